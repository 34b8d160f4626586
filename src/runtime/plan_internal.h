// Internals shared by the planner's two halves: placement and pools (plan.cc) and the
// operations of one iteration (plan_ops.cc).
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "fuyou/model.h"
#include "fuyou/plan.h"
#include "fuyou/sizes.h"

namespace fuyou::plan_detail {

struct Sizes {
  uint64_t elem_bytes = 4;  // bytes per element of the device's tensors (PlanRequest::tensors)
  uint64_t weights = 0;     // one layer's parameters (padded group), as the device holds them
  uint64_t ckpt = 0;        // one block input (N x C)
  uint64_t acts = 0;        // one layer's full saved activations
  uint64_t workspace = 0;   // Transformer kWorkspace allocations
  uint64_t embed = 0, final = 0;  // group bytes
  double layer_flops = 0;         // forward FLOPs of one block over the micro-batch
  double head_flops = 0;
};

// attention_keys: PlanRequest::attention_keys (0: seq_len); it changes only the FLOPs.
inline Sizes compute_sizes(const ModelConfig& m, int B, ElemType tensors,
                           double attention_keys = 0) {
  ParamLayout layout = make_gpt_layout(m);
  const uint64_t N = static_cast<uint64_t>(B) * m.seq_len, C = m.d_model, V = m.vocab_size;
  Sizes s;
  s.elem_bytes = elem_type_size(tensors);
  s.weights = s.elem_bytes * layout.groups[1].numel;
  s.embed = s.elem_bytes * layout.groups.front().numel;
  s.final = s.elem_bytes * layout.groups.back().numel;
  s.ckpt = s.elem_bytes * N * C;
  // The model's own allocation lists and FLOP count, per family (src/model/gpt.cc).
  s.acts = layer_activation_bytes(m, B, s.elem_bytes);
  s.workspace = model_workspace_bytes(m, B, s.elem_bytes);
  // The attention's two T x T products (4 T C FLOPs a token) over the keys a query covers.
  const double keys = attention_keys > 0 ? std::min<double>(attention_keys, m.seq_len) : m.seq_len;
  s.layer_flops = (layer_forward_flops_per_token(m) - 4.0 * (m.seq_len - keys) * C) * N;
  s.head_flops = 2.0 * C * V * N;
  return s;
}

// The bytes a held gradient of `tensor_bytes` of device tensors takes in host memory or on
// SSD: the same in the tensors' type, twice or more as an fp32 sum (Plan::accum_fp32).
inline uint64_t held_grad_bytes(bool accum_fp32, uint64_t elem_bytes, uint64_t tensor_bytes) {
  return accum_fp32 ? 4 * (tensor_bytes / elem_bytes) : tensor_bytes;
}
inline uint64_t held_grad_bytes(const Plan& plan, uint64_t tensor_bytes) {
  return held_grad_bytes(plan.accum_fp32, elem_type_size(plan.tensors), tensor_bytes);
}

// Parts of the embedding's gradient save, update and refresh (PlanOp::parts): enough to
// overlap the three copies and the update, few enough that each stays a large transfer.
constexpr int kEmbedParts = 4;

// The buffer table as the planner writes it: the placement adds each buffer as it places it
// and reads what it has placed back from here, so the plan's memory figures are the table's
// sums (sum_buffers) and no other count.
struct BufferRows {
  std::vector<PlanBuffer> rows;
  void add(BufferKind kind, int index, Tier tier, uint64_t bytes, const std::string& part) {
    rows.push_back({kind, index, tier, bytes, part});
  }
  // `count` more buffers of `kind`, indexed after those already in the table.
  void slots(BufferKind kind, int count, Tier tier, uint64_t bytes, const std::string& part) {
    const int first = static_cast<int>(std::count_if(
        rows.begin(), rows.end(), [&](const PlanBuffer& b) { return b.kind == kind; }));
    for (int s = 0; s < count; ++s) add(kind, first + s, tier, bytes, part);
  }
  uint64_t bytes(Tier tier) const {
    uint64_t n = 0;
    for (const PlanBuffer& b : rows) n += b.tier == tier ? b.bytes : 0;
    return n;
  }
  uint64_t bytes(std::initializer_list<BufferKind> kinds) const {
    uint64_t n = 0;
    for (const PlanBuffer& b : rows)
      n += std::find(kinds.begin(), kinds.end(), b.kind) != kinds.end() ? b.bytes : 0;
    return n;
  }
};

// The device part of the buffer table for these activation decisions and pool sizes (the
// planner sizes pools with it).
std::vector<PlanBuffer> device_buffers(const ModelConfig& m, int micro_batch, ElemType tensors,
                                       const std::vector<ActPlacement>& acts, int weight_slots,
                                       int ckpt_slots, int grad_slots);
// The rows in the order the table lists them: the device's as device_buffers gives them, then
// the host's and the SSD's by kind (BufferKind's order) and index.
std::vector<PlanBuffer> in_table_order(std::vector<PlanBuffer> rows);

// Lays out the iteration's operations into plan.ops for the placement, pools and buffer table
// already in `plan`.
void lay_out_iteration(const PlanRequest& req, Plan& plan);

}  // namespace fuyou::plan_detail
