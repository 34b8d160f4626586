// Every CUDA kernel against the CPU backend on the same random inputs, and the device arena.
//
// Tolerances, all from fp32's unit roundoff u = FLT_EPSILON / 2 (or bf16's / fp16's for the
// mixed-precision GEMMs), written next to each comparison:
// - element-wise kernels run the same element_math.h function on both sides; they may differ
//   by one rounding per operation where nvcc contracts a*b+c into an FMA and GCC does not, so
//   the bound is (operations) * u relative to the magnitude involved;
// - a sum of K terms computed in two different orders differs by at most 2 gamma_K
//   sum |terms| (gamma_K = K u / (1 - K u) ~ K u), with sum |terms| computed from the data;
// - statistics accumulated in double on both sides (LayerNorm, RMSNorm, cross-entropy) leave
//   only the final fp32 roundings.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cfloat>
#include <cmath>

#include "cuda_test_support.h"
#include "fuyou/cuda.h"
#include "fuyou/error.h"
#include "fuyou/model.h"
#include "kernels/common/element_math.h"
#include "tests/storage_values.h"

using namespace fuyou;
using test::abs_products;
using test::check_within;
using test::check_within_each;
using test::DeviceVec;
using test::max_abs;
using test::random_normal;
using test::random_tokens;
using test::transpose;

namespace {

constexpr double kU = FLT_EPSILON / 2;  // fp32 unit roundoff
constexpr uint64_t kArena = 256ull << 20;

struct Pair {
  std::unique_ptr<Backend> cpu = make_cpu_backend(2, 0);
  std::unique_ptr<Backend> gpu = make_cuda_backend(0, kArena);
};

}  // namespace

TEST_CASE("cuda arena: capacity, 256-byte alignment, zeroing, coalescing", "[cuda]") {
  auto be = make_cuda_backend(0, 1 << 20);
  CHECK(be->kind() == BackendKind::kCuda);
  CHECK(be->memory().capacity == (1u << 20));
  void* a = be->alloc(1000, "a");
  void* b = be->alloc(3000, "b");
  CHECK(reinterpret_cast<uintptr_t>(a) % 256 == 0);
  CHECK(reinterpret_cast<uintptr_t>(b) % 256 == 0);
  CHECK(be->memory().used == 1024 + 3072);
  std::vector<unsigned char> h(3000, 0xff);
  be->copy_to_host(h.data(), b, h.size());
  CHECK(std::count(h.begin(), h.end(), 0) == 3000);
  try {
    be->alloc(1 << 20, "too big");
    FAIL("allocation beyond the capacity did not throw");
  } catch (const Error& e) {
    std::string m = e.what();
    CHECK(m.find("too big") != std::string::npos);
    CHECK(m.find("1.00 MiB") != std::string::npos);
  }
  be->free(a);
  be->free(b);
  CHECK(be->memory().used == 0);
  CHECK(be->memory().peak == 1024 + 3072);
  void* all = be->alloc(1 << 20, "everything");  // the free blocks coalesced back into one
  be->free(all);
}

TEST_CASE("cuda embedding forward and backward match the CPU", "[cuda]") {
  Pair p;
  const int B = 3, T = 17, C = 40, V = 11;
  auto wte = random_normal(V * C, 1), wpe = random_normal(T * C, 2),
       dout = random_normal(B * T * C, 3);
  auto tok = random_tokens(B * T, V, 4);  // 51 tokens over 11 ids: rows repeat
  for (bool with_pos : {true, false}) {
    std::vector<float> out(B * T * C), dwte(V * C, 0.5f), dwpe(T * C, 0.25f);
    p.cpu->embedding_forward(out.data(), tok.data(), wte.data(), with_pos ? wpe.data() : nullptr, B,
                             T, C);
    p.cpu->embedding_backward(dwte.data(), with_pos ? dwpe.data() : nullptr, dout.data(),
                              tok.data(), B, T, C);
    DeviceVec<float> g_out(*p.gpu, out.size()), g_wte(*p.gpu, wte), g_wpe(*p.gpu, wpe),
        g_dout(*p.gpu, dout), g_dwte(*p.gpu, std::vector<float>(V * C, 0.5f)),
        g_dwpe(*p.gpu, std::vector<float>(T * C, 0.25f));
    DeviceVec<int32_t> g_tok(*p.gpu, tok);
    p.gpu->embedding_forward(g_out.get(), g_tok.get(), g_wte.get(),
                             with_pos ? g_wpe.get() : nullptr, B, T, C);
    p.gpu->embedding_backward(g_dwte.get(), with_pos ? g_dwpe.get() : nullptr, g_dout.get(),
                              g_tok.get(), B, T, C);
    // One addition per element: identical.
    check_within("embedding out", g_out.host(), out, 0.0);
    // Both backends add the rows of dout into dwte and dwpe in increasing position, one
    // correctly rounded addition at a time: identical.
    check_within("embedding dwte", g_dwte.host(), dwte, 0.0);
    if (with_pos) check_within("embedding dwpe", g_dwpe.host(), dwpe, 0.0);
  }
}

