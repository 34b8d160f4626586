// 16-bit device tensors on the CUDA backend (runtime.device_tensors: bf16 / fp16).
//
// Every kernel is one template on the storage type (kernels/cuda/cuda_util.cuh): loads
// widen to fp32, the arithmetic is the fp32 instantiation's, each store rounds once. So:
// - the element-wise and row kernels on 16-bit tensors equal the same GPU's fp32 kernel on
//   the same values, rounded once, bit for bit (a kernel that read a tensor as the wrong
//   type, indexed it with the wrong element size or treated an accumulator as an output
//   fails here), and their fp32 statistics (mean, rstd, lse, losses) are equal;
// - the embedding gradient sums each row in fp32 in position order and adds it to the
//   stored row once, as the CPU backend's 16-bit kernel does: equal to the CPU's, bit for bit;
// - the GEMMs (cuBLAS on 16-bit operands, fp32 accumulation) and attention (widened per head)
//   sum in another order than the CPU: within the fp32 bound of tests/cuda/test_cuda_kernels.cc
//   plus one 16-bit rounding of either side, |round(a) - round(b)| <= |a - b| + u16 (|a| + |b|).
#include <catch2/catch.hpp>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <tuple>

#include "cuda_test_support.h"
#include "fuyou/cuda.h"
#include "fuyou/error.h"
#include "fuyou/model.h"
#include "fuyou/rng.h"
#include "kernels/common/element_math.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/storage_values.h"

using namespace fuyou;
using test::abs_products;
using test::max_abs;
using test::random_tokens;
using test::rnd16;
using test::transpose;
using test::unit_roundoff;
using test::wid16;

