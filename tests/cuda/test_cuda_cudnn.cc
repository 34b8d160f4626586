// cuDNN's fused causal attention (kernels/cuda/cudnn_attention.cc, runtime.attention: cudnn)
// on 16-bit tensors.
//
// cuDNN computes in another way than the CPU backend: the scores in fp32 from the 16-bit
// operands, but the probabilities enter P V rounded to the tensors' type, as do P^T (for dV)
// and dS^T (for dK), and the backward's row sums use the forward's rounded output. Each of
// those is one 16-bit rounding of one factor of a product (relative error <= u16, the unit
// roundoff), and every output is rounded once more (<= u16): at most three such roundings on
// any path, so against the exact result (fp64, from the same 16-bit inputs) the normwise
// relative error of out, dq, dk and dv is within 3 u16 plus fp32's terms; the bound is 8 u16,
// and the figures are printed beside the CPU backend's own error on the same inputs. The
// log-sum-exps are fp32 throughout: within 4 (D + T) u32 (1 + the largest |score|).
// Also: two runs give the same bits (the deterministic backward), the backend routes
// attention_forward / attention_backward to cuDNN without refusing these shapes, and a batch
// taken in chunks of rows (as a workspace over the cap is) stays within the same bounds.
#include <catch2/catch.hpp>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "cuda_test_support.h"
#include "fuyou/cuda.h"
#include "kernels/common/element_math.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/storage_values.h"

using namespace fuyou;
using test::rnd16;
using test::unit_roundoff;
using test::wid16;

namespace {

constexpr double kU32 = FLT_EPSILON / 2;

struct Exact {
  std::vector<double> out, lse, dqkv;
  double max_score = 0;
};

// Causal attention and its gradient in fp64 on packed qkv(B,T,3C), dout(B,T,C).
Exact exact_attention(const std::vector<float>& qkv, const std::vector<float>& dout, int B, int T,
                      int C, int H) {
  const int D = C / H;
  const double scale = 1.0 / std::sqrt(double(D));
  Exact r;
  r.out.assign(size_t(B) * T * C, 0.0);
  r.lse.assign(size_t(B) * H * T, 0.0);
  r.dqkv.assign(qkv.size(), 0.0);
  std::vector<double> p(size_t(T) * T), dp(size_t(T) * T);
  auto at = [&](int b, int t, int part, int h, int d) {
    return size_t(b * T + t) * 3 * C + part * C + h * D + d;
  };
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < T; ++i) {
        double mx = -INFINITY;
        for (int j = 0; j <= i; ++j) {
          double s = 0, sa = 0;
          for (int d = 0; d < D; ++d) {
            s += double(qkv[at(b, i, 0, h, d)]) * qkv[at(b, j, 1, h, d)];
            sa += std::fabs(double(qkv[at(b, i, 0, h, d)]) * qkv[at(b, j, 1, h, d)]);
          }
          p[size_t(i) * T + j] = s * scale;
          r.max_score = std::max(r.max_score, sa * scale);
          mx = std::max(mx, s * scale);
        }
        double z = 0;
        for (int j = 0; j <= i; ++j) z += std::exp(p[size_t(i) * T + j] - mx);
        const double lse = mx + std::log(z);
        r.lse[(size_t(b) * H + h) * T + i] = lse;
        for (int j = 0; j <= i; ++j) p[size_t(i) * T + j] = std::exp(p[size_t(i) * T + j] - lse);
        for (int d = 0; d < D; ++d) {
          double o = 0;
          for (int j = 0; j <= i; ++j) o += p[size_t(i) * T + j] * qkv[at(b, j, 2, h, d)];
          r.out[size_t(b * T + i) * C + h * D + d] = o;
        }
      }
      for (int i = 0; i < T; ++i) {
        double dot = 0;
        for (int j = 0; j <= i; ++j) {
          double s = 0;
          for (int d = 0; d < D; ++d)
            s += double(dout[size_t(b * T + i) * C + h * D + d]) * qkv[at(b, j, 2, h, d)];
          dp[size_t(i) * T + j] = s;
          dot += p[size_t(i) * T + j] * s;
        }
        for (int j = 0; j <= i; ++j) {
          const double ds = p[size_t(i) * T + j] * (dp[size_t(i) * T + j] - dot) * scale;
          const double pij = p[size_t(i) * T + j];
          for (int d = 0; d < D; ++d) {
            r.dqkv[at(b, i, 0, h, d)] += ds * qkv[at(b, j, 1, h, d)];
            r.dqkv[at(b, j, 1, h, d)] += ds * qkv[at(b, i, 0, h, d)];
            r.dqkv[at(b, j, 2, h, d)] += pij * dout[size_t(b * T + i) * C + h * D + d];
          }
        }
      }
    }
  return r;
}

