// Internal: the packed-state AdamW (adamw_update_packed) one block at a time. The scalar block
// is the reference; the SIMD blocks handle whole blocks inside one tensor and give its bits.
#pragma once

#include "fuyou/optim.h"
#include "kernels/common/element_math.h"

namespace fuyou::optim_detail {

static_assert(kStateBlock == static_cast<uint64_t>(math::kStateBlock), "one block size");

// 1 / Q^2 of each grid, rounded once to fp32: a code's decoded value is s (q^2 / Q^2).
constexpr float kInvQm2 = 1.0f / (math::kQm * math::kQm);
constexpr float kInvQv2 = 1.0f / (math::kQv * math::kQv);

struct PackedConsts {
  math::AdamWConsts k;  // decay set per block or element from decay_on / decay_off
  float decay_on = 1.0f, decay_off = 1.0f;
  uint32_t key_m = 0, key_v = 0;
};

// Block elements [b0, b0 + nb) of the args' range (b0 a multiple of kStateBlock, nb at most
// one block): upd[j] 0 keeps element b0 + j's state (padding), 1 updates it without weight
// decay, 2 with.
void packed_block_scalar(const PackedAdamWArgs& a, const PackedConsts& c, size_t b0, size_t nb,
                         const uint8_t* upd);
// A whole block every element of which is updated with decay factor `decay`.
void packed_block_avx512(const PackedAdamWArgs& a, const PackedConsts& c, size_t b0, float decay);
void packed_block_avx2(const PackedAdamWArgs& a, const PackedConsts& c, size_t b0, float decay);

}  // namespace fuyou::optim_detail
