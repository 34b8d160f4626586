// The AdamW kernel: every SIMD path bit-identical to the scalar reference (fp32 state and
// low-precision outputs, for each gradient type), fp16/bf16 rounding against the hardware,
// the gradient statistics pass, and a torch.optim.AdamW fixture to 1e-6 relative.
#include <immintrin.h>

#include <catch2/catch.hpp>
#include <cstring>

#include "fuyou/optim.h"
#include "fuyou/rng.h"
#include "fuyou/safetensors.h"
#include "kernels/common/element_math.h"
#include "test_support.h"

using namespace fuyou;

namespace {

std::vector<SimdPath> supported_paths() {
  std::vector<SimdPath> out = {SimdPath::kScalar};
  if (static_cast<int>(best_simd_path()) >= static_cast<int>(SimdPath::kAvx2))
    out.push_back(SimdPath::kAvx2);
  if (best_simd_path() == SimdPath::kAvx512) out.push_back(SimdPath::kAvx512);
  return out;
}

// Values spanning many magnitudes, both signs, plus exact zeros.
std::vector<float> wide_values(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) {
    double mag = std::pow(10.0, -8 + 10 * rng.uniform());
    x = rng.below(20) == 0 ? 0.0f : static_cast<float>((rng.below(2) ? 1 : -1) * mag);
  }
  return v;
}

__attribute__((target("f16c"))) uint16_t hw_fp16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

}  // namespace

TEST_CASE("AdamW SIMD paths are bit-identical to the scalar reference", "[optim]") {
  const size_t n = 3 * 4096 + 37;  // several work blocks and a ragged tail
  for (ElemType gt : {ElemType::kF32, ElemType::kBF16, ElemType::kF16}) {
    for (ElemType lt : {ElemType::kBF16, ElemType::kF16, ElemType::kF32}) {
      std::vector<std::vector<float>> masters, ms, vs;
      std::vector<std::vector<uint16_t>> lowps;
      std::vector<std::vector<float>> lowp32s;
      for (SimdPath path : supported_paths()) {
        std::vector<float> p = wide_values(n, 1), m(n, 0.0f), v(n, 0.0f);
        std::vector<uint16_t> low16(n);
        std::vector<float> low32(n);
        for (int t = 1; t <= 3; ++t) {
          auto g32 = wide_values(n, 10 + t);
          std::vector<uint16_t> g16(n);
          for (size_t i = 0; i < n; ++i)
            g16[i] =
                gt == ElemType::kBF16 ? math::float_to_bf16(g32[i]) : math::float_to_fp16(g32[i]);
          AdamWArgs a;
          a.master = p.data();
          a.m = m.data();
          a.v = v.data();
          a.grad = gt == ElemType::kF32 ? static_cast<const void*>(g32.data()) : g16.data();
          a.grad_type = gt;
          a.lowp = lt == ElemType::kF32 ? static_cast<void*>(low32.data()) : low16.data();
          a.lowp_type = lt;
          a.n = n;
          a.grad_scale = 0.75f;
          adamw_update(a, {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, t}, path);
        }
        masters.push_back(p);
        ms.push_back(m);
        vs.push_back(v);
        lowps.push_back(low16);
        lowp32s.push_back(low32);
      }
      for (size_t k = 1; k < masters.size(); ++k) {
        INFO("grad " << elem_type_name(gt) << ", lowp " << elem_type_name(lt) << ", path "
                     << simd_path_name(supported_paths()[k]));
        CHECK(std::memcmp(masters[k].data(), masters[0].data(), n * 4) == 0);
        CHECK(std::memcmp(ms[k].data(), ms[0].data(), n * 4) == 0);
        CHECK(std::memcmp(vs[k].data(), vs[0].data(), n * 4) == 0);
        CHECK(std::memcmp(lowps[k].data(), lowps[0].data(), n * 2) == 0);
        CHECK(std::memcmp(lowp32s[k].data(), lowp32s[0].data(), n * 4) == 0);
      }
      // The low-precision copy is the rounded master.
      for (size_t i = 0; i < n; i += 97) {
        float p = masters[0][i];
        if (lt == ElemType::kBF16) CHECK(lowps[0][i] == math::float_to_bf16(p));
        if (lt == ElemType::kF16) CHECK(lowps[0][i] == math::float_to_fp16(p));
      }
    }
  }
  CHECK(supported_paths().size() >= 2);  // this machine has AVX2 and AVX-512
}

