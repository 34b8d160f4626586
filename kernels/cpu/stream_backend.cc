#include "kernels/cpu/stream_backend.h"

#include <cstring>

#include "fuyou/error.h"

namespace fuyou::cpu {

namespace {
// Garbage for new allocations until their zeroing runs: every float NaN.
constexpr int kPoison = 0xFF;
}  // namespace

// The queues' generators are streams 0..2 of the seed: the same seed gives the same delays.
StreamBackend::StreamBackend(std::unique_ptr<Backend> inner, const StreamOptions& opts)
    : inner_(std::move(inner)),
      opts_(opts),
      compute_(inner_->threads(), opts.min_delay_us, opts.max_delay_us, opts.seed, 0),
      h2d_(1, opts.min_delay_us, opts.max_delay_us, opts.seed, 1),
      d2h_(1, opts.min_delay_us, opts.max_delay_us, opts.seed, 2) {
  FY_CHECK(opts.min_delay_us >= 0 && opts.min_delay_us <= opts.max_delay_us, "delays ",
           opts.min_delay_us, " .. ", opts.max_delay_us, " us");
}

// The queues drain in their destructors (compute first: a queued free reaches inner_ then).
StreamBackend::~StreamBackend() = default;

std::string StreamBackend::name() const {
  return str("cpu-streams (CUDA ordering: asynchronous compute queue, a copy queue per direction",
             opts_.max_delay_us ? str(", random delays of ", opts_.min_delay_us, "-",
                                      opts_.max_delay_us, " us, seed ", opts_.seed)
                                : "",
             ") over ", inner_->name());
}

// Kernels already queued read the precision when they run: they finish first.
void StreamBackend::set_matmul_precision(MatmulPrecision p) {
  compute_.wait_all();
  inner_->set_matmul_precision(p);
}

void* StreamBackend::alloc(size_t bytes, const std::string& what) {
  void* p = inner_->alloc(bytes, what);
  std::memset(p, kPoison, bytes);
  std::lock_guard<std::mutex> lock(zeroed_mu_);
  zeroed_ = compute_.submit([p, bytes] { std::memset(p, 0, bytes); });
  return p;
}

void StreamBackend::free(void* ptr) {
  if (!ptr) return;
  compute_.submit([this, ptr] { inner_->free(ptr); });
}

// The caller blocks until its copy is done (as CudaBackend::copy_on), so a host buffer may be
// reused at once. The copy waits for the compute queued before it, or, caller-ordered, only
// for the zeroing of the allocations made so far.
void StreamBackend::copy(OpQueue& q, void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  uint64_t after = 0;
  if (caller_ordered_) {
    std::lock_guard<std::mutex> lock(zeroed_mu_);
    after = zeroed_;
  } else {
    after = compute_.submitted();
  }
  q.wait(q.submit([this, after, dst, src, bytes] {
    if (after) compute_.wait(after);
    std::memcpy(dst, src, bytes);
  }));
}

void StreamBackend::copy_to_device(void* dst, const void* src, size_t bytes) {
  copy(h2d_, dst, src, bytes);
}
void StreamBackend::copy_to_host(void* dst, const void* src, size_t bytes) {
  copy(d2h_, dst, src, bytes);
}

void StreamBackend::zero(void* ptr, size_t bytes) {
  if (bytes) kernel([ptr, bytes] { std::memset(ptr, 0, bytes); });
}

void StreamBackend::synchronize() {
  compute_.wait_all();
  h2d_.wait_all();
  d2h_.wait_all();
}

// ---- kernels: queued, arguments captured by value ----------------------------------------

void StreamBackend::embedding_forward(void* out, const int32_t* tokens, const void* wte,
                                      const void* wpe, int B, int T, int C) {
  kernel([=, this] { inner_->embedding_forward(out, tokens, wte, wpe, B, T, C); });
}
void StreamBackend::embedding_backward(void* dwte, void* dwpe, const void* dout,
                                       const int32_t* tokens, int B, int T, int C) {
  kernel([=, this] { inner_->embedding_backward(dwte, dwpe, dout, tokens, B, T, C); });
}
void StreamBackend::layernorm_forward(void* out, float* mean, float* rstd, const void* in,
                                      const void* w, const void* b, int N, int C) {
  kernel([=, this] { inner_->layernorm_forward(out, mean, rstd, in, w, b, N, C); });
}
void StreamBackend::layernorm_backward(void* din, void* dw, void* db, const void* dout,
                                       const void* in, const void* w, const float* mean,
                                       const float* rstd, int N, int C) {
  kernel([=, this] { inner_->layernorm_backward(din, dw, db, dout, in, w, mean, rstd, N, C); });
}
void StreamBackend::matmul_forward(void* out, const void* in, const void* w, const void* bias,
                                   int N, int IC, int OC) {
  kernel([=, this] { inner_->matmul_forward(out, in, w, bias, N, IC, OC); });
}
void StreamBackend::matmul_backward(void* din, void* dw, void* dbias, const void* dout,
                                    const void* in, const void* w, int N, int IC, int OC) {
  kernel([=, this] { inner_->matmul_backward(din, dw, dbias, dout, in, w, N, IC, OC); });
}
void StreamBackend::attention_forward(void* out, float* lse, float* scratch, const void* qkv, int B,
                                      int T, int C, int H, const int32_t* pos) {
  kernel([=, this] { inner_->attention_forward(out, lse, scratch, qkv, B, T, C, H, pos); });
}
void StreamBackend::attention_backward(void* dqkv, float* scratch, const void* dout,
                                       const void* out, const void* qkv, const float* lse, int B,
                                       int T, int C, int H, const int32_t* pos) {
  kernel([=, this] {
    inner_->attention_backward(dqkv, scratch, dout, out, qkv, lse, B, T, C, H, pos);
  });
}
void StreamBackend::gelu_forward(void* out, const void* in, size_t n) {
  kernel([=, this] { inner_->gelu_forward(out, in, n); });
}
void StreamBackend::gelu_backward(void* din, const void* in, const void* dout, size_t n) {
  kernel([=, this] { inner_->gelu_backward(din, in, dout, n); });
}
void StreamBackend::add(void* out, const void* a, const void* b, size_t n) {
  kernel([=, this] { inner_->add(out, a, b, n); });
}
void StreamBackend::crossentropy_forward(float* losses, float* lse, const void* logits,
                                         const int32_t* targets, int N, int V, int ld) {
  kernel([=, this] { inner_->crossentropy_forward(losses, lse, logits, targets, N, V, ld); });
}
void StreamBackend::crossentropy_backward(void* logits_to_dlogits, const float* lse,
                                          const int32_t* targets, float scale, int N, int V,
                                          int ld) {
  kernel([=, this] {
    inner_->crossentropy_backward(logits_to_dlogits, lse, targets, scale, N, V, ld);
  });
}
void StreamBackend::rmsnorm_forward(void* out, float* rstd, const void* in, const void* w,
                                    float eps, int N, int C) {
  kernel([=, this] { inner_->rmsnorm_forward(out, rstd, in, w, eps, N, C); });
}
void StreamBackend::rmsnorm_backward(void* din, void* dw, const void* dout, const void* in,
                                     const void* w, const float* rstd, int N, int C) {
  kernel([=, this] { inner_->rmsnorm_backward(din, dw, dout, in, w, rstd, N, C); });
}
void StreamBackend::rope_forward(void* qkvc, int B, int T, int Hq, int Hkv, int D, float theta,
                                 const int32_t* pos) {
  kernel([=, this] { inner_->rope_forward(qkvc, B, T, Hq, Hkv, D, theta, pos); });
}
void StreamBackend::rope_forward_at(void* qkvc, int N, int pos0, int Hq, int Hkv, int D,
                                    float theta) {
  kernel([=, this] { inner_->rope_forward_at(qkvc, N, pos0, Hq, Hkv, D, theta); });
}
void StreamBackend::attention_decode(void* out, void* k_cache, void* v_cache, const void* qkvc,
                                     int N, int pos0, int Hq, int Hkv, int D) {
  kernel([=, this] { inner_->attention_decode(out, k_cache, v_cache, qkvc, N, pos0, Hq, Hkv, D); });
}
void StreamBackend::rope_backward(void* dqkvc, int B, int T, int Hq, int Hkv, int D, float theta,
                                  const int32_t* pos) {
  kernel([=, this] { inner_->rope_backward(dqkvc, B, T, Hq, Hkv, D, theta, pos); });
}
void StreamBackend::repeat_kv_forward(void* qkv, const void* qkvc, int N, int Hq, int Hkv, int D) {
  kernel([=, this] { inner_->repeat_kv_forward(qkv, qkvc, N, Hq, Hkv, D); });
}
void StreamBackend::repeat_kv_backward(void* dqkvc, const void* dqkv, int N, int Hq, int Hkv,
                                       int D) {
  kernel([=, this] { inner_->repeat_kv_backward(dqkvc, dqkv, N, Hq, Hkv, D); });
}
void StreamBackend::swiglu_forward(void* out, const void* gu, int N, int F) {
  kernel([=, this] { inner_->swiglu_forward(out, gu, N, F); });
}
void StreamBackend::swiglu_backward(void* dgu, const void* gu, const void* dout, int N, int F) {
  kernel([=, this] { inner_->swiglu_backward(dgu, gu, dout, N, F); });
}
void StreamBackend::relu_forward(void* out, const void* in, size_t n) {
  kernel([=, this] { inner_->relu_forward(out, in, n); });
}
void StreamBackend::relu_backward(void* din, const void* in, const void* dout, size_t n) {
  kernel([=, this] { inner_->relu_backward(din, in, dout, n); });
}

}  // namespace fuyou::cpu

namespace fuyou {

std::unique_ptr<Backend> make_cpu_stream_backend(int threads, uint64_t device_memory,
                                                 const StreamOptions& opts) {
  return std::make_unique<cpu::StreamBackend>(make_cpu_backend(threads, device_memory), opts);
}

}  // namespace fuyou