// ||got - exact|| / ||exact|| over the elements of part `part` (0 q, 1 k, 2 v) of a packed
// (rows, 3C) tensor, or of a whole (rows, C) tensor when part < 0.
double rel_error(const std::vector<float>& got, const std::vector<double>& exact, int C, int part) {
  double num = 0, den = 0;
  const size_t width = part < 0 ? C : 3 * size_t(C);
  for (size_t i = 0; i < exact.size(); ++i) {
    if (part >= 0 && int((i % width) / C) != part) continue;
    num += (got[i] - exact[i]) * (got[i] - exact[i]);
    den += exact[i] * exact[i];
  }
  return std::sqrt(num / den);
}

struct Result {
  std::vector<uint16_t> out, dqkv;
  std::vector<float> lse;
};

// One forward and backward on `be` (16-bit tensors of type t) from the 16-bit inputs.
// `pos` (B*T positions within packed records, Backend::attention_forward) may be empty.
Result run(Backend& be, ElemType t, const std::vector<uint16_t>& qkv,
           const std::vector<uint16_t>& dout, int B, int T, int C, int H,
           const std::vector<int32_t>& pos = {}) {
  (void)t;
  const size_t n_qkv = qkv.size(), n_out = dout.size(), n_lse = size_t(B) * H * T;
  void* dq = be.alloc(2 * n_qkv, "qkv");
  void* ddo = be.alloc(2 * n_out, "dout");
  void* out = be.alloc(2 * n_out, "out");
  void* dd = be.alloc(2 * n_qkv, "dqkv");
  float* lse = static_cast<float*>(be.alloc(4 * n_lse, "lse"));
  float* scratch = static_cast<float*>(be.alloc(8 * size_t(T) * T, "scratch"));
  be.copy_to_device(dq, qkv.data(), 2 * n_qkv);
  be.copy_to_device(ddo, dout.data(), 2 * n_out);
  int32_t* dpos =
      pos.empty() ? nullptr : static_cast<int32_t*>(be.alloc(4 * pos.size(), "positions"));
  if (dpos) be.copy_to_device(dpos, pos.data(), 4 * pos.size());
  be.attention_forward(out, lse, scratch, dq, B, T, C, H, dpos);
  be.attention_backward(dd, scratch, ddo, out, dq, lse, B, T, C, H, dpos);
  Result r{std::vector<uint16_t>(n_out), std::vector<uint16_t>(n_qkv), std::vector<float>(n_lse)};
  be.copy_to_host(r.out.data(), out, 2 * n_out);
  be.copy_to_host(r.dqkv.data(), dd, 2 * n_qkv);
  be.copy_to_host(r.lse.data(), lse, 4 * n_lse);
  for (void* p : {dq, ddo, out, dd, static_cast<void*>(lse), static_cast<void*>(scratch)})
    be.free(p);
  if (dpos) be.free(dpos);
  return r;
}

std::vector<float> widen(ElemType t, const std::vector<uint16_t>& h) {
  std::vector<float> f(h.size());
  for (size_t i = 0; i < h.size(); ++i) f[i] = wid16(t, h[i]);
  return f;
}

}  // namespace

