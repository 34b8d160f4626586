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

using plan_detail::compute_sizes;
using plan_detail::lay_out_iteration;
using plan_detail::Sizes;

namespace {

// The out-of-core optimizer's chunk slots: 9 x 4 MiB (see ooc_adamw.cc).
constexpr uint64_t kOptimChunkPool = 9ull * (4ull << 20);

}  // namespace

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

Plan make_plan(const PlanRequest& req) {
  if (req.deferred_updates < 0) {
    // Auto: the top layer's update deferred where it streams its state from SSD, the forward
    // leaves the disk to it (no weights are read from SSD: with weight reads the deferred
    // update and the next forward's reads share the disk, and the forward waits; measured in
    // docs/performance.md), and the slot its gradient waits in moves no optimizer state to SSD.
    PlanRequest off = req;
    off.deferred_updates = 0;
    Plan plain = make_plan(off);
    if (plain.holds_grads() || plain.model.n_layer < 2 || plain.layers.back().optim != StateTier::kSsd) return plain;
    for (const PlanOp& op : plain.ops)
      if (op.kind == OpKind::kReadWeights) return plain;
    PlanRequest on = req;
    on.deferred_updates = 1;
    Plan deferred;
    try {
      deferred = make_plan(on);
    } catch (const Error&) {
      return plain;
    }
    auto state_on_ssd = [](const Plan& p) {
      int n = (p.embed_optim == StateTier::kSsd) + (p.final_optim == StateTier::kSsd);
      for (const LayerDecision& d : p.layers) n += d.optim == StateTier::kSsd;
      return n;
    };
    return state_on_ssd(deferred) <= state_on_ssd(plain) ? deferred : plain;
  }
  const ModelConfig& m = req.model;
  const int L = m.n_layer;
  Plan plan;
  plan.model = m;
  plan.micro_batch = req.micro_batch;
  plan.exact = req.exact;
  if (req.grad_accum < 1) throw ConfigError(str("schedule.grad_accum is ", req.grad_accum, "; it must be at least 1"));
  plan.grad_accum = req.grad_accum;
  const int K = req.grad_accum;
  const bool hold = plan.holds_grads();
  const Sizes sz = compute_sizes(m, req.micro_batch);
  const uint64_t dev_budget = req.device_budget ? req.device_budget : UINT64_MAX;
  const uint64_t host_budget = req.host_budget ? req.host_budget : UINT64_MAX;

  // ---- activation decisions --------------------------------------------------------------
  std::vector<ActPlacement> acts = req.acts;
  if (!acts.empty() && static_cast<int>(acts.size()) != L)
    throw Error(str("plan: ", acts.size(), " activation decisions for ", L, " layers"));
  const bool auto_acts = acts.empty();
  if (auto_acts) acts.assign(L, req.default_act);
  for (int l = 0; l < L; ++l) {
    if (acts[l] == ActPlacement::kSsd && !req.have_ssd)
      throw ConfigError(str("layer ", l, ": activations to SSD need offload.ssd_paths"));
    if (acts[l] == ActPlacement::kRecompute && (l == 0 || acts[l - 1] == ActPlacement::kRecompute))
      throw ConfigError(str("layer ", l, ": 'recompute' rebuilds the input from layer ", l - 1,
                            "'s checkpoint, so layer 0 and two recomputed layers in a row are not allowed"));
  }

  // ---- device memory -----------------------------------------------------------------------
  bool any_recompute = std::count(acts.begin(), acts.end(), ActPlacement::kRecompute) > 0;
  auto device_need = [&](const std::vector<ActPlacement>& a, int dw, int dc, int dg, MemoryPlan* mp) {
    uint64_t total = 0;
    auto part = [&](const std::string& name, uint64_t b) {
      total += b;
      if (mp && b) mp->device_parts.push_back({name, b});
    };
    part("embedding + final norm: weights and gradients", 2 * (sz.embed + sz.final));
    part("model workspace (logits, head, backward scratch)", sz.workspace);
    part("forward stream buffers (2)", 2 * sz.ckpt);
    // The executor's residual-gradient buffer (N x C) is counted with the scratch.
    part("working activations + recompute scratch + residual gradient", sz.acts + 2 * sz.ckpt);
    uint64_t keep = 0, dev = 0;
    for (ActPlacement x : a) {
      if (x == ActPlacement::kKeep) keep += sz.acts + sz.ckpt;
      if (x == ActPlacement::kDevice) dev += sz.ckpt;
    }
    part("kept activations", keep);
    part("checkpoints on device", dev);
    part(str("weight slots (", dw, ")"), dw * sz.weights);
    part(str("checkpoint slots (", dc, ")"), dc * sz.ckpt);
    part(str("gradient slots (", dg, ")"), dg * sz.weights);
    return total;
  };
  int min_dw = any_recompute ? 3 : 2;
  int dw = 4, dc = 3, dg = 2;
  if (auto_acts) {
    // Demote kept layers (last first: they are needed first in the backward) until the
    // minimal pools fit; checkpoints then move to the host, then to SSD.
    for (ActPlacement next : {ActPlacement::kDevice, ActPlacement::kHost, ActPlacement::kSsd}) {
      if (next == ActPlacement::kSsd && !req.have_ssd) break;
      for (int l = L - 1; l >= 0 && device_need(acts, min_dw, 2, 1, nullptr) > dev_budget; --l)
        if (static_cast<int>(acts[l]) < static_cast<int>(next)) acts[l] = next;
    }
  }
  uint64_t minimal = device_need(acts, min_dw, 2, 1, nullptr);
  if (minimal > dev_budget) {
    std::vector<ActPlacement> leanest(L, req.have_ssd ? ActPlacement::kSsd : ActPlacement::kHost);
    MemoryPlan parts;
    device_need(acts, min_dw, 2, 1, &parts);
    std::string detail;
    for (auto& [n, b] : parts.device_parts) detail += str("\n  ", n, ": ", format_size(b));
    throw Error(str("device memory: the plan needs at least ", format_size(minimal),
                    " but offload.device_memory is ", format_size(dev_budget), ":", detail,
                    "\n  smallest device budget that runs this model at micro_batch ", req.micro_batch,
                    ": ", format_size(device_need(leanest, 2, 2, 1, nullptr))));
  }
  while (device_need(acts, dw, dc, dg, nullptr) > dev_budget) {
    if (dw > min_dw) --dw;
    else if (dc > 2) --dc;
    else if (dg > 1) --dg;
    else break;
  }
  plan.pools.device_weight_slots = dw;
  plan.pools.device_ckpt_slots = dc;
  plan.pools.device_grad_slots = dg;
  plan.memory.device_bytes = device_need(acts, dw, dc, dg, &plan.memory);

  // ---- host memory: weights, checkpoints, optimizer state ---------------------------------
  // The only backend is the CPU's, whose "device" memory is process memory: it counts
  // against the host budget too.
  uint64_t host_fixed = kProcessBaseline + plan.memory.device_bytes;
  uint64_t host_ckpt = 0, ssd_ckpt_layers = 0;
  for (ActPlacement x : acts) {
    if (x == ActPlacement::kHost) host_ckpt += sz.ckpt;
    if (x == ActPlacement::kSsd) ++ssd_ckpt_layers;
  }
  const uint64_t all_params = L * sz.weights + sz.embed + sz.final;  // bytes of fp32 weights
  // Staging for checkpoints on SSD: a forward's save waits for the write of the checkpoint
  // that last used its slot, and writes queue behind whatever else the disk writes (a
  // layer's updated weights: tens of MB). One slot per SSD checkpoint lets the forward run
  // on while the writes drain, when they take at most 1/16 of the host budget; else 2.
  plan.pools.host_ckpt_slots = 0;
  if (ssd_ckpt_layers) {
    const uint64_t want = ssd_ckpt_layers * static_cast<uint64_t>(K);
    const uint64_t fit = host_budget / 16 / std::max<uint64_t>(sz.ckpt, 1);
    plan.pools.host_ckpt_slots = static_cast<int>(std::clamp<uint64_t>(std::min(want, fit), 2, 1024));
  }
  // Two host gradient slots of the largest group: rotated between a layer's gradients and
  // its update, or (exact mode) holding the embedding's and the final group's until theirs.
  plan.pools.host_grad_slots = 2;
  uint64_t grad_slots_bytes = 2 * std::max(sz.weights, std::max(sz.embed, sz.final));
  // Deferring the top layers' updates (Plan::deferred_updates; make_plan's auto above
  // decides) holds each one's gradient through the next forward in a host slot of its own.
  const int D = req.deferred_updates > 0 ? req.deferred_updates : 0;
  if (D && hold)
    throw ConfigError(str("offload.deferred_updates is ", D, ", but this step holds its gradients until ",
                          req.exact ? "the global norm is known (exact mode: optimizer.grad_clip > 0 or fp16)"
                                    : str("all ", K, " micro-batches are done (schedule.grad_accum)"),
                          "; use auto or 0"));
  if (D >= L)
    throw ConfigError(str("offload.deferred_updates is ", D, " but the model has ", L,
                          " layers: at most ", L - 1, " (layer 0's update must precede the next forward)"));
  plan.deferred_updates = D;
  plan.pools.host_grad_stage_slots = D;
  (void)all_params;
  uint64_t host_used = host_fixed + host_ckpt + plan.pools.host_ckpt_slots * sz.ckpt + grad_slots_bytes +
                       plan.pools.host_grad_stage_slots * sz.weights +
                       sz.embed + sz.final;  // host copies of the resident groups' weights
  plan.layers.resize(L);
  for (int l = 0; l < L; ++l) plan.layers[l].act = acts[l];
  // The updates of the embedding and of layers 0 and 1 are the last of an iteration (at or
  // after the last layer backward, which is short beside an update streaming its state)
  // and the next iteration's forward starts with their results, so their state's SSD
  // traffic would lie on the critical path between iterations, where nothing else runs.
  // Their optimizer state takes host memory first, before any layer's weights, when it fits
  // beside the SSD staging that the layers would then need.
  int tail_groups = 0;  // groups 0 .. tail_groups-1 have their optimizer state on the host
  for (uint64_t state : {12 * sz.embed / 4, 12 * sz.weights / 4, 12 * sz.weights / 4}) {
    if (!req.have_ssd || req.optim_on_ssd ||
        host_used + state + 4 * sz.weights + kOptimChunkPool + (hold ? 2 * sz.weights : 0) > host_budget)
      break;
    host_used += state;
    ++tail_groups;
  }
  // Weights: on the host while they fit (4 bytes per parameter), else on SSD.
  int ssd_weight_layers = 0;
  for (int l = 0; l < L; ++l) {
    // Leave room for what choosing SSD for any layer adds: weight staging and the optimizer's
    // chunk slots.
    // Held gradients that end up on SSD add their staging slots too.
    bool fits = !req.weights_on_ssd &&
                host_used + sz.weights +
                        (req.have_ssd ? 4 * sz.weights + kOptimChunkPool + (hold ? 2 * sz.weights : 0) : 0) <=
                    host_budget;
    if (fits || !req.have_ssd) {
      plan.layers[l].weights = StateTier::kHost;
      host_used += sz.weights;
    } else {
      plan.layers[l].weights = StateTier::kSsd;
      ++ssd_weight_layers;
    }
  }
  if (ssd_weight_layers) {
    plan.pools.host_weight_slots = 2;
    plan.pools.host_wout_slots = 2;
    host_used += 4 * sz.weights;
  }
  // Held gradients (exact mode, grad_accum > 1): a host buffer per layer while they fit,
  // else an SSD extent staged through two host slots. Placed after the weights and before
  // the optimizer state: holding a gradient on SSD costs one write and one read of it per
  // micro-batch boundary (or per step in exact mode), as a layer's weights on SSD do.
  uint64_t host_grad_hold = 0;
  int ssd_grad_layers = 0;
  if (req.grads_on_ssd && !req.have_ssd) throw ConfigError("gradients on SSD need offload.ssd_paths");
  for (int l = 0; hold && l < L; ++l) {
    bool fits = !req.grads_on_ssd &&
                host_used + sz.weights + (req.have_ssd ? 2 * sz.weights + kOptimChunkPool : 0) <= host_budget;
    if (fits || !req.have_ssd) {
      plan.layers[l].grads = StateTier::kHost;
      host_used += sz.weights;
      host_grad_hold += sz.weights;
    } else {
      plan.layers[l].grads = StateTier::kSsd;
      ++ssd_grad_layers;
    }
  }
  if (ssd_grad_layers) {
    plan.pools.host_grad_stage_slots = 2;
    host_used += 2 * sz.weights;
  }
  // Optimizer state with what is left.
  std::vector<OptimGroup> groups;
  {
    ParamLayout layout = make_gpt_layout(m);
    for (const ParamGroup& g : layout.groups) groups.push_back({g.name, g.numel, {}});
  }
  uint64_t optim_budget = 0;
  if (req.have_ssd) host_used += kOptimChunkPool;
  if (!req.optim_on_ssd && host_used < host_budget) optim_budget = host_budget - host_used;
  if (req.optim_on_ssd && !req.have_ssd) throw ConfigError("optimizer state on SSD needs offload.ssd_paths");
  // Without SSD every group stays on the host; the host check below then reports the total.
  std::vector<StateTier> tiers;
  if (!req.have_ssd) {
    tiers.assign(groups.size(), StateTier::kHost);
  } else {
    tiers = place_optimizer_state(std::vector<OptimGroup>(groups.begin() + tail_groups, groups.end()), optim_budget, true);
    tiers.insert(tiers.begin(), tail_groups, StateTier::kHost);
  }
  for (size_t g = tail_groups; g < groups.size(); ++g)
    if (tiers[g] == StateTier::kHost) host_used += 12ull * groups[g].numel;
  // Host memory left after the optimizer state buys more weight slots, up to one per
  // SSD-weight layer each: weights-out slots first (an update waits for a free one, that is
  // for the SSD write of an earlier update: the optimizer then runs at the disk's write
  // speed and the embedding's update, last, with it), then read-ahead (the forward's reads
  // run further ahead of their layers, and a read whose write is done can pass one still
  // waiting for its write: the SSD queues reorder, reorders()).
  for (int* slots : {&plan.pools.host_wout_slots, &plan.pools.host_weight_slots}) {
    if (ssd_weight_layers <= 2 || host_used >= host_budget) break;
    const uint64_t extra = std::min<uint64_t>((host_budget - host_used) / sz.weights, ssd_weight_layers - 2);
    *slots += static_cast<int>(extra);
    host_used += extra * sz.weights;
  }
  // The updates write new weights to the weights-out slots in turn, layers L-1 .. 0 (of
  // those on SSD): the last one per slot stays there until the next step uses it (retained),
  // so the next forward, and the backward until the slot is written again, load those
  // layers from host memory instead of reading back what was just written.
  if (ssd_weight_layers && !req.exact) {
    std::vector<int> order;  // SSD-weight layers in update order
    for (int l = L - 1 - D; l >= 0; --l)
      if (plan.layers[l].weights == StateTier::kSsd) order.push_back(l);
    for (int l = L - D; l < L; ++l)  // the deferred ones, in forward order (emitted so below)
      if (plan.layers[l].weights == StateTier::kSsd) order.push_back(l);
    const int n = static_cast<int>(order.size()), w = plan.pools.host_wout_slots;
    for (int i = std::max(0, n - w); i < n; ++i) plan.layers[order[i]].retained = i % w;
  }
  plan.embed_optim = tiers.front();
  plan.final_optim = tiers.back();
  for (int l = 0; l < L; ++l) plan.layers[l].optim = tiers[1 + l];
  if (host_used > host_budget) {
    throw Error(str("host memory: the plan needs ", format_size(host_used), " but offload.host_memory is ",
                    format_size(host_budget), " (", format_size(host_fixed), " process and device arena, ",
                    format_size(grad_slots_bytes), " gradient slots, ",
                    hold ? str(format_size(host_grad_hold), " held gradients (",
                               req.exact ? "exact mode" : "gradient accumulation", "), ")
                         : std::string(),
                    format_size(host_ckpt), " host checkpoints, ", format_size(sz.embed + sz.final),
                    " embedding copy, ",
                    format_size(host_used - host_fixed - grad_slots_bytes - host_grad_hold - host_ckpt - sz.embed -
                                sz.final),
                    " weights, optimizer state and staging)",
                    req.have_ssd ? "" : "; configure offload.ssd_paths to move weights and optimizer state to SSD"));
  }
  plan.memory.host_bytes = host_used;
  auto hpart = [&](const std::string& n, uint64_t b) { if (b) plan.memory.host_parts.push_back({n, b}); };
  hpart("process baseline", kProcessBaseline);
  hpart("device arena (CPU backend: host memory)", plan.memory.device_bytes);
  hpart("host checkpoints", host_ckpt);
  hpart("gradient slots", grad_slots_bytes);
  hpart(req.exact ? "held gradients (exact mode)" : "held gradients (gradient accumulation)", host_grad_hold);
  hpart(D ? "top layers' gradients (deferred updates)" : "held gradient staging",
        plan.pools.host_grad_stage_slots * sz.weights);
  hpart("checkpoint staging", plan.pools.host_ckpt_slots * sz.ckpt);
  uint64_t host_weights = sz.embed + sz.final, host_optim = 0, ssd_w = 0, ssd_o = 0;
  for (int l = 0; l < L; ++l) {
    (plan.layers[l].weights == StateTier::kHost ? host_weights : ssd_w) += sz.weights;
  }
  for (size_t g = 0; g < groups.size(); ++g) (tiers[g] == StateTier::kHost ? host_optim : ssd_o) += 12ull * groups[g].numel;
  hpart("weights", host_weights);
  hpart("weight staging", (plan.pools.host_weight_slots + plan.pools.host_wout_slots) * sz.weights);
  hpart("optimizer state", host_optim);
  hpart("optimizer chunk slots", req.have_ssd ? kOptimChunkPool : 0);
  auto spart = [&](const std::string& n, uint64_t b) { if (b) plan.memory.ssd_parts.push_back({n, b}); };
  spart("weights", ssd_w);
  spart("optimizer state", ssd_o);
  spart("checkpoints", ssd_ckpt_layers * sz.ckpt);
  spart("held gradients", ssd_grad_layers * sz.weights);
  plan.memory.ssd_bytes = ssd_w + ssd_o + ssd_ckpt_layers * sz.ckpt + ssd_grad_layers * sz.weights;

  lay_out_iteration(req, acts, plan);
  return plan;
}

}  // namespace fuyou