TEST_CASE("cuda layernorm and rmsnorm forward and backward match the CPU", "[cuda]") {
  Pair p;
  // C not a multiple of the block size: tails are exercised. 300 is a whole number of
  // 16-byte vectors of floats (the vector path); 301 is not (element by element).
  const int N = 37, C = GENERATE(300, 301);
  auto x = random_normal(N * C, 5, 3.0f), w = random_normal(C, 6), b = random_normal(C, 7),
       dy = random_normal(N * C, 8);
  std::vector<float> out(N * C), mean(N), rstd(N), din(N * C, 1.0f), dw(C, 0.0f), db(C, 0.0f);
  p.cpu->layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N,
                           C);
  p.cpu->layernorm_backward(din.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(),
                            mean.data(), rstd.data(), N, C);
  DeviceVec<float> gx(*p.gpu, x), gw(*p.gpu, w), gb(*p.gpu, b), gdy(*p.gpu, dy),
      gout(*p.gpu, N * C), gmean(*p.gpu, N), grstd(*p.gpu, N),
      gdin(*p.gpu, std::vector<float>(N * C, 1.0f)), gdw(*p.gpu, C), gdb(*p.gpu, C);
  p.gpu->layernorm_forward(gout.get(), gmean.get(), grstd.get(), gx.get(), gw.get(), gb.get(), N,
                           C);
  p.gpu->layernorm_backward(gdin.get(), gdw.get(), gdb.get(), gdy.get(), gx.get(), gw.get(),
                            gmean.get(), grstd.get(), N, C);
  // Statistics in double on both sides: the fp32 mean and rstd agree to a rounding or two.
  check_within("layernorm mean", gmean.host(), mean, 2 * kU * max_abs(mean));
  check_within("layernorm rstd", grstd.host(), rstd, 4 * kU * max_abs(rstd));
  // out = (x - m) * r * w + b: four roundings, each relative to |xhat w| + |b|.
  const double xhat_max = max_abs(x) * 2 * max_abs(rstd);
  check_within("layernorm out", gout.host(), out, 8 * kU * (xhat_max * max_abs(w) + max_abs(b)));
  // din += (g - mean(g) - xhat mean(g xhat)) r, g = dy w: each of its terms is at most
  // |g| (1 + 1 + xhat^2) r in size, and about eight roundings touch it, plus the one of the
  // accumulation into the initial 1.
  const double g_max = max_abs(dy) * max_abs(w);
  check_within("layernorm din", gdin.host(), din,
               16 * kU * (1 + (2 + xhat_max * xhat_max) * g_max * max_abs(rstd)));
  // dw, db: column sums of N terms in another order.
  check_within("layernorm dw", gdw.host(), dw, 2 * N * kU * N * max_abs(dy) * xhat_max);
  check_within("layernorm db", gdb.host(), db, 2 * N * kU * N * max_abs(dy));

  std::vector<float> rout(N * C), rr(N), rdin(N * C, 1.0f), rdw(C, 0.0f);
  p.cpu->rmsnorm_forward(rout.data(), rr.data(), x.data(), w.data(), 1e-6f, N, C);
  p.cpu->rmsnorm_backward(rdin.data(), rdw.data(), dy.data(), x.data(), w.data(), rr.data(), N, C);
  DeviceVec<float> grout(*p.gpu, N * C), grr(*p.gpu, N),
      grdin(*p.gpu, std::vector<float>(N * C, 1.0f)), grdw(*p.gpu, C);
  p.gpu->rmsnorm_forward(grout.get(), grr.get(), gx.get(), gw.get(), 1e-6f, N, C);
  p.gpu->rmsnorm_backward(grdin.get(), grdw.get(), gdy.get(), gx.get(), gw.get(), grr.get(), N, C);
  check_within("rmsnorm rstd", grr.host(), rr, 4 * kU * max_abs(rr));
  const double rxhat = max_abs(x) * max_abs(rr);
  check_within("rmsnorm out", grout.host(), rout, 4 * kU * rxhat * max_abs(w));
  // The same as LayerNorm's din without the mean term: |g| (1 + xhat^2) r.
  check_within("rmsnorm din", grdin.host(), rdin,
               16 * kU * (1 + (1 + rxhat * rxhat) * g_max * max_abs(rr)));
  check_within("rmsnorm dw", grdw.host(), rdw, 2 * N * kU * N * max_abs(dy) * rxhat);
}

