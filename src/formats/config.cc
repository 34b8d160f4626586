#include "fuyou/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>

#include "fuyou/error.h"
#include "fuyou/read_file.h"
#include "fuyou/sizes.h"
#include "src/formats/yaml_checks.h"

namespace fuyou {
namespace {

// A config file is a few kilobytes; anything this large is the wrong file.
constexpr uint64_t kMaxConfigBytes = 16ull << 20;

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i];
  return out;
}

// Where a config's values come from: the text (a file, or "<default config>") and the
// command line's --set overrides ("section.key" -> the assignment as given), so that an error
// names the --set that caused it rather than the file.
struct Origin {
  std::string source;
  std::map<std::string, std::string> sets;
  std::vector<std::string>* keys = nullptr;  // config_keys(): every key read, "section.key"
};

// Reads one YAML section. Every get() records the key as known, so finish() can reject the
// keys nobody asked for and list the ones that exist.
class Section {
 public:
  Section(const YAML::Node& node, std::string name, const Origin& origin)
      : node_(node), name_(std::move(name)), source_(origin.source), origin_(origin) {
    if (node_ && !node_.IsNull() && !node_.IsMap())
      throw ConfigError(
          str(source_, ": section '", name_, "' must be a mapping of keys to values"));
  }

  template <typename T>
  void get(const std::string& key, T& out) {
    known_.push_back(key);
    if (!node_ || node_.IsNull()) return;
    YAML::Node v = node_[key];
    if (!v || v.IsNull()) return;
    if (!v.IsScalar()) fail(key, "expected a single value");
    try {
      out = v.as<T>();
    } catch (const YAML::Exception&) {
      fail(key, str("expected ", type_name<T>(), ", got '", v.Scalar(), "'"));
    }
  }

  void get_size(const std::string& key, uint64_t& out) {
    std::string text;
    get(key, text);
    if (!text.empty()) out = parse_size(text, path(key));
  }

  void get_list(const std::string& key, std::vector<std::string>& out) {
    known_.push_back(key);
    if (!node_ || node_.IsNull()) return;
    YAML::Node v = node_[key];
    if (!v || v.IsNull()) return;
    if (v.IsScalar()) {
      out = {v.Scalar()};
      return;
    }
    if (!v.IsSequence()) fail(key, "expected a list of strings");
    out.clear();
    for (const auto& item : v) {
      if (!item.IsScalar()) fail(key, "expected a list of strings");
      out.push_back(item.Scalar());
    }
  }

  void finish() {
    if (origin_.keys)
      for (const auto& k : known_) origin_.keys->push_back(path(k));
    if (!node_ || node_.IsNull()) return;
    for (const auto& kv : node_) {
      const std::string& key = kv.first.Scalar();  // load_yaml_checked: keys are scalars
      if (std::find(known_.begin(), known_.end(), key) == known_.end())
        throw ConfigError(str(where(key), ": unknown key '", path(key), "' (allowed in ", name_,
                              ": ", join(known_), ")"));
    }
  }

  // A value's error names where it came from; a rule that mentions another key set on the
  // command line says so too (`--set schedule.steps=10` makes warmup_steps 20 too long).
  [[noreturn]] void fail(const std::string& key, const std::string& why) const {
    std::string note;
    for (const auto& [k, assignment] : origin_.sets)
      if (k != path(key) && why.find(k) != std::string::npos)
        note += str(" (", k, " is from --set '", assignment, "')");
    throw ConfigError(str(where(key), ": ", path(key), ": ", why, note));
  }
  std::string where(const std::string& key) const {
    auto it = origin_.sets.find(path(key));
    return it == origin_.sets.end() ? source_ : str("--set '", it->second, "'");
  }
  std::string path(const std::string& key) const { return name_ + "." + key; }
  // Whether the text sets `key` (to anything but null).
  bool given(const std::string& key) const {
    return node_ && node_.IsMap() && node_[key] && !node_[key].IsNull();
  }

 private:
  template <typename T>
  static const char* type_name() {
    if constexpr (std::is_same_v<T, bool>)
      return "true or false";
    else if constexpr (std::is_integral_v<T>)
      return "an integer";
    else if constexpr (std::is_floating_point_v<T>)
      return "a number";
    else
      return "a string";
  }

  YAML::Node node_;
  std::string name_;
  std::string source_;
  const Origin& origin_;
  std::vector<std::string> known_;
};

template <typename T>
void require(bool ok, const Section& s, const std::string& key, T value, const std::string& rule) {
  if (!ok) s.fail(key, str("value ", value, " is not allowed: ", rule));
}

// The checkpoint directories being read, outermost first: a checkpoint's config.yaml may
// itself name a checkpoint (a run directory records the one it started from), and a chain
// that comes back to a directory it has read, or grows implausibly long, is refused instead
// of recursing until the stack runs out.
using CheckpointChain = std::vector<std::string>;
constexpr size_t kMaxCheckpointChain = 16;

