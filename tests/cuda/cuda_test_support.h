// Helpers of the CUDA tests: moving host vectors through a backend and the error bounds the
// comparisons use.
#pragma once

#include <catch2/catch.hpp>
#include <cfloat>
#include <cmath>
#include <string>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/rng.h"

namespace fuyou::test {

// A device copy of a host vector on `be`, freed with it.
template <typename T>
class DeviceVec {
 public:
  DeviceVec(Backend& be, const std::vector<T>& host) : be_(be), n_(host.size()) {
    p_ = static_cast<T*>(be_.alloc(sizeof(T) * n_, "test tensor"));
    be_.copy_to_device(p_, host.data(), sizeof(T) * n_);
  }
  DeviceVec(Backend& be, size_t n) : DeviceVec(be, std::vector<T>(n, T(0))) {}
  ~DeviceVec() { be_.free(p_); }
  DeviceVec(const DeviceVec&) = delete;
  DeviceVec& operator=(const DeviceVec&) = delete;
  T* get() const { return p_; }
  std::vector<T> host() const {
    std::vector<T> h(n_);
    be_.copy_to_host(h.data(), p_, sizeof(T) * n_);
    return h;
  }

 private:
  Backend& be_;
  size_t n_;
  T* p_;
};

inline std::vector<float> random_normal(size_t n, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = scale * rng.normal();
  return v;
}

inline std::vector<int32_t> random_tokens(size_t n, int V, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng.below(V));
  return t;
}

// (|A| |B|^T)_ij in double for row-major A(M,K), B(N,K): what a dot product's rounding
// error is proportional to.
inline std::vector<double> abs_products(const std::vector<float>& A, const std::vector<float>& B,
                                        int M, int N, int K) {
  std::vector<double> out(size_t(M) * N, 0.0);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      double s = 0;
      for (int k = 0; k < K; ++k)
        s += std::fabs(double(A[size_t(i) * K + k])) * std::fabs(double(B[size_t(j) * K + k]));
      out[size_t(i) * N + j] = s;
    }
  return out;
}

inline std::vector<float> transpose(const std::vector<float>& X, int R, int C) {
  std::vector<float> t(X.size());
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) t[size_t(c) * R + r] = X[size_t(r) * C + c];
  return t;
}

inline double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::fabs(double(x)));
  return m;
}

// Every element within `bound` (one bound for the whole tensor) of the reference.
inline void check_within(const std::string& what, const std::vector<float>& got,
                         const std::vector<float>& ref, double bound) {
  REQUIRE(got.size() == ref.size());
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double d = std::fabs(double(got[i]) - ref[i]);
    if (!(d <= worst)) {  // also catches NaN
      worst = d;
      at = i;
    }
  }
  INFO(what << ": worst |cuda - cpu| " << worst << " at " << at << " (cuda " << got[at] << ", cpu "
            << ref[at] << "), bound " << bound);
  CHECK(worst <= bound);
}

// Per element: |got_i - ref_i| <= bound_i.
inline void check_within_each(const std::string& what, const std::vector<float>& got,
                              const std::vector<float>& ref, const std::vector<double>& bound) {
  REQUIRE(got.size() == ref.size());
  REQUIRE(bound.size() == ref.size());
  double worst_ratio = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double r = std::fabs(double(got[i]) - ref[i]) / bound[i];
    if (!(r <= worst_ratio)) {
      worst_ratio = r;
      at = i;
    }
  }
  INFO(what << ": worst |cuda - cpu| / bound " << worst_ratio << " at " << at << " (cuda "
            << got[at] << ", cpu " << ref[at] << ", bound " << bound[at] << ")");
  CHECK(worst_ratio <= 1.0);
}

}  // namespace fuyou::test
