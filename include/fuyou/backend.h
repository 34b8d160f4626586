// The Backend: where tensors live and kernels run.
//
// The model reaches compute and device memory only through this interface, so the CPU
// backend (kernels/cpu), the CUDA backend and the offloading scheduler plug in without the
// model changing. All pointers passed to kernels are device pointers obtained from alloc();
// on the CPU backend "device memory" is ordinary host memory with a hard capacity, so every
// budget path can be exercised on a machine without a GPU.
//
// Shapes in comments: N = rows (batch * seq tokens), C = d_model, F = d_ff, V = vocab,
// B = batch, T = seq_len, H = heads. Row-major throughout. Kernels that produce a
// parameter gradient accumulate into it (+=), so gradient accumulation over micro-batches
// needs no extra pass; kernels that produce an activation gradient overwrite it, except
// where noted (layernorm_backward accumulates into din because the residual stream also
// carries a gradient there).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "fuyou/elem_type.h"
#include "fuyou/rope.h"

namespace fuyou {

struct DeviceAdamW;

// `n` elements of a device buffer at `data` (Backend::sum_squares_spans).
struct SquareSpan {
  const void* data = nullptr;
  size_t n = 0;
};

// The spans qk_norm_forward normalises in each row of qkvc(N, (Hq + 2Hkv) D): q_spans spans
// of q_width values (the q part), then k_spans of k_width (the k part); v follows. Qwen3
// normalises each head (heads()), OLMo 2 the whole q and the whole k projection
// (projection()), each span with its own statistics and the weight of its part (q_width or
// k_width values: one head's, or the projection's).
struct QkNormSpans {
  int q_spans = 0, k_spans = 0;
  int q_width = 0, k_width = 0;

