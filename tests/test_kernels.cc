// Every CPU kernel's backward against central finite differences of its forward, and the
// shared element math against direct formulas.
// The finite-difference tolerance and its derivation are in fd_check.h.
#include <catch2/catch.hpp>
#include <cfloat>
#include <cmath>
#include <functional>

#include "fuyou/backend.h"
#include "fuyou/rng.h"
#include "kernels/common/element_math.h"
#include "fd_check.h"
#include "test_support.h"

using namespace fuyou;
using namespace fuyou::test;

TEST_CASE("layernorm backward matches finite differences", "[kernels]") {
  auto be = make_cpu_backend(2, 0);
  const int N = 5, C = 24;
  auto x = randn(N * C, 1), w = randn(C, 2), b = randn(C, 3), R = randn(N * C, 4);
  std::vector<float> out(N * C), mean(N), rstd(N);
  auto loss = [&] {
    be->layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    return dot(out, R);
  };
  loss();
  std::vector<float> dx(N * C, 0.0f), dw(C, 0.0f), db(C, 0.0f);
  be->layernorm_backward(dx.data(), dw.data(), db.data(), R.data(), x.data(), w.data(), mean.data(),
                         rstd.data(), N, C);
  check_grad("layernorm dx", x, dx, loss);
  check_grad("layernorm dw", w, dw, loss);
  check_grad("layernorm db", b, db, loss);
}

TEST_CASE("matmul backward matches finite differences", "[kernels]") {
  auto be = make_cpu_backend(2, 0);
  const int N = 7, IC = 12, OC = 9;
  auto x = randn(N * IC, 5), w = randn(OC * IC, 6), bias = randn(OC, 7), R = randn(N * OC, 8);
  std::vector<float> out(N * OC);
  auto loss = [&] {
    be->matmul_forward(out.data(), x.data(), w.data(), bias.data(), N, IC, OC);
    return dot(out, R);
  };
  loss();
  std::vector<float> dx(N * IC), dw(OC * IC, 0.0f), db(OC, 0.0f);
  be->matmul_backward(dx.data(), dw.data(), db.data(), R.data(), x.data(), w.data(), N, IC, OC);
  check_grad("matmul dx", x, dx, loss);
  check_grad("matmul dw", w, dw, loss);
  check_grad("matmul dbias", bias, db, loss);
}

TEST_CASE("causal attention backward matches finite differences", "[kernels]") {
  auto be = make_cpu_backend(2, 0);
  const int B = 2, T = 6, C = 8, H = 2;
  auto qkv = randn(B * T * 3 * C, 9), R = randn(B * T * C, 10);
  std::vector<float> out(B * T * C), lse(B * H * T), scratch(2 * T * T);
  auto loss = [&] {
    be->attention_forward(out.data(), lse.data(), scratch.data(), qkv.data(), B, T, C, H);
    return dot(out, R);
  };
  loss();
  // Causality: row t's log-sum-exp covers the scores of keys 0..t only.
  const int hd = C / H;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) {
        double s = 0;
        for (int j = 0; j <= t; ++j) {
          double dotqk = 0;
          for (int d = 0; d < hd; ++d)
            dotqk += double(qkv[(b * T + t) * 3 * C + h * hd + d]) * qkv[(b * T + j) * 3 * C + C + h * hd + d];
          s += std::exp(dotqk / std::sqrt(double(hd)));
        }
        CHECK(lse[(b * H + h) * T + t] == Approx(std::log(s)).epsilon(1e-5));
      }
  std::vector<float> dqkv(qkv.size());
  be->attention_backward(dqkv.data(), scratch.data(), R.data(), out.data(), qkv.data(), lse.data(), B, T, C, H);
  check_grad("attention dqkv", qkv, dqkv, loss);
}

TEST_CASE("gelu backward matches finite differences", "[kernels]") {
  auto be = make_cpu_backend(2, 0);
  auto x = randn(40, 11, 2.0f), R = randn(40, 12);
  std::vector<float> out(40);
  auto loss = [&] {
    be->gelu_forward(out.data(), x.data(), x.size());
    return dot(out, R);
  };
  loss();
  std::vector<float> dx(40);
  be->gelu_backward(dx.data(), x.data(), R.data(), x.size());
  check_grad("gelu dx", x, dx, loss);
}

TEST_CASE("cross-entropy backward matches finite differences", "[kernels]") {
  auto be = make_cpu_backend(2, 0);
  const int N = 4, V = 11;
  auto logits = randn(N * V, 13, 2.0f);
  std::vector<int32_t> targets = {3, 0, 10, 7};
  std::vector<float> losses(N), lse(N);
  auto loss = [&] {
    be->crossentropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V);
    double s = 0;
    for (float l : losses) s += l;
    return s;
  };
  double l0 = loss();
  // Forward against the direct formula in double.
  double direct = 0;
  for (int n = 0; n < N; ++n) {
    double z = 0;
    for (int v = 0; v < V; ++v) z += std::exp(double(logits[n * V + v]));
    direct += std::log(z) - logits[n * V + targets[n]];
  }
  CHECK(l0 == Approx(direct).epsilon(1e-6));
  std::vector<float> d = logits;
  be->crossentropy_backward(d.data(), lse.data(), targets.data(), 1.0f, N, V);
  check_grad("cross-entropy dlogits", logits, d, loss);
}

TEST_CASE("embedding backward matches finite differences", "[kernels]") {
  auto be = make_cpu_backend(2, 0);
  const int B = 2, T = 3, C = 5, V = 4;
  auto wte = randn(V * C, 14), wpe = randn(T * C, 15), R = randn(B * T * C, 16);
  std::vector<int32_t> tokens = {1, 3, 1, 0, 1, 2};  // token 1 repeats: gradients must add up
  std::vector<float> out(B * T * C);
  auto loss = [&] {
    be->embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    return dot(out, R);
  };
  loss();
  std::vector<float> dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
  be->embedding_backward(dwte.data(), dwpe.data(), R.data(), tokens.data(), B, T, C);
  check_grad("embedding dwte", wte, dwte, loss);
  check_grad("embedding dwpe", wpe, dwpe, loss);
}

TEST_CASE("shared element math", "[kernels]") {
  // gelu against its definition in double; gelu_grad against a double central difference.
  for (double x = -6; x <= 6; x += 0.37) {
    double ref = 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
    CHECK(math::gelu(float(x)) == Approx(ref).margin(1e-6).epsilon(1e-5));
    double h = 1e-5;
    auto g = [](double v) { return 0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))); };
    double fd = (g(x + h) - g(x - h)) / (2 * h);
    CHECK(math::gelu_grad(float(x)) == Approx(fd).margin(1e-5).epsilon(1e-5));
  }
  // bf16 rounding: round-to-nearest-even, exact values preserved, NaN kept.
  CHECK(math::bf16_to_float(math::float_to_bf16(1.0f)) == 1.0f);
  CHECK(math::float_to_bf16(1.0f + 1.0f / 256) == 0x3f80);  // tie, even stays
  CHECK(math::float_to_bf16(1.0f + 3.0f / 256) == 0x3f82);  // tie, odd rounds up
  CHECK(std::isnan(math::bf16_to_float(math::float_to_bf16(NAN))));
  for (float v : {3.14159f, -2.5e-3f, 65504.0f, 1e-30f}) {
    float r = math::bf16_to_float(math::float_to_bf16(v));
    CHECK(std::fabs(r - v) <= std::fabs(v) * std::ldexp(1.0f, -8));  // half a bf16 ulp
  }
}
