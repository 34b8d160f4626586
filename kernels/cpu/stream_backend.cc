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

}  // namespace fuyou::cpu

namespace fuyou {

std::unique_ptr<Backend> make_cpu_stream_backend(int threads, uint64_t device_memory,
                                                 const StreamOptions& opts) {
  return std::make_unique<cpu::StreamBackend>(make_cpu_backend(threads, device_memory), opts);
}

}  // namespace fuyou