TEST_CASE("cuda matmul in fp32, bf16 and fp16 matches the CPU's fp32", "[cuda]") {
  Pair p;
  const int N = 45, IC = 130, OC = 70;
  auto x = random_normal(N * IC, 9), w = random_normal(OC * IC, 10), bias = random_normal(OC, 11),
       dy = random_normal(N * OC, 12);
  std::vector<float> out(N * OC), din(N * IC), dw(OC * IC, 0.0f), dbias(OC, 0.0f);
  p.cpu->matmul_forward(out.data(), x.data(), w.data(), bias.data(), N, IC, OC);
  p.cpu->matmul_backward(din.data(), dw.data(), dbias.data(), dy.data(), x.data(), w.data(), N, IC,
                         OC);
  // |A||B| for the three products: out = x w^T, din = dy w, dw = dy^T x.
  auto m_out = abs_products(x, w, N, OC, IC);
  auto m_din = abs_products(dy, transpose(w, OC, IC), N, IC, OC);
  auto m_dw = abs_products(transpose(dy, N, OC), transpose(x, N, IC), OC, IC, N);
  struct Mode {
    MatmulPrecision p;
    double u_in;  // unit roundoff the GEMM inputs are rounded to
  };
  for (Mode m :
       {Mode{MatmulPrecision::kFp32, 0.0}, Mode{MatmulPrecision::kBf16, std::ldexp(1.0, -8)},
        Mode{MatmulPrecision::kFp16, std::ldexp(1.0, -11)}}) {
    INFO("precision " << matmul_precision_name(m.p));
    p.gpu->set_matmul_precision(m.p);
    DeviceVec<float> gx(*p.gpu, x), gw(*p.gpu, w), gb(*p.gpu, bias), gdy(*p.gpu, dy),
        gout(*p.gpu, N * OC), gdin(*p.gpu, N * IC), gdw(*p.gpu, OC * IC), gdb(*p.gpu, OC);
    p.gpu->matmul_forward(gout.get(), gx.get(), gw.get(), gb.get(), N, IC, OC);
    p.gpu->matmul_backward(gdin.get(), gdw.get(), gdb.get(), gdy.get(), gx.get(), gw.get(), N, IC,
                           OC);
    // Each product term carries at most 2 u_in (rounding both inputs) + u_in^2, and both
    // fp32 sums of K terms at most gamma_K each: per element
    // (2 u_in + u_in^2 + 2 (K+1) u) (|A||B|)_ij (+ the bias added once).
    auto bound = [&](const std::vector<double>& ab, int K, double extra) {
      std::vector<double> b(ab.size());
      for (size_t i = 0; i < ab.size(); ++i)
        b[i] = (2 * m.u_in + m.u_in * m.u_in + 2 * (K + 1) * kU) * (ab[i] + extra) + 1e-30;
      return b;
    };
    check_within_each("matmul out", gout.host(), out, bound(m_out, IC, max_abs(bias)));
    check_within_each("matmul din", gdin.host(), din, bound(m_din, OC, 0));
    check_within_each("matmul dw", gdw.host(), dw, bound(m_dw, N, 0));
    // The bias gradient is an fp32 column sum whatever the precision.
    check_within("matmul dbias", gdb.host(), dbias, 2 * N * kU * N * max_abs(dy));
  }
}

