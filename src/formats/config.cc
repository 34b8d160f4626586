#include "fuyou/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iomanip>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>

#include "fuyou/error.h"
#include "fuyou/family.h"
#include "fuyou/lora.h"
#include "fuyou/read_file.h"
#include "fuyou/rope.h"
#include "fuyou/sizes.h"
#include "src/formats/yaml_checks.h"

namespace fuyou {
namespace {

// A config file is a few kilobytes; anything this large is the wrong file.
constexpr uint64_t kMaxConfigBytes = 16ull << 20;

// Where a config's values come from: the text (a file, or "<default config>") and the
// command line's --set overrides ("section.key" -> the assignment as given), so that an error
// names the --set that caused it rather than the file.
struct Origin {
  std::string source;
  std::map<std::string, std::string> sets;
};

// ---- the keys -----------------------------------------------------------------------------
//
// Each section's keys are one list (model_keys, data_keys, ...): a key's name, its field and
// the rule its value must meet. That list parses the section (Section::read), checks each
// value on its own (Section::check), writes a run's config.yaml (config_to_yaml) and names
// every key for config_keys() and the documentation test. Rules between keys (min_lr at most
// lr, the families' shapes) are written in the section's parse function after the list's
// checks.

// A number in [lo, hi], an end excluded where open_lo / open_hi say; `note` follows the rule
// in an error (what a special value means).
template <typename T>
struct Range {
  T lo, hi;
  bool open_lo = false, open_hi = false;
  const char* note = "";
};
template <typename R>
struct is_range : std::false_type {};
template <typename T>
struct is_range<Range<T>> : std::true_type {};
template <typename T>
Range<T> closed(T lo, T hi, const char* note = "") {
  return {lo, hi, false, false, note};
}
Range<double> interval(double lo, double hi, const char* ends, const char* note = "") {
  return {lo, hi, ends[0] == '(', ends[1] == ')', note};
}
// One of these names: a string field holds the name, an enum field the name's index.
struct OneOf {
  std::vector<std::string> names;
};
struct Free {};          // any value of the field's type
struct Size {};          // bytes, written as a size ("16GiB") or a plain number
struct Path {};          // a file or directory (a string, or a list of them)
struct OptionalPath {};  // a path written to config.yaml only when set
// A mapping of chat template variables (YAML, or a JSON object's text), kept as JSON text.
struct TemplateKwargs {};
// "auto" (stored as -1) or a count in 0..max.
struct AutoOrCount {
  int max;
  const char* what;      // what the count counts
  const char* max_name;  // where the bound comes from
};

// 1e+12 -> 1e12: bounds read as they are written in docs/config.md.
std::string bound_text(double v) {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::string t = str(v);
  const size_t e = t.find("e+");
  if (e != std::string::npos) {
    size_t digits = e + 2;
    while (digits + 1 < t.size() && t[digits] == '0') ++digits;
    t = t.substr(0, e + 1) + t.substr(digits);
  }
  return t;
}

// A range as lo..hi (integers) or in interval notation (reals), each bound written by
// `number`: exact in errors (rule_text), as docs/config.md writes it in the key list's values
// text (doc_number).
template <typename T, typename Number>
std::string range_text(const Range<T>& r, Number&& number) {
  if constexpr (std::is_integral_v<T>)
    return str(number(r.lo), "..", number(r.hi));
  else
    return str(r.open_lo ? "(" : "[", number(r.lo), ", ", number(r.hi), r.open_hi ? ")" : "]");
}

template <typename T>
std::string rule_text(const Range<T>& r) {
  if constexpr (std::is_integral_v<T>)
    return str("must be in ", range_text(r, [](T v) { return str(v); }), r.note);
  else
    return str("must be in ", range_text(r, bound_text), r.note);
}

template <typename T>
bool in_range(T v, const Range<T>& r) {
  // NaN fails both comparisons, so it is refused like a number out of range.
  const bool above_lo = r.open_lo ? v > r.lo : v >= r.lo;
  const bool below_hi = r.open_hi ? v < r.hi : v <= r.hi;
  return above_lo && below_hi;
}

// How docs/config.md writes a bound: powers of two from 2^20 as powers, and of ten from a
// million as 10^6 (integers) or 1e6 (reals); other numbers as they are.
std::string doc_number(double v, bool integer) {
  for (int k = 20; k < 64; ++k)
    if (v == std::ldexp(1.0, k)) return str("2^", k);
  double p = 1e6;
  for (int k = 6; k < 16 && integer; ++k, p *= 10)
    if (v == p) return str("10^", k);
  return bound_text(v);
}

// The type of a field its member pointer names.
template <typename P>
struct MemberType;
template <typename C, typename T>
struct MemberType<T C::*> {
  using type = T;
};

// The values a key takes, as docs/config.md's type column writes them.
template <typename T, typename Rule>
std::string values_text(const Rule& rule) {
  if constexpr (is_range<Rule>::value) {
    constexpr bool integer = std::is_integral_v<T>;
    return str(integer ? "int " : "float ", range_text(rule, [](auto v) {
                 return doc_number(static_cast<double>(v), integer);
               }));
  } else if constexpr (std::is_same_v<Rule, OneOf>) {
    return join(rule.names);
  } else if constexpr (std::is_same_v<Rule, Size>) {
    return "size";
  } else if constexpr (std::is_same_v<Rule, AutoOrCount>) {
    return str("auto, or an int 0..", rule.max_name);
  } else if constexpr (std::is_same_v<Rule, TemplateKwargs>) {
    return "mapping";
  } else if constexpr (std::is_same_v<Rule, Path> || std::is_same_v<Rule, OptionalPath>) {
    return std::is_same_v<T, std::vector<std::string>> ? "list of paths" : "path";
  } else if constexpr (std::is_same_v<T, bool>) {
    return "bool";
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    return "list of strings";
  } else if constexpr (std::is_same_v<T, FloatList>) {
    return "list of floats";
  } else if constexpr (std::is_same_v<T, IntList>) {
    return "list of ints";
  } else if constexpr (std::is_same_v<T, uint64_t>) {
    return "int 0..2^64-1";
  } else {
    static_assert(std::is_same_v<T, std::string>, "a Free field of a type values_text knows");
    return "string";
  }
}

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

