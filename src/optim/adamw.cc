// AdamW: dispatch over instruction-set paths, and the scalar reference path.
//
// Work is split across OpenMP threads in blocks of kBlock elements (a multiple of every
// vector width), claimed kClaimItems at a time, so every path sees the same element-to-lane
// assignment and the scalar tail of each block is handled by the same scalar code.
#include <omp.h>

#include <cmath>
#include <vector>

#include "fuyou/error.h"
#include "fuyou/optim.h"
#include "kernels/common/element_math.h"
#include "kernels/common/grad_math.h"
#include "src/optim/adamw_kernels.h"

namespace fuyou {

const char* elem_type_name(ElemType t) {
  switch (t) {
    case ElemType::kF32:
      return "f32";
    case ElemType::kBF16:
      return "bf16";
    case ElemType::kF16:
      return "f16";
  }
  return "?";
}

size_t elem_type_size(ElemType t) { return t == ElemType::kF32 ? 4 : 2; }

const char* simd_path_name(SimdPath p) {
  switch (p) {
    case SimdPath::kAuto:
      return "auto";
    case SimdPath::kScalar:
      return "scalar";
    case SimdPath::kAvx2:
      return "avx2";
    case SimdPath::kAvx512:
      return "avx512";
  }
  return "?";
}

SimdPath simd_path_from_name(const std::string& name, const std::string& what) {
  for (SimdPath p : {SimdPath::kAuto, SimdPath::kScalar, SimdPath::kAvx2, SimdPath::kAvx512})
    if (name == simd_path_name(p)) return p;
  throw ConfigError(str(what, ": expected auto, scalar, avx2 or avx512, got '", name, "'"));
}

bool simd_path_supported(SimdPath p) {
  // Paths in order of width: scalar, AVX2, AVX-512; a wider one than the CPU's would fault.
  return p == SimdPath::kAuto || p == SimdPath::kScalar ||
         static_cast<int>(p) <= static_cast<int>(best_simd_path());
}

SimdPath best_simd_path() {
  static const SimdPath best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
      return SimdPath::kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
      return SimdPath::kAvx2;
    return SimdPath::kScalar;
  }();
  return best;
}

namespace optim_detail {

float load_grad(const void* g, ElemType t, size_t i) { return math::load_elem(g, t, i); }

void store_lowp(void* out, ElemType t, size_t i, float x) { math::store_elem(out, t, i, x); }

void adamw_scalar(const AdamWArgs& a, const math::AdamWConsts& k, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    float p = a.master[i], m = a.m[i], v = a.v[i];
    math::adamw_element(p, m, v, load_grad(a.grad, a.grad_type, i), k);
    a.master[i] = p;
    a.m[i] = m;
    a.v[i] = v;
    if (a.lowp) store_lowp(a.lowp, a.lowp_type, i, p);
  }
}

void grad_stats_scalar(const void* g, ElemType t, size_t begin, size_t end, GradStats* out) {
  for (size_t i = begin; i < end; ++i) {
    float x = load_grad(g, t, i);
    if (!std::isfinite(x)) {
      ++out->nonfinite;
      continue;
    }
    out->sum_squares += static_cast<double>(x) * x;
  }
}

// The constants of step s that every piece shares (grad_scale and decay are per piece).
math::AdamWConsts step_consts(const AdamWStep& s) {
  math::AdamWConsts k;
  k.grad_scale = 1.0f;
  k.decay = 1.0f;
  k.one_minus_b1 = 1.0f - s.beta1;
  k.b2 = s.beta2;
  k.one_minus_b2 = 1.0f - s.beta2;
  // Bias corrections in double, then rounded once: every path shares these constants.
  k.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(double(s.beta2), double(s.t))));
  k.eps = s.eps;
  k.neg_step = static_cast<float>(-double(s.lr) / (1.0 - std::pow(double(s.beta1), double(s.t))));
  return k;
}

}  // namespace optim_detail

using namespace optim_detail;

