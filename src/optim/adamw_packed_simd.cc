// AVX-512 and AVX2 blocks of the packed-state AdamW: one whole block of kStateBlock elements
// inside one tensor, written once (adamw_packed_block.inc) and compiled for each instruction
// set inside its target region; every set gives packed_block_scalar's bits.
// GCC 12's AVX-512 conversion intrinsics start from _mm512_undefined_*, which its
// -Wmaybe-uninitialized reports at every inlined call site; the lanes are all written.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "src/optim/adamw_kernels.h"
#include "src/optim/adamw_packed_kernels.h"
#include "src/optim/simd_vec.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
namespace fuyou::optim_detail::avx512 {
namespace {
#include "src/optim/adamw_packed_block.inc"
}  // namespace
}  // namespace fuyou::optim_detail::avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace fuyou::optim_detail::avx2 {
namespace {
#include "src/optim/adamw_packed_block.inc"
}  // namespace
}  // namespace fuyou::optim_detail::avx2
#pragma GCC pop_options

namespace fuyou::optim_detail {

void packed_block_avx512(const PackedAdamWArgs& a, const PackedConsts& c, size_t b0, float decay) {
  avx512::packed_block(a, c, b0, decay);
}

void packed_block_avx2(const PackedAdamWArgs& a, const PackedConsts& c, size_t b0, float decay) {
  avx2::packed_block(a, c, b0, decay);
}

}  // namespace fuyou::optim_detail