namespace {

// The CUDA backend's attention kernels (storage type t) against the CPU backend's fp32 on the
// same (widened) inputs: B rows of T, records by `pos` (empty: one record per row), Tmax the
// longest record.
void check_attention(int B, int T, int C, int H, const std::vector<int32_t>& pos, int Tmax,
                     ElemType t, uint64_t seed) {
  INFO("B " << B << " T " << T << " C " << C << " H " << H << " " << elem_type_name(t));
  Pair p;
  p.gpu->set_storage_type(t);
  p.gpu->set_attention_impl(AttentionImpl::kKernels);
  auto stored = [&](std::vector<float> v) {  // as the device stores them, widened back
    if (t == ElemType::kF32) return v;
    std::vector<uint16_t> h(v.size());
    round_to(t, h.data(), v.data(), v.size());
    widen_from(t, v.data(), h.data(), v.size());
    return v;
  };
  const auto qkv = stored(random_normal(size_t(B) * T * 3 * C, seed)),
             dout = stored(random_normal(size_t(B) * T * C, seed + 1));
  const int32_t* cpos = pos.empty() ? nullptr : pos.data();
  std::vector<float> out(size_t(B) * T * C), lse(size_t(B) * H * T), scratch(2 * size_t(T) * T),
      dqkv(qkv.size());
  p.cpu->attention_forward(out.data(), lse.data(), scratch.data(), qkv.data(), B, T, C, H, cpos);
  p.cpu->attention_backward(dqkv.data(), scratch.data(), dout.data(), out.data(), qkv.data(),
                            lse.data(), B, T, C, H, cpos);
  // The device's tensors in its storage type, and its results widened.
  const size_t es = elem_type_size(t);
  auto to_device = [&](const std::vector<float>& v) {
    std::vector<char> h(v.size() * es);
    round_to(t, h.data(), v.data(), v.size());
    return h;
  };
  auto from_device = [&](const std::vector<char>& h) {
    std::vector<float> v(h.size() / es);
    widen_from(t, v.data(), h.data(), v.size());
    return v;
  };
  DeviceVec<char> gqkv(*p.gpu, to_device(qkv)), gdout(*p.gpu, to_device(dout)),
      gout(*p.gpu, out.size() * es), gdqkv(*p.gpu, qkv.size() * es);
  DeviceVec<float> glse(*p.gpu, lse.size()), gscratch(*p.gpu, scratch.size());
  std::unique_ptr<DeviceVec<int32_t>> gpos;
  if (cpos) gpos = std::make_unique<DeviceVec<int32_t>>(*p.gpu, pos);
  const int32_t* dpos = gpos ? gpos->get() : nullptr;
  p.gpu->attention_forward(gout.get(), glse.get(), gscratch.get(), gqkv.get(), B, T, C, H, dpos);
  p.gpu->attention_backward(gdqkv.get(), gscratch.get(), gdout.get(), gout.get(), gqkv.get(),
                            glse.get(), B, T, C, H, dpos);
  const int hd = C / H;
  // Scores: sums of hd products (|q||k| <= hd max|qkv|^2 / sqrt(hd)), then exp (relative
  // error about (score error + a few u)), a sum of up to Tmax terms and a division.
  const double score_err =
      2 * (hd + 1) * kU * hd * max_abs(qkv) * max_abs(qkv) / std::sqrt(double(hd));
  const double p_rel = score_err + (2 * Tmax + 8) * kU;
  // 16-bit outputs add their one rounding: half a unit of the type's precision of the largest
  // value (out: |P V| <= max|v|; dqkv: the gradients' largest).
  const double u16 = test::unit_roundoff(t);
  // The log-sum-exp: the largest score's error plus log's of the sum's relative error.
  check_within("attention log-sum-exp", glse.host(), lse, 2 * p_rel);
  // out = P V: Tmax terms of |P||V| <= max|v| each row (P sums to 1).
  check_within("attention out", from_device(gout.host()), out,
               (2 * p_rel + 2 * (Tmax + 1) * kU + u16) * max_abs(qkv));
  // Gradients go through two more GEMMs of length hd or Tmax; the bound grows by the same
  // per-step terms on values of size |dout| |qkv|^2 Tmax.
  const double scale = max_abs(dout) * max_abs(qkv) * max_abs(qkv) * Tmax;
  check_within("attention dqkv", from_device(gdqkv.host()), dqkv,
               4 * (p_rel + 2 * (Tmax + hd + 2) * kU) * scale + u16 * max_abs(dqkv));
}

}  // namespace

TEST_CASE("cuda causal attention forward and backward match the CPU", "[cuda]") {
  check_attention(2, 19, 48, 4, {}, 19, ElemType::kF32, 13);
}

TEST_CASE("cuda attention in batched chunks of heads matches the CPU, fp32 and bf16", "[cuda]") {
  // T 1024 with 20 heads: more (T, T) blocks than the batched calls' 64 MiB of scratch, so the
  // heads go in chunks (fp32: 16 + 4 forward, 8 + 8 + 4 backward), the last one short; bf16
  // widens each chunk's q, k, v.
  for (ElemType t : {ElemType::kF32, ElemType::kBF16})
    check_attention(1, 1024, 160, 20, {}, 1024, t, 61);
}

TEST_CASE("cuda packed-record attention (document-masked) matches the CPU, and rope by position",
          "[cuda][records]") {
  // Two rows of T = 70 holding records of several lengths (one of a single token) and padding:
  // each query attends its own record only (Backend::attention_forward's pos). The same bounds
  // as the unpacked case, with T the longest record.
  Pair p;
  const int B = 2, T = 70, Tmax = 45;
  const std::vector<std::vector<int>> rows = {{12, 1, 45, 12}, {30, 25}};
  std::vector<int32_t> pos;
  for (const auto& r : rows) {
    for (int len : r)
      for (int i = 0; i < len; ++i) pos.push_back(i);
    for (int i = 0; static_cast<int>(pos.size()) % T != 0; ++i) pos.push_back(i);
  }
  REQUIRE(pos.size() == static_cast<size_t>(B) * T);
  check_attention(B, T, 48, 4, pos, Tmax, ElemType::kF32, 23);
  check_attention(B, T, 48, 4, pos, Tmax, ElemType::kBF16, 23);
  DeviceVec<int32_t> gpos(*p.gpu, pos);
  // Rotary phases by position: the bound of the rope test below.
  const int Hq = 4, Hkv = 2, D = 8;
  auto x = random_normal(B * T * (Hq + 2 * Hkv) * D, 25);
  std::vector<float> c = x;
  DeviceVec<float> g(*p.gpu, x);
  p.cpu->rope_forward(c.data(), B, T, Hq, Hkv, D, default_rope_table(D, 10000.0f), pos.data());
  p.gpu->rope_forward(g.get(), B, T, Hq, Hkv, D, default_rope_table(D, 10000.0f), gpos.get());
  check_within("rope by position", g.host(), c, 8 * kU * 2 * max_abs(x));
}

