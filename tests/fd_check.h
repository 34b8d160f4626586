// Finite-difference gradient checks shared by the kernel and model-family tests.
//
// Tolerance: a central difference in fp32 has truncation error ~h^2 |f'''| and rounding
// error ~eps |L| / h, smallest (~eps^(2/3) = 2.4e-5 of the scale) near h = eps^(1/3). With
// h = 1e-2 on O(1) data and losses summing up to a few hundred terms we allow 20 times that,
// relative to the largest gradient element; a missing or wrong term is off by far more.
#pragma once

#include <algorithm>
#include <catch2/catch.hpp>
#include <cfloat>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "fuyou/rng.h"

namespace fuyou::test {

inline const double kFdTolerance = 20 * std::pow(double(FLT_EPSILON), 2.0 / 3.0);
constexpr float kStep = 1e-2f;

inline std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = scale * rng.normal();
  return v;
}

inline double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * b[i];
  return s;
}

// Checks `analytic` (d loss / d x) against central differences of `loss` at up to 48 sampled
// elements of x.
inline void check_grad(const std::string& what, std::vector<float>& x,
                       const std::vector<float>& analytic, const std::function<double()>& loss) {
  REQUIRE(x.size() == analytic.size());
  double scale = 0;
  for (float g : analytic) scale = std::max(scale, std::fabs(double(g)));
  REQUIRE(scale > 0);
  Rng rng(77);
  size_t samples = std::min<size_t>(48, x.size());
  double worst = 0;
  for (size_t s = 0; s < samples; ++s) {
    size_t i = x.size() <= 48 ? s : rng.below(x.size());
    float orig = x[i];
    x[i] = orig + kStep;
    double lp = loss();
    x[i] = orig - kStep;
    double lm = loss();
    x[i] = orig;
    double fd = (lp - lm) / (2.0 * kStep);
    worst = std::max(worst, std::fabs(fd - analytic[i]) / scale);
  }
  INFO(what << ": worst finite-difference error " << worst << " of gradient scale " << scale);
  CHECK(worst < kFdTolerance);
}

}  // namespace fuyou::test
