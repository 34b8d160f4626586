// The planner's second half: one iteration's operations per resource, with their
// dependencies and the buffers each uses, for a placement made by make_plan (plan.cc).
//
// Creation order is a topological order of the dependency graph, and each resource runs
// its operations in creation order: the executor can therefore never deadlock, and
// prefetching happens by itself because a transfer's only dependencies are its data and a
// free slot, not the compute that will use it.
#include <algorithm>
#include <map>

#include "fuyou/error.h"
#include "fuyou/plan.h"
#include "plan_internal.h"

namespace fuyou {
namespace plan_detail {
namespace {

// A device slot pool used as an LRU cache keyed by layer (weights; checkpoints brought back
// for the backward). A load into a slot waits for the last compute op that used its previous
// occupant.
struct SlotState {
  int layer = -1;
  int load_op = -1;
  int last_use = -1;  // compute op
  int last_use_seq = -1;
};

// An update waiting to be emitted: its group, the op after which its gradient is ready, the
// buffer that holds the gradient, and (the embedding) its part.
struct PendingUpdate {
  int group;
  int ready;
  int grad;  // buffer id
  int part = 0, parts = 1;
};

// Emits one iteration's ops into plan.ops: every micro-batch's forward and backward with the
// transfers they need, then the step's norm (exact mode), the final group's refresh and the
// deferred updates. One instance per plan; its members are the state of the pools as the
// ops are laid out in order.
class IterationBuilder {
 public:
  IterationBuilder(const PlanRequest& req, Plan& plan)
      : req_(req),
        plan_(plan),
        n_layer_(plan.model.n_layer),
        grad_accum_(plan.grad_accum),
        deferred_(plan.deferred_updates),
        sizes_(compute_sizes(plan.model, plan.micro_batch, plan.tensors, plan.attention_keys)) {
    for (size_t i = 0; i < plan.buffers.size(); ++i)
      index_[{plan.buffers[i].kind, plan.buffers[i].index}] = static_cast<int>(i);
    const PlanPools& pp = plan.pools;
    weight_slots_.resize(pp.device_weight_slots);
    cslots_.resize(pp.device_ckpt_slots);
    host_read_consumer_.assign(pp.host_weight_slots, -1);
    host_read_holds_.assign(pp.host_weight_slots, -1);
    host_read_fill_.assign(pp.host_weight_slots, -1);
    host_wout_writer_.assign(pp.host_wout_slots, -1);
    wout_holds_.assign(pp.host_wout_slots, -1);
    for (int l = 0; l < n_layer_; ++l)
      if (plan.layers[l].retained >= 0) wout_holds_[plan.layers[l].retained] = l;
    host_ckpt_consumer_.assign(pp.host_ckpt_slots, -1);
    ckpt_producer_.assign(n_layer_ + 1, -1);
    ckpt_saved_.assign(n_layer_, -1);
    fwd_loc_.assign(n_layer_ + 1, -1);
    dev_grad_consumer_.assign(pp.device_grad_slots, -1);
    host_grad_consumer_.assign(pp.host_grad_slots, -1);
    stage_users_.resize(pp.host_grad_stage_slots);
    held_.assign(n_layer_ + 2, -1);
    // AdamW on the device: layer l's weights live in weight slot l from before the first step
    // (set_params puts them there) and its updates rewrite them in place: no load.
    if (plan.device_optimizer)
      for (int l = 0; l < n_layer_; ++l) weight_slots_[l] = {l, -1, -1, use_seq_++};
  }

  void build() {
    for (micro_ = 0; micro_ < grad_accum_; ++micro_) {
      forward();
      backward();
    }
    micro_ = grad_accum_ - 1;
    finish_step();
  }

  // The validation pass: the embedding, every layer's forward with its weights brought by
  // need_weights as the training forward brings them (same tiers, slots, pools and retained
  // weights-out slots), and the loss. Each layer's input and output go through the two
  // stream buffers and the working activations: nothing is kept for a backward.
  void build_forward_only() {
    PlanOp& e = add(OpKind::kEmbedForward, {});
    use(e, buf(BufferKind::kEmbedWeights), Access::kRead, Role::kWeights);
    use(e, buf(BufferKind::kStream, 0), Access::kWrite, Role::kOutput);
    int prev = e.id;
    for (int l = 0; l < n_layer_; ++l) {
      const int s = need_weights(l, -1);
      // The forward of l writes the stream buffer the forward of l-1 read: compute runs in
      // order, so the dependency on the previous forward covers it.
      prev = layer_forward(l, s, {weight_slots_[s].load_op, prev}, buf(BufferKind::kStream, l % 2),
                           buf(BufferKind::kStream, (l + 1) % 2), buf(BufferKind::kWorkActs))
                 .id;
    }
    PlanOp& h = add(OpKind::kHeadLoss, {prev});
    h.flops = sizes_.head_flops;
    use(h, buf(BufferKind::kStream, n_layer_ % 2), Access::kRead, Role::kInput);
    use(h, buf(BufferKind::kEmbedWeights), Access::kRead, Role::kWeights);
    use(h, buf(BufferKind::kFinalWeights), Access::kRead, Role::kWeights);
  }

 private:
  // ---- ops and uses ------------------------------------------------------------------------

  int buf(BufferKind kind, int index = 0) const {
    auto it = index_.find({kind, index});
    FY_CHECK(it != index_.end(), "the plan has no buffer ", buffer_kind_name(kind), " ", index);
    return it->second;
  }
  BufferKind kind_of(int buffer) const { return plan_.buffers[buffer].kind; }

  // Appends an op with the next id, of the current micro-batch, on its kind's queue; -1 in
  // deps means "no such op" and is dropped, as is a repeated dependency.
  PlanOp& add(OpKind kind, std::vector<int> deps) {
    PlanOp op;
    op.id = static_cast<int>(plan_.ops.size());
    op.kind = kind;
    op.resource = op_kind_info(kind).resource;
    op.micro = micro_;
    for (int d : deps)
      if (d >= 0 && std::find(op.deps.begin(), op.deps.end(), d) == op.deps.end())
        op.deps.push_back(d);
    plan_.ops.push_back(std::move(op));
    return plan_.ops.back();
  }
  // A use of a buffer's bytes [offset, offset + bytes); bytes 0: the whole buffer.
  void use(PlanOp& op, int buffer, Access access, Role role, uint64_t offset = 0,
           uint64_t bytes = 0) {
    op.uses.push_back(
        {buffer, access, role, offset, bytes ? bytes : plan_.buffers[buffer].bytes - offset});
  }
  void copy(PlanOp& op, int src, int dst, uint64_t offset = 0, uint64_t bytes = 0) {
    use(op, src, Access::kRead, Role::kSource, offset, bytes);
    use(op, dst, Access::kWrite, Role::kDest, offset, bytes);
  }