TEST_CASE("cuda element-wise kernels match the CPU", "[cuda]") {
  Pair p;
  const size_t n = 100003;  // not a multiple of any block size
  auto a = random_normal(n, 15, 3.0f), b = random_normal(n, 16);
  DeviceVec<float> ga(*p.gpu, a), gb(*p.gpu, b), gout(*p.gpu, n);
  std::vector<float> out(n);
  // GELU: exp_fast is ~12 dependent operations, tanh and the polynomial ~8 more; each may
  // round differently under FMA contraction: 32 u relative to |x| (|gelu(x)| <= |x|).
  p.cpu->gelu_forward(out.data(), a.data(), n);
  p.gpu->gelu_forward(gout.get(), ga.get(), n);
  check_within("gelu", gout.host(), out, 32 * kU * max_abs(a));
  p.cpu->gelu_backward(out.data(), a.data(), b.data(), n);
  p.gpu->gelu_backward(gout.get(), ga.get(), gb.get(), n);
  // gelu' = 0.5 (1 + t) + 0.5 x sech^2 k (1 + 3 c x^2): for large |x| the sech^2 = 1 - t^2
  // term cancels, so a few roundings of t are multiplied by 0.5 |x| k (1 + 3 c x^2). Per
  // element: 32 u times that magnitude (plus the O(1) first term), times |dout|.
  std::vector<double> gelu_bound(n);
  for (size_t i = 0; i < n; ++i) {
    double x = std::fabs(double(a[i]));
    double mag = 1 + 0.5 * x * math::kGeluScale * (1 + 3 * math::kGeluCubic * x * x);
    gelu_bound[i] = 32 * kU * mag * std::fabs(double(b[i])) + 1e-30;
  }
  check_within_each("gelu backward", gout.host(), out, gelu_bound);
  p.cpu->add(out.data(), a.data(), b.data(), n);
  p.gpu->add(gout.get(), ga.get(), gb.get(), n);
  check_within("add", gout.host(), out, 0.0);  // one correctly rounded addition
  p.cpu->relu_forward(out.data(), a.data(), n);
  p.gpu->relu_forward(gout.get(), ga.get(), n);
  check_within("relu", gout.host(), out, 0.0);
  p.cpu->relu_backward(out.data(), a.data(), b.data(), n);
  p.gpu->relu_backward(gout.get(), ga.get(), gb.get(), n);
  check_within("relu backward", gout.host(), out, 0.0);
}