Config parse_config_in_chain(const std::string& yaml_text, const std::string& source,
                             const std::vector<std::string>& overrides, CheckpointChain& chain,
                             std::vector<std::string>* keys = nullptr);

std::string chain_text(const CheckpointChain& chain, const std::string& last) {
  std::string out;
  for (const auto& c : chain) out += "'" + c + "' -> ";
  return out + "'" + last + "'";
}

ModelConfig load_checkpoint_model(const std::string& dir, const Section& s,
                                  CheckpointChain& chain) {
  std::error_code ec;
  std::string canonical = std::filesystem::weakly_canonical(dir, ec).string();
  if (ec || canonical.empty()) canonical = dir;
  if (std::find(chain.begin(), chain.end(), canonical) != chain.end())
    s.fail("checkpoint",
           str("checkpoints name each other in a cycle: ", chain_text(chain, canonical),
               " (a checkpoint's config.yaml must not name itself or a checkpoint "
               "that leads back to it)"));
  if (chain.size() >= kMaxCheckpointChain)
    s.fail("checkpoint", str("more than ", kMaxCheckpointChain,
                             " checkpoints each name another: ", chain_text(chain, canonical)));
  const std::string yaml = dir + "/config.yaml";
  std::string text;
  try {
    text = read_file_bounded(yaml, kMaxConfigBytes, "config");
  } catch (const IoError& e) {
    throw ConfigError(e.what());
  }
  chain.push_back(canonical);
  ModelConfig m;
  try {
    m = parse_config_in_chain(text, yaml, {}, chain).model;
  } catch (...) {
    chain.pop_back();
    throw;
  }
  chain.pop_back();
  return m;
}

// model.checkpoint: the model section comes from the checkpoint's config.yaml (written by
// fuyou-convert from-hf, or a run directory's). Keys the text also sets must agree with it,
// so a config that names both cannot silently train a different shape; seq_len may differ
// for llama, which has no position table to outgrow.
ModelConfig model_from_checkpoint(const ModelConfig& given, const Section& s,
                                  CheckpointChain& chain) {
  ModelConfig ck;
  const bool outermost = chain.empty();
  try {
    ck = load_checkpoint_model(given.checkpoint, s, chain);
  } catch (const ConfigError& e) {
    if (!outermost) throw;  // the outermost config adds the context once
    s.fail("checkpoint", str("'", given.checkpoint, "': ", e.what(),
                             " (model.checkpoint takes a directory written by fuyou-convert "
                             "from-hf or a fuyou-train run directory)"));
  }
  auto agree = [&](const char* key, auto a, auto b) {
    if (s.given(key) && !(a == b))
      s.fail(key, str("is ", a, " but the checkpoint ", given.checkpoint, " has ", b,
                      " (leave it out: the model section comes from the checkpoint)"));
  };
  agree("family", given.family, ck.family);
  agree("n_layer", given.n_layer, ck.n_layer);
  agree("n_head", given.n_head, ck.n_head);
  agree("d_model", given.d_model, ck.d_model);
  agree("d_ff", given.d_ff, ck.d_ff);
  agree("vocab_size", given.vocab_size, ck.vocab_size);
  agree("n_kv_head", given.n_kv_head, ck.n_kv_head);
  agree("norm_eps", given.norm_eps, ck.norm_eps);
  agree("rope_theta", given.rope_theta, ck.rope_theta);
  agree("tie_embeddings", given.tie_embeddings, ck.tie_embeddings);
  agree("qkv_bias", given.qkv_bias, ck.qkv_bias);
  if (ck.family != "llama") agree("seq_len", given.seq_len, ck.seq_len);
  ModelConfig m = ck;
  if (ck.family == "llama" && s.given("seq_len")) m.seq_len = given.seq_len;
  if (s.given("init_std")) m.init_std = given.init_std;
  if (s.given("head_chunk_tokens")) m.head_chunk_tokens = given.head_chunk_tokens;
  m.checkpoint = given.checkpoint;
  return m;
}

// Returns the overridden key's path, "section.key".
std::string apply_override(YAML::Node& root, const std::string& assignment,
                           const std::string& source) {
  size_t eq = assignment.find('=');
  size_t dot = assignment.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq)
    throw ConfigError(
        str("--set '", assignment, "': expected section.key=value, e.g. model.n_layer=4"));
  std::string section = assignment.substr(0, dot);
  std::string key = assignment.substr(dot + 1, eq - dot - 1);
  std::string value = assignment.substr(eq + 1);
  static const std::set<std::string> sections = {"model",   "data",    "optimizer", "schedule",
                                                 "offload", "runtime", "checkpoint"};
  if (!sections.count(section))
    throw ConfigError(
        str("--set '", assignment, "': unknown section '", section,
            "' (allowed: checkpoint, data, model, offload, optimizer, runtime, schedule)"));
  YAML::Node parsed;
  try {
    parsed = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    throw ConfigError(str("--set '", assignment, "': value is not valid YAML: ", e.msg));
  }
  if (!root[section] || root[section].IsNull()) root[section] = YAML::Node(YAML::NodeType::Map);
  root[section][key] = parsed;
  (void)source;
  return section + "." + key;
}