namespace {

constexpr double kU = FLT_EPSILON / 2;  // fp32 unit roundoff
constexpr uint64_t kArena = 256ull << 20;

// One tensor in both forms: random 16-bit values and the same values in fp32.
struct Tensor {
  std::vector<uint16_t> h;
  std::vector<float> f;
  Tensor(ElemType t, size_t n, uint64_t seed, float scale = 1.0f) : h(n), f(n) {
    Rng rng(seed);
    for (size_t i = 0; i < n; ++i) {
      h[i] = rnd16(t, scale * rng.normal());
      f[i] = wid16(t, h[i]);
    }
  }
  struct Fill {
    float value;
  };
  Tensor(ElemType t, size_t n, Fill x)
      : h(n, rnd16(t, x.value)), f(n, wid16(t, rnd16(t, x.value))) {}
  size_t size() const { return f.size(); }
};

// Device copies of the 16-bit (or fp32) values of some tensors and of some fp32 vectors.
struct Uploaded {
  Backend& be;
  std::vector<void*> t;
  std::vector<float*> s;
  Uploaded(Backend& b, const std::vector<Tensor*>& ts, const std::vector<std::vector<float>>& stats,
           bool wide)
      : be(b) {
    for (Tensor* x : ts) {
      const size_t bytes = x->size() * (wide ? 4 : 2);
      t.push_back(be.alloc(bytes, "test tensor"));
      be.copy_to_device(t.back(), wide ? static_cast<const void*>(x->f.data()) : x->h.data(),
                        bytes);
    }
    for (const auto& v : stats) {
      s.push_back(static_cast<float*>(be.alloc(4 * v.size(), "test stat")));
      be.copy_to_device(s.back(), v.data(), 4 * v.size());
    }
  }
  ~Uploaded() {
    for (void* p : t) be.free(p);
    for (float* p : s) be.free(p);
  }
};

using Call = std::function<void(Backend&, const std::vector<void*>&, const std::vector<float*>&)>;

// Runs `call` on the GPU with fp32 tensors and with 16-bit tensors holding the same values;
// every tensor's 16-bit result must be its fp32 result rounded once, and every fp32 vector
// (statistics) the same, bit for bit. `stats` gives the fp32 vectors' initial contents.
void check_rounded_once(const char* what, ElemType t, const std::vector<Tensor*>& ts,
                        const std::vector<std::vector<float>>& stats, const Call& call) {
  INFO("kernel " << what << " on " << elem_type_name(t) << " tensors");
  auto g32 = make_cuda_backend(0, kArena);
  auto g16 = make_cuda_backend(0, kArena);
  g16->set_storage_type(t);
  REQUIRE(g16->storage_type() == t);
  Uploaded u32(*g32, ts, stats, true), u16(*g16, ts, stats, false);
  call(*g32, u32.t, u32.s);
  call(*g16, u16.t, u16.s);
  for (size_t k = 0; k < ts.size(); ++k) {
    const size_t n = ts[k]->size();
    std::vector<float> r32(n);
    std::vector<uint16_t> r16(n);
    g32->copy_to_host(r32.data(), u32.t[k], 4 * n);
    g16->copy_to_host(r16.data(), u16.t[k], 2 * n);
    size_t mismatches = 0, first = n;
    for (size_t i = 0; i < n; ++i)
      if (rnd16(t, r32[i]) != r16[i]) {
        ++mismatches;
        if (first == n) first = i;
      }
    INFO("tensor " << k << ": " << mismatches << " of " << n
                   << " differ from the fp32 result rounded once"
                   << (first < n ? fuyou::str("; first at ", first, ": fp32 ", r32[first],
                                              " 16-bit ", wid16(t, r16[first]))
                                 : std::string()));
    CHECK(mismatches == 0);
  }
  for (size_t k = 0; k < stats.size(); ++k) {
    const size_t n = stats[k].size();
    std::vector<float> a(n), b(n);
    g32->copy_to_host(a.data(), u32.s[k], 4 * n);
    g16->copy_to_host(b.data(), u16.s[k], 4 * n);
    INFO("fp32 vector " << k);
    CHECK(std::memcmp(a.data(), b.data(), 4 * n) == 0);
  }
}

// The 16-bit results of `call` on the CPU backend and on the GPU, both storing `t`, widened.
struct CpuGpu {
  std::vector<std::vector<float>> cpu, gpu;            // per tensor
  std::vector<std::vector<float>> cpu_stat, gpu_stat;  // per fp32 vector
};

CpuGpu run_cpu_gpu(ElemType t, const std::vector<Tensor*>& ts,
                   const std::vector<std::vector<float>>& stats, const Call& call) {
  auto cpu = make_cpu_backend(2, 0);
  auto gpu = make_cuda_backend(0, kArena);
  cpu->set_storage_type(t);
  gpu->set_storage_type(t);
  const bool wide = t == ElemType::kF32;  // fp32 tensors: the fp32 values of each Tensor
  Uploaded uc(*cpu, ts, stats, wide), ug(*gpu, ts, stats, wide);
  call(*cpu, uc.t, uc.s);
  call(*gpu, ug.t, ug.s);
  CpuGpu r;
  for (size_t k = 0; k < ts.size(); ++k) {
    const size_t n = ts[k]->size(), es = elem_type_size(t);
    std::vector<char> hc(n * es), hg(n * es);
    cpu->copy_to_host(hc.data(), uc.t[k], es * n);
    gpu->copy_to_host(hg.data(), ug.t[k], es * n);
    std::vector<float> fc(n), fg(n);
    widen_from(t, fc.data(), hc.data(), n);
    widen_from(t, fg.data(), hg.data(), n);
    r.cpu.push_back(std::move(fc));
    r.gpu.push_back(std::move(fg));
  }
  for (size_t k = 0; k < stats.size(); ++k) {
    std::vector<float> a(stats[k].size()), b(stats[k].size());
    cpu->copy_to_host(a.data(), uc.s[k], 4 * a.size());
    gpu->copy_to_host(b.data(), ug.s[k], 4 * b.size());
    r.cpu_stat.push_back(std::move(a));
    r.gpu_stat.push_back(std::move(b));
  }
  return r;
}

// |gpu_i - cpu_i| <= fp32_i + u16 (|gpu_i| + |cpu_i|) (1 + 2 u16): the two fp32 results differ
// by at most fp32_i, and each was rounded once to 16 bits (relative error u16 of the
// unrounded value, whose size is within (1 + u16) of the rounded one's).
void check_rounded_pair(const std::string& what, ElemType t, const std::vector<float>& got,
                        const std::vector<float>& ref, const std::vector<double>& fp32) {
  const double u = unit_roundoff(t);
  std::vector<double> bound(ref.size());
  for (size_t i = 0; i < ref.size(); ++i)
    bound[i] =
        fp32[i] + u * (std::fabs(double(got[i])) + std::fabs(double(ref[i]))) * (1 + 2 * u) + 1e-30;
  test::check_within_each(what, got, ref, bound);
}

template <class T>
T* P(const std::vector<void*>& v, size_t i) {
  return static_cast<T*>(v[i]);
}

}  // namespace

