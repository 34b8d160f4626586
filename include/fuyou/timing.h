// Wall-clock helpers shared by the benchmarks, the run loop and the tests: seconds since a
// steady-clock time point, and the median of timed samples.
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace fuyou {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The median of samples (the mean of the middle two for an even count); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace fuyou
