// Optimizer state in fewer bytes (optimizer.state, optimizer.master): the split master's
// exactness, the int8 grid's error bound, and the packed AdamW's SIMD paths against the
// scalar reference, bit for bit, over tensor boundaries inside blocks, padding, ragged ends and
// edge values. The Python reference (tests/reference/optim_state_ref.py) checks the scalar
// reference itself.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>

#include "fuyou/optim.h"
#include "fuyou/rng.h"
#include "kernels/common/element_math.h"
#include "test_support.h"

using namespace fuyou;

namespace {

std::vector<SimdPath> paths() {
  std::vector<SimdPath> out = {SimdPath::kScalar};
  if (static_cast<int>(best_simd_path()) >= static_cast<int>(SimdPath::kAvx2))
    out.push_back(SimdPath::kAvx2);
  if (best_simd_path() == SimdPath::kAvx512) out.push_back(SimdPath::kAvx512);
  return out;
}

uint32_t bits_of(float f) { return math::f32_bits(f); }

// Magnitudes over 12 decades, both signs, exact zeros, and a few denormals.
std::vector<float> wide(size_t n, uint64_t seed, double lo = -9, double span = 10) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) {
    const uint64_t r = rng.below(40);
    const double mag = std::pow(10.0, lo + span * rng.uniform());
    x = r == 0   ? 0.0f
        : r == 1 ? 1e-40f * static_cast<float>(1 + rng.below(100))
                 : static_cast<float>(mag);
    if (rng.below(2)) x = -x;
  }
  return v;
}

// One group's packed state and its update, for one format.
struct PackedState {
  OptimFormat f;
  size_t n;
  std::vector<float> master32;
  std::vector<int16_t> lo;
  std::vector<uint16_t> hi;
  std::vector<uint8_t> m, v;
  std::vector<float> ms, vs;
  PackedState(OptimFormat fmt, size_t count, const std::vector<float>& init) : f(fmt), n(count) {
    m.assign(moment_elem_bytes(f.moments) * n, 0);
    v.assign(moment_elem_bytes(f.moments) * n, 0);
    ms.assign(state_blocks(n), 0.0f);
    vs.assign(state_blocks(n), 0.0f);
    hi.resize(n);
    if (f.master == MasterFormat::kSplit) {
      lo.resize(n);
      for (size_t i = 0; i < n; ++i) {
        hi[i] = math::split_hi(init[i]);
        lo[i] = math::split_lo(init[i]);
      }
    } else {
      master32 = init;
    }
  }
  PackedAdamWArgs args(const void* grad, ElemType gt) {
    PackedAdamWArgs a;
    a.format = f;
    a.master = f.master == MasterFormat::kSplit ? static_cast<void*>(lo.data()) : master32.data();
    a.m = m.data();
    a.v = v.data();
    a.m_scale = ms.data();
    a.v_scale = vs.data();
    a.grad = grad;
    a.grad_type = gt;
    a.lowp = hi.data();
    a.lowp_type = ElemType::kBF16;
    a.n = n;
    return a;
  }
  bool same_bits(const PackedState& o) const {
    auto eq = [](const auto& x, const auto& y) {
      return x.size() == y.size() &&
             (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0);
    };
    return eq(master32, o.master32) && eq(lo, o.lo) && eq(hi, o.hi) && eq(m, o.m) && eq(v, o.v) &&
           eq(ms, o.ms) && eq(vs, o.vs);
  }
};

const OptimFormat kFormats[] = {
    {MomentFormat::kF32, MasterFormat::kSplit},  {MomentFormat::kBF16, MasterFormat::kF32},
    {MomentFormat::kBF16, MasterFormat::kSplit}, {MomentFormat::kInt8, MasterFormat::kF32},
    {MomentFormat::kInt8, MasterFormat::kSplit},
};

}  // namespace

