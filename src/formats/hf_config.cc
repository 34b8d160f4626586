// Hugging Face config.json for the gpt2, opt and llama families, in and out, and the
// tensor-name mapping of each family (one row per Hugging Face tensor, in the order of the
// engine's own list, make_gpt_layout()).
#include <cmath>
#include <fstream>
#include <iomanip>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "fuyou/error.h"
#include "fuyou/hf_checkpoint.h"
#include "fuyou/read_file.h"
#include "fuyou/tokenizer.h"

namespace fuyou {
namespace {

using json = nlohmann::json;

// Typed, checked access to config.json fields. Every failure names the file and the field;
// nothing here lets a nlohmann exception escape, so a malformed file is always a
// ConfigError (the fuzz test in tests/test_hf.cc holds us to that).
class Fields {
 public:
  Fields(const json& j, std::string source) : j_(j), source_(std::move(source)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& why) const {
    throw ConfigError(str(source_, ": field '", key, "': ", why));
  }

  bool present(const std::string& key) const { return j_.contains(key) && !j_[key].is_null(); }

  const json& required(const std::string& key) const {
    if (!j_.contains(key)) fail(key, "missing (this model type's config.json must give it)");
    if (j_[key].is_null()) fail(key, "is null; a value is required");
    return j_[key];
  }

  int integer(const std::string& key, int lo, int hi) const {
    const json& v = required(key);
    return checked_int(key, v, lo, hi);
  }

  int integer_or(const std::string& key, int fallback, int lo, int hi) const {
    return present(key) ? checked_int(key, j_[key], lo, hi) : fallback;
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

 private:
  int checked_int(const std::string& key, const json& v, int lo, int hi) const {
    if (!v.is_number_integer()) fail(key, str("expected an integer, got ", v.dump()));
    // Compare in the widest type first: a huge unsigned must not wrap into range.
    if (v.is_number_unsigned()) {
      uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(hi)) fail(key, str("value ", u, " is not in ", lo, "..", hi));
      if (static_cast<int64_t>(u) < lo) fail(key, str("value ", u, " is not in ", lo, "..", hi));
      return static_cast<int>(u);
    }
    int64_t s = v.get<int64_t>();
    if (s < lo || s > hi) fail(key, str("value ", s, " is not in ", lo, "..", hi));
    return static_cast<int>(s);
  }