  uint64_t group_bytes(int g) const {
    return g == 0 ? sizes_.embed : g == n_layer_ + 1 ? sizes_.final : sizes_.weights;
  }
  uint64_t group_params(int g) const { return group_bytes(g) / sizes_.elem_bytes; }
  // Group g's held gradient: in the tensors' type, or its fp32 sum (Plan::accum_fp32).
  uint64_t held_bytes(int g) const { return held_grad_bytes(plan_, group_bytes(g)); }
  // An update's use of group g's optimizer state for device-tensor bytes [offset, offset +
  // bytes) of the group: in host memory the proportional range of its buffer (master, m and v
  // in Plan::optim_format), on SSD the whole extent set (updates there are whole-group).
  void use_state(PlanOp& u, int g, uint64_t offset, uint64_t bytes) {
    const int state = optim_state_of_group(g);
    if (plan_.buffers[state].tier == Tier::kSsd)
      return use(u, state, Access::kAccumulate, Role::kState);
    auto at = [&](uint64_t b) {
      return optim_state_bytes(plan_.optim_format, b / sizes_.elem_bytes);
    };
    use(u, state, Access::kAccumulate, Role::kState, at(offset), at(offset + bytes) - at(offset));
  }
  // A split master's update reads the working weights it rewrites.
  Access weights_access() const {
    return plan_.optim_format.master == MasterFormat::kSplit ? Access::kAccumulate : Access::kWrite;
  }
  // The byte range of part `part` of group g (part -1: the rows first, sized for the
  // largest micro-batch; the executor copies the rows it fixes at run time).
  std::pair<uint64_t, uint64_t> part_bytes(int g, int part, int parts) const {
    if (part < 0) return {0, sizes_.elem_bytes * embed_rows_first_params(plan_)};
    const ParamRange r = part_range(group_params(g), part, parts);
    return {sizes_.elem_bytes * r.begin, sizes_.elem_bytes * (r.end - r.begin)};
  }
  int host_weights_of_group(int g) const {
    return g == 0              ? buf(BufferKind::kHostEmbed)
           : g == n_layer_ + 1 ? buf(BufferKind::kHostFinal)
                               : buf(BufferKind::kHostWeights, g - 1);
  }
  int optim_state_of_group(int g) const {
    return plan_.optim_tier(g) == Tier::kHost ? buf(BufferKind::kHostOptim, g)
                                              : buf(BufferKind::kSsdOptim, g);
  }
  int work_of(int layer, bool kept) const {
    return kept ? buf(BufferKind::kLayerActs, layer) : buf(BufferKind::kWorkActs);
  }

  // ---- weights -----------------------------------------------------------------------------

  int pick_slot(std::vector<SlotState>& slots, int keep_a, int keep_b) {
    int best = -1;
    for (int s = 0; s < static_cast<int>(slots.size()); ++s) {
      if (slots[s].layer >= 0 && (slots[s].layer == keep_a || slots[s].layer == keep_b)) continue;
      if (best < 0 || slots[s].last_use_seq < slots[best].last_use_seq) best = s;
    }
    FY_CHECK(best >= 0, "no free slot");
    return best;
  }

  PlanOp& load_weights(int l, int slot, std::vector<int> deps, int src) {
    PlanOp& ld = add(OpKind::kLoadWeights, std::move(deps));
    ld.layer = l;
    ld.group = l + 1;
    copy(ld, src, buf(BufferKind::kWeightSlot, slot));
    return ld;
  }

  // Returns the device weight slot holding layer l, loading it if needed. A retained layer
  // loads from its weights-out slot while that holds it (the previous step's update wrote
  // it; no update of this step has yet).
  int need_weights(int l, int also_needed) {
    for (int s = 0; s < static_cast<int>(weight_slots_.size()); ++s)
      if (weight_slots_[s].layer == l) return s;
    const int s = pick_slot(weight_slots_, also_needed, -1);
    const int w = plan_.layers[l].retained;
    if (w >= 0 && wout_holds_[w] == l) {
      const int ld = load_weights(l, s, {weight_slots_[s].last_use, host_wout_writer_[w]},
                                  buf(BufferKind::kWoutSlot, w))
                         .id;
      host_wout_writer_[w] = ld;  // this step's first update into the slot waits for the load
      weight_slots_[s] = {l, ld, -1, use_seq_++};
      return s;
    }
    int read = -1, staging = -1;
    if (plan_.layers[l].weights == Tier::kSsd) {
      // A layer read earlier in this step whose staging slot has not been reused since (the
      // backward's second use, or the next micro-batch) loads from there again: a layer's
      // weights do not change within a step.
      for (int h = 0; h < plan_.pools.host_weight_slots; ++h)
        if (host_read_holds_[h] == l) staging = h, read = host_read_fill_[h];
      if (staging < 0) {
        staging = host_read_rr_++ % plan_.pools.host_weight_slots;
        PlanOp& r = add(OpKind::kReadWeights, {host_read_consumer_[staging]});
        r.layer = l;
        r.group = l + 1;
        copy(r, buf(BufferKind::kSsdWeights, l), buf(BufferKind::kReadSlot, staging));
        read = r.id;
        host_read_holds_[staging] = l;
        host_read_fill_[staging] = r.id;
      }
    }
    const int src =
        staging >= 0 ? buf(BufferKind::kReadSlot, staging) : buf(BufferKind::kHostWeights, l);
    const int ld = load_weights(l, s, {read, weight_slots_[s].last_use}, src).id;
    if (staging >= 0) host_read_consumer_[staging] = ld;
    weight_slots_[s] = {l, ld, -1, use_seq_++};
    return s;
  }
  void use_weights(int s, int op) {
    weight_slots_[s].last_use = op;
    weight_slots_[s].last_use_seq = use_seq_++;
  }

  // ---- forward -----------------------------------------------------------------------------