TEST_CASE("split master: hi and lo give back the fp32 master exactly", "[optim_state]") {
  Rng rng(7);
  std::vector<uint32_t> cases = {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu,
                                 0x7f7fffffu, 0xff7fffffu, 0x7f800000u, 0xff800000u,
                                 0x3f808000u, 0x3f818000u, 0xbf808000u, 0x3f807fffu};
  for (int i = 0; i < 200000; ++i) cases.push_back(static_cast<uint32_t>(rng.next()));
  for (uint32_t u : cases) {
    const float x = math::f32_from_bits(u);
    const uint16_t hi = math::split_hi(x);
    const int16_t lo = math::split_lo(x);
    if (std::isnan(x)) {
      CHECK(std::isnan(math::split_join(hi, lo)));
      CHECK(std::isnan(math::bf16_to_float(hi)));
      continue;
    }
    REQUIRE(bits_of(math::split_join(hi, lo)) == u);
    // The working weight is the nearest bf16 (ties away from zero): within half a bf16 ulp,
    // and equal to nearest-even except on exact ties.
    const uint16_t rne = math::float_to_bf16(x);
    if ((u & 0xffffu) != 0x8000u)
      REQUIRE(hi == rne);
    else
      REQUIRE((hi & 0x7fffu) == (((u & 0x7fffffffu) + 0x8000u) >> 16));
  }
}

TEST_CASE(
    "int8 codes: decoded within one grid step, nearest within half, zero and the maximum exact",
    "[optim_state]") {
  for (bool second : {false, true}) {
    const size_t n = 4 * 256 + 77;
    std::vector<float> x = wide(n, second ? 3 : 4, -12, 12);
    if (second)
      for (auto& e : x) e = e * e;  // v >= 0
    x[5] = 0.0f;
    x[300] = 1e30f;  // one large value in block 1
    std::vector<uint8_t> codes(n);
    std::vector<float> scales(state_blocks(n)), back(n);
    encode_moment(MomentFormat::kInt8, second, x.data(), codes.data(), scales.data(), n);
    decode_moment(MomentFormat::kInt8, second, codes.data(), scales.data(), back.data(), n);
    const float Q = second ? math::kQv : math::kQm;
    for (size_t i = 0; i < n; ++i) {
      const float s = scales[i / 256];
      // Grid points s k^2 / Q^2 for the stored root (v: sqrt v); nearest rounding puts the
      // stored value within half a step of the grid point below or above it: at most
      // s (2k + 1) / (2 Q^2) with k = floor(Q sqrt(a / s)), plus fp32 rounding of the decode
      // (3 operations: 4 u relative, u = 2^-24).
      const float a = second ? std::sqrt(x[i]) : std::fabs(x[i]);
      const float got = second ? std::sqrt(back[i]) : std::fabs(back[i]);
      const double k = std::floor(Q * std::sqrt(static_cast<double>(a) / s));
      const double bound = s * (2 * k + 1) / (2.0 * Q * Q) + 4 * std::ldexp(1.0, -24) * s;
      INFO("element " << i << " value " << x[i] << " scale " << s);
      REQUIRE(std::fabs(static_cast<double>(got) - a) <= bound);
      if (x[i] == 0.0f) REQUIRE(back[i] == 0.0f);
      if (!second && x[i] != 0.0f && back[i] != 0.0f)
        REQUIRE(std::signbit(back[i]) == std::signbit(x[i]));
    }
    // The block's largest magnitude is its scale, and decodes to it within 2 u.
    REQUIRE(scales[1] == (second ? std::sqrt(1e30f) : 1e30f));
  }
}

