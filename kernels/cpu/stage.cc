#include "kernels/cpu/stage.h"

#include <algorithm>
#include <vector>

#include "fuyou/error.h"
#include "kernels/common/element_math.h"
#include "kernels/cpu/clones.h"

namespace fuyou::cpu {
namespace {

// Per thread: the scratch buffers of the Stage in use (one per view), and whether one is.
struct Scratch {
  std::vector<float> bufs[8];
  bool busy = false;
};
thread_local Scratch scratch_of_thread;

// Tensors below this many elements convert on the calling thread (a parallel region costs
// more than the loop).
constexpr size_t kParallelFrom = 1 << 15;

FY_CLONES void widen_range(float* dst, const uint16_t* src, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) dst[i] = math::bf16_to_float(src[i]);
}

FY_CLONES void round_range(uint16_t* dst, const float* src, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) dst[i] = math::float_to_bf16(src[i]);
}

// Runs fn(begin, count) over [0, n) in chunks of 16 Ki elements, in parallel when n is large.
template <typename Fn>
void chunked(size_t n, Fn fn) {
  constexpr size_t kChunk = 1 << 14;
  const long chunks = static_cast<long>((n + kChunk - 1) / kChunk);
#pragma omp parallel for schedule(static) if (n >= kParallelFrom)
  for (long c = 0; c < chunks; ++c) {
    const size_t b = static_cast<size_t>(c) * kChunk;
    fn(b, std::min(kChunk, n - b));
  }
}

}  // namespace
}  // namespace fuyou::cpu

namespace fuyou {

void widen_from_bf16(float* dst, const uint16_t* src, size_t n) {
  cpu::chunked(n, [&](size_t b, size_t k) { cpu::widen_range(dst + b, src + b, k); });
}

void round_to_bf16(uint16_t* dst, const float* src, size_t n) {
  cpu::chunked(n, [&](size_t b, size_t k) { cpu::round_range(dst + b, src + b, k); });
}

}  // namespace fuyou

namespace fuyou::cpu {

Stage::Stage(ElemType t) : t_(t) {
  FY_CHECK(t == ElemType::kF32 || t == ElemType::kBF16, "CPU backend: no kernels for ",
           elem_type_name(t), " tensors");
  if (t_ == ElemType::kF32) return;
  FY_CHECK(!scratch_of_thread.busy, "CPU backend: a kernel's stage opened inside another's");
  scratch_of_thread.busy = true;
}

Stage::~Stage() {
  if (t_ == ElemType::kF32) return;
  for (int i = 0; i < nback_; ++i) round_to_bf16(back_[i].dst, back_[i].src, back_[i].n);
  scratch_of_thread.busy = false;
}

float* Stage::scratch(size_t n) {
  FY_CHECK(used_ < kMaxViews, "CPU backend: more than ", kMaxViews, " tensors in one kernel");
  std::vector<float>& b = scratch_of_thread.bufs[used_++];
  if (b.size() < n) b.resize(n);
  return b.data();
}

const float* Stage::in(const void* p, size_t n) {
  if (!p || t_ == ElemType::kF32) return static_cast<const float*>(p);
  float* s = scratch(n);
  widen_from_bf16(s, static_cast<const uint16_t*>(p), n);
  return s;
}

float* Stage::out(void* p, size_t n) {
  if (!p || t_ == ElemType::kF32) return static_cast<float*>(p);
  float* s = scratch(n);
  back_[nback_++] = {static_cast<uint16_t*>(p), s, n};
  return s;
}

float* Stage::acc(void* p, size_t n) {
  if (!p || t_ == ElemType::kF32) return static_cast<float*>(p);
  float* s = scratch(n);
  widen_from_bf16(s, static_cast<const uint16_t*>(p), n);
  back_[nback_++] = {static_cast<uint16_t*>(p), s, n};
  return s;
}

}  // namespace fuyou::cpu
