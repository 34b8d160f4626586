// AdamW with bias correction and decoupled weight decay, and the learning-rate schedule.
// The optimizer always runs on the host over fp32 master weights, as the engine's design
// puts it (the device only ever sees the weights it computes with).
#pragma once

#include <cstddef>
#include <cstdint>

#include "fuyou/backend.h"
#include "fuyou/config.h"
#include "fuyou/elem_type.h"

namespace fuyou {

struct AdamWStep {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;  // already 0 for tensors without decay
  int64_t t;           // 1-based step count, for bias correction
};

// Instruction-set paths of the optimizer kernels. kAuto picks the widest the CPU has.
enum class SimdPath { kAuto, kScalar, kAvx2, kAvx512 };
const char* simd_path_name(SimdPath p);
// The path simd_path_name names; ConfigError naming `what` (the option or key) and the names
// otherwise.
SimdPath simd_path_from_name(const std::string& name, const std::string& what);
SimdPath best_simd_path();
// Whether this CPU runs `p` (kAuto and kScalar always; a path at most as wide as the widest).
bool simd_path_supported(SimdPath p);

// One fused pass over n elements: reads fp32 master, m, v and the gradient (of grad_type),
// writes fp32 master, m, v and, when lowp is non-null, the updated weights as lowp_type
// (round to nearest even) for the next forward. The gradient is multiplied by grad_scale
// first (global-norm clipping, or undoing an fp16 loss scale). Every path gives
// bit-identical results to the scalar reference (math::adamw_element). Threads: OpenMP.
struct AdamWArgs {
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  const void* grad = nullptr;
  ElemType grad_type = ElemType::kF32;
  void* lowp = nullptr;
  ElemType lowp_type = ElemType::kBF16;
  size_t n = 0;
  float grad_scale = 1.0f;
};
void adamw_update(const AdamWArgs& a, const AdamWStep& s, SimdPath path = SimdPath::kAuto);
// Several pieces of one update in one parallel pass: piece i is pieces[i] with weight decay
// decay[i] in place of s.weight_decay. Element for element what adamw_update gives each piece
// alone, without a parallel region per piece (a rows-first embedding update has thousands of
// one-row ranges, each too short to pay for one).
void adamw_update(const AdamWArgs* pieces, const float* decay, size_t count, const AdamWStep& s,
                  SimdPath path = SimdPath::kAuto);

// The constants of step s for AdamW on the device (Backend::adamw), computed exactly as
// adamw_update computes its own, so both give the same bits.
void set_adamw_constants(DeviceAdamW* a, const AdamWStep& s, float weight_decay, float grad_scale);

// Convenience for fp32 gradients without a low-precision copy (the CPU backend's case).
void adamw_update(float* param, float* m, float* v, const float* grad, size_t n,
                  const AdamWStep& s);

// ---- Optimizer state in fewer bytes (optimizer.state, optimizer.master) ----------------------
// docs/precision.md, "Optimizer state in fewer bytes", says what each format keeps and costs.

// Adam's moments: fp32; bf16 with stochastic rounding; or int8 codes in blocks of
// math::kStateBlock elements with one fp32 scale each (m signed, v as sqrt(v)).
enum class MomentFormat { kF32, kBF16, kInt8 };
// The master weights: fp32, or split: the bf16 working weight (the weights the forward reads)
// and a 16-bit remainder that together are the fp32 master exactly (math::split_hi/lo).
enum class MasterFormat { kF32, kSplit };
struct OptimFormat {
  MomentFormat moments = MomentFormat::kF32;
  MasterFormat master = MasterFormat::kF32;
  // Anything but fp32 master and fp32 moments (the reference, adamw_update's).
  bool packed() const { return moments != MomentFormat::kF32 || master != MasterFormat::kF32; }
  bool operator==(const OptimFormat& o) const { return moments == o.moments && master == o.master; }
  bool operator!=(const OptimFormat& o) const { return !(*this == o); }
};
const char* moment_format_name(MomentFormat f);  // "fp32", "bf16", "int8"
const char* master_format_name(MasterFormat f);  // "fp32", "split"
// "moments/master", e.g. "int8/split": the key of a hardware profile's AdamW rate by format.
std::string optim_format_name(const OptimFormat& f);
// Bytes per element of the moments' values or codes, and of the master (split: the remainder;
// the working weight is the engine's).
size_t moment_elem_bytes(MomentFormat f);
size_t master_elem_bytes(MasterFormat f);
// Elements per int8 block (one scale each): small enough that one large value costs its
// neighbours little precision, large enough that the scales add 1/64 byte per element.
constexpr uint64_t kStateBlock = 256;
// Scales of an int8 moment over n elements (one per block, the last one partial).
inline uint64_t state_blocks(uint64_t n) { return (n + kStateBlock - 1) / kStateBlock; }
// Bytes one moment of n elements takes in host memory: values or codes, then (int8) scales.
uint64_t moment_bytes(MomentFormat f, uint64_t n);
// Bytes the optimizer's state of n parameters takes in host memory: master (or remainder),
// m and v.
uint64_t optim_state_bytes(const OptimFormat& f, uint64_t n);

// The tensors of an update's element range, relative to its first element: elements inside
// one are updated (with weight decay where `decay`), the others (padding) keep their state.
struct DecayRange {
  size_t begin = 0, end = 0;
  bool decay = false;
};

// One fused pass over n elements in a packed format: decodes the master and moments, updates
// them as math::adamw_element does, and re-encodes them, writing the working weights in the
// same pass. Every path gives the scalar reference's bits (src/optim/adamw_packed.cc).
struct PackedAdamWArgs {
  OptimFormat format;
  void* master = nullptr;    // n floats (fp32) or n int16 remainders (split)
  void* m = nullptr;         // n values or codes in format.moments
  float* m_scale = nullptr;  // int8: one per block of [0, n)
  void* v = nullptr;
  float* v_scale = nullptr;
  const void* grad = nullptr;
  ElemType grad_type = ElemType::kF32;
  // The working weights: with a split master the bf16 halves of the master, read and written
  // (required); with an fp32 master the updated weights in lowp_type, written when set.
  void* lowp = nullptr;
  ElemType lowp_type = ElemType::kBF16;
  size_t n = 0;
  // Index of element 0 within its parameter group: a multiple of the block (int8 blocks are
  // counted from the group's start), and the rounding bits' counter.
  uint64_t first = 0;
  float grad_scale = 1.0f;
  uint32_t key = 0;                    // math::round_key(group, t)
  const DecayRange* ranges = nullptr;  // sorted, disjoint, within [0, n)
  size_t nranges = 0;
};
void adamw_update_packed(const PackedAdamWArgs& a, const AdamWStep& s,
                         SimdPath path = SimdPath::kAuto);

// A moment's n elements (from a block boundary) to fp32, and back with rounding to nearest
// (checkpoint conversions between formats). For an int8 v the values are v (its stored root
// squared, as the update reads it).
void decode_moment(MomentFormat f, bool second, const void* data, const float* scales, float* out,
                   size_t n);
void encode_moment(MomentFormat f, bool second, const float* in, void* data, float* scales,
                   size_t n);

// Sum of squares (in double) and count of non-finite values of a gradient: the fused pass
// that global-norm clipping and fp16 overflow checks need before any update.
struct GradStats {
  double sum_squares = 0;
  uint64_t nonfinite = 0;
};
GradStats grad_stats(const void* grad, ElemType type, size_t n, SimdPath path = SimdPath::kAuto);

// Bytes the update moves per parameter: read master, m, v, grad; write master, m, v, lowp.
size_t adamw_bytes_per_param(ElemType grad_type, bool with_lowp, ElemType lowp_type);

// Warmup, then schedule.lr_decay: lr(s) = max_lr (s+1)/warmup for s < warmup, then with
// p = (s - warmup) / (steps - warmup): cosine min_lr + (max_lr - min_lr) (1 + cos(pi p)) / 2,
// linear max_lr + (min_lr - max_lr) p, constant max_lr.
double learning_rate(const OptimizerConfig& o, const ScheduleConfig& s, int64_t step);

}  // namespace fuyou
