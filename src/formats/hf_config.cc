// Hugging Face config.json for the gpt2, opt and llama families, in and out, and the
// tensor-name mapping of each family (one row per Hugging Face tensor, in the order of the
// engine's own list, make_gpt_layout()).
#include <cmath>
#include <fstream>
#include <iomanip>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

#include "fuyou/error.h"
#include "fuyou/hf_checkpoint.h"
#include "fuyou/read_file.h"
#include "fuyou/rope.h"
#include "fuyou/tokenizer.h"

namespace fuyou {
namespace {

using json = nlohmann::json;

// Typed, checked access to config.json fields. Every failure names the file and the field;
// nothing here lets a nlohmann exception escape, so a malformed file is always a
// ConfigError (the fuzz test in tests/test_hf.cc holds us to that).
//
// Every field a parser looks at is recorded, so that finish() can refuse the fields nobody
// read: a config.json key is either modelled by the family's parser, on the list of keys
// that do not change what the model computes (kInertKeys), or refused. No checkpoint is
// accepted and computed differently from transformers because of a key the engine skipped.
class Fields {
 public:
  Fields(const json& j, std::string source) : j_(j), source_(std::move(source)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& why) const {
    throw ConfigError(str(source_, ": field '", key, "': ", why));
  }

  bool present(const std::string& key) const {
    read_.insert(key);
    return j_.contains(key) && !j_[key].is_null();
  }

  const json& required(const std::string& key) const {
    read_.insert(key);
    if (!j_.contains(key)) fail(key, "missing (this model type's config.json must give it)");
    if (j_[key].is_null()) fail(key, "is null; a value is required");
    return j_[key];
  }

  // Whether the field is there at all (null included).
  bool has_key(const std::string& key) const {
    read_.insert(key);
    return j_.contains(key);
  }

  // The value, or null when the field is absent.
  const json& value(const std::string& key) const {
    static const json null_value;
    read_.insert(key);
    return j_.contains(key) ? j_[key] : null_value;
  }

  int integer(const std::string& key, int lo, int hi) const {
    const json& v = required(key);
    return checked_int(source_, key, v, lo, hi);
  }

  int integer_or(const std::string& key, int fallback, int lo, int hi) const {
    return present(key) ? checked_int(source_, key, j_[key], lo, hi) : fallback;
  }

  std::string string_or(const std::string& key, const std::string& fallback) const {
    if (!present(key)) return fallback;
    if (!j_[key].is_string()) fail(key, str("expected a string, got ", j_[key].dump()));
    return j_[key].get<std::string>();
  }

  std::string string(const std::string& key) const {
    const json& v = required(key);
    if (!v.is_string()) fail(key, str("expected a string, got ", v.dump()));
    return v.get<std::string>();
  }

  double number_or(const std::string& key, double fallback) const {
    if (!present(key)) return fallback;
    if (!j_[key].is_number()) fail(key, str("expected a number, got ", j_[key].dump()));
    return j_[key].get<double>();
  }

  bool boolean_or(const std::string& key, bool fallback) const {
    if (!present(key)) return fallback;
    if (!j_[key].is_boolean()) fail(key, str("expected true or false, got ", j_[key].dump()));
    return j_[key].get<bool>();
  }

  // A field whose only value the engine computes: absent, null or `expected`.
  void expect(const std::string& key, const json& expected, const std::string& why) const {
    if (present(key) && j_[key] != expected)
      fail(key, str("value ", j_[key].dump(), " is not supported: ", why));
  }

  // Refuses the first field that no parser read and that is not inert.
  void finish(const std::string& model_type) const;

  // Integer checks shared with the rotary parameters (a nested object).
  static int checked_int(const std::string& source, const std::string& key, const json& v, int lo,
                         int hi) {
    auto fail = [&](const std::string& why) {
      throw ConfigError(str(source, ": field '", key, "': ", why));
    };
    if (!v.is_number_integer()) fail(str("expected an integer, got ", v.dump()));
    // Compare in the widest type first: a huge unsigned must not wrap into range.
    if (v.is_number_unsigned()) {
      uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(hi)) fail(str("value ", u, " is not in ", lo, "..", hi));
      if (static_cast<int64_t>(u) < lo) fail(str("value ", u, " is not in ", lo, "..", hi));
      return static_cast<int>(u);
    }
    int64_t s = v.get<int64_t>();
    if (s < lo || s > hi) fail(str("value ", s, " is not in ", lo, "..", hi));
    return static_cast<int>(s);
  }

  const std::string& source() const { return source_; }

 private:
  const json& j_;
  std::string source_;
  mutable std::set<std::string> read_;
};

// Keys of every model type that do not change what the model computes from its weights and
// tokens: names and versions, token ids (the tokenizer's business), the dtype the weights are
// stored in (read by hf_torch_dtype), cache and output switches, generation defaults
// (fuyou-generate takes its own), classification-head labels, and dropout rates (training
// regularisation that the engine does not apply: docs/checkpoints.md). Everything else a
// config.json carries is modelled by its family's parser or refused.
const std::set<std::string>& inert_keys() {
  static const std::set<std::string> keys = {
      "architectures", "model_type", "transformers_version", "_name_or_path", "name_or_path",
      "_commit_hash", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
      "unk_token_id", "decoder_start_token_id", "torch_dtype", "dtype", "use_cache",
      "output_attentions", "output_hidden_states", "return_dict", "torchscript", "use_return_dict",
      "_attn_implementation", "attn_implementation", "_attn_implementation_autoset",
      "tf_legacy_loss", "use_bfloat16", "is_decoder", "chunk_size_feed_forward", "problem_type",
      "finetuning_task", "id2label", "label2id", "num_labels", "prefix", "task_specific_params",
      "tokenizer_class", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
      "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
      "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
      "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
      "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
      "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
      "begin_suppress_tokens",
      // dropout: not applied by the engine in training, never applied in evaluation
      "attention_dropout", "hidden_dropout", "dropout", "activation_dropout", "attn_pdrop",
      "embd_pdrop", "resid_pdrop", "layerdrop", "summary_first_dropout",
      // GPT-2's sequence-summary head (GPT2DoubleHeadsModel), not part of the causal LM
      "summary_activation", "summary_proj_to_labels", "summary_type", "summary_use_proj",
      // GPT-2's n_ctx repeats n_positions and is not read by its model
      "n_ctx"};
  return keys;
}

void Fields::finish(const std::string& model_type) const {
  for (auto it = j_.begin(); it != j_.end(); ++it) {
    const std::string& key = it.key();
    if (read_.count(key) || inert_keys().count(key)) continue;
    std::string shown = it.value().dump();
    if (shown.size() > 80) shown = shown.substr(0, 77) + "...";
    fail(key, str("value ", shown, " is not modelled by the engine for model_type ", model_type,
                  ": the conversion stops rather than compute a model that differs from "
                  "transformers' (docs/checkpoints.md lists the fields each family reads)"));
  }
}

// The engine's LayerNorm epsilon (kernels use 1e-5, as GPT-2 does).
constexpr double kEngineLayerNormEps = 1e-5;
// The engine config's own bounds (include/fuyou/config.h), so that every config.json
// accepted here converts into a config.yaml that parse_config accepts.
constexpr int kMaxDim = kMaxModelDim;

}  // namespace