void set_adamw_constants(DeviceAdamW* a, const AdamWStep& s, float weight_decay, float grad_scale) {
  FY_CHECK(s.t >= 1, "AdamW step count starts at 1, got ", s.t);
  const math::AdamWConsts k = step_consts(s);
  a->grad_scale = grad_scale;
  a->decay_on = 1.0f - s.lr * weight_decay;  // as adamw_update's per-piece decay
  a->decay_off = 1.0f - s.lr * 0.0f;
  a->one_minus_b1 = k.one_minus_b1;
  a->b2 = k.b2;
  a->one_minus_b2 = k.one_minus_b2;
  a->bc2_sqrt = k.bc2_sqrt;
  a->eps = k.eps;
  a->neg_step = k.neg_step;
}

void adamw_update(const AdamWArgs& a, const AdamWStep& s, SimdPath path) {
  adamw_update(&a, &s.weight_decay, 1, s, path);
}

void adamw_update(const AdamWArgs* pieces, const float* decay, size_t count, const AdamWStep& s,
                  SimdPath path) {
  FY_CHECK(s.t >= 1, "AdamW step count starts at 1, got ", s.t);
  if (path == SimdPath::kAuto) path = best_simd_path();
  FY_CHECK(simd_path_supported(path), "SIMD path ", simd_path_name(path),
           " is not supported by this CPU");
  const math::AdamWConsts base = step_consts(s);
  std::vector<math::AdamWConsts> k(count, base);
  // Work items of at most kBlock elements, each within one piece.
  struct Item {
    size_t piece, begin, end;
  };
  std::vector<Item> items;
  for (size_t i = 0; i < count; ++i) {
    k[i].grad_scale = pieces[i].grad_scale;
    k[i].decay = 1.0f - s.lr * decay[i];
    for (size_t b = 0; b < pieces[i].n; b += kBlock)
      items.push_back({i, b, std::min(pieces[i].n, b + kBlock)});
  }
#pragma omp parallel for schedule(dynamic, kClaimItems)
  for (size_t w = 0; w < items.size(); ++w) {
    const Item& it = items[w];
    const AdamWArgs& a = pieces[it.piece];
    switch (path) {
      case SimdPath::kAvx512:
        adamw_avx512(a, k[it.piece], it.begin, it.end);
        break;
      case SimdPath::kAvx2:
        adamw_avx2(a, k[it.piece], it.begin, it.end);
        break;
      default:
        adamw_scalar(a, k[it.piece], it.begin, it.end);
        break;
    }
  }
}

void adamw_update(float* param, float* m, float* v, const float* grad, size_t n,
                  const AdamWStep& s) {
  AdamWArgs a;
  a.master = param;
  a.m = m;
  a.v = v;
  a.grad = grad;
  a.grad_type = ElemType::kF32;
  a.n = n;
  adamw_update(a, s);
}

GradStats grad_stats(const void* grad, ElemType type, size_t n, SimdPath path) {
  if (path == SimdPath::kAuto) path = best_simd_path();
  // Each thread sums one contiguous range in order, and the ranges are combined in thread
  // order: the result is deterministic for a given thread count.
  const int threads = omp_get_max_threads();
  std::vector<GradStats> parts(threads);
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    size_t begin = n * t / nt, end = n * (t + 1) / nt;
    if (path == SimdPath::kAvx512)
      grad_stats_avx512(grad, type, begin, end, &parts[t]);
    else
      grad_stats_scalar(grad, type, begin, end, &parts[t]);
  }
  GradStats total;
  for (const auto& p : parts) {
    total.sum_squares += p.sum_squares;
    total.nonfinite += p.nonfinite;
  }
  return total;
}

size_t adamw_bytes_per_param(ElemType grad_type, bool with_lowp, ElemType lowp_type) {
  // fp32 state read and written back, the gradient read, the working weight written.
  return 2 * optim_state_bytes(OptimFormat{}, 1) + elem_type_size(grad_type) +
         (with_lowp ? elem_type_size(lowp_type) : 0);
}

}  // namespace fuyou
