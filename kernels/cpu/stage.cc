#include "kernels/cpu/stage.h"

#include <algorithm>
#include <exception>
#include <vector>

#include "fuyou/error.h"
#include "kernels/common/element_math.h"
#include "kernels/cpu/clones.h"

namespace fuyou::cpu {
namespace {

// Per thread: the scratch of the Stage in use, views carved one after another from the last
// block; a call that outgrows it adds a block, and at its end the blocks become one of the
// call's total size, so once warm one block serves every call (the largest call's views).
struct Scratch {
  std::vector<std::vector<float>> blocks;
  size_t used = 0;   // floats carved from blocks.back() by the Stage in use
  size_t total = 0;  // floats carved by the Stage in use
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

FY_CLONES void widen_range_fp16(float* dst, const uint16_t* src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = math::fp16_to_float(src[i]);
}

FY_CLONES void round_range_fp16(uint16_t* dst, const float* src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = math::float_to_fp16(src[i]);
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

void round_to(ElemType t, void* dst, const float* src, size_t n) {
  uint16_t* h = static_cast<uint16_t*>(dst);
  switch (t) {
    case ElemType::kF32:
      std::copy(src, src + n, static_cast<float*>(dst));
      return;
    case ElemType::kBF16:
      return cpu::chunked(n, [&](size_t b, size_t k) { cpu::round_range(h + b, src + b, k); });
    case ElemType::kF16:
      return cpu::chunked(n, [&](size_t b, size_t k) { cpu::round_range_fp16(h + b, src + b, k); });
  }
}

void widen_from(ElemType t, float* dst, const void* src, size_t n) {
  const uint16_t* h = static_cast<const uint16_t*>(src);
  switch (t) {
    case ElemType::kF32:
      std::copy(static_cast<const float*>(src), static_cast<const float*>(src) + n, dst);
      return;
    case ElemType::kBF16:
      return cpu::chunked(n, [&](size_t b, size_t k) { cpu::widen_range(dst + b, h + b, k); });
    case ElemType::kF16:
      return cpu::chunked(n, [&](size_t b, size_t k) { cpu::widen_range_fp16(dst + b, h + b, k); });
  }
}

}  // namespace fuyou

namespace fuyou::cpu {

Stage::Stage(ElemType t) : t_(t) {
  if (t_ == ElemType::kF32) return;
  FY_CHECK(!scratch_of_thread.busy, "CPU backend: a kernel's stage opened inside another's");
  scratch_of_thread.busy = true;
}

Stage::~Stage() {
  if (t_ == ElemType::kF32) return;
  // A kernel that threw left its outputs unfinished: the tensors keep what they held.
  if (std::uncaught_exceptions() == 0)
    for (int i = 0; i < nback_; ++i) round_to(t_, back_[i].dst, back_[i].src, back_[i].n);
  Scratch& s = scratch_of_thread;
  if (s.blocks.size() > 1) {
    s.blocks.clear();
    s.blocks.emplace_back(s.total);
  }
  s.used = s.total = 0;
  s.busy = false;
}

size_t stage_scratch_bytes() {
  size_t n = 0;
  for (const auto& b : scratch_of_thread.blocks) n += b.capacity() * sizeof(float);
  return n;
}

void release_stage_scratch() {
  FY_CHECK(!scratch_of_thread.busy, "release_stage_scratch inside a kernel");
  scratch_of_thread.blocks.clear();
  scratch_of_thread.blocks.shrink_to_fit();
}

float* Stage::scratch(size_t n) {
  FY_CHECK(used_ < kMaxViews, "CPU backend: more than ", kMaxViews, " tensors in one kernel");
  ++used_;
  Scratch& s = scratch_of_thread;
  n = (n + 15) / 16 * 16;  // 64-byte aligned views
  if (s.blocks.empty() || s.blocks.back().size() - s.used < n) {
    s.blocks.emplace_back(n);
    s.used = 0;
  }
  float* p = s.blocks.back().data() + s.used;
  s.used += n;
  s.total += n;
  return p;
}

const float* Stage::in(const void* p, size_t n) {
  if (!p || t_ == ElemType::kF32) return static_cast<const float*>(p);
  float* s = scratch(n);
  widen_from(t_, s, p, n);
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
  widen_from(t_, s, p, n);
  back_[nback_++] = {static_cast<uint16_t*>(p), s, n};
  return s;
}

}  // namespace fuyou::cpu
