// fuyou-generate: text from a model with a key/value cache, greedy or sampled, on the CPU or
// CUDA backend. The model is a fuyou-train run directory, a training or engine checkpoint, or a
// Hugging Face model directory; its tokenizer comes with it (docs/generate.md).
#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "fuyou/backend_select.h"
#include "fuyou/config.h"
#include "fuyou/decoder.h"
#include "fuyou/error.h"
#include "fuyou/generate.h"
#include "fuyou/log.h"
#include "fuyou/sizes.h"
#include "fuyou/stop.h"
#include "tools/tool_errors.h"

namespace {

// Prints the text of the tokens generated so far as it grows. A token may end inside a
// character (byte fallback, byte-level pieces): the decoder then shows U+FFFD, which is held
// back until a later token completes the character.
class TextStream {
 public:
  explicit TextStream(const fuyou::TextCodec& codec) : codec_(codec) {}
  void add(int32_t id) {
    ids_.push_back(id);
    std::string text = codec_.decode(ids_);
    size_t end = text.size();
    static const std::string kReplacement = "\xEF\xBF\xBD";
    while (end >= 3 && text.compare(end - 3, 3, kReplacement) == 0) end -= 3;
    if (end > printed_ && text.compare(0, printed_, shown_, 0, printed_) == 0) {
      std::fwrite(text.data() + printed_, 1, end - printed_, stdout);
      std::fflush(stdout);
      shown_ = text.substr(0, end);
      printed_ = end;
    }
  }
  void finish() {
    std::string text = codec_.decode(ids_);
    if (text.size() > printed_ && text.compare(0, printed_, shown_, 0, printed_) == 0)
      std::fwrite(text.data() + printed_, 1, text.size() - printed_, stdout);
    std::fputc('\n', stdout);
  }

 private:
  const fuyou::TextCodec& codec_;
  std::vector<int32_t> ids_;
  std::string shown_;
  size_t printed_ = 0;
};

// One prompt of a batch (--input): its ids, and the record it came from.
struct BatchItem {
  nlohmann::ordered_json record;
  std::vector<int32_t> ids;
};

// The fields fuyou-generate adds to each output record; an input record may not have them.
const char* const kOutputFields[] = {"completion", "completion_ids", "prompt_ids", "stopped"};

// --input FILE: one JSON object a line, {"prompt": TEXT} (with --chat a user message, after
// --system when given) or {"messages": [...]} (a conversation, earlier turns and any system
// message included, rendered with the chat template and the generation prompt).
std::vector<BatchItem> read_batch(const std::string& path, const fuyou::TextCodec& codec, bool chat,
                                  const std::string& system) {
  std::ifstream in(path);
  if (!in) throw fuyou::IoError(fuyou::str(path, ": cannot open"));
  std::vector<BatchItem> items;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fuyou::str(path, ":", n);
    BatchItem item;
    item.record = nlohmann::ordered_json::parse(line, nullptr, false);
    if (item.record.is_discarded() || !item.record.is_object())
      throw fuyou::IoError(fuyou::str(where, ": expected a JSON object"));
    for (const char* f : kOutputFields)
      if (item.record.contains(f))
        throw fuyou::IoError(
            fuyou::str(where, ": field '", f, "' is one fuyou-generate writes; rename it"));
    const bool has_prompt = item.record.contains("prompt"),
               has_messages = item.record.contains("messages");
    if (has_prompt == has_messages)
      throw fuyou::IoError(fuyou::str(where,
                                      ": give either 'prompt' (a string) or 'messages' "
                                      "(a list of messages), not ",
                                      has_prompt ? "both" : "neither"));
    if (has_messages) {
      item.ids = codec.encode_chat_messages(item.record["messages"].dump(), where);
    } else {
      if (!item.record["prompt"].is_string())
        throw fuyou::IoError(fuyou::str(where, ": 'prompt' must be a string"));
      const std::string text = item.record["prompt"].get<std::string>();
      if (!chat) {
        item.ids = codec.encode_prompt(text);
      } else {
        nlohmann::json messages = nlohmann::json::array();
        if (!system.empty()) messages.push_back({{"role", "system"}, {"content", system}});
        messages.push_back({{"role", "user"}, {"content", text}});
        item.ids = codec.encode_chat_messages(messages.dump(), where);
      }
    }
    items.push_back(std::move(item));
  }
  if (items.empty()) throw fuyou::IoError(fuyou::str(path, ": no prompts"));
  return items;
}