  // Layer l's forward with its weights in device slot s, from buffer `in` to `out`, its
  // working activations in `work`.
  PlanOp& layer_forward(int l, int s, std::vector<int> deps, int in, int out, int work) {
    PlanOp& f = add(OpKind::kForward, std::move(deps));
    f.layer = l;
    f.flops = sizes_.layer_flops;
    use(f, buf(BufferKind::kWeightSlot, s), Access::kRead, Role::kWeights);
    use(f, in, Access::kRead, Role::kInput);
    use(f, out, Access::kWrite, Role::kOutput);
    use(f, work, Access::kWrite, Role::kWork);
    use_weights(s, f.id);
    return f;
  }

  // Where layer l's block input lives during the forward: its own checkpoint buffer (keep,
  // device), else one of the two stream buffers.
  int input_location(int l) const {
    if (l < n_layer_ && (acts(l) == ActPlacement::kKeep || acts(l) == ActPlacement::kDevice))
      return buf(BufferKind::kLayerCkpt, l);
    return buf(BufferKind::kStream, l % 2);
  }
  ActPlacement acts(int l) const { return plan_.layers[l].act; }
  // Every op reading a stream buffer's current content (a forward and maybe a d2h save, on
  // different resources): the next write into the buffer waits for all of them.
  std::vector<int>& stream_readers(int buffer) {
    return stream_readers_[plan_.buffers[buffer].index];
  }
  void take_stream_readers(int buffer, std::vector<int>& deps) {
    if (kind_of(buffer) != BufferKind::kStream) return;
    auto& readers = stream_readers(buffer);
    deps.insert(deps.end(), readers.begin(), readers.end());
    readers.clear();
  }

  void save_checkpoint(int l) {
    if (acts(l) != ActPlacement::kHost && acts(l) != ActPlacement::kSsd) return;
    int staging = -1;
    std::vector<int> deps = {ckpt_producer_[l]};
    if (acts(l) == ActPlacement::kSsd) {
      staging = host_ckpt_rr_++ % plan_.pools.host_ckpt_slots;
      deps.push_back(host_ckpt_consumer_[staging]);
    }
    PlanOp& s = add(OpKind::kSaveCheckpoint, deps);
    s.layer = l;
    copy(s, fwd_loc_[l],
         staging >= 0 ? buf(BufferKind::kCkptStage, staging) : buf(BufferKind::kHostCkpt, l));
    if (kind_of(fwd_loc_[l]) == BufferKind::kStream) stream_readers(fwd_loc_[l]).push_back(s.id);
    ckpt_saved_[l] = s.id;
    if (staging >= 0) {
      const int sid = s.id;
      PlanOp& w = add(OpKind::kWriteCheckpoint, {sid});
      w.layer = l;
      copy(w, buf(BufferKind::kCkptStage, staging), buf(BufferKind::kSsdCkpt, l));
      host_ckpt_consumer_[staging] = w.id;
      ckpt_saved_[l] = w.id;
    }
  }

  void forward() {
    // The weights do not change within a step, so the device weight slots stay valid across
    // micro-batches; the checkpoint slots do not (other tokens).
    for (SlotState& c : cslots_) c.layer = -1;
    fwd_loc_[0] = input_location(0);
    std::vector<int> edeps;
    take_stream_readers(fwd_loc_[0], edeps);
    PlanOp& e = add(OpKind::kEmbedForward, edeps);
    // With rows first the first micro-batch looks up only the rows refreshed first.
    use(e,
        buf(plan_.embed_rows_first && micro_ == 0 ? BufferKind::kEmbedRows
                                                  : BufferKind::kEmbedWeights),
        Access::kRead, Role::kWeights);
    use(e, fwd_loc_[0], Access::kWrite, Role::kOutput);
    ckpt_producer_[0] = e.id;
    save_checkpoint(0);
    for (int l = 0; l < n_layer_; ++l) {
      const int s = need_weights(l, -1);
      fwd_loc_[l + 1] = input_location(l + 1);
      std::vector<int> deps = {weight_slots_[s].load_op, ckpt_producer_[l]};
      take_stream_readers(fwd_loc_[l + 1], deps);
      PlanOp& f = layer_forward(l, s, std::move(deps), fwd_loc_[l], fwd_loc_[l + 1],
                                work_of(l, acts(l) == ActPlacement::kKeep));
      if (kind_of(fwd_loc_[l]) == BufferKind::kStream) stream_readers(fwd_loc_[l]).push_back(f.id);
      ckpt_producer_[l + 1] = f.id;
      if (l + 1 < n_layer_) save_checkpoint(l + 1);
    }
    if (micro_ == 0 || plan_.accum_fp32) {
      // The step's embedding and final gradients accumulate on the device from the first
      // head on; the previous step's saves of them must be done first (the uses say so).
      // fp32 sums: each micro-batch's start afresh, after the previous one's saves.
      PlanOp& z = add(OpKind::kZeroGrads, {resident_save_[0], resident_save_[1]});
      use(z, buf(BufferKind::kEmbedGrads), Access::kWrite, Role::kGrads);
      use(z, buf(BufferKind::kFinalGrads), Access::kWrite, Role::kGrads);
    }
    PlanOp& head = add(OpKind::kHead, {ckpt_producer_[n_layer_]});
    // Forward + backward of the LM head (head_train: no chunk's logits computed twice).
    head.flops = sizes_.head_flops * 3;
    use(head, fwd_loc_[n_layer_], Access::kRead, Role::kInput);
    use(head, buf(BufferKind::kEmbedWeights), Access::kRead, Role::kWeights);
    use(head, buf(BufferKind::kFinalWeights), Access::kRead, Role::kWeights);
    use(head, buf(BufferKind::kEmbedGrads), Access::kAccumulate, Role::kGrads);
    use(head, buf(BufferKind::kFinalGrads), Access::kAccumulate, Role::kGrads);
    use(head, buf(BufferKind::kResidualGrad), Access::kWrite, Role::kResidual);
    if (micro_ == grad_accum_ - 1 || plan_.accum_fp32) save_grads(n_layer_ + 1, head.id, -1);
  }

  // ---- backward ----------------------------------------------------------------------------

  // The op that brought a checkpoint slot's content, for an op that reads it.
  int ckpt_load_op(int buffer) const {
    return kind_of(buffer) == BufferKind::kCkptSlot ? cslots_[plan_.buffers[buffer].index].load_op
                                                    : -1;
  }
  void touch_ckpt(int buffer, int op) {
    if (kind_of(buffer) != BufferKind::kCkptSlot) return;
    SlotState& c = cslots_[plan_.buffers[buffer].index];
    c.last_use = op;
    c.last_use_seq = use_seq_++;
  }