  template <typename T>
  void get_numbers(const std::string& key, ValueList<T>& out) {
    known_.push_back(key);
    if (!node_ || node_.IsNull()) return;
    YAML::Node v = node_[key];
    if (!v || v.IsNull()) return;
    if (!v.IsSequence()) fail(key, "expected a list of numbers, e.g. [1, 1.5]");
    out.values.clear();
    for (const auto& item : v) {
      T x = 0;
      try {
        if (!item.IsScalar()) throw YAML::Exception(YAML::Mark(), "");
        x = item.as<T>();
      } catch (const YAML::Exception&) {
        fail(key, str("entry ", out.values.size(), ": expected ", type_name<T>()));
      }
      if constexpr (std::is_floating_point_v<T>)
        if (!std::isfinite(x))
          fail(key, str("entry ", out.values.size(), ": ", x, " is not finite"));
      out.values.push_back(x);
    }
  }

  // A mapping (or a JSON object's text, as --set may give it), as JSON text.
  void get_mapping(const std::string& key, std::string& out) {
    known_.push_back(key);
    if (!node_ || node_.IsNull()) return;
    YAML::Node v = node_[key];
    if (!v || v.IsNull()) return;
    const char* expected =
        "expected a mapping of template variables, e.g. {enable_thinking: false}";
    if (v.IsScalar()) {
      const auto j = nlohmann::ordered_json::parse(v.Scalar(), nullptr, false);
      if (j.is_discarded() || !j.is_object()) fail(key, str(expected, ", got '", v.Scalar(), "'"));
      out = j.empty() ? "" : j.dump();
      return;
    }
    if (!v.IsMap()) fail(key, str(expected, ", got a list"));
    const nlohmann::ordered_json j = yaml_to_json(key, v, 1);
    out = j.empty() ? "" : j.dump();
  }

  // Reads one key of the section's list into its field, as the rule's kind of value.
  template <typename T, typename Rule>
  void read(const char* key, T& out, const Rule& rule) {
    if constexpr (std::is_same_v<Rule, TemplateKwargs>) {
      get_mapping(key, out);
    } else if constexpr (std::is_same_v<Rule, Size>) {
      get_size(key, out);
    } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      get_list(key, out);
    } else if constexpr (std::is_same_v<T, FloatList> || std::is_same_v<T, IntList>) {
      get_numbers(key, out);
    } else if constexpr (std::is_enum_v<T>) {
      std::string name;
      get(key, name);
      if (name.empty()) return;
      out = static_cast<T>(one_of(key, name, rule));
    } else if constexpr (std::is_same_v<Rule, AutoOrCount>) {
      std::string text;
      get(key, text);
      if (text.empty()) return;
      if (text == "auto") {
        out = -1;
        return;
      }
      size_t used = 0;
      int n = -1;
      try {
        n = std::stoi(text, &used);
      } catch (const std::exception&) {
      }
      if (used != text.size() || n < 0 || n > rule.max)
        fail(key, str("'", text, "' is neither auto nor ", rule.what, " in [0, ", rule.max_name,
                      " = ", rule.max, "]"));
      out = n;
    } else {
      get(key, out);
    }
  }

  // Checks one value against its rule alone.
  template <typename T, typename Rule>
  void check(const char* key, const T& value, const Rule& rule) const {
    if constexpr (is_range<Rule>::value) {
      using Bound = decltype(rule.lo);
      static_assert(std::is_same_v<T, Bound> ||
                        (std::is_floating_point_v<T> && std::is_same_v<Bound, double>),
                    "a range's bounds have its field's type (reals: double)");
      if (!in_range(static_cast<Bound>(value), rule))
        fail(key, str("value ", value, " is not allowed: ", rule_text(rule)));
    } else if constexpr (std::is_same_v<Rule, OneOf> && std::is_same_v<T, std::string>) {
      one_of(key, value, rule);
    } else {
      // Read already checked these: an enum's name, an AutoOrCount's count, a size's text.
      static_assert(std::is_same_v<Rule, Free> || std::is_same_v<Rule, Path> ||
                        std::is_same_v<Rule, TemplateKwargs> || std::is_same_v<Rule, Size> ||
                        std::is_same_v<Rule, OptionalPath> || std::is_same_v<Rule, AutoOrCount> ||
                        (std::is_same_v<Rule, OneOf> && std::is_enum_v<T>),
                    "a rule Section::check does not know");
    }
  }

  // The index of `name` in the rule's names; an error naming them where it is none of them.
  size_t one_of(const char* key, const std::string& name, const OneOf& rule) const {
    const auto it = std::find(rule.names.begin(), rule.names.end(), name);
    if (it == rule.names.end()) fail(key, str("'", name, "' is not one of ", join(rule.names)));
    return static_cast<size_t>(it - rule.names.begin());
  }

