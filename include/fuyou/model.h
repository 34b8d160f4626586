// The decoder-only transformer of the gpt2, opt and llama families: its parameter layout,
// and its forward and backward passes as calls on a Backend, one layer at a time.
//
// One list of tensors (ParamLayout, built per family by make_gpt_layout) drives everything
// that touches weights: init, load, save, the optimizer's decay groups, swapping and
// conversion (the Hugging Face name maps follow it row for row). Parameters are stored in one
// flat fp32 array grouped as [embed | layer 0 | ... | layer L-1 | final], each group
// contiguous so a layer's state moves as one extent. A tensor a family lacks is simply not
// in the list, and its pointer in LayerTensors / GlobalTensors is null.
//
// Per family (C = d_model, F = d_ff, D = head size, KV = kv heads * D):
//   gpt2  embed [wte (V,C), wpe (T,C)]; layer: LayerNorm, packed qkv (3C,C) + bias, proj,
//         LayerNorm, fc (F,C) + bias, GELU, fc proj (C,F) + bias; final [ln_f w, b]; head = wte.
//   opt   as gpt2 but wpe is (T+2, C) and position t reads row t+2 (OPT's offset), ReLU.
//   llama embed [wte]; layer: RMSNorm w, packed q|k|v (A+2KV, C) (+ bias if qkv_bias),
//         with qk_norm an RMSNorm of each q and k head (q_norm, k_norm (D)), RoPE on q and k,
//         proj (C,A) no bias, RMSNorm w, packed gate|up (2F, C), SwiGLU, down (C,F); final
//         [norm w, lm_head (V,C) unless tie_embeddings]. A = n_head * D is C unless head_dim
//         says otherwise.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/config.h"
#include "fuyou/family.h"
#include "fuyou/op_class.h"
#include "fuyou/rope.h"

namespace fuyou {

struct TensorSpec {
  std::string name;            // e.g. "h.3.attn.c_attn.weight"
  std::vector<int64_t> shape;  // e.g. {3C, C} (nn.Linear layout: out, in)
  int group = 0;               // index into ParamLayout::groups
  size_t offset = 0;           // elements from the start of the flat array
  size_t numel = 0;
  bool decay = false;  // weight decay applies (matrices and embeddings)
  int role = 0;        // TensorRole: which pointer of Layer/GlobalTensors it fills
};

// What a tensor is to the model code, independent of its name.
enum TensorRole : int {
  kWte,
  kWpe,
  kLnfW,
  kLnfB,
  kLmHead,
  kLn1W,
  kLn1B,
  kQkvW,
  kQkvB,
  kProjW,
  kProjB,
  kLn2W,
  kLn2B,
  kFcW,
  kFcB,
  kFcProjW,
  kFcProjB,
  kQNormW,
  kKNormW,
};

// The rotary frequencies of a llama-family config (rope_type and its parameters), computed
// in fp32 as transformers' rope initialisers compute them; pairs = 0 for gpt2 and opt.
RopeTable rope_table(const ModelConfig& cfg);
// The default variant's table for heads of size D (even, at most 2 kMaxRopePairs).
RopeTable default_rope_table(int D, float theta);
// Rows of the position table: seq_len plus the family's offset (OPT: 2); 0 with rotary
// positions (no table).
int position_rows(const ModelConfig& cfg);
// The pieces of a block the training model and the decoder share, as the family's traits
// say: its norm (mean is unused by RMSNorm), the residual add fused with the next norm, and
// the MLP's activation of fc's outputs (n rows, F = d_ff outputs).
void norm_forward(Backend& be, const FamilyTraits& fam, void* out, float* mean, float* rstd,
                  const void* in, const void* w, const void* b, float eps, int n, int C);
void residual_norm_forward(Backend& be, const FamilyTraits& fam, void* res, void* out, float* mean,
                           float* rstd, const void* a, const void* b, const void* w,
                           const void* bias, float eps, int n, int C);
void mlp_activation_forward(Backend& be, const FamilyTraits& fam, void* fcg, const void* fch, int n,
                            int F);
// The LM head's rows as the model computes them: vocab_size rounded up to a multiple of
// kVocabPad, so the head's GEMMs get aligned leading dimensions and whole tiles (a vocabulary
// such as GPT-2's 50257 otherwise sends cuBLAS to its slow unaligned kernels). The padding
// rows of the token table (and of an untied head) are zero and stay zero; tensors, checkpoints
// and exports have vocab_size rows; the logits buffer is (rows, padded_vocab) and
// logits_stride() says so.
inline constexpr int kVocabPad = 64;
inline int padded_vocab(const ModelConfig& cfg) {
  return (cfg.vocab_size + kVocabPad - 1) / kVocabPad * kVocabPad;
}

struct ParamGroup {
  std::string name;  // "embed", "layer.0", ..., "final"
  size_t offset = 0;
  size_t numel = 0;         // including alignment padding at the end
  size_t first_tensor = 0;  // the group's tensors are tensors[first_tensor, + num_tensors)
  size_t num_tensors = 0;
};

struct ParamLayout {
  std::vector<TensorSpec> tensors;
  std::vector<ParamGroup> groups;
  size_t total = 0;  // elements, with padding

