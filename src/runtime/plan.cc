// The planner: places state in the memory tiers within the budgets and sizes the slot pools
// (here), then lays out one iteration's operations per resource with their dependencies
// (plan_ops.cc).
#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>

#include "fuyou/error.h"
#include "fuyou/model.h"
#include "fuyou/plan.h"
#include "fuyou/sizes.h"
#include "plan_internal.h"

namespace fuyou {

using namespace plan_detail;

uint64_t embed_rows_first_params(const Plan& plan) {
  const ModelConfig& m = plan.model;
  const uint64_t C = m.d_model, V = m.vocab_size;
  const uint64_t rows = std::min<uint64_t>(static_cast<uint64_t>(plan.micro_batch) * m.seq_len, V);
  return rows * C + (make_gpt_layout(m).groups.front().numel - V * C);
}

ParamRange part_range(size_t numel, int part, int parts) {
  const size_t blocks = (numel + 1023) / 1024;
  auto at = [&](int p) { return std::min(numel, blocks * p / parts * 1024); };
  return {at(part), at(part + 1)};
}

namespace {

uint64_t device_bytes(const std::vector<PlanBuffer>& device) { return sum_buffers(device).device_bytes; }

// Places one plan's state in the memory tiers within the budgets and sizes its slot pools,
// for a given number of deferred updates: everything of a Plan but its buffer table and ops.
// `host_used` counts the host memory placed so far, as the buffer table will sum it.
class Placer {
 public:
  Placer(const PlanRequest& req, int deferred)
      : req_(req), L_(req.model.n_layer), sz_(compute_sizes(req.model, req.micro_batch, req.tensors, req.attention_keys)), D_(deferred),
        hold_(req.exact || req.grad_accum > 1),
        accum_fp32_(req.accum_fp32 && req.grad_accum > 1 && req.tensors != ElemType::kF32),
        held_(held_grad_bytes(accum_fp32_, sz_.es, sz_.weights)),
        dev_budget_(req.device_budget ? req.device_budget : UINT64_MAX),
        host_budget_(req.host_budget ? req.host_budget : UINT64_MAX) {}

  Plan place() {
    plan_.model = req_.model;
    plan_.micro_batch = req_.micro_batch;
    plan_.tensors = req_.tensors;
    plan_.attention_keys = req_.attention_keys;
    plan_.exact = req_.exact;
    plan_.optim_format = req_.optim_format;
    if (req_.grad_accum < 1) throw ConfigError(str("schedule.grad_accum is ", req_.grad_accum, "; it must be at least 1"));
    plan_.grad_accum = req_.grad_accum;
    plan_.accum_fp32 = accum_fp32_;
    plan_.layers.resize(L_);
    const std::vector<ActPlacement> acts = decide_activations();
    for (int l = 0; l < L_; ++l) plan_.layers[l].act = acts[l];
    size_device_pools(acts);
    count_fixed_host(acts);
    place_weights();
    place_held_grads();
    place_optimizer_state();
    buy_weight_slots();
    retain_weights();
    check_host_budget();
    // The embedding's save, update and refresh go in parts where they pay (a large
    // embedding) and where the optimizer can update a range (state in host memory).
    // Not with fp32 sums: the update reads the whole sum after the last micro-batch's
    // accumulation, which goes as one op.
    plan_.embed_parts = req_.exact || accum_fp32_ || plan_.embed_optim != StateTier::kHost ? 1
                        : req_.embed_parts > 0                              ? req_.embed_parts
                        : sz_.embed >= (16ull << 20)                        ? kEmbedParts
                                                                            : 1;
    plan_.embed_rows_first =
        req_.embed_rows_first && plan_.embed_parts > 1 && req_.optim_format.moments != MomentFormat::kInt8;
    return plan_;
  }

  uint64_t host_used() const { return host_used_; }

