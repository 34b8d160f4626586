// The CPU backend's decoding kernels (Backend::rope_forward_at, attention_decode): a few new
// rows of one sequence against its key/value cache. Typed on the storage type like the
// embedding's kernels: the cache is (capacity, Hkv D) and a step reads only its first rows, so
// an fp32 view of the whole cache (Stage) would move far more than the step uses.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "fuyou/error.h"
#include "kernels/common/element_math.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/stage.h"

namespace fuyou::cpu {
namespace {

struct F32 {
  using T = float;
  static float load(float x) { return x; }
  static float store(float f) { return f; }
};
struct Bf16 {
  using T = uint16_t;
  static float load(uint16_t h) { return math::bf16_to_float(h); }
  static uint16_t store(float f) { return math::float_to_bf16(f); }
};
struct Fp16 {
  using T = uint16_t;
  static float load(uint16_t h) { return math::fp16_to_float(h); }
  static uint16_t store(float f) { return math::float_to_fp16(f); }
};

// Stores the new rows' k and v, then attends. Each (row, query head) is independent once
// the cache holds every new row, so they run in parallel; a thread's scores live in its own
// buffer of pos0 + N values.
template <class E>
void attend(typename E::T* out, typename E::T* kc, typename E::T* vc, const typename E::T* qkvc,
            int N, int pos0, int Hq, int Hkv, int D) {
  using T = typename E::T;
  const size_t C = static_cast<size_t>(Hq) * D, KV = static_cast<size_t>(Hkv) * D, row = C + 2 * KV;
  for (int i = 0; i < N; ++i) {
    const T* src = qkvc + i * row;
    std::copy(src + C, src + C + KV, kc + (pos0 + static_cast<size_t>(i)) * KV);
    std::copy(src + C + KV, src + C + 2 * KV, vc + (pos0 + static_cast<size_t>(i)) * KV);
  }
  const int G = Hq / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
#pragma omp parallel
  {
    std::vector<float> p(static_cast<size_t>(pos0) + N), acc(D), q(D);
#pragma omp for schedule(static)
    for (int ih = 0; ih < N * Hq; ++ih) {
      const int i = ih / Hq, h = ih % Hq, g = h / G, last = pos0 + i;
      const T* qr = qkvc + i * row + static_cast<size_t>(h) * D;
      for (int d = 0; d < D; ++d) q[d] = E::load(qr[d]);
      float m = -INFINITY;
      for (int j = 0; j <= last; ++j) {
        const T* k = kc + static_cast<size_t>(j) * KV + static_cast<size_t>(g) * D;
        float s = 0.0f;
        for (int d = 0; d < D; ++d) s += q[d] * E::load(k[d]);
        p[j] = s * scale;
        m = std::max(m, p[j]);
      }
      float sum = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int j = 0; j <= last; ++j) {
        const float e = std::exp(p[j] - m);
        sum += e;
        const T* v = vc + static_cast<size_t>(j) * KV + static_cast<size_t>(g) * D;
        for (int d = 0; d < D; ++d) acc[d] += e * E::load(v[d]);
      }
      T* o = out + static_cast<size_t>(i) * C + static_cast<size_t>(h) * D;
      for (int d = 0; d < D; ++d) o[d] = E::store(acc[d] / sum);
    }
  }
}

}  // namespace

void CpuBackend::rope_forward_at(void* qkvc, int N, int pos0, int Hq, int Hkv, int D,
                                 const RopeTable& rope) {
  FY_CHECK(pos0 >= 0 && N >= 0, "rope_forward_at: rows ", N, " at position ", pos0);
  Stage s(storage_);
  k_.rope_forward_at(s.acc(qkvc, static_cast<size_t>(N) * (Hq + 2 * Hkv) * D), N, pos0, Hq, Hkv, D,
                     rope);
}

void CpuBackend::attention_decode(void* out, void* k_cache, void* v_cache, const void* qkvc, int N,
                                  int pos0, int Hq, int Hkv, int D) {
  FY_CHECK(pos0 >= 0 && N >= 1 && Hkv >= 1 && Hq % Hkv == 0, "attention_decode: ", N, " rows at ",
           pos0, ", ", Hq, " query heads, ", Hkv, " key/value heads");
  switch (storage_) {
    case ElemType::kF32:
      return attend<F32>(static_cast<float*>(out), static_cast<float*>(k_cache),
                         static_cast<float*>(v_cache), static_cast<const float*>(qkvc), N, pos0, Hq,
                         Hkv, D);
    case ElemType::kBF16:
      return attend<Bf16>(static_cast<uint16_t*>(out), static_cast<uint16_t*>(k_cache),
                          static_cast<uint16_t*>(v_cache), static_cast<const uint16_t*>(qkvc), N,
                          pos0, Hq, Hkv, D);
    case ElemType::kF16:
      return attend<Fp16>(static_cast<uint16_t*>(out), static_cast<uint16_t*>(k_cache),
                          static_cast<uint16_t*>(v_cache), static_cast<const uint16_t*>(qkvc), N,
                          pos0, Hq, Hkv, D);
  }
}

}  // namespace fuyou::cpu