  // The buffer holding layer l's block input for the backward. Checkpoints come back through
  // an LRU of device slots like the weights; a recomputed input is rebuilt from layer l-1's
  // checkpoint (recursively available).
  int need_checkpoint(int l, int also) {
    const ActPlacement a = acts(l);
    if (a == ActPlacement::kKeep || a == ActPlacement::kDevice)
      return buf(BufferKind::kLayerCkpt, l);
    for (int s = 0; s < static_cast<int>(cslots_.size()); ++s)
      if (cslots_[s].layer == l) return buf(BufferKind::kCkptSlot, s);
    if (a == ActPlacement::kRecompute) return recompute_input(l, also);
    const int s = pick_slot(cslots_, also, -1);
    int read = -1, staging = -1;
    if (a == ActPlacement::kSsd) {
      staging = host_ckpt_rr_++ % plan_.pools.host_ckpt_slots;
      PlanOp& rd = add(OpKind::kReadCheckpoint, {ckpt_saved_[l], host_ckpt_consumer_[staging]});
      rd.layer = l;
      copy(rd, buf(BufferKind::kSsdCkpt, l), buf(BufferKind::kCkptStage, staging));
      read = rd.id;
    }
    PlanOp& ld = add(OpKind::kLoadCheckpoint, {read, ckpt_saved_[l], cslots_[s].last_use});
    ld.layer = l;
    copy(ld, staging >= 0 ? buf(BufferKind::kCkptStage, staging) : buf(BufferKind::kHostCkpt, l),
         buf(BufferKind::kCkptSlot, s));
    if (staging >= 0) host_ckpt_consumer_[staging] = ld.id;
    cslots_[s] = {l, ld.id, -1, use_seq_++};
    return buf(BufferKind::kCkptSlot, s);
  }

  // Layer l's input rebuilt by layer l-1's forward from its own checkpoint, into a slot.
  int recompute_input(int l, int also) {
    const int prev = need_checkpoint(l - 1, l);
    const int ws = need_weights(l - 1, -1);
    const int s = pick_slot(cslots_, l - 1, also);
    PlanOp& r = add(OpKind::kRecomputeInput,
                    {cslots_[s].last_use, ckpt_load_op(prev), weight_slots_[ws].load_op});
    r.layer = l;
    r.recompute_flops = sizes_.layer_flops;
    use(r, buf(BufferKind::kWeightSlot, ws), Access::kRead, Role::kWeights);  // layer l-1's
    use(r, prev, Access::kRead, Role::kInput);
    use(r, buf(BufferKind::kCkptSlot, s), Access::kWrite, Role::kOutput);
    use(r, buf(BufferKind::kWorkActs), Access::kWrite, Role::kWork);
    use_weights(ws, r.id);
    touch_ckpt(prev, r.id);
    cslots_[s] = {l, r.id, r.id, use_seq_++};
    return buf(BufferKind::kCkptSlot, s);
  }

  void backward() {
    for (int l = n_layer_ - 1; l >= 0; --l) {
      const int in = need_checkpoint(l, -1);
      const int ws = need_weights(l, -1);
      const int ckpt_dep = ckpt_load_op(in);
      const bool kept = acts(l) == ActPlacement::kKeep;
      int prev = -1;
      if (!kept) {
        PlanOp& r = add(OpKind::kRecompute, {weight_slots_[ws].load_op, ckpt_dep});
        r.layer = l;
        r.recompute_flops = sizes_.layer_flops;
        use(r, buf(BufferKind::kWeightSlot, ws), Access::kRead, Role::kWeights);
        use(r, in, Access::kRead, Role::kInput);
        use(r, buf(BufferKind::kScratch), Access::kWrite, Role::kOutput);
        use(r, buf(BufferKind::kWorkActs), Access::kWrite, Role::kWork);
        use_weights(ws, r.id);
        touch_ckpt(in, r.id);
        prev = r.id;
      }
      // AdamW on the device, holding gradients in the tensors' type: layer l's own slot (the
      // pool has one per layer at least), which keeps the sum between micro-batches.
      const bool own_slot = plan_.device_optimizer && plan_.holds_grads() && !plan_.accum_fp32;
      const int gs = own_slot ? l : grad_rr_++ % plan_.pools.device_grad_slots;
      // Micro-batch 0 (and every micro-batch where the sums are fp32) writes the slot afresh; a
      // later one adds to what load_grads put back (or, in its own slot, to what it holds), so
      // each sum is formed term by term as in-memory training forms it.
      const bool fresh = micro_ == 0 || plan_.accum_fp32;
      const int acc = fresh || own_slot ? -1 : load_grads(1 + l, gs);
      PlanOp& b = add(OpKind::kBackward,
                      {weight_slots_[ws].load_op, ckpt_dep, prev, dev_grad_consumer_[gs], acc});
      b.layer = l;
      b.group = l + 1;
      b.flops = 2 * sizes_.layer_flops;
      use(b, buf(BufferKind::kWeightSlot, ws), Access::kRead, Role::kWeights);
      use(b, in, Access::kRead, Role::kInput);
      // Reads the layer's activations and overwrites one of them with its gradient
      // (Transformer::block_backward): the next forward into this buffer waits for it.
      use(b, work_of(l, kept), Access::kAccumulate, Role::kWork);
      use(b, buf(BufferKind::kGradSlot, gs), fresh ? Access::kWrite : Access::kAccumulate,
          Role::kGrads);
      use(b, buf(BufferKind::kResidualGrad), Access::kAccumulate, Role::kResidual);
      use_weights(ws, b.id);
      touch_ckpt(in, b.id);
      // Layer 0's gradient save (and update) goes after the embedding's rows-first ones,
      // where those exist; otherwise after the embedding's save.
      if (l == 0 && micro_ == grad_accum_ - 1 && req_.embed_rows_first && !req_.exact)
        layer0_save_ = {b.id, gs};
      else
        save_grads(1 + l, b.id, gs);
    }
    PlanOp& eb = add(OpKind::kEmbedBackward, {});
    use(eb, buf(BufferKind::kEmbedWeights), Access::kRead, Role::kWeights);
    use(eb, buf(BufferKind::kEmbedGrads), Access::kAccumulate, Role::kGrads);
    use(eb, buf(BufferKind::kResidualGrad), Access::kRead, Role::kResidual);
    if (micro_ == grad_accum_ - 1 || plan_.accum_fp32) save_grads(0, eb.id, -1);
    save_layer0_grads();  // when the embedding had no rows-first part
  }