TEST_CASE("cuda 16-bit tensors: element-wise and row kernels are the fp32 kernels rounded once",
          "[cuda][lowp]") {
  const ElemType t = GENERATE(ElemType::kBF16, ElemType::kF16);
  const int N = 37, C = 300, V = 11, B = 3, T = 17;
  {
    Tensor x(t, N * C, 1, 3.0f), w(t, C, 2), b(t, C, 3), dy(t, N * C, 4),
        out(t, N * C, Tensor::Fill{0.0f}), din(t, N * C, Tensor::Fill{1.0f}),
        dw(t, C, Tensor::Fill{0.5f}), db(t, C, Tensor::Fill{0.25f});
    check_rounded_once(
        "layernorm", t, {&x, &w, &b, &dy, &out, &din, &dw, &db},
        {std::vector<float>(N), std::vector<float>(N)}, [&](Backend& be, auto& p, auto& s) {
          be.layernorm_forward(p[4], s[0], s[1], p[0], p[1], p[2], N, C);
          be.layernorm_backward(p[5], p[6], p[7], p[3], p[0], p[1], s[0], s[1], N, C);
        });
    check_rounded_once("rmsnorm", t, {&x, &w, &dy, &out, &din, &dw}, {std::vector<float>(N)},
                       [&](Backend& be, auto& p, auto& s) {
                         be.rmsnorm_forward(p[3], s[0], p[0], p[1], 1e-6f, N, C);
                         be.rmsnorm_backward(p[4], p[5], p[2], p[0], p[1], s[0], N, C);
                       });
  }
  {
    // A row of whole 16-byte vectors (C a multiple of 8): the vector loads' path.
    const int Cv = 256;
    Tensor x(t, N * Cv, 1, 3.0f), w(t, Cv, 2), dy(t, N * Cv, 4), out(t, N * Cv, Tensor::Fill{0.0f}),
        din(t, N * Cv, Tensor::Fill{1.0f}), dw(t, Cv, Tensor::Fill{0.5f});
    check_rounded_once("rmsnorm, vector rows", t, {&x, &w, &dy, &out, &din, &dw},
                       {std::vector<float>(N)}, [&](Backend& be, auto& p, auto& s) {
                         be.rmsnorm_forward(p[3], s[0], p[0], p[1], 1e-6f, N, Cv);
                         be.rmsnorm_backward(p[4], p[5], p[2], p[0], p[1], s[0], N, Cv);
                       });
  }
  {
    const size_t n = 100003;
    Tensor a(t, n, 5, 3.0f), g(t, n, 6), o(t, n, Tensor::Fill{0.0f});
    for (const char* k : {"gelu", "gelu_backward", "add", "relu", "relu_backward"})
      check_rounded_once(k, t, {&a, &g, &o}, {}, [&](Backend& be, auto& p, auto&) {
        const std::string name = k;
        if (name == "gelu") be.gelu_forward(p[2], p[0], n);
        if (name == "gelu_backward") be.gelu_backward(p[2], p[0], p[1], n);
        if (name == "add") be.add(p[2], p[0], p[1], n);
        if (name == "relu") be.relu_forward(p[2], p[0], n);
        if (name == "relu_backward") be.relu_backward(p[2], p[0], p[1], n);
      });
  }
  {
    const int Bq = 2, Tq = 9, Hq = 6, Hkv = 2, D = 16, Nq = Bq * Tq, F = 50;
    const size_t row = size_t(Hq + 2 * Hkv) * D, C3 = size_t(3) * Hq * D;
    Tensor qkvc(t, Nq * row, 7), qkv(t, Nq * C3, Tensor::Fill{0.0f}), dqkv(t, Nq * C3, 8),
        dqkvc(t, Nq * row, Tensor::Fill{0.0f});
    // One kernel per check: two kernels in a row round twice on 16-bit tensors, once in fp32.
    check_rounded_once("rope forward", t, {&qkvc}, {}, [&](Backend& be, auto& p, auto&) {
      be.rope_forward(p[0], Bq, Tq, Hq, Hkv, D, default_rope_table(D, 10000.0f), nullptr);
    });
    check_rounded_once("rope backward", t, {&qkvc}, {}, [&](Backend& be, auto& p, auto&) {
      be.rope_backward(p[0], Bq, Tq, Hq, Hkv, D, default_rope_table(D, 10000.0f), nullptr);
    });
    check_rounded_once("repeat_kv forward", t, {&qkvc, &qkv}, {}, [&](Backend& be, auto& p, auto&) {
      be.repeat_kv_forward(p[1], p[0], Nq, Hq, Hkv, D);
    });
    check_rounded_once(
        "repeat_kv backward", t, {&dqkv, &dqkvc}, {},
        [&](Backend& be, auto& p, auto&) { be.repeat_kv_backward(p[1], p[0], Nq, Hq, Hkv, D); });
    // F = 50: element by element; 64: 16-byte vectors.
    for (const int Fs : {F, 64}) {
      INFO("swiglu F " << Fs);
      Tensor gu(t, size_t(Nq) * 2 * Fs, 9, 2.0f), sdy(t, size_t(Nq) * Fs, 10),
          sout(t, size_t(Nq) * Fs, Tensor::Fill{0.0f}), dgu(t, gu.size(), Tensor::Fill{0.0f});
      check_rounded_once("swiglu", t, {&gu, &sdy, &sout, &dgu}, {},
                         [&](Backend& be, auto& p, auto&) {
                           be.swiglu_forward(p[2], p[0], Nq, Fs);
                           be.swiglu_backward(p[3], p[0], p[1], Nq, Fs);
                         });
    }
  }
  {
    const int Nc = 23, Vc = 1000;
    Tensor logits(t, size_t(Nc) * Vc, 11, 3.0f);
    auto tg = random_tokens(Nc, Vc, 12);
    for (int i = 0; i < Nc; i += 4) tg[i] = kIgnoreTarget;
    check_rounded_once("cross-entropy", t, {&logits},
                       {std::vector<float>(Nc), std::vector<float>(Nc)},
                       [&](Backend& be, auto& p, auto& s) {
                         test::DeviceVec<int32_t> gtg(be, tg);
                         be.crossentropy_forward(s[0], s[1], p[0], gtg.get(), Nc, Vc, Vc);
                         be.crossentropy_backward(p[0], s[1], gtg.get(), 1.0f / Nc, Nc, Vc, Vc);
                       });
  }
  {
    Tensor wte(t, V * C, 13), wpe(t, T * C, 14), out(t, size_t(B) * T * C, Tensor::Fill{0.0f});
    auto tok = random_tokens(B * T, V, 15);
    check_rounded_once("embedding forward", t, {&wte, &wpe, &out}, {},
                       [&](Backend& be, auto& p, auto&) {
                         test::DeviceVec<int32_t> g(be, tok);
                         be.embedding_forward(p[2], g.get(), p[0], p[1], B, T, C);
                       });
  }
}