TEST_CASE("cuda llama-family kernels (rope, repeat_kv, swiglu) match the CPU", "[cuda]") {
  Pair p;
  const int B = 2, T = 9, Hq = 6, Hkv = 2, D = 16, N = B * T, F = 50;
  const size_t row = size_t(Hq + 2 * Hkv) * D;
  auto qkvc = random_normal(N * row, 17);
  DeviceVec<float> g(*p.gpu, qkvc);
  std::vector<float> c = qkvc;
  // A scaled variant's table (yarn: llama3-like frequencies and a scale on cos and sin), so
  // the device reads the table and the scale, not only the default frequencies.
  ModelConfig yarn;
  yarn.family = "llama";
  yarn.n_head = Hq;
  yarn.d_model = Hq * D;
  yarn.rope_type = "yarn";
  yarn.rope_factor = 4;
  yarn.rope_original_context = 4;
  const RopeTable rope = rope_table(yarn);
  REQUIRE(rope.scale > 1.0f);
  p.cpu->rope_forward(c.data(), B, T, Hq, Hkv, D, rope, nullptr);
  p.gpu->rope_forward(g.get(), B, T, Hq, Hkv, D, rope, nullptr);
  // cos/sin of the same fp32 angle: the device's cosf/sinf are within 2 ulp (CUDA
  // programming guide), so each rotated value is within ~8 u of |x| (times the scale).
  check_within("rope forward", g.host(), c, 8 * kU * 2 * rope.scale * max_abs(qkvc));
  p.cpu->rope_backward(c.data(), B, T, Hq, Hkv, D, rope, nullptr);
  p.gpu->rope_backward(g.get(), B, T, Hq, Hkv, D, rope, nullptr);
  check_within("rope round trip", g.host(), c,
               16 * kU * 2 * rope.scale * rope.scale * max_abs(qkvc));

  std::vector<float> qkv(size_t(N) * 3 * Hq * D), back(qkvc.size());
  DeviceVec<float> gqkv(*p.gpu, qkv.size()), gback(*p.gpu, back.size()), gc(*p.gpu, qkvc);
  p.cpu->repeat_kv_forward(qkv.data(), qkvc.data(), N, Hq, Hkv, D);
  p.gpu->repeat_kv_forward(gqkv.get(), gc.get(), N, Hq, Hkv, D);
  check_within("repeat_kv forward", gqkv.host(), qkv, 0.0);  // copies
  p.cpu->repeat_kv_backward(back.data(), qkv.data(), N, Hq, Hkv, D);
  p.gpu->repeat_kv_backward(gback.get(), gqkv.get(), N, Hq, Hkv, D);
  check_within("repeat_kv backward", gback.host(), back, 0.0);  // same sums in the same order

  // F = 50: element by element; 48: 16-byte vectors of 4 floats.
  for (const int Fs : {F, 48}) {
    INFO("swiglu F " << Fs);
    auto gu = random_normal(size_t(N) * 2 * Fs, 18, 2.0f), dy = random_normal(size_t(N) * Fs, 19);
    std::vector<float> out(size_t(N) * Fs), dgu(gu.size());
    DeviceVec<float> ggu(*p.gpu, gu), gdy(*p.gpu, dy), gout(*p.gpu, out.size()),
        gdgu(*p.gpu, dgu.size());
    p.cpu->swiglu_forward(out.data(), gu.data(), N, Fs);
    p.gpu->swiglu_forward(gout.get(), ggu.get(), N, Fs);
    p.cpu->swiglu_backward(dgu.data(), gu.data(), dy.data(), N, Fs);
    p.gpu->swiglu_backward(gdgu.get(), ggu.get(), gdy.get(), N, Fs);
    // silu through exp_fast: ~16 roundings relative to |gate| |up|.
    check_within("swiglu forward", gout.host(), out, 32 * kU * max_abs(gu) * max_abs(gu));
    check_within("swiglu backward", gdgu.host(), dgu,
                 64 * kU * max_abs(gu) * max_abs(gu) * max_abs(dy));
  }
  // Heads of 12 (6 pairs, not a whole vector of 4): rope element by element.
  {
    const int Ds = 12;
    auto q = random_normal(size_t(N) * (Hq + 2 * Hkv) * Ds, 20);
    DeviceVec<float> gq(*p.gpu, q);
    const RopeTable r = default_rope_table(Ds, 10000.0f);
    p.cpu->rope_forward(q.data(), B, T, Hq, Hkv, Ds, r, nullptr);
    p.gpu->rope_forward(gq.get(), B, T, Hq, Hkv, Ds, r, nullptr);
    check_within("rope forward, head 12", gq.host(), q, 8 * kU * 2 * max_abs(q));
  }
}

TEST_CASE("cuda qk_norm forward and backward match the CPU", "[cuda]") {
  // The RMSNorm of q and k in place (v untouched) over each head (Qwen3) and over the whole q
  // and k projections (OLMo 2), its saved input, rstd, and the backward's input gradient over
  // the q and k parts and the two weight gradients.
  Pair p;
  const int N = 19, Hq = 6, Hkv = 2, D = 32;
  for (const bool projection : {false, true}) {
    CAPTURE(projection);
    const QkNormSpans s =
        projection ? QkNormSpans::projection(Hq, Hkv, D) : QkNormSpans::heads(Hq, Hkv, D);
    const size_t row = s.row();
    auto qkvc = random_normal(N * row, 40, 2.0f), qw = random_normal(s.q_width, 41),
         kw = random_normal(s.k_width, 42), d = random_normal(N * row, 43);
    std::vector<float> c = qkvc, saved(size_t(N) * s.saved_row()), rstd(size_t(N) * s.spans()),
                       dqw(s.q_width, 0.5f), dkw(s.k_width, 0.25f), dc = d;
    DeviceVec<float> g(*p.gpu, qkvc), gqw(*p.gpu, qw), gkw(*p.gpu, kw),
        gsaved(*p.gpu, saved.size()), grstd(*p.gpu, rstd.size()), gdqw(*p.gpu, dqw),
        gdkw(*p.gpu, dkw), gd(*p.gpu, d);
    p.cpu->qk_norm_forward(c.data(), saved.data(), rstd.data(), qw.data(), kw.data(), 1e-6f, N, s);
    p.gpu->qk_norm_forward(g.get(), gsaved.get(), grstd.get(), gqw.get(), gkw.get(), 1e-6f, N, s);
    check_within("qk_norm saved", gsaved.host(), saved, 0.0);  // copies
    check_within("qk_norm rstd", grstd.host(), rstd, 4 * kU * max_abs(rstd));
    const double xhat = max_abs(qkvc) * max_abs(rstd), wmax = std::max(max_abs(qw), max_abs(kw));
    // x r w: two roundings relative to |xhat w|; v copied through untouched (within that bound).
    check_within("qk_norm out", g.host(), c, 4 * kU * xhat * wmax);
    p.cpu->qk_norm_backward(dc.data(), dqw.data(), dkw.data(), saved.data(), qw.data(), kw.data(),
                            rstd.data(), N, s);
    p.gpu->qk_norm_backward(gd.get(), gdqw.get(), gdkw.get(), gsaved.get(), gqw.get(), gkw.get(),
                            grstd.get(), N, s);
    // As rmsnorm's din: |g| (1 + xhat^2) r with g = d w, the sums over a span of its width; the
    // weight gradients: column sums of N q_spans (or N k_spans) terms |d xhat| in another order.
    const double g_max = max_abs(d) * wmax, width = std::max(s.q_width, s.k_width) / double(D);
    check_within("qk_norm dx", gd.host(), dc,
                 16 * width * kU * (1 + (1 + xhat * xhat) * g_max * max_abs(rstd)));
    const int nq = N * s.q_spans, nk = N * s.k_spans;
    check_within("qk_norm dqw", gdqw.host(), dqw, 2 * nq * kU * nq * max_abs(d) * xhat);
    check_within("qk_norm dkw", gdkw.host(), dkw, 2 * nk * kU * nk * max_abs(d) * xhat);
  }
}

