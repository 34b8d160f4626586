// The training configuration: YAML sections model, data, optimizer, schedule, offload,
// runtime, checkpoint. Every key is documented in docs/config.md. Loading validates everything
// before any work starts: an unknown key, a wrong type or an impossible value is a ConfigError
// naming the key and what is allowed.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace fuyou {

// A list of numbers as one config value (model.rope_short_factor, model.nope_layers):
// compared and printed whole.
template <typename T>
struct ValueList {
  std::vector<T> values;
  bool operator==(const ValueList& o) const { return values == o.values; }
  bool empty() const { return values.empty(); }
  size_t size() const { return values.size(); }
  bool contains(T v) const {
    for (const T& x : values)
      if (x == v) return true;
    return false;
  }
};
using FloatList = ValueList<float>;
using IntList = ValueList<int>;
// As YAML's flow form writes it: [1, 1.5, 2], each with the digits that give it back.
std::ostream& operator<<(std::ostream& os, const FloatList& l);
std::ostream& operator<<(std::ostream& os, const IntList& l);

// Upper bounds on the integer keys (docs/config.md lists each). They lie far above any
// model or run this engine is for, and low enough that sizes computed from them (vocab x
// d_model, micro-batch tokens x d_ff, in bytes) fit 64 bits and that a typo such as
// eval_batches: 2147483647 is refused instead of running for days.
constexpr int kMaxLayers = 1024;
constexpr int kMaxModelDim = 1 << 20;         // n_head, d_model, seq_len
constexpr int kMaxFfDim = 1 << 22;            // d_ff (4 x kMaxModelDim)
constexpr int kMaxVocab = 1 << 24;            // vocab_size (released models: up to ~2^18)
constexpr int64_t kMaxSteps = 1'000'000'000;  // steps, eval_every, log_every
constexpr int kMaxBatch = 1 << 16;            // micro_batch, grad_accum
constexpr int64_t kMaxBatchTokens = 1 << 24;  // micro_batch x seq_len
constexpr int kMaxEvalBatches = 10'000;       // eval_batches

// Where a llama-family block normalises (docs/config.md, model.norm_position).
enum class NormPosition { kPre, kPost };
// What the q/k norm normalises: each head, or the whole q and k projections.
enum class QkNormSpan { kHead, kProjection };