ActivationPolicy parse_activations(const std::string& s, const Section& sec) {
  if (s == "auto") return ActivationPolicy::kAuto;
  if (s == "keep") return ActivationPolicy::kKeep;
  if (s == "swap") return ActivationPolicy::kSwap;
  if (s == "recompute") return ActivationPolicy::kRecompute;
  sec.fail("activations", str("'", s, "' is not one of auto, keep, swap, recompute"));
}

}  // namespace

OptimizerConfig fine_tune_optimizer_defaults() {
  OptimizerConfig o;
  o.lr = 2e-5;
  o.min_lr = 2e-6;
  o.weight_decay = 0.0;
  return o;
}

const char* activation_policy_name(ActivationPolicy p) {
  switch (p) {
    case ActivationPolicy::kAuto:
      return "auto";
    case ActivationPolicy::kKeep:
      return "keep";
    case ActivationPolicy::kSwap:
      return "swap";
    case ActivationPolicy::kRecompute:
      return "recompute";
  }
  return "?";
}

namespace {

ModelConfig parse_model(const YAML::Node& node, const Origin& source, CheckpointChain& chain) {
  Section s(node, "model", source);
  ModelConfig m;
  s.get("family", m.family);
  s.get("n_layer", m.n_layer);
  s.get("n_head", m.n_head);
  s.get("d_model", m.d_model);
  s.get("d_ff", m.d_ff);
  s.get("vocab_size", m.vocab_size);
  s.get("seq_len", m.seq_len);
  s.get("init_std", m.init_std);
  s.get("n_kv_head", m.n_kv_head);
  s.get("norm_eps", m.norm_eps);
  s.get("rope_theta", m.rope_theta);
  s.get("tie_embeddings", m.tie_embeddings);
  s.get("qkv_bias", m.qkv_bias);
  s.get("head_chunk_tokens", m.head_chunk_tokens);
  s.get("checkpoint", m.checkpoint);
  s.finish();
  if (!m.checkpoint.empty()) m = model_from_checkpoint(m, s, chain);
  if (m.family != "gpt2" && m.family != "opt" && m.family != "llama")
    s.fail("family", str("'", m.family, "' is not one of: gpt2, opt, llama"));
  // The shape first: the family rules below divide by n_head.
  require(m.n_layer >= 1 && m.n_layer <= kMaxLayers, s, "n_layer", m.n_layer,
          str("must be in 1..", kMaxLayers));
  require(m.n_head >= 1 && m.n_head <= kMaxModelDim, s, "n_head", m.n_head,
          str("must be in 1..", kMaxModelDim));
  require(m.d_model >= 1 && m.d_model <= kMaxModelDim, s, "d_model", m.d_model,
          str("must be in 1..", kMaxModelDim));
  require(m.d_model % m.n_head == 0, s, "d_model", m.d_model,
          str("must be a multiple of model.n_head (", m.n_head, ")"));
  if (m.family != "llama") {
    // Only llama computes with these; a value elsewhere would be silently ignored.
    require(m.n_kv_head == 0 || m.n_kv_head == m.n_head, s, "n_kv_head", m.n_kv_head,
            str("grouped-query attention is a llama feature (family ", m.family, ")"));
    require(m.tie_embeddings, s, "tie_embeddings", "false",
            str("family ", m.family, " ties the LM head to the token embedding"));
    require(!m.qkv_bias, s, "qkv_bias", "true",
            str("family ", m.family, " always has q/k/v biases; the key is for llama"));
  } else {
    require(m.d_ff != 0, s, "d_ff", m.d_ff,
            "family llama needs an explicit d_ff (intermediate_size)");
    require(m.n_kv_head >= 0 && m.n_kv_head <= m.n_head, s, "n_kv_head", m.n_kv_head,
            str("must be in 0..model.n_head (", m.n_head, "); 0 means n_head"));
    require(m.n_kv_head == 0 || m.n_head % m.n_kv_head == 0, s, "n_kv_head", m.n_kv_head,
            str("must divide model.n_head (", m.n_head, ")"));
    require(m.norm_eps > 0 && m.norm_eps < 1, s, "norm_eps", m.norm_eps, "must be in (0, 1)");
    require(m.rope_theta > 1 && m.rope_theta < 1e12f, s, "rope_theta", m.rope_theta,
            "must be in (1, 1e12)");
    require((m.d_model / m.n_head) % 2 == 0, s, "d_model", m.d_model,
            "rotary embeddings need an even head size (d_model / n_head)");
  }
  require(m.head_chunk_tokens >= 0 && m.head_chunk_tokens <= (1 << 30), s, "head_chunk_tokens",
          m.head_chunk_tokens, "must be in 0..2^30 (0: the whole micro-batch's logits at once)");
  if (m.d_ff == 0) m.d_ff = 4 * m.d_model;
  require(m.d_ff >= 1 && m.d_ff <= kMaxFfDim, s, "d_ff", m.d_ff,
          str("must be in 1..", kMaxFfDim, " (or 0 for 4 * d_model)"));
  require(m.vocab_size >= 2 && m.vocab_size <= kMaxVocab, s, "vocab_size", m.vocab_size,
          str("must be in 2..", kMaxVocab));
  require(m.seq_len >= 1 && m.seq_len <= kMaxModelDim, s, "seq_len", m.seq_len,
          str("must be in 1..", kMaxModelDim));
  require(m.init_std > 0 && m.init_std < 10, s, "init_std", m.init_std, "must be in (0, 10)");
  return m;
}

DataConfig parse_data(const YAML::Node& node, const Origin& source) {
  Section s(node, "data", source);
  DataConfig d;
  s.get_list("text", d.text);
  s.get_list("train_shards", d.train_shards);
  s.get_list("val_shards", d.val_shards);
  s.get("val_fraction", d.val_fraction);
  s.get("tokenizer", d.tokenizer);
  s.get("truncate", d.truncate);
  s.finish();
  if (d.truncate != "refuse" && d.truncate != "right" && d.truncate != "drop")
    s.fail("truncate", str("'", d.truncate, "' is not one of refuse, right, drop"));
  require(d.val_fraction >= 0 && d.val_fraction < 1, s, "val_fraction", d.val_fraction,
          "must be in [0, 1)");
  if (d.tokenizer != "byte") s.fail("tokenizer", str("'", d.tokenizer, "' is not one of: byte"));
  if (!d.text.empty() && !d.train_shards.empty())
    s.fail("text", "give either data.text or data.train_shards, not both");
  return d;
}

OptimizerConfig parse_optimizer(const YAML::Node& node, const Origin& source, bool fine_tune) {
  Section s(node, "optimizer", source);
  OptimizerConfig o = fine_tune ? fine_tune_optimizer_defaults() : OptimizerConfig{};
  s.get("lr", o.lr);
  s.get("min_lr", o.min_lr);
  s.get("beta1", o.beta1);
  s.get("beta2", o.beta2);
  s.get("eps", o.eps);
  s.get("weight_decay", o.weight_decay);
  s.get("grad_clip", o.grad_clip);
  s.get("initial_loss_scale", o.initial_loss_scale);
  s.get("placement", o.placement);
  s.get("state", o.state);
  s.get("master", o.master);
  s.finish();
  // A fine-tune's floor follows its peak: a tenth of the lr given.
  if (fine_tune && s.given("lr") && !s.given("min_lr")) o.min_lr = o.lr / 10;
  // Infinity passes a one-sided test (eps > 0) and silently stops training, so every bound
  // here is two-sided.
  require(o.lr > 0 && o.lr < 10, s, "lr", o.lr, "must be in (0, 10)");
  require(o.min_lr >= 0 && o.min_lr <= o.lr, s, "min_lr", o.min_lr, "must be in [0, optimizer.lr]");
  require(o.beta1 >= 0 && o.beta1 < 1, s, "beta1", o.beta1, "must be in [0, 1)");
  require(o.beta2 >= 0 && o.beta2 < 1, s, "beta2", o.beta2, "must be in [0, 1)");
  require(o.eps > 0 && o.eps < 1, s, "eps", o.eps, "must be in (0, 1)");
  require(o.weight_decay >= 0 && o.weight_decay < 100, s, "weight_decay", o.weight_decay,
          "must be in [0, 100)");
  require(o.grad_clip >= 0 && std::isfinite(o.grad_clip), s, "grad_clip", o.grad_clip,
          "must be a finite number >= 0 (0 disables clipping)");
  require(o.initial_loss_scale >= 1 && o.initial_loss_scale <= 16777216.0, s, "initial_loss_scale",
          o.initial_loss_scale, "must be in [1, 2^24]");
  if (o.placement != "auto" && o.placement != "host" && o.placement != "device")
    s.fail("placement", str("'", o.placement, "' is not one of auto, host, device"));
  const auto one_of = [&](const char* key, const std::string& v,
                          const std::vector<std::string>& names) {
    if (std::find(names.begin(), names.end(), v) == names.end())
      s.fail(key, str("'", v, "' is not one of ", join(names)));
  };
  one_of("state", o.state, optimizer_state_names());
  one_of("master", o.master, optimizer_master_names());
  return o;
}

ScheduleConfig parse_schedule(const YAML::Node& node, const Origin& source, int seq_len,
                              bool fine_tune) {
  Section s(node, "schedule", source);
  ScheduleConfig t;
  s.get("steps", t.steps);
  s.get("epochs", t.epochs);
  s.get("warmup_steps", t.warmup_steps);
  s.get("lr_decay", t.lr_decay);
  s.get("micro_batch", t.micro_batch);
  s.get("grad_accum", t.grad_accum);
  s.get("grad_accum_type", t.grad_accum_type);
  s.get("eval_every", t.eval_every);
  s.get("eval_batches", t.eval_batches);
  s.get("log_every", t.log_every);
  s.get("sample_every", t.sample_every);
  s.get_list("sample_prompts", t.sample_prompts);
  s.get("sample_tokens", t.sample_tokens);
  s.finish();
  // Unless given: a fine-tune warms up over kFineTuneWarmupSteps; any run's warmup is at most
  // its length. Not a share of the steps: a resume that trains longer must keep its warmup.
  if (!s.given("warmup_steps"))
    t.warmup_steps = std::min(t.steps, fine_tune ? kFineTuneWarmupSteps : t.warmup_steps);
  if (t.lr_decay != "cosine" && t.lr_decay != "linear" && t.lr_decay != "constant")
    s.fail("lr_decay", str("'", t.lr_decay, "' is not one of cosine, linear, constant"));
  require(t.sample_every >= 0 && t.sample_every <= kMaxSteps, s, "sample_every", t.sample_every,
          str("must be in 0..", kMaxSteps, " (0: no samples)"));
  require(t.sample_tokens >= 1 && t.sample_tokens <= 4096, s, "sample_tokens", t.sample_tokens,
          "must be in 1..4096");
  if (t.sample_every > 0 && t.sample_prompts.empty())
    s.fail("sample_every",
           "is set but schedule.sample_prompts is empty: give the prompts to continue");
  require(t.steps >= 1 && t.steps <= kMaxSteps, s, "steps", t.steps,
          str("must be in 1..", kMaxSteps));
  require(t.epochs >= 0 && t.epochs <= 1000000, s, "epochs", t.epochs,
          "must be in 0..1000000 (0: schedule.steps)");
  // With epochs the steps come from the records; the run checks warmup_steps against them.
  require(t.warmup_steps >= 0 && (t.epochs > 0 || t.warmup_steps <= t.steps), s, "warmup_steps",
          t.warmup_steps, "must be in [0, schedule.steps]");
  require(t.micro_batch >= 1 && t.micro_batch <= kMaxBatch, s, "micro_batch", t.micro_batch,
          str("must be in 1..", kMaxBatch));
  require(int64_t{t.micro_batch} * seq_len <= kMaxBatchTokens, s, "micro_batch", t.micro_batch,
          str("times model.seq_len (", seq_len, ") must be at most ", kMaxBatchTokens,
              " tokens per micro-batch"));
  require(t.grad_accum >= 1 && t.grad_accum <= kMaxBatch, s, "grad_accum", t.grad_accum,
          str("must be in 1..", kMaxBatch));
  if (t.grad_accum_type != "auto" && t.grad_accum_type != "fp32" && t.grad_accum_type != "tensors")
    s.fail("grad_accum_type", str("'", t.grad_accum_type, "' is not one of auto, fp32, tensors"));
  require(t.eval_every >= 0 && t.eval_every <= kMaxSteps, s, "eval_every", t.eval_every,
          str("must be in 0..", kMaxSteps));
  require(t.eval_batches >= 1 && t.eval_batches <= kMaxEvalBatches, s, "eval_batches",
          t.eval_batches, str("must be in 1..", kMaxEvalBatches));
  require(t.log_every >= 1 && t.log_every <= kMaxSteps, s, "log_every", t.log_every,
          str("must be in 1..", kMaxSteps));
  return t;
}

OffloadConfig parse_offload(const YAML::Node& node, const Origin& source, int n_layer) {
  Section s(node, "offload", source);
  OffloadConfig o;
  std::string activations = "auto";
  s.get_size("device_memory", o.device_memory);
  s.get_size("host_memory", o.host_memory);
  s.get_list("ssd_paths", o.ssd_paths);
  s.get("activations", activations);
  s.get("hardware", o.hardware);
  s.get("weights", o.weights);
  s.get("optimizer_state", o.optimizer_state);
  s.get("verify_store", o.verify_store);
  std::string deferred = "auto";
  s.get("deferred_updates", deferred);
  s.finish();
  o.activations = parse_activations(activations, s);
  for (const auto& [key, value] :
       {std::pair{"weights", o.weights}, {"optimizer_state", o.optimizer_state}}) {
    if (value != "auto" && value != "ssd")
      s.fail(key, str("'", value, "' is not one of auto, ssd"));
    if (value == "ssd" && o.ssd_paths.empty()) s.fail(key, "is ssd but offload.ssd_paths is empty");
  }
  if (deferred == "auto") {
    o.deferred_updates = -1;
  } else {
    size_t used = 0;
    int n = -1;
    try {
      n = std::stoi(deferred, &used);
    } catch (const std::exception&) {
    }
    if (used != deferred.size() || n < 0 || n >= n_layer)
      s.fail("deferred_updates",
             str("'", deferred, "' is neither auto nor a layer count in [0, model.n_layer - 1 = ",
                 n_layer - 1, "]"));
    o.deferred_updates = n;
  }
  return o;
}

RuntimeConfig parse_runtime(const YAML::Node& node, const Origin& source,
                            const OffloadConfig& offload) {
  Section s(node, "runtime", source);
  RuntimeConfig r;
  s.get("backend", r.backend);
  s.get("threads", r.threads);
  s.get("precision", r.precision);
  s.get("device_tensors", r.device_tensors);
  s.get("attention", r.attention);
  s.get("seed", r.seed);
  s.get("stream_delay_us", r.stream_delay_us);
  s.get("emulated_scale", r.emulated_scale);
  s.finish();
  if (r.backend != "cpu" && r.backend != "cuda" && r.backend != "auto" &&
      r.backend != "cpu-streams" && r.backend != "emulated")
    s.fail("backend",
           str("'", r.backend, "' is not one of cpu, cuda, auto, cpu-streams, emulated"));
  require(r.emulated_scale > 0 && r.emulated_scale <= 1e6, s, "emulated_scale", r.emulated_scale,
          "must be in (0, 1e6]");
  if (r.backend == "emulated" && offload.hardware.empty())
    s.fail("backend", "emulated needs offload.hardware: the profile of the GPU to emulate");
  require(r.stream_delay_us >= 0 && r.stream_delay_us <= 1000000, s, "stream_delay_us",
          r.stream_delay_us, "must be in 0..1000000 microseconds");
  if (r.stream_delay_us && r.backend != "cpu-streams")
    s.fail(
        "stream_delay_us",
        str("delays are a mode of backend cpu-streams, but runtime.backend is '", r.backend, "'"));
  if (r.precision != "auto" && r.precision != "fp32" && r.precision != "bf16" &&
      r.precision != "fp16")
    s.fail("precision", str("'", r.precision, "' is not one of auto, fp32, bf16, fp16"));
  if (r.device_tensors != "fp32" && r.device_tensors != "bf16" && r.device_tensors != "fp16")
    s.fail("device_tensors", str("'", r.device_tensors, "' is not one of fp32, bf16, fp16"));
  // fp16 gradients underflow and overflow without a loss scale, which precision fp16 brings.
  if (r.device_tensors == "fp16" && r.precision != "fp16")
    s.fail("device_tensors",
           str("fp16 tensors need runtime.precision: fp16 (its dynamic loss scaling keeps fp16 "
               "gradients in range), but precision is '",
               r.precision, "'"));
  // bf16 operands rounded to fp16 would lose range for nothing; the backends also differ on it
  // (the CPU rounds them, cuBLAS multiplies the stored bf16 as they are).
  if (r.device_tensors == "bf16" && r.precision == "fp16")
    s.fail("precision",
           "fp16 GEMMs on bf16 tensors are not a mode: use precision bf16 (or auto) with bf16 "
           "tensors, or device_tensors fp16 with precision fp16");
  if (r.attention != "auto" && r.attention != "kernels" && r.attention != "cudnn")
    s.fail("attention", str("'", r.attention, "' is not one of auto, kernels, cudnn"));
  if (r.attention == "cudnn" && r.device_tensors == "fp32")
    s.fail("attention",
           "cudnn's fused attention takes 16-bit tensors, but device_tensors is fp32 (set "
           "device_tensors: bf16, or attention: kernels)");
  if (r.attention == "cudnn" && r.backend != "cuda" && r.backend != "auto")
    s.fail("attention",
           str("cudnn runs on the CUDA backend, but runtime.backend is '", r.backend, "'"));
  require(r.threads >= 0 && r.threads <= 4096, s, "threads", r.threads,
          "must be in 0..4096 (0 uses every core)");
  return r;
}

CheckpointConfig parse_checkpoint(const YAML::Node& node, const Origin& source) {
  Section s(node, "checkpoint", source);
  CheckpointConfig k;
  s.get("every_steps", k.every_steps);
  s.get("every_minutes", k.every_minutes);
  s.get("keep", k.keep);
  s.get("keep_best", k.keep_best);
  s.finish();
  require(k.every_steps >= 0 && k.every_steps <= 1000000000, s, "every_steps", k.every_steps,
          "must be in 0..1e9 (0: not by step count)");
  require(k.every_minutes >= 0 && k.every_minutes <= 1e6, s, "every_minutes", k.every_minutes,
          "must be in [0, 1e6] (0: not by time)");
  require(k.keep >= 1 && k.keep <= 1000, s, "keep", k.keep, "must be in 1..1000");
  return k;
}

Config parse_config_in_chain(const std::string& yaml_text, const std::string& source,
                             const std::vector<std::string>& overrides, CheckpointChain& chain,
                             std::vector<std::string>* keys) {
  YAML::Node root = load_yaml_checked(yaml_text, source);
  if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  if (!root.IsMap())
    throw ConfigError(str(source, ": the top level must be a mapping of sections"));
  Origin origin{source, {}, keys};
  for (const auto& o : overrides) origin.sets[apply_override(root, o, source)] = o;

  static const std::vector<std::string> sections = {"model",   "data",    "optimizer", "schedule",
                                                    "offload", "runtime", "checkpoint"};
  for (const auto& kv : root) {
    std::string name = kv.first.Scalar();
    if (std::find(sections.begin(), sections.end(), name) == sections.end())
      throw ConfigError(
          str(source, ": unknown section '", name, "' (allowed: ", join(sections), ")"));
  }
  Config c;
  // Lookups on a const node: a missing section reads as absent instead of being inserted.
  const YAML::Node& r = root;
  c.model = parse_model(r["model"], origin, chain);
  c.data = parse_data(r["data"], origin);
  // A fine-tune (weights from model.checkpoint) gets fine-tuning defaults for the keys the
  // text leaves out (fine_tune_optimizer_defaults, docs/config.md).
  const bool fine_tune = !c.model.checkpoint.empty();
  c.optimizer = parse_optimizer(r["optimizer"], origin, fine_tune);
  c.schedule = parse_schedule(r["schedule"], origin, c.model.seq_len, fine_tune);
  c.offload = parse_offload(r["offload"], origin, c.model.n_layer);
  c.runtime = parse_runtime(r["runtime"], origin, c.offload);
  c.checkpoint = parse_checkpoint(r["checkpoint"], origin);
  c.model.seed = c.runtime.seed;
  return c;
}

}  // namespace