TEST_CASE("cuda cross-entropy over a padded vocabulary equals the unpadded rows", "[cuda]") {
  // Rows ld apart with garbage in the padding columns: the same losses, lse and real columns'
  // gradient as the compact rows (bit for bit: the padding is never read), zero in the padding.
  Pair p;
  const int N = 9, V = 1000, ld = 1024;
  auto logits = random_normal(size_t(N) * V, 30, 3.0f);
  auto padded = random_normal(size_t(N) * ld, 31, 100.0f);
  for (int n = 0; n < N; ++n)
    std::copy(&logits[size_t(n) * V], &logits[size_t(n) * V] + V, &padded[size_t(n) * ld]);
  auto tg = random_tokens(N, V, 32);
  tg[2] = kIgnoreTarget;
  DeviceVec<float> a(*p.gpu, logits), b(*p.gpu, padded), la(*p.gpu, N), lb(*p.gpu, N),
      za(*p.gpu, N), zb(*p.gpu, N);
  DeviceVec<int32_t> gtg(*p.gpu, tg);
  p.gpu->crossentropy_forward(la.get(), za.get(), a.get(), gtg.get(), N, V, V);
  p.gpu->crossentropy_forward(lb.get(), zb.get(), b.get(), gtg.get(), N, V, ld);
  CHECK(la.host() == lb.host());
  CHECK(za.host() == zb.host());
  p.gpu->crossentropy_backward(a.get(), za.get(), gtg.get(), 0.25f, N, V, V);
  p.gpu->crossentropy_backward(b.get(), zb.get(), gtg.get(), 0.25f, N, V, ld);
  const std::vector<float> ga = a.host(), gb = b.host();
  for (int n = 0; n < N; ++n) {
    INFO("row " << n);
    CHECK(std::equal(&ga[size_t(n) * V], &ga[size_t(n) * V] + V, &gb[size_t(n) * ld]));
    CHECK(std::all_of(&gb[size_t(n) * ld + V], &gb[size_t(n) * ld + ld],
                      [](float x) { return x == 0.0f; }));
  }
}

TEST_CASE("cuda cross-entropy in one pass equals its forward then backward", "[cuda]") {
  // The fused kernel's losses, lse and gradient (padding columns included) are the two
  // kernels' bits, on padded rows with an ignored target.
  Pair p;
  const int N = 9, V = 1000, ld = 1024;
  auto padded = random_normal(size_t(N) * ld, 33, 3.0f);
  auto tg = random_tokens(N, V, 34);
  tg[5] = kIgnoreTarget;
  DeviceVec<float> a(*p.gpu, padded), b(*p.gpu, padded), la(*p.gpu, N), lb(*p.gpu, N),
      za(*p.gpu, N), zb(*p.gpu, N);
  DeviceVec<int32_t> gtg(*p.gpu, tg);
  p.gpu->crossentropy_forward(la.get(), za.get(), a.get(), gtg.get(), N, V, ld);
  p.gpu->crossentropy_backward(a.get(), za.get(), gtg.get(), 0.25f, N, V, ld);
  p.gpu->crossentropy_forward_backward(lb.get(), zb.get(), b.get(), gtg.get(), 0.25f, N, V, ld);
  CHECK(la.host() == lb.host());
  CHECK(za.host() == zb.host());
  CHECK(a.host() == b.host());
}

