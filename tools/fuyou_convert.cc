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

// Prints a shard as text, or one token per line with --ids.
// BOS / EOS of `fuyou-convert tokenize`: given ones as they are ('none': none), else from
// tokenizer_config.json beside tokenizer.json: its bos_token where it adds one (add_bos_token,
// as transformers' encoding does), its eos_token after every JSON Lines record (so a fine-tune
// learns to stop). Conversations take the chat template and its tokens from there, and no
// BOS / EOS beyond what the template writes. Each choice is logged.
void resolve_special_tokens(const std::string& tokenizer, bool bos_given, bool eos_given,
                            fuyou::DatasetOptions* o) {
  const std::string config =
      (std::filesystem::path(tokenizer).parent_path() / "tokenizer_config.json").string();
  const bool chat = !o->chat_field.empty();
  const bool records = !o->jsonl_field.empty() || !o->prompt_field.empty();
  if (std::filesystem::exists(config)) {
    const fuyou::SpecialTokens st = fuyou::read_special_tokens(config);
    if (!bos_given && st.add_bos && !chat) o->bos_token = st.bos;
    if (!eos_given && records) o->eos_token = st.eos;
    if (chat) {
      fuyou::use_chat_template(st, config, o);
      spdlog::info("chat template: {} ({} characters)", config, st.chat_template.size());
    }
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

}  // namespace

int main(int argc, char** argv) {
  // First, before any thread exists (include/fuyou/stop.h). A signal ends the process at once
  // except during from-hf and to-hf, which stop between tensors and leave nothing behind.
  fuyou::StopSignals stop;
  CLI::App app{"fuyou-convert: token shards and Hugging Face checkpoints in and out"};
  app.require_subcommand(1);

  auto* text = app.add_subcommand(
      "text", "Tokenize plain-text files or directories into byte-level token shards");
  std::vector<std::string> inputs;
  std::string out_dir;
  double val_fraction = 0.05;
  text->add_option("inputs", inputs, "Text files or directories")->required();
  text->add_option("--out", out_dir, "Output directory (train.tok, val.tok)")->required();
  text->add_option("--val-fraction", val_fraction, "Share of each file held out for validation")
      ->check(CLI::Range(0.0, 0.99));

  auto* tokenize = app.add_subcommand(
      "tokenize", "Tokenize text or JSON Lines with a tokenizer.json into token shards");
  std::string tokenizer;
  fuyou::DatasetOptions dopts;
  tokenize->add_option("--tokenizer", tokenizer, "Hugging Face tokenizer.json")->required();
  tokenize->add_option("inputs", inputs, "Text or .jsonl files, or directories")->required();
  tokenize
      ->add_option("--out", out_dir, "Output directory (train.tok, val.tok, and .mask for pairs)")
      ->required();
  tokenize->add_option("--jsonl-field", dopts.jsonl_field,
                       "Inputs are JSON Lines; tokenize this string field");
  tokenize->add_option("--prompt-field", dopts.prompt_field,
                       "JSON Lines prompt field (no loss on it)");
  tokenize->add_option("--completion-field", dopts.completion_field,
                       "JSON Lines completion field (loss on it)");
  tokenize->add_option(
      "--chat-field", dopts.chat_field,
      "JSON Lines field holding a conversation (list of {role, content}), rendered "
      "with tokenizer_config.json's chat_template; loss on the assistant turns");
  tokenize
      ->add_option("--val-fraction", dopts.val_fraction,
                   "Share held out: the end of each text file, "
                   "the last records of each JSONL file")
      ->check(CLI::Range(0.0, 0.99));
  auto* bos_opt =
      tokenize->add_option("--bos-token", dopts.bos_token,
                           "Token put before every document/record, e.g. '<s>' ('none': no "
                           "BOS; default: tokenizer_config.json's when it adds one)");
  auto* eos_opt =
      tokenize->add_option("--eos-token", dopts.eos_token,
                           "Token put after every JSON Lines record, e.g. '<|endoftext|>' "
                           "('none': no EOS; default: tokenizer_config.json's eos_token)");

  auto* decode =
      app.add_subcommand("decode", "Print a token shard as text (or token by token with --ids)");
  std::string shard;
  int64_t count = 200, offset = 0;
  bool ids = false;
  decode->add_option("--tokenizer", tokenizer, "Hugging Face tokenizer.json")->required();
  decode->add_option("shard", shard, "Token shard (.tok)")->required();
  decode->add_option("--count", count, "Tokens to show (-1: all)");
  decode->add_option("--offset", offset, "First token to show")->check(CLI::NonNegativeNumber);
  decode->add_flag("--ids", ids, "One token per line: index, id, [mask,] token string");

  auto* from_hf = app.add_subcommand(
      "from-hf", "Convert a Hugging Face model directory into an engine checkpoint");
  std::string src, max_shard = "5GB", dtype;
  from_hf
      ->add_option("hf_dir", src,
                   "Directory with config.json and model.safetensors (or shards + index)")
      ->required();
  from_hf->add_option("--out", out_dir, "New engine checkpoint directory")->required();
  from_hf->add_option("--max-shard-size", max_shard,
                      "Largest output file before sharding (e.g. 5GB, 500MiB)");

  auto* to_hf = app.add_subcommand(
      "to-hf", "Write an engine checkpoint or fuyou-train run as a Hugging Face directory");
  to_hf
      ->add_option("checkpoint", src,
                   "Engine checkpoint directory, run directory or model.safetensors")
      ->required();
  to_hf->add_option("--out", out_dir, "New Hugging Face model directory")->required();
  to_hf
      ->add_option("--dtype", dtype,
                   "Tensor dtype written: f32, bf16 or f16 (default: the base model's torch_dtype, "
                   "f32 without one)")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}));
  to_hf->add_option("--max-shard-size", max_shard,
                    "Largest output file before sharding (e.g. 2GB)");

  CLI11_PARSE(app, argc, argv);
  fuyou::init_logging(false);
  try {
    if (*text) {
      auto r = fuyou::build_text_shards(inputs, out_dir, val_fraction);
      spdlog::info("{} files ({} skipped): {} train tokens -> {}, {} validation tokens -> {}",
                   r.files, r.skipped, r.train_tokens, r.train_path, r.val_tokens, r.val_path);
    } else if (*tokenize) {
      fuyou::Tokenizer tok = fuyou::Tokenizer::from_file(tokenizer);
      spdlog::info("{}: {}", tokenizer, tok.describe());
      resolve_special_tokens(tokenizer, bos_opt->count() > 0, eos_opt->count() > 0, &dopts);
      auto r = fuyou::build_tokenized_dataset(tok, inputs, out_dir, dopts);
      spdlog::info(
          "{} files, {} documents ({} skipped): {} train tokens -> {}, {} validation tokens -> {}",
          r.files, r.documents, r.skipped, r.train_tokens, r.train_path, r.val_tokens, r.val_path);
      if (!r.train_mask_path.empty())
        spdlog::info("loss masks (1 = completion token): {}, {}", r.train_mask_path,
                     r.val_mask_path);
      if (!r.train_records_path.empty())
        spdlog::info("record indexes (records stay whole in training): {}, {}",
                     r.train_records_path, r.val_records_path);
    } else if (*decode) {
      decode_shard(tokenizer, shard, offset, count, ids);
    } else {
      fuyou::ConvertOptions opts;
      opts.max_shard_bytes = fuyou::parse_size(max_shard, "--max-shard-size");
      if (opts.max_shard_bytes == 0) throw fuyou::ConfigError("--max-shard-size must be positive");
      opts.progress = progress_printer(stop);
      stop.set_graceful("stopping before the next tensor; nothing is written");
      if (*from_hf) {
        report(fuyou::convert_hf_to_engine(src, out_dir, opts), out_dir);
      } else {
        if (!dtype.empty()) opts.dtype = parse_dtype(dtype);
        fuyou::ConvertResult r = fuyou::convert_engine_to_hf(src, out_dir, opts);
        report(r, out_dir);
        spdlog::info("dtype {} ({})", fuyou::st_dtype_name(r.dtype), r.dtype_origin);
        for (const auto& f : r.written) spdlog::info("written from config.json's token ids: {}", f);
      }
    }
  } catch (...) {
    return fuyou::tools::report_failure(
        "convert on a machine with more memory, or report the file that "
        "needed it");
  }
  if (stop.requested()) return 128 + stop.requested();  // it arrived after the last tensor
  return 0;
}