  const TensorSpec& tensor(const std::string& name) const;  // throws if absent
  size_t num_params() const;                                // without padding
};

ParamLayout make_gpt_layout(const ModelConfig& cfg);

// Pointers to one layer's tensors inside a buffer laid out like the flat parameter array
// (parameters, gradients or any per-parameter state). Null where the family has no such
// tensor (llama: ln*_b, proj_b, fc_b, fcproj_b; qkv_b unless qkv_bias).
struct LayerTensors {
  int layer = -1;            // which layer's tensors these are
  void* ln1_w = nullptr;     // (C)
  void* ln1_b = nullptr;     // (C)
  void* qkv_w = nullptr;     // (C + 2KV, C): q | k | v (KV = C without GQA)
  void* qkv_b = nullptr;     // (C + 2KV)
  void* proj_w = nullptr;    // (C, C)
  void* proj_b = nullptr;    // (C)
  void* ln2_w = nullptr;     // (C)
  void* ln2_b = nullptr;     // (C)
  void* fc_w = nullptr;      // (F, C); llama (2F, C): gate | up
  void* fc_b = nullptr;      // (F)
  void* fcproj_w = nullptr;  // (C, F)
  void* fcproj_b = nullptr;  // (C)
  void* q_norm_w = nullptr;  // llama with qk_norm: RMSNorm weight of every q head (D), or of
                             // the whole q projection (A, qk_norm_span projection)
  void* k_norm_w = nullptr;  // the same for the k heads: (D), or (KV)
};

// The spans the q/k norm normalises (model.qk_norm_span): each head, or the whole projections.
inline QkNormSpans qk_norm_spans(const ModelConfig& cfg) {
  const int H = cfg.n_head, Hkv = cfg.kv_heads(), D = cfg.head_size();
  return cfg.qk_norm_span == QkNormSpan::kProjection ? QkNormSpans::projection(H, Hkv, D)
                                                     : QkNormSpans::heads(H, Hkv, D);
}
inline bool post_norm(const ModelConfig& cfg) { return cfg.norm_position == NormPosition::kPost; }

struct GlobalTensors {
  void* wte = nullptr;      // (V, C)
  void* wpe = nullptr;      // (position_rows, C); null for llama
  void* lnf_w = nullptr;    // (C)
  void* lnf_b = nullptr;    // (C); null for llama
  void* lm_head = nullptr;  // (V, C): wte when tied, else the final group's own tensor
};

// `base` holds elements of `elem_bytes` bytes each (the device's storage type).
LayerTensors layer_tensors(const ParamLayout& layout, int layer, void* base, size_t elem_bytes);
// The same from a buffer holding only the layer's group (group-relative offsets).
LayerTensors layer_group_tensors(const ParamLayout& layout, int layer, void* group,
                                 size_t elem_bytes);
GlobalTensors global_tensors(const ParamLayout& layout, void* base, size_t elem_bytes);
// The same from separate buffers holding only the embed group and only the final group
// (the offloading scheduler keeps them apart). `embed` and `final_` are group-relative.
GlobalTensors global_tensors(const ParamLayout& layout, void* embed, void* final_,
                             size_t elem_bytes);

// What one layer's forward saves for its backward, in device memory: tensors of the storage
// type (void*) and fp32 norm statistics (float*).
struct LayerActivations {
  // pre-norm: ln1, ln2 the norms' outputs; post-norm (model.norm_position): their inputs,
  // the attention projection's and the MLP's outputs.
  void* ln1 = nullptr;        // (N, C)
  float* ln1_mean = nullptr;  // (N); null for llama (RMSNorm keeps only rstd)
  float* ln1_rstd = nullptr;  // (N)
  void* qkv = nullptr;        // (N, 3A) after RoPE and with k/v heads repeated (llama)
  void* qk = nullptr;         // (N, A + KV) llama with qk_norm: q and k heads before the norm
  float* qk_rstd = nullptr;   // (N, Hq + Hkv) their RMSNorm statistics
  float* lse = nullptr;       // (B, H, T) log-sum-exp of each query's scaled scores
  void* atty = nullptr;       // (N, A) attention output before the projection
  void* res2 = nullptr;       // (N, C) residual after attention
  void* ln2 = nullptr;        // (N, C)
  float* ln2_mean = nullptr;  // (N); null for llama
  float* ln2_rstd = nullptr;  // (N)
  void* fch = nullptr;        // (N, F) MLP pre-activation; llama (N, 2F) gate | up
  void* fcg = nullptr;        // (N, F) after GELU / ReLU / SwiGLU
  void* out = nullptr;        // (N, C) block output = next block's input
};

// Device bytes of one layer's saved activations, and of a kWorkspace model's own buffers, at
// micro-batch B with tensors of `elem_bytes` bytes per element (statistics are fp32 either
// way): the same lists the model allocates from.
size_t layer_activation_bytes(const ModelConfig& cfg, int B, size_t elem_bytes);
size_t model_workspace_bytes(const ModelConfig& cfg, int B, size_t elem_bytes);
// Rows (tokens) of one chunk of the LM head at micro-batch B: model.head_chunk_tokens, or
// all B seq_len rows when it is 0 or larger.
int head_chunk_rows(const ModelConfig& cfg, int B);
// Elements of a frozen base's discarded norm weight gradients (ModelState::kFrozenBase).
size_t frozen_grad_elems(const ModelConfig& cfg);
// Host bytes the CPU backend's kernels take beside its arena with 16-bit tensors: the fp32
// views of the largest kernel call's tensors (kernels/cpu/stage.h), an upper bound over the
// model's calls at micro-batch B.
size_t cpu_kernel_scratch_bytes(const ModelConfig& cfg, int B);

// Fills a host array laid out by `layout` with the initial weights: normal(0, init_std) for
// matrices and embeddings, scaled by 1/sqrt(2 n_layer) for the two residual projections
// (GPT-2), LayerNorm / RMSNorm weights 1, biases 0. Deterministic in cfg.seed.
void init_gpt_params(const ModelConfig& cfg, const ParamLayout& layout, float* params);
// The same values for one parameter group only, into dst (group-relative), so a model
// larger than memory can be initialised group by group.
void init_gpt_group(const ModelConfig& cfg, const ParamLayout& layout, int group, float* dst);

// What a Transformer allocates on the device. kFull: parameters, gradients and every layer's
// activations (in-memory training). kWorkspace: only the per-pass workspace (tokens, head,
// backward scratch); the scheduler owns weights, gradients and activations and passes them
// to the per-layer calls.
// kFrozenBase (lora): parameters and activations as kFull, but no gradients: the base trains
// nothing, its weight-gradient GEMMs are skipped and the adapters (attach_lora) get the
// gradients instead.
enum class ModelState { kFull, kWorkspace, kFrozenBase };

struct LoraLayout;

// The decoder-only transformer of every model family (gpt2, opt, llama: ModelConfig::family)
// on a backend for a fixed micro-batch, all device memory sized at construction (nothing is
// allocated during a step).
class Transformer {
 public:
  Transformer(const ModelConfig& cfg, Backend& backend, int micro_batch,
              ModelState state = ModelState::kFull);
  ~Transformer();
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  int micro_batch() const { return B_; }
  int tokens_per_batch() const { return B_ * cfg_.seq_len; }

