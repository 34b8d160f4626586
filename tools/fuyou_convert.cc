// fuyou-convert: moves data into and out of the engine's formats.
//   text      plain-text files -> byte-level token shards
//   tokenize  text or JSON Lines -> token shards (and loss masks) with a tokenizer.json
//   decode    token shard -> text, for inspection
//   from-hf   Hugging Face model directory -> engine checkpoint
//   to-hf     engine checkpoint or fuyou-train run directory -> Hugging Face directory
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>

#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/hf_checkpoint.h"
#include "fuyou/log.h"
#include "fuyou/partial_outputs.h"
#include "fuyou/sizes.h"
#include "fuyou/stop.h"
#include "fuyou/tokenizer.h"
#include "tools/tool_errors.h"

namespace {

// "tensor 12/148 transformer.h.5.mlp.c_fc.weight" on stderr: one line that rewrites itself
// on a terminal, one line per tensor otherwise (logs stay readable). A stop asked meanwhile
// ends the conversion here, between tensors: its staging directory is removed on the way out.
std::function<void(size_t, size_t, const std::string&)> progress_printer(
    const fuyou::StopSignals& stop) {
  const bool tty = ::isatty(2);
  return [tty, &stop](size_t i, size_t n, const std::string& name) {
    stop.check("before converting every tensor (nothing was written)");
    if (tty) {
      std::fprintf(stderr, "\rtensor %zu/%zu %-60s", i + 1, n, name.c_str());
      if (i + 1 == n) std::fprintf(stderr, "\n");
    } else {
      std::fprintf(stderr, "tensor %zu/%zu %s\n", i + 1, n, name.c_str());
    }
    std::fflush(stderr);
  };
}

fuyou::StDtype parse_dtype(const std::string& s) {
  if (s == "f32") return fuyou::StDtype::kF32;
  if (s == "bf16") return fuyou::StDtype::kBF16;
  if (s == "f16") return fuyou::StDtype::kF16;
  throw fuyou::ConfigError("--dtype '" + s + "': expected f32, bf16 or f16");
}

void report(const fuyou::ConvertResult& r, const std::string& out) {
  std::string files;
  for (const auto& f : r.files) files += (files.empty() ? "" : ", ") + f;
  std::string copied;
  for (const auto& f : r.copied) copied += (copied.empty() ? "" : ", ") + f;
  spdlog::info("{} tensors ({}) -> {}: {}", r.tensors, fuyou::format_size(r.bytes), out, files);
  if (!copied.empty()) spdlog::info("copied through: {}", copied);
  spdlog::info(
      "model: n_layer {} n_head {} d_model {} d_ff {} vocab_size {} seq_len {}; peak RSS {}",
      r.model.n_layer, r.model.n_head, r.model.d_model, r.model.d_ff, r.model.vocab_size,
      r.model.seq_len, fuyou::format_size(fuyou::peak_rss_bytes()));
}

// Conversations: the template from tokenizer_config.json writes their special tokens; a given
// --bos-token / --eos-token ('none': none) is what the template is expected to write.
void resolve_chat_special_tokens(const std::string& tokenizer, bool bos_given, bool eos_given,
                                 fuyou::DatasetOptions* o) {
  const std::string config =
      (std::filesystem::path(tokenizer).parent_path() / "tokenizer_config.json").string();
  if (std::filesystem::exists(config)) {
    const fuyou::SpecialTokens st = fuyou::read_special_tokens(config);
    fuyou::use_chat_template(st, config, o);
    spdlog::info("chat template: {} ({} characters)", config, st.chat_template.size());
  }
  auto expected = [](bool given, std::string* option) -> std::optional<std::string> {
    std::string v = std::move(*option);
    option->clear();
    if (!given) return std::nullopt;
    return v == "none" ? std::string() : v;
  };
  o->chat_bos = expected(bos_given, &o->bos_token);
  o->chat_eos = expected(eos_given, &o->eos_token);
  auto said = [](const std::optional<std::string>& e, const char* option) {
    if (!e) return std::string();
    return fmt::format("; {} {} checked on every conversation", option,
                       e->empty() ? "none" : "'" + *e + "'");
  };
  spdlog::info("bos, eos: those the chat template writes, no other added{}{}",
               said(o->chat_bos, "--bos-token"), said(o->chat_eos, "--eos-token"));
}

// BOS / EOS of `fuyou-convert tokenize`: given ones as they are ('none': none), else from
// tokenizer_config.json beside tokenizer.json: its bos_token where it adds one (add_bos_token,
// as transformers' encoding does), its eos_token after every JSON Lines record (so a fine-tune
// learns to stop). Conversations take the chat template and its tokens from there, and no
// BOS / EOS beyond what the template writes: a given --bos-token / --eos-token says what the
// template writes, checked on every conversation. Each choice is logged.
void resolve_special_tokens(const std::string& tokenizer, bool bos_given, bool eos_given,
                            fuyou::DatasetOptions* o) {
  if (!o->chat_field.empty())
    return resolve_chat_special_tokens(tokenizer, bos_given, eos_given, o);
  const std::string config =
      (std::filesystem::path(tokenizer).parent_path() / "tokenizer_config.json").string();
  const bool records = !o->jsonl_field.empty() || !o->prompt_field.empty();
  if (std::filesystem::exists(config)) {
    const fuyou::SpecialTokens st = fuyou::read_special_tokens(config);
    if (!bos_given && st.add_bos) o->bos_token = st.bos;
    if (!eos_given && records) o->eos_token = st.eos;
  }
  if (o->bos_token == "none") o->bos_token.clear();
  if (o->eos_token == "none") o->eos_token.clear();
  const char* from =
      std::filesystem::exists(config) ? "tokenizer_config.json" : "no tokenizer_config.json";
  spdlog::info(
      "bos: {} ({}); eos: {} ({})", o->bos_token.empty() ? "none" : "'" + o->bos_token + "'",
      bos_given ? "--bos-token" : from, o->eos_token.empty() ? "none" : "'" + o->eos_token + "'",
      eos_given ? "--eos-token" : from);
}

// Prints a shard as text, or one token per line with --ids.
void decode_shard(const std::string& tokenizer, const std::string& shard, int64_t offset,
                  int64_t count, bool ids) {
  fuyou::Tokenizer tok = fuyou::Tokenizer::from_file(tokenizer);
  fuyou::TokenShard s = fuyou::read_token_shard(shard);
  if (s.vocab_size > tok.vocab_size())
    spdlog::warn("{}: vocab size {} is larger than the tokenizer's {}", shard, s.vocab_size,
                 tok.vocab_size());
  std::vector<uint8_t> mask;
  std::string mask_path = std::filesystem::path(shard).replace_extension(".mask").string();
  if (std::filesystem::exists(mask_path)) mask = fuyou::read_loss_mask(mask_path).mask;
  const size_t b = std::min<size_t>(static_cast<size_t>(offset), s.tokens.size());
  const size_t e =
      count < 0 ? s.tokens.size() : std::min(s.tokens.size(), b + static_cast<size_t>(count));
  std::vector<int32_t> slice(s.tokens.begin() + b, s.tokens.begin() + e);
  if (!ids) {
    std::string text = tok.decode(slice);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fputc('\n', stdout);
    return;
  }
  for (size_t i = b; i < e; ++i) {
    std::string piece = tok.id_to_token(s.tokens[i]);
    if (mask.size() == s.tokens.size())
      std::printf("%zu\t%d\t%d\t%s\n", i, s.tokens[i], mask[i], piece.c_str());
    else
      std::printf("%zu\t%d\t%s\n", i, s.tokens[i], piece.c_str());
  }
}

// `text`: byte-level shards, no tokenizer.
struct TextArgs {
  std::vector<std::string> inputs;
  std::string out_dir;
  double val_fraction = 0.05;
};

CLI::App* add_text_command(CLI::App& app, TextArgs& a) {
  auto* text = app.add_subcommand(
      "text", "Tokenize plain-text files or directories into byte-level token shards");
  text->add_option("inputs", a.inputs, "Text files or directories")->required();
  text->add_option("--out", a.out_dir, "Output directory (train.tok, val.tok)")->required();
  text->add_option("--val-fraction", a.val_fraction, "Share of each file held out for validation")
      ->check(CLI::Range(0.0, 0.99));
  return text;
}

void convert_text(const TextArgs& a) {
  auto r = fuyou::build_text_shards(a.inputs, a.out_dir, a.val_fraction);
  spdlog::info("{} files ({} skipped): {} train tokens -> {}, {} validation tokens -> {}", r.files,
               r.skipped, r.train_tokens, r.train_path, r.val_tokens, r.val_path);
}

// `tokenize`: shards through a tokenizer.json. The --bos-token and --eos-token options are
// kept: whether each was given decides if tokenizer_config.json's token is used instead
// (resolve_special_tokens).
struct TokenizeArgs {
  std::string tokenizer;
  std::vector<std::string> inputs;
  std::string out_dir;
  fuyou::DatasetOptions opts;
  CLI::Option* bos = nullptr;
  CLI::Option* eos = nullptr;
};

CLI::App* add_tokenize_command(CLI::App& app, TokenizeArgs& a) {
  auto* tokenize = app.add_subcommand(
      "tokenize", "Tokenize text or JSON Lines with a tokenizer.json into token shards");
  tokenize->add_option("--tokenizer", a.tokenizer, "Hugging Face tokenizer.json")->required();
  tokenize->add_option("inputs", a.inputs, "Text or .jsonl files, or directories")->required();
  tokenize
      ->add_option("--out", a.out_dir, "Output directory (train.tok, val.tok, and .mask for pairs)")
      ->required();
  tokenize->add_option("--jsonl-field", a.opts.jsonl_field,
                       "Inputs are JSON Lines; tokenize this string field");
  tokenize->add_option("--prompt-field", a.opts.prompt_field,
                       "JSON Lines prompt field (no loss on it)");
  tokenize->add_option("--completion-field", a.opts.completion_field,
                       "JSON Lines completion field (loss on it)");
  tokenize->add_option(
      "--chat-field", a.opts.chat_field,
      "JSON Lines field holding a conversation (list of {role, content}), rendered "
      "with tokenizer_config.json's chat_template; loss on the assistant turns");
  tokenize
      ->add_option("--chat-format", a.opts.chat_format,
                   "How --chat-field's turns are written: openai ({role, content}) or sharegpt "
                   "({from, value}: human, gpt, system, tool/observation)")
      ->check(CLI::IsMember({"openai", "sharegpt"}));
  tokenize->add_option("--tools-field", a.opts.tools_field,
                       "JSON Lines field of a conversation's function definitions, passed to the "
                       "chat template as `tools` (absent or null: none)");
  tokenize->add_option("--chat-template-kwargs", a.opts.chat_template_kwargs,
                       "More variables for the chat template, a JSON object, e.g. "
                       "'{\"enable_thinking\": false}'");
  tokenize
      ->add_option("--val-fraction", a.opts.val_fraction,
                   "Share held out: the end of each text file, "
                   "the last records of each JSONL file")
      ->check(CLI::Range(0.0, 0.99));
  a.bos = tokenize->add_option("--bos-token", a.opts.bos_token,
                               "Token put before every document/record, e.g. '<s>' ('none': no "
                               "BOS; default: tokenizer_config.json's when it adds one); with "
                               "--chat-field, the one the chat template writes (checked)");
  a.eos = tokenize->add_option("--eos-token", a.opts.eos_token,
                               "Token put after every JSON Lines record, e.g. '<|endoftext|>' "
                               "('none': no EOS; default: tokenizer_config.json's eos_token); "
                               "with --chat-field, the one the chat template writes (checked)");
  return tokenize;
}

void tokenize_dataset(TokenizeArgs& a) {
  fuyou::Tokenizer tok = fuyou::Tokenizer::from_file(a.tokenizer);
  spdlog::info("{}: {}", a.tokenizer, tok.describe());
  resolve_special_tokens(a.tokenizer, a.bos->count() > 0, a.eos->count() > 0, &a.opts);
  auto r = fuyou::build_tokenized_dataset(tok, a.inputs, a.out_dir, a.opts);
  spdlog::info(
      "{} files, {} documents ({} skipped): {} train tokens -> {}, {} validation tokens -> {}",
      r.files, r.documents, r.skipped, r.train_tokens, r.train_path, r.val_tokens, r.val_path);
  if (!r.train_mask_path.empty())
    spdlog::info("loss masks (1 = completion token): {}, {}", r.train_mask_path, r.val_mask_path);
  if (!r.train_records_path.empty())
    spdlog::info("record indexes (records stay whole in training): {}, {}", r.train_records_path,
                 r.val_records_path);
}

struct DecodeArgs {
  std::string tokenizer, shard;
  int64_t count = 200, offset = 0;
  bool ids = false;
};

CLI::App* add_decode_command(CLI::App& app, DecodeArgs& a) {
  auto* decode =
      app.add_subcommand("decode", "Print a token shard as text (or token by token with --ids)");
  decode->add_option("--tokenizer", a.tokenizer, "Hugging Face tokenizer.json")->required();
  decode->add_option("shard", a.shard, "Token shard (.tok)")->required();
  decode->add_option("--count", a.count, "Tokens to show (-1: all)");
  decode->add_option("--offset", a.offset, "First token to show")->check(CLI::NonNegativeNumber);
  decode->add_flag("--ids", a.ids, "One token per line: index, id, [mask,] token string");
  return decode;
}

// `from-hf` and `to-hf`: checkpoints converted tensor by tensor.
struct HfArgs {
  std::string src, out_dir, max_shard = "5GB", dtype;
};

CLI::App* add_from_hf_command(CLI::App& app, HfArgs& a) {
  auto* from_hf = app.add_subcommand(
      "from-hf", "Convert a Hugging Face model directory into an engine checkpoint");
  from_hf
      ->add_option("hf_dir", a.src,
                   "Directory with config.json and model.safetensors (or shards + index)")
      ->required();
  from_hf->add_option("--out", a.out_dir, "New engine checkpoint directory")->required();
  from_hf->add_option("--max-shard-size", a.max_shard,
                      "Largest output file before sharding (e.g. 5GB, 500MiB)");
  return from_hf;
}

CLI::App* add_to_hf_command(CLI::App& app, HfArgs& a) {
  auto* to_hf = app.add_subcommand(
      "to-hf", "Write an engine checkpoint or fuyou-train run as a Hugging Face directory");
  to_hf
      ->add_option("checkpoint", a.src,
                   "Engine checkpoint directory, run directory or model.safetensors")
      ->required();
  to_hf->add_option("--out", a.out_dir, "New Hugging Face model directory")->required();
  to_hf
      ->add_option("--dtype", a.dtype,
                   "Tensor dtype written: f32, bf16 or f16 (default: the base model's torch_dtype, "
                   "f32 without one)")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}));
  to_hf->add_option("--max-shard-size", a.max_shard,
                    "Largest output file before sharding (e.g. 2GB)");
  return to_hf;
}

