// Helpers shared by the tests: relative comparison of arrays and the fixture directory.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace fuyou::test {

inline std::string source_path(const std::string& rel) { return std::string(FUYOU_SOURCE_DIR) + "/" + rel; }

// max |a - b| / max |b|: the error relative to the tensor's scale, so tiny elements near
// zero do not dominate the way an element-wise relative error would.
inline double rel_error(const float* a, const float* b, size_t n) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

}  // namespace fuyou::test