 private:
  // Per-layer activation placement: the request's, or (auto) kept layers demoted, last first
  // (they are needed first in the backward), until the minimal pools fit the device budget;
  // checkpoints then move to the host, then to SSD.
  std::vector<ActPlacement> decide_activations() {
    std::vector<ActPlacement> acts = req_.acts;
    if (!acts.empty() && static_cast<int>(acts.size()) != L_)
      throw Error(str("plan: ", acts.size(), " activation decisions for ", L_, " layers"));
    const bool auto_acts = acts.empty();
    if (auto_acts) acts.assign(L_, req_.default_act);
    for (int l = 0; l < L_; ++l) {
      if (acts[l] == ActPlacement::kSsd && !req_.have_ssd)
        throw ConfigError(str("layer ", l, ": activations to SSD need offload.ssd_paths"));
      if (acts[l] == ActPlacement::kRecompute && (l == 0 || acts[l - 1] == ActPlacement::kRecompute))
        throw ConfigError(str("layer ", l, ": 'recompute' rebuilds the input from layer ", l - 1,
                              "'s checkpoint, so layer 0 and two recomputed layers in a row are not allowed"));
    }
    min_dw_ = std::count(acts.begin(), acts.end(), ActPlacement::kRecompute) > 0 ? 3 : 2;
    if (!auto_acts) return acts;
    for (ActPlacement next : {ActPlacement::kDevice, ActPlacement::kHost, ActPlacement::kSsd}) {
      if (next == ActPlacement::kSsd && !req_.have_ssd) break;
      for (int l = L_ - 1; l >= 0 && device_need(acts, min_dw_, 2, 1) > dev_budget_; --l)
        if (static_cast<int>(acts[l]) < static_cast<int>(next)) acts[l] = next;
    }
    return acts;
  }

  // Host bytes of the optimizer state of `tensor_bytes` of device tensors (one group).
  uint64_t state_bytes(uint64_t tensor_bytes) const { return optim_state_bytes(req_.optim_format, tensor_bytes / sz_.es); }

  uint64_t device_need(const std::vector<ActPlacement>& acts, int dw, int dc, int dg) const {
    return device_bytes(device_buffers(req_.model, req_.micro_batch, req_.tensors, acts, dw, dc, dg));
  }

  // The device pools: weight, checkpoint and gradient slots, as many as fit (4, 3, 2 at
  // most), at least the minimum; else an error with the smallest budget that would do.
  void size_device_pools(const std::vector<ActPlacement>& acts) {
    const uint64_t minimal = device_need(acts, min_dw_, 2, 1);
    if (minimal > dev_budget_) {
      std::vector<ActPlacement> leanest(L_, req_.have_ssd ? ActPlacement::kSsd : ActPlacement::kHost);
      std::string detail;
      for (auto& [n, b] : sum_buffers(device_buffers(req_.model, req_.micro_batch, req_.tensors, acts, min_dw_, 2, 1)).device_parts)
        detail += str("\n  ", n, ": ", format_size(b));
      // The whole micro-batch's logits are often the largest buffer: say what chunking them saves.
      std::string hint;
      const int N = req_.micro_batch * req_.model.seq_len, chunk = 1024;
      if (head_chunk_rows(req_.model, req_.micro_batch) == N && N > chunk) {
        ModelConfig m = req_.model;
        m.head_chunk_tokens = chunk;
        hint = str("\n  the same with model.head_chunk_tokens: ", chunk, " (the LM head in chunks, docs/config.md): ",
                   format_size(device_bytes(device_buffers(m, req_.micro_batch, req_.tensors, leanest, 2, 2, 1))));
      }
      throw Error(str("device memory: the plan needs at least ", format_size(minimal),
                      " but offload.device_memory is ", format_size(dev_budget_), ":", detail,
                      "\n  smallest device budget that runs this model at micro_batch ", req_.micro_batch, ": ",
                      format_size(device_need(leanest, 2, 2, 1)), hint));
    }
    int dw = 4, dc = 3, dg = 2;
    while (device_need(acts, dw, dc, dg) > dev_budget_) {
      if (dw > min_dw_) --dw;
      else if (dc > 2) --dc;
      else if (dg > 1) --dg;
      else break;
    }
    plan_.pools.device_weight_slots = dw;
    plan_.pools.device_ckpt_slots = dc;
    plan_.pools.device_grad_slots = dg;
    device_total_ = device_need(acts, dw, dc, dg);
  }