  void save_layer0_grads() {
    if (layer0_save_.first < 0) return;
    const auto [producer, slot] = layer0_save_;
    layer0_save_ = {-1, -1};
    save_grads(1, producer, slot);
  }

  // ---- gradients and updates ---------------------------------------------------------------

  // A gradient staging slot in turn; `deps` gains the ops still using it.
  int take_stage(std::vector<int>& deps) {
    const int s = stage_rr_++ % plan_.pools.host_grad_stage_slots;
    deps.insert(deps.end(), stage_users_[s].begin(), stage_users_[s].end());
    stage_users_[s].clear();
    return s;
  }
  // Records that op `op` read gradient buffer `grad` (the next writer of a slot waits for it).
  void consumed(int grad, int op, bool add_user = false) {
    const PlanBuffer& b = plan_.buffers[grad];
    if (b.kind == BufferKind::kHostGradSlot) host_grad_consumer_[b.index] = op;
    if (b.kind == BufferKind::kGradStage) {
      if (!add_user) stage_users_[b.index].clear();
      stage_users_[b.index].push_back(op);
    }
  }

  // A device refresh of group 0 or L+1 from its host weights after `update`.
  void emit_refresh(int group, int update, int part, int parts) {
    PlanOp& r = add(OpKind::kLoadResident, {update});
    r.micro = grad_accum_ - 1;
    r.group = group;
    r.part = part;
    r.parts = parts;
    const auto [offset, bytes] = part_bytes(group, part, parts);
    const bool embed = group == 0;
    copy(r, buf(embed ? BufferKind::kHostEmbed : BufferKind::kHostFinal),
         buf(embed ? BufferKind::kEmbedWeights : BufferKind::kFinalWeights), offset, bytes);
    if (part < 0) use(r, buf(BufferKind::kEmbedRows), Access::kWrite, Role::kDest);
  }

  void emit_update(const PendingUpdate& p, int norm_op) {
    const int l = p.group - 1;
    const bool is_layer = p.group >= 1 && p.group <= n_layer_;
    std::vector<int> deps = {p.ready, norm_op};
    int grad = p.grad;
    if (req_.exact && is_layer && plan_.layers[l].grads == Tier::kSsd) {
      // Exact mode: the held gradient comes back from SSD for the update (its staging slot
      // has been reused since).
      std::vector<int> rdeps = {p.ready};
      const int s = take_stage(rdeps);
      PlanOp& r = add(OpKind::kReadGrads, rdeps);
      r.micro = grad_accum_ - 1;
      r.group = p.group;
      r.layer = l;
      copy(r, buf(BufferKind::kSsdGrads, l), buf(BufferKind::kGradStage, s));
      grad = buf(BufferKind::kGradStage, s);
      deps.push_back(r.id);
    }
    int wout = -1;
    if (is_layer && plan_.layers[l].weights == Tier::kSsd) {
      wout = host_wout_rr_++ % plan_.pools.host_wout_slots;
      FY_CHECK(plan_.layers[l].retained < 0 || plan_.layers[l].retained == wout, "layer ", l,
               " retained in weights-out slot ", plan_.layers[l].retained,
               " but updated into slot ", wout);
      deps.push_back(host_wout_writer_[wout]);
      if (plan_.optim_format.master == MasterFormat::kSplit && wout_holds_[wout] != l) {
        // The update reads the layer's current weights (a split master's working halves) from
        // the slot it writes: from the layer's extent, once the slot's last write is done.
        PlanOp& r = add(OpKind::kReadWeights, {host_wout_writer_[wout]});
        r.micro = grad_accum_ - 1;
        r.layer = l;
        r.group = p.group;
        copy(r, buf(BufferKind::kSsdWeights, l), buf(BufferKind::kWoutSlot, wout));
        deps.push_back(r.id);
      }
      wout_holds_[wout] = -1;
    }
    PlanOp& u = add(OpKind::kUpdate, deps);
    u.micro = grad_accum_ - 1;
    u.group = p.group;
    u.layer = is_layer ? l : -1;
    u.part = p.part;
    u.parts = p.parts;
    const auto [offset, bytes] = part_bytes(p.group, p.part, p.parts);
    u.params = bytes / sizes_.elem_bytes;
    const int dst = wout >= 0 ? buf(BufferKind::kWoutSlot, wout) : host_weights_of_group(p.group);
    if (plan_.accum_fp32) {  // the fp32 sum (one part)
      use(u, grad, Access::kRead, Role::kSource, 0, held_bytes(p.group));
    } else {
      use(u, grad, Access::kRead, Role::kSource, offset, bytes);
    }
    use(u, dst, weights_access(), Role::kDest, offset, bytes);
    // The state streams through the store for a group on SSD (master, m and v read and
    // written back), in host memory otherwise.
    use_state(u, p.group, offset, bytes);
    const int uid = u.id;
    consumed(grad, uid);
    if (wout >= 0) {
      PlanOp& w = add(OpKind::kWriteWeights, {uid});
      w.micro = grad_accum_ - 1;
      w.group = p.group;
      w.layer = l;
      copy(w, buf(BufferKind::kWoutSlot, wout), buf(BufferKind::kSsdWeights, l));
      host_wout_writer_[wout] = w.id;
    }
    if (p.group == n_layer_ + 1 && !req_.exact) {
      // The final group is updated right after the head, but only the next step's head reads
      // its device copy: refreshed at the end of the step, its copy does not hold the
      // in-order h2d queue, and with it the backward's checkpoint and weight loads (and the
      // SSD reads waiting for their staging slots), behind the update.
      final_update_ = uid;
    } else if (!is_layer) {
      emit_refresh(p.group, uid, p.part, p.parts);
    }
  }

  PlanOp& save_op(int group, std::vector<int> deps, int src, int dst, int part = 0, int parts = 1) {
    PlanOp& s = add(OpKind::kSaveGrads, std::move(deps));
    s.group = group;
    s.layer = group >= 1 && group <= n_layer_ ? group - 1 : -1;
    s.part = part;
    s.parts = parts;
    const auto [offset, bytes] = part_bytes(group, part, parts);
    copy(s, src, dst, offset, bytes);
    return s;
  }
  int grads_on_device(int group, int dev_slot) const {
    return group == 0              ? buf(BufferKind::kEmbedGrads)
           : group == n_layer_ + 1 ? buf(BufferKind::kFinalGrads)
                                   : buf(BufferKind::kGradSlot, dev_slot);
  }