  void finish() {
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

  // A YAML value as JSON: a quoted scalar is a string, an unquoted one null, a boolean or a
  // number where it reads as one, else a string. Nesting is bounded (--set values do not go
  // through load_yaml_checked).
  nlohmann::ordered_json yaml_to_json(const std::string& key, const YAML::Node& n,
                                      int depth) const {
    constexpr int kMaxNesting = 32;
    if (depth > kMaxNesting) fail(key, str("nests deeper than ", kMaxNesting, " levels"));
    if (n.IsMap()) {
      nlohmann::ordered_json j = nlohmann::ordered_json::object();
      for (const auto& kv : n) {
        if (!kv.first.IsScalar()) fail(key, "a template variable's name must be a string");
        j[kv.first.Scalar()] = yaml_to_json(key, kv.second, depth + 1);
      }
      return j;
    }
    if (n.IsSequence()) {
      nlohmann::ordered_json j = nlohmann::ordered_json::array();
      for (const auto& item : n) j.push_back(yaml_to_json(key, item, depth + 1));
      return j;
    }
    if (!n.IsScalar()) return nullptr;
    const std::string& t = n.Scalar();
    if (n.Tag() == "!") return t;  // quoted
    if (t == "null" || t == "Null" || t == "NULL" || t == "~") return nullptr;
    if (t == "true" || t == "True" || t == "TRUE") return true;
    if (t == "false" || t == "False" || t == "FALSE") return false;
    const auto number = nlohmann::ordered_json::parse(t, nullptr, false);
    if (!number.is_discarded() && number.is_number()) return number;
    return t;
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

// model.rope_type's names, and the parameters each variant reads (a parameter another
// variant sets would otherwise be silently ignored: parse_model refuses it).
const std::vector<std::string>& rope_type_names() {
  static const std::vector<std::string> names = {"default", "linear", "dynamic",
                                                 "yarn",    "llama3", "longrope"};
  return names;
}

bool rope_type_reads(const std::string& type, const std::string& key) {
  if (key == "rope_factor") return type != "default";
  if (key == "rope_original_context")
    return type == "dynamic" || type == "yarn" || type == "llama3" || type == "longrope";
  if (key == "rope_low_freq_factor" || key == "rope_high_freq_factor") return type == "llama3";
  if (key == "rope_beta_fast" || key == "rope_beta_slow" || key == "rope_truncate")
    return type == "yarn";
  if (key == "rope_attention_factor") return type == "yarn" || type == "longrope";
  if (key == "rope_short_factor" || key == "rope_long_factor") return type == "longrope";
  return true;
}

// ActivationPolicy's names, in its enumerators' order.
const std::vector<std::string>& activation_policy_names() {
  static const std::vector<std::string> names = {"auto", "keep", "swap", "recompute"};
  return names;
}

// A key's value as an error message writes it: an enum's as its name.
template <typename T, typename Rule>
std::string shown(const T& v, const Rule& rule) {
  if constexpr (std::is_enum_v<T>)
    return rule.names.at(static_cast<size_t>(v));
  else
    return str(v);
}

// Each section's keys in the order config.yaml writes them: key(name, field, rule).
template <typename F>
void model_keys(F&& key) {
  using M = ModelConfig;
  key("family", &M::family, OneOf{family_names()});
  key("n_layer", &M::n_layer, closed(1, kMaxLayers));
  key("n_head", &M::n_head, closed(1, kMaxModelDim));
  key("d_model", &M::d_model, closed(1, kMaxModelDim));
  key("d_ff", &M::d_ff, closed(0, kMaxFfDim, " (0: 4 * d_model)"));
  key("vocab_size", &M::vocab_size, closed(2, kMaxVocab));
  key("seq_len", &M::seq_len, closed(1, kMaxModelDim));
  key("positions", &M::positions, closed(0, kMaxModelDim, " (0: seq_len)"));
  key("init_std", &M::init_std, interval(0, 10, "()"));
  key("n_kv_head", &M::n_kv_head, closed(0, kMaxModelDim, " (0: n_head)"));
  key("head_dim", &M::head_dim, closed(0, 2 * kMaxRopePairs, " (0: d_model / n_head)"));
  key("qk_norm", &M::qk_norm, Free{});
  key("qk_norm_span", &M::qk_norm_span, OneOf{{"head", "projection"}});
  key("norm_position", &M::norm_position, OneOf{{"pre", "post"}});
  key("norm_eps", &M::norm_eps, interval(0, 1, "()"));
  key("rope_theta", &M::rope_theta, interval(1, 1e12, "()"));
  key("rope_type", &M::rope_type, OneOf{rope_type_names()});
  key("rope_factor", &M::rope_factor, interval(0, 1e6, "()"));
  key("rope_original_context", &M::rope_original_context, closed(0, kMaxModelDim, " (0: none)"));
  key("rope_low_freq_factor", &M::rope_low_freq_factor, interval(0, 1e6, "()"));
  key("rope_high_freq_factor", &M::rope_high_freq_factor, interval(0, 1e6, "()"));
  key("rope_beta_fast", &M::rope_beta_fast, interval(0, 1e6, "()"));
  key("rope_beta_slow", &M::rope_beta_slow, interval(0, 1e6, "()"));
  key("rope_truncate", &M::rope_truncate, Free{});
  key("rope_attention_factor", &M::rope_attention_factor,
      interval(0, 1e6, "[)", " (0: derived from rope_factor)"));
  key("rope_short_factor", &M::rope_short_factor, Free{});
  key("rope_long_factor", &M::rope_long_factor, Free{});
  key("nope_layers", &M::nope_layers, Free{});
  key("sliding_window", &M::sliding_window, closed(0, kMaxModelDim, " (0: none)"));
  key("tie_embeddings", &M::tie_embeddings, Free{});
  key("qkv_bias", &M::qkv_bias, Free{});
  key("head_chunk_tokens", &M::head_chunk_tokens,
      closed(0, 1 << 30, " (0: the whole micro-batch's logits at once)"));
  key("checkpoint", &M::checkpoint, OptionalPath{});
}

template <typename F>
void data_keys(F&& key) {
  using D = DataConfig;
  key("text", &D::text, Path{});
  key("train_shards", &D::train_shards, Path{});
  key("val_shards", &D::val_shards, Path{});
  key("val_fraction", &D::val_fraction, interval(0, 1, "[)"));
  key("tokenizer", &D::tokenizer, OneOf{{"byte"}});
  key("truncate", &D::truncate, OneOf{{"refuse", "right", "drop"}});
  key("chat_template_kwargs", &D::chat_template_kwargs, TemplateKwargs{});
}

template <typename F>
void optimizer_keys(F&& key) {
  using O = OptimizerConfig;
  // Infinity passes a one-sided test (eps > 0) and silently stops training, so every bound
  // here is two-sided.
  key("lr", &O::lr, interval(0, 10, "()"));
  key("min_lr", &O::min_lr, interval(0, 10, "[)"));
  key("beta1", &O::beta1, interval(0, 1, "[)"));
  key("beta2", &O::beta2, interval(0, 1, "[)"));
  key("eps", &O::eps, interval(0, 1, "()"));
  key("weight_decay", &O::weight_decay, interval(0, 100, "[)"));
  key("grad_clip", &O::grad_clip, interval(0, HUGE_VAL, "[)", " (0 disables clipping)"));
  key("initial_loss_scale", &O::initial_loss_scale, interval(1, 16777216.0, "[]"));
  key("placement", &O::placement, OneOf{{"auto", "host", "device"}});
  key("state", &O::state, OneOf{optimizer_state_names()});
  key("master", &O::master, OneOf{optimizer_master_names()});
}

template <typename F>
void schedule_keys(F&& key) {
  using S = ScheduleConfig;
  key("steps", &S::steps, closed(int64_t{1}, kMaxSteps));
  key("epochs", &S::epochs, closed(int64_t{0}, int64_t{1000000}, " (0: schedule.steps)"));
  key("warmup_steps", &S::warmup_steps, closed(int64_t{0}, kMaxSteps));
  key("lr_decay", &S::lr_decay, OneOf{{"cosine", "linear", "constant"}});
  key("micro_batch", &S::micro_batch, closed(1, kMaxBatch));
  key("grad_accum", &S::grad_accum, closed(1, kMaxBatch));
  key("grad_accum_type", &S::grad_accum_type, OneOf{{"auto", "fp32", "tensors"}});
  key("eval_every", &S::eval_every, closed(int64_t{0}, kMaxSteps));
  key("eval_batches", &S::eval_batches, closed(1, kMaxEvalBatches));
  key("log_every", &S::log_every, closed(int64_t{1}, kMaxSteps));
  key("sample_every", &S::sample_every, closed(int64_t{0}, kMaxSteps, " (0: no samples)"));
  key("sample_prompts", &S::sample_prompts, Free{});
  key("sample_tokens", &S::sample_tokens, closed(1, 4096));
  key("sample_chat", &S::sample_chat, Free{});
}

// deferred_updates counts layers: its bound is the model's.
template <typename F>
void offload_keys(F&& key, int n_layer) {
  using O = OffloadConfig;
  key("device_memory", &O::device_memory, Size{});
  key("host_memory", &O::host_memory, Size{});
  key("ssd_paths", &O::ssd_paths, Path{});
  key("activations", &O::activations, OneOf{activation_policy_names()});
  key("weights", &O::weights, OneOf{{"auto", "ssd"}});
  key("optimizer_state", &O::optimizer_state, OneOf{{"auto", "ssd"}});
  key("deferred_updates", &O::deferred_updates,
      AutoOrCount{n_layer - 1, "a layer count", "model.n_layer - 1"});
  key("hardware", &O::hardware, Path{});
  key("verify_store", &O::verify_store, Free{});
}

template <typename F>
void runtime_keys(F&& key) {
  using R = RuntimeConfig;
  key("backend", &R::backend, OneOf{{"cpu", "cuda", "auto", "cpu-streams", "emulated"}});
  key("threads", &R::threads, closed(0, 4096, " (0 uses every core)"));
  key("precision", &R::precision, OneOf{{"auto", "fp32", "bf16", "fp16"}});
  key("device_tensors", &R::device_tensors, OneOf{{"fp32", "bf16", "fp16"}});
  key("attention", &R::attention, OneOf{{"auto", "kernels", "cudnn"}});
  key("gemm_bias", &R::gemm_bias, OneOf{{"kernel", "epilogue"}});
  key("cuda_wait", &R::cuda_wait, OneOf{{"auto", "spin", "yield", "block"}});
  key("in_memory", &R::in_memory, OneOf{{"plan", "step"}});
  key("seed", &R::seed, Free{});
  key("stream_delay_us", &R::stream_delay_us, closed(0, 1000000, " microseconds"));
  key("emulated_scale", &R::emulated_scale, interval(0, 1e6, "(]"));
}

template <typename F>
void checkpoint_keys(F&& key) {
  using K = CheckpointConfig;
  key("every_steps", &K::every_steps,
      closed(int64_t{0}, int64_t{1000000000}, " (0: not by step count)"));
  key("every_minutes", &K::every_minutes, interval(0, 1e6, "[]", " (0: not by time)"));
  key("keep", &K::keep, closed(1, 1000));
  key("keep_best", &K::keep_best, Free{});
}

template <typename F>
void lora_keys(F&& key) {
  using L = LoraConfig;
  key("rank", &L::rank, closed(0, 65536, " (0: no LoRA, every weight trains)"));
  key("alpha", &L::alpha, interval(0, 1e6, "()"));
  key("dropout", &L::dropout, interval(0, 1, "[)"));
  key("targets", &L::targets, Free{});
  key("base", &L::base, OneOf{{"fp32", "bf16", "nf4"}});
  key("init", &L::init, Free{});
  key("use_rslora", &L::use_rslora, Free{});
}

// The sections in the order config.yaml writes them: section(name, member of Config, keys),
// keys(key) visiting the section's key list. deferred_updates' bound is n_layer's.
template <typename F>
void config_sections(F&& section, int n_layer) {
  section("model", &Config::model, [](auto&& key) { model_keys(key); });
  section("data", &Config::data, [](auto&& key) { data_keys(key); });
  section("optimizer", &Config::optimizer, [](auto&& key) { optimizer_keys(key); });
  section("schedule", &Config::schedule, [](auto&& key) { schedule_keys(key); });
  section("offload", &Config::offload, [n_layer](auto&& key) { offload_keys(key, n_layer); });
  section("runtime", &Config::runtime, [](auto&& key) { runtime_keys(key); });
  section("checkpoint", &Config::checkpoint, [](auto&& key) { checkpoint_keys(key); });
  section("lora", &Config::lora, [](auto&& key) { lora_keys(key); });
}

const std::vector<std::string>& section_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    config_sections([&n](const char* name, auto, auto&&) { n.push_back(name); }, kMaxLayers);
    return n;
  }();
  return names;
}

// Reads a section's keys from its list into `c` and refuses keys not on it.
template <typename C, typename Keys>
void read_keys(Section& s, C& c, Keys&& keys) {
  keys([&](const char* key, auto field, const auto& rule) { s.read(key, c.*field, rule); });
  s.finish();
}
// Checks each of a section's values against its key's rule.
template <typename C, typename Keys>
void check_keys(const Section& s, const C& c, Keys&& keys) {
  keys([&](const char* key, auto field, const auto& rule) { s.check(key, c.*field, rule); });
}

// The checkpoint directories being read, outermost first: a checkpoint's config.yaml may
// itself name a checkpoint (a run directory records the one it started from), and a chain
// that comes back to a directory it has read, or grows implausibly long, is refused instead
// of recursing until the stack runs out.
using CheckpointChain = std::vector<std::string>;
constexpr size_t kMaxCheckpointChain = 16;

Config parse_config_in_chain(const std::string& yaml_text, const std::string& source,
                             const std::vector<std::string>& overrides, CheckpointChain& chain);

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
// (llama has no position table; gpt2/opt keep theirs whole and train within it).
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
  // What a config may change of a checkpoint's model: the initialisation scale (of no weight
  // here), the head's chunking, and the sequence length (a learned position table keeps its
  // rows: parse_model holds seq_len within it). Every other key the text sets must agree with
  // the checkpoint; `positions` may name the table's rows that the checkpoint leaves implicit.
  ModelConfig m = ck;
  if (!rotary(family_traits(ck.family))) m.positions = ck.position_table();
  model_keys([&](const char* key, auto field, const auto& rule) {
    const std::string k = key;

    if (k == "checkpoint" || !s.given(key)) return;
    if (k == "init_std" || k == "head_chunk_tokens" || k == "seq_len") {
      m.*field = given.*field;
    } else if (k == "positions" && given.positions == m.positions) {
      return;
    } else if (!(given.*field == ck.*field)) {
      s.fail(key, str("is ", shown(given.*field, rule), " but the checkpoint ", given.checkpoint,
                      " has ", shown(ck.*field, rule),
                      " (leave it out: the model section comes from the checkpoint)"));
    }
  });
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
  const auto& sections = section_names();
  if (std::find(sections.begin(), sections.end(), section) == sections.end())
    throw ConfigError(str("--set '", assignment, "': unknown section '", section,
                          "' (allowed: ", join(sections), ")"));
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

}  // namespace