  // What the host holds whatever the tiers: the process, the device arena where it is host
  // memory (PlanRequest::device_in_host: the CPU backend), host checkpoints, gradient slots,
  // checkpoint staging, the deferred updates' gradient slots and the resident groups' host
  // weights.
  void count_fixed_host(const std::vector<ActPlacement>& acts) {
    host_fixed_ = kProcessBaseline + (req_.device_in_host ? device_total_ : 0);
    // 16-bit tensors: the checkpoint state staging, and on the CPU backend its kernels' fp32
    // views (plan_buffers.cc).
    if (sz_.es < 4) host_fixed_ += 4 * std::max(sz_.weights, std::max(sz_.embed, sz_.final)) / sz_.es;
    if (sz_.es < 4 && req_.device_in_host) host_fixed_ += cpu_kernel_scratch_bytes(req_.model, req_.micro_batch);
    uint64_t ssd_ckpt_layers = 0;
    for (ActPlacement x : acts) {
      if (x == ActPlacement::kHost) host_ckpt_ += sz_.ckpt;
      if (x == ActPlacement::kSsd) ++ssd_ckpt_layers;
    }
    // Staging for checkpoints on SSD: a forward's save waits for the write of the checkpoint
    // that last used its slot, and writes queue behind whatever else the disk writes (a
    // layer's updated weights: tens of MB). One slot per SSD checkpoint lets the forward run
    // on while the writes drain, when they take at most 1/16 of the host budget; else 2.
    if (ssd_ckpt_layers) {
      const uint64_t want = ssd_ckpt_layers * static_cast<uint64_t>(req_.grad_accum);
      const uint64_t fit = host_budget_ / 16 / std::max<uint64_t>(sz_.ckpt, 1);
      plan_.pools.host_ckpt_slots = static_cast<int>(std::clamp<uint64_t>(std::min(want, fit), 2, 1024));
    }
    // Two host gradient slots of the largest group: rotated between a layer's gradients and
    // its update, or (exact mode) holding the embedding's and the final group's until theirs.
    plan_.pools.host_grad_slots = 2;
    grad_slots_bytes_ = 2 * std::max(sz_.weights, std::max(sz_.embed, sz_.final));
    // Deferring the top layers' updates (Plan::deferred_updates) holds each one's gradient
    // through the next forward in a host slot of its own.
    if (D_ && hold_)
      throw ConfigError(str("offload.deferred_updates is ", D_, ", but this step holds its gradients until ",
                            req_.exact ? "the global norm is known (exact mode: optimizer.grad_clip > 0 or fp16)"
                                       : str("all ", req_.grad_accum, " micro-batches are done (schedule.grad_accum)"),
                            "; use auto or 0"));
    if (D_ >= L_)
      throw ConfigError(str("offload.deferred_updates is ", D_, " but the model has ", L_, " layers: at most ", L_ - 1,
                            " (layer 0's update must precede the next forward)"));
    plan_.deferred_updates = D_;
    plan_.pools.host_grad_stage_slots = D_;
    host_used_ = host_fixed_ + host_ckpt_ + plan_.pools.host_ckpt_slots * sz_.ckpt + grad_slots_bytes_ +
                 plan_.pools.host_grad_stage_slots * sz_.weights + sz_.embed + sz_.final;
    // fp32 sums: the embedding's and final group's are held in host memory.
    if (accum_fp32_) {
      host_grad_hold_ = held_grad_bytes(true, sz_.es, sz_.embed) + held_grad_bytes(true, sz_.es, sz_.final);
      host_used_ += host_grad_hold_;
    }
  }

