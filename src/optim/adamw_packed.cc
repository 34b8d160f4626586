// AdamW over packed optimizer state (optimizer.state bf16 / int8, optimizer.master split): the
// formats' sizes, the scalar reference block, the dispatch over blocks and threads, and the
// conversions between a moment's format and fp32.
//
// Work goes in items of kItemBlocks int8-sized blocks, each block whole in one item, so every
// path sees the same blocks; threads claim kClaimItems items at a time. A block inside one tensor
// (every element updated, one weight decay) runs on the widest SIMD path; a block holding a tensor
// boundary or padding runs on the scalar reference, which gives the same bits.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "fuyou/error.h"
#include "fuyou/optim.h"
#include "src/optim/adamw_kernels.h"
#include "src/optim/adamw_packed_kernels.h"

namespace fuyou {

const char* moment_format_name(MomentFormat f) {
  switch (f) {
    case MomentFormat::kF32:
      return "fp32";
    case MomentFormat::kBF16:
      return "bf16";
    case MomentFormat::kInt8:
      return "int8";
  }
  return "?";
}

const char* master_format_name(MasterFormat f) {
  switch (f) {
    case MasterFormat::kF32:
      return "fp32";
    case MasterFormat::kSplit:
      return "split";
  }
  return "?";
}

std::string optim_format_name(const OptimFormat& f) {
  return std::string(moment_format_name(f.moments)) + "/" + master_format_name(f.master);
}

size_t moment_elem_bytes(MomentFormat f) {
  switch (f) {
    case MomentFormat::kF32:
      return 4;
    case MomentFormat::kBF16:
      return 2;
    case MomentFormat::kInt8:
      return 1;
  }
  return 4;
}

size_t master_elem_bytes(MasterFormat f) { return f == MasterFormat::kSplit ? 2 : 4; }

uint64_t moment_bytes(MomentFormat f, uint64_t n) {
  return moment_elem_bytes(f) * n + (f == MomentFormat::kInt8 ? 4 * state_blocks(n) : 0);
}

uint64_t optim_state_bytes(const OptimFormat& f, uint64_t n) {
  return master_elem_bytes(f.master) * n + 2 * moment_bytes(f.moments, n);
}

namespace optim_detail {
namespace {

constexpr size_t B = kStateBlock;

float load_moment(MomentFormat f, const void* data, const float* scales, size_t i, bool second) {
  switch (f) {
    case MomentFormat::kF32:
      return static_cast<const float*>(data)[i];
    case MomentFormat::kBF16:
      return math::bf16_to_float(static_cast<const uint16_t*>(data)[i]);
    case MomentFormat::kInt8: {
      const float s = scales[i / B];
      if (second) {  // sqrt(v)
        const int32_t q = static_cast<const uint8_t*>(data)[i];
        return math::code_decode(q * q, s, kInvQv2);
      }
      const int32_t q = static_cast<const int8_t*>(data)[i];
      return math::code_decode(q * (q < 0 ? -q : q), s, kInvQm2);
    }
  }
  return 0;
}

// Encodes values [0, nb) of one block into codes at element b0 (int8: and its scale), with
// rounding variates from `key` (nullptr-free: u == 0.5 everywhere when `nearest`).
void store_moments(MomentFormat f, bool second, const float* x, void* data, float* scales,
                   size_t b0, size_t nb, uint64_t first, uint32_t key, bool nearest) {
  switch (f) {
    case MomentFormat::kF32:
      std::copy(x, x + nb, static_cast<float*>(data) + b0);
      return;
    case MomentFormat::kBF16:
      for (size_t j = 0; j < nb; ++j) {
        const uint32_t bits =
            nearest ? 0x8000u : math::round_bits(key, static_cast<uint32_t>(first + b0 + j));
        // Nearest with ties up in magnitude: adding half an ulp; the update uses the variates.
        static_cast<uint16_t*>(data)[b0 + j] = math::bf16_round_stochastic(x[j], bits);
      }
      return;
    case MomentFormat::kInt8: {
      float smax = 0.0f;
      bool bad = false;
      for (size_t j = 0; j < nb; ++j) {
        const float a = std::fabs(x[j]);
        if (!(a < std::numeric_limits<float>::infinity()))
          bad = true;
        else
          smax = a > smax ? a : smax;
      }
      const float s = bad ? std::numeric_limits<float>::quiet_NaN() : smax;
      scales[b0 / B] = s;
      const float Q = second ? math::kQv : math::kQm, inv = (Q * Q) / s;
      for (size_t j = 0; j < nb; ++j) {
        int32_t q = 0;
        if (!bad && smax > 0.0f) {
          const float u = nearest ? 0.5f
                                  : math::round_uniform(math::round_bits(
                                        key, static_cast<uint32_t>(first + b0 + j)));
          q = math::code_encode(math::grid_position(std::fabs(x[j]), s, inv, Q), Q, u);
        }
        if (second)
          static_cast<uint8_t*>(data)[b0 + j] = static_cast<uint8_t>(q);
        else
          static_cast<int8_t*>(data)[b0 + j] = static_cast<int8_t>(x[j] < 0.0f ? -q : q);
      }
      return;
    }
  }
}

}  // namespace

void packed_block_scalar(const PackedAdamWArgs& a, const PackedConsts& c, size_t b0, size_t nb,
                         const uint8_t* upd) {
  const OptimFormat f = a.format;
  const bool int8 = f.moments == MomentFormat::kInt8, split = f.master == MasterFormat::kSplit;
  float mv[B], wv[B];  // the block's new m, and v (int8: sqrt(v))
  for (size_t j = 0; j < nb; ++j) {
    const size_t i = b0 + j;
    float m = load_moment(f.moments, a.m, a.m_scale, i, false);
    float w = load_moment(f.moments, a.v, a.v_scale, i, true);
    float v = int8 ? w * w : w;
    if (upd[j]) {
      math::AdamWConsts k = c.k;
      k.decay = upd[j] == 2 ? c.decay_on : c.decay_off;
      uint16_t* hi = static_cast<uint16_t*>(a.lowp);
      int16_t* lo = static_cast<int16_t*>(a.master);
      float p = split ? math::split_join(hi[i], lo[i]) : static_cast<float*>(a.master)[i];
      math::adamw_element_w(p, m, v, w, load_grad(a.grad, a.grad_type, i), k);
      if (split) {
        hi[i] = math::split_hi(p);
        lo[i] = math::split_lo(p);
      } else {
        static_cast<float*>(a.master)[i] = p;
        if (a.lowp) store_lowp(a.lowp, a.lowp_type, i, p);
      }
    }
    mv[j] = m;
    wv[j] = int8 ? w : v;
  }
  store_moments(f.moments, false, mv, a.m, a.m_scale, b0, nb, a.first, c.key_m, false);
  store_moments(f.moments, true, wv, a.v, a.v_scale, b0, nb, a.first, c.key_v, false);
}

}  // namespace optim_detail

using namespace optim_detail;

void adamw_update_packed(const PackedAdamWArgs& a, const AdamWStep& s, SimdPath path) {
  FY_CHECK(s.t >= 1, "AdamW step count starts at 1, got ", s.t);
  FY_CHECK(a.format.moments != MomentFormat::kInt8 || a.first % B == 0,
           "an int8 update starts at a multiple of ", B, " elements, not ", a.first);
  FY_CHECK(a.first + a.n <= (uint64_t{1} << 32), "a parameter group of more than 2^32 elements");
  FY_CHECK(a.master && a.m && a.v && a.grad, "packed AdamW needs master, moments and gradient");
  FY_CHECK(a.format.moments != MomentFormat::kInt8 || (a.m_scale && a.v_scale),
           "int8 moments need their scales");
  FY_CHECK(a.format.master != MasterFormat::kSplit || (a.lowp && a.lowp_type == ElemType::kBF16),
           "a split master needs the bf16 working weights");
  for (size_t r = 0; r < a.nranges; ++r)
    FY_CHECK(a.ranges[r].begin <= a.ranges[r].end && a.ranges[r].end <= a.n &&
                 (r == 0 || a.ranges[r - 1].end <= a.ranges[r].begin),
             "update range ", r, " [", a.ranges[r].begin, ", ", a.ranges[r].end, ") of ", a.n,
             " elements");
  if (path == SimdPath::kAuto) path = best_simd_path();
  FY_CHECK(simd_path_supported(path), "SIMD path ", simd_path_name(path),
           " is not supported by this CPU");
  PackedConsts c;
  c.k = step_consts(s);
  c.k.grad_scale = a.grad_scale;
  c.decay_on = 1.0f - s.lr * s.weight_decay;
  c.decay_off = 1.0f - s.lr * 0.0f;
  c.key_m = a.key ^ math::kKeyM;
  c.key_v = a.key ^ math::kKeyV;
  constexpr size_t kItemBlocks = 16;
  const size_t blocks = (a.n + B - 1) / B, items = (blocks + kItemBlocks - 1) / kItemBlocks;
#pragma omp parallel for schedule(dynamic, kClaimItems)
  for (size_t w = 0; w < items; ++w) {
    uint8_t upd[B];
    // The first range that ends after this item's first element.
    size_t r =
        std::partition_point(a.ranges, a.ranges + a.nranges,
                             [&](const DecayRange& x) { return x.end <= w * kItemBlocks * B; }) -
        a.ranges;
    for (size_t b = w * kItemBlocks; b < std::min(blocks, (w + 1) * kItemBlocks); ++b) {
      const size_t b0 = b * B, nb = std::min(B, a.n - b0);
      while (r < a.nranges && a.ranges[r].end <= b0) ++r;
      const bool whole =
          nb == B && r < a.nranges && a.ranges[r].begin <= b0 && b0 + nb <= a.ranges[r].end;
      if (whole && path != SimdPath::kScalar) {
        const float decay = a.ranges[r].decay ? c.decay_on : c.decay_off;
        if (path == SimdPath::kAvx512)
          packed_block_avx512(a, c, b0, decay);
        else
          packed_block_avx2(a, c, b0, decay);
        continue;
      }
      std::fill(upd, upd + nb, 0);
      for (size_t q = r; q < a.nranges && a.ranges[q].begin < b0 + nb; ++q)
        for (size_t i = std::max(b0, a.ranges[q].begin); i < std::min(b0 + nb, a.ranges[q].end);
             ++i)
          upd[i - b0] = a.ranges[q].decay ? 2 : 1;
      packed_block_scalar(a, c, b0, nb, upd);
    }
  }
}

void decode_moment(MomentFormat f, bool second, const void* data, const float* scales, float* out,
                   size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float x = load_moment(f, data, scales, i, second);
    out[i] = f == MomentFormat::kInt8 && second ? x * x : x;
  }
}

void encode_moment(MomentFormat f, bool second, const float* in, void* data, float* scales,
                   size_t n) {
  float x[B];
  for (size_t b0 = 0; b0 < n; b0 += B) {
    const size_t nb = std::min(B, n - b0);
    for (size_t j = 0; j < nb; ++j)
      x[j] = f == MomentFormat::kInt8 && second ? std::sqrt(in[b0 + j]) : in[b0 + j];
    store_moments(f, second, x, data, scales, b0, nb, 0, 0, true);
  }
}

}  // namespace fuyou