namespace {

// The fused residual + norm on the device against add then the norm on the device, with
// tensors of type T stored as storage type t; res over a (the layer's use) or apart.
template <typename T>
void check_residual_norm(ElemType t, bool rms, bool in_place) {
  INFO(elem_type_name(t) << (rms ? " rmsnorm" : " layernorm") << (in_place ? " in place" : ""));
  Pair p;
  p.gpu->set_storage_type(t);
  const int N = 37, C = 300;  // C not a multiple of the block size
  auto stored = [&](const std::vector<float>& v) {
    std::vector<T> out(v.size());
    if constexpr (sizeof(T) == 4)
      out = v;
    else
      round_to(t, out.data(), v.data(), v.size());
    return out;
  };
  const std::vector<T> a = stored(random_normal(N * C, 51, 3.0f)),
                       b = stored(random_normal(N * C, 52, 0.7f)), w = stored(random_normal(C, 53)),
                       bias = stored(random_normal(C, 54));
  DeviceVec<T> ga(*p.gpu, a), ga2(*p.gpu, a), gb(*p.gpu, b), gw(*p.gpu, w), gbias(*p.gpu, bias),
      res1(*p.gpu, N * C), res2(*p.gpu, N * C), out1(*p.gpu, N * C), out2(*p.gpu, N * C);
  DeviceVec<float> m1(*p.gpu, N), r1(*p.gpu, N), m2(*p.gpu, N), r2(*p.gpu, N);
  p.gpu->add(res1.get(), ga.get(), gb.get(), size_t(N) * C);
  T* res = in_place ? ga2.get() : res2.get();
  if (rms) {
    p.gpu->rmsnorm_forward(out1.get(), r1.get(), res1.get(), gw.get(), 1e-6f, N, C);
    p.gpu->residual_rmsnorm_forward(res, out2.get(), r2.get(), ga2.get(), gb.get(), gw.get(), 1e-6f,
                                    N, C);
  } else {
    p.gpu->layernorm_forward(out1.get(), m1.get(), r1.get(), res1.get(), gw.get(), gbias.get(), N,
                             C);
    p.gpu->residual_layernorm_forward(res, out2.get(), m2.get(), r2.get(), ga2.get(), gb.get(),
                                      gw.get(), gbias.get(), N, C);
    CHECK(m1.host() == m2.host());
  }
  CHECK((in_place ? ga2.host() : res2.host()) == res1.host());
  CHECK(out1.host() == out2.host());
  CHECK(r1.host() == r2.host());
}

}  // namespace

TEST_CASE("cuda residual add and norm in one pass equal add then the norm", "[cuda]") {
  for (bool rms : {false, true})
    for (bool in_place : {false, true}) {
      check_residual_norm<float>(ElemType::kF32, rms, in_place);
      check_residual_norm<uint16_t>(ElemType::kBF16, rms, in_place);
    }
}

TEST_CASE("cuda cross-entropy forward and backward match the CPU", "[cuda]") {
  Pair p;
  const int N = 23, V = 1000;
  auto logits = random_normal(size_t(N) * V, 20, 3.0f);
  auto tg = random_tokens(N, V, 21);
  for (int n = 0; n < N; n += 4) tg[n] = kIgnoreTarget;  // masked positions: loss 0, gradient 0
  std::vector<float> losses(N), lse(N), d = logits;
  p.cpu->crossentropy_forward(losses.data(), lse.data(), logits.data(), tg.data(), N, V, V);
  p.cpu->crossentropy_backward(d.data(), lse.data(), tg.data(), 1.0f / N, N, V, V);
  DeviceVec<float> gl(*p.gpu, logits), glosses(*p.gpu, N), glse(*p.gpu, N);
  DeviceVec<int32_t> gtg(*p.gpu, tg);
  p.gpu->crossentropy_forward(glosses.get(), glse.get(), gl.get(), gtg.get(), N, V, V);
  p.gpu->crossentropy_backward(gl.get(), glse.get(), gtg.get(), 1.0f / N, N, V, V);
  // The exp sum is in double on both sides: lse differs by the last roundings of exp_fast
  // (a few u relative, summed in any order) and of max + log: 8 u of |lse|.
  check_within("cross-entropy lse", glse.host(), lse, 8 * kU * max_abs(lse));
  check_within("cross-entropy losses", glosses.host(), losses,
               8 * kU * (max_abs(lse) + max_abs(logits)));
  // dlogits = exp(l - lse) / N: exp's relative error grows with the error of its argument
  // (8 u |lse|) plus its own ~16 roundings.
  check_within("cross-entropy dlogits", gl.host(), d,
               (8 * kU * max_abs(lse) + 32 * kU) * (1.0 / N));
  std::vector<float> gd = gl.host(), gloss = glosses.host();
  for (int n = 0; n < N; n += 4) {
    INFO("ignored row " << n);
    CHECK(gloss[n] == 0.0f);
    CHECK(std::all_of(gd.begin() + size_t(n) * V, gd.begin() + size_t(n + 1) * V,
                      [](float x) { return x == 0.0f; }));
  }
}