  // Host memory that choosing SSD for anything adds: weight staging (4 layers' worth), the
  // optimizer's chunk slots and, with held gradients, their staging.
  uint64_t ssd_overhead(uint64_t staging_layers) const {
    return req_.have_ssd ? staging_layers * sz_.weights + ooc_chunk_pool_bytes() : 0;
  }

  // Layer weights on the host while they fit, else on SSD. First,
  // the updates of the embedding and of layers 0 and 1 are the last of an iteration (at or
  // after the last layer backward, which is short beside an update streaming its state) and
  // the next iteration's forward starts with their results, so their state's SSD traffic
  // would lie on the critical path between iterations, where nothing else runs: their
  // optimizer state takes host memory before any layer's weights, when it fits beside the
  // SSD staging that the layers would then need.
  void place_weights() {
    for (uint64_t state : {state_bytes(sz_.embed), state_bytes(sz_.weights), state_bytes(sz_.weights)}) {
      if (!req_.have_ssd || req_.optim_on_ssd ||
          host_used_ + state + 4 * sz_.weights + ooc_chunk_pool_bytes() + (hold_ ? 2 * held_ : 0) > host_budget_)
        break;
      host_used_ += state;
      ++tail_groups_;
    }
    for (int l = 0; l < L_; ++l) {
      const bool fits = !req_.weights_on_ssd &&
                        host_used_ + sz_.weights + ssd_overhead(4) + (hold_ && req_.have_ssd ? 2 * held_ : 0) <=
                            host_budget_;
      if (fits || !req_.have_ssd) {
        plan_.layers[l].weights = StateTier::kHost;
        host_used_ += sz_.weights;
      } else {
        plan_.layers[l].weights = StateTier::kSsd;
        ++ssd_weight_layers_;
      }
    }
    if (ssd_weight_layers_) {
      plan_.pools.host_weight_slots = 2;
      plan_.pools.host_wout_slots = 2;
      host_used_ += 4 * sz_.weights;
    }
  }

  // Held gradients (exact mode, grad_accum > 1): a host buffer per layer while they fit,
  // else an SSD extent staged through two host slots. Placed after the weights and before
  // the optimizer state: holding a gradient on SSD costs one write and one read of it per
  // micro-batch boundary (or per step in exact mode), as a layer's weights on SSD do.
  void place_held_grads() {
    if (req_.grads_on_ssd && !req_.have_ssd) throw ConfigError("gradients on SSD need offload.ssd_paths");
    int ssd_grad_layers = 0;
    for (int l = 0; hold_ && l < L_; ++l) {
      const bool fits = !req_.grads_on_ssd && host_used_ + held_ + (req_.have_ssd ? 2 * held_ : 0) +
                                                  ssd_overhead(0) <= host_budget_;
      if (fits || !req_.have_ssd) {
        plan_.layers[l].grads = StateTier::kHost;
        host_used_ += held_;
        host_grad_hold_ += held_;
      } else {
        plan_.layers[l].grads = StateTier::kSsd;
        ++ssd_grad_layers;
      }
    }
    if (ssd_grad_layers) {
      plan_.pools.host_grad_stage_slots = 2;
      host_used_ += 2 * held_;
    }
  }