const std::vector<std::string>& tokenizer_file_names() {
  static const std::vector<std::string> names = {
      "tokenizer.json",          "tokenizer_config.json", "vocab.json",        "merges.txt",
      "special_tokens_map.json", "tokenizer.model",       "added_tokens.json", kChatTemplateFile};
  return names;
}

const std::vector<std::string>& carried_file_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n = {kKeptHfConfigFile, kGenerationConfigFile};
    for (const auto& t : tokenizer_file_names()) n.push_back(t);
    return n;
  }();
  return names;
}

namespace {

ModelConfig parse_gpt2(const Fields& f) {
  ModelConfig m;
  m.family = "gpt2";
  m.n_layer = f.integer("n_layer", 1, kMaxLayers);
  m.n_head = f.integer("n_head", 1, kMaxDim);
  m.d_model = f.integer("n_embd", 1, kMaxDim);
  if (m.d_model % m.n_head != 0)
    f.fail("n_embd", str("value ", m.d_model, " is not a multiple of n_head (", m.n_head, ")"));
  m.d_ff = f.integer_or("n_inner", 4 * m.d_model, 1, kMaxFfDim);
  m.vocab_size = f.integer("vocab_size", 2, kMaxVocab);
  m.seq_len = f.integer("n_positions", 1, kMaxDim);
  double init = f.number_or("initializer_range", 0.02);
  if (init > 0 && init < 10) m.init_std = static_cast<float>(init);
  // transformers upcasts its own attention to fp32 with it; the engine's softmax is fp32.
  (void)f.value("reorder_and_upcast_attn");

  // Fields that change the arithmetic: the engine computes exactly one variant.
  std::string act = f.string_or("activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    f.fail("activation_function", str("'", act,
                                      "' is not supported: the engine's GELU is the tanh "
                                      "approximation (gelu_new or gelu_pytorch_tanh)"));
  double eps = f.number_or("layer_norm_epsilon", kEngineLayerNormEps);
  if (!(std::fabs(eps - kEngineLayerNormEps) <= 1e-12))
    f.fail("layer_norm_epsilon", str("value ", eps,
                                     " is not supported: the engine's LayerNorm "
                                     "uses 1e-05"));
  if (!f.boolean_or("tie_word_embeddings", true))
    f.fail("tie_word_embeddings", "false is not supported: the engine ties the LM head to wte");
  if (!f.boolean_or("scale_attn_weights", true))
    f.fail("scale_attn_weights",
           "false is not supported: attention scores are scaled by "
           "1/sqrt(head size)");
  if (f.boolean_or("scale_attn_by_inverse_layer_idx", false))
    f.fail("scale_attn_by_inverse_layer_idx", "true is not supported");
  if (f.boolean_or("add_cross_attention", false))
    f.fail("add_cross_attention", "true is not supported (decoder-only models)");
  return m;
}

ModelConfig parse_opt(const Fields& f) {
  ModelConfig m;
  m.family = "opt";
  m.n_layer = f.integer("num_hidden_layers", 1, kMaxLayers);
  m.n_head = f.integer("num_attention_heads", 1, kMaxDim);
  m.d_model = f.integer("hidden_size", 1, kMaxDim);
  if (m.d_model % m.n_head != 0)
    f.fail("hidden_size",
           str("value ", m.d_model, " is not a multiple of num_attention_heads (", m.n_head, ")"));
  m.d_ff = f.integer("ffn_dim", 1, kMaxFfDim);
  m.vocab_size = f.integer("vocab_size", 2, kMaxVocab);
  m.seq_len = f.integer("max_position_embeddings", 1, kMaxDim);
  double init = f.number_or("init_std", 0.02);
  if (init > 0 && init < 10) m.init_std = static_cast<float>(init);
  std::string act = f.string_or("activation_function", "relu");
  if (act != "relu")
    f.fail("activation_function", str("'", act, "' is not supported: the opt family uses relu"));
  if (!f.boolean_or("do_layer_norm_before", true))
    f.fail("do_layer_norm_before",
           "false (post-LN, as OPT-350m) is not supported: the engine normalises before "
           "attention and the MLP (pre-LN)");
  if (f.boolean_or("_remove_final_layer_norm", false))
    f.fail("_remove_final_layer_norm", "true is not supported: the engine has a final LayerNorm");
  int proj = f.integer_or("word_embed_proj_dim", m.d_model, 1, kMaxDim);
  if (proj != m.d_model)
    f.fail("word_embed_proj_dim",
           str("value ", proj, " differs from hidden_size (", m.d_model,
               "): the project_in/project_out layers this needs are not supported"));
  if (!f.boolean_or("enable_bias", true))
    f.fail("enable_bias", "false is not supported: the opt family has biases everywhere");
  if (!f.boolean_or("layer_norm_elementwise_affine", true))
    f.fail("layer_norm_elementwise_affine", "false is not supported");
  if (!f.boolean_or("tie_word_embeddings", true))
    f.fail("tie_word_embeddings", "false is not supported: the opt family ties the LM head");
  return m;
}

// The rotary embedding of a llama-family config.json, as transformers 5 reads it: the
// 5.x form `rope_parameters: {rope_type, rope_theta, factor, ...}`, or the 4.x form
// `rope_theta` plus `rope_scaling` (which, when given, takes the place of rope_parameters).
// Every parameter of the chosen variant is modelled or refused; a value given twice must
// agree. The frequencies themselves: rope_table (src/model/rope.cc).
class RopeReader {
 public:
  // class_original_context: the config class's own original_max_position_embeddings (Phi-3:
  // 4096), which transformers puts in place of the rotary parameters' one; 0 where the class
  // has none. legacy_longrope: the class reads rope_type su and yarn as longrope (Phi-3).
  RopeReader(const Fields& f, ModelConfig& m, int max_positions, int class_original_context,
             bool legacy_longrope, double default_theta)
      : f_(f),
        m_(m),
        max_positions_(max_positions),
        class_original_(class_original_context),
        legacy_longrope_(legacy_longrope),
        default_theta_(default_theta) {}