  static QkNormSpans heads(int Hq, int Hkv, int D) { return {Hq, Hkv, D, D}; }
  static QkNormSpans projection(int Hq, int Hkv, int D) { return {1, 1, Hq * D, Hkv * D}; }
  int spans() const { return q_spans + k_spans; }
  size_t q_values() const { return static_cast<size_t>(q_spans) * q_width; }
  size_t k_values() const { return static_cast<size_t>(k_spans) * k_width; }
  size_t row() const { return q_values() + 2 * k_values(); }  // qkvc's row: q, k, v
  size_t saved_row() const { return q_values() + k_values(); }
  // Span j's first value within a row (of qkvc, and of saved: q and k come first in both).
  size_t offset(int j) const {
    return j < q_spans ? static_cast<size_t>(j) * q_width
                       : q_values() + static_cast<size_t>(j - q_spans) * k_width;
  }
  int width(int j) const { return j < q_spans ? q_width : k_width; }
};

// kEmulated: a GPU that does no arithmetic but takes a hardware profile's time
// (runtime.backend: emulated, kernels/emulated/emulated_backend.h).
enum class BackendKind { kCpu, kCuda, kEmulated };

// The target value of a position whose prediction does not count in the loss (a prompt token
// of prompt/completion data): see crossentropy_forward.
constexpr int32_t kIgnoreTarget = -1;

// What GEMM inputs are rounded to before the product (runtime.precision); accumulation is
// fp32 in every mode. What the device stores its tensors as is the storage type
// (Backend::storage_type, runtime.device_tensors).
enum class MatmulPrecision { kFp32, kBf16, kFp16 };
const char* matmul_precision_name(MatmulPrecision p);

// Which attention a backend runs (runtime.attention). kKernels: the backend's own kernels
// (on every backend the CPU's arithmetic). kCudnn: cuDNN's fused flash attention (the CUDA
// backend with 16-bit tensors; an Error without cuDNN or with fp32 tensors; a shape cuDNN
// refuses runs on the kernels, logged once per reason). kAuto: kCudnn where the backend has
// cuDNN and its tensors are 16-bit, else kKernels.
enum class AttentionImpl { kAuto, kKernels, kCudnn };

// Device-memory accounting: a hard capacity, what is in use now, and the high-water mark.
struct MemoryStats {
  uint64_t capacity = 0;
  uint64_t used = 0;
  uint64_t peak = 0;
};

// ---- the kernels ---------------------------------------------------------------------------
// Tensors passed as void* are of the backend's storage type (storage_type(): fp32, or bf16
// with runtime.device_tensors: bf16): weights, activations, gradients, logits. Tensors passed
// as float* are always fp32: the norms' mean and rstd, the losses, the log-sum-exps and the
// attention's scratch. Every kernel computes in fp32 whatever the storage type (loads widen,
// stores round to nearest even), and accumulates its sums in fp32 or wider.
//
// Each list entry is X(name, (parameters), (arguments)); a backend expands a list with a macro
// that declares (FY_KERNEL_OVERRIDE), forwards (kernels/cpu/stream_backend.h) or counts
// (tests) every kernel, so a kernel is added in one place and in each backend's source.
//
// FUYOU_GEMM_KERNELS: the kernels the FLOP count of a step covers (the emulated device times
// them); FUYOU_ELEMENTWISE_KERNELS: the rest of a layer's kernels, memory-bound.
//
// matmul_forward: out(N,OC) = in(N,IC) * w(OC,IC)^T + bias(OC); bias may be null.
// matmul_backward: din(N,IC) = dout * w (overwritten; skipped when din is null); dw(OC,IC) +=
//   dout^T in (skipped when null: a frozen weight, lora); dbias(OC) += column sums of dout
//   (skipped when null). din may alias in: dw is
//   computed from in before din is written (the MLP's backward overwrites its input activation).
//
// Packed records (segments). `pos` (device memory, B*T int32, or null) gives each token its
// position within its record: pos[b*T + t] is 0 where a record starts and pos[b*T + t - 1] + 1
// otherwise (pos[b*T] is 0), so the record of token t is the run [t - pos[b*T + t], t] of
// row b. Attention is causal within each record only (no token attends to another record's),
// rotary phases restart with each record, and learned positions are looked up by pos (the
// model gathers them; embedding_forward is unchanged). Null: one record per row, pos = t,
// the arithmetic of an unpacked batch bit for bit. Transformer::set_tokens checks the rule.
//
// attention_forward: causal multi-head self-attention on packed qkv(B,T,3C) (q | k | v, heads
//   contiguous within each), each query attending the keys of its own record up to itself
//   (see `pos`). Writes out(B,T,C) and lse(B,H,T), each query row's log-sum-exp of its scaled
//   scores: all the backward needs besides qkv, which recomputes the probabilities from them
//   (no (T, T) matrix outlives a call). scratch: 2 T T fp32 values of workspace that a
//   backend may use within the call (the CUDA backend's unfused kernels do).
// attention_backward: dqkv(B,T,3C) overwritten. out is the forward's output (a fused backward
//   reads it for each row's sum of dout * out; the kernels recompute from qkv and lse alone).
//   `pos` as the forward's.
// clang-format off
#define FUYOU_GEMM_KERNELS(X)                                                                    \
  X(matmul_forward, (void* out, const void* in, const void* w, const void* bias, int N, int IC,  \
                     int OC),                                                                    \
    (out, in, w, bias, N, IC, OC))                                                               \
  X(matmul_backward, (void* din, void* dw, void* dbias, const void* dout, const void* in,        \
                      const void* w, int N, int IC, int OC),                                     \
    (din, dw, dbias, dout, in, w, N, IC, OC))                                                    \
  X(attention_forward, (void* out, float* lse, float* scratch, const void* qkv, int B, int T,    \
                        int C, int H, const int32_t* pos),                                       \
    (out, lse, scratch, qkv, B, T, C, H, pos))                                                   \
  X(attention_backward, (void* dqkv, float* scratch, const void* dout, const void* out,          \
                         const void* qkv, const float* lse, int B, int T, int C, int H,          \
                         const int32_t* pos),                                                    \
    (dqkv, scratch, dout, out, qkv, lse, B, T, C, H, pos))
// clang-format on
//
// embedding_forward: out(N,C) = wte[tokens[n]] + wpe[n % T]. wpe may be null (a family
//   without a position table, llama): then out = wte[tokens[n]].
// embedding_backward: dwte(V,C) += scatter of dout rows by token; dwpe(T,C) += sum over batch
//   (skipped when dwpe is null).
// layernorm_forward: out(N,C) = (in - mean) * rstd * w + b; saves mean(N), rstd(N) for the
//   backward. layernorm_backward: din(N,C) += ...; dw(C), db(C) += ...
// gelu_forward: GELU, tanh approximation. gelu_backward: din = dout * gelu'(in); din may
//   alias dout.
// add: out = a + b (out may alias a or b).
// residual_layernorm_forward: the residual add and the LayerNorm after it in one pass over
//   each row: res(N,C) = a + b (res may alias a or b), then out, mean and rstd as
//   layernorm_forward(out, mean, rstd, res, w, bias), which reads the sum as stored (rounded
//   to the storage type): the same bits as add then layernorm_forward. The backward needs no
//   fused kernel: layernorm_backward already adds into the residual stream's gradient.
// crossentropy_forward / _backward: mean cross-entropy support. Forward: losses(N) =
//   logsumexp(logits[n]) - logits[n][target], and lse(N) saved. Backward: logits(N,V) is
//   overwritten with (softmax(logits) - onehot(target)) * scale, the gradient of
//   scale * sum(losses). A target equal to kIgnoreTarget (-1, PyTorch's ignore_index) does
//   not count: its row gets loss 0 (and lse 0) in the forward and an all-zero gradient row in
//   the backward, so a masked-out target contributes neither loss nor gradient. The caller
//   divides by the number of counted targets (the mean over counted targets: scale =
//   1 / count). Rows are ld >= V elements apart: a vocabulary padded for the GEMMs' sake (the
//   model's padded_vocab) has ld - V columns past the real ones, which the forward ignores and
//   the backward sets to zero, so the padding's weight rows get no gradient.
// crossentropy_forward_backward: the forward then the backward on the same rows in one pass
//   over the logits (training: the loss and the logits' gradient, written in place), with
//   the same bits in losses, lse and the gradient as the two kernels one after the other.
//
// The opt and llama families' kernels. Hq = query heads, Hkv = key/value heads (Hkv divides
// Hq), D = head size, C = Hq * D. Grouped-query attention projects to a compact packed
// qkvc(N, (Hq + 2 Hkv) D): q | k | v, heads contiguous within each, as one matmul with the
// packed q/k/v weight writes it. Per-element math for all of these is in
// kernels/common/element_math.h.
// rmsnorm_forward: out(N,C) = in * rstd * w, with rstd(N) = 1 / sqrt(mean over C of in^2 +
//   eps) saved for the backward (statistics accumulated in math::StatAcc, as layernorm).
//   rmsnorm_backward: din(N,C) += ... (accumulates, like layernorm_backward); dw(C) += ...
// residual_rmsnorm_forward: res = a + b, then rmsnorm_forward(out, rstd, res, w, eps), in one
//   pass over each row, with the bits of the two kernels (as residual_layernorm_forward).
// rope_forward: rotary position embeddings (Llama's rotate-half form), in place on the q and k
//   heads of qkvc(B,T,(Hq+2Hkv)D); v is untouched. Row n has position pos[n] (n % T when pos
//   is null; see attention_forward for pos); within each head the pair (i, i + D/2), i < D/2,
//   is rotated by the angle position * rope.inv_freq[i], cos and sin scaled by rope.scale
//   (fuyou/rope.h; i < rope.pairs = D/2). rope_backward: the
//   transpose (rotation by -angle), in place on the q and k parts of dqkvc(B,T,(Hq+2Hkv)D).
// qk_norm_forward: the RMSNorm of each span s (QkNormSpans: each q and k head for Qwen3, the
//   whole q and k projections for OLMo 2) of qkvc(N, s.row()), in place, before RoPE: span x
//   becomes x * r * w with r = 1 / sqrt(mean(x^2) + eps), w = qw (s.q_width) for q spans and
//   kw (s.k_width) for k spans; v is untouched. r is saved in rstd(N, s.spans()) and, when
//   saved is not null, every row's q and k parts as they were in saved(N, s.saved_row()).
//   qk_norm_backward: the q and k parts of dqkvc (the gradient after the norm) overwritten
//   with the gradient before it, from saved and rstd; dqw (s.q_width), dkw (s.k_width) += ....
// repeat_kv_forward: grouped-query attention in its simple form: expands qkvc(N,(Hq+2Hkv)D)
//   into the full packed qkv(N,3C) that attention_forward takes, k/v head j copied to query
//   heads j*G .. j*G+G-1 (G = Hq/Hkv). repeat_kv_backward: dqkvc(N,(Hq+2Hkv)D) overwritten: q
//   part copied from dqkv(N,3C), each k/v head the sum of the gradients of its G copies.
// swiglu_forward: SwiGLU on the packed gate|up projection gu(N,2F) (row n: gate[0..F) then
//   up[0..F)): out(N,F) = silu(gate) * up. swiglu_backward: dgu(N,2F) overwritten from
//   dout(N,F).
// relu_forward: ReLU (opt's MLP activation). relu_backward: din = dout * (in > 0); din may
//   alias dout.
// clang-format off
#define FUYOU_ELEMENTWISE_KERNELS(X)                                                             \
  X(embedding_forward, (void* out, const int32_t* tokens, const void* wte, const void* wpe,      \
                        int B, int T, int C),                                                    \
    (out, tokens, wte, wpe, B, T, C))                                                            \
  X(embedding_backward, (void* dwte, void* dwpe, const void* dout, const int32_t* tokens, int B, \
                         int T, int C),                                                          \
    (dwte, dwpe, dout, tokens, B, T, C))                                                         \
  X(layernorm_forward, (void* out, float* mean, float* rstd, const void* in, const void* w,      \
                        const void* b, int N, int C),                                            \
    (out, mean, rstd, in, w, b, N, C))                                                           \
  X(layernorm_backward, (void* din, void* dw, void* db, const void* dout, const void* in,        \
                         const void* w, const float* mean, const float* rstd, int N, int C),     \
    (din, dw, db, dout, in, w, mean, rstd, N, C))                                                \
  X(gelu_forward, (void* out, const void* in, size_t n), (out, in, n))                           \
  X(gelu_backward, (void* din, const void* in, const void* dout, size_t n), (din, in, dout, n))  \
  X(add, (void* out, const void* a, const void* b, size_t n), (out, a, b, n))                    \
  X(residual_layernorm_forward, (void* res, void* out, float* mean, float* rstd, const void* a,  \
                                 const void* b, const void* w, const void* bias, int N, int C),  \
    (res, out, mean, rstd, a, b, w, bias, N, C))                                                 \
  X(crossentropy_forward, (float* losses, float* lse, const void* logits,                        \
                           const int32_t* targets, int N, int V, int ld),                        \
    (losses, lse, logits, targets, N, V, ld))                                                    \
  X(crossentropy_backward, (void* logits_to_dlogits, const float* lse, const int32_t* targets,   \
                            float scale, int N, int V, int ld),                                  \
    (logits_to_dlogits, lse, targets, scale, N, V, ld))                                          \
  X(crossentropy_forward_backward, (float* losses, float* lse, void* logits_to_dlogits,          \
                                    const int32_t* targets, float scale, int N, int V, int ld),  \
    (losses, lse, logits_to_dlogits, targets, scale, N, V, ld))                                  \
  X(rmsnorm_forward, (void* out, float* rstd, const void* in, const void* w, float eps, int N,   \
                      int C),                                                                    \
    (out, rstd, in, w, eps, N, C))                                                               \
  X(rmsnorm_backward, (void* din, void* dw, const void* dout, const void* in, const void* w,     \
                       const float* rstd, int N, int C),                                         \
    (din, dw, dout, in, w, rstd, N, C))                                                          \
  X(residual_rmsnorm_forward, (void* res, void* out, float* rstd, const void* a, const void* b,  \
                               const void* w, float eps, int N, int C),                          \
    (res, out, rstd, a, b, w, eps, N, C))                                                        \
  X(rope_forward, (void* qkvc, int B, int T, int Hq, int Hkv, int D, const RopeTable& rope,      \
                   const int32_t* pos),                                                          \
    (qkvc, B, T, Hq, Hkv, D, rope, pos))                                                         \
  X(rope_backward, (void* dqkvc, int B, int T, int Hq, int Hkv, int D, const RopeTable& rope,    \
                    const int32_t* pos),                                                         \
    (dqkvc, B, T, Hq, Hkv, D, rope, pos))                                                        \
  X(qk_norm_forward, (void* qkvc, void* saved, float* rstd, const void* qw, const void* kw,       \
                      float eps, int N, const QkNormSpans& s),                                   \
    (qkvc, saved, rstd, qw, kw, eps, N, s))                                                      \
  X(qk_norm_backward, (void* dqkvc, void* dqw, void* dkw, const void* saved, const void* qw,     \
                       const void* kw, const float* rstd, int N, const QkNormSpans& s),          \
    (dqkvc, dqw, dkw, saved, qw, kw, rstd, N, s))                                                \
  X(repeat_kv_forward, (void* qkv, const void* qkvc, int N, int Hq, int Hkv, int D),             \
    (qkv, qkvc, N, Hq, Hkv, D))                                                                  \
  X(repeat_kv_backward, (void* dqkvc, const void* dqkv, int N, int Hq, int Hkv, int D),          \
    (dqkvc, dqkv, N, Hq, Hkv, D))                                                                \
  X(swiglu_forward, (void* out, const void* gu, int N, int F), (out, gu, N, F))                  \
  X(swiglu_backward, (void* dgu, const void* gu, const void* dout, int N, int F),                \
    (dgu, gu, dout, N, F))                                                                       \
  X(relu_forward, (void* out, const void* in, size_t n), (out, in, n))                           \
  X(relu_backward, (void* din, const void* in, const void* dout, size_t n), (din, in, dout, n))
// clang-format on
#define FUYOU_LAYER_KERNELS(X) FUYOU_GEMM_KERNELS(X) FUYOU_ELEMENTWISE_KERNELS(X)
//
// rope_forward_at: rotary embeddings as rope_forward, on qkvc(N,(Hq+2Hkv)D) whose row n is at
//   position pos0 + n.
// attention_decode: causal attention of N new rows of one sequence over the cache. k_cache and
//   v_cache hold (capacity, Hkv D) each, rows 0 .. pos0-1 filled. The k and v parts of
//   qkvc(N,(Hq+2Hkv)D) (after RoPE) are first stored at rows pos0 .. pos0+N-1; then
//   out(N, Hq D): row i, query head h attends to cache rows 0 .. pos0+i of key/value head
//   h / (Hq / Hkv), scores scaled by 1/sqrt(D), softmax and sums in fp32 (gpt2/opt: Hkv = Hq,
//   and qkvc is their packed qkv).
// clang-format off
#define FUYOU_DECODE_KERNELS(X)                                                                  \
  X(rope_forward_at, (void* qkvc, int N, int pos0, int Hq, int Hkv, int D,                      \
                      const RopeTable& rope),                                                    \
    (qkvc, N, pos0, Hq, Hkv, D, rope))                                                           \
  X(attention_decode, (void* out, void* k_cache, void* v_cache, const void* qkvc, int N,         \
                       int pos0, int Hq, int Hkv, int D),                                        \
    (out, k_cache, v_cache, qkvc, N, pos0, Hq, Hkv, D))
// clang-format on

// Expansions: a pure virtual kernel (Backend), a virtual one with a default (Backend's
// decoding kernels refuse), and an override a backend defines in its source.
#define FY_KERNEL_PURE(name, params, args) virtual void name params = 0;
#define FY_KERNEL_VIRTUAL(name, params, args) virtual void name params;
#define FY_KERNEL_OVERRIDE(name, params, args) void name params override;

class Backend {
 public:
  virtual ~Backend() = default;