  // Optimizer state with what is left, group by group (place_optimizer_state); without SSD
  // every group stays on the host (check_host_budget then reports the total).
  void place_optimizer_state() {
    std::vector<OptimGroup> groups;
    for (const ParamGroup& g : make_gpt_layout(req_.model).groups) groups.push_back({g.name, g.numel, {}});
    uint64_t optim_budget = 0;
    if (req_.have_ssd) host_used_ += ooc_chunk_pool_bytes();
    if (!req_.optim_on_ssd && host_used_ < host_budget_) optim_budget = host_budget_ - host_used_;
    if (req_.optim_on_ssd && !req_.have_ssd) throw ConfigError("optimizer state on SSD needs offload.ssd_paths");
    std::vector<StateTier> tiers;
    if (!req_.have_ssd) {
      tiers.assign(groups.size(), StateTier::kHost);
    } else {
      tiers = fuyou::place_optimizer_state(std::vector<OptimGroup>(groups.begin() + tail_groups_, groups.end()),
                                           optim_budget, true, req_.optim_format);
      tiers.insert(tiers.begin(), tail_groups_, StateTier::kHost);
      if (req_.spread_host_state) spread_host_layers(tiers);
    }
    for (size_t g = tail_groups_; g < groups.size(); ++g)
      if (tiers[g] == StateTier::kHost) host_used_ += optim_state_bytes(req_.optim_format, groups[g].numel);
    plan_.embed_optim = tiers.front();
    plan_.final_optim = tiers.back();
    for (int l = 0; l < L_; ++l) plan_.layers[l].optim = tiers[1 + l];
  }

  // The same number of host-state layers above the tail (layers are equal in size: the same
  // bytes), spread evenly from the top: layer j-th from the top is on the host where
  // floor((j + 1) k / n) > floor(j k / n), so the lowest is on the host and no two SSD
  // layers are adjacent while k >= n - k.
  void spread_host_layers(std::vector<StateTier>& tiers) const {
    const int first = std::max(0, tail_groups_ - 1), n = L_ - first;  // layers first .. L-1
    int k = 0;
    for (int l = first; l < L_; ++l) k += tiers[1 + l] == StateTier::kHost;
    for (int j = 0; j < n; ++j)
      tiers[L_ - j] = (static_cast<int64_t>(j + 1) * k / n > static_cast<int64_t>(j) * k / n) ? StateTier::kHost
                                                                                             : StateTier::kSsd;
  }

  // Host memory left after the optimizer state buys more weight slots, up to one per
  // SSD-weight layer each: weights-out slots first (an update waits for a free one, that is
  // for the SSD write of an earlier update: the optimizer then runs at the disk's write
  // speed and the embedding's update, last, with it), then read-ahead (the forward's reads
  // run further ahead of their layers, and a read whose write is done can pass one still
  // waiting for its write: the SSD queues reorder, reorders()).
  void buy_weight_slots() {
    for (int* slots : {&plan_.pools.host_wout_slots, &plan_.pools.host_weight_slots}) {
      if (ssd_weight_layers_ <= 2 || host_used_ >= host_budget_) break;
      const uint64_t extra = std::min<uint64_t>((host_budget_ - host_used_) / sz_.weights, ssd_weight_layers_ - 2);
      *slots += static_cast<int>(extra);
      host_used_ += extra * sz_.weights;
    }
  }

  // The updates write new weights to the weights-out slots in turn, layers L-1 .. 0 (of
  // those on SSD): the last one per slot stays there until the next step uses it (retained),
  // so the next forward, and the backward until the slot is written again, load those
  // layers from host memory instead of reading back what was just written.
  void retain_weights() {
    if (!ssd_weight_layers_ || req_.exact) return;
    std::vector<int> order;  // SSD-weight layers in update order
    for (int l = L_ - 1 - D_; l >= 0; --l)
      if (plan_.layers[l].weights == StateTier::kSsd) order.push_back(l);
    for (int l = L_ - D_; l < L_; ++l)  // the deferred ones, in forward order (emitted so)
      if (plan_.layers[l].weights == StateTier::kSsd) order.push_back(l);
    const int n = static_cast<int>(order.size()), w = plan_.pools.host_wout_slots;
    for (int i = std::max(0, n - w); i < n; ++i) plan_.layers[order[i]].retained = i % w;
  }