TEST_CASE("AdamW over many pieces in one pass equals each piece updated alone", "[optim]") {
  // Pieces as a rows-first embedding update makes them: short rows, some longer than a work
  // block, with and without weight decay, different gradient scales; bf16 gradients and
  // weights out.
  const size_t n = 40000;
  std::vector<std::pair<size_t, size_t>> ranges;
  Rng rng(3);
  for (size_t at = 0; at + 9000 < n;) {
    const size_t len = rng.below(4) == 0 ? 4096 + rng.below(5000) : 1 + rng.below(300);
    ranges.push_back({at, at + len});
    at += len + rng.below(200);
  }
  REQUIRE(ranges.size() > 20);
  const auto g32 = wide_values(n, 7);
  std::vector<uint16_t> g16(n);
  for (size_t i = 0; i < n; ++i) g16[i] = math::float_to_bf16(g32[i]);
  std::vector<float> p[2], m[2], v[2];
  std::vector<uint16_t> low[2];
  for (int way = 0; way < 2; ++way) {
    p[way] = wide_values(n, 1);
    m[way].assign(n, 0.0f);
    v[way].assign(n, 0.0f);
    low[way].assign(n, 0);
    for (int t = 1; t <= 2; ++t) {
      std::vector<AdamWArgs> pieces;
      std::vector<float> decay;
      for (size_t r = 0; r < ranges.size(); ++r) {
        const auto [a, b] = ranges[r];
        AdamWArgs x;
        x.master = p[way].data() + a;
        x.m = m[way].data() + a;
        x.v = v[way].data() + a;
        x.grad = g16.data() + a;
        x.grad_type = ElemType::kBF16;
        x.lowp = low[way].data() + a;
        x.lowp_type = ElemType::kBF16;
        x.n = b - a;
        x.grad_scale = r % 3 ? 1.0f : 0.5f;
        pieces.push_back(x);
        decay.push_back(r % 2 ? 0.1f : 0.0f);
      }
      const AdamWStep step{1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, t};
      if (way == 0) {
        adamw_update(pieces.data(), decay.data(), pieces.size(), step);
      } else {
        for (size_t r = 0; r < pieces.size(); ++r) {
          AdamWStep s = step;
          s.weight_decay = decay[r];
          adamw_update(pieces[r], s);
        }
      }
    }
  }
  CHECK(std::memcmp(p[0].data(), p[1].data(), 4 * n) == 0);
  CHECK(std::memcmp(m[0].data(), m[1].data(), 4 * n) == 0);
  CHECK(std::memcmp(v[0].data(), v[1].data(), 4 * n) == 0);
  CHECK(std::memcmp(low[0].data(), low[1].data(), 2 * n) == 0);
  CHECK(std::memcmp(p[0].data(), wide_values(n, 1).data(), 4 * n) != 0);  // something was updated
}