TEST_CASE("packed AdamW: every SIMD path gives the scalar reference's bits", "[optim_state]") {
  REQUIRE(static_cast<float>(std::sqrt(1.0 - std::pow(static_cast<double>(0.999f), 20000.0))) ==
          1.0f);
  // Tensors with boundaries inside blocks, a padding gap, a ragged last block; decay on some.
  const size_t n = 9 * 256 + 77;
  const std::vector<DecayRange> ranges = {
      {0, 600, true}, {600, 1000, false}, {1024, 2048, true}, {2060, n, true}};
  for (const OptimFormat& f : kFormats) {
    for (ElemType gt : {ElemType::kF32, ElemType::kBF16, ElemType::kF16}) {
      std::vector<PackedState> results;
      for (SimdPath path : paths()) {
        PackedState st(f, n, wide(n, 1, -4, 4));
        // The last step late in a run: there sqrt(1 - beta2^t) is exactly 1 in fp32, which
        // the SIMD paths take as a case of its own.
        for (const int64_t t : {1, 2, 3, 20000}) {
          std::vector<float> g = wide(n, 100 + static_cast<uint64_t>(t), -10, 9);
          if (t == 3)
            g[2100] = gt == ElemType::kF16
                          ? 6e4f
                          : 3e37f;  // a block with one large value (finite in fp16)
          std::vector<uint16_t> g16(n);
          for (size_t i = 0; i < n; ++i)
            g16[i] = gt == ElemType::kBF16 ? math::float_to_bf16(g[i]) : math::float_to_fp16(g[i]);
          PackedAdamWArgs a =
              st.args(gt == ElemType::kF32 ? static_cast<const void*>(g.data()) : g16.data(), gt);
          a.ranges = ranges.data();
          a.nranges = ranges.size();
          a.key = math::round_key(3, t);
          a.grad_scale = 0.75f;
          adamw_update_packed(a, AdamWStep{1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, t}, path);
        }
        results.push_back(std::move(st));
      }
      INFO("moments " << moment_format_name(f.moments) << ", master "
                      << master_format_name(f.master) << ", gradient " << elem_type_name(gt));
      for (size_t p = 1; p < results.size(); ++p) REQUIRE(results[p].same_bits(results[0]));
      // Padding (elements 1000 .. 1023 and 2048 .. 2059) kept its state: zero moments.
      const PackedState& r = results[0];
      std::vector<float> m(n);
      decode_moment(f.moments, false, r.m.data(), r.ms.data(), m.data(), n);
      for (size_t i : {1000, 1023, 2048, 2059}) REQUIRE(m[i] == 0.0f);
      REQUIRE(m[0] != 0.0f);
    }
  }
}

TEST_CASE("int8 encode: the SIMD paths' grid floor near every grid point gives the scalar's codes",
          "[optim_state]") {
  // The SIMD paths find the grid point below y from a reciprocal square root estimate, which
  // lands one below or above the answer for some y just above or below a square; only the two
  // corrections make them the scalar's. With beta1 = beta2 = 0 from zero state, m = g and
  // sqrt(v) = |g| exactly, and a block whose largest value is Q^2 puts g on the grid as is
  // (Q^2 / s = 1): every other element sits at k^2 + d for each grid point k, with d on both
  // sides over the estimates' error (up to about 0.2 k + 2e-4 k^2). Many rounding keys, since a
  // wrong grid point changes a code only when its variate falls in the gap (a few percent).
  std::vector<float> g;
  for (const float Q : {math::kQv, math::kQm}) {
    std::vector<float> vals;
    for (int k = 1; k <= static_cast<int>(Q); ++k) {
      const float z = (0.2f * k + 2e-4f * k * k) / 8, k2 = static_cast<float>(k * k);
      for (int j = -8; j <= 8; ++j) vals.push_back(std::min(k2 + j * z, Q * Q));
      vals.push_back(std::nextafter(k2, 0.0f));
    }
    for (size_t i = 0; i < vals.size(); i += 255) {
      g.push_back(Q * Q);  // the block's scale: Q^2
      for (size_t j = i; j < std::min(vals.size(), i + 255); ++j)
        g.push_back(g.size() % 2 ? vals[j] : -vals[j]);
      while (g.size() % 256) g.push_back(1.0f);
    }
  }
  const size_t n = g.size();
  const DecayRange all{0, n, false};
  const OptimFormat f{MomentFormat::kInt8, MasterFormat::kF32};
  for (uint32_t key = 1; key <= 64; ++key) {
    std::vector<PackedState> results;
    for (SimdPath path : paths()) {
      PackedState st(f, n, std::vector<float>(n, 0.5f));
      PackedAdamWArgs a = st.args(g.data(), ElemType::kF32);
      a.ranges = &all;
      a.nranges = 1;
      a.key = math::round_key(0, key);
      adamw_update_packed(a, AdamWStep{1e-3f, 0.0f, 0.0f, 1e-8f, 0.0f, 1}, path);
      results.push_back(std::move(st));
    }
    for (size_t p = 1; p < results.size(); ++p) {
      INFO("path " << simd_path_name(paths()[p]) << ", key " << key);
      REQUIRE(results[p].same_bits(results[0]));
    }
  }
}