  // Device tensors of the backend's storage type (elem_bytes() bytes per element).
  size_t elem_bytes() const { return es_; }
  void* params() { return params_; }  // layout() order
  void* grads() { return grads_; }    // layout() order
  // (N, V) after forward(), rows logits_stride() elements apart; only where the head is not
  // chunked (model.head_chunk_tokens).
  const void* logits() const;
  int logits_stride() const { return padded_vocab(cfg_); }
  // The logits of the last forward() to host memory as a compact (N, V) array of the storage
  // type (the padding columns left out).
  void copy_logits(void* dst) const;

  // Runs the whole forward on inputs(B*T) (host memory). With targets (host, B*T), computes
  // the per-token losses and returns their mean over the counted targets (those that are not
  // kIgnoreTarget; 0 when none counts); without, returns 0 and leaves logits. `positions`
  // (host, B*T, or null: one record per row) packs records: see set_tokens.
  float forward(const int32_t* inputs, const int32_t* targets, const int32_t* positions = nullptr);
  // Accumulates into grads() the gradient of loss_scale * sum of per-token losses of the
  // last forward() (ignored targets contribute nothing). For the mean over a step:
  // 1 / (counted targets of all its micro-batches), which is 1 / (N * grad_accum) unmasked.
  void backward(float loss_scale);
  // forward() then backward(loss_scale), the same bits, with the loss's gradient computed in
  // the forward's pass over the logits (crossentropy_forward_backward; a chunked head's
  // logits are not computed again). Training's step; targets required.
  float forward_backward(const int32_t* inputs, const int32_t* targets, const int32_t* positions,
                         float loss_scale);
  void zero_grads();