// The model section. Plain fields, each documented in docs/config.md; what a family computes
// with them is in include/fuyou/model.h.
struct ModelConfig {
  // gpt2: GPT-2 / GPT-3 (learned positions, LayerNorm, GELU, tied head).
  // opt: OPT (learned positions at offset 2, pre-LN LayerNorm, ReLU, tied head).
  // llama: Llama 2/3 (RMSNorm, rotary positions, SwiGLU, grouped-query attention).
  std::string family = "gpt2";
  int n_layer = 6;
  int n_head = 6;
  int d_model = 384;
  int d_ff = 0;  // 0 means 4 * d_model (gpt2, opt); llama requires it
  int vocab_size = 256;
  int seq_len = 256;
  // gpt2/opt: the learned position table's rows (n_positions, max_position_embeddings); 0
  // means seq_len. A fine-tune of a checkpoint may train at a shorter seq_len than its table.
  int positions = 0;
  float init_std = 0.02f;
  uint64_t seed = 1234;  // initialisation seed; copied from runtime.seed
  // llama only (gpt2 and opt require the defaults):
  int n_kv_head = 0;  // key/value heads of grouped-query attention; 0 means n_head
  // The head size; 0 means d_model / n_head. Set (Qwen3, Mistral-Nemo), the attention's width
  // A = n_head * head_dim may differ from d_model: q is (A, C), the projection (C, A).
  int head_dim = 0;
  // RMSNorm of q and k (eps norm_eps) before RoPE: of each head with weights of head_dim
  // (qk_norm_span head: Qwen3), or of the whole q and k projections with weights of
  // n_head * head_dim and n_kv_head * head_dim (projection: OLMo 2).
  bool qk_norm = false;
  QkNormSpan qk_norm_span = QkNormSpan::kHead;
  // pre: x + attn(norm1(x)), then + mlp(norm2(.)) (Llama); post: x + norm1(attn(x)), then
  // + norm2(mlp(.)) (OLMo 2: the norms on the sublayers' outputs, inside the residual).
  NormPosition norm_position = NormPosition::kPre;
  float norm_eps = 1e-5f;       // RMSNorm epsilon (gpt2/opt LayerNorm always use 1e-5)
  float rope_theta = 10000.0f;  // rotary base
  // The rotary variant and its parameters, named as transformers' rope_parameters names them
  // (docs/config.md, "Rotary embeddings"); the frequencies: rope_table in fuyou/model.h.
  std::string rope_type = "default";  // default, linear, dynamic, yarn, llama3 or longrope
  float rope_factor = 1.0f;           // linear, dynamic, yarn, llama3: `factor`
  // llama3, yarn, longrope: original_max_position_embeddings; dynamic:
  // max_position_embeddings (the context within which dynamic NTK keeps the default
  // frequencies). 0 for the others.
  int rope_original_context = 0;
  float rope_low_freq_factor = 1.0f;   // llama3
  float rope_high_freq_factor = 4.0f;  // llama3
  float rope_beta_fast = 32.0f;        // yarn
  float rope_beta_slow = 1.0f;         // yarn
  bool rope_truncate = true;           // yarn: the correction range floored and ceiled
  // yarn, longrope: cos/sin scale; 0: transformers' default (yarn: 0.1 ln(factor) + 1;
  // longrope: sqrt(1 + ln(factor) / ln(rope_original_context)), 1 for factor <= 1)
  float rope_attention_factor = 0.0f;
  // longrope (Phi-3.5, Phi-4 mini): each pair's frequency divided by its factor, the short
  // list within rope_original_context (where the engine trains: seq_len may not exceed it),
  // the long one kept for the export. head_size / 2 entries each.
  FloatList rope_short_factor;
  FloatList rope_long_factor;
  // Layers computed without rotary embeddings (SmolLM3's NoPE layers), ascending; the others
  // rotate q and k as rope_type says.
  IntList nope_layers;
  // Attention over at most this many earlier positions (Mistral's sliding_window); 0: none.
  // The engine computes full causal attention, so seq_len may not exceed it: within the
  // window both are the same computation.
  int sliding_window = 0;
  bool tie_embeddings = true;  // false: a separate LM head (V, C) in the "final" group
  bool qkv_bias = false;       // biases on the q/k/v projections (Qwen2 style)
  // Tokens whose logits exist at once (0: the whole micro-batch). Smaller: the LM head and
  // its loss run in chunks of this many tokens, the backward recomputing each chunk's
  // logits (one more head GEMM), so the logits take chunk x vocab elements of device memory
  // instead of B T x vocab. Not part of the architecture: a checkpoint's model may set it.
  int head_chunk_tokens = 0;
  // A converted checkpoint directory (fuyou-convert from-hf) to start from: the model section
  // then comes from its config.yaml and the weights from its tensors. Empty: random init.
  std::string checkpoint;

  int kv_heads() const { return n_kv_head ? n_kv_head : n_head; }
  int head_size() const { return head_dim ? head_dim : d_model / n_head; }
  int attn_width() const { return n_head * head_size(); }  // A: q's and the projection's width
  int position_table() const { return positions ? positions : seq_len; }
  // Whether layer l rotates q and k (rotary families; nope_layers are those that do not).
  bool rotates(int layer) const { return !nope_layers.contains(layer); }
};

struct DataConfig {
  // Plain-text files or directories, tokenized at start into shards in the run directory.
  std::vector<std::string> text;
  // Prebuilt token shards (see docs/data.md); used instead of `text` when given.
  std::vector<std::string> train_shards;
  std::vector<std::string> val_shards;
  double val_fraction = 0.05;  // share of `text` held out for validation
  std::string tokenizer = "byte";
  // Record data (shards with a record index): a record longer than seq_len + 1 tokens is
  // refused (the run does not start; default), cut to its first seq_len + 1 tokens (right)
  // or left out (drop). docs/data.md, "Records".
  std::string truncate = "refuse";
  // The chat template's keyword arguments (a JSON object's text; empty: none) where the run
  // renders the template: its samples with schedule.sample_chat. The config form of
  // fuyou-convert tokenize --chat-template-kwargs.
  std::string chat_template_kwargs;
};

struct OptimizerConfig {
  double lr = 1e-3;
  double min_lr = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;  // 0 disables global-norm clipping
  // With runtime.precision fp16: the dynamic loss scale's starting value
  // (include/fuyou/loss_scale.h).
  double initial_loss_scale = 65536.0;
  // Where AdamW and its state (fp32 master, moments) live when the model trains in memory:
  // auto (the device when it has a GPU's own memory and the state fits beside the model,
  // else the host), host, or device (an error where it does not fit or the backend has no
  // device optimizer). Offloaded runs keep the state on host and SSD (offload.optimizer_state).
  std::string placement = "auto";
  // How the optimizer stores Adam's moments (fp32; bf16 with stochastic rounding; int8 codes
  // in blocks of 256 with one scale each) and the master weights (fp32; split: the bf16
  // working weight plus a 16-bit remainder, exactly the fp32 master). docs/precision.md.
  std::string state = "fp32";
  std::string master = "fp32";
};