  virtual BackendKind kind() const = 0;
  virtual std::string name() const = 0;  // e.g. "cpu (2 threads, oneDNN sgemm)"
  virtual int threads() const = 0;
  // Whether the device arena is host memory (the CPU backend's), so that the planner counts
  // it against offload.host_memory too.
  virtual bool device_is_host_memory() const { return kind() == BackendKind::kCpu; }

  // GEMM precision of matmul_forward / matmul_backward (the projections and the LM head).
  // Throws fuyou::Error when the backend cannot run `p`.
  virtual void set_matmul_precision(MatmulPrecision p) = 0;
  virtual MatmulPrecision matmul_precision() const = 0;

  // The element type of the device's tensors (see the kernels below): fp32 (the default and
  // the reference) or bf16. Set before anything is allocated; throws fuyou::Error naming the
  // backend when it cannot store `t`.
  virtual void set_storage_type(ElemType t) = 0;
  // runtime.attention. A backend without a fused attention takes kAuto and kKernels and
  // refuses kCudnn (an Error naming itself), so a request it cannot honour never runs
  // quietly on other kernels.
  virtual void set_attention_impl(AttentionImpl impl);
  // runtime.gemm_bias: true adds the projections' bias in the GEMM's epilogue (CUDA, 16-bit
  // tensors, cuBLASLt) instead of a broadcast kernel before a GEMM with beta = 1. A backend
  // without such an epilogue refuses true (an Error naming itself).
  virtual void set_bias_epilogue(bool on);
  virtual ElemType storage_type() const = 0;
  size_t storage_bytes() const { return elem_type_size(storage_type()); }