Config parse_config(const std::string& yaml_text, const std::string& source,
                    const std::vector<std::string>& overrides) {
  CheckpointChain chain;
  try {
    return parse_config_in_chain(yaml_text, source, overrides, chain);
  } catch (const YAML::Exception& e) {
    // Every access above is guarded; this keeps a yaml-cpp corner nobody foresaw a
    // ConfigError naming the file rather than an uncaught exception.
    throw ConfigError(str(source, ": ", yaml_position(e.mark), ": ", e.msg));
  }
}

const std::vector<std::string>& optimizer_state_names() {
  static const std::vector<std::string> names = {"fp32", "bf16", "int8"};
  return names;
}

const std::vector<std::string>& optimizer_master_names() {
  static const std::vector<std::string> names = {"fp32", "split"};
  return names;
}

std::vector<std::string> config_keys() {
  std::vector<std::string> keys;
  CheckpointChain chain;
  parse_config_in_chain("", "<config keys>", {}, chain, &keys);
  return keys;
}

Config load_config_file(const std::string& path, const std::vector<std::string>& overrides) {
  std::string text;
  try {
    text = read_file_bounded(path, kMaxConfigBytes, "config");
  } catch (const IoError& e) {
    throw ConfigError(e.what());
  }
  return parse_config(text, path, overrides);
}