// Flushes `path` (a file, or a directory after a rename in it) to the disk.
void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0));
  if (fd < 0 || ::fsync(fd) != 0) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    throw fuyou::IoError(fuyou::str(path, ": fsync failed: ", std::strerror(err)));
  }
  ::close(fd);
}

}  // namespace

int main(int argc, char** argv) {
  // Before any thread exists: SIGINT and SIGTERM are received on StopSignals' own thread, which
  // removes --output's partial file and ends the process (docs/robustness.md, "Stop signals").
  fuyou::StopSignals stop;
  CLI::App app{"fuyou-generate: text from a run, a checkpoint or a Hugging Face model"};
  std::string model_path, prompt, tokenizer, input, output, system, chat_kwargs;
  std::vector<std::string> sets;
  fuyou::GenerateOptions g;
  std::string backend = "auto", device_tensors = "fp32", precision = "fp32", stream = "auto";
  bool chat = false, ignore_eos = false, json_out = false, verbose = false;
  app.add_option("--model", model_path,
                 "fuyou-train run directory, training or engine checkpoint, or Hugging Face model "
                 "directory")
      ->required();
  CLI::Option* prompt_opt = app.add_option("--prompt", prompt, "The text to continue");
  CLI::Option* input_opt =
      app.add_option("--input", input,
                     "JSON Lines of prompts, one model load for all: {\"prompt\": TEXT} or "
                     "{\"messages\": [...]} a line")
          ->excludes(prompt_opt);
  app.add_option("--output", output,
                 "With --input: JSON Lines, each input record with completion, completion_ids, "
                 "prompt_ids and stopped")
      ->needs(input_opt);
  app.add_option("--system", system, "With --chat: a system message before the prompt");
  app.add_option("--chat-template-kwargs", chat_kwargs,
                 "JSON object of more chat template variables, e.g. '{\"enable_thinking\": "
                 "false}'; for a run directory or checkpoint, instead of its config.yaml's "
                 "data.chat_template_kwargs");
  app.add_option("--max-new-tokens", g.max_new_tokens, "Tokens to generate at most")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--temperature", g.sampling.temperature, "0: greedy (default); above 0: sample")
      ->check(CLI::Range(0.0, 100.0));
  app.add_option("--top-p", g.sampling.top_p,
                 "Nucleus sampling: keep the most likely tokens up to this mass")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", g.seed, "Seed of the sampling");
  app.add_flag("--ignore-eos", ignore_eos, "Do not stop at the model's end-of-sequence token");
  app.add_flag("--chat", chat,
               "The prompt is a user message: render it with the model's chat template "
               "(tokenizer_config.json's chat_template) and the generation prompt");
  app.add_option("--stream-layers", stream,
                 "auto: stream the layers through the device when the model does not fit it; "
                 "always; never")
      ->check(CLI::IsMember({"auto", "always", "never"}));
  app.add_option("--tokenizer", tokenizer, "tokenizer.json to use instead of the model's");
  app.add_option("--backend", backend, "cpu, cuda or auto")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  app.add_option("--device-tensors", device_tensors,
                 "Weights and activations on the device: fp32 or bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--precision", precision, "GEMM inputs: fp32 (default), bf16 or auto")
      ->check(CLI::IsMember({"fp32", "bf16", "auto"}));
  app.add_option("--set", sets,
                 "Other runtime keys: runtime.threads=N, offload.device_memory=SIZE");
  app.add_flag("--json", json_out,
               "Print one JSON object (ids, text, timings) instead of the text");
  app.add_flag("-v,--verbose", verbose, "Debug logging");
  CLI11_PARSE(app, argc, argv);
  fuyou::init_logging(verbose);
  if (prompt_opt->count() == 0 && input_opt->count() == 0) {
    std::fprintf(stderr, "fuyou-generate: give --prompt TEXT or --input FILE\n");
    return 2;
  }
  if (input_opt->count() && output.empty()) {
    std::fprintf(stderr, "fuyou-generate: --input needs --output FILE\n");
    return 2;
  }
  if (!system.empty() && !chat) {
    std::fprintf(stderr, "fuyou-generate: --system needs --chat\n");
    return 2;
  }
  try {
    std::vector<std::string> overrides = {"runtime.backend=" + backend,
                                          "runtime.device_tensors=" + device_tensors,
                                          "runtime.precision=" + precision};
    overrides.insert(overrides.end(), sets.begin(), sets.end());
    const fuyou::Config cfg = fuyou::parse_config("", "fuyou-generate", overrides);
    g.stop_at_eos = !ignore_eos;

    fuyou::GenerationModel m = fuyou::load_generation_model(model_path);
    fuyou::TextCodec codec = fuyou::TextCodec::for_model(m.files, m.model, tokenizer);
    if (!chat_kwargs.empty()) codec.set_chat_template_kwargs(chat_kwargs);
    if (chat)
      spdlog::info("chat template variables: {}",
                   !chat_kwargs.empty() ? chat_kwargs + " (--chat-template-kwargs)"
                   : !m.files.chat_template_kwargs.empty()
                       ? m.files.chat_template_kwargs + " (the run's data.chat_template_kwargs)"
                       : std::string("none"));
    spdlog::info("model: {} ({}), {} {} layers, d_model {}, vocab {}, context {}", model_path,
                 m.kind, m.model.family, m.model.n_layer, m.model.d_model, m.model.vocab_size,
                 m.files.context);
    spdlog::info("tokenizer: {}", codec.describe());
    std::vector<BatchItem> batch;
    if (!input.empty()) {
      batch = read_batch(input, codec, chat, system);
    } else {
      batch.resize(1);
      if (!chat) {
        batch[0].ids = codec.encode_prompt(prompt);
      } else {
        nlohmann::json messages = nlohmann::json::array();
        if (!system.empty()) messages.push_back({{"role", "system"}, {"content", system}});
        messages.push_back({{"role", "user"}, {"content", prompt}});
        batch[0].ids = codec.encode_chat_messages(messages.dump(), "--chat");
      }
    }
    size_t longest = 0;
    for (const BatchItem& b : batch) longest = std::max(longest, b.ids.size());
    const int capacity =
        std::min<int64_t>(m.files.context, static_cast<int64_t>(longest) + g.max_new_tokens);
    std::string why;
    std::unique_ptr<fuyou::Backend> be = fuyou::make_backend(cfg, &why);
    spdlog::info("{}", why);
    const fuyou::LayerStreaming streaming = stream == "always"  ? fuyou::LayerStreaming::kAlways
                                            : stream == "never" ? fuyou::LayerStreaming::kNever
                                                                : fuyou::LayerStreaming::kAuto;
    fuyou::GptDecoder decoder(m.model, *be, capacity, streaming);
    decoder.set_params(m.params.data());
    m.params = {};
    if (decoder.streaming())
      spdlog::info(
          "layers streamed from host memory ({}): {} copied per step (the prompt's chunk or one "
          "generated token)",
          streaming == fuyou::LayerStreaming::kAlways
              ? "--stream-layers always"
              : "the model does not fit the device beside its key/value cache",
          fuyou::format_size(decoder.streamed_bytes_per_step()));

    if (!input.empty()) {
      // Every prompt from an empty cache with the same seed: each record's completion is the
      // one a run with that prompt alone gives. Written beside OUTPUT and renamed when complete.
      const std::string partial = output + ".partial";
      stop.set_cleanup_paths({partial});  // a stop signal leaves no partial output behind
      std::ofstream out(partial, std::ios::trunc);
      if (!out) throw fuyou::IoError(fuyou::str(partial, ": cannot create"));
      size_t new_tokens = 0;
      double generate_s = 0;
      for (size_t i = 0; i < batch.size(); ++i) {
        const fuyou::GenerateResult r =
            fuyou::generate_tokens(decoder, batch[i].ids, codec.stop_ids(), g);
        nlohmann::ordered_json rec = batch[i].record;
        rec["completion"] = codec.decode(r.ids);
        rec["completion_ids"] = r.ids;
        rec["prompt_ids"] = r.prompt_ids;
        rec["stopped"] = r.stopped;
        out << rec.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
        new_tokens += r.ids.size();
        generate_s += r.prompt_s + r.generate_s;
        spdlog::info("{}/{}: prompt {} tokens, {} new tokens{}", i + 1, batch.size(),
                     r.prompt_ids.size(), r.ids.size(), r.stopped ? ", stopped" : "");
      }
      out.close();
      if (!out) throw fuyou::IoError(fuyou::str(partial, ": write failed"));
      // On the disk before the rename, so that OUTPUT is never a name for incomplete bytes.
      fsync_path(partial, false);
      std::filesystem::rename(partial, output);
      const std::filesystem::path parent = std::filesystem::absolute(output).parent_path();
      fsync_path(parent.string(), true);
      stop.set_cleanup_paths({});
      spdlog::info("{} prompts, {} new tokens in {:.3f} s; written to {}", batch.size(), new_tokens,
                   generate_s, output);
      return 0;
    }
    const std::vector<int32_t>& ids = batch[0].ids;
    TextStream stream(codec);
    if (!json_out) g.on_token = [&](int32_t id) { stream.add(id); };
    fuyou::GenerateResult r = fuyou::generate_tokens(decoder, ids, codec.stop_ids(), g);
    if (!json_out) stream.finish();
    const double tps = r.generate_s > 0 ? r.ids.size() / r.generate_s : 0;
    const fuyou::DecoderStreamStats& ss = decoder.stream_stats();
    if (decoder.streaming())
      spdlog::info(
          "streaming: {} copied in {:.3f} s ({:.2f} GB/s while copying); compute waited {:.3f} s "
          "for weights",
          fuyou::format_size(ss.bytes), ss.copy_s, ss.copy_s > 0 ? ss.bytes / ss.copy_s / 1e9 : 0,
          ss.wait_s);
    spdlog::info("prompt {} tokens in {:.3f} s; {} new tokens in {:.3f} s ({:.1f} tokens/s){}",
                 ids.size(), r.prompt_s, r.ids.size(), r.generate_s, tps,
                 r.stopped ? "; stopped at the end-of-sequence token"
                 : static_cast<int>(ids.size() + r.ids.size()) >= m.files.context
                     ? "; the context is full"
                     : "");
    if (json_out) {
      nlohmann::json j{{"prompt_ids", r.prompt_ids},
                       {"ids", r.ids},
                       {"text", codec.decode(r.ids)},
                       {"stopped", r.stopped},
                       {"prompt_s", r.prompt_s},
                       {"generate_s", r.generate_s},
                       {"tokens_per_s", tps},
                       {"backend", be->name()},
                       {"streamed", decoder.streaming()},
                       {"streamed_bytes", ss.bytes},
                       {"stream_copy_s", ss.copy_s},
                       {"stream_wait_s", ss.wait_s}};
      // Text that ends inside a character is not UTF-8: those bytes become U+FFFD.
      std::puts(j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    }
  } catch (...) {
    return fuyou::tools::report_failure();
  }
  return 0;
}