  // ---- memory -------------------------------------------------------------------------
  // Allocates from the device arena; throws fuyou::Error naming `what`, the request and the
  // remaining capacity when it does not fit. Memory is 64-byte aligned and zeroed.
  virtual void* alloc(size_t bytes, const std::string& what) = 0;
  virtual void free(void* ptr) = 0;
  virtual MemoryStats memory() const = 0;
  virtual void copy_to_device(void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_to_host(void* dst, const void* src, size_t bytes) = 0;
  virtual void zero(void* ptr, size_t bytes) = 0;
  virtual void synchronize() = 0;
  // For a caller that orders device work itself (the offload executor: an op starts only
  // after the ops it depends on have finished, and each compute op ends with
  // finish_compute()). Copies then wait only for their own transfer, not for all compute
  // queued before them, so a weight load runs beside the layer computing. Default (off):
  // every copy first waits for the compute queued so far.
  virtual void set_caller_ordered(bool on) { (void)on; }
  // Waits until the compute queued so far has finished (nothing to wait for where compute
  // is synchronous, as on the CPU).
  virtual void finish_compute() {}
  // Page-locks host memory for fast asynchronous copies (CUDA); nothing to do on the CPU.
  // False: refused (e.g. the locked-memory limit); copies from it still work, slower.
  virtual bool register_host(void* ptr, size_t bytes) { return (void)ptr, (void)bytes, true; }
  virtual void unregister_host(void* ptr) { (void)ptr; }

  // ---- the kernels (the lists and their contracts: FUYOU_GEMM_KERNELS above) ------------
  FUYOU_LAYER_KERNELS(FY_KERNEL_PURE)
  // Decoding with a key/value cache (GptDecoder, fuyou-generate): forward only. The CPU and
  // CUDA backends implement them; any other refuses (an Error naming itself and the op).
  FUYOU_DECODE_KERNELS(FY_KERNEL_VIRTUAL)

  // ---- the optimizer on the device ------------------------------------------------------
  // For a model whose whole optimizer state fits the device (the in-memory step with
  // optimizer.placement device): the gradient's sum of squares, its fp32 sums over
  // micro-batches and AdamW run where the gradients are, with the host optimizer's
  // arithmetic in the host optimizer's order, so the results are the same bits. A backend
  // without them answers false here and the step keeps the host optimizer; the others
  // throw fuyou::Error naming the backend.
  virtual bool supports_device_optimizer() const { return false; }
  // sum(n, fp32) = widen(g) when first, else sum += widen(g), element by element.
  virtual void accumulate_fp32(float* sum, const void* g, ElemType type, size_t n, bool first);
  // The sum of squares of x's elements over `groups` (element offset, count), in the order
  // of kernels/common/sum_squares.h; returned to the host once the kernels queued before
  // have run.
  virtual double sum_squares(const void* x, ElemType type,
                             const std::vector<std::pair<size_t, size_t>>& groups);
  // The same over separate buffers (each span one group, in order): sum_squares's bits for the
  // same elements, returned to the host once for all of them. The default asks sum_squares
  // span by span; CUDA sums them in one launch.
  virtual double sum_squares_spans(const std::vector<SquareSpan>& spans, ElemType type);
  // AdamW over device-resident fp32 state (DeviceAdamW).
  virtual void adamw(const DeviceAdamW& a);

  // ---- step timing (fuyou-bench train --breakdown) ---------------------------------------
  // Marks on the compute queue's timeline, between timing_start() and timing_stop(): a mark
  // records the instant the device reaches that point of its queue (CUDA: an event on the
  // compute stream; the CPU, whose compute is synchronous: the clock; cpu-streams: the clock
  // when its compute queue gets there). The span from one mark to the next belongs to the
  // first mark's tag (include/fuyou/op_class.h): the device's time on the work queued
  // between them, and any time it sat idle until the host queued more. So the spans tile the
  // device's timeline from the first mark to the last with nothing counted twice.
  // Marks come from the thread driving the compute queue (the offloading executor's compute
  // thread, or the in-memory step's); start and stop may come from another.
  struct TimingMark {
    int tag;
    double t;  // seconds after the first mark
  };
  virtual void timing_start();
  bool timing_on() const { return timing_on_.load(std::memory_order_relaxed); }
  virtual void timing_mark(int tag);  // nothing while timing is off
  // Waits for the last mark, ends timing, and returns the marks in queue order.
  virtual std::vector<TimingMark> timing_stop();

 protected:
  std::atomic<bool> timing_on_{false};
  std::mutex timing_mu_;  // guards the marks between the marking thread and start / stop

 private:
  std::vector<std::pair<int, double>> host_marks_;  // the clock-based default's marks
};

// One piece of a device AdamW update: elements [begin, begin + n) of the flat arrays, all
// of one tensor (so of one weight decay). Pieces are at most kDeviceAdamWPiece elements, so
// a GPU spreads them over its multiprocessors evenly.
struct AdamWPiece {
  uint64_t begin = 0;
  uint32_t n = 0;
  uint32_t decay = 0;  // 1: weight decay applies (DeviceAdamW::decay_on), 0: decay_off
};
constexpr uint32_t kDeviceAdamWPiece = 1u << 16;

// AdamW on the device (Backend::adamw), the constants of math::AdamWConsts as the host
// optimizer computes them (optim: adamw_consts). Per element of each piece:
// math::adamw_element(master, m, v, widen(grad) , consts with decay_on or decay_off), and the
// new master rounded to lowp's type when lowp is set.
struct DeviceAdamW {
  float* master = nullptr;  // fp32, the flat layout; may be the device's weights (fp32 tensors)
  float* m = nullptr;
  float* v = nullptr;
  const void* grad = nullptr;
  ElemType grad_type = ElemType::kF32;
  void* lowp = nullptr;  // the device's 16-bit weights, or null
  ElemType lowp_type = ElemType::kBF16;
  const AdamWPiece* pieces = nullptr;  // device memory (alloc'd), `count` of them
  size_t count = 0;
  float grad_scale = 1, decay_on = 1, decay_off = 1, one_minus_b1 = 0, b2 = 0, one_minus_b2 = 0,
        bc2_sqrt = 1, eps = 0, neg_step = 0;
};

std::unique_ptr<Backend> make_cpu_backend(int threads, uint64_t device_memory);

// The CPU backend with the CUDA backend's ordering rules (runtime.backend: cpu-streams; see
// kernels/cpu/stream_backend.h): asynchronous compute, one copy queue per direction.
struct StreamOptions {
  // Each queued operation first sleeps a random time in [min_delay_us, max_delay_us]
  // microseconds (max: runtime.stream_delay_us; 0: none), from generators seeded with `seed`.
  int min_delay_us = 0, max_delay_us = 0;
  uint64_t seed = 1;
};
std::unique_ptr<Backend> make_cpu_stream_backend(int threads, uint64_t device_memory,
                                                 const StreamOptions& opts);

// Page-locks each (pointer, bytes) host buffer through be.register_host (CUDA: full-speed
// asynchronous copies), appending those it locked to *locked for unregister_host later; what
// it could not lock (the locked-memory limit) is logged once, naming `whose` buffers: copies
// from them run through the driver's staging, slower.
void page_lock_host(Backend& be, const std::vector<std::pair<void*, size_t>>& buffers,
                    std::vector<void*>* locked, const char* whose);

}  // namespace fuyou