  void read() {
    const json& scaling = f_.value("rope_scaling");
    const json& params = f_.value("rope_parameters");
    for (const auto* v : {&scaling, &params})
      if (!v->is_null() && !v->is_object())
        f_.fail(v == &scaling ? "rope_scaling" : "rope_parameters",
                str("expected an object or null, got ", v->dump()));
    const bool use_scaling = scaling.is_object() && !scaling.empty();
    where_ = use_scaling ? "rope_scaling" : "rope_parameters";
    const json empty = json::object();
    const json& p = use_scaling ? scaling : (params.is_object() ? params : empty);
    if (use_scaling && params.is_object() && !params.empty() && !same_rope(scaling, params))
      f_.fail("rope_scaling", str("differs from rope_parameters (", params.dump(),
                                  "); give the rotary settings once"));
    for (const char* nested : {"full_attention", "sliding_attention"})
      if (p.contains(nested))
        f_.fail(where_,
                "per-layer-type rotary parameters are not supported (one set for "
                "every layer)");
    read_theta(p);
    std::string type = "default";
    for (const char* k : {"rope_type", "type"})
      if (p.contains(k)) {
        if (!p[k].is_string()) bad(k, p[k], "a string");
        if (p.contains("rope_type") && p.contains("type") && p["rope_type"] != p["type"])
          f_.fail(where_, "'rope_type' and 'type' disagree");
        type = p[k].get<std::string>();
      }
    if (legacy_longrope_ && (type == "su" || type == "yarn")) type = "longrope";
    if (legacy_longrope_ && type != "default" && type != "longrope")
      f_.fail(where_, str("rope_type '", type,
                          "': this model type has only default and longrope rotary embeddings"));
    m_.rope_type = type;
    if (type == "default") {
      allow(p, {});
    } else if (type == "linear" || type == "dynamic") {
      allow(p, {"factor"});
      m_.rope_factor = positive(p, "factor", std::nullopt);
      if (type == "dynamic") m_.rope_original_context = max_positions_;
    } else if (type == "llama3") {
      allow(p,
            {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"});
      m_.rope_factor = positive(p, "factor", std::nullopt);
      m_.rope_low_freq_factor = positive(p, "low_freq_factor", std::nullopt);
      m_.rope_high_freq_factor = positive(p, "high_freq_factor", std::nullopt);
      if (!(m_.rope_low_freq_factor < m_.rope_high_freq_factor))
        f_.fail(where_, "low_freq_factor must be below high_freq_factor");
      m_.rope_original_context = original_context(p);
    } else if (type == "yarn") {
      read_yarn(p);
    } else if (type == "longrope") {
      read_longrope(p);
    } else {
      f_.fail(where_, str("rope_type '", type,
                          "' is not supported (supported: default, linear, dynamic, yarn, "
                          "llama3, longrope)"));
    }
  }

 private:
  // transformers 5's order: rope_parameters' own rope_theta, else the top-level one, else the
  // config class's default. Given in both places, they must agree.
  void read_theta(const json& p) {
    double theta = default_theta_;
    const bool top = f_.present("rope_theta");
    if (top) theta = f_.number_or("rope_theta", theta);
    if (p.contains("rope_theta") && !p["rope_theta"].is_null()) {
      if (!p["rope_theta"].is_number()) bad("rope_theta", p["rope_theta"], "a number");
      const double inner = p["rope_theta"].get<double>();
      if (top && inner != theta)
        f_.fail("rope_theta", str("value ", theta, " differs from ", where_, ".rope_theta (", inner,
                                  "); give it once"));
      theta = inner;
    }
    m_.rope_theta = static_cast<float>(theta);
    if (!(m_.rope_theta > 1 && m_.rope_theta < 1e12f))
      f_.fail("rope_theta", str("value ", theta, " is not in (1, 1e12) as a 32-bit float"));
  }

  void read_yarn(const json& p) {
    allow(p, {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
              "beta_slow", "mscale", "mscale_all_dim", "truncate"});
    m_.rope_original_context = original_context(p);
    const double factor = has(p, "factor")
                              ? positive(p, "factor", std::nullopt)
                              : static_cast<double>(max_positions_) / m_.rope_original_context;
    m_.rope_factor = static_cast<float>(factor);
    // beta_fast and beta_slow: transformers takes 0 and null as its defaults (`or 32`).
    m_.rope_beta_fast = static_cast<float>(zero_or(p, "beta_fast", 32));
    m_.rope_beta_slow = static_cast<float>(zero_or(p, "beta_slow", 1));
    if (has(p, "truncate")) {
      if (!p["truncate"].is_boolean()) bad("truncate", p["truncate"], "true or false");
      m_.rope_truncate = p["truncate"].get<bool>();
    }
    double attention = 0;
    if (has(p, "attention_factor")) {
      attention = positive(p, "attention_factor", std::nullopt);
    } else {
      const double ms = zero_or(p, "mscale", 0), all = zero_or(p, "mscale_all_dim", 0);
      attention = ms != 0 && all != 0 ? yarn_mscale(factor, ms) / yarn_mscale(factor, all)
                                      : yarn_mscale(factor, 1);
    }
    m_.rope_attention_factor = static_cast<float>(attention);
  }

  // longrope (Phi-3.5, Phi-4 mini): per-pair factors, short within the original context and
  // long beyond it; the engine trains within it (the config holds seq_len there).
  void read_longrope(const json& p) {
    allow(p, {"factor", "long_factor", "short_factor", "attention_factor",
              "original_max_position_embeddings"});
    m_.rope_original_context = original_context(p);
    // transformers derives the factor from the two contexts where the config gives none.
    const double factor = has(p, "factor")
                              ? positive(p, "factor", std::nullopt)
                              : static_cast<double>(max_positions_) / m_.rope_original_context;
    m_.rope_factor = static_cast<float>(factor);
    m_.rope_short_factor = factors(p, "short_factor");
    m_.rope_long_factor = factors(p, "long_factor");
    const double attention = has(p, "attention_factor")
                                 ? positive(p, "attention_factor", std::nullopt)
                                 : longrope_attention_factor(factor, m_.rope_original_context);
    m_.rope_attention_factor = static_cast<float>(attention);
  }

  FloatList factors(const json& p, const char* k) {
    if (!has(p, k)) f_.fail(where_, str("rope_type longrope needs '", k, "'"));
    if (!p[k].is_array()) bad(k, p[k], "a list of numbers");
    const size_t pairs = static_cast<size_t>(m_.head_size() / 2);
    if (p[k].size() != pairs)
      f_.fail(where_, str("'", k, "' has ", p[k].size(), " entries; the head size ", m_.head_size(),
                          " rotates ", pairs, " pairs"));
    FloatList l;
    for (const json& x : p[k]) {
      if (!x.is_number()) bad(k, x, "a number in the list");
      const double v = x.get<double>();
      if (!(v > 0 && v < 1e6)) f_.fail(where_, str("'", k, "' entry ", v, " is not in (0, 1e6)"));
      l.values.push_back(static_cast<float>(v));
    }
    return l;
  }

  // The pretraining context of llama3, yarn and longrope: a top-level
  // original_max_position_embeddings wins (as transformers 5 gives it priority), else the
  // config class's own default where it has one, else the parameter, else the model's context.
  int original_context(const json& p) {
    if (f_.present("original_max_position_embeddings"))
      return f_.integer("original_max_position_embeddings", 1, kMaxModelDim);
    if (class_original_) return class_original_;
    if (has(p, "original_max_position_embeddings"))
      return Fields::checked_int(f_.source(), where_ + ".original_max_position_embeddings",
                                 p["original_max_position_embeddings"], 1, kMaxModelDim);
    return max_positions_;
  }

  static bool has(const json& p, const char* k) { return p.contains(k) && !p[k].is_null(); }

  // Keys every variant may carry, and the variant's own; any other key is refused.
  void allow(const json& p, std::initializer_list<const char*> own) {
    for (auto it = p.begin(); it != p.end(); ++it) {
      const std::string& k = it.key();
      if (k == "rope_type" || k == "type" || k == "rope_theta") continue;
      if (k == "partial_rotary_factor" && it.value().is_number() && it.value().get<double>() == 1.0)
        continue;
      bool ok = false;
      for (const char* o : own) ok = ok || k == o;
      if (!ok)
        f_.fail(where_, str("key '", k, "' (", it.value().dump(),
                            ") is not modelled for rope_type ", m_.rope_type,
                            " (the engine rotates whole heads by the variant's "
                            "frequencies; docs/checkpoints.md)"));
    }
  }

  double positive(const json& p, const char* k, std::optional<double> fallback) {
    if (!has(p, k)) {
      if (fallback) return *fallback;
      f_.fail(where_, str("rope_type ", m_.rope_type, " needs '", k, "'"));
    }
    if (!p[k].is_number()) bad(k, p[k], "a number");
    const double v = p[k].get<double>();
    if (!(v > 0 && v < 1e6)) f_.fail(where_, str("'", k, "' value ", v, " is not in (0, 1e6)"));
    return v;
  }

  double zero_or(const json& p, const char* k, double fallback) {
    if (!has(p, k)) return fallback;
    if (!p[k].is_number()) bad(k, p[k], "a number");
    const double v = p[k].get<double>();
    if (v == 0) return fallback;
    return positive(p, k, std::nullopt);
  }

  [[noreturn]] void bad(const char* k, const json& v, const char* want) {
    f_.fail(where_, str("'", k, "': expected ", want, ", got ", v.dump()));
  }

  // The same settings written in both forms (rope_theta may be in one only).
  static bool same_rope(json a, json b) {
    for (json* x : {&a, &b}) {
      x->erase("rope_theta");
      if (x->contains("type") && !x->contains("rope_type")) (*x)["rope_type"] = (*x)["type"];
      x->erase("type");
    }
    return a == b;
  }

  const Fields& f_;
  ModelConfig& m_;
  int max_positions_;
  int class_original_;
  bool legacy_longrope_;
  double default_theta_;
  std::string where_;
};

// Qwen2's window: used only with use_sliding_window (then from layer max_window_layers on);
// the engine computes full attention, so the window must be off in every layer.
void read_qwen2_window(const Fields& f, int n_layer) {
  if (f.boolean_or("use_sliding_window", false))
    f.fail("use_sliding_window", "true is not supported: attention is full causal");
  (void)f.value("sliding_window");     // read by transformers only with use_sliding_window
  (void)f.value("max_window_layers");  // the same
  const json& types = f.value("layer_types");
  if (types.is_null()) return;
  if (!types.is_array()) f.fail("layer_types", str("expected a list, got ", types.dump()));
  if (types.size() != static_cast<size_t>(n_layer))
    f.fail("layer_types",
           str("has ", types.size(), " entries for ", n_layer, " layers (num_hidden_layers)"));
  for (const auto& t : types)
    if (t != "full_attention")
      f.fail("layer_types", str("entry ", t.dump(),
                                " is not supported: every layer must be "
                                "full_attention"));
}

}  // namespace

// The Hugging Face model types the engine's llama family computes, one row each: what the
// config class defaults to and reads, how its tensors are named, and what an export writes.
const std::vector<LlamaDialect>& llama_dialects() {
  using W = LlamaDialect::Window;
  static const std::vector<LlamaDialect> rows = {
      // model_type, architecture, default_positions, qkv_bias, qk_norm, window,
      // default_window, attention_bias_key, mlp_bias_key, fused, class_original_context,
      // default_theta, default_tied, nope[, default_eps (1e-6), post_norm]
      {"llama", "LlamaForCausalLM", 2048, false, false, W::kNone, 0, true, true, false, 0, 0, false,
       false},
      {"qwen2", "Qwen2ForCausalLM", 32768, true, false, W::kQwen, 0, false, false, false, 0, 0,
       false, false},
      {"qwen3", "Qwen3ForCausalLM", 32768, false, true, W::kQwen, 0, true, false, false, 0, 0,
       false, false},
      {"mistral", "MistralForCausalLM", 131072, false, false, W::kUniform, 4096, false, false,
       false, 0, 0, false, false},
      {"phi3", "Phi3ForCausalLM", 4096, false, false, W::kUniform, 0, false, false, true, 4096, 0,
       false, false, 1e-5},
      {"smollm3", "SmolLM3ForCausalLM", 32768, false, false, W::kQwen, 0, true, true, false, 0,
       2000000.0f, true, true},
      {"olmo2", "Olmo2ForCausalLM", 2048, false, true, W::kNone, 0, true, false, false, 0, 0, false,
       false, 1e-5, true},
  };
  return rows;
}

const LlamaDialect* find_llama_dialect(const std::string& model_type) {
  for (const LlamaDialect& d : llama_dialects())
    if (model_type == d.model_type) return &d;
  return nullptr;
}

namespace {

// SmolLM3's layers without rotary embeddings: no_rope_layers (1: the layer rotates), or
// without it every no_rope_layer_interval-th layer (SmolLM3Config's default, 4).
void read_nope_layers(const Fields& f, ModelConfig& m) {
  const int interval = f.integer_or("no_rope_layer_interval", 4, 1, kMaxLayers);
  const json& flags = f.value("no_rope_layers");
  if (!flags.is_null() && !flags.is_array())
    f.fail("no_rope_layers", str("expected a list of 0 and 1, got ", flags.dump()));
  if (flags.is_array() && flags.size() != static_cast<size_t>(m.n_layer))
    f.fail("no_rope_layers",
           str("has ", flags.size(), " entries for ", m.n_layer, " layers (num_hidden_layers)"));
  for (int l = 0; l < m.n_layer; ++l) {
    bool rotates = (l + 1) % interval != 0;
    if (flags.is_array()) {
      const json& v = flags[static_cast<size_t>(l)];
      if (!(v == 0 || v == 1))
        f.fail("no_rope_layers", str("entry ", l, " is ", v.dump(), "; expected 0 or 1"));
      rotates = v == 1;
    }
    if (!rotates) m.nope_layers.values.push_back(l);
  }
}

// The llama-style model types (llama_dialects()), as the engine's llama family. Each may
// give head_dim apart from hidden_size / num_attention_heads; a sliding window is computed
// exactly within it (full causal attention equals it there).
ModelConfig parse_llama(const Fields& f, const LlamaDialect& d) {
  ModelConfig m;
  m.family = "llama";
  m.qkv_bias = d.qkv_bias;
  m.qk_norm = d.qk_norm;
  if (d.post_norm) {
    m.norm_position = NormPosition::kPost;
    m.qk_norm_span = QkNormSpan::kProjection;
  }
  m.n_layer = f.integer("num_hidden_layers", 1, kMaxLayers);
  m.n_head = f.integer("num_attention_heads", 1, kMaxDim);
  m.d_model = f.integer("hidden_size", 1, kMaxDim);
  if (f.present("head_dim")) {
    const int D = f.integer("head_dim", 1, 2 * kMaxRopePairs);
    // The canonical form: 0 where it is hidden_size / heads.
    m.head_dim = m.d_model % m.n_head == 0 && D == m.d_model / m.n_head ? 0 : D;
  } else if (m.d_model % m.n_head != 0) {
    f.fail("hidden_size", str("value ", m.d_model, " is not a multiple of num_attention_heads (",
                              m.n_head, ") and there is no head_dim"));
  }
  if (m.head_size() % 2 != 0)
    f.fail(m.head_dim ? "head_dim" : "hidden_size",
           str("head size ", m.head_size(), " is odd; rotary embeddings need an even one"));
  if (m.head_size() > 2 * kMaxRopePairs)
    f.fail("hidden_size",
           str("head size ", m.head_size(), " is over the engine's ", 2 * kMaxRopePairs));
  m.n_kv_head = f.integer_or("num_key_value_heads", m.n_head, 1, kMaxDim);
  if (m.n_head % m.n_kv_head != 0)
    f.fail("num_key_value_heads",
           str("value ", m.n_kv_head, " does not divide num_attention_heads (", m.n_head, ")"));
  m.d_ff = f.integer("intermediate_size", 1, kMaxFfDim);
  m.vocab_size = f.integer("vocab_size", 2, kMaxVocab);
  const int max_positions =
      f.integer_or("max_position_embeddings", d.default_positions, 1, kMaxDim);
  m.seq_len = max_positions;
  // The engine keeps these as 32-bit floats: the ranges are checked on the rounded value (a
  // 1e-46 is above 0 but rounds to 0, which the engine's config then refuses).
  const float init = static_cast<float>(f.number_or("initializer_range", 0.02));
  if (init > 0 && init < 10) m.init_std = init;
  const double eps = f.number_or("rms_norm_eps", d.default_eps);
  m.norm_eps = static_cast<float>(eps);
  if (!(m.norm_eps > 0 && m.norm_eps < 1))
    f.fail("rms_norm_eps", str("value ", eps, " is not in (0, 1) as a 32-bit float"));
  RopeReader(f, m, max_positions, d.class_original_context, d.class_original_context > 0,
             d.default_theta > 0 ? d.default_theta : 10000.0)
      .read();
  // Read by transformers' longrope alone (the class keeps it for every config).
  if (d.class_original_context) (void)f.value("original_max_position_embeddings");
  if (m.rope_type == "dynamic" || m.rope_type == "longrope")
    m.seq_len = std::min(m.seq_len, m.rope_original_context);
  m.tie_embeddings = f.boolean_or("tie_word_embeddings", d.default_tied);
  if (d.nope) read_nope_layers(f, m);
  std::string act = f.string_or("hidden_act", "silu");
  if (act != "silu")
    f.fail("hidden_act", str("'", act, "' is not supported: the engine's gated MLP uses silu"));
  f.expect("partial_rotary_factor", 1.0, "the engine rotates whole heads");
  f.expect("pretraining_tp", 1, "transformers 5 ignores it; the engine takes it as 1");
  if (d.attention_bias_key)
    f.expect("attention_bias", false,
             "it also puts a bias on o_proj; Qwen2-style q/k/v biases are, as model_type qwen2");
  if (d.mlp_bias_key) f.expect("mlp_bias", false, "the engine's MLP has no biases");
  if (d.window == LlamaDialect::Window::kQwen) read_qwen2_window(f, m.n_layer);
  if (d.window == LlamaDialect::Window::kUniform) {
    // The class's default window where the key is absent (MistralConfig 4096, Phi3Config
    // none); null turns it off (Mistral v0.2 and later).
    m.sliding_window = f.has_key("sliding_window") ? f.integer_or("sliding_window", 0, 1, kMaxDim)
                                                   : d.default_window;
    if (m.sliding_window > 0) m.seq_len = std::min(m.seq_len, m.sliding_window);
  }
  return m;
}

}  // namespace

ModelConfig parse_hf_config(const std::string& json_text, const std::string& source,
                            std::string* model_type_out) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    throw ConfigError(str(source, ": not valid JSON: ", e.what()));
  }
  if (!j.is_object()) throw ConfigError(str(source, ": config.json must be a JSON object"));
  Fields f(j, source);
  std::string model_type = f.string("model_type");
  ModelConfig m;
  if (model_type == "gpt2")
    m = parse_gpt2(f);
  else if (model_type == "opt")
    m = parse_opt(f);
  else if (const LlamaDialect* d = find_llama_dialect(model_type))
    m = parse_llama(f, *d);
  else
    f.fail("model_type",
           str("'", model_type, "' is not supported (supported: ", join(hf_model_types()), ")"));
  f.finish(model_type);
  if (model_type_out) *model_type_out = model_type;
  return m;
}