TEST_CASE("cuda embedding gradient equals the CPU's, bit for bit, in every storage type",
          "[cuda][lowp]") {
  const ElemType t = GENERATE(ElemType::kF32, ElemType::kBF16, ElemType::kF16);
  // Small, and 1000 positions over 7 tokens: the token ranks span four 256-token tiles with
  // ties across them (not a multiple of the block), and more positions than the kernel's
  // 512 row blocks, so its strided loop over runs turns.
  struct Shape {
    int B, T, C, V;
  };
  for (Shape sh : {Shape{3, 17, 40, 11}, Shape{4, 250, 40, 7}}) {
    Tensor dout(t, size_t(sh.B) * sh.T * sh.C, 16),
        dwte(t, size_t(sh.V) * sh.C, Tensor::Fill{0.5f}),
        dwpe(t, size_t(sh.T) * sh.C, Tensor::Fill{0.25f});
    auto tok = random_tokens(size_t(sh.B) * sh.T, sh.V, 17);
    for (bool with_pos : {true, false}) {
      INFO("B " << sh.B << ", T " << sh.T << ", position table " << with_pos << ", "
                << elem_type_name(t));
      CpuGpu r = run_cpu_gpu(t, {&dout, &dwte, &dwpe}, {}, [&](Backend& be, auto& p, auto&) {
        test::DeviceVec<int32_t> g(be, tok);
        be.embedding_backward(p[1], with_pos ? p[2] : nullptr, p[0], g.get(), sh.B, sh.T, sh.C);
      });
      test::check_within("dwte", r.gpu[1], r.cpu[1], 0.0);
      test::check_within("dwpe", r.gpu[2], r.cpu[2], 0.0);
    }
  }
}

