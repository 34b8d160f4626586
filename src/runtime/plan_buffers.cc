// The plan's buffer table: every buffer an iteration uses, on the device, in host memory and
// on SSD, with its size. The device's part for given pools is device_buffers (here); the
// placement (plan.cc) adds the host's and the SSD's as it places them. The plan's memory
// figures are this table summed (sum_buffers); the executor allocates from it; ops name its
// entries in their uses.
#include <algorithm>

#include "fuyou/error.h"
#include "fuyou/plan.h"
#include "plan_internal.h"

namespace fuyou {

const char* buffer_kind_name(BufferKind k) {
  switch (k) {
    case BufferKind::kEmbedWeights:
      return "embedding";
    case BufferKind::kFinalWeights:
      return "final";
    case BufferKind::kEmbedRows:
      return "embedding.first_rows";
    case BufferKind::kEmbedGrads:
      return "embedding.grads";
    case BufferKind::kFinalGrads:
      return "final.grads";
    case BufferKind::kWeightSlot:
      return "weight_slot";
    case BufferKind::kGradSlot:
      return "grad_slot";
    case BufferKind::kCkptSlot:
      return "ckpt_slot";
    case BufferKind::kStream:
      return "stream";
    case BufferKind::kLayerCkpt:
      return "ckpt.layer";
    case BufferKind::kLayerActs:
      return "acts.layer";
    case BufferKind::kWorkActs:
      return "work_acts";
    case BufferKind::kScratch:
      return "scratch";
    case BufferKind::kResidualGrad:
      return "residual_grad";
    case BufferKind::kModelWorkspace:
      return "model_workspace";
    case BufferKind::kDeviceOptim:
      return "optim.group";
    case BufferKind::kDeviceGradSum:
      return "grad_sum.group";
    case BufferKind::kAdamWPieces:
      return "adamw_pieces";
    case BufferKind::kReadSlot:
      return "read_slot";
    case BufferKind::kWoutSlot:
      return "wout_slot";
    case BufferKind::kCkptStage:
      return "ckpt_stage";
    case BufferKind::kHostGradSlot:
      return "grad_slot";
    case BufferKind::kGradStage:
      return "grad_stage";
    case BufferKind::kGradHold:
      return "grad_hold.layer";
    case BufferKind::kEmbedGradHold:
      return "embedding.grad_hold";
    case BufferKind::kFinalGradHold:
      return "final.grad_hold";
    case BufferKind::kHostWeights:
      return "weights.layer";
    case BufferKind::kHostCkpt:
      return "ckpt.layer";
    case BufferKind::kHostEmbed:
      return "embedding";
    case BufferKind::kHostFinal:
      return "final";
    case BufferKind::kHostOptim:
      return "optim.group";
    case BufferKind::kStateStage:
      return "state_stage";
    case BufferKind::kOptimChunks:
      return "optim_chunks";
    case BufferKind::kDeviceArena:
      return "device_arena";
    case BufferKind::kKernelScratch:
      return "kernel_scratch";
    case BufferKind::kProcess:
      return "process";
    case BufferKind::kSsdWeights:
      return "weights.layer";
    case BufferKind::kSsdCkpt:
      return "ckpt.layer";
    case BufferKind::kSsdGrads:
      return "grads.layer";
    case BufferKind::kSsdOptim:
      return "optim.group";
  }
  return "?";
}

namespace {

// Kinds of which a plan has several (an index) rather than one.
bool indexed(BufferKind k) {
  switch (k) {
    case BufferKind::kWeightSlot:
    case BufferKind::kGradSlot:
    case BufferKind::kCkptSlot:
    case BufferKind::kStream:
    case BufferKind::kLayerCkpt:
    case BufferKind::kLayerActs:
    case BufferKind::kReadSlot:
    case BufferKind::kWoutSlot:
    case BufferKind::kCkptStage:
    case BufferKind::kHostGradSlot:
    case BufferKind::kGradStage:
    case BufferKind::kGradHold:
    case BufferKind::kHostWeights:
    case BufferKind::kHostCkpt:
    case BufferKind::kHostOptim:
    case BufferKind::kSsdWeights:
    case BufferKind::kSsdCkpt:
    case BufferKind::kSsdGrads:
    case BufferKind::kSsdOptim:
    case BufferKind::kDeviceOptim:
    case BufferKind::kDeviceGradSum:
      return true;
    default:
      return false;
  }
}

}  // namespace

std::string PlanBuffer::name() const {
  std::string n = str(tier_name(tier), ".", buffer_kind_name(kind));
  return indexed(kind) ? str(n, ".", index) : n;
}

Tier Plan::optim_tier(int group) const {
  if (group == 0) return embed_optim;
  if (group == model.n_layer + 1) return final_optim;
  return layers.at(group - 1).optim;
}

int Plan::buffer(BufferKind kind, int index) const {
  for (size_t i = 0; i < buffers.size(); ++i)
    if (buffers[i].kind == kind && buffers[i].index == index) return static_cast<int>(i);
  FY_CHECK(false, "the plan has no buffer ", buffer_kind_name(kind), " ", index);
  return -1;
}

const BufferUse* PlanOp::find(Role role) const {
  for (const BufferUse& u : uses)
    if (u.role == role) return &u;
  return nullptr;
}

const BufferUse& PlanOp::use(Role role) const {
  const BufferUse* u = find(role);
  FY_CHECK(u, op_kind_name(kind), " op ", id, " has no use of that role");
  return *u;
}

uint64_t op_bytes(const PlanOp& op) {
  const OpKindInfo k = op_kind_info(op.kind);
  switch (k.traffic) {
    case Traffic::kH2D:
    case Traffic::kD2H:
    case Traffic::kSsdRead:
    case Traffic::kSsdWrite:
    case Traffic::kHostRead:
      return op.use(k.role).bytes;
    case Traffic::kNone:
    case Traffic::kHostSum:
    case Traffic::kState:
      return 0;
  }
  return 0;
}

MemoryPlan sum_buffers(const std::vector<PlanBuffer>& buffers) {
  MemoryPlan m;
  for (const PlanBuffer& b : buffers) {
    if (!b.bytes) continue;
    auto& parts = b.tier == Tier::kDevice ? m.device_parts
                  : b.tier == Tier::kHost ? m.host_parts
                                          : m.ssd_parts;
    (b.tier == Tier::kDevice ? m.device_bytes
     : b.tier == Tier::kHost ? m.host_bytes
                             : m.ssd_bytes) += b.bytes;
    auto it =
        std::find_if(parts.begin(), parts.end(), [&](const auto& p) { return p.first == b.part; });
    if (it == parts.end())
      parts.push_back({b.part, b.bytes});
    else
      it->second += b.bytes;
  }
  return m;
}

namespace plan_detail {

std::vector<PlanBuffer> device_buffers(const ModelConfig& m, int micro_batch, ElemType tensors,
                                       const std::vector<ActPlacement>& acts, int weight_slots,
                                       int ckpt_slots, int grad_slots) {
  const Sizes sz = compute_sizes(m, micro_batch, tensors);
  const Tier D = Tier::kDevice;
  BufferRows t;
  const std::string globals = "embedding + final norm: weights and gradients";
  t.add(BufferKind::kEmbedWeights, 0, D, sz.embed, globals);
  t.add(BufferKind::kEmbedRows, 0, D, 0, globals);  // a view of the embedding: no memory of its own
  t.add(BufferKind::kEmbedGrads, 0, D, sz.embed, globals);
  t.add(BufferKind::kFinalWeights, 0, D, sz.final, globals);
  t.add(BufferKind::kFinalGrads, 0, D, sz.final, globals);
  t.add(BufferKind::kModelWorkspace, 0, D, sz.workspace,
        "model workspace (logits, head, backward scratch)");
  t.slots(BufferKind::kStream, 2, D, sz.ckpt, "forward stream buffers (2)");
  const std::string work = "working activations + recompute scratch + residual gradient";
  t.add(BufferKind::kWorkActs, 0, D, sz.acts, work);
  t.add(BufferKind::kScratch, 0, D, sz.ckpt, work);
  t.add(BufferKind::kResidualGrad, 0, D, sz.ckpt, work);
  for (size_t l = 0; l < acts.size(); ++l)
    if (acts[l] == ActPlacement::kKeep) {
      t.add(BufferKind::kLayerActs, static_cast<int>(l), D, sz.acts, "kept activations");
      t.add(BufferKind::kLayerCkpt, static_cast<int>(l), D, sz.ckpt, "kept activations");
    }
  for (size_t l = 0; l < acts.size(); ++l)
    if (acts[l] == ActPlacement::kDevice)
      t.add(BufferKind::kLayerCkpt, static_cast<int>(l), D, sz.ckpt, "checkpoints on device");
  t.slots(BufferKind::kWeightSlot, weight_slots, D, sz.weights,
          str("weight slots (", weight_slots, ")"));
  t.slots(BufferKind::kCkptSlot, ckpt_slots, D, sz.ckpt,
          str("checkpoint slots (", ckpt_slots, ")"));
  t.slots(BufferKind::kGradSlot, grad_slots, D, sz.weights,
          str("gradient slots (", grad_slots, ")"));
  return t.rows;
}

std::vector<PlanBuffer> in_table_order(std::vector<PlanBuffer> rows) {
  std::stable_sort(rows.begin(), rows.end(), [](const PlanBuffer& a, const PlanBuffer& b) {
    if (a.tier != b.tier) return a.tier < b.tier;
    if (a.tier == Tier::kDevice) return false;
    return a.kind != b.kind ? a.kind < b.kind : a.index < b.index;
  });
  return rows;
}

}  // namespace plan_detail
}  // namespace fuyou