  // The embedding's save, update and device refresh, part by part: the update of part p runs
  // while part p+1 is copied out and part p-1 copied back. With rows first, first (part -1)
  // the rows the next step's first micro-batch looks up and the position table: saved,
  // updated and refreshed ahead of layer 0's gradient save and update, so that the next
  // embedding forward, which waits only for them, runs beside layer 0's update.
  void save_embed_grads_in_parts(int producer) {
    const int parts = plan_.embed_parts;
    const int hs = host_grad_rr_++ % plan_.pools.host_grad_slots;
    const std::vector<int> deps = {producer, host_grad_consumer_[hs]};
    const int where = buf(BufferKind::kHostGradSlot, hs), src = buf(BufferKind::kEmbedGrads);
    int rows_id = -1;
    if (plan_.embed_rows_first) {
      PlanOp& sr = save_op(0, deps, src, where, -1, parts);
      const int save_rows = sr.id;
      PlanOp& rows = add(OpKind::kUpdate, {save_rows});
      rows.group = 0;
      rows.part = -1;
      rows.parts = parts;
      const auto [offset, bytes] = part_bytes(0, -1, parts);
      rows.params = bytes / sizes_.elem_bytes;
      use(rows, where, Access::kRead, Role::kSource, offset, bytes);
      use(rows, buf(BufferKind::kHostEmbed), weights_access(), Role::kDest, offset, bytes);
      use_state(rows, 0, offset, bytes);
      rows_id = rows.id;
      emit_refresh(0, rows_id, -1, parts);
      save_layer0_grads();
    }
    for (int part = 0; part < parts; ++part) {
      PlanOp& sp = save_op(0, deps, src, where, part, parts);
      // Updating part p needs only its own gradient; the rows update read none of it.
      emit_update({0, sp.id, where, part, parts}, rows_id);
    }
  }

  // Group `group`'s gradients, produced by op `producer` (in device gradient slot `dev_slot`
  // for a layer), saved to host memory: for its update, held for the next micro-batch or the
  // norm, or (a deferred layer) kept for its update at the end of the step. The embedding and
  // final groups' gradients stay on the device across micro-batches and are saved after the
  // last; a layer's after every micro-batch.
  void save_grads(int group, int producer, int dev_slot) {
    if (plan_.device_optimizer) return device_grads(group, producer, dev_slot);
    if (plan_.accum_fp32) return save_and_sum(group, producer, dev_slot);
    const bool is_layer = group >= 1 && group <= n_layer_, last = micro_ == grad_accum_ - 1;
    if (group == 0 && !req_.exact && plan_.embed_parts > 1)
      return save_embed_grads_in_parts(producer);
    std::vector<int> deps = {producer};
    const int src = grads_on_device(group, dev_slot);
    // Exact mode, Plan::device_sum_squares: the group's share of the norm first, on the compute
    // queue right after the backward that made the gradient, and the save after it: the save
    // is what the slot's next writer (a held gradient's load, on the h2d queue) waits for.
    const bool device_sq = last && plan_.device_sum_squares;  // implies exact mode
    if (device_sq) deps.push_back(device_sum_sq(group, producer, src));
    int where = -1, ready = -1, save_id = -1;
    const bool deferred = is_layer && group > n_layer_ - deferred_;
    if (deferred) {
      // A top layer's gradient waits in its own slot for its update, among the step's last.
      where = buf(BufferKind::kGradStage, n_layer_ - group);
      save_id = ready = save_op(group, deps, src, where).id;
    } else if (!is_layer || (last && !req_.exact)) {
      // To a host gradient slot, for the update.
      const int hs =
          req_.exact ? (group == 0 ? 0 : 1) : host_grad_rr_++ % plan_.pools.host_grad_slots;
      deps.push_back(host_grad_consumer_[hs]);
      where = buf(BufferKind::kHostGradSlot, hs);
      save_id = ready = save_op(group, deps, src, where).id;
    } else if (plan_.layers[group - 1].grads == Tier::kHost) {
      // Held in the layer's host buffer; the previous content was read by this micro-batch's
      // load_grads, which the producing backward waited for.
      where = buf(BufferKind::kGradHold, group - 1);
      save_id = ready = save_op(group, deps, src, where).id;
    } else {
      const int st = take_stage(deps);
      where = buf(BufferKind::kGradStage, st);
      save_id = save_op(group, deps, src, where).id;
      PlanOp& w = add(OpKind::kWriteGrads, {save_id});
      w.group = group;
      w.layer = group - 1;
      copy(w, where, buf(BufferKind::kSsdGrads, group - 1));
      stage_users_[st] = {w.id};
      ready = w.id;
    }
    if (dev_slot >= 0) dev_grad_consumer_[dev_slot] = save_id;
    if (is_layer) held_[group] = ready;
    if (!last) return;
    if (deferred) return deferred_updates_.push_back({group, ready, where});
    if (!req_.exact) return emit_update({group, ready, where}, -1);
    const int held = kind_of(where) == BufferKind::kGradStage ? ready : save_id;
    if (device_sq) return pending_.push_back({group, held, where});
    sum_sq_then_pend(group, save_id, where, held);
  }

  // Plan::device_optimizer: group `group`'s gradient, made by op `producer` (in device gradient
  // slot `dev_slot` for a layer), stays on the device. fp32 sums: added into the group's sum
  // there. After the last micro-batch its update follows at once, or (exact mode) its sum of
  // squares, and its update after the norm.
  void device_grads(int group, int producer, int dev_slot) {
    const bool is_layer = group >= 1 && group <= n_layer_, last = micro_ == grad_accum_ - 1;
    int grad = grads_on_device(group, dev_slot), ready = producer;
    if (plan_.accum_fp32) {
      PlanOp& a = add(OpKind::kDeviceAccumulate, {producer, held_[group]});
      a.group = group;
      a.layer = is_layer ? group - 1 : -1;
      a.params = group_params(group);
      const int sum = buf(BufferKind::kDeviceGradSum, group);
      use(a, grad, Access::kRead, Role::kSource, 0, group_bytes(group));
      use(a, sum, micro_ == 0 ? Access::kWrite : Access::kAccumulate, Role::kDest);
      ready = held_[group] = a.id;
      if (!is_layer) resident_save_[group == 0 ? 0 : 1] = a.id;
      if (dev_slot >= 0) dev_grad_consumer_[dev_slot] = a.id;
      grad = sum;
    }
    if (!last) return;
    // Exact mode: the norm's sum of squares over every group at once, after the last
    // backward (device_norm_sum_sq), then the updates.
    if (req_.exact) return pending_.push_back({group, ready, grad});
    emit_device_update({group, ready, grad}, -1);
  }