TEST_CASE("cuda 16-bit tensors: GEMMs on 16-bit operands match the CPU", "[cuda][lowp]") {
  const ElemType t = GENERATE(ElemType::kBF16, ElemType::kF16);
  // Odd sizes (the forward's bias by the broadcast kernel where cuBLASLt has no algorithm for
  // unaligned rows), and sizes of whole 16-byte rows, where with runtime.gemm_bias epilogue the
  // bias goes into cuBLASLt's epilogue (kernels/cuda/lt_bias_gemm.cu).
  const std::tuple<int, int, int> shape =
      GENERATE(std::tuple<int, int, int>{45, 130, 70}, std::tuple<int, int, int>{64, 128, 192});
  const bool epilogue = GENERATE(false, true);
  const int N = std::get<0>(shape), IC = std::get<1>(shape), OC = std::get<2>(shape);
  INFO("N " << N << ", IC " << IC << ", OC " << OC << (epilogue ? ", bias epilogue" : ""));
  uint64_t epilogues = 0;
  Tensor x(t, N * IC, 18), w(t, OC * IC, 19), bias(t, OC, 20), dy(t, N * OC, 21),
      out(t, N * OC, Tensor::Fill{0.0f}), din(t, N * IC, Tensor::Fill{0.0f}),
      dw(t, OC * IC, Tensor::Fill{0.5f}), dbias(t, OC, Tensor::Fill{0.25f});
  CpuGpu r = run_cpu_gpu(t, {&x, &w, &bias, &dy, &out, &din, &dw, &dbias}, {},
                         [&](Backend& be, auto& p, auto&) {
                           auto* cuda = dynamic_cast<cuda::CudaBackend*>(&be);
                           if (cuda) cuda->set_bias_epilogue(epilogue);
                           be.matmul_forward(p[4], p[0], p[1], p[2], N, IC, OC);
                           be.matmul_backward(p[5], p[6], p[7], p[3], p[0], p[1], N, IC, OC);
                           if (cuda) epilogues = cuda->bias_epilogues();
                         });
  // The bias goes through the epilogue only when asked, and the aligned shape's does (the
  // arena's 64-byte aligned buffers; a cuBLASLt without an algorithm for it fails here, not
  // quietly). Whether cuBLASLt takes the odd shape is its heuristic's choice.
  if (!epilogue) CHECK(epilogues == 0);
  if (epilogue && OC % 8 == 0 && IC % 8 == 0) CHECK(epilogues == 1);
  // The 16-bit operands multiply exactly in fp32; the fp32 sums of K terms in two orders
  // differ by at most 2 gamma_K (|A||B|)_ij, plus one rounding of an added bias or stored
  // gradient (K + 1 terms).
  auto fp32 = [&](const std::vector<double>& ab, int K, double extra) {
    std::vector<double> b(ab.size());
    for (size_t i = 0; i < ab.size(); ++i) b[i] = 2 * (K + 1) * kU * (ab[i] + extra);
    return b;
  };
  INFO(elem_type_name(t));
  check_rounded_pair("matmul out", t, r.gpu[4], r.cpu[4],
                     fp32(abs_products(x.f, w.f, N, OC, IC), IC, max_abs(bias.f)));
  check_rounded_pair("matmul din", t, r.gpu[5], r.cpu[5],
                     fp32(abs_products(dy.f, transpose(w.f, OC, IC), N, IC, OC), OC, 0));
  check_rounded_pair(
      "matmul dw", t, r.gpu[6], r.cpu[6],
      fp32(abs_products(transpose(dy.f, N, OC), transpose(x.f, N, IC), OC, IC, N), N, 0.5));
  check_rounded_pair("matmul dbias", t, r.gpu[7], r.cpu[7],
                     std::vector<double>(OC, 2 * (N + 1) * kU * (N * max_abs(dy.f) + 0.25)));
}

