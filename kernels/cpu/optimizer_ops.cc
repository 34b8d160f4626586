// The optimizer on the CPU backend's "device" (Backend: the optimizer on the device): the
// host's reductions and AdamW element on arrays in the arena. On this backend the host
// optimizer is the faster choice (its SIMD paths, no arena); these exist so that the
// in-memory step's device placement, and its equality with the host placement, are tested
// on every machine.
#include <cstddef>

#include "fuyou/error.h"
#include "kernels/common/element_math.h"
#include "kernels/common/grad_math.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/stream_backend.h"

namespace fuyou {

void Backend::accumulate_fp32(float*, const void*, ElemType, size_t, bool) {
  throw Error(
      str("backend ", name(), " has no optimizer on the device (optimizer.placement: host)"));
}
double Backend::sum_squares(const void*, ElemType, const std::vector<std::pair<size_t, size_t>>&) {
  throw Error(
      str("backend ", name(), " has no optimizer on the device (optimizer.placement: host)"));
}

double Backend::sum_squares_spans(const std::vector<SquareSpan>& spans, ElemType type) {
  // Each span's sum alone is its group's sum (0 + the group's), added in order: the bits of
  // one sum_squares over the spans as groups.
  double s = 0;
  for (const SquareSpan& sp : spans) s += sum_squares(sp.data, type, {{0, sp.n}});
  return s;
}
void Backend::adamw(const DeviceAdamW&) {
  throw Error(
      str("backend ", name(), " has no optimizer on the device (optimizer.placement: host)"));
}

namespace cpu {

void CpuBackend::accumulate_fp32(float* sum, const void* g, ElemType type, size_t n, bool first) {
  math::accumulate_fp32(sum, g, type, n, first);
}

double CpuBackend::sum_squares(const void* x, ElemType type,
                               const std::vector<std::pair<size_t, size_t>>& groups) {
  const size_t es = elem_type_size(type);
  double s = 0;
  for (const auto& [offset, n] : groups)
    s += math::group_sum_squares(static_cast<const char*>(x) + es * offset, type, n);
  return s;
}

void CpuBackend::adamw(const DeviceAdamW& a) {
  math::AdamWConsts on{a.grad_scale,   a.decay_on, a.one_minus_b1, a.b2,
                       a.one_minus_b2, a.bc2_sqrt, a.eps,          a.neg_step};
  math::AdamWConsts off = on;
  off.decay = a.decay_off;
#pragma omp parallel for schedule(dynamic, 1)
  for (ptrdiff_t p = 0; p < static_cast<ptrdiff_t>(a.count); ++p) {
    const AdamWPiece& piece = a.pieces[p];
    const math::AdamWConsts& k = piece.decay ? on : off;
    for (size_t i = piece.begin; i < piece.begin + piece.n; ++i) {
      float w = a.master[i], m = a.m[i], v = a.v[i];
      math::adamw_element(w, m, v, math::load_elem(a.grad, a.grad_type, i), k);
      a.master[i] = w;
      a.m[i] = m;
      a.v[i] = v;
      if (a.lowp) math::store_elem(a.lowp, a.lowp_type, i, w);
    }
  }
}

// cpu-streams: queued on the compute queue like every kernel; the sum of squares returns a
// value, so it waits for the queue first (the GPU's sum is read back the same way).
void StreamBackend::accumulate_fp32(float* sum, const void* g, ElemType type, size_t n,
                                    bool first) {
  kernel([=, this] { inner_->accumulate_fp32(sum, g, type, n, first); });
}

double StreamBackend::sum_squares(const void* x, ElemType type,
                                  const std::vector<std::pair<size_t, size_t>>& groups) {
  compute_.wait_all();
  return inner_->sum_squares(x, type, groups);
}

void StreamBackend::adamw(const DeviceAdamW& a) {
  kernel([=, this] { inner_->adamw(a); });
}

}  // namespace cpu
}  // namespace fuyou