  // Plan::device_optimizer in exact mode: one sum of squares over every group's gradient on
  // the device, in group order (0 .. L+1, the norm's order), one use per group: one return to
  // the host a step instead of one per group (Backend::sum_squares_spans).
  void device_norm_sum_sq() {
    std::vector<PendingUpdate> by_group = pending_;
    std::sort(by_group.begin(), by_group.end(),
              [](const PendingUpdate& a, const PendingUpdate& b) { return a.group < b.group; });
    std::vector<int> deps;
    for (const PendingUpdate& p : by_group) deps.push_back(p.ready);
    PlanOp& q = add(OpKind::kDeviceGradSumSq, deps);
    for (const PendingUpdate& p : by_group) {
      use(q, p.grad, Access::kRead, Role::kSource, 0,
          plan_.buffers[p.grad].kind == BufferKind::kDeviceGradSum ? held_bytes(p.group)
                                                                   : group_bytes(p.group));
      q.params += group_params(p.group);
    }
    sum_sq_ops_.push_back(q.id);
  }

  // AdamW of group p.group on the device, from its gradient in buffer p.grad into its weights
  // there, after op p.ready and the norm (exact mode).
  void emit_device_update(const PendingUpdate& p, int norm_op) {
    const bool is_layer = p.group >= 1 && p.group <= n_layer_;
    PlanOp& u = add(OpKind::kDeviceUpdate, {p.ready, norm_op});
    u.micro = grad_accum_ - 1;
    u.group = p.group;
    u.layer = is_layer ? p.group - 1 : -1;
    u.params = group_params(p.group);
    const bool sum = plan_.buffers[p.grad].kind == BufferKind::kDeviceGradSum;
    use(u, p.grad, Access::kRead, Role::kSource, 0,
        sum ? held_bytes(p.group) : group_bytes(p.group));
    use(u,
        p.group == 0              ? buf(BufferKind::kEmbedWeights)
        : p.group == n_layer_ + 1 ? buf(BufferKind::kFinalWeights)
                                  : buf(BufferKind::kWeightSlot, p.group - 1),
        Access::kAccumulate, Role::kDest);
    use(u, buf(BufferKind::kDeviceOptim, p.group), Access::kAccumulate, Role::kState);
    const PlanBuffer& g = plan_.buffers[p.grad];
    if (g.kind == BufferKind::kGradSlot) dev_grad_consumer_[g.index] = u.id;
    if (is_layer) use_weights(p.group - 1, u.id);
  }

  // Exact mode: an op of `kind` (kGradSumSq, kDeviceGradSumSq) that sums the squares of group
  // `group`'s gradient, the first `bytes` of buffer `grad`, after op `after`: the group's share
  // of the norm. Returns its id.
  int sum_sq_op(OpKind kind, int group, int after, int grad, uint64_t bytes) {
    PlanOp& q = add(kind, {after});
    q.group = group;
    q.layer = group >= 1 && group <= n_layer_ ? group - 1 : -1;
    q.params = group_params(group);
    use(q, grad, Access::kRead, Role::kSource, 0, bytes);
    sum_sq_ops_.push_back(q.id);
    return q.id;
  }
  // Plan::device_sum_squares: from the gradient in device buffer `grad` (the group's own size),
  // on the compute queue after op `producer` made it.
  int device_sum_sq(int group, int producer, int grad) {
    return sum_sq_op(OpKind::kDeviceGradSumSq, group, producer, grad, group_bytes(group));
  }
  // From `grad` in host memory after op `after` (all of its buffer but in a host gradient
  // slot, the largest group's); the update waits for the norm and for op `ready`.
  void sum_sq_then_pend(int group, int after, int grad, int ready) {
    const int q = sum_sq_op(OpKind::kGradSumSq, group, after, grad, held_bytes(group));
    consumed(grad, q, /*add_user=*/true);
    pending_.push_back({group, ready, grad});
  }

  // Plan::accum_fp32: group `group`'s gradient of this micro-batch, made afresh by op
  // `producer` (in device gradient slot `dev_slot` for a layer), saved to a host gradient
  // slot and added into the group's fp32 sum: a host buffer, or a staging slot between reads
  // and writes of its SSD extent. After the last micro-batch the sum is the update's
  // gradient (exact mode: its sum of squares first; a sum on SSD is read back for the update).
  void save_and_sum(int group, int producer, int dev_slot) {
    const bool is_layer = group >= 1 && group <= n_layer_, first = micro_ == 0,
               last = micro_ == grad_accum_ - 1;
    const int hs = host_grad_rr_++ % plan_.pools.host_grad_slots;
    const int slot = buf(BufferKind::kHostGradSlot, hs);
    PlanOp& s =
        save_op(group, {producer, host_grad_consumer_[hs]}, grads_on_device(group, dev_slot), slot);
    const int save_id = s.id;
    if (dev_slot >= 0) dev_grad_consumer_[dev_slot] = save_id;
    if (!is_layer) resident_save_[group == 0 ? 0 : 1] = save_id;
    const bool on_ssd = is_layer && plan_.layers[group - 1].grads == Tier::kSsd;
    std::vector<int> deps = {save_id, held_[group]};
    int sum = -1, stage = -1;
    if (!on_ssd) {
      sum = group == 0              ? buf(BufferKind::kEmbedGradHold)
            : group == n_layer_ + 1 ? buf(BufferKind::kFinalGradHold)
                                    : buf(BufferKind::kGradHold, group - 1);
    } else {
      std::vector<int> rdeps = {held_[group]};
      stage = take_stage(rdeps);
      sum = buf(BufferKind::kGradStage, stage);
      if (first) {
        deps.insert(deps.end(), rdeps.begin(), rdeps.end());
      } else {  // the sum so far back from its extent
        PlanOp& r = add(OpKind::kReadGrads, rdeps);
        r.group = group;
        r.layer = group - 1;
        copy(r, buf(BufferKind::kSsdGrads, group - 1), sum);
        deps.push_back(r.id);
      }
    }
    PlanOp& a = add(OpKind::kAccumulateGrads, deps);
    a.group = group;
    a.layer = is_layer ? group - 1 : -1;
    a.params = group_params(group);
    use(a, slot, Access::kRead, Role::kSource, 0, group_bytes(group));
    use(a, sum, first ? Access::kWrite : Access::kAccumulate, Role::kDest, 0, held_bytes(group));
    const int acc = a.id;
    host_grad_consumer_[hs] = acc;
    int ready = acc;
    if (on_ssd) {
      stage_users_[stage] = {acc};
      // To its extent, unless the update reads it from the staging slot right away.
      if (!last || req_.exact) {
        PlanOp& w = add(OpKind::kWriteGrads, {acc});
        w.group = group;
        w.layer = group - 1;
        copy(w, sum, buf(BufferKind::kSsdGrads, group - 1));
        stage_users_[stage] = {w.id};
        ready = w.id;
      }
    }
    held_[group] = ready;
    if (!last) return;
    if (!req_.exact) return emit_update({group, ready, sum}, -1);
    sum_sq_then_pend(group, acc, sum, ready);
  }