std::vector<std::string> hf_model_types() {
  std::vector<std::string> types = {"gpt2", "opt"};
  for (const LlamaDialect& d : llama_dialects()) types.push_back(d.model_type);
  return types;
}

namespace {

bool dialect_computes(const LlamaDialect& d, const ModelConfig& cfg) {
  const bool rope_ok =
      d.class_original_context == 0 || cfg.rope_type == "default" || cfg.rope_type == "longrope";
  const bool post = cfg.norm_position == NormPosition::kPost;
  const bool projection = cfg.qk_norm && cfg.qk_norm_span == QkNormSpan::kProjection;
  return d.qkv_bias == cfg.qkv_bias && d.qk_norm == cfg.qk_norm && d.post_norm == post &&
         d.post_norm == projection &&
         (cfg.sliding_window == 0 || d.window == LlamaDialect::Window::kUniform) && rope_ok &&
         (cfg.nope_layers.empty() || d.nope);
}

}  // namespace

std::string hf_model_type(const ModelConfig& cfg, const std::string& base_model_type) {
  if (cfg.family != "llama") return cfg.family;
  if (const LlamaDialect* d = find_llama_dialect(base_model_type))
    if (dialect_computes(*d, cfg)) return d->model_type;
  for (const LlamaDialect& d : llama_dialects())
    if (dialect_computes(d, cfg)) return d.model_type;
  throw ConfigError(
      str("no Hugging Face model type computes this llama-family model (qkv_bias ", cfg.qkv_bias,
          ", qk_norm ", cfg.qk_norm, ", qk_norm_span ",
          cfg.qk_norm_span == QkNormSpan::kProjection ? "projection" : "head", ", norm_position ",
          cfg.norm_position == NormPosition::kPost ? "post" : "pre", ", sliding_window ",
          cfg.sliding_window, ", rope_type ", cfg.rope_type, ")"));
}

