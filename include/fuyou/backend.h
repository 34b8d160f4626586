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

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace fuyou {

struct RuntimeConfig;

enum class BackendKind { kCpu, kCuda };

// Device-memory accounting: a hard capacity, what is in use now, and the high-water mark.
struct MemoryStats {
  uint64_t capacity = 0;
  uint64_t used = 0;
  uint64_t peak = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual BackendKind kind() const = 0;
  virtual std::string name() const = 0;  // e.g. "cpu (2 threads, oneDNN sgemm)"
  virtual int threads() const = 0;

  // ---- memory -------------------------------------------------------------------------
  // Allocates from the device arena; throws fuyou::Error naming `what`, the request and the
  // remaining capacity when it does not fit. Memory is 64-byte aligned and zeroed.
  virtual void* alloc(size_t bytes, const std::string& what) = 0;
  virtual void free(void* ptr) = 0;
  virtual MemoryStats memory() const = 0;
  virtual void copy_to_device(void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_to_host(void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_on_device(void* dst, const void* src, size_t bytes) = 0;
  virtual void zero(void* ptr, size_t bytes) = 0;
  virtual void synchronize() = 0;

  // ---- transformer kernels (fp32) --------------------------------------------------------
  // out(N,C) = wte[tokens[n]] + wpe[n % T]
  virtual void embedding_forward(float* out, const int32_t* tokens, const float* wte,
                                 const float* wpe, int B, int T, int C) = 0;
  // dwte(V,C) += scatter of dout rows by token; dwpe(T,C) += sum over batch.
  virtual void embedding_backward(float* dwte, float* dwpe, const float* dout,
                                  const int32_t* tokens, int B, int T, int C) = 0;

  // out(N,C) = (in - mean) * rstd * w + b; saves mean(N), rstd(N) for the backward.
  virtual void layernorm_forward(float* out, float* mean, float* rstd, const float* in,
                                 const float* w, const float* b, int N, int C) = 0;
  // din(N,C) += ...; dw(C), db(C) += ...
  virtual void layernorm_backward(float* din, float* dw, float* db, const float* dout,
                                  const float* in, const float* w, const float* mean,
                                  const float* rstd, int N, int C) = 0;

  // out(N,OC) = in(N,IC) * w(OC,IC)^T + bias(OC); bias may be null.
  virtual void matmul_forward(float* out, const float* in, const float* w, const float* bias,
                              int N, int IC, int OC) = 0;
  // din(N,IC) = dout * w (overwritten; skipped when din is null); dw(OC,IC) += dout^T in;
  // dbias(OC) += column sums of dout (skipped when null).
  virtual void matmul_backward(float* din, float* dw, float* dbias, const float* dout,
                               const float* in, const float* w, int N, int IC, int OC) = 0;

  // Causal multi-head self-attention on packed qkv(B,T,3C) (q | k | v, heads contiguous
  // within each). Writes out(B,T,C) and the softmax probabilities att(B,H,T,T) that the
  // backward needs.
  virtual void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C,
                                 int H) = 0;
  // dqkv(B,T,3C) overwritten; datt(B,H,T,T) is scratch.
  virtual void attention_backward(float* dqkv, float* datt, const float* dout, const float* qkv,
                                  const float* att, int B, int T, int C, int H) = 0;

  // GELU, tanh approximation.
  virtual void gelu_forward(float* out, const float* in, size_t n) = 0;
  // din = dout * gelu'(in); din may alias dout.
  virtual void gelu_backward(float* din, const float* in, const float* dout, size_t n) = 0;

  // out = a + b (out may alias a or b).
  virtual void add(float* out, const float* a, const float* b, size_t n) = 0;

  // Mean cross-entropy support. Forward: losses(N) = logsumexp(logits[n]) - logits[n][target],
  // and lse(N) saved. Backward: logits(N,V) is overwritten with
  // (softmax(logits) - onehot(target)) * scale, the gradient of scale * sum(losses).
  virtual void crossentropy_forward(float* losses, float* lse, const float* logits,
                                    const int32_t* targets, int N, int V) = 0;
  virtual void crossentropy_backward(float* logits_to_dlogits, const float* lse,
                                     const int32_t* targets, float scale, int N, int V) = 0;

  // Returns sum of squares of x[0..n), accumulated in double.
  virtual double sum_squares(const float* x, size_t n) = 0;
  virtual void scale(float* x, float s, size_t n) = 0;
};

// Picks and creates the backend for runtime.backend (cpu | cuda | auto). `reason` receives a
// sentence saying which backend was chosen and why (for the first log line).
std::unique_ptr<Backend> make_backend(const RuntimeConfig& runtime, uint64_t device_memory,
                                      std::string* reason);

std::unique_ptr<Backend> make_cpu_backend(int threads, uint64_t device_memory);

}  // namespace fuyou