TEST_CASE("cuda 16-bit tensors: attention matches the CPU", "[cuda][lowp]") {
  const ElemType t = GENERATE(ElemType::kBF16, ElemType::kF16);
  const int B = 2, T = 19, C = 48, H = 4, hd = C / H;
  Tensor qkv(t, size_t(B) * T * 3 * C, 22), dout(t, size_t(B) * T * C, 23),
      out(t, size_t(B) * T * C, Tensor::Fill{0.0f}), dqkv(t, qkv.size(), Tensor::Fill{0.0f});
  CpuGpu r = run_cpu_gpu(
      t, {&qkv, &dout, &out, &dqkv}, {std::vector<float>(B * H * T), std::vector<float>(2 * T * T)},
      [&](Backend& be, auto& p, auto& s) {
        be.attention_forward(p[2], s[0], s[1], p[0], B, T, C, H, nullptr);
        be.attention_backward(p[3], s[1], p[1], p[2], p[0], s[0], B, T, C, H, nullptr);
      });
  // The fp32 bounds of the fp32 attention test (test_cuda_kernels.cc): both sides compute in
  // fp32 from the same widened values and round the outputs once.
  const double score_err =
      2 * (hd + 1) * kU * hd * max_abs(qkv.f) * max_abs(qkv.f) / std::sqrt(double(hd));
  const double p_rel = score_err + (2 * T + 8) * kU;
  INFO(elem_type_name(t));
  test::check_within("attention log-sum-exp", r.gpu_stat[0], r.cpu_stat[0], 2 * p_rel);
  check_rounded_pair(
      "attention out", t, r.gpu[2], r.cpu[2],
      std::vector<double>(out.size(), (2 * p_rel + 2 * (T + 1) * kU) * max_abs(qkv.f)));
  const double scale = max_abs(dout.f) * max_abs(qkv.f) * max_abs(qkv.f) * T;
  check_rounded_pair("attention dqkv", t, r.gpu[3], r.cpu[3],
                     std::vector<double>(qkv.size(), 4 * (p_rel + 2 * (T + hd + 2) * kU) * scale));
}