TEST_CASE("packed AdamW: a non-finite gradient makes its int8 block NaN and leaves the others",
          "[optim_state]") {
  const size_t n = 4 * 256;
  const DecayRange all{0, n, false};
  std::vector<PackedState> results;
  for (SimdPath path : paths()) {
    PackedState st({MomentFormat::kInt8, MasterFormat::kSplit}, n, wide(n, 2, -3, 2));
    std::vector<float> g = wide(n, 5, -6, 4);
    g[256 + 9] = std::numeric_limits<float>::infinity();
    PackedAdamWArgs a = st.args(g.data(), ElemType::kF32);
    a.ranges = &all;
    a.nranges = 1;
    a.key = math::round_key(0, 1);
    adamw_update_packed(a, AdamWStep{1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 1}, path);
    INFO(simd_path_name(path));
    REQUIRE(std::isnan(st.ms[1]));
    REQUIRE(std::isnan(st.vs[1]));
    REQUIRE(std::isfinite(st.ms[0]));
    REQUIRE(std::isfinite(st.ms[2]));
    std::vector<float> m(n);
    decode_moment(MomentFormat::kInt8, false, st.m.data(), st.ms.data(), m.data(), n);
    for (size_t i = 256; i < 512; ++i) REQUIRE(std::isnan(m[i]));
    REQUIRE(std::isfinite(m[0]));
    // The NaN master's halves too: every path stores the scalar's (quiet hi, lo 0).
    REQUIRE(std::isnan(math::split_join(st.hi[256 + 9], st.lo[256 + 9])));
    REQUIRE(st.lo[256 + 9] == 0);
    results.push_back(std::move(st));
  }
  for (size_t p = 1; p < results.size(); ++p) REQUIRE(results[p].same_bits(results[0]));
}

TEST_CASE(
    "packed AdamW with fp32 moments and a split master equals fp32 AdamW on the joined master",
    "[optim_state]") {
  // Same arithmetic, the master stored in two halves: the results must agree exactly.
  const size_t n = 3 * 4096 + 17;
  std::vector<float> init = wide(n, 9, -3, 3);
  PackedState st({MomentFormat::kF32, MasterFormat::kSplit}, n, init);
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
  for (size_t i = 0; i < n; ++i) p[i] = math::split_join(st.hi[i], st.lo[i]);
  const DecayRange all{0, n, true};
  for (int t = 1; t <= 3; ++t) {
    std::vector<float> g = wide(n, 20 + t, -8, 8);
    PackedAdamWArgs a = st.args(g.data(), ElemType::kF32);
    a.ranges = &all;
    a.nranges = 1;
    const AdamWStep s{2e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, t};
    adamw_update_packed(a, s);
    AdamWArgs r;
    r.master = p.data();
    r.m = m.data();
    r.v = v.data();
    r.grad = g.data();
    r.n = n;
    adamw_update(r, s);
  }
  std::vector<float> sm(n);
  std::memcpy(sm.data(), st.m.data(), 4 * n);
  for (size_t i = 0; i < n; ++i) {
    REQUIRE(bits_of(math::split_join(st.hi[i], st.lo[i])) == bits_of(p[i]));
    REQUIRE(bits_of(sm[i]) == bits_of(m[i]));
  }
}