TEST_CASE("cudnn fused attention: within 16-bit bounds of exact, deterministic, routed",
          "[cuda][cudnn]") {
  struct Shape {
    int B, T, C, H;
  };
  const ElemType t = GENERATE(ElemType::kBF16, ElemType::kF16);
  const Shape sh = GENERATE(Shape{2, 256, 256, 4}, Shape{2, 128, 512, 4}, Shape{1, 384, 192, 3},
                            Shape{2, 200, 128, 2});
  const int B = sh.B, T = sh.T, C = sh.C, H = sh.H, D = C / H;
  INFO(elem_type_name(t) << " B " << B << " T " << T << " C " << C << " H " << H << " (head size "
                         << D << ")");

  Rng rng(1000 + T + C);
  std::vector<uint16_t> qkv(size_t(B) * T * 3 * C), dout(size_t(B) * T * C);
  for (auto& x : qkv) x = rnd16(t, static_cast<float>(rng.normal()));
  for (auto& x : dout) x = rnd16(t, static_cast<float>(rng.normal()));
  const std::vector<float> qkv_f = widen(t, qkv), dout_f = widen(t, dout);
  const Exact ex = exact_attention(qkv_f, dout_f, B, T, C, H);

  auto gpu = make_cuda_backend(0, 1ull << 30);
  gpu->set_storage_type(t);
  gpu->set_attention_impl(AttentionImpl::kCudnn);  // throws when cuDNN cannot be loaded
  auto* cuda = dynamic_cast<cuda::CudaBackend*>(gpu.get());
  REQUIRE(cuda);
  REQUIRE(cuda->fused_attention());
  std::printf("cudnn attention test: %s\n", gpu->name().c_str());
  const Result a = run(*gpu, t, qkv, dout, B, T, C, H);
  // Both directions ran on cuDNN, except the backward at a length that is not a multiple of
  // 128 before cuDNN 9.16 (refused, the kernels run it: the results are checked all the same).
  const bool old_backward = T % 128 && cuda->cudnn()->version_number() < 91600;
  INFO("refusals: " << cuda->attention_refusals() << " (" << cuda->cudnn()->version() << ")");
  REQUIRE(cuda->attention_refusals() == (old_backward ? 1u : 0u));
  const Result b = run(*gpu, t, qkv, dout, B, T, C, H);
  CHECK(a.out == b.out);
  CHECK(a.dqkv == b.dqkv);
  CHECK(std::memcmp(a.lse.data(), b.lse.data(), 4 * a.lse.size()) == 0);

  // The CPU backend's 16-bit attention on the same inputs, for the figures.
  auto cpu = make_cpu_backend(2, 1ull << 30);
  cpu->set_storage_type(t);
  const Result c = run(*cpu, t, qkv, dout, B, T, C, H);

  const double u = unit_roundoff(t), bound = 8 * u;
  const std::vector<float> c_out = widen(t, c.out), c_d = widen(t, c.dqkv);
  const double ce[4] = {rel_error(c_out, ex.out, C, -1), rel_error(c_d, ex.dqkv, C, 0),
                        rel_error(c_d, ex.dqkv, C, 1), rel_error(c_d, ex.dqkv, C, 2)};
  auto check_errors = [&](const Result& r, const char* how) {
    const std::vector<float> g_out = widen(t, r.out), g_d = widen(t, r.dqkv);
    const double e[4] = {rel_error(g_out, ex.out, C, -1), rel_error(g_d, ex.dqkv, C, 0),
                         rel_error(g_d, ex.dqkv, C, 1), rel_error(g_d, ex.dqkv, C, 2)};
    std::printf(
        "cudnn attention %s B %d T %d C %d H %d%s: relative error / u16 (cuDNN | CPU kernels): out "
        "%.2f | %.2f, dq %.2f | %.2f, dk %.2f | %.2f, dv %.2f | %.2f\n",
        elem_type_name(t), B, T, C, H, how, e[0] / u, ce[0] / u, e[1] / u, ce[1] / u, e[2] / u,
        ce[2] / u, e[3] / u, ce[3] / u);
    const char* names[4] = {"out", "dq", "dk", "dv"};
    for (int k = 0; k < 4; ++k) {
      INFO(how << " " << names[k] << ": relative error " << e[k] << " = " << e[k] / u << " u16");
      CHECK(e[k] <= bound);
    }
  };
  check_errors(a, "");
  // The batch in chunks of one row (the workspace cap lowered below every plan's): the same
  // bounds, nothing refused that was not before.
  cuda->cudnn()->set_workspace_cap(1);
  const Result chunked = run(*gpu, t, qkv, dout, B, T, C, H);
  INFO("refusals after the chunked run: " << cuda->attention_refusals());
  CHECK(cuda->attention_refusals() == (old_backward ? 2u : 0u));
  check_errors(chunked, ", in chunks of one row");
  std::printf("  chunked results %s the whole batch's\n",
              chunked.out == a.out && chunked.dqkv == a.dqkv ? "equal bit for bit" : "differ from");
  double lse_err = 0;
  for (size_t i = 0; i < ex.lse.size(); ++i)
    lse_err = std::max(lse_err, std::fabs(a.lse[i] - ex.lse[i]));
  INFO("log-sum-exp: largest error " << lse_err);
  CHECK(lse_err <= 4 * (D + T) * kU32 * (1 + ex.max_score));
}

TEST_CASE(
    "cudnn attention refuses packed records once, and the kernels run them as with "
    "runtime.attention: "
    "kernels",
    "[cuda][cudnn][records]") {
  const ElemType t = ElemType::kBF16;
  const int B = 2, T = 128, C = 128, H = 2;
  std::vector<int32_t> pos;
  for (int b = 0; b < B; ++b)
    for (int len : {40, 88 - 30 * b, 30 * b})
      for (int i = 0; i < len; ++i) pos.push_back(i);
  REQUIRE(pos.size() == size_t(B) * T);
  Rng rng(77);
  std::vector<uint16_t> qkv(size_t(B) * T * 3 * C), dout(size_t(B) * T * C);
  for (auto& x : qkv) x = rnd16(t, static_cast<float>(rng.normal()));
  for (auto& x : dout) x = rnd16(t, static_cast<float>(rng.normal()));
  auto fused = make_cuda_backend(0, 1ull << 30);
  fused->set_storage_type(t);
  fused->set_attention_impl(AttentionImpl::kCudnn);
  auto* cuda = dynamic_cast<cuda::CudaBackend*>(fused.get());
  REQUIRE(cuda);
  const Result a = run(*fused, t, qkv, dout, B, T, C, H, pos);
  CHECK(cuda->attention_refusals() == 2u);  // the forward and the backward
  auto kernels = make_cuda_backend(0, 1ull << 30);
  kernels->set_storage_type(t);
  kernels->set_attention_impl(AttentionImpl::kKernels);
  const Result b = run(*kernels, t, qkv, dout, B, T, C, H, pos);
  CHECK(a.out == b.out);
  CHECK(a.dqkv == b.dqkv);
}
