// The CPU attention kernel against a plain double-precision causal attention, at lengths
// that split into several row blocks (with a ragged last one), forward and backward.
#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <vector>

#include "fuyou/backend.h"
#include "test_support.h"

using namespace fuyou;

namespace {

// out(B,T,C), and with dout the gradient dqkv(B,T,3C), of softmax(q k^T / sqrt(hd)) v, causal.
void reference_attention(const std::vector<float>& qkv, const std::vector<float>& dout, int B,
                         int T, int C, int H, std::vector<double>* out, std::vector<double>* dqkv) {
  const int hd = C / H, ld = 3 * C;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  out->assign(static_cast<size_t>(B) * T * C, 0.0);
  dqkv->assign(qkv.size(), 0.0);
  auto at = [&](int b, int t, int part, int h, int d) {
    return static_cast<size_t>(b * T + t) * ld + part * C + h * hd + d;
  };
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) {
        std::vector<double> s(t + 1), dp(t + 1);
        double mx = -1e300, sum = 0;
        for (int j = 0; j <= t; ++j) {
          double x = 0;
          for (int d = 0; d < hd; ++d)
            x += static_cast<double>(qkv[at(b, t, 0, h, d)]) * qkv[at(b, j, 1, h, d)];
          s[j] = x * scale;
          mx = std::max(mx, s[j]);
        }
        for (int j = 0; j <= t; ++j) sum += (s[j] = std::exp(s[j] - mx));
        for (int j = 0; j <= t; ++j) s[j] /= sum;
        const size_t o = static_cast<size_t>(b * T + t) * C + h * hd;
        for (int d = 0; d < hd; ++d)
          for (int j = 0; j <= t; ++j) (*out)[o + d] += s[j] * qkv[at(b, j, 2, h, d)];
        // Backward of row t: dP_j = dO . v_j; dS_j = P_j (dP_j - sum P dP); dq += dS k, dk_j += dS
        // q.
        double dot = 0;
        for (int j = 0; j <= t; ++j) {
          dp[j] = 0;
          for (int d = 0; d < hd; ++d) {
            dp[j] += static_cast<double>(dout[o + d]) * qkv[at(b, j, 2, h, d)];
            (*dqkv)[at(b, j, 2, h, d)] += s[j] * dout[o + d];
          }
          dot += s[j] * dp[j];
        }
        for (int j = 0; j <= t; ++j) {
          double ds = s[j] * (dp[j] - dot) * scale;
          for (int d = 0; d < hd; ++d) {
            (*dqkv)[at(b, t, 0, h, d)] += ds * qkv[at(b, j, 1, h, d)];
            (*dqkv)[at(b, j, 1, h, d)] += ds * qkv[at(b, t, 0, h, d)];
          }
        }
      }
}

}  // namespace

TEST_CASE("blocked causal attention equals plain causal attention", "[kernels][attention]") {
  const int B = 2, C = 48, H = 3;
  for (int T : {200, 256, 40}) {
    std::mt19937 rng(T);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> qkv(static_cast<size_t>(B) * T * 3 * C),
        dout(static_cast<size_t>(B) * T * C);
    for (float& x : qkv) x = nd(rng);
    for (float& x : dout) x = nd(rng);
    auto be = make_cpu_backend(2, 0);
    // Outputs start as garbage (7s): the kernels overwrite what they own. The scratch is the
    // backend's to use; the CPU's needs none.
    std::vector<float> out(dout.size(), 7.0f), lse(static_cast<size_t>(B) * H * T, 7.0f),
        scratch(2 * static_cast<size_t>(T) * T, 7.0f), dqkv(qkv.size(), 7.0f);
    be->attention_forward(out.data(), lse.data(), scratch.data(), qkv.data(), B, T, C, H, nullptr);
    be->attention_backward(dqkv.data(), scratch.data(), dout.data(), out.data(), qkv.data(),
                           lse.data(), B, T, C, H, nullptr);
    std::vector<double> ref_out, ref_dqkv;
    reference_attention(qkv, dout, B, T, C, H, &ref_out, &ref_dqkv);
    std::vector<float> ro(ref_out.begin(), ref_out.end()), rd(ref_dqkv.begin(), ref_dqkv.end());
    // fp32 sums of up to T terms: relative error grows like T u32 (u32 = 2^-24); 4 T u32.
    const double tol = 4.0 * T * std::ldexp(1.0, -24);
    INFO("T " << T);
    CHECK(test::rel_error(out.data(), ro.data(), ro.size()) <= tol);
    CHECK(test::rel_error(dqkv.data(), rd.data(), rd.size()) <= tol);
    // Each query row's log-sum-exp, over its keys 0..t only.
    const int hd = C / H;
    double worst = 0;
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < T; ++t) {
          std::vector<double> sc(t + 1);
          double mx = -1e300;
          for (int j = 0; j <= t; ++j) {
            double d = 0;
            for (int e = 0; e < hd; ++e)
              d += double(qkv[(static_cast<size_t>(b) * T + t) * 3 * C + h * hd + e]) *
                   qkv[(static_cast<size_t>(b) * T + j) * 3 * C + C + h * hd + e];
            sc[j] = d / std::sqrt(double(hd));
            mx = std::max(mx, sc[j]);
          }
          double s = 0;
          for (double x : sc) s += std::exp(x - mx);
          worst = std::max(
              worst, std::fabs(lse[(static_cast<size_t>(b) * H + h) * T + t] - (mx + std::log(s))));
        }
    CHECK(worst <= tol * 16);  // |lse| is O(1) here: an absolute bound of the same size
  }
}
