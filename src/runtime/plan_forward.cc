// The validation pass's plan (make_forward_plan): the embedding, every layer's forward with
// its weights streamed as the training forward streams them (same tiers, slots and pools),
// and the loss; nothing kept for a backward.
#include <algorithm>

#include "fuyou/plan.h"
#include "plan_internal.h"

namespace fuyou {

Plan make_forward_plan(const Plan& train) {
  using plan_detail::compute_sizes;
  Plan p = train;
  p.forward_only = true;
  p.ops.clear();
  const int L = p.model.n_layer;
  const plan_detail::Sizes sz = compute_sizes(p.model, p.micro_batch, p.tensors, p.attention_keys);
  auto add = [&](OpKind kind, std::vector<int> deps) -> PlanOp& {
    PlanOp op;
    op.id = static_cast<int>(p.ops.size());
    op.kind = kind;
    op.resource = op_kind_info(kind).resource;
    deps.erase(std::remove(deps.begin(), deps.end(), -1), deps.end());
    op.deps = std::move(deps);
    p.ops.push_back(std::move(op));
    return p.ops.back();
  };
  auto use = [&](PlanOp& op, int buffer, Access a, Role r) {
    op.uses.push_back({buffer, a, r, 0, p.buffers[buffer].bytes});
  };
  // Every layer's input and output go through the two stream buffers and the working
  // activations (nothing is kept for a backward); device weight slots and host read staging
  // rotate, each reuse waiting for the slot's last reader.
  const int dw = p.pools.device_weight_slots, hw = p.pools.host_weight_slots;
  std::vector<int> wslot_user(dw, -1), hslot_user(hw, -1);
  PlanOp& e = add(OpKind::kEmbedForward, {});
  use(e, p.buffer(BufferKind::kEmbedWeights), Access::kRead, Role::kWeights);
  use(e, p.buffer(BufferKind::kStream, 0), Access::kWrite, Role::kOutput);
  int prev = e.id;
  for (int l = 0; l < L; ++l) {
    const int s = l % dw;
    int read = -1, staging = -1;
    if (p.layers[l].weights == Tier::kSsd) {
      staging = l % hw;
      PlanOp& r = add(OpKind::kReadWeights, {hslot_user[staging]});
      r.layer = l;
      r.group = l + 1;
      use(r, p.buffer(BufferKind::kSsdWeights, l), Access::kRead, Role::kSource);
      use(r, p.buffer(BufferKind::kReadSlot, staging), Access::kWrite, Role::kDest);
      read = r.id;
    }
    PlanOp& ld = add(OpKind::kLoadWeights, {read, wslot_user[s]});
    ld.layer = l;
    ld.group = l + 1;
    use(ld,
        staging >= 0 ? p.buffer(BufferKind::kReadSlot, staging)
                     : p.buffer(BufferKind::kHostWeights, l),
        Access::kRead, Role::kSource);
    use(ld, p.buffer(BufferKind::kWeightSlot, s), Access::kWrite, Role::kDest);
    if (staging >= 0) hslot_user[staging] = ld.id;
    const int load = ld.id;
    // The forward of l writes the stream buffer the forward of l-1 read: compute runs in
    // order, so the dependency on the previous forward covers it.
    PlanOp& f = add(OpKind::kForward, {load, prev});
    f.layer = l;
    f.flops = sz.layer_flops;
    use(f, p.buffer(BufferKind::kWeightSlot, s), Access::kRead, Role::kWeights);
    use(f, p.buffer(BufferKind::kStream, l % 2), Access::kRead, Role::kInput);
    use(f, p.buffer(BufferKind::kStream, (l + 1) % 2), Access::kWrite, Role::kOutput);
    use(f, p.buffer(BufferKind::kWorkActs), Access::kWrite, Role::kWork);
    wslot_user[s] = f.id;
    prev = f.id;
  }
  PlanOp& h = add(OpKind::kHeadLoss, {prev});
  h.flops = sz.head_flops;
  use(h, p.buffer(BufferKind::kStream, L % 2), Access::kRead, Role::kInput);
  use(h, p.buffer(BufferKind::kEmbedWeights), Access::kRead, Role::kWeights);
  use(h, p.buffer(BufferKind::kFinalWeights), Access::kRead, Role::kWeights);
  return p;
}

}  // namespace fuyou