std::string config_to_yaml(const Config& c) {
  YAML::Emitter e;
  auto list = [&](const std::vector<std::string>& v) {
    e << YAML::Flow << YAML::BeginSeq;
    for (const auto& s : v) e << s;
    e << YAML::EndSeq;
  };
  auto size = [](uint64_t b) { return std::to_string(b); };
  e << YAML::BeginMap;
  e << YAML::Key << "model" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "family" << YAML::Value << c.model.family;
  e << YAML::Key << "n_layer" << YAML::Value << c.model.n_layer;
  e << YAML::Key << "n_head" << YAML::Value << c.model.n_head;
  e << YAML::Key << "d_model" << YAML::Value << c.model.d_model;
  e << YAML::Key << "d_ff" << YAML::Value << c.model.d_ff;
  e << YAML::Key << "vocab_size" << YAML::Value << c.model.vocab_size;
  e << YAML::Key << "seq_len" << YAML::Value << c.model.seq_len;
  e << YAML::Key << "init_std" << YAML::Value << c.model.init_std;
  e << YAML::Key << "n_kv_head" << YAML::Value << c.model.n_kv_head;
  e << YAML::Key << "norm_eps" << YAML::Value << c.model.norm_eps;
  e << YAML::Key << "rope_theta" << YAML::Value << c.model.rope_theta;
  e << YAML::Key << "tie_embeddings" << YAML::Value << c.model.tie_embeddings;
  e << YAML::Key << "qkv_bias" << YAML::Value << c.model.qkv_bias;
  e << YAML::Key << "head_chunk_tokens" << YAML::Value << c.model.head_chunk_tokens;
  if (!c.model.checkpoint.empty())
    e << YAML::Key << "checkpoint" << YAML::Value << c.model.checkpoint;
  e << YAML::EndMap;
  e << YAML::Key << "data" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "text" << YAML::Value;
  list(c.data.text);
  e << YAML::Key << "train_shards" << YAML::Value;
  list(c.data.train_shards);
  e << YAML::Key << "val_shards" << YAML::Value;
  list(c.data.val_shards);
  e << YAML::Key << "val_fraction" << YAML::Value << c.data.val_fraction;
  e << YAML::Key << "tokenizer" << YAML::Value << c.data.tokenizer;
  e << YAML::Key << "truncate" << YAML::Value << c.data.truncate;
  e << YAML::EndMap;
  e << YAML::Key << "optimizer" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "lr" << YAML::Value << c.optimizer.lr;
  e << YAML::Key << "min_lr" << YAML::Value << c.optimizer.min_lr;
  e << YAML::Key << "beta1" << YAML::Value << c.optimizer.beta1;
  e << YAML::Key << "beta2" << YAML::Value << c.optimizer.beta2;
  e << YAML::Key << "eps" << YAML::Value << c.optimizer.eps;
  e << YAML::Key << "weight_decay" << YAML::Value << c.optimizer.weight_decay;
  e << YAML::Key << "grad_clip" << YAML::Value << c.optimizer.grad_clip;
  e << YAML::Key << "initial_loss_scale" << YAML::Value << c.optimizer.initial_loss_scale;
  e << YAML::Key << "placement" << YAML::Value << c.optimizer.placement;
  e << YAML::Key << "state" << YAML::Value << c.optimizer.state;
  e << YAML::Key << "master" << YAML::Value << c.optimizer.master;
  e << YAML::EndMap;
  e << YAML::Key << "schedule" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "steps" << YAML::Value << c.schedule.steps;
  e << YAML::Key << "epochs" << YAML::Value << c.schedule.epochs;
  e << YAML::Key << "warmup_steps" << YAML::Value << c.schedule.warmup_steps;
  e << YAML::Key << "lr_decay" << YAML::Value << c.schedule.lr_decay;
  e << YAML::Key << "micro_batch" << YAML::Value << c.schedule.micro_batch;
  e << YAML::Key << "grad_accum" << YAML::Value << c.schedule.grad_accum;
  e << YAML::Key << "grad_accum_type" << YAML::Value << c.schedule.grad_accum_type;
  e << YAML::Key << "eval_every" << YAML::Value << c.schedule.eval_every;
  e << YAML::Key << "eval_batches" << YAML::Value << c.schedule.eval_batches;
  e << YAML::Key << "log_every" << YAML::Value << c.schedule.log_every;
  e << YAML::Key << "sample_every" << YAML::Value << c.schedule.sample_every;
  e << YAML::Key << "sample_prompts" << YAML::Value;
  list(c.schedule.sample_prompts);
  e << YAML::Key << "sample_tokens" << YAML::Value << c.schedule.sample_tokens;
  e << YAML::EndMap;
  e << YAML::Key << "offload" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "device_memory" << YAML::Value << size(c.offload.device_memory);
  e << YAML::Key << "host_memory" << YAML::Value << size(c.offload.host_memory);
  e << YAML::Key << "ssd_paths" << YAML::Value;
  list(c.offload.ssd_paths);
  e << YAML::Key << "activations" << YAML::Value << activation_policy_name(c.offload.activations);
  e << YAML::Key << "weights" << YAML::Value << c.offload.weights;
  e << YAML::Key << "optimizer_state" << YAML::Value << c.offload.optimizer_state;
  e << YAML::Key << "deferred_updates" << YAML::Value;
  if (c.offload.deferred_updates < 0)
    e << "auto";
  else
    e << c.offload.deferred_updates;
  e << YAML::Key << "hardware" << YAML::Value << c.offload.hardware;
  e << YAML::Key << "verify_store" << YAML::Value << c.offload.verify_store;
  e << YAML::EndMap;
  e << YAML::Key << "runtime" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "backend" << YAML::Value << c.runtime.backend;
  e << YAML::Key << "threads" << YAML::Value << c.runtime.threads;
  e << YAML::Key << "precision" << YAML::Value << c.runtime.precision;
  e << YAML::Key << "device_tensors" << YAML::Value << c.runtime.device_tensors;
  e << YAML::Key << "attention" << YAML::Value << c.runtime.attention;
  e << YAML::Key << "seed" << YAML::Value << c.runtime.seed;
  e << YAML::Key << "stream_delay_us" << YAML::Value << c.runtime.stream_delay_us;
  e << YAML::Key << "emulated_scale" << YAML::Value << c.runtime.emulated_scale;
  e << YAML::EndMap;
  e << YAML::Key << "checkpoint" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "every_steps" << YAML::Value << c.checkpoint.every_steps;
  e << YAML::Key << "every_minutes" << YAML::Value << c.checkpoint.every_minutes;
  e << YAML::Key << "keep" << YAML::Value << c.checkpoint.keep;
  e << YAML::Key << "keep_best" << YAML::Value << c.checkpoint.keep_best;
  e << YAML::EndMap;
  e << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

std::string config_to_self_contained_yaml(const Config& c) {
  Config resolved = c;
  resolved.model.checkpoint.clear();
  std::string text = config_to_yaml(resolved);
  if (c.model.checkpoint.empty()) return text;
  // YAML comments cannot hold a line break; a path with one is cut there.
  std::string from = c.model.checkpoint.substr(0, c.model.checkpoint.find('\n'));
  return "# model weights initialised from " + from +
         " (model.checkpoint); the model section below is\n"
         "# complete, so this file does not need that directory.\n" +
         text;
}

}  // namespace fuyou