  const json& j_;
  std::string source_;
};

// The engine's LayerNorm epsilon (kernels use 1e-5, as GPT-2 does).
constexpr double kEngineLayerNormEps = 1e-5;
// The engine config's own bounds (include/fuyou/config.h), so that every config.json
// accepted here converts into a config.yaml that parse_config accepts.
constexpr int kMaxDim = kMaxModelDim;

}  // namespace

const std::vector<std::string>& tokenizer_file_names() {
  static const std::vector<std::string> names = {
      "tokenizer.json",          "tokenizer_config.json", "vocab.json",       "merges.txt",
      "special_tokens_map.json", "tokenizer.model",       "added_tokens.json"};
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

// Llama 2/3 (model_type llama) and, with q/k/v biases, Qwen2 (model_type qwen2).
ModelConfig parse_llama(const Fields& f, bool qwen2) {
  ModelConfig m;
  m.family = "llama";
  m.qkv_bias = qwen2;
  m.n_layer = f.integer("num_hidden_layers", 1, kMaxLayers);
  m.n_head = f.integer("num_attention_heads", 1, kMaxDim);
  m.d_model = f.integer("hidden_size", 1, kMaxDim);
  if (m.d_model % m.n_head != 0)
    f.fail("hidden_size",
           str("value ", m.d_model, " is not a multiple of num_attention_heads (", m.n_head, ")"));
  if ((m.d_model / m.n_head) % 2 != 0)
    f.fail("hidden_size",
           str("head size ", m.d_model / m.n_head, " is odd; rotary embeddings need an even one"));
  if (f.present("head_dim") && f.integer("head_dim", 1, kMaxDim) != m.d_model / m.n_head)
    f.fail("head_dim", str("value ", f.integer("head_dim", 1, kMaxDim),
                           " is not supported: the engine's head size is hidden_size / "
                           "num_attention_heads (",
                           m.d_model / m.n_head, ")"));
  m.n_kv_head = f.integer_or("num_key_value_heads", m.n_head, 1, kMaxDim);
  if (m.n_head % m.n_kv_head != 0)
    f.fail("num_key_value_heads",
           str("value ", m.n_kv_head, " does not divide num_attention_heads (", m.n_head, ")"));
  m.d_ff = f.integer("intermediate_size", 1, kMaxFfDim);
  m.vocab_size = f.integer("vocab_size", 2, kMaxVocab);
  m.seq_len = f.integer_or("max_position_embeddings", 2048, 1, kMaxDim);
  // The engine keeps these as 32-bit floats: the ranges are checked on the rounded value (a
  // 1e-46 is above 0 but rounds to 0, which the engine's config then refuses).
  const float init = static_cast<float>(f.number_or("initializer_range", 0.02));
  if (init > 0 && init < 10) m.init_std = init;
  const double eps = f.number_or("rms_norm_eps", 1e-6);
  m.norm_eps = static_cast<float>(eps);
  if (!(m.norm_eps > 0 && m.norm_eps < 1))
    f.fail("rms_norm_eps", str("value ", eps, " is not in (0, 1) as a 32-bit float"));
  const double theta = f.number_or("rope_theta", 10000.0);
  m.rope_theta = static_cast<float>(theta);
  if (!(m.rope_theta > 1 && m.rope_theta < 1e12f))
    f.fail("rope_theta", str("value ", theta, " is not in (1, 1e12) as a 32-bit float"));
  // Qwen2's config class defaults to tied embeddings, Llama's to untied.
  m.tie_embeddings = f.boolean_or("tie_word_embeddings", qwen2);
  std::string act = f.string_or("hidden_act", "silu");
  if (act != "silu")
    f.fail("hidden_act", str("'", act, "' is not supported: the engine's gated MLP uses silu"));
  if (f.present("rope_scaling")) {
    std::string type = "?";
    try {
      const json& rs = f.required("rope_scaling");
      if (rs.is_object()) {
        for (const char* k : {"rope_type", "type"})
          if (rs.contains(k) && rs[k].is_string()) type = rs[k].get<std::string>();
      }
    } catch (const ConfigError&) {
    }
    if (type != "default")
      f.fail("rope_scaling", str("type '", type,
                                 "' is not supported: the engine implements plain rotary "
                                 "embeddings (rope_scaling null)"));
  }
  if (f.boolean_or("attention_bias", false))
    f.fail("attention_bias",
           "true is not supported (it also puts a bias on o_proj); Qwen2-style q/k/v biases "
           "are, as model_type qwen2");
  if (f.boolean_or("mlp_bias", false)) f.fail("mlp_bias", "true is not supported");
  if (qwen2 && f.boolean_or("use_sliding_window", false))
    f.fail("use_sliding_window", "true is not supported: attention is full causal");
  return m;
}

}  // namespace

ModelConfig parse_hf_config(const std::string& json_text, const std::string& source) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    throw ConfigError(str(source, ": not valid JSON: ", e.what()));
  }
  if (!j.is_object()) throw ConfigError(str(source, ": config.json must be a JSON object"));
  Fields f(j, source);
  std::string model_type = f.string("model_type");
  if (model_type == "gpt2") return parse_gpt2(f);
  if (model_type == "opt") return parse_opt(f);
  if (model_type == "llama") return parse_llama(f, false);
  if (model_type == "qwen2") return parse_llama(f, true);
  f.fail("model_type",
         str("'", model_type, "' is not supported (supported: gpt2, opt, llama, qwen2)"));
}

