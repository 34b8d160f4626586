// The planner's second half: one iteration's operations per resource, with their
// dependencies and the pool slots they use, for a placement made by make_plan (plan.cc).
//
// Creation order is a topological order of the dependency graph, and each resource runs
// its operations in creation order: the executor can therefore never deadlock, and
// prefetching happens by itself because a transfer's only dependencies are its data and a
// free slot, not the compute that will use it.
#include <algorithm>
#include <functional>
#include <map>

#include "fuyou/error.h"
#include "fuyou/plan.h"
#include "plan_internal.h"

namespace fuyou {
namespace plan_detail {

void lay_out_iteration(const PlanRequest& req, const std::vector<ActPlacement>& acts, Plan& plan) {
  const int L = plan.model.n_layer, K = plan.grad_accum, D = plan.deferred_updates;
  const int dw = plan.pools.device_weight_slots, dc = plan.pools.device_ckpt_slots, dg = plan.pools.device_grad_slots;
  const Sizes sz = compute_sizes(plan.model, plan.micro_batch);
  // ---- operations --------------------------------------------------------------------------
  std::vector<PlanOp>& ops = plan.ops;
  auto add = [&](OpKind kind, Resource res, int layer, std::vector<int> deps) -> PlanOp& {
    return append_op(ops, kind, res, layer, std::move(deps));
  };

  // Device weight slots: an LRU cache keyed by layer. A load into a slot waits for the last
  // compute op that used its previous occupant.
  struct SlotState {
    int layer = -1;
    int load_op = -1;
    int last_use = -1;  // compute op
    int last_use_seq = -1;
  };
  std::vector<SlotState> wslots(dw), cslots(dc);
  int use_seq = 0;
  int micro = 0;  // the micro-batch whose ops are being laid out
  int host_read_rr = 0, host_wout_rr = 0, host_ckpt_rr = 0;
  std::vector<int> host_read_consumer(plan.pools.host_weight_slots, -1);
  // The layer each staging slot holds this step (-1: none yet) and the read that filled it.
  std::vector<int> host_read_holds(plan.pools.host_weight_slots, -1), host_read_fill(plan.pools.host_weight_slots, -1);
  std::vector<int> host_wout_writer(plan.pools.host_wout_slots, -1);
  // The layer whose weights of this step each weights-out slot holds (retained by the
  // previous step's update) until this step's first update into it; -1: none.
  std::vector<int> wout_holds(plan.pools.host_wout_slots, -1);
  for (int l = 0; l < L; ++l)
    if (plan.layers[l].retained >= 0) wout_holds[plan.layers[l].retained] = l;
  std::vector<int> host_ckpt_consumer(plan.pools.host_ckpt_slots, -1);

  auto pick_slot = [&](std::vector<SlotState>& slots, int keep_a, int keep_b) {
    int best = -1;
    for (int s = 0; s < static_cast<int>(slots.size()); ++s) {
      if (slots[s].layer >= 0 && (slots[s].layer == keep_a || slots[s].layer == keep_b)) continue;
      if (best < 0 || slots[s].last_use_seq < slots[best].last_use_seq) best = s;
    }
    FY_CHECK(best >= 0, "no free slot");
    return best;
  };
  // Returns the device weight slot holding layer l, loading it if needed. A retained layer
  // loads from its weights-out slot while that holds it (the previous step's update wrote
  // it; no update of this step has yet).
  auto need_weights = [&](int l, int also_needed) -> int {
    for (int s = 0; s < dw; ++s)
      if (wslots[s].layer == l) return s;
    int s = pick_slot(wslots, also_needed, -1);
    if (plan.layers[l].retained >= 0 && wout_holds[plan.layers[l].retained] == l) {
      const int w = plan.layers[l].retained;
      PlanOp& ld = add(OpKind::kLoadWeights, Resource::kH2D, l, {wslots[s].last_use, host_wout_writer[w]});
      ld.micro = micro;
      ld.slot = s;
      ld.in = {BufRef::kWeightsOut, w};
      ld.bytes = sz.weights;
      host_wout_writer[w] = ld.id;  // this step's first update into the slot waits for the load
      wslots[s] = {l, ld.id, -1, use_seq++};
      return s;
    }
    int read = -1, staging = -1;
    if (plan.layers[l].weights == StateTier::kSsd) {
      // A layer read earlier in this step whose staging slot has not been reused since (the
      // backward's second use, or the next micro-batch) loads from there again: a layer's
      // weights do not change within a step.
      for (int h = 0; h < plan.pools.host_weight_slots; ++h)
        if (host_read_holds[h] == l) staging = h, read = host_read_fill[h];
      if (staging < 0) {
        staging = host_read_rr++ % plan.pools.host_weight_slots;
        PlanOp& r = add(OpKind::kReadWeights, Resource::kSsdRead, l, {host_read_consumer[staging]});
        r.micro = micro;
        r.slot = staging;
        r.bytes = sz.weights;
        read = r.id;
        host_read_holds[staging] = l;
        host_read_fill[staging] = r.id;
      }
    }
    PlanOp& ld = add(OpKind::kLoadWeights, Resource::kH2D, l, {read, wslots[s].last_use});
    ld.micro = micro;
    ld.slot = s;
    ld.slot2 = staging;
    ld.bytes = sz.weights;
    if (staging >= 0) host_read_consumer[staging] = ld.id;
    wslots[s] = {l, ld.id, -1, use_seq++};
    return s;
  };
  auto use_weights = [&](int s, int op) {
    wslots[s].last_use = op;
    wslots[s].last_use_seq = use_seq++;
  };

  std::vector<int> ckpt_producer(L + 1, -1);  // op that wrote layer l's input in the forward
  std::vector<int> ckpt_saved(L, -1);         // d2h save (host) or ssd write (ssd)
  std::vector<BufRef> fwd_loc(L + 1);         // where layer l's input is during the forward
  // Every op reading each stream buffer's current content (a forward and maybe a d2h save,
  // on different resources): the next write into the buffer waits for all of them.
  std::vector<std::vector<int>> stream_readers(2);
  auto input_location = [&](int l) -> BufRef {
    if (l < L && (acts[l] == ActPlacement::kKeep || acts[l] == ActPlacement::kDevice)) return {BufRef::kLayerCkpt, l};
    return {BufRef::kStream, l % 2};
  };
  auto save_checkpoint = [&](int l) {
    if (acts[l] != ActPlacement::kHost && acts[l] != ActPlacement::kSsd) return;
    int staging = -1;
    std::vector<int> deps = {ckpt_producer[l]};
    if (acts[l] == ActPlacement::kSsd) {
      staging = host_ckpt_rr++ % plan.pools.host_ckpt_slots;
      deps.push_back(host_ckpt_consumer[staging]);
    }
    PlanOp& s = add(OpKind::kSaveCheckpoint, Resource::kD2H, l, deps);
    s.micro = micro;
    s.in = fwd_loc[l];
    s.slot = staging;
    s.bytes = sz.ckpt;
    if (fwd_loc[l].kind == BufRef::kStream) stream_readers[fwd_loc[l].index].push_back(s.id);
    ckpt_saved[l] = s.id;
    if (staging >= 0) {
      PlanOp& w = add(OpKind::kWriteCheckpoint, Resource::kSsdWrite, l, {s.id});
      w.micro = micro;
      w.slot = staging;
      w.bytes = sz.ckpt;
      host_ckpt_consumer[staging] = w.id;
      ckpt_saved[l] = w.id;
    }
  };

  // Gradients and updates. Host gradient slots rotate between a group's save and its update;
  // in exact mode slot 0 holds the embedding's gradient and slot 1 the final group's until
  // their updates. Held layer gradients (holds_grads) live in a per-layer host buffer or go
  // through the two staging slots to an SSD extent.
  int grad_rr = 0, host_grad_rr = 0, stage_rr = 0;
  std::vector<int> dev_grad_consumer(dg, -1);
  std::vector<int> host_grad_consumer(plan.pools.host_grad_slots, -1);
  std::vector<std::vector<int>> stage_users(plan.pools.host_grad_stage_slots);
  std::vector<int> held(L + 2, -1);  // op after which group g's held gradient is complete
  auto take_stage = [&](std::vector<int>& deps) {
    int s = stage_rr++ % plan.pools.host_grad_stage_slots;
    deps.insert(deps.end(), stage_users[s].begin(), stage_users[s].end());
    stage_users[s].clear();
    return s;
  };
  struct PendingUpdate { int group; int ready; BufRef grad; int part = 0, parts = 1; };
  std::vector<PendingUpdate> pending;
  std::vector<int> sum_sq_ops;
  auto group_bytes = [&](int g) { return g == 0 ? sz.embed : g == L + 1 ? sz.final : sz.weights; };
  int final_update = -1;  // its refresh is emitted at the end of the step
  std::vector<PendingUpdate> deferred_ups;  // Plan::deferred_updates: emitted at the end
  auto emit_refresh = [&](int group, int update, int part, int parts) {
    PlanOp& r = add(OpKind::kLoadResident, Resource::kH2D, group, {update});
    r.micro = K - 1;
    r.part = part;
    r.parts = parts;
    r.bytes = part < 0 ? 4 * embed_rows_first_params(plan) : (group == 0 ? sz.embed : sz.final) / parts;
  };
  auto emit_update = [&](const PendingUpdate& p, int norm_op) {
    int l = p.group - 1;
    bool is_layer = p.group >= 1 && p.group <= L;
    int wout = -1;
    std::vector<int> deps = {p.ready, norm_op};
    BufRef grad = p.grad;
    int read = -1;
    if (req.exact && is_layer && plan.layers[l].grads == StateTier::kSsd) {
      // Exact mode: the held gradient comes back from SSD for the update (its staging slot
      // has been reused since).
      std::vector<int> rdeps = {p.ready};
      int s = take_stage(rdeps);
      PlanOp& r = add(OpKind::kReadGrads, Resource::kSsdRead, p.group, rdeps);
      r.micro = K - 1;
      r.out = {BufRef::kGradStage, s};
      r.bytes = sz.weights;
      read = r.id;
      grad = r.out;
      deps.push_back(read);
    }
    if (is_layer && plan.layers[l].weights == StateTier::kSsd) {
      wout = host_wout_rr++ % plan.pools.host_wout_slots;
      FY_CHECK(plan.layers[l].retained < 0 || plan.layers[l].retained == wout, "layer ", l,
               " retained in weights-out slot ", plan.layers[l].retained, " but updated into slot ", wout);
      deps.push_back(host_wout_writer[wout]);
      wout_holds[wout] = -1;
    }
    PlanOp& u = add(OpKind::kUpdate, Resource::kOptimizer, p.group, deps);
    u.micro = K - 1;
    u.in = grad;
    u.slot2 = wout;
    u.part = p.part;
    u.parts = p.parts;
    int uid = u.id;
    if (grad.kind == BufRef::kHostGrad) host_grad_consumer[grad.index] = uid;
    if (grad.kind == BufRef::kGradStage) stage_users[grad.index] = {uid};
    if (wout >= 0) {
      PlanOp& w = add(OpKind::kWriteWeights, Resource::kSsdWrite, p.group, {uid});
      w.micro = K - 1;
      w.slot = wout;
      w.bytes = sz.weights;
      host_wout_writer[wout] = w.id;
    }
    if (p.group == L + 1 && !req.exact) {
      // The final group is updated right after the head, but only the next step's head reads
      // its device copy: refreshed at the end of the step (below), its copy does not hold the
      // in-order h2d queue, and with it the backward's checkpoint and weight loads (and the
      // SSD reads waiting for their staging slots), behind the update.
      final_update = uid;
    } else if (!is_layer) {
      emit_refresh(p.group, uid, p.part, p.parts);
    }
  };
  // The embedding and final groups' gradients stay on the device across micro-batches and
  // are saved after the last; a layer's are saved after every micro-batch.
  // Parts only where they pay (a large embedding) and where the optimizer can update a
  // range (state in host memory).
  const int embed_parts = plan.embed_optim != StateTier::kHost ? 1
                          : req.embed_parts > 0                 ? req.embed_parts
                          : sz.embed >= (16ull << 20)           ? kEmbedParts
                                                                : 1;
  std::function<void()> after_rows;  // see the embedding's parts in save_grads
  auto save_grads = [&](int group, int producer, int dev_slot) {
    const bool is_layer = group >= 1 && group <= L, last = micro == K - 1;
    std::vector<int> deps = {producer};
    PlanOp* s = nullptr;
    int ready = -1;
    if (group == 0 && !req.exact && embed_parts > 1) {
      // The embedding's save, update and device refresh, part by part: the update of part p
      // runs while part p+1 is copied out and part p-1 copied back. With rows first
      // (PlanRequest::embed_rows_first), first (part -1) the rows the next step's first
      // micro-batch looks up and the position table: saved, updated and refreshed ahead of
      // layer 0's gradient save and update (`after_rows`, emitted between the two), so that the
      // next embedding forward, which waits only for them, runs beside layer 0's update.
      const int hs = host_grad_rr++ % plan.pools.host_grad_slots;
      deps.push_back(host_grad_consumer[hs]);
      const BufRef where{BufRef::kHostGrad, hs};
      int rows_id = -1;
      if (req.embed_rows_first) {
        plan.embed_rows_first = true;
        PlanOp& sr = add(OpKind::kSaveGrads, Resource::kD2H, group, deps);
        sr.micro = micro;
        sr.out = where;
        sr.part = -1;
        sr.parts = embed_parts;
        sr.bytes = 4 * embed_rows_first_params(plan);
        const int save_rows = sr.id;
        PlanOp& rows = add(OpKind::kUpdate, Resource::kOptimizer, group, {save_rows});
        rows.micro = micro;
        rows.in = where;
        rows.part = -1;
        rows.parts = embed_parts;
        rows_id = rows.id;
        emit_refresh(group, rows_id, -1, embed_parts);
        if (after_rows) after_rows();
      }
      for (int part = 0; part < embed_parts; ++part) {
        PlanOp& sp = add(OpKind::kSaveGrads, Resource::kD2H, group, deps);
        sp.micro = micro;
        sp.out = where;
        sp.part = part;
        sp.parts = embed_parts;
        sp.bytes = sz.embed / embed_parts;
        // Updating part p needs only its own gradient; the rows update read none of it.
        emit_update({group, sp.id, where, part, embed_parts}, rows_id);
      }
      return;
    }
    const bool deferred = is_layer && group > L - D;
    if (deferred) {
      // A top layer's gradient waits in its own slot for its update, among the step's last.
      s = &add(OpKind::kSaveGrads, Resource::kD2H, group, deps);
      s->out = {BufRef::kGradStage, L - group};
      ready = s->id;
    } else if (!is_layer || (last && !req.exact)) {
      // To a host gradient slot, for the update.
      int hs = req.exact ? (group == 0 ? 0 : 1) : host_grad_rr++ % plan.pools.host_grad_slots;
      deps.push_back(host_grad_consumer[hs]);
      s = &add(OpKind::kSaveGrads, Resource::kD2H, group, deps);
      s->out = {BufRef::kHostGrad, hs};
      ready = s->id;
    } else if (plan.layers[group - 1].grads == StateTier::kHost) {
      // Held in the layer's host buffer; the previous content was read by this micro-batch's
      // load_grads, which the producing backward waited for.
      s = &add(OpKind::kSaveGrads, Resource::kD2H, group, deps);
      s->out = {BufRef::kGradHold, group - 1};
      ready = s->id;
    } else {
      int st = take_stage(deps);
      s = &add(OpKind::kSaveGrads, Resource::kD2H, group, deps);
      s->out = {BufRef::kGradStage, st};
      int sid = s->id;
      PlanOp& w = add(OpKind::kWriteGrads, Resource::kSsdWrite, group, {sid});
      w.micro = micro;
      w.in = {BufRef::kGradStage, st};
      w.bytes = sz.weights;
      stage_users[st] = {w.id};
      ready = w.id;
      s = &ops[sid];
    }
    s->micro = micro;
    s->slot = dev_slot;
    s->bytes = group_bytes(group);
    const int save_id = s->id;
    const BufRef where = s->out;
    if (dev_slot >= 0) dev_grad_consumer[dev_slot] = save_id;
    if (is_layer) held[group] = ready;
    if (!last) return;
    if (deferred) {
      deferred_ups.push_back({group, ready, where});
      return;
    }
    if (!req.exact) return emit_update({group, ready, where}, -1);
    // Exact mode: this group's share of the norm while the gradient is in host memory.
    PlanOp& q = add(OpKind::kGradSumSq, Resource::kOptimizer, group, {save_id});
    q.micro = micro;
    q.in = where;
    q.bytes = group_bytes(group);
    sum_sq_ops.push_back(q.id);
    if (where.kind == BufRef::kGradStage) stage_users[where.index].push_back(q.id);
    if (where.kind == BufRef::kHostGrad) host_grad_consumer[where.index] = q.id;
    pending.push_back({group, where.kind == BufRef::kGradStage ? ready : save_id, where});
  };
  // Micro-batch > 0: the gradient held from the previous micro-batches goes back into the
  // device slot the backward adds to (so the sums are the in-memory ones, term by term).
  auto load_grads = [&](int group, int dev_slot) -> int {
    std::vector<int> deps = {held[group], dev_grad_consumer[dev_slot]};
    BufRef src{BufRef::kGradHold, group - 1};
    if (plan.layers[group - 1].grads == StateTier::kSsd) {
      std::vector<int> rdeps = {held[group]};
      int st = take_stage(rdeps);
      PlanOp& r = add(OpKind::kReadGrads, Resource::kSsdRead, group, rdeps);
      r.micro = micro;
      r.out = {BufRef::kGradStage, st};
      r.bytes = sz.weights;
      deps.push_back(r.id);
      src = r.out;
    }
    PlanOp& ld = add(OpKind::kLoadGrads, Resource::kH2D, group, deps);
    ld.micro = micro;
    ld.in = src;
    ld.slot = dev_slot;
    ld.bytes = sz.weights;
    if (src.kind == BufRef::kGradStage) stage_users[src.index] = {ld.id};
    return ld.id;
  };

  // Backward. Checkpoints come back through an LRU of device slots like the weights; a
  // recomputed input is rebuilt from layer l-1's checkpoint (recursively available).
  struct Ckpt {
    Plan& plan;
    const std::vector<ActPlacement>& acts;
    std::vector<SlotState>& cslots;
    std::function<PlanOp&(OpKind, Resource, int, std::vector<int>)> add;
    std::function<int(std::vector<SlotState>&, int, int)> pick;
    std::function<int(int, int)> need_w;
    std::function<void(int, int)> use_w;
    std::vector<int>& ckpt_saved;
    std::vector<int>& host_ckpt_consumer;
    int& host_ckpt_rr;
    int& use_seq;
    const Sizes& sz;
    int dc;
    int& micro;

    BufRef need(int l, int also) {
      ActPlacement a = acts[l];
      if (a == ActPlacement::kKeep || a == ActPlacement::kDevice) return {BufRef::kLayerCkpt, l};
      for (int s = 0; s < dc; ++s)
        if (cslots[s].layer == l) return {BufRef::kCkptSlot, s};
      if (a == ActPlacement::kRecompute) {
        BufRef prev = need(l - 1, l);
        int ws = need_w(l - 1, -1);
        int s = pick(cslots, l - 1, also);
        PlanOp& r = add(OpKind::kRecomputeInput, Resource::kCompute, l,
                        {cslots[s].last_use, prev_dep(prev, l - 1), ws_load(ws)});
        r.micro = micro;
        r.slot = ws;
        r.in = prev;
        r.out = {BufRef::kCkptSlot, s};
        r.recompute_flops = sz.layer_flops;
        use_w(ws, r.id);
        touch(prev, r.id);
        cslots[s] = {l, r.id, r.id, use_seq++};
        return {BufRef::kCkptSlot, s};
      }
      int s = pick(cslots, also, -1);
      int read = -1, staging = -1;
      if (a == ActPlacement::kSsd) {
        staging = host_ckpt_rr++ % plan.pools.host_ckpt_slots;
        PlanOp& rd = add(OpKind::kReadCheckpoint, Resource::kSsdRead, l, {ckpt_saved[l], host_ckpt_consumer[staging]});
        rd.micro = micro;
        rd.slot = staging;
        rd.bytes = sz.ckpt;
        read = rd.id;
      }
      PlanOp& ld = add(OpKind::kLoadCheckpoint, Resource::kH2D, l, {read, ckpt_saved[l], cslots[s].last_use});
      ld.micro = micro;
      ld.slot = staging;
      ld.out = {BufRef::kCkptSlot, s};
      ld.bytes = sz.ckpt;
      if (staging >= 0) host_ckpt_consumer[staging] = ld.id;
      cslots[s] = {l, ld.id, -1, use_seq++};
      return {BufRef::kCkptSlot, s};
    }
    int prev_dep(const BufRef& b, int) {
      return b.kind == BufRef::kCkptSlot ? cslots[b.index].load_op : -1;
    }
    std::function<int(int)> ws_load;
    void touch(const BufRef& b, int op) {
      if (b.kind == BufRef::kCkptSlot) {
        cslots[b.index].last_use = op;
        cslots[b.index].last_use_seq = use_seq++;
      }
    }
  };
  Ckpt ck{plan, acts, cslots, add, pick_slot, need_weights, use_weights, ckpt_saved, host_ckpt_consumer,
          host_ckpt_rr, use_seq, sz, dc, micro, [&](int s) { return wslots[s].load_op; }};

  for (micro = 0; micro < K; ++micro) {
    // Forward. The weights do not change within a step, so the device weight slots stay
    // valid across micro-batches; the checkpoint slots do not (other tokens).
    for (SlotState& c : cslots) c.layer = -1;
    fwd_loc[0] = input_location(0);
    std::vector<int> edeps;
    if (fwd_loc[0].kind == BufRef::kStream) {
      auto& readers = stream_readers[fwd_loc[0].index];
      edeps.insert(edeps.end(), readers.begin(), readers.end());
      readers.clear();
    }
    PlanOp& e = add(OpKind::kEmbedForward, Resource::kCompute, -1, edeps);
    e.micro = micro;
    e.out = fwd_loc[0];
    ckpt_producer[0] = e.id;
    save_checkpoint(0);
    for (int l = 0; l < L; ++l) {
      int s = need_weights(l, -1);
      fwd_loc[l + 1] = input_location(l + 1);
      std::vector<int> deps = {wslots[s].load_op, ckpt_producer[l]};
      if (fwd_loc[l + 1].kind == BufRef::kStream) {
        auto& readers = stream_readers[fwd_loc[l + 1].index];
        deps.insert(deps.end(), readers.begin(), readers.end());
        readers.clear();
      }
      PlanOp& f = add(OpKind::kForward, Resource::kCompute, l, deps);
      f.micro = micro;
      f.slot = s;
      f.in = fwd_loc[l];
      f.out = fwd_loc[l + 1];
      f.flops = sz.layer_flops;
      use_weights(s, f.id);
      if (fwd_loc[l].kind == BufRef::kStream) stream_readers[fwd_loc[l].index].push_back(f.id);
      ckpt_producer[l + 1] = f.id;
      if (l + 1 < L) save_checkpoint(l + 1);
    }
    PlanOp& head = add(OpKind::kHead, Resource::kCompute, -1, {ckpt_producer[L]});
    head.micro = micro;
    head.in = fwd_loc[L];
    head.flops = sz.head_flops * 3;  // forward + backward of the LM head
    if (micro == K - 1) save_grads(L + 1, head.id, -1);

    for (int l = L - 1; l >= 0; --l) {
      BufRef in = ck.need(l, -1);
      int ws = need_weights(l, -1);
      int ckpt_dep = ck.prev_dep(in, l);
      int prev = -1;
      if (acts[l] != ActPlacement::kKeep) {
        PlanOp& r = add(OpKind::kRecompute, Resource::kCompute, l, {wslots[ws].load_op, ckpt_dep});
        r.micro = micro;
        r.slot = ws;
        r.in = in;
        r.out = {BufRef::kScratch, 0};
        r.recompute_flops = sz.layer_flops;
        use_weights(ws, r.id);
        ck.touch(in, r.id);
        prev = r.id;
      }
      int gs = grad_rr++ % dg;
      int acc = micro > 0 ? load_grads(1 + l, gs) : -1;
      PlanOp& b = add(OpKind::kBackward, Resource::kCompute, l,
                      {wslots[ws].load_op, ckpt_dep, prev, dev_grad_consumer[gs], acc});
      b.micro = micro;
      b.slot = ws;
      b.slot2 = gs;
      b.in = in;
      b.flops = 2 * sz.layer_flops;
      use_weights(ws, b.id);
      ck.touch(in, b.id);
      // Layer 0's gradient save (and update) goes after the embedding's rows-first ones,
      // where those exist (save_grads(0) calls it back); otherwise here.
      if (l == 0 && micro == K - 1 && req.embed_rows_first && !req.exact) {
        const int bid = b.id;
        bool done = false;
        after_rows = [&, bid, gs, done]() mutable {
          if (!done) save_grads(1, bid, gs);
          done = true;
        };
      } else {
        save_grads(1 + l, b.id, gs);
      }
    }
    PlanOp& eb = add(OpKind::kEmbedBackward, Resource::kCompute, -1, {});
    eb.micro = micro;
    if (micro == K - 1) save_grads(0, eb.id, -1);
    if (after_rows) after_rows();  // when the embedding had no rows-first part
    after_rows = nullptr;
  }
  micro = K - 1;

  if (req.exact) {
    // The norm adds the groups' sums of squares in layout order (0 .. L+1), as in-memory
    // training does; the updates then run in the order the next iteration's forward needs
    // them: the resident groups first (embedding, final: their device copies are refreshed
    // on the h2d queue, which must not hold the next weight loads behind the last update),
    // then layers 0 .. L-1.
    PlanOp& n = add(OpKind::kGradNorm, Resource::kOptimizer, -1, sum_sq_ops);
    n.micro = K - 1;
    int norm = n.id;
    auto rank = [&](const PendingUpdate& p) { return p.group == 0 ? 0 : p.group == L + 1 ? 1 : p.group + 1; };
    std::sort(pending.begin(), pending.end(),
              [&](const PendingUpdate& a, const PendingUpdate& b) { return rank(a) < rank(b); });
    for (const auto& p : pending) emit_update(p, norm);
  }
  if (final_update >= 0) emit_refresh(L + 1, final_update, 0, 1);
  // The deferred updates in the order the next forward needs them (lowest layer first).
  for (auto it = deferred_ups.rbegin(); it != deferred_ups.rend(); ++it) emit_update(*it, -1);
}

}  // namespace plan_detail

Plan make_forward_plan(const Plan& train) {
  using namespace plan_detail;
  Plan p = train;
  p.forward_only = true;
  p.ops.clear();
  const int L = p.model.n_layer;
  const Sizes sz = compute_sizes(p.model, p.micro_batch);
  std::vector<PlanOp>& ops = p.ops;
  auto add = [&](OpKind kind, Resource res, int layer, std::vector<int> deps) -> PlanOp& {
    return append_op(ops, kind, res, layer, std::move(deps));
  };
  // Every layer's input and output go through the two stream buffers; device weight slots
  // and host read staging rotate, each reuse waiting for the slot's last reader.
  const int dw = p.pools.device_weight_slots, hw = p.pools.host_weight_slots;
  std::vector<int> wslot_user(dw, -1), hslot_user(hw, -1);
  int prev = add(OpKind::kEmbedForward, Resource::kCompute, -1, {}).id;
  ops[prev].out = {BufRef::kStream, 0};
  for (int l = 0; l < L; ++l) {
    const int s = l % dw;
    int read = -1, staging = -1;
    if (p.layers[l].weights == StateTier::kSsd) {
      staging = (l % hw);
      PlanOp& r = add(OpKind::kReadWeights, Resource::kSsdRead, l, {hslot_user[staging]});
      r.slot = staging;
      r.bytes = sz.weights;
      read = r.id;
    }
    PlanOp& ld = add(OpKind::kLoadWeights, Resource::kH2D, l, {read, wslot_user[s]});
    ld.slot = s;
    ld.slot2 = staging;
    ld.bytes = sz.weights;
    if (staging >= 0) hslot_user[staging] = ld.id;
    int load = ld.id;
    // The forward of l writes the stream buffer the forward of l-1 read: compute runs in
    // order, so the dependency on the previous forward covers it.
    PlanOp& f = add(OpKind::kForward, Resource::kCompute, l, {load, prev});
    f.slot = s;
    f.in = {BufRef::kStream, l % 2};
    f.out = {BufRef::kStream, (l + 1) % 2};
    f.flops = sz.layer_flops;
    wslot_user[s] = f.id;
    prev = f.id;
  }
  PlanOp& h = add(OpKind::kHeadLoss, Resource::kCompute, -1, {prev});
  h.in = {BufRef::kStream, L % 2};
  h.flops = sz.head_flops;
  return p;
}


}  // namespace fuyou
