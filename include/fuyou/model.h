// The GPT model (GPT-2 / GPT-3 architecture): its parameter layout, and its forward and
// backward passes as calls on a Backend, one layer at a time.
//
// One list of tensors (ParamLayout) drives everything that touches weights: init, load,
// save, the optimizer's decay groups and, later, swapping and conversion. Parameters are
// stored in one flat fp32 array grouped as [embed | layer 0 | ... | layer L-1 | final], each
// group contiguous so a layer's state moves as one extent.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/config.h"

namespace fuyou {

struct TensorSpec {
  std::string name;            // e.g. "h.3.attn.c_attn.weight"
  std::vector<int64_t> shape;  // e.g. {3C, C} (nn.Linear layout: out, in)
  int group = 0;               // index into ParamLayout::groups
  size_t offset = 0;           // elements from the start of the flat array
  size_t numel = 0;
  bool decay = false;          // weight decay applies (matrices and embeddings)
};

struct ParamGroup {
  std::string name;  // "embed", "layer.0", ..., "final"
  size_t offset = 0;
  size_t numel = 0;  // including alignment padding at the end
};

struct ParamLayout {
  std::vector<TensorSpec> tensors;
  std::vector<ParamGroup> groups;
  size_t total = 0;  // elements, with padding

  const TensorSpec& tensor(const std::string& name) const;  // throws if absent
  size_t num_params() const;                                 // without padding
};

ParamLayout make_gpt_layout(const ModelConfig& cfg);

// Pointers to one layer's tensors inside a buffer laid out like the flat parameter array
// (parameters, gradients or any per-parameter state).
struct LayerTensors {
  float* ln1_w;     // (C)
  float* ln1_b;     // (C)
  float* qkv_w;     // (3C, C)
  float* qkv_b;     // (3C)
  float* proj_w;    // (C, C)
  float* proj_b;    // (C)
  float* ln2_w;     // (C)
  float* ln2_b;     // (C)
  float* fc_w;      // (F, C)
  float* fc_b;      // (F)
  float* fcproj_w;  // (C, F)
  float* fcproj_b;  // (C)
};

struct GlobalTensors {
  float* wte;   // (V, C), also the LM head
  float* wpe;   // (T, C)
  float* lnf_w; // (C)
  float* lnf_b; // (C)
};

LayerTensors layer_tensors(const ParamLayout& layout, int layer, float* base);
GlobalTensors global_tensors(const ParamLayout& layout, float* base);

// What one layer's forward saves for its backward, in device memory.
struct LayerActivations {
  float* ln1;       // (N, C)
  float* ln1_mean;  // (N)
  float* ln1_rstd;  // (N)
  float* qkv;       // (N, 3C)
  float* att;       // (B, H, T, T) softmax probabilities
  float* atty;      // (N, C) attention output before the projection
  float* res2;      // (N, C) residual after attention
  float* ln2;       // (N, C)
  float* ln2_mean;  // (N)
  float* ln2_rstd;  // (N)
  float* fch;       // (N, F) MLP pre-activation
  float* fcg;       // (N, F) after GELU
  float* out;       // (N, C) block output = next block's input
};

// Fills a host array laid out by `layout` with the initial weights: normal(0, init_std) for
// matrices and embeddings, scaled by 1/sqrt(2 n_layer) for the two residual projections
// (GPT-2), LayerNorm weights 1, biases 0. Deterministic in cfg.seed.
void init_gpt_params(const ModelConfig& cfg, const ParamLayout& layout, float* params);
// The same values for one parameter group only, into dst (group-relative), so a model
// larger than memory can be initialised group by group.
void init_gpt_group(const ModelConfig& cfg, const ParamLayout& layout, int group, float* dst);

// What a GptModel allocates on the device. kFull: parameters, gradients and every layer's
// activations (in-memory training). kWorkspace: only the per-pass workspace (tokens, head,
// backward scratch); the scheduler owns weights, gradients and activations and passes them
// to the per-layer calls.
enum class ModelState { kFull, kWorkspace };

// The model on a backend for a fixed micro-batch, all device memory sized at construction
// (nothing is allocated during a step).
class GptModel {
 public:
  GptModel(const ModelConfig& cfg, Backend& backend, int micro_batch,
           ModelState state = ModelState::kFull);
  ~GptModel();
  GptModel(const GptModel&) = delete;
  GptModel& operator=(const GptModel&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  int micro_batch() const { return B_; }
  int tokens_per_batch() const { return B_ * cfg_.seq_len; }

  float* params() { return params_; }  // device, layout() order
  float* grads() { return grads_; }    // device, layout() order
  const float* logits() const { return logits_; }  // (N, V) after forward()

  // Runs the whole forward on inputs(B*T) (host memory). With targets (host, B*T), computes
  // the per-token losses and returns their mean; without, returns 0 and leaves logits.
  float forward(const int32_t* inputs, const int32_t* targets);
  // Accumulates into grads() the gradient of loss_scale * sum of per-token losses of the
  // last forward(). For a mean over grad_accum micro-batches: 1 / (N * grad_accum).
  void backward(float loss_scale);
  void zero_grads();

  // Per-layer pieces of forward() and backward(), for the scheduler to drive one at a time.
  // set_tokens copies a micro-batch's inputs (and targets) to the device first.
  void set_tokens(const int32_t* inputs, const int32_t* targets);
  LayerActivations alloc_activations(const std::string& what);  // owned by the model
  float last_loss() const { return last_loss_; }
  void embed_forward(const float* wte, const float* wpe, float* x);
  void block_forward(const LayerTensors& w, const float* x_in, const LayerActivations& a);
  float head_forward(const GlobalTensors& g, const float* x, bool with_loss);
  void head_backward(const GlobalTensors& g, const GlobalTensors& dg, const float* x,
                     float loss_scale, float* dx);
  void block_backward(const LayerTensors& w, const LayerTensors& dw, const float* x_in,
                      const LayerActivations& a, float* dx_out_in);
  void embed_backward(const GlobalTensors& dg, const float* dx);

  // Device bytes of one layer's saved activations at this micro-batch.
  size_t activation_bytes_per_layer() const;

 private:
  float* alloc_floats(size_t n, const std::string& what);

  ModelConfig cfg_;
  Backend& be_;
  int B_;
  int N_;
  ParamLayout layout_;
  float* params_ = nullptr;
  float* grads_ = nullptr;
  int32_t* inputs_ = nullptr;
  int32_t* targets_ = nullptr;
  float* x0_ = nullptr;  // (N, C) embedding output
  std::vector<LayerActivations> acts_;
  float* lnf_ = nullptr;       // (N, C)
  float* lnf_mean_ = nullptr;  // (N)
  float* lnf_rstd_ = nullptr;  // (N)
  float* logits_ = nullptr;    // (N, V), overwritten by dlogits in backward
  float* losses_ = nullptr;    // (N)
  float* lse_ = nullptr;       // (N)
  std::vector<float> host_losses_;
  float last_loss_ = 0;
  // Backward scratch
  float* dres_ = nullptr;   // (N, C) gradient flowing along the residual stream
  float* dtmp_ = nullptr;   // (N, C)
  float* dqkv_ = nullptr;   // (N, 3C)
  float* datt_ = nullptr;   // (B, H, T, T)
  float* dfc_ = nullptr;    // (N, F)
  std::vector<void*> owned_;
};

// Model FLOPs of one token's forward pass (matmuls, attention as dense T x T, LM head);
// training counts 3x this. Formula in docs/performance.md.
double forward_flops_per_token(const ModelConfig& cfg);
// Useful training TFLOP/s at a token rate: 3 x forward FLOPs (backward = 2 x forward).
double training_tflops(const ModelConfig& cfg, double tokens_per_s);

}  // namespace fuyou
