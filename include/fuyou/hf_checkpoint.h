// Hugging Face checkpoints in and out (fuyou-convert from-hf / to-hf): the gpt2, opt and
// llama families (llama with q/k/v biases is written as Qwen2).
//
// A Hugging Face model directory holds config.json and either model.safetensors or
// model-XXXXX-of-YYYYY.safetensors shards with model.safetensors.index.json. The engine's
// checkpoint directory (docs/checkpoints.md) holds config.yaml (the model section), the
// fp32 tensors of make_gpt_layout() under their engine names in model.safetensors (or the
// same sharded layout), and the tokenizer files copied through. Conversion streams tensor
// by tensor in bounded chunks: memory use does not grow with the model.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fuyou/config.h"
#include "fuyou/safetensors.h"

namespace fuyou {

class Tokenizer;

// File names shared by both layouts.
inline constexpr const char* kSingleWeightsFile = "model.safetensors";
inline constexpr const char* kWeightsIndexFile = "model.safetensors.index.json";
inline constexpr const char* kHfConfigFile = "config.json";
inline constexpr const char* kEngineConfigFile = "config.yaml";
// config.json of the source model, kept in an engine checkpoint so that to-hf can give
// back the fields the engine does not model (token ids, dropout, task settings).
inline constexpr const char* kKeptHfConfigFile = "hf_config.json";
// Hugging Face's generation defaults (eos ids among them), copied through when present.
inline constexpr const char* kGenerationConfigFile = "generation_config.json";

// Tokenizer files copied through in both directions when present.
const std::vector<std::string>& tokenizer_file_names();

// The files that travel with a model's weights from `from-hf` through fuyou-train's run
// directory and its training checkpoints to `to-hf` and fuyou-generate: the source's
// config.json (kept as hf_config.json: token ids, context length, rope settings, dtype), its
// generation_config.json and the tokenizer files.
const std::vector<std::string>& carried_file_names();
// Copies each carried file that from_dir holds into to_dir (each written to a temporary name,
// fsynced and renamed; one already in to_dir is replaced). Returns the names copied.
std::vector<std::string> copy_carried_files(const std::string& from_dir, const std::string& to_dir);
// Where the carried files of an engine checkpoint directory are: the directory itself when it
// holds any, else, for a training checkpoint RUN_DIR/checkpoints/step-N written before
// checkpoints carried them, its run directory when that holds any; else `dir`.
std::string carried_files_dir(const std::string& dir);

// Parses a config.json into the engine's model section. Everything the engine would compute
// differently is refused with a ConfigError naming `source` and the field.
// gpt2: activation_function gelu_new (or gelu_pytorch_tanh), layer_norm_epsilon 1e-5, tied
//   embeddings, no per-layer attention scaling, no cross attention. n_inner null means
//   4 * n_embd; n_positions becomes seq_len.
// opt: relu, pre-LN (do_layer_norm_before true), word_embed_proj_dim == hidden_size, biases,
//   tied head; max_position_embeddings becomes seq_len (the table has 2 more rows).
// llama and its dialects (llama_dialects() below): silu, attention_bias false (qwen2: q/k/v
//   biases), the rotary variants of docs/checkpoints.md; max_position_embeddings becomes
//   seq_len (bounded by a window or a variant's original context).
// `model_type`, when given, receives the file's model_type (it names the tensors: hf_tensor_map).
ModelConfig parse_hf_config(const std::string& json_text, const std::string& source,
                            std::string* model_type = nullptr);
ModelConfig load_hf_config(const std::string& path, std::string* model_type = nullptr);

// A Hugging Face model type that the engine's llama family computes: one row of the table
// below, so that a dialect is one line (docs/architecture.md, "Adding a family").
struct LlamaDialect {
  // How the config gives an attention window: none; Qwen's use_sliding_window,
  // max_window_layers and layer_types (the engine needs the window off); or one
  // sliding_window for every layer (default_window when the key is absent).
  enum class Window { kNone, kQwen, kUniform };
  const char* model_type;    // "mistral"
  const char* architecture;  // what an export writes: "MistralForCausalLM"
  int default_positions;     // the config class's max_position_embeddings
  bool qkv_bias;             // biases on q, k and v (Qwen2)
  bool qk_norm;              // an RMSNorm of q and k: each head (Qwen3), or see post_norm
  Window window;
  int default_window;
  bool attention_bias_key;  // the class has attention_bias (must be false)
  bool mlp_bias_key;        // the class has mlp_bias (must be false)
  bool fused;               // one qkv_proj and one gate_up_proj tensor (Phi-3)
  // The class's own original_max_position_embeddings (Phi-3: 4096), which transformers puts
  // in place of the rotary parameters'; such a class has only default and longrope rotary
  // embeddings and reads rope_type su and yarn as longrope. 0: none.
  int class_original_context;
  float default_theta;  // the class's rope_theta where the config gives none (0: 10000)
  bool default_tied;    // the class's tie_word_embeddings default
  // The class has SmolLM3's no_rope_layers (1: the layer rotates) and no_rope_layer_interval
  // (absent list: every interval-th layer has no rotary embeddings).
  bool nope;
  double default_eps = 1e-6;  // the class's rms_norm_eps where the config gives none
  // OLMo 2's norms: after the attention and the MLP (post_attention_layernorm,
  // post_feedforward_layernorm, inside the residual), and q/k norms over the whole q and k
  // projections (qk_norm then true).
  bool post_norm = false;
};
const std::vector<LlamaDialect>& llama_dialects();
const LlamaDialect* find_llama_dialect(const std::string& model_type);
// Every model_type from-hf converts: gpt2, opt and the llama dialects.
std::vector<std::string> hf_model_types();
// The model_type an export of cfg writes and whose tensor names it uses: base_model_type
// when that type computes cfg (a fine-tune exports as its base), else the first type that
// does. ConfigError where none does.
std::string hf_model_type(const ModelConfig& cfg, const std::string& base_model_type = "");

// config.json for a model: `base_json` (may be empty) supplies the fields the engine does
// not own; the architecture fields, model_type, architectures and torch_dtype are set from
// `cfg` and `dtype`.
std::string hf_config_json(const ModelConfig& cfg, StDtype dtype, const std::string& base_json);

// torch_dtype of a config.json ("bfloat16", "float16", "float32"); nullopt when absent or other.
std::optional<StDtype> hf_torch_dtype(const std::string& config_json);

// tokenizer_config.json for an export whose source had tokenizer.json without one: the
// special tokens config.json's bos/eos/pad ids name in `tok` (unk: "<unk>" when the vocabulary
// has it; gpt2/opt: the end-of-text token for bos and unk, as GPT-2's), llama's add_bos_token,
// model_max_length from the context length, clean_up_tokenization_spaces false.
std::string hf_tokenizer_config_json(const std::string& config_json, const Tokenizer& tok);

// The model section as config.yaml text, which parse_config accepts.
std::string engine_config_yaml(const ModelConfig& cfg);

// One row per Hugging Face tensor, in make_gpt_layout() order: the single list that drives
// both conversion directions. Rows that share an engine tensor (q/k/v packed in c_attn,
// gate/up in c_fc) are consecutive, each a contiguous range of it.
struct HfTensorMap {
  std::string engine;                 // "h.0.attn.c_attn.weight"
  std::string hf;                     // "transformer.h.0.attn.c_attn.weight"
  bool transpose = false;             // Conv1D weights are stored (in, out)
  std::vector<int64_t> engine_shape;  // the whole engine tensor, e.g. (3C, C)
  std::vector<int64_t> hf_shape;      // (C, 3C)
  int64_t engine_offset = 0;          // elements into the engine tensor where this one starts
};
// model_type: the Hugging Face type whose names to use (hf_model_type(cfg) when empty).
std::vector<HfTensorMap> hf_tensor_map(const ModelConfig& cfg, const std::string& model_type = "");

struct ConvertOptions {
  // Output shards are filled in order up to this many bytes (a larger tensor gets a shard of
  // its own); one shard is written as model.safetensors without an index.
  uint64_t max_shard_bytes = 5'000'000'000ull;
  // to-hf only: F32, BF16 or F16; unset: the base model's torch_dtype (hf_config.json, so a
  // bf16 base is exported in bf16), F32 when there is none.
  std::optional<StDtype> dtype;
  // Called before each tensor is converted (index from 0).
  std::function<void(size_t index, size_t count, const std::string& name)> progress;
};

struct ConvertResult {
  ModelConfig model;
  size_t tensors = 0;
  uint64_t bytes = 0;                // tensor bytes written
  std::vector<std::string> files;    // weight files and index, names relative to the output
  std::vector<std::string> copied;   // tokenizer and config files copied through
  StDtype dtype = StDtype::kF32;     // to-hf: the tensors' dtype
  std::string dtype_origin;          // to-hf: why that dtype ("--dtype", "the base model's ...")
  std::vector<std::string> written;  // to-hf: files it made (tokenizer_config.json when absent)
};

// HF_DIR -> engine checkpoint directory. `out_dir` must not exist or be empty; the output is
// assembled in a staging directory beside it and renamed into place at the end, so a failed
// conversion leaves nothing behind.
ConvertResult convert_hf_to_engine(const std::string& hf_dir, const std::string& out_dir,
                                   const ConvertOptions& opts);

// Engine checkpoint (a directory from convert_hf_to_engine, a fuyou-train run directory, or a
// model.safetensors written by either) -> Hugging Face directory that transformers loads as
// GPT2LMHeadModel, OPTForCausalLM, LlamaForCausalLM or Qwen2ForCausalLM.
ConvertResult convert_engine_to_hf(const std::string& checkpoint, const std::string& out_dir,
                                   const ConvertOptions& opts);

// An engine checkpoint loaded into one flat fp32 array in make_gpt_layout() order (padding
// zero), ready for Backend::copy_to_device into Transformer::params().
struct LoadedCheckpoint {
  ModelConfig model;
  std::vector<float> params;
};
LoadedCheckpoint load_engine_checkpoint(const std::string& checkpoint);
// A Hugging Face model directory (config.json, safetensors) read into the same array, with
// the checks from-hf makes; nothing is written.
LoadedCheckpoint load_hf_checkpoint(const std::string& hf_dir);

// An engine checkpoint read one parameter group at a time (model.checkpoint: fine-tuning
// starts from it without holding the whole model twice). Every tensor's presence, dtype and
// shape is checked when it opens.
class CheckpointGroupReader {
 public:
  CheckpointGroupReader(const std::string& checkpoint, const ModelConfig& model);
  ~CheckpointGroupReader();
  // dst holds the group's layout().groups[g].numel elements (group-relative); padding zero.
  void read_group(int g, float* dst) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fuyou