  // LoRA (kFrozenBase only): every linear the layout adapts computes W x + s B (A x), with the
  // adapters in `params` and their gradients accumulated into `grads` (both device buffers
  // laid out as layout.params, the storage type; fp32 only). The layout must outlive the
  // model. zero_grads() then clears the adapters' gradients.
  void attach_lora(const LoraLayout& layout, const void* params, void* grads);

  // Per-layer pieces of forward() and backward(), for the scheduler to drive one at a time.
  // set_tokens copies a micro-batch's inputs (and targets) to the device first. With
  // `positions` (B*T) the rows are packed records: positions[b*T + t] is token t's position
  // within its record (0 where a record starts, else the previous token's + 1; the rule of
  // Backend::attention_forward's pos, checked here). Each record then sees only itself:
  // learned positions and rotary phases restart, attention stops at its boundaries. Null: one
  // record per row, the unpacked arithmetic bit for bit.
  void set_tokens(const int32_t* inputs, const int32_t* targets,
                  const int32_t* positions = nullptr);
  LayerActivations alloc_activations(const std::string& what);  // owned by the model
  // Targets of the last set_tokens() that count (not kIgnoreTarget): N without a mask.
  int64_t counted_targets() const { return counted_; }
  // wpe is the table as stored (null for llama); the OPT offset is applied inside.
  void embed_forward(const void* wte, const void* wpe, void* x);
  void block_forward(const LayerTensors& w, const void* x_in, const LayerActivations& a);
  float head_forward(const GlobalTensors& g, const void* x, bool with_loss);
  void head_backward(const GlobalTensors& g, const GlobalTensors& dg, const void* x,
                     float loss_scale, void* dx);
  // head_forward then head_backward in one pass over each chunk's logits; returns the loss.
  float head_train(const GlobalTensors& g, const GlobalTensors& dg, const void* x, float loss_scale,
                   void* dx);
  void block_backward(const LayerTensors& w, const LayerTensors& dw, const void* x_in,
                      const LayerActivations& a, void* dx_out_in);
  void embed_backward(const GlobalTensors& dg, const void* dx);

 private:
  const void* forward_layers(const int32_t* inputs, const int32_t* targets,
                             const int32_t* positions);
  void backward_layers();
  const void* last_layer_output() const;
  // The head over lnf_, chunk by chunk: logits and losses, and with dg (training) the loss's
  // gradient in the same pass and the chunk's backward GEMM into dg; returns the mean loss.
  float head_loss(const GlobalTensors& g, const GlobalTensors* dg, float loss_scale);
  // The head's pieces: the mean of the losses once they are on the host, the backward GEMM of
  // rows [r0, r0 + rows), and the final norm's backward into dx.
  float mean_loss();
  void head_gemm_backward(const GlobalTensors& g, const GlobalTensors& dg, int r0, int rows);
  void head_norm_backward(const GlobalTensors& g, const GlobalTensors& dg, const void* x, void* dx);
  // The adapter of (layer, linear k) applied after the base linear's forward: out(N, out) +=
  // s B (A in); nothing where the linear has no adapter.
  void lora_forward(int layer, int k, void* out, const void* in);
  // Before the base linear's backward (its input `in` may be overwritten by it): the adapter's
  // gradients from dout and in, and its share of the input gradient into lora_dx_; false
  // where the linear has no adapter (lora_dx_ untouched).
  bool lora_backward(int layer, int k, const void* dout, const void* in);
  // Adds the adapter's input gradient (lora_backward true) into din (N, in).
  void lora_add_input_grad(int layer, int k, void* din);
  // The gradients the backward writes: the model's own, or with a frozen base null matrices
  // and the norms' weight gradients in a scratch that nothing reads.
  LayerTensors layer_grads(int layer);
  GlobalTensors global_grads();
  // A timing mark before the work of class c (Backend: step timing; only while timing).
  void mark(StepPhase p, OpClass c) {
    if (be_.timing_on()) be_.timing_mark(timing_tag(p, c));
  }
  // n elements of the storage type / n fp32 statistics.
  void* alloc_tensor(size_t n, const std::string& what);
  float* alloc_floats(size_t n, const std::string& what);
  template <typename P>
  P* alloc_entry(P* type_tag, size_t n, const std::string& what);  // by the entry's type
  void norm_forward(void* out, float* mean, float* rstd, const void* in, const void* w,
                    const void* b);
  void norm_backward(void* din, void* dw, void* db, const void* dout, const void* in, const void* w,
                     const float* mean, const float* rstd);
  // The same into din alone (zeroed first: the norm kernels add into din, for the residual
  // stream): a norm's input gradient that is not a residual's.
  void norm_backward_into(void* din, void* dw, void* db, const void* dout, const void* in,
                          const void* w, const float* mean, const float* rstd);
  // res = a + b, then out = the norm of res: one fused kernel (the same bits as the two).
  void residual_norm_forward(void* res, void* out, float* mean, float* rstd, const void* a,
                             const void* b, const void* w, const void* bias);