ModelConfig load_hf_config(const std::string& path, std::string* model_type) {
  // A config.json is a few kilobytes; a file this large is the wrong one.
  constexpr uint64_t kMaxHfConfigBytes = 16ull << 20;
  std::string text;
  try {
    text = read_file_bounded(path, kMaxHfConfigBytes, "config.json");
  } catch (const IoError& e) {
    throw ConfigError(str(e.what(), " (a Hugging Face model directory needs config.json)"));
  }
  return parse_hf_config(text, path, model_type);
}

namespace {

// The kept source value when it rounds to the engine's float (1e-06 stays 1e-06), else the
// float printed with the digits that give it back.
void keep_float(nlohmann::ordered_json& j, const char* key, float v) {
  if (j.contains(key) && j[key].is_number() && static_cast<float>(j[key].get<double>()) == v)
    return;
  j[key] = std::stod(str(std::setprecision(9), v));
}

// The rotary settings in both forms transformers reads, saying the same: rope_parameters
// (5.x, with rope_theta inside) and rope_theta + rope_scaling (4.x; null for the default).
void write_rope(nlohmann::ordered_json& j, const ModelConfig& cfg) {
  nlohmann::ordered_json kept = j.contains("rope_parameters") && j["rope_parameters"].is_object()
                                    ? j["rope_parameters"]
                                    : nlohmann::ordered_json::object();
  nlohmann::ordered_json p = nlohmann::ordered_json::object();
  p["rope_type"] = cfg.rope_type;
  keep_float(p, "rope_theta", cfg.rope_theta);
  auto put = [&](const char* key, float v) {
    if (kept.contains(key)) p[key] = kept[key];
    keep_float(p, key, v);
  };
  if (cfg.rope_type != "default") put("factor", cfg.rope_factor);
  if (cfg.rope_type == "llama3") {
    put("low_freq_factor", cfg.rope_low_freq_factor);
    put("high_freq_factor", cfg.rope_high_freq_factor);
  }
  if (cfg.rope_type == "llama3" || cfg.rope_type == "yarn" || cfg.rope_type == "longrope")
    p["original_max_position_embeddings"] = cfg.rope_original_context;
  if (cfg.rope_type == "longrope") {
    auto list = [](const FloatList& l) {
      nlohmann::ordered_json a = nlohmann::ordered_json::array();
      for (float x : l.values) a.push_back(std::stod(str(std::setprecision(9), x)));
      return a;
    };
    // Nine digits give each float back (transformers reads them into fp32 tensors).
    p["short_factor"] = list(cfg.rope_short_factor);
    p["long_factor"] = list(cfg.rope_long_factor);
    put("attention_factor", cfg.rope_attention_factor);
  }
  if (cfg.rope_type == "yarn") {
    put("beta_fast", cfg.rope_beta_fast);
    put("beta_slow", cfg.rope_beta_slow);
    p["truncate"] = cfg.rope_truncate;
    put("attention_factor", cfg.rope_attention_factor);
  }
  // A top-level original_max_position_embeddings takes priority in transformers 5.
  if (j.contains("original_max_position_embeddings") && cfg.rope_original_context > 0)
    j["original_max_position_embeddings"] = cfg.rope_original_context;
  j["rope_parameters"] = p;
  keep_float(j, "rope_theta", cfg.rope_theta);
  if (cfg.rope_type == "default") {
    j["rope_scaling"] = nullptr;
  } else {
    nlohmann::ordered_json legacy = p;
    legacy.erase("rope_theta");
    j["rope_scaling"] = legacy;
  }
}

}  // namespace