ModelConfig load_hf_config(const std::string& path) {
  // A config.json is a few kilobytes; a file this large is the wrong one.
  constexpr uint64_t kMaxHfConfigBytes = 16ull << 20;
  std::string text;
  try {
    text = read_file_bounded(path, kMaxHfConfigBytes, "config.json");
  } catch (const IoError& e) {
    throw ConfigError(str(e.what(), " (a Hugging Face model directory needs config.json)"));
  }
  return parse_hf_config(text, path);
}

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
    j["max_position_embeddings"] = cfg.seq_len;
    j["vocab_size"] = cfg.vocab_size;
    j["activation_function"] = "relu";
    j["do_layer_norm_before"] = true;
    j["_remove_final_layer_norm"] = false;
    j["enable_bias"] = true;
    j["layer_norm_elementwise_affine"] = true;
    j["tie_word_embeddings"] = true;
    if (!j.contains("init_std")) j["init_std"] = cfg.init_std;
  } else if (cfg.family == "llama") {
    j["model_type"] = cfg.qkv_bias ? "qwen2" : "llama";
    j["architectures"] = {cfg.qkv_bias ? "Qwen2ForCausalLM" : "LlamaForCausalLM"};
    j["num_hidden_layers"] = cfg.n_layer;
    j["num_attention_heads"] = cfg.n_head;
    j["num_key_value_heads"] = cfg.kv_heads();
    j["hidden_size"] = cfg.d_model;
    j["intermediate_size"] = cfg.d_ff;
    // A fine-tune may train at a shorter seq_len than the model's context: keep the source's.
    if (!j.contains("max_position_embeddings")) j["max_position_embeddings"] = cfg.seq_len;
    j["vocab_size"] = cfg.vocab_size;
    j["hidden_act"] = "silu";
    // The kept source value when it rounds to the engine's float (1e-06 stays 1e-06), else
    // the float printed with the digits that give it back.
    auto keep_float = [&](const char* key, float v) {
      if (j.contains(key) && j[key].is_number() && static_cast<float>(j[key].get<double>()) == v)
        return;
      j[key] = std::stod(str(std::setprecision(9), v));
    };
    keep_float("rms_norm_eps", cfg.norm_eps);
    keep_float("rope_theta", cfg.rope_theta);
    j["rope_scaling"] = nullptr;
    j["tie_word_embeddings"] = cfg.tie_embeddings;
    if (!cfg.qkv_bias) j["attention_bias"] = false;
    if (cfg.qkv_bias) j["use_sliding_window"] = false;
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
    j["n_positions"] = cfg.seq_len;
    if (j.contains("n_ctx")) j["n_ctx"] = cfg.seq_len;  // older configs repeat n_positions here
    j["vocab_size"] = cfg.vocab_size;
    j["activation_function"] = "gelu_new";
    j["layer_norm_epsilon"] = kEngineLayerNormEps;
    j["tie_word_embeddings"] = true;
    j["scale_attn_weights"] = true;
    j["scale_attn_by_inverse_layer_idx"] = false;
    j["reorder_and_upcast_attn"] = false;
    if (!j.contains("initializer_range")) j["initializer_range"] = cfg.init_std;
  }
  j["torch_dtype"] = torch_dtype;
  return j.dump(2) + "\n";
}

std::optional<StDtype> hf_torch_dtype(const std::string& config_json) {
  nlohmann::json j = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("torch_dtype") || !j["torch_dtype"].is_string())
    return std::nullopt;
  const std::string t = j["torch_dtype"].get<std::string>();
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
  if (cfg.family == "llama")
    out += str("  n_kv_head: ", cfg.kv_heads(), "\n", "  norm_eps: ", std::setprecision(9),
               cfg.norm_eps, "\n", "  rope_theta: ", cfg.rope_theta, "\n",
               "  tie_embeddings: ", cfg.tie_embeddings ? "true" : "false", "\n",
               "  qkv_bias: ", cfg.qkv_bias ? "true" : "false", "\n");
  return out;
}

// Every row is one Hugging Face tensor. Several rows may fill one engine tensor (q, k and v
// projections are packed into c_attn, gate and up into c_fc): they come in the engine
// tensor's row order with increasing engine_offset, so from-hf appends them in turn and
// to-hf reads each back as a contiguous range.
std::vector<HfTensorMap> hf_tensor_map(const ModelConfig& cfg) {
  const int64_t C = cfg.d_model, F = cfg.d_ff, V = cfg.vocab_size;
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
    const int64_t T = cfg.seq_len;
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
    same("wpe.weight", d + "embed_positions.weight", {cfg.seq_len + 2, C});
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
    same("wte.weight", "model.embed_tokens.weight", {V, C});
    for (int l = 0; l < cfg.n_layer; ++l) {
      std::string p = str("h.", l, "."), h = str("model.layers.", l, ".");
      same(p + "ln_1.weight", h + "input_layernorm.weight", {C});
      const std::vector<int64_t> qkv_w = {C + 2 * KV, C}, qkv_b = {C + 2 * KV};
      part(p + "attn.c_attn.weight", h + "self_attn.q_proj.weight", qkv_w, 0, C);
      part(p + "attn.c_attn.weight", h + "self_attn.k_proj.weight", qkv_w, C, KV);
      part(p + "attn.c_attn.weight", h + "self_attn.v_proj.weight", qkv_w, C + KV, KV);
      if (cfg.qkv_bias) {
        part(p + "attn.c_attn.bias", h + "self_attn.q_proj.bias", qkv_b, 0, C);
        part(p + "attn.c_attn.bias", h + "self_attn.k_proj.bias", qkv_b, C, KV);
        part(p + "attn.c_attn.bias", h + "self_attn.v_proj.bias", qkv_b, C + KV, KV);
      }
      same(p + "attn.c_proj.weight", h + "self_attn.o_proj.weight", {C, C});
      same(p + "ln_2.weight", h + "post_attention_layernorm.weight", {C});
      part(p + "mlp.c_fc.weight", h + "mlp.gate_proj.weight", {2 * F, C}, 0, F);
      part(p + "mlp.c_fc.weight", h + "mlp.up_proj.weight", {2 * F, C}, F, F);
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
