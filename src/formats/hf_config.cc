// Hugging Face config.json for the GPT-2 family, in and out, and the tensor-name mapping.
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "fuyou/error.h"
#include "fuyou/hf_checkpoint.h"

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
    if (!j_.contains(key)) fail(key, "missing (a GPT-2 config.json must give it)");
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
constexpr int kMaxDim = 1 << 20;

}  // namespace

const std::vector<std::string>& tokenizer_file_names() {
  static const std::vector<std::string> names = {"tokenizer.json", "tokenizer_config.json",
                                                 "vocab.json", "merges.txt",
                                                 "special_tokens_map.json"};
  return names;
}

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
  if (model_type != "gpt2")
    f.fail("model_type", str("'", model_type,
                             "' is not supported (supported: gpt2; opt and llama "
                             "need model families the engine does not have yet)"));
  ModelConfig m;
  m.family = "gpt2";
  m.n_layer = f.integer("n_layer", 1, 1024);
  m.n_head = f.integer("n_head", 1, kMaxDim);
  m.d_model = f.integer("n_embd", 1, kMaxDim);
  if (m.d_model % m.n_head != 0)
    f.fail("n_embd", str("value ", m.d_model, " is not a multiple of n_head (", m.n_head, ")"));
  m.d_ff = f.integer_or("n_inner", 4 * m.d_model, 1, 4 * kMaxDim);
  m.vocab_size = f.integer("vocab_size", 2, std::numeric_limits<int>::max());
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

ModelConfig load_hf_config(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw ConfigError(str(path,
                          ": cannot open (a Hugging Face model directory needs "
                          "config.json)"));
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_hf_config(ss.str(), path);
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
  j["torch_dtype"] = torch_dtype;
  return j.dump(2) + "\n";
}

std::string engine_config_yaml(const ModelConfig& cfg) {
  return str("# fuyou checkpoint: the model section of the engine config (docs/checkpoints.md)\n",
             "model:\n", "  family: ", cfg.family, "\n", "  n_layer: ", cfg.n_layer, "\n",
             "  n_head: ", cfg.n_head, "\n", "  d_model: ", cfg.d_model, "\n", "  d_ff: ", cfg.d_ff,
             "\n", "  vocab_size: ", cfg.vocab_size, "\n", "  seq_len: ", cfg.seq_len, "\n",
             "  init_std: ", cfg.init_std, "\n");
}

std::vector<HfTensorMap> gpt2_hf_tensor_map(const ModelConfig& cfg) {
  const int64_t C = cfg.d_model, F = cfg.d_ff, V = cfg.vocab_size, T = cfg.seq_len;
  std::vector<HfTensorMap> out;
  auto same = [&](const std::string& name, std::vector<int64_t> shape) {
    out.push_back({name, name, false, shape, shape});
  };
  // Conv1D keeps its weight as (in, out): the transpose of nn.Linear's (out, in).
  auto conv = [&](const std::string& name, int64_t n_out, int64_t n_in) {
    out.push_back({name, name, true, {n_out, n_in}, {n_in, n_out}});
  };
  same("wte.weight", {V, C});
  same("wpe.weight", {T, C});
  for (int l = 0; l < cfg.n_layer; ++l) {
    std::string p = str("h.", l, ".");
    same(p + "ln_1.weight", {C});
    same(p + "ln_1.bias", {C});
    conv(p + "attn.c_attn.weight", 3 * C, C);
    same(p + "attn.c_attn.bias", {3 * C});
    conv(p + "attn.c_proj.weight", C, C);
    same(p + "attn.c_proj.bias", {C});
    same(p + "ln_2.weight", {C});
    same(p + "ln_2.bias", {C});
    conv(p + "mlp.c_fc.weight", F, C);
    same(p + "mlp.c_fc.bias", {F});
    conv(p + "mlp.c_proj.weight", C, F);
    same(p + "mlp.c_proj.bias", {C});
  }
  same("ln_f.weight", {C});
  same("ln_f.bias", {C});
  return out;
}

}  // namespace fuyou