  void check_host_budget() const {
    if (host_used_ <= host_budget_) return;
    const uint64_t rest = host_used_ - host_fixed_ - grad_slots_bytes_ - host_grad_hold_ - host_ckpt_ - sz_.embed - sz_.final;
    throw Error(str("host memory: the plan needs ", format_size(host_used_), " but offload.host_memory is ",
                    format_size(host_budget_), " (", format_size(host_fixed_), " process and device arena, ",
                    format_size(grad_slots_bytes_), " gradient slots, ",
                    hold_ ? str(format_size(host_grad_hold_), " held gradients (",
                                accum_fp32_ ? "fp32 sums over micro-batches" : req_.exact ? "exact mode" : "gradient accumulation",
                                "), ")
                          : std::string(),
                    format_size(host_ckpt_), " host checkpoints, ", format_size(sz_.embed + sz_.final),
                    " embedding copy, ", format_size(rest), " weights, optimizer state and staging)",
                    req_.have_ssd ? "" : "; configure offload.ssd_paths to move weights and optimizer state to SSD"));
  }

  const PlanRequest& req_;
  const int L_;
  const Sizes sz_;
  const int D_;
  const bool hold_;
  const bool accum_fp32_;  // Plan::accum_fp32
  const uint64_t held_;    // one layer's held gradient (held_grad_bytes)
  const uint64_t dev_budget_, host_budget_;
  Plan plan_;
  int min_dw_ = 2;
  uint64_t device_total_ = 0;
  uint64_t host_used_ = 0, host_fixed_ = 0, host_ckpt_ = 0, grad_slots_bytes_ = 0, host_grad_hold_ = 0;
  int tail_groups_ = 0;  // groups 0 .. tail_groups_-1 have their optimizer state on the host
  int ssd_weight_layers_ = 0;
};

// A plan for `deferred` deferred updates: placement, buffer table, ops.
Plan plan_with(const PlanRequest& req, int deferred) {
  Placer placer(req, deferred);
  Plan plan = placer.place();
  plan.buffers = buffer_table(plan, req.have_ssd, req.device_in_host);
  plan.memory = sum_buffers(plan.buffers);
  plan.memory.device_in_host = req.device_in_host;
  FY_CHECK(plan.memory.host_bytes == placer.host_used(), "the buffer table counts ", plan.memory.host_bytes,
           " host bytes, the placement ", placer.host_used());
  lay_out_iteration(req, plan);
  return plan;
}

int state_groups_on_ssd(const Plan& p) {
  int n = (p.embed_optim == StateTier::kSsd) + (p.final_optim == StateTier::kSsd);
  for (const LayerDecision& d : p.layers) n += d.optim == StateTier::kSsd;
  return n;
}

}  // namespace

bool update_has_cores(const Plan& plan, const PlanOp& u) {
  return (u.group == 0 && !(plan.embed_rows_first && u.part >= 0)) || u.group == 1 ||
         (plan.exact && u.group == plan.model.n_layer + 1);
}

Plan make_plan(const PlanRequest& req) {
  if (req.deferred_updates >= 0) return plan_with(req, req.deferred_updates);
  // Auto: the top layer's update deferred where it streams its state from SSD, the forward
  // leaves the disk to it (no weights are read from SSD: with weight reads the deferred
  // update and the next forward's reads share the disk, and the forward waits; measured in
  // docs/performance.md), and the slot its gradient waits in moves no optimizer state to SSD.
  Plan plain = plan_with(req, 0);
  if (plain.holds_grads() || plain.model.n_layer < 2 || plain.layers.back().optim != StateTier::kSsd) return plain;
  for (const PlanOp& op : plain.ops)
    if (op.kind == OpKind::kReadWeights) return plain;
  Plan deferred;
  try {
    deferred = plan_with(req, 1);
  } catch (const Error&) {
    return plain;
  }
  return state_groups_on_ssd(deferred) <= state_groups_on_ssd(plain) ? deferred : plain;
}

}  // namespace fuyou