struct ScheduleConfig {
  int64_t steps = 300;
  // Record data: train this many epochs (every record once per epoch, in a seeded order); the
  // run's steps follow from the records and schedule.steps is not used. 0: schedule.steps.
  int64_t epochs = 0;
  int64_t warmup_steps = 20;  // at most steps; a fine-tune's default: kFineTuneWarmupSteps
  // The learning rate after warmup: cosine (to optimizer.min_lr at `steps`), linear (the
  // same ends, a straight line) or constant (optimizer.lr throughout).
  std::string lr_decay = "cosine";
  int micro_batch = 8;
  int grad_accum = 1;
  // What gradients are summed in over micro-batches with 16-bit device tensors: auto or fp32
  // (an fp32 sum per group on the host, docs/precision.md), or tensors (the device's 16-bit
  // gradient, rounded at every micro-batch). fp32 tensors always sum in fp32.
  std::string grad_accum_type = "auto";
  int64_t eval_every = 50;  // 0 disables periodic validation (the last step is still evaluated)
  int eval_batches = 8;
  int64_t log_every = 1;
  // Samples: every sample_every steps (0: never) each prompt is continued greedily by
  // sample_tokens tokens with the current weights, logged and written to samples.jsonl.
  int64_t sample_every = 0;
  std::vector<std::string> sample_prompts;
  int sample_tokens = 32;
  // Each sample prompt is a user message rendered with the model's chat template and the
  // generation prompt (fuyou-generate --chat), with data.chat_template_kwargs.
  bool sample_chat = false;
};

enum class ActivationPolicy { kAuto, kKeep, kSwap, kRecompute };

struct OffloadConfig {
  uint64_t device_memory = 0;  // bytes; 0 means no limit below what the machine has
  uint64_t host_memory = 0;
  std::vector<std::string> ssd_paths;
  ActivationPolicy activations = ActivationPolicy::kAuto;
  // Where layer weights / optimizer state (fp32 master, Adam moments) live: "auto" places them
  // in host memory while the budget allows, weights first; "ssd" keeps every layer's on SSD.
  std::string weights = "auto";
  std::string optimizer_state = "auto";
  // How many top layers' updates run after the embedding's, beside the next forward
  // (Plan::deferred_updates): -1 auto (the top layer's where its state streams from SSD, no
  // weights are read from SSD and its gradient's slot moves no state to SSD), else 0 .. n_layer-1.
  int deferred_updates = -1;
  // Hardware profile (configs/hardware/*.yaml) the automatic activation placement simulates
  // plans on; empty: auto places activations by the memory rule alone.
  std::string hardware;
  // Checksums of every block written to the SSD store, checked on read (StoreConfig::verify).
  bool verify_store = true;
};

struct RuntimeConfig {
  std::string backend = "auto";  // cpu | cuda | auto | cpu-streams | emulated
  // cpu-streams: each queued operation first sleeps a random time up to this many
  // microseconds (seeded by `seed`), so that a missing wait shows; 0: no delays.
  int stream_delay_us = 0;
  // emulated: the emulated GPU's (offload.hardware's) compute and PCIe throughputs are
  // multiplied by this, to map the profile onto this machine's disks (docs/performance.md).
  double emulated_scale = 1.0;
  // GEMM input precision: auto (bf16 on a GPU, fp32 on the CPU), fp32, bf16 or fp16. Inputs
  // are rounded to it; accumulation and everything outside GEMMs stay fp32.
  std::string precision = "auto";
  // What the device stores weights, activations and gradients as: fp32 (the reference), bf16
  // or fp16 (with precision fp16, for its loss scaling; docs/precision.md). Master weights and
  // optimizer state are fp32 in every case.
  std::string device_tensors = "fp32";
  // Attention kernels: auto (cuDNN's fused flash attention on the CUDA backend with 16-bit
  // tensors, else the backend's own), kernels (the backend's own: the CPU's arithmetic), cudnn.
  std::string attention = "auto";
  // The projections' bias on the CUDA backend with 16-bit tensors: kernel (a broadcast kernel,
  // then the GEMM adds its product, beta = 1) or epilogue (cuBLASLt adds it in the GEMM).
  std::string gemm_bias = "kernel";
  // How the CUDA backend's host threads wait for the device (cudaSetDeviceFlags): auto (CUDA's
  // rule: spin while the process has fewer contexts than CPUs), spin, yield or block.
  std::string cuda_wait = "auto";
  // In-memory runs with AdamW on the host: plan (a plan of the executor, in_memory_plan) or
  // step (InMemoryStep, its phases one after the other: for comparison).
  std::string in_memory = "plan";
  int threads = 0;  // 0 means every core the process may use
  uint64_t seed = 1234;
};