std::ostream& operator<<(std::ostream& os, const FloatList& l) {
  os << "[";
  for (size_t i = 0; i < l.values.size(); ++i)
    os << (i ? ", " : "") << std::setprecision(9) << l.values[i];
  return os << "]";
}

std::ostream& operator<<(std::ostream& os, const IntList& l) {
  os << "[";
  for (size_t i = 0; i < l.values.size(); ++i) os << (i ? ", " : "") << l.values[i];
  return os << "]";
}

OptimizerConfig fine_tune_optimizer_defaults() {
  OptimizerConfig o;
  o.lr = 2e-5;
  o.min_lr = 2e-6;
  o.weight_decay = 0.0;
  return o;
}

const char* activation_policy_name(ActivationPolicy p) {
  return activation_policy_names().at(static_cast<size_t>(p)).c_str();
}

namespace {

// The rotary variant's parameters and the attention window of a llama model: each variant
// reads its own parameters (a set parameter it does not read is refused), and where the
// engine's computation equals transformers' only within a context, seq_len stays inside it.
void check_rope(const Section& s, const ModelConfig& m) {
  const ModelConfig plain;
  model_keys([&](const char* key, auto field, const auto& rule) {
    const std::string k = key;
    if (k.rfind("rope_", 0) != 0 || k == "rope_type" || k == "rope_theta") return;
    if (!rope_type_reads(m.rope_type, k) && !(m.*field == plain.*field))
      s.fail(key, str("is ", shown(m.*field, rule), " but model.rope_type ", m.rope_type,
                      " does not use it (leave it out)"));
  });
  if (rope_type_reads(m.rope_type, "rope_original_context"))
    require(m.rope_original_context > 0, s, "rope_original_context", m.rope_original_context,
            str("model.rope_type ", m.rope_type, " needs the original context length"));
  if (m.rope_type == "llama3")
    require(m.rope_low_freq_factor < m.rope_high_freq_factor, s, "rope_low_freq_factor",
            m.rope_low_freq_factor, "must be below model.rope_high_freq_factor");
  if (m.rope_type == "longrope") {
    const size_t pairs = static_cast<size_t>(m.head_size() / 2);
    const std::pair<const char*, const FloatList*> lists[] = {
        {"rope_short_factor", &m.rope_short_factor}, {"rope_long_factor", &m.rope_long_factor}};
    for (const auto& [k, list] : lists) {
      const FloatList& l = *list;
      require(l.size() == pairs, s, k, l,
              str("longrope needs one factor per rotated pair: ", pairs, " (head size / 2)"));
      for (float x : l.values)
        require(x > 0 && x < 1e6f, s, k, l, str("entry ", x, " is not in (0, 1e6)"));
    }
    require(m.seq_len <= m.rope_original_context, s, "seq_len", m.seq_len,
            str("longrope's short factors apply within the original context "
                "(model.rope_original_context ",
                m.rope_original_context,
                "); beyond it transformers switches to the long ones by the batch's length"));
  }
  if (m.rope_type == "dynamic")
    require(m.seq_len <= m.rope_original_context, s, "seq_len", m.seq_len,
            str("dynamic NTK rotary embeddings equal the default ones only within the model's "
                "context (model.rope_original_context ",
                m.rope_original_context, "); beyond it transformers rescales them by length"));
  if (m.sliding_window > 0)
    require(m.seq_len <= m.sliding_window, s, "seq_len", m.seq_len,
            str("the engine attends over the whole causal context, which equals the model's "
                "sliding-window attention only within the window (model.sliding_window ",
                m.sliding_window, ")"));
}

ModelConfig parse_model(const YAML::Node& node, const Origin& source, CheckpointChain& chain) {
  Section s(node, "model", source);
  ModelConfig m;
  read_keys(s, m, [](auto&& key) { model_keys(key); });
  if (!m.checkpoint.empty()) m = model_from_checkpoint(m, s, chain);
  check_keys(s, m, [](auto&& key) { model_keys(key); });
  if (m.head_dim == 0)
    require(
        m.d_model % m.n_head == 0, s, "d_model", m.d_model,
        str("must be a multiple of model.n_head (", m.n_head, ") unless model.head_dim is given"));
  const FamilyTraits& fam = family_traits(m.family);
  if (!fam.open_shape) {
    // Only a family of open shape computes with these; a value elsewhere would be silently
    // ignored.
    require(m.n_kv_head == 0 || m.n_kv_head == m.n_head, s, "n_kv_head", m.n_kv_head,
            str("family ", m.family, " has no grouped-query attention"));
    require(m.tie_embeddings, s, "tie_embeddings", "false",
            str("family ", m.family, " ties the LM head to the token embedding"));
    require(!m.qkv_bias, s, "qkv_bias", "true",
            str("family ", m.family, " always has q/k/v biases; the key is for llama"));
    require(m.head_dim == 0 || m.head_dim * m.n_head == m.d_model, s, "head_dim", m.head_dim,
            str("family ", m.family, " has heads of d_model / n_head; the key is for llama"));
    require(!m.qk_norm, s, "qk_norm", "true", str("family ", m.family, " has no q/k norm"));
    require(m.norm_position == NormPosition::kPre, s, "norm_position", "post",
            str("family ", m.family, " normalises before its sublayers"));
  } else {
    require(m.d_ff != 0, s, "d_ff", m.d_ff,
            str("family ", m.family, " needs an explicit d_ff (intermediate_size)"));
    require(m.n_kv_head <= m.n_head, s, "n_kv_head", m.n_kv_head,
            str("must be in 0..model.n_head (", m.n_head, "); 0 means n_head"));
    require(m.n_kv_head == 0 || m.n_head % m.n_kv_head == 0, s, "n_kv_head", m.n_kv_head,
            str("must divide model.n_head (", m.n_head, ")"));
  }
  require(m.qk_norm || m.qk_norm_span == QkNormSpan::kHead, s, "qk_norm_span", "projection",
          "needs model.qk_norm: true (without a q/k norm there is nothing to span)");
  if (rotary(fam)) {
    require(m.head_size() % 2 == 0, s, m.head_dim ? "head_dim" : "d_model",
            m.head_dim ? m.head_dim : m.d_model,
            "rotary embeddings need an even head size (head_dim, or d_model / n_head)");
    require(m.head_size() <= 2 * kMaxRopePairs, s, m.head_dim ? "head_dim" : "d_model",
            m.head_dim ? m.head_dim : m.d_model,
            str("the head size (head_dim, or d_model / n_head) is at most ", 2 * kMaxRopePairs));
    check_rope(s, m);
    require(m.positions == 0, s, "positions", m.positions,
            str("family ", m.family, " has rotary embeddings and no position table"));
    for (size_t i = 0; i < m.nope_layers.size(); ++i) {
      const int l = m.nope_layers.values[i];
      require(l >= 0 && l < m.n_layer, s, "nope_layers", m.nope_layers,
              str("entry ", l, " is not a layer (0..", m.n_layer - 1, ")"));
      require(i == 0 || l > m.nope_layers.values[i - 1], s, "nope_layers", m.nope_layers,
              "must be ascending, each layer once");
    }
  } else {
    // The rotary and window keys are rotary families': elsewhere a value would be silently
    // ignored.
    require(m.positions == 0 || m.positions >= m.seq_len, s, "seq_len", m.seq_len,
            str("must be at most the position table's ", m.positions,
                " rows (model.positions; the checkpoint's n_positions or "
                "max_position_embeddings)"));
    const ModelConfig plain;
    model_keys([&](const char* key, auto field, const auto& rule) {
      const std::string k = key;
      if ((k.rfind("rope_", 0) == 0 || k == "sliding_window" || k == "nope_layers") &&
          !(m.*field == plain.*field))
        s.fail(key, str("is ", shown(m.*field, rule), " but family ", m.family,
                        " has no rotary embeddings "
                        "or attention window (the key is for llama)"));
    });
  }
  if (m.d_ff == 0) m.d_ff = 4 * m.d_model;  // at most kMaxFfDim: d_model is at most a quarter
  // A vocabulary over 64k makes a micro-batch's logits gigabytes (Llama 3's 128,256 at 4 x 4096
  // tokens: 4.2 GB in bf16): unless the text says otherwise, the head runs in chunks.
  constexpr int kChunkedHeadVocab = 1 << 16, kDefaultHeadChunkTokens = 2048;
  if (!s.given("head_chunk_tokens") && m.head_chunk_tokens == 0 && m.vocab_size > kChunkedHeadVocab)
    m.head_chunk_tokens = kDefaultHeadChunkTokens;
  return m;
}

DataConfig parse_data(const YAML::Node& node, const Origin& source) {
  Section s(node, "data", source);
  DataConfig d;
  read_keys(s, d, [](auto&& key) { data_keys(key); });
  check_keys(s, d, [](auto&& key) { data_keys(key); });
  if (!d.text.empty() && !d.train_shards.empty())
    s.fail("text", "give either data.text or data.train_shards, not both");
  return d;
}

OptimizerConfig parse_optimizer(const YAML::Node& node, const Origin& source, bool fine_tune) {
  Section s(node, "optimizer", source);
  OptimizerConfig o = fine_tune ? fine_tune_optimizer_defaults() : OptimizerConfig{};
  read_keys(s, o, [](auto&& key) { optimizer_keys(key); });
  // A fine-tune's floor follows its peak: a tenth of the lr given.
  if (fine_tune && s.given("lr") && !s.given("min_lr")) o.min_lr = o.lr / 10;
  check_keys(s, o, [](auto&& key) { optimizer_keys(key); });
  require(o.min_lr <= o.lr, s, "min_lr", o.min_lr, "must be in [0, optimizer.lr]");
  return o;
}

ScheduleConfig parse_schedule(const YAML::Node& node, const Origin& source, int seq_len,
                              bool fine_tune) {
  Section s(node, "schedule", source);
  ScheduleConfig t;
  read_keys(s, t, [](auto&& key) { schedule_keys(key); });
  check_keys(s, t, [](auto&& key) { schedule_keys(key); });
  // Unless given: a fine-tune warms up over kFineTuneWarmupSteps; any run's warmup is at most
  // its length. Not a share of the steps: a resume that trains longer must keep its warmup.
  if (!s.given("warmup_steps"))
    t.warmup_steps = std::min(t.steps, fine_tune ? kFineTuneWarmupSteps : t.warmup_steps);
  if (t.sample_every > 0 && t.sample_prompts.empty())
    s.fail("sample_every",
           "is set but schedule.sample_prompts is empty: give the prompts to continue");
  // With epochs the steps come from the records; the run checks warmup_steps against them.
  require(t.epochs > 0 || t.warmup_steps <= t.steps, s, "warmup_steps", t.warmup_steps,
          "must be in [0, schedule.steps]");
  require(int64_t{t.micro_batch} * seq_len <= kMaxBatchTokens, s, "micro_batch", t.micro_batch,
          str("times model.seq_len (", seq_len, ") must be at most ", kMaxBatchTokens,
              " tokens per micro-batch"));
  return t;
}

OffloadConfig parse_offload(const YAML::Node& node, const Origin& source, int n_layer) {
  Section s(node, "offload", source);
  OffloadConfig o;
  const auto keys = [n_layer](auto&& key) { offload_keys(key, n_layer); };
  read_keys(s, o, keys);
  check_keys(s, o, keys);
  for (const auto& [key, value] :
       {std::pair{"weights", o.weights}, {"optimizer_state", o.optimizer_state}})
    if (value == "ssd" && o.ssd_paths.empty()) s.fail(key, "is ssd but offload.ssd_paths is empty");
  return o;
}

RuntimeConfig parse_runtime(const YAML::Node& node, const Origin& source,
                            const OffloadConfig& offload) {
  Section s(node, "runtime", source);
  RuntimeConfig r;
  read_keys(s, r, [](auto&& key) { runtime_keys(key); });
  check_keys(s, r, [](auto&& key) { runtime_keys(key); });
  if (r.backend == "emulated" && offload.hardware.empty())
    s.fail("backend", "emulated needs offload.hardware: the profile of the GPU to emulate");
  if (r.stream_delay_us && r.backend != "cpu-streams")
    s.fail(
        "stream_delay_us",
        str("delays are a mode of backend cpu-streams, but runtime.backend is '", r.backend, "'"));
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
  // Choices of the CUDA backend with 16-bit tensors only: refused with fp32 tensors or on
  // another backend.
  auto cuda_16bit = [&](const char* key, const char* what, const char* otherwise) {
    if (r.device_tensors == "fp32")
      s.fail(key, str(what,
                      " takes 16-bit tensors, but device_tensors is fp32 (set "
                      "device_tensors: bf16, or ",
                      otherwise, ")"));
    if (r.backend != "cuda" && r.backend != "auto")
      s.fail(key, str(what, " runs on the CUDA backend, but runtime.backend is '", r.backend, "'"));
  };
  if (r.attention == "cudnn")
    cuda_16bit("attention", "cudnn's fused attention", "attention: kernels");
  if (r.gemm_bias == "epilogue")
    cuda_16bit("gemm_bias", "the bias epilogue (cuBLASLt)", "gemm_bias: kernel");
  if (r.cuda_wait != "auto" && r.backend != "cuda" && r.backend != "auto")
    s.fail("cuda_wait",
           str("sets how the CUDA backend waits, but runtime.backend is '", r.backend, "'"));
  return r;
}

CheckpointConfig parse_checkpoint(const YAML::Node& node, const Origin& source) {
  Section s(node, "checkpoint", source);
  CheckpointConfig k;
  read_keys(s, k, [](auto&& key) { checkpoint_keys(key); });
  check_keys(s, k, [](auto&& key) { checkpoint_keys(key); });
  return k;
}

// What the LoRA step runs so far (docs/lora.md): the CPU backend's fp32 tensors and GEMMs, the
// base, activations and adapters in memory, AdamW on the host with fp32 state. Anything else
// is refused here, naming the key that asks for it, rather than run some other way.
void check_lora_runs(const Section& s, const Config& c) {
  auto refuse = [&](const std::string& key, const std::string& value) {
    s.fail("rank", str("LoRA does not run with ", key, " ", value,
                       " yet (it runs on the CPU backend with fp32 tensors, everything in "
                       "memory, AdamW on the host in fp32: docs/lora.md)"));
  };
  const RuntimeConfig& r = c.runtime;
  if (r.backend != "cpu" && r.backend != "auto") refuse("runtime.backend", r.backend);
  if (r.device_tensors != "fp32") refuse("runtime.device_tensors", r.device_tensors);
  if (r.precision != "auto" && r.precision != "fp32") refuse("runtime.precision", r.precision);
  const OffloadConfig& o = c.offload;
  if (!o.ssd_paths.empty()) refuse("offload.ssd_paths", "(a base streamed from SSD)");
  if (o.weights != "auto") refuse("offload.weights", o.weights);
  if (o.optimizer_state != "auto") refuse("offload.optimizer_state", o.optimizer_state);
  if (o.activations != ActivationPolicy::kAuto && o.activations != ActivationPolicy::kKeep)
    refuse("offload.activations", activation_policy_name(o.activations));
  // The LoRA step's host memory is not planned yet, so a budget for it could not be held.
  if (o.host_memory) refuse("offload.host_memory", format_size(o.host_memory));
  if (c.optimizer.placement == "device") refuse("optimizer.placement", "device");
  if (c.optimizer.state != "fp32") refuse("optimizer.state", c.optimizer.state);
  if (c.optimizer.master != "fp32") refuse("optimizer.master", c.optimizer.master);
  if (c.schedule.sample_every > 0)
    s.fail("rank",
           str("LoRA does not write samples yet (schedule.sample_every ", c.schedule.sample_every,
               "): generation with the adapters applied is not done; set "
               "schedule.sample_every: 0 (docs/lora.md)"));
}

// The lora section: its keys, then what this build runs of them (docs/lora.md says what is
// missing). The targets are the model's family's module names.
LoraConfig parse_lora(const YAML::Node& node, const Origin& source, const Config& c) {
  Section s(node, "lora", source);
  LoraConfig l;
  read_keys(s, l, [](auto&& key) { lora_keys(key); });
  check_keys(s, l, [](auto&& key) { lora_keys(key); });
  if (!l.enabled()) {
    // Off: a key that differs from its default would be silently ignored (config.yaml writes
    // the defaults, which read back).
    const LoraConfig off;
    const bool differs[] = {l.alpha != off.alpha,     l.dropout != off.dropout,
                            l.targets != off.targets, l.base != off.base,
                            l.init != off.init,       l.use_rslora != off.use_rslora};
    const char* keys[] = {"alpha", "dropout", "targets", "base", "init", "use_rslora"};
    for (size_t i = 0; i < 6; ++i)
      if (differs[i]) s.fail(keys[i], "is set but lora.rank is 0 (LoRA off): give lora.rank");
    return l;
  }
  if (l.targets.empty())
    s.fail("targets", str("is empty: name the modules to adapt (", join(lora_module_names(c.model)),
                          ") or all-linear"));
  try {
    lora_target_modules(c.model, l);
  } catch (const ConfigError& e) {
    s.fail("targets", e.what());
  }
  if (l.dropout != 0)
    s.fail("dropout", str(l.dropout, ": adapter dropout is not implemented yet (use 0)"));
  if (l.base != "fp32")
    s.fail("base",
           str(l.base, ": only an fp32 base runs yet (",
               l.base == "nf4" ? "NF4 quantisation" : "a bf16 base", " is not implemented)"));
  if (l.init != "peft" && !std::filesystem::is_directory(l.init))
    s.fail("init", str("'", l.init,
                       "' is neither peft nor a directory (a PEFT adapter "
                       "directory: adapter_config.json, adapter_model.safetensors)"));
  check_lora_runs(s, c);
  if (c.model.checkpoint.empty())
    s.fail("rank",
           "LoRA adapts a trained base: set model.checkpoint (a directory of "
           "fuyou-convert from-hf)");
  return l;
}

Config parse_config_in_chain(const std::string& yaml_text, const std::string& source,
                             const std::vector<std::string>& overrides, CheckpointChain& chain) {
  YAML::Node root = load_yaml_checked(yaml_text, source);
  if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  if (!root.IsMap())
    throw ConfigError(str(source, ": the top level must be a mapping of sections"));
  Origin origin{source, {}};
  for (const auto& o : overrides) origin.sets[apply_override(root, o, source)] = o;

  const auto& sections = section_names();
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
  c.lora = parse_lora(r["lora"], origin, c);
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

std::vector<ConfigKey> config_keys() {
  std::vector<ConfigKey> keys;
  const auto add = [&keys](const char* section) {
    return [&keys, section](const char* key, auto field, const auto& rule) {
      using T = typename MemberType<decltype(field)>::type;
      keys.push_back({str(section, ".", key), values_text<T>(rule)});
    };
  };
  config_sections([&](const char* section, auto, auto&& list) { list(add(section)); }, kMaxLayers);
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

namespace {

// Writes one key of a section's list as config.yaml holds it; parse_config reads it back to
// the same value.
class KeyWriter {
 public:
  explicit KeyWriter(YAML::Emitter& e) : e_(e) {}

  template <typename T, typename Rule>
  void write(const char* key, const T& value, const Rule& rule) {
    if constexpr (std::is_same_v<Rule, OptionalPath> || std::is_same_v<Rule, TemplateKwargs>) {
      if (value.empty()) return;
    }
    e_ << YAML::Key << key << YAML::Value;
    if constexpr (std::is_same_v<Rule, TemplateKwargs>) {
      e_ << YAML::DoubleQuoted << value;  // the JSON object's text, read back as such
    } else if constexpr (std::is_same_v<Rule, Size>) {
      e_ << std::to_string(value);
    } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      e_ << YAML::Flow << YAML::BeginSeq;
      for (const auto& item : value) e_ << item;
      e_ << YAML::EndSeq;
    } else if constexpr (std::is_same_v<T, FloatList> || std::is_same_v<T, IntList>) {
      e_ << YAML::Flow << YAML::BeginSeq;
      for (auto x : value.values) e_ << x;
      e_ << YAML::EndSeq;
    } else if constexpr (std::is_enum_v<T>) {
      e_ << rule.names.at(static_cast<size_t>(value));
    } else if constexpr (std::is_same_v<Rule, AutoOrCount>) {
      if (value < 0)
        e_ << "auto";
      else
        e_ << value;
    } else {
      e_ << value;
    }
  }

 private:
  YAML::Emitter& e_;
};

}  // namespace

std::string config_to_yaml(const Config& c) {
  YAML::Emitter e;
  KeyWriter w(e);
  e << YAML::BeginMap;
  config_sections(
      [&](const char* name, auto member, auto&& list) {
        const auto& section = c.*member;
        e << YAML::Key << name << YAML::Value << YAML::BeginMap;
        list([&](const char* key, auto field, const auto& rule) {
          w.write(key, section.*field, rule);
        });
        e << YAML::EndMap;
      },
      c.model.n_layer);
  e << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

std::string config_to_self_contained_yaml(const Config& c) {
  // A LoRA run's weights are its adapters over model.checkpoint's frozen base, which the run
  // does not copy: the key stays (a checkpoint's manifest names the base by its checksum).
  if (c.lora.enabled()) return config_to_yaml(c);
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