TEST_CASE("fp16 rounding matches the F16C hardware conversion bit for bit", "[optim]") {
  INFO("this test compares against the F16C instruction, which this CPU must have");
  REQUIRE(__builtin_cpu_supports("f16c"));
  // Every exponent with edge mantissas, then a large random sample of bit patterns.
  uint64_t checked = 0, mismatches = 0;
  auto check = [&](uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, 4);
    uint16_t sw = math::float_to_fp16(f), hw = hw_fp16(f);
    ++checked;
    if (sw != hw && ++mismatches <= 5)
      FAIL_CHECK("bits 0x" << std::hex << bits << ": software 0x" << sw << ", hardware 0x" << hw);
  };
  for (uint32_t sign : {0u, 0x80000000u})
    for (uint32_t e = 0; e < 256; ++e)
      for (uint32_t mant :
           {0u, 1u, 0xfffu, 0x1000u, 0x1001u, 0x2000u, 0x3000u, 0x7fffffu, 0x400000u, 0x401000u})
        check(sign | e << 23 | mant);
  Rng rng(5);
  for (int i = 0; i < 2000000; ++i) check(static_cast<uint32_t>(rng.next()));
  // Around the subnormal range, densely.
  for (uint32_t bits = 0x33000000u; bits < 0x38900000u; bits += 257) check(bits);
  CHECK(mismatches == 0);
  // And the way back is exact for every half.
  for (uint32_t h = 0; h < 65536; ++h) {
    if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu)) continue;  // NaN payloads
    if (math::float_to_fp16(math::fp16_to_float(static_cast<uint16_t>(h))) != h)
      FAIL("fp16 round trip of 0x" << std::hex << h);
  }
  INFO(checked << " conversions checked");
}

TEST_CASE("gradient statistics: sum of squares and non-finite count", "[optim]") {
  const size_t n = 100003;
  auto g = wide_values(n, 3);
  g[17] = NAN;
  g[5000] = INFINITY;
  g[n - 1] = -INFINITY;
  double ref = 0;
  for (float x : g)
    if (std::isfinite(x)) ref += double(x) * x;
  for (SimdPath path : supported_paths()) {
    GradStats s = grad_stats(g.data(), ElemType::kF32, n, path);
    CHECK(s.nonfinite == 3);
    // Summation order differs between paths; in double, n terms differ by at most n * eps.
    CHECK(std::fabs(s.sum_squares - ref) <= ref * n * std::numeric_limits<double>::epsilon());
  }
  std::vector<uint16_t> h(n);
  for (size_t i = 0; i < n; ++i) h[i] = math::float_to_bf16(g[i]);
  CHECK(grad_stats(h.data(), ElemType::kBF16, n).nonfinite == 3);
}

TEST_CASE("AdamW matches torch.optim.AdamW to 1e-6 relative", "[optim][reference]") {
  SafetensorsReader f(test::source_path("tests/reference/fixtures/adamw/adamw.safetensors"));
  auto pd = f.read_f32("init.decay"), pp = f.read_f32("init.plain");
  auto grads = f.read_f32("grads"), lrs = f.read_f32("lrs");
  const size_t nd = pd.size(), np = pp.size(), n = nd + np;
  std::vector<float> md(nd), vd(nd), mp(np), vp(np);
  for (size_t s = 0; s < lrs.size(); ++s) {
    const float* g = grads.data() + s * n;
    adamw_update(pd.data(), md.data(), vd.data(), g, nd,
                 {lrs[s], 0.9f, 0.95f, 1e-8f, 0.1f, int64_t(s + 1)});
    adamw_update(pp.data(), mp.data(), vp.data(), g + nd, np,
                 {lrs[s], 0.9f, 0.95f, 1e-8f, 0.0f, int64_t(s + 1)});
  }
  CHECK(test::rel_error(pd.data(), f.read_f32("final.decay").data(), nd) < 1e-6);
  CHECK(test::rel_error(pp.data(), f.read_f32("final.plain").data(), np) < 1e-6);
  CHECK(test::rel_error(md.data(), f.read_f32("m.decay").data(), nd) < 1e-6);
  CHECK(test::rel_error(mp.data(), f.read_f32("m.plain").data(), np) < 1e-6);
  CHECK(test::rel_error(vd.data(), f.read_f32("v.decay").data(), nd) < 1e-6);
  CHECK(test::rel_error(vp.data(), f.read_f32("v.plain").data(), np) < 1e-6);
}