// Training-state checkpoints (docs/checkpoints.md): RUN_DIR/checkpoints/step-N, written at
// step boundaries; the last step gets one too whenever either interval is set, so a
// finished run can be extended with --resume. A graceful stop (SIGINT/SIGTERM) always
// writes one.
struct CheckpointConfig {
  int64_t every_steps = 0;    // 0: not by step count
  double every_minutes = 30;  // wall-clock minutes of training between checkpoints; 0: not by time
  int keep = 2;               // complete checkpoints kept (the newest ones), at least 1
  // Also keep the checkpoint with the lowest validation loss (validation runs at every
  // checkpoint then), named by checkpoints/best.
  bool keep_best = false;
};

// LoRA over a frozen base (docs/config.md, "lora"; docs/lora.md), the keys named as PEFT's
// LoraConfig names them. rank 0: no adapters, every weight trains.
struct LoraConfig {
  int rank = 0;                      // r: the adapters' inner size; 0 disables LoRA
  double alpha = 8;                  // lora_alpha: the scale is alpha / rank
  double dropout = 0;                // lora_dropout on the adapters' input (only 0 runs yet)
  std::vector<std::string> targets;  // target_modules: HF module names, or all-linear
  std::string base = "fp32";         // the frozen base's storage: fp32, bf16, nf4
  std::string init = "peft";         // peft (A Kaiming-uniform, B zero) or a PEFT adapter dir
  bool use_rslora = false;           // the scale is alpha / sqrt(rank)
  bool enabled() const { return rank > 0; }
};

struct Config {
  ModelConfig model;
  DataConfig data;
  OptimizerConfig optimizer;
  ScheduleConfig schedule;
  OffloadConfig offload;
  RuntimeConfig runtime;
  CheckpointConfig checkpoint;
  LoraConfig lora;
};

// Parses and validates YAML text. `source` names it in errors (a path or "<default>").
// Each override is "section.key=value", value in YAML syntax, applied before validation.
Config parse_config(const std::string& yaml_text, const std::string& source,
                    const std::vector<std::string>& overrides = {});
Config load_config_file(const std::string& path, const std::vector<std::string>& overrides = {});

// The embedded default config (configs/default.yaml, compiled in).
const std::string& default_config_text();

// The config as YAML, every key written out, so a run directory records what ran.
std::string config_to_yaml(const Config& c);
// One key of the config's key lists: "section.key" and the values it takes, as
// docs/config.md's type column writes them ("int 1..1024", "float (0, 10)", "auto, ssd").
struct ConfigKey {
  std::string name;
  std::string values;
};
// Every key parse_config reads, in the order config_to_yaml writes them (a test holds
// config_to_yaml and docs/config.md to this list).
std::vector<ConfigKey> config_keys();
// The values optimizer.state and optimizer.master take ("fp32", "bf16", "int8"; "fp32",
// "split"): the names moment_format_name and master_format_name give the formats.
const std::vector<std::string>& optimizer_state_names();
const std::vector<std::string>& optimizer_master_names();
// The same for a run directory or a checkpoint: the model section is already resolved, so
// model.checkpoint (the directory the run started from) is left out and the text loads
// without that directory; the origin is kept as a comment. With a lora section it stays: the
// run's weights are adapters over that base.
std::string config_to_self_contained_yaml(const Config& c);

const char* activation_policy_name(ActivationPolicy p);

// The optimizer's defaults for a fine-tune (model.checkpoint set): lr 2e-5, min_lr 2e-6
// (a tenth of a given lr), weight_decay 0; the rest as OptimizerConfig's. Its warmup:
// kFineTuneWarmupSteps (at most schedule.steps).
OptimizerConfig fine_tune_optimizer_defaults();
inline constexpr int64_t kFineTuneWarmupSteps = 10;

}  // namespace fuyou
