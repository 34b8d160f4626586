#include "kernels/emulated/emulated_backend.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <thread>

#include "fuyou/error.h"
#include "fuyou/sizes.h"

namespace fuyou::emulated {

namespace {

constexpr uint64_t kAlign = 256;  // the CUDA arena's block alignment

// Waits until `t`, unless that is less than kSleepSlack away: a sleep overshoots by about
// the kernel's timer slack (50 us), which thousands of tiny copies (an embedding's rows)
// would add up to seconds a GPU does not spend. The timeline a wait belongs to keeps the
// time, so the next operation on it starts no earlier.
constexpr std::chrono::microseconds kSleepSlack{100};

void wait_until(std::chrono::steady_clock::time_point t) {
  if (t - std::chrono::steady_clock::now() > kSleepSlack) std::this_thread::sleep_until(t);
}

}  // namespace

EmulatedBackend::EmulatedBackend(const EmulatedOptions& o) : o_(o) {
  if (!(o_.scale > 0))
    throw ConfigError(str("runtime.emulated_scale is ", o_.scale, "; it must be > 0"));
  if (!(o_.gpu.peak_flops > 0) || !(o_.gpu.h2d_Bps > 0) || !(o_.gpu.d2h_Bps > 0))
    throw ConfigError(
        str(o_.gpu.source, ": the emulated device needs compute.peak_tflops and the pcie rates"));
  o_.capacity = o_.capacity / kAlign * kAlign;
  if (o_.capacity == 0)
    throw ConfigError(
        str("the emulated device needs a capacity: set offload.device_memory or memory.device in ",
            o_.gpu.source));
  // Address space only: nothing is committed, and any host access to it faults.
  void* p =
      mmap(nullptr, o_.capacity, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    throw Error(
        str("emulated device: cannot reserve ", format_size(o_.capacity), " of address space"));
  base_ = static_cast<char*>(p);
}

EmulatedBackend::~EmulatedBackend() {
  if (base_) munmap(base_, o_.capacity);
}

std::string EmulatedBackend::name() const {
  return str("emulated ", o_.gpu.name, " (", o_.gpu.source,
             "; no arithmetic: compute and PCIe take the profile's time ",
             o_.scale == 1.0 ? std::string("unscaled") : str("at ", o_.scale, "x its throughput"),
             "; losses and gradients are NaN)");
}

void EmulatedBackend::set_matmul_precision(MatmulPrecision p) {
  if (p == MatmulPrecision::kFp16)
    throw ConfigError(
        "runtime.precision fp16 on the emulated device: its loss scaling skips steps by the "
        "gradients' values, which the emulated device does not compute (they are NaN); use bf16 or "
        "fp32");
  precision_ = p;
}

// ---- arena ---------------------------------------------------------------------------------

void* EmulatedBackend::alloc(size_t bytes, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t offset = arena_.take(bytes, what, "of the emulated device (plan sizes)");
  // The zeroing is queued on the compute timeline and takes no time (the profile has no
  // device-memory bandwidth); caller-ordered copies still wait for the compute before it.
  zeroed_ = std::max(clock::now(), compute_free_);
  compute_free_ = zeroed_;
  return base_ + offset;
}

void EmulatedBackend::free(void* ptr) {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  FY_CHECK(ptr >= base_ && ptr < base_ + o_.capacity,
           "free of a pointer outside the emulated arena");
  arena_.give_back(static_cast<char*>(ptr) - base_);
}

MemoryStats EmulatedBackend::memory() const {
  std::lock_guard<std::mutex> lock(mu_);
  return arena_.stats();
}

// ---- timelines -----------------------------------------------------------------------------

void EmulatedBackend::compute(double flops) {
  const double s = o_.gpu.compute_seconds(flops, o_.gemm_size) / o_.scale;
  std::lock_guard<std::mutex> lock(mu_);
  flops_ += flops;
  compute_free_ = std::max(clock::now(), compute_free_) +
                  std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(s));
}

double EmulatedBackend::flops_queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return flops_;
}

void EmulatedBackend::finish_compute() {
  clock::time_point until;
  {
    std::lock_guard<std::mutex> lock(mu_);
    until = compute_free_;
  }
  wait_until(until);
}

void EmulatedBackend::set_caller_ordered(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  caller_ordered_ = on;
}

namespace {

// What a copy from the device leaves in `dst`: NaN, as the device holds no data. A small
// copy (the losses) becomes NaN whole; a large one (gradients, checkpoints) gets one NaN per
// 4 KiB, which poisons every sum over it as surely, without a full memset: that would be
// real memory traffic on this machine, slower than the emulated link at a GPU's rates.
void poison(void* dst, size_t bytes) {
  constexpr size_t kWhole = 64 << 10, kStride = 4096;
  if (bytes <= kWhole) {
    std::memset(dst, 0xFF, bytes);
    return;
  }
  char* p = static_cast<char*>(dst);
  for (size_t off = 0; off + 4 <= bytes; off += kStride) std::memset(p + off, 0xFF, 4);
}

}  // namespace

// Starts once the direction is free and the compute it must follow has ended; returns when
// the transfer's time has passed (`move`, the host side of it, runs within that time).
template <class Move>
void EmulatedBackend::copy(std::mutex& dir_mu, clock::time_point& dir_free, double seconds,
                           Move&& move) {
  std::lock_guard<std::mutex> dir_lock(dir_mu);
  clock::time_point after;
  {
    std::lock_guard<std::mutex> lock(mu_);
    after = caller_ordered_ ? zeroed_ : compute_free_;
  }
  const clock::time_point start = std::max({clock::now(), dir_free, after});
  dir_free = start + std::chrono::duration_cast<clock::duration>(
                         std::chrono::duration<double>(seconds / o_.scale));
  wait_until(start);
  move();
  wait_until(dir_free);
}

void EmulatedBackend::copy_to_device(void*, const void*, size_t bytes) {
  if (bytes) copy(h2d_mu_, h2d_free_, o_.gpu.h2d_seconds(static_cast<double>(bytes)), [] {});
}

void EmulatedBackend::copy_to_host(void* dst, const void*, size_t bytes) {
  if (bytes)
    copy(d2h_mu_, d2h_free_, o_.gpu.d2h_seconds(static_cast<double>(bytes)),
         [&] { poison(dst, bytes); });
}

// ---- the kernels that take time: forward_flops_per_token's terms -----------------------------

void EmulatedBackend::matmul_forward(void*, const void*, const void*, const void*, int N, int IC,
                                     int OC) {
  compute(2.0 * N * IC * OC);
}

void EmulatedBackend::matmul_backward(void* din, void*, void*, const void*, const void*,
                                      const void*, int N, int IC, int OC) {
  compute((din ? 4.0 : 2.0) * N * IC * OC);
}

void EmulatedBackend::attention_forward(void*, float*, float*, const void*, int B, int T, int C,
                                        int, const int32_t*) {
  compute(4.0 * B * T * T * C);  // q k^T and att v
}

void EmulatedBackend::attention_backward(void*, float*, const void*, const void*, const void*,
                                         const float*, int B, int T, int C, int, const int32_t*) {
  compute(8.0 * B * T * T * C);
}

}  // namespace fuyou::emulated