std::string hf_config_json(const ModelConfig& cfg, StDtype dtype, const std::string& base_json) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!base_json.empty()) {
    try {
      j = nlohmann::ordered_json::parse(base_json);
    } catch (const nlohmann::json::exception& e) {
      throw ConfigError(str("kept config.json: not valid JSON: ", e.what()));
    }
    if (!j.is_object()) throw ConfigError("kept config.json: not a JSON object");
  }
  const char* torch_dtype = dtype == StDtype::kBF16  ? "bfloat16"
                            : dtype == StDtype::kF16 ? "float16"
                                                     : "float32";
  if (cfg.family == "opt") {
    j["model_type"] = "opt";
    j["architectures"] = {"OPTForCausalLM"};
    j["num_hidden_layers"] = cfg.n_layer;
    j["num_attention_heads"] = cfg.n_head;
    j["hidden_size"] = cfg.d_model;
    j["word_embed_proj_dim"] = cfg.d_model;
    j["ffn_dim"] = cfg.d_ff;
    j["max_position_embeddings"] = cfg.position_table();
    j["vocab_size"] = cfg.vocab_size;
    j["activation_function"] = "relu";
    j["do_layer_norm_before"] = true;
    j["_remove_final_layer_norm"] = false;
    j["enable_bias"] = true;
    j["layer_norm_elementwise_affine"] = true;
    j["tie_word_embeddings"] = true;
    if (!j.contains("init_std")) j["init_std"] = cfg.init_std;
  } else if (cfg.family == "llama") {
    // The base's model type where it computes the model, else the first that does.
    const std::string base_type = j.contains("model_type") && j["model_type"].is_string()
                                      ? j["model_type"].get<std::string>()
                                      : "";
    const LlamaDialect& d = *find_llama_dialect(hf_model_type(cfg, base_type));
    j["model_type"] = d.model_type;
    j["architectures"] = {d.architecture};
    j["head_dim"] = cfg.head_size();
    j["num_hidden_layers"] = cfg.n_layer;
    j["num_attention_heads"] = cfg.n_head;
    j["num_key_value_heads"] = cfg.kv_heads();
    j["hidden_size"] = cfg.d_model;
    j["intermediate_size"] = cfg.d_ff;
    // A fine-tune may train at a shorter seq_len than the model's context: keep the source's.
    if (!j.contains("max_position_embeddings"))
      j["max_position_embeddings"] =
          cfg.rope_type == "dynamic" ? cfg.rope_original_context : cfg.seq_len;
    j["vocab_size"] = cfg.vocab_size;
    j["hidden_act"] = "silu";
    keep_float(j, "rms_norm_eps", cfg.norm_eps);
    write_rope(j, cfg);
    j["tie_word_embeddings"] = cfg.tie_embeddings;
    if (d.attention_bias_key) j["attention_bias"] = false;
    if (d.mlp_bias_key && j.contains("mlp_bias")) j["mlp_bias"] = false;
    if (d.window == LlamaDialect::Window::kQwen) j["use_sliding_window"] = false;
    if (d.window == LlamaDialect::Window::kUniform)
      j["sliding_window"] = cfg.sliding_window > 0 ? nlohmann::ordered_json(cfg.sliding_window)
                                                   : nlohmann::ordered_json(nullptr);
    if (d.nope) {
      nlohmann::ordered_json flags = nlohmann::ordered_json::array();
      for (int l = 0; l < cfg.n_layer; ++l) flags.push_back(cfg.rotates(l) ? 1 : 0);
      j["no_rope_layers"] = flags;
    }
    // The class's own original context takes the place of the rotary parameters' one.
    if (d.class_original_context && cfg.rope_original_context > 0)
      j["original_max_position_embeddings"] = cfg.rope_original_context;
    if (!j.contains("initializer_range")) j["initializer_range"] = cfg.init_std;
  } else {
    j["model_type"] = "gpt2";
    j["architectures"] = {"GPT2LMHeadModel"};
    j["n_layer"] = cfg.n_layer;
    j["n_head"] = cfg.n_head;
    j["n_embd"] = cfg.d_model;
    // null is how GPT2Config says "4 * n_embd"; keep an explicit width only when it differs.
    if (cfg.d_ff == 4 * cfg.d_model)
      j["n_inner"] = nullptr;
    else
      j["n_inner"] = cfg.d_ff;
    j["n_positions"] = cfg.position_table();
    if (j.contains("n_ctx")) j["n_ctx"] = cfg.position_table();  // older configs repeat it here
    j["vocab_size"] = cfg.vocab_size;
    j["activation_function"] = "gelu_new";
    j["layer_norm_epsilon"] = kEngineLayerNormEps;
    j["tie_word_embeddings"] = true;
    j["scale_attn_weights"] = true;
    j["scale_attn_by_inverse_layer_idx"] = false;
    j["reorder_and_upcast_attn"] = false;
    if (!j.contains("initializer_range")) j["initializer_range"] = cfg.init_std;
  }
  // transformers 5 reads `dtype`, 4.x `torch_dtype`: both say the same.
  j["dtype"] = torch_dtype;
  j["torch_dtype"] = torch_dtype;
  return j.dump(2) + "\n";
}

