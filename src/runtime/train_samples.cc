#include "src/runtime/train_samples.h"

#include <ctime>
#include <nlohmann/json.hpp>

#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/log.h"
#include "fuyou/model.h"
#include "fuyou/sizes.h"

namespace fuyou {
namespace {

// MemAvailable of /proc/meminfo in bytes; 0 when unknown.
uint64_t available_memory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

std::string utc_now() {
  std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return buf;
}

// A string as a JSON literal; bytes that are not UTF-8 (a token may end inside a character)
// become U+FFFD.
std::string json_quoted(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

RunSamples::RunSamples(const Config& cfg, const std::string& run_dir)
    : cfg_(cfg), path_(run_dir + "/samples.jsonl") {
  const ModelFiles files = find_model_files(run_dir, cfg.model);
  codec_ = std::make_unique<TextCodec>(TextCodec::for_model(files, cfg.model));
  if (!cfg.data.chat_template_kwargs.empty())
    codec_->set_chat_template_kwargs(cfg.data.chat_template_kwargs);
  size_t longest = 0;
  for (size_t i = 0; i < cfg.schedule.sample_prompts.size(); ++i) {
    const std::string& p = cfg.schedule.sample_prompts[i];
    if (cfg.schedule.sample_chat) {
      const nlohmann::json messages = nlohmann::json::array({{{"role", "user"}, {"content", p}}});
      prompts_.push_back(codec_->encode_chat_messages(
          messages.dump(), str("schedule.sample_prompts[", i, "] (schedule.sample_chat)")));
    } else {
      prompts_.push_back(codec_->encode_prompt(p));
    }
    longest = std::max(longest, prompts_.back().size());
  }
  capacity_ = static_cast<int>(
      std::min<int64_t>(files.context, static_cast<int64_t>(longest) + cfg.schedule.sample_tokens));
  if (static_cast<int>(longest) >= capacity_)
    throw ConfigError(str("schedule.sample_prompts: a prompt of ", longest,
                          " tokens leaves no room in the model's ", files.context, " positions"));
  const uint64_t weights = make_gpt_layout(cfg.model).total * sizeof(float);
  const uint64_t need =
      2 * weights + decoder_device_bytes(cfg.model, capacity_, sizeof(float)) - weights;
  const uint64_t have = available_memory();
  if (have && need > have)
    throw ConfigError(str(
        "schedule.sample_every: samples decode on the CPU from a host copy of the fp32 weights, ",
        format_size(need), " in all, but this machine has ", format_size(have),
        " available; set schedule.sample_every: 0 and sample an exported checkpoint with "
        "fuyou-generate instead"));
  backend_ = make_cpu_backend(cfg.runtime.threads, 0);
  decoder_ = std::make_unique<GptDecoder>(cfg.model, *backend_, capacity_);
  out_.open(path_, std::ios::app);
  if (!out_) throw IoError(str(path_, ": cannot open for writing"));
  spdlog::info("samples: {} prompt(s){}, {} tokens each, every {} steps; tokenizer {}",
               prompts_.size(), cfg.schedule.sample_chat ? " as user messages (chat template)" : "",
               cfg.schedule.sample_tokens, cfg.schedule.sample_every, codec_->describe());
}

RunSamples::~RunSamples() = default;

void RunSamples::write(int64_t step, TrainEngine& engine) {
  const ParamLayout layout = make_gpt_layout(cfg_.model);
  std::vector<float> params(layout.total);
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    float* dst = params.data() + layout.groups[g].offset;
    engine.read_state(
        static_cast<int>(g), StateKind::kMaster,
        [&](size_t begin, const float* data, size_t n) { std::copy(data, data + n, dst + begin); });
  }
  decoder_->set_params(params.data());
  GenerateOptions opts;
  opts.max_new_tokens = cfg_.schedule.sample_tokens;
  for (size_t i = 0; i < prompts_.size(); ++i) {
    GenerateResult r = generate_tokens(*decoder_, prompts_[i], codec_->stop_ids(), opts);
    const std::string text = codec_->decode(r.ids);
    spdlog::info("step {} sample {}: {} -> {}", step, i + 1,
                 json_quoted(cfg_.schedule.sample_prompts[i]), json_quoted(text));
    nlohmann::json line{{"type", "sample"},
                        {"step", step},
                        {"time", utc_now()},
                        {"prompt", cfg_.schedule.sample_prompts[i]},
                        {"text", text},
                        {"ids", r.ids},
                        {"prompt_ids", r.prompt_ids}};
    out_ << line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  }
  out_.flush();
}

}  // namespace fuyou