  // Micro-batch > 0: the gradient held from the previous micro-batches goes back into the
  // device slot the backward adds to (so the sums are the in-memory ones, term by term).
  int load_grads(int group, int dev_slot) {
    std::vector<int> deps = {held_[group], dev_grad_consumer_[dev_slot]};
    int src = -1;
    if (plan_.layers[group - 1].grads == Tier::kHost) {
      src = buf(BufferKind::kGradHold, group - 1);
    } else {
      std::vector<int> rdeps = {held_[group]};
      const int st = take_stage(rdeps);
      PlanOp& r = add(OpKind::kReadGrads, rdeps);
      r.group = group;
      r.layer = group - 1;
      src = buf(BufferKind::kGradStage, st);
      copy(r, buf(BufferKind::kSsdGrads, group - 1), src);
      deps.push_back(r.id);
    }
    PlanOp& ld = add(OpKind::kLoadGrads, deps);
    ld.group = group;
    ld.layer = group - 1;
    copy(ld, src, buf(BufferKind::kGradSlot, dev_slot));
    if (kind_of(src) == BufferKind::kGradStage) stage_users_[plan_.buffers[src].index] = {ld.id};
    return ld.id;
  }

  // The step's last ops: the norm and the updates after it (exact mode), the final group's
  // refresh, and the deferred updates.
  void finish_step() {
    if (req_.exact) {
      // The norm adds the groups' sums of squares in layout order (0 .. L+1), as in-memory
      // training does; the updates then run in the order the next iteration's forward needs
      // them: the resident groups first (embedding, final: their device copies are refreshed
      // on the h2d queue, which must not hold the next weight loads behind the last update),
      // then layers 0 .. L-1.
      if (plan_.device_optimizer) device_norm_sum_sq();
      const int norm = add(OpKind::kGradNorm, sum_sq_ops_).id;
      auto rank = [&](const PendingUpdate& p) {
        return p.group == 0 ? 0 : p.group == n_layer_ + 1 ? 1 : p.group + 1;
      };
      std::sort(pending_.begin(), pending_.end(),
                [&](const PendingUpdate& a, const PendingUpdate& b) { return rank(a) < rank(b); });
      for (const auto& p : pending_)
        plan_.device_optimizer ? emit_device_update(p, norm) : emit_update(p, norm);
    }
    if (final_update_ >= 0) emit_refresh(n_layer_ + 1, final_update_, 0, 1);
    // The deferred updates in the order the next forward needs them (lowest layer first).
    for (auto it = deferred_updates_.rbegin(); it != deferred_updates_.rend(); ++it)
      emit_update(*it, -1);
  }

  const PlanRequest& req_;
  Plan& plan_;
  const int n_layer_, grad_accum_, deferred_;
  const Sizes sizes_;
  std::map<std::pair<BufferKind, int>, int> index_;  // (kind, index) -> buffer id
  int micro_ = 0;                                    // the micro-batch whose ops are being laid out
  int use_seq_ = 0;

  // Weights: device slots, host read staging and weights-out slots.
  std::vector<SlotState> weight_slots_, cslots_;
  int host_read_rr_ = 0, host_wout_rr_ = 0, host_ckpt_rr_ = 0;
  std::vector<int> host_read_consumer_;
  // The layer each read slot holds this step (-1: none yet) and the read that filled it.
  std::vector<int> host_read_holds_, host_read_fill_;
  std::vector<int> host_wout_writer_;
  // The layer whose weights of this step each weights-out slot holds (retained by the
  // previous step's update) until this step's first update into it; -1: none.
  std::vector<int> wout_holds_;
  std::vector<int> host_ckpt_consumer_;

  // Activations.
  std::vector<int> ckpt_producer_;  // op that wrote layer l's input in the forward
  std::vector<int> ckpt_saved_;     // d2h save (host) or ssd write (ssd)
  std::vector<int> fwd_loc_;        // buffer holding layer l's input during the forward
  std::vector<int> stream_readers_[2];

  // Gradients and updates. Host gradient slots rotate between a group's save and its update;
  // in exact mode slot 0 holds the embedding's gradient and slot 1 the final group's until
  // their updates. Held layer gradients live in a per-layer host buffer or go through the
  // staging slots to an SSD extent.
  int grad_rr_ = 0, host_grad_rr_ = 0, stage_rr_ = 0;
  std::vector<int> dev_grad_consumer_, host_grad_consumer_;
  std::vector<std::vector<int>> stage_users_;
  std::vector<int> held_;               // op after which group g's held gradient is complete
  std::vector<PendingUpdate> pending_;  // exact mode: updated after the norm
  std::vector<int> sum_sq_ops_;
  int final_update_ = -1;                        // its refresh is emitted at the step's end
  std::vector<PendingUpdate> deferred_updates_;  // Plan::deferred_updates, emitted at the end
  std::pair<int, int> layer0_save_{-1, -1};      // (producer, slot) saved after the rows first
  int resident_save_[2] = {
      -1, -1};  // accum_fp32: the last saves of the embedding's and final group's gradients
};

}  // namespace

void lay_out_iteration(const PlanRequest& req, Plan& plan) { IterationBuilder(req, plan).build(); }

}  // namespace plan_detail

Plan make_forward_plan(const Plan& train) {
  Plan p = train;
  p.forward_only = true;
  p.ops.clear();
  // The forward alone reads nothing of the request: only the backward and the step's end
  // (exact mode, rows first, the head's chunking) do.
  const PlanRequest no_request;
  plan_detail::IterationBuilder(no_request, p).build_forward_only();
  return p;
}
}  // namespace fuyou