  ModelConfig cfg_;
  Backend& be_;
  int B_;
  int N_;
  size_t es_;  // bytes per element of the storage type
  ParamLayout layout_;
  void* params_ = nullptr;
  void* grads_ = nullptr;
  int32_t* inputs_ = nullptr;
  int32_t* targets_ = nullptr;
  int32_t* positions_ = nullptr;  // (N) device copy of the last set_tokens()'s positions
  const int32_t* pos_ = nullptr;  // positions_ when the last set_tokens() packed records, else null
  void* x0_ = nullptr;            // (N, C) embedding output
  std::vector<LayerActivations> acts_;
  void* lnf_ = nullptr;        // (N, C)
  float* lnf_mean_ = nullptr;  // (N)
  float* lnf_rstd_ = nullptr;  // (N)
  void* logits_ = nullptr;     // (head_rows_, V), overwritten by dlogits in backward
  int head_rows_ = 0;          // tokens of one chunk of the head (N: not chunked)
  // Row `row` of a (rows, width) tensor of the storage type.
  void* rows_at(void* p, int row, int width) const {
    return static_cast<char*>(p) + es_ * static_cast<size_t>(row) * width;
  }
  float* losses_ = nullptr;  // (N)
  float* lse_ = nullptr;     // (N)
  std::vector<float> host_losses_;
  int64_t counted_ = 0;  // targets of the last set_tokens() that count
  // Backward scratch
  void* dres_ = nullptr;          // (N, C) gradient flowing along the residual stream
  void* dtmp_ = nullptr;          // (N, C)
  void* dqkv_ = nullptr;          // (N, 3C)
  float* att_scratch_ = nullptr;  // (2, T, T) the backend's attention scratch
  void* qkvc_ = nullptr;          // (N, C + 2KV) compact q|k|v before the heads are repeated (GQA)
  void* dqkvc_ = nullptr;         // (N, C + 2KV)
  void* dgu_ = nullptr;           // (N, 2F) llama: gradient of gate | up
  const FamilyTraits& fam_;
  RopeTable rope_;                // llama: the rotary frequencies of cfg_
  bool frozen_ = false;           // kFrozenBase: no base gradients
  void* frozen_grads_ = nullptr;  // (4C + 2D) the norms' discarded weight gradients
  const LoraLayout* lora_ = nullptr;
  const void* lora_params_ = nullptr;
  void* lora_grads_ = nullptr;
  size_t lora_total_ = 0;           // elements of the adapters' layout
  void* lora_u_ = nullptr;          // (N, widest adapter) A in, then its gradient
  void* lora_v_ = nullptr;          // (N, widest adapter) s A in, then its gradient
  void* lora_dx_ = nullptr;         // (N, widest linear) the adapter's output / input gradient
  std::vector<void*> lora_scales_;  // per adapter: s I (width, width), the scale as a GEMM
  // Per adapter: the element ranges of B outside its parts' blocks, whose gradient is cleared.
  std::vector<std::vector<std::pair<size_t, size_t>>> lora_zero_;
  std::vector<void*> owned_;
};

// Model FLOPs of one token's forward pass (matmuls, attention as dense T x T, LM head);
// training counts 3x this. Formula in docs/performance.md. Per family: the q/k/v projection
// is C x (C + 2KV) (smaller k/v under GQA), the MLP has 2 matrices (gpt2, opt) or 3 (llama's
// gate, up, down); the LM head is C x V whether tied or not.
double forward_flops_per_token(const ModelConfig& cfg);
// One block's share of that (what the planner charges per layer).
double layer_forward_flops_per_token(const ModelConfig& cfg);
// Useful training TFLOP/s at a token rate: 3 x forward FLOPs (backward = 2 x forward).
double training_tflops(const ModelConfig& cfg, double tokens_per_s);

}  // namespace fuyou