std::optional<StDtype> hf_torch_dtype(const std::string& config_json) {
  nlohmann::json j = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return std::nullopt;
  // transformers 5 writes `dtype`; 4.x wrote `torch_dtype`.
  const char* key = j.contains("dtype") && j["dtype"].is_string() ? "dtype" : "torch_dtype";
  if (!j.contains(key) || !j[key].is_string()) return std::nullopt;
  const std::string t = j[key].get<std::string>();
  if (t == "bfloat16") return StDtype::kBF16;
  if (t == "float16") return StDtype::kF16;
  if (t == "float32") return StDtype::kF32;
  return std::nullopt;
}

std::string hf_tokenizer_config_json(const std::string& config_json, const Tokenizer& tok) {
  nlohmann::json cfg = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (!cfg.is_object()) throw ConfigError("config.json: not a JSON object");
  // The token of an id field (an integer, or a list whose first entry is one) when the
  // vocabulary has it.
  auto token_of = [&](const char* key) -> std::string {
    if (!cfg.contains(key)) return "";
    nlohmann::json v = cfg[key];
    if (v.is_array() && !v.empty()) v = v[0];
    if (!v.is_number_integer()) return "";
    const int64_t id = v.get<int64_t>();
    if (id < 0 || id >= static_cast<int64_t>(tok.vocab_size())) return "";
    return tok.id_to_token(static_cast<int32_t>(id));
  };
  const std::string type = cfg.value("model_type", std::string());
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  std::string bos = token_of("bos_token_id"), eos = token_of("eos_token_id"),
              pad = token_of("pad_token_id");
  std::string unk = tok.token_to_id("<unk>") ? "<unk>" : "";
  // GPT-2's tokenizer uses its end-of-text token for all three; the class's default
  // ("<|endoftext|>") would otherwise be added to a vocabulary that lacks it.
  if (type != "llama") {
    if (bos.empty()) bos = eos;
    if (unk.empty()) unk = eos;
  }
  if (type == "llama") {
    // LlamaTokenizerFast's own defaults, written out: a prompt starts with BOS.
    out["add_bos_token"] = true;
    out["add_eos_token"] = false;
  }
  if (!bos.empty()) out["bos_token"] = bos;
  if (!eos.empty()) out["eos_token"] = eos;
  if (!unk.empty()) out["unk_token"] = unk;
  out["pad_token"] = pad.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(pad);
  for (const char* key : {"max_position_embeddings", "n_positions"})
    if (cfg.contains(key) && cfg[key].is_number_integer()) {
      out["model_max_length"] = cfg[key];
      break;
    }
  // Decoded text as the tokenizer's decoder gives it (fuyou-generate prints the same).
  out["clean_up_tokenization_spaces"] = false;
  return out.dump(2) + "\n";
}

std::string engine_config_yaml(const ModelConfig& cfg) {
  std::string out =
      str("# fuyou checkpoint: the model section of the engine config (docs/checkpoints.md)\n",
          "model:\n", "  family: ", cfg.family, "\n", "  n_layer: ", cfg.n_layer, "\n",
          "  n_head: ", cfg.n_head, "\n", "  d_model: ", cfg.d_model, "\n", "  d_ff: ", cfg.d_ff,
          "\n", "  vocab_size: ", cfg.vocab_size, "\n", "  seq_len: ", cfg.seq_len, "\n",
          "  init_std: ", cfg.init_std, "\n");
  if (cfg.positions) out += str("  positions: ", cfg.positions, "\n");
  if (cfg.family == "llama" && cfg.head_dim) out += str("  head_dim: ", cfg.head_dim, "\n");
  if (cfg.family == "llama" && cfg.qk_norm) out += "  qk_norm: true\n";
  if (cfg.qk_norm_span == QkNormSpan::kProjection) out += "  qk_norm_span: projection\n";
  if (cfg.norm_position == NormPosition::kPost) out += "  norm_position: post\n";
  if (cfg.family == "llama")
    out += str("  n_kv_head: ", cfg.kv_heads(), "\n", "  norm_eps: ", std::setprecision(9),
               cfg.norm_eps, "\n", "  rope_theta: ", cfg.rope_theta, "\n",
               "  tie_embeddings: ", cfg.tie_embeddings ? "true" : "false", "\n",
               "  qkv_bias: ", cfg.qkv_bias ? "true" : "false", "\n");
  if (cfg.family == "llama" && cfg.rope_type != "default") {
    out += str("  rope_type: ", cfg.rope_type, "\n", "  rope_factor: ", std::setprecision(9),
               cfg.rope_factor, "\n");
    if (cfg.rope_original_context > 0)
      out += str("  rope_original_context: ", cfg.rope_original_context, "\n");
    if (cfg.rope_type == "llama3")
      out += str("  rope_low_freq_factor: ", std::setprecision(9), cfg.rope_low_freq_factor, "\n",
                 "  rope_high_freq_factor: ", cfg.rope_high_freq_factor, "\n");
    if (cfg.rope_type == "yarn")
      out += str("  rope_beta_fast: ", std::setprecision(9), cfg.rope_beta_fast, "\n",
                 "  rope_beta_slow: ", cfg.rope_beta_slow, "\n",
                 "  rope_truncate: ", cfg.rope_truncate ? "true" : "false", "\n",
                 "  rope_attention_factor: ", cfg.rope_attention_factor, "\n");
    if (cfg.rope_type == "longrope")
      out += str("  rope_attention_factor: ", std::setprecision(9), cfg.rope_attention_factor, "\n",
                 "  rope_short_factor: ", cfg.rope_short_factor, "\n",
                 "  rope_long_factor: ", cfg.rope_long_factor, "\n");
  }
  if (cfg.sliding_window > 0) out += str("  sliding_window: ", cfg.sliding_window, "\n");
  if (!cfg.nope_layers.empty()) out += str("  nope_layers: ", cfg.nope_layers, "\n");
  return out;
}