// A stop during the conversion ends it between tensors, leaving nothing behind.
void convert_checkpoint(const HfArgs& a, bool from_hf, fuyou::StopSignals& stop) {
  fuyou::ConvertOptions opts;
  opts.max_shard_bytes = fuyou::parse_size(a.max_shard, "--max-shard-size");
  if (opts.max_shard_bytes == 0) throw fuyou::ConfigError("--max-shard-size must be positive");
  opts.progress = progress_printer(stop);
  stop.set_graceful("stopping before the next tensor; nothing is written");
  // What an earlier conversion to the same output left when it was killed before its rename.
  fuyou::clean_partial_outputs(a.out_dir);
  if (from_hf) {
    report(fuyou::convert_hf_to_engine(a.src, a.out_dir, opts), a.out_dir);
    return;
  }
  if (!a.dtype.empty()) opts.dtype = parse_dtype(a.dtype);
  fuyou::ConvertResult r = fuyou::convert_engine_to_hf(a.src, a.out_dir, opts);
  report(r, a.out_dir);
  spdlog::info("dtype {} ({})", fuyou::st_dtype_name(r.dtype), r.dtype_origin);
  for (const auto& f : r.written) spdlog::info("written from config.json's token ids: {}", f);
}

}  // namespace

int main(int argc, char** argv) {
  // First, before any thread exists (include/fuyou/stop.h). A signal ends the process at once
  // except during from-hf and to-hf, which stop between tensors and leave nothing behind.
  fuyou::StopSignals stop;
  CLI::App app{"fuyou-convert: token shards and Hugging Face checkpoints in and out"};
  app.require_subcommand(1);
  TextArgs text_args;
  auto* text = add_text_command(app, text_args);
  TokenizeArgs tokenize_args;
  auto* tokenize = add_tokenize_command(app, tokenize_args);
  DecodeArgs decode_args;
  auto* decode = add_decode_command(app, decode_args);
  HfArgs hf_args;
  auto* from_hf = add_from_hf_command(app, hf_args);
  add_to_hf_command(app, hf_args);
  CLI11_PARSE(app, argc, argv);
  fuyou::init_logging(false);
  try {
    if (*text) {
      convert_text(text_args);
    } else if (*tokenize) {
      tokenize_dataset(tokenize_args);
    } else if (*decode) {
      decode_shard(decode_args.tokenizer, decode_args.shard, decode_args.offset, decode_args.count,
                   decode_args.ids);
    } else {
      convert_checkpoint(hf_args, from_hf->parsed(), stop);
    }
  } catch (...) {
    return fuyou::tools::report_failure(
        "convert on a machine with more memory, or report the file that "
        "needed it");
  }
  if (stop.requested()) return 128 + stop.requested();  // it arrived after the last tensor
  return 0;
}
