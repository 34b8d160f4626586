#include <cmath>

#include "fuyou/optim.h"

namespace fuyou {

void adamw_update(float* param, float* m, float* v, const float* grad, size_t n,
                  const AdamWStep& s) {
  const float decay = 1.0f - s.lr * s.weight_decay;
  const float bc1 = 1.0f - std::pow(s.beta1, static_cast<float>(s.t));
  const float bc2 = 1.0f - std::pow(s.beta2, static_cast<float>(s.t));
  const float step_size = s.lr / bc1;
  const float bc2_sqrt = std::sqrt(bc2);
  const float b1 = s.beta1, b2 = s.beta2, eps = s.eps;
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; ++i) {
    float g = grad[i];
    float p = param[i] * decay;
    float mi = m[i] + (1.0f - b1) * (g - m[i]);
    float vi = b2 * v[i] + (1.0f - b2) * g * g;
    float denom = std::sqrt(vi) / bc2_sqrt + eps;
    param[i] = p - step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
  }
}

}  // namespace fuyou