// Every row is one Hugging Face tensor. Several rows may fill one engine tensor (q, k and v
// projections are packed into c_attn, gate and up into c_fc): they come in the engine
// tensor's row order with increasing engine_offset, so from-hf appends them in turn and
// to-hf reads each back as a contiguous range.
std::vector<HfTensorMap> hf_tensor_map(const ModelConfig& cfg, const std::string& model_type) {
  const int64_t C = cfg.d_model, F = cfg.d_ff, V = cfg.vocab_size, A = cfg.attn_width();
  const int64_t KV = static_cast<int64_t>(cfg.kv_heads()) * cfg.head_size();
  std::vector<HfTensorMap> out;
  auto same = [&](const std::string& engine, const std::string& hf, std::vector<int64_t> shape) {
    out.push_back({engine, hf, false, shape, shape, 0});
  };
  // Conv1D (gpt2) keeps its weight as (in, out): the transpose of nn.Linear's (out, in).
  auto conv = [&](const std::string& name, int64_t n_out, int64_t n_in) {
    out.push_back({name, "transformer." + name, true, {n_out, n_in}, {n_in, n_out}, 0});
  };
  // Rows [row0, row0 + rows) of a packed engine tensor of shape `full`.
  auto part = [&](const std::string& engine, const std::string& hf, std::vector<int64_t> full,
                  int64_t row0, int64_t rows) {
    std::vector<int64_t> shape = full;
    shape[0] = rows;
    int64_t cols = full.size() > 1 ? full[1] : 1;
    out.push_back({engine, hf, false, full, shape, row0 * cols});
  };
  if (cfg.family == "gpt2") {
    const int64_t T = cfg.position_table();
    auto g = [&](const std::string& name, std::vector<int64_t> shape) {
      same(name, "transformer." + name, shape);
    };
    g("wte.weight", {V, C});
    g("wpe.weight", {T, C});
    for (int l = 0; l < cfg.n_layer; ++l) {
      std::string p = str("h.", l, ".");
      g(p + "ln_1.weight", {C});
      g(p + "ln_1.bias", {C});
      conv(p + "attn.c_attn.weight", 3 * C, C);
      g(p + "attn.c_attn.bias", {3 * C});
      conv(p + "attn.c_proj.weight", C, C);
      g(p + "attn.c_proj.bias", {C});
      g(p + "ln_2.weight", {C});
      g(p + "ln_2.bias", {C});
      conv(p + "mlp.c_fc.weight", F, C);
      g(p + "mlp.c_fc.bias", {F});
      conv(p + "mlp.c_proj.weight", C, F);
      g(p + "mlp.c_proj.bias", {C});
    }
    g("ln_f.weight", {C});
    g("ln_f.bias", {C});
  } else if (cfg.family == "opt") {
    const std::string d = "model.decoder.";
    same("wte.weight", d + "embed_tokens.weight", {V, C});
    same("wpe.weight", d + "embed_positions.weight", {cfg.position_table() + 2, C});
    for (int l = 0; l < cfg.n_layer; ++l) {
      std::string p = str("h.", l, "."), h = str(d, "layers.", l, ".");
      same(p + "ln_1.weight", h + "self_attn_layer_norm.weight", {C});
      same(p + "ln_1.bias", h + "self_attn_layer_norm.bias", {C});
      const char* qkv[] = {"q_proj", "k_proj", "v_proj"};
      for (int i = 0; i < 3; ++i)
        part(p + "attn.c_attn.weight", h + "self_attn." + qkv[i] + ".weight", {3 * C, C}, i * C, C);
      for (int i = 0; i < 3; ++i)
        part(p + "attn.c_attn.bias", h + "self_attn." + qkv[i] + ".bias", {3 * C}, i * C, C);
      same(p + "attn.c_proj.weight", h + "self_attn.out_proj.weight", {C, C});
      same(p + "attn.c_proj.bias", h + "self_attn.out_proj.bias", {C});
      same(p + "ln_2.weight", h + "final_layer_norm.weight", {C});
      same(p + "ln_2.bias", h + "final_layer_norm.bias", {C});
      same(p + "mlp.c_fc.weight", h + "fc1.weight", {F, C});
      same(p + "mlp.c_fc.bias", h + "fc1.bias", {F});
      same(p + "mlp.c_proj.weight", h + "fc2.weight", {C, F});
      same(p + "mlp.c_proj.bias", h + "fc2.bias", {C});
    }
    same("ln_f.weight", d + "final_layer_norm.weight", {C});
    same("ln_f.bias", d + "final_layer_norm.bias", {C});
  } else if (cfg.family == "llama") {
    const std::string type = model_type.empty() ? hf_model_type(cfg) : model_type;
    const LlamaDialect* d = find_llama_dialect(type);
    if (!d || !dialect_computes(*d, cfg))
      throw ConfigError(str("model_type '", type, "' does not name this model's tensors"));
    same("wte.weight", "model.embed_tokens.weight", {V, C});
    for (int l = 0; l < cfg.n_layer; ++l) {
      std::string p = str("h.", l, "."), h = str("model.layers.", l, ".");
      // Post-norm (OLMo 2): ln_1 and ln_2 normalise the attention's and the MLP's outputs.
      const std::string ln1 = d->post_norm ? "post_attention_layernorm" : "input_layernorm";
      const std::string ln2 =
          d->post_norm ? "post_feedforward_layernorm" : "post_attention_layernorm";
      same(p + "ln_1.weight", h + ln1 + ".weight", {C});
      const std::vector<int64_t> qkv_w = {A + 2 * KV, C}, qkv_b = {A + 2 * KV};
      if (d->fused) {  // q|k|v in the engine's order already
        same(p + "attn.c_attn.weight", h + "self_attn.qkv_proj.weight", qkv_w);
      } else {
        part(p + "attn.c_attn.weight", h + "self_attn.q_proj.weight", qkv_w, 0, A);
        part(p + "attn.c_attn.weight", h + "self_attn.k_proj.weight", qkv_w, A, KV);
        part(p + "attn.c_attn.weight", h + "self_attn.v_proj.weight", qkv_w, A + KV, KV);
      }
      if (cfg.qkv_bias) {
        part(p + "attn.c_attn.bias", h + "self_attn.q_proj.bias", qkv_b, 0, A);
        part(p + "attn.c_attn.bias", h + "self_attn.k_proj.bias", qkv_b, A, KV);
        part(p + "attn.c_attn.bias", h + "self_attn.v_proj.bias", qkv_b, A + KV, KV);
      }
      if (cfg.qk_norm) {
        // Per head (Qwen3) or over the whole projections (OLMo 2).
        const bool whole = cfg.qk_norm_span == QkNormSpan::kProjection;
        same(p + "attn.q_norm.weight", h + "self_attn.q_norm.weight",
             {whole ? A : cfg.head_size()});
        same(p + "attn.k_norm.weight", h + "self_attn.k_norm.weight",
             {whole ? KV : cfg.head_size()});
      }
      same(p + "attn.c_proj.weight", h + "self_attn.o_proj.weight", {C, A});
      same(p + "ln_2.weight", h + ln2 + ".weight", {C});
      if (d->fused) {  // gate|up, as the engine packs them
        same(p + "mlp.c_fc.weight", h + "mlp.gate_up_proj.weight", {2 * F, C});
      } else {
        part(p + "mlp.c_fc.weight", h + "mlp.gate_proj.weight", {2 * F, C}, 0, F);
        part(p + "mlp.c_fc.weight", h + "mlp.up_proj.weight", {2 * F, C}, F, F);
      }
      same(p + "mlp.c_proj.weight", h + "mlp.down_proj.weight", {C, F});
    }
    same("ln_f.weight", "model.norm.weight", {C});
    if (!cfg.tie_embeddings) same("lm_head.weight", "lm_head.weight", {V, C});
  } else {
    throw ConfigError(str("model.family '", cfg.family, "' has no Hugging Face mapping"));
  }
  return out;
}

}  // namespace fuyou
