// GEMM precision on the CPU backend (runtime.precision): the bf16 GEMM equals an exact
// product of the bf16-rounded inputs up to fp32 accumulation error, and a model run with bf16
// GEMM inputs stays within bf16 rounding of the fp32 model.
#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <vector>

#include "fuyou/backend_select.h"
#include "fuyou/config.h"
#include "fuyou/error.h"
#include "fuyou/model.h"
#include "kernels/common/element_math.h"
#include "kernels/cpu/gemm.h"
#include "storage_values.h"
#include "test_support.h"

using namespace fuyou;
using test::as_stored;

namespace {

// X as stored: (rows, cols) with row stride ld; element (i, k) of op(X).
struct Mat {
  std::vector<float> v;
  int ld;
  bool trans;
  float at(int i, int k) const {
    return trans ? v[static_cast<size_t>(k) * ld + i] : v[static_cast<size_t>(i) * ld + k];
  }
};

Mat random_mat(int rows, int cols, bool trans, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  int r = trans ? cols : rows, c = trans ? rows : cols;
  Mat m{std::vector<float>(static_cast<size_t>(r) * (c + 3)), c + 3, trans};
  for (float& x : m.v) x = d(rng);
  return m;
}

}  // namespace

TEST_CASE("gemm_bf16 is the exact product of the bf16-rounded inputs up to fp32 accumulation",
          "[precision]") {
  // Both paths: oneDNN's bf16 matmul where the CPU has it, and the fp32 GEMM on rounded
  // operands (the only path on CPUs without AVX-512).
  const bool fallback = GENERATE(false, true);
  cpu::set_bf16_gemm_fallback(fallback);
  INFO("fp32 fallback forced " << fallback << ", native bf16 matmul " << cpu::bf16_gemm_native());
  std::mt19937 rng(11);
  const int M = 37, N = 29, K = 301;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb)
      for (float beta : {0.0f, 1.0f}) {
        Mat A = random_mat(M, K, ta, rng), B = random_mat(K, N, tb, rng);
        const int ldc = N + 5;
        std::vector<float> C(static_cast<size_t>(M) * ldc, 0.5f), C0 = C;
        cpu::gemm_bf16(ta, tb, M, N, K, 1.0f, A.v.data(), A.ld, B.v.data(), B.ld, beta, C.data(),
                       ldc);
        double worst = 0, worst_unrounded = 0;
        for (int i = 0; i < M; ++i)
          for (int j = 0; j < N; ++j) {
            double exact = 0, mag = 0, unrounded = 0;
            for (int k = 0; k < K; ++k) {
              double p = static_cast<double>(as_stored(ElemType::kBF16, A.at(i, k))) *
                         as_stored(ElemType::kBF16, B.at(k, j));
              exact += p;
              mag += std::fabs(p);
              unrounded += static_cast<double>(A.at(i, k)) * B.at(k, j);
            }
            double c0 = beta * C0[static_cast<size_t>(i) * ldc + j];
            double got = C[static_cast<size_t>(i) * ldc + j];
            // fp32 accumulation of K products (plus the beta term): |error| <= K u32 sum|p|,
            // u32 = 2^-24, the standard gamma_K bound; bf16 products are exact in fp32.
            double bound = (K + 1) * std::ldexp(1.0, -24) * (mag + std::fabs(c0));
            worst = std::max(worst, std::fabs(got - (exact + c0)) / bound);
            worst_unrounded = std::max(worst_unrounded, std::fabs(got - (unrounded + c0)) / bound);
          }
        INFO("trans_a " << ta << " trans_b " << tb << " beta " << beta);
        CHECK(worst <= 1.0);
        // The inputs really were rounded: against the unrounded product the error is far
        // past the fp32 bound.
        CHECK(worst_unrounded > 10.0);
        for (int i = 0; i < M; ++i)  // the padding past N columns is untouched
          for (int j = N; j < ldc; ++j) CHECK(C[static_cast<size_t>(i) * ldc + j] == 0.5f);
      }
  cpu::set_bf16_gemm_fallback(false);
}

TEST_CASE("a model with bf16 GEMM inputs stays within bf16 rounding of the fp32 model",
          "[precision]") {
  ModelConfig mc;
  mc.n_layer = 2;
  mc.n_head = 2;
  mc.d_model = 64;
  mc.d_ff = 256;
  mc.vocab_size = 256;
  mc.seq_len = 32;
  const int B = 2;
  std::vector<int32_t> tokens(B * mc.seq_len), targets(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>((i * 37 + 11) % 256);
    targets[i] = static_cast<int32_t>((i * 53 + 5) % 256);
  }
  const bool fallback = GENERATE(false, true);
  cpu::set_bf16_gemm_fallback(fallback);
  INFO("fp32 fallback forced " << fallback);
  std::vector<float> logits[2], grads[2];
  float loss[2];
  for (int mode = 0; mode < 2; ++mode) {
    auto be = make_cpu_backend(2, 0);
    be->set_matmul_precision(mode ? MatmulPrecision::kBf16 : MatmulPrecision::kFp32);
    Transformer m(mc, *be, B);
    std::vector<float> host(m.layout().total);
    init_gpt_params(mc, m.layout(), host.data());
    be->copy_to_device(m.params(), host.data(), 4 * host.size());
    loss[mode] = m.forward(tokens.data(), targets.data());
    const size_t nl = static_cast<size_t>(m.tokens_per_batch()) * mc.vocab_size;
    logits[mode].resize(nl);
    m.copy_logits(logits[mode].data());
    m.zero_grads();
    m.backward(1.0f / m.tokens_per_batch());
    grads[mode].assign(test::f32(m.grads()), test::f32(m.grads()) + m.layout().total);
  }
  // Each GEMM rounds its inputs to bf16 (unit roundoff u = 2^-8); the errors of the ~7 GEMMs
  // on a path through this 2-layer model add, so 8u bounds the relative error with margin.
  const double u = std::ldexp(1.0, -8);
  double e_logits = test::rel_error(logits[1].data(), logits[0].data(), logits[0].size());
  double e_grads = test::rel_error(grads[1].data(), grads[0].data(), grads[0].size());
  INFO("logits rel error " << e_logits << ", grads rel error " << e_grads << ", u " << u);
  CHECK(e_logits <= 8 * u);
  CHECK(e_grads <= 8 * u);
  CHECK(std::fabs(loss[1] - loss[0]) <= 8 * u * std::fabs(loss[0]));
  CHECK(e_logits > 0);  // the bf16 path ran
  cpu::set_bf16_gemm_fallback(false);
}

TEST_CASE("runtime.precision is validated and applied", "[precision]") {
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(parse_config("runtime: {precision: fp8}\n", "<t>"),
                    Contains("precision") && Contains("fp8"));
  Config c = parse_config("runtime: {precision: fp16}\n", "<t>");
  auto be = make_cpu_backend(1, 0);
  apply_precision(*be, c.runtime);
  CHECK(be->matmul_precision() == MatmulPrecision::kFp16);
  c = parse_config("runtime: {precision: auto}\n", "<t>");
  apply_precision(*be, c.runtime);
  CHECK(be->matmul_precision() == MatmulPrecision::kFp32);
  c = parse_config("runtime: {precision: bf16}\n", "<t>");
  apply_precision(*be, c.runtime);
  CHECK(be->matmul_precision() == MatmulPrecision::kBf16);
}
