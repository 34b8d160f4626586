// The planner: places state in the memory tiers within the budgets and sizes the slot pools
// (here), then lays out one iteration's operations per resource with their dependencies
// (plan_ops.cc).
#include "fuyou/plan.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>

#include "fuyou/error.h"
#include "fuyou/model.h"
#include "fuyou/sizes.h"
#include "fuyou/train.h"
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

uint64_t device_bytes(const std::vector<PlanBuffer>& device) {
  return sum_buffers(device).device_bytes;
}

// Places one plan's state in the memory tiers within the budgets and sizes its slot pools,
// for a given number of deferred updates: everything of a Plan but its ops. Each buffer goes
// into the table as it is placed; what is placed so far is the table's sum (host_used()).
class Placer {
 public:
  Placer(const PlanRequest& req, int deferred)
      : req_(req),
        n_layer_(req.model.n_layer),
        sizes_(compute_sizes(req.model, req.micro_batch, req.tensors, req.attention_keys)),
        deferred_(deferred),
        layout_(make_gpt_layout(req.model)),
        hold_(req.exact || req.grad_accum > 1),
        accum_fp32_(req.accum_fp32 && req.grad_accum > 1 && req.tensors != ElemType::kF32),
        held_(held_grad_bytes(accum_fp32_, sizes_.elem_bytes, sizes_.weights)),
        dev_budget_(req.device_budget ? req.device_budget : UINT64_MAX),
        host_budget_(req.host_budget ? req.host_budget : UINT64_MAX) {}

  Plan place() {
    plan_.model = req_.model;
    plan_.micro_batch = req_.micro_batch;
    plan_.tensors = req_.tensors;
    plan_.attention_keys = req_.attention_keys;
    plan_.exact = req_.exact;
    plan_.optim_format = req_.optim_format;
    plan_.resident_weights = req_.resident_weights;
    plan_.device_sum_squares = req_.device_sum_squares && req_.exact && !accum_fp32_;
    // (Plan::device_optimizer is set where its state is placed: place_device_optimizer.)
    if (req_.grad_accum < 1)
      throw ConfigError(str("schedule.grad_accum is ", req_.grad_accum, "; it must be at least 1"));
    plan_.grad_accum = req_.grad_accum;
    plan_.accum_fp32 = accum_fp32_;
    plan_.layers.resize(n_layer_);
    const std::vector<ActPlacement> acts = decide_activations();
    for (int l = 0; l < n_layer_; ++l) plan_.layers[l].act = acts[l];
    size_device_pools(acts);
    if (req_.device_optimizer) place_device_optimizer(acts);
    place_fixed_host(acts);
    if (!req_.device_optimizer) {
      place_weights();
      place_held_grads();
      place_optimizer_state();
      buy_weight_slots();
      retain_weights();
    }
    check_host_budget();
    // The embedding's save, update and refresh go in parts where they pay (a large
    // embedding) and where the optimizer can update a range (state in host memory).
    // Not with fp32 sums: the update reads the whole sum after the last micro-batch's
    // accumulation, which goes as one op.
    plan_.embed_parts = req_.exact || accum_fp32_ || plan_.embed_optim != Tier::kHost ? 1
                        : req_.embed_parts > 0          ? req_.embed_parts
                        : sizes_.embed >= (16ull << 20) ? kEmbedParts
                                                        : 1;
    plan_.embed_rows_first = req_.embed_rows_first && plan_.embed_parts > 1 &&
                             req_.optim_format.moments != MomentFormat::kInt8;
    plan_.buffers = in_table_order(std::move(table_.rows));
    return plan_;
  }

 private:
  static constexpr Tier H = Tier::kHost, S = Tier::kSsd;

  // Host memory placed so far: the table's.
  uint64_t host_used() const { return table_.bytes(H); }

  // Per-layer activation placement: the request's, or (auto) kept layers demoted, last first
  // (they are needed first in the backward), until the minimal pools fit the device budget;
  // checkpoints then move to the host, then to SSD.
  std::vector<ActPlacement> decide_activations() {
    std::vector<ActPlacement> acts = req_.acts;
    if (!acts.empty() && static_cast<int>(acts.size()) != n_layer_)
      throw Error(str("plan: ", acts.size(), " activation decisions for ", n_layer_, " layers"));
    const bool auto_acts = acts.empty();
    if (auto_acts) acts.assign(n_layer_, req_.default_act);
    for (int l = 0; l < n_layer_; ++l) {
      if (acts[l] == ActPlacement::kSsd && !req_.have_ssd)
        throw ConfigError(str("layer ", l, ": activations to SSD need offload.ssd_paths"));
      if (acts[l] == ActPlacement::kRecompute &&
          (l == 0 || acts[l - 1] == ActPlacement::kRecompute))
        throw ConfigError(
            str("layer ", l, ": 'recompute' rebuilds the input from layer ", l - 1,
                "'s checkpoint, so layer 0 and two recomputed layers in a row are not allowed"));
    }
    min_dw_ = std::count(acts.begin(), acts.end(), ActPlacement::kRecompute) > 0 ? 3 : 2;
    if (!auto_acts) return acts;
    for (ActPlacement next : {ActPlacement::kDevice, ActPlacement::kHost, ActPlacement::kSsd}) {
      if (next == ActPlacement::kSsd && !req_.have_ssd) break;
      for (int l = n_layer_ - 1;
           l >= 0 && device_need(acts, min_dw_, min_ckpt_slots(acts), 1) > dev_budget_; --l)
        if (static_cast<int>(acts[l]) < static_cast<int>(next)) acts[l] = next;
    }
    return acts;
  }

  // Host bytes of group g's optimizer state.
  uint64_t state_bytes(int g) const {
    return optim_state_bytes(req_.optim_format, layout_.groups[g].numel);
  }
  uint64_t max_group_bytes() const {
    return std::max(sizes_.weights, std::max(sizes_.embed, sizes_.final));
  }
  // The memory line held gradients are counted under.
  std::string held_part() const {
    return accum_fp32_  ? "held gradients (fp32 sums over micro-batches)"
           : req_.exact ? "held gradients (exact mode)"
                        : "held gradients (gradient accumulation)";
  }

  // Device checkpoint slots at least (and at most: 3 where any is needed): none where every
  // layer's block input stays on the device (kept, or checkpointed there), else 2, for a
  // checkpoint loaded from the host or SSD or an input recomputed into one.
  static int min_ckpt_slots(const std::vector<ActPlacement>& acts) {
    for (ActPlacement a : acts)
      if (a != ActPlacement::kKeep && a != ActPlacement::kDevice) return 2;
    return 0;
  }
  uint64_t device_need(const std::vector<ActPlacement>& acts, int dw, int dc, int dg) const {
    return device_bytes(
        device_buffers(req_.model, req_.micro_batch, req_.tensors, acts, dw, dc, dg));
  }

  // The device pools: weight, checkpoint and gradient slots, as many as fit (4, 3, 2 at
  // most), at least the minimum; else an error with the smallest budget that would do.
  void size_device_pools(const std::vector<ActPlacement>& acts) {
    if (req_.resident_weights) min_dw_ = std::max(min_dw_, n_layer_);
    // AdamW on the device holds each layer's gradient in a slot of its own where the step
    // holds gradients in the tensors' type (Plan::device_optimizer).
    const int min_dg = req_.device_optimizer && hold_ && !accum_fp32_ ? n_layer_ : 1;
    const int min_dc = min_ckpt_slots(acts);
    const uint64_t minimal = device_need(acts, min_dw_, min_dc, min_dg);
    if (minimal > dev_budget_) {
      std::vector<ActPlacement> leanest(n_layer_,
                                        req_.have_ssd ? ActPlacement::kSsd : ActPlacement::kHost);
      std::string detail;
      for (auto& [n, b] : sum_buffers(device_buffers(req_.model, req_.micro_batch, req_.tensors,
                                                     acts, min_dw_, min_dc, 1))
                              .device_parts)
        detail += str("\n  ", n, ": ", format_size(b));
      // The whole micro-batch's logits are often the largest buffer: say what chunking them saves.
      std::string hint;
      const int N = req_.micro_batch * req_.model.seq_len, chunk = 1024;
      if (head_chunk_rows(req_.model, req_.micro_batch) == N && N > chunk) {
        ModelConfig m = req_.model;
        m.head_chunk_tokens = chunk;
        hint = str("\n  the same with model.head_chunk_tokens: ", chunk,
                   " (the LM head in chunks, docs/config.md): ",
                   format_size(device_bytes(
                       device_buffers(m, req_.micro_batch, req_.tensors, leanest, 2, 2, 1))));
      }
      throw Error(str("device memory: the plan needs at least ", format_size(minimal),
                      " but offload.device_memory is ", format_size(dev_budget_), ":", detail,
                      "\n  smallest device budget that runs this model at micro_batch ",
                      req_.micro_batch, ": ", format_size(device_need(leanest, 2, 2, 1)), hint));
    }
    int dw = req_.resident_weights ? min_dw_ : 4, dc = min_dc ? 3 : 0, dg = std::max(2, min_dg);
    while (device_need(acts, dw, dc, dg) > dev_budget_) {
      if (dw > min_dw_)
        --dw;
      else if (dc > min_dc)
        --dc;
      else if (dg > min_dg)
        --dg;
      else
        break;
    }
    plan_.pools.device_weight_slots = dw;
    plan_.pools.device_ckpt_slots = dc;
    plan_.pools.device_grad_slots = dg;
    table_.rows = device_buffers(req_.model, req_.micro_batch, req_.tensors, acts, dw, dc, dg);
  }

  // Plan::device_optimizer: every group's state on the device (master unless the weights are
  // fp32, m, v), the fp32 sums over micro-batches there (Plan::accum_fp32), and AdamW's pieces.
  // Every layer's weights stay in their device slot; nothing of the model waits on the host.
  void place_device_optimizer(const std::vector<ActPlacement>& acts) {
    if (!req_.resident_weights || req_.have_ssd || deferred_ > 0 || req_.optim_format.packed())
      throw Error(
          "plan: AdamW on the device needs an in-memory plan (resident weights, no SSD, no "
          "deferred updates) and fp32 optimizer state");
    for (int l = 0; l < n_layer_; ++l)
      if (acts[l] != ActPlacement::kKeep && acts[l] != ActPlacement::kDevice)
        throw Error(
            str("plan: AdamW on the device needs every layer's activations on the device; "
                "layer ",
                l, "'s are ", act_placement_name(acts[l])));
    plan_.device_optimizer = true;
    const Tier D = Tier::kDevice;
    const uint64_t per_param = 4 * device_state_floats(req_.tensors);
    size_t pieces = 0;
    for (size_t g = 0; g < layout_.groups.size(); ++g) {
      const ParamGroup& pg = layout_.groups[g];
      table_.add(BufferKind::kDeviceOptim, static_cast<int>(g), D, per_param * pg.numel,
                 "optimizer state (AdamW on the device)");
      if (accum_fp32_)
        table_.add(BufferKind::kDeviceGradSum, static_cast<int>(g), D, 4 * pg.numel, held_part());
      pieces += adamw_pieces(layout_, pg.offset, pg.offset + pg.numel).size();
    }
    table_.add(BufferKind::kAdamWPieces, 0, D, sizeof(AdamWPiece) * pieces,
               "optimizer state (AdamW on the device)");
    plan_.embed_optim = plan_.final_optim = D;
    for (LayerDecision& d : plan_.layers) d.weights = d.optim = d.grads = D;
  }

  // What the host holds whatever the tiers: the process, the device arena where it is host
  // memory (PlanRequest::device_in_host: the CPU backend), host checkpoints (and the SSD
  // checkpoints' extents), gradient slots, checkpoint staging, the deferred updates' gradient
  // slots and the resident groups' host weights.
  void place_fixed_host(const std::vector<ActPlacement>& acts) {
    table_.add(BufferKind::kProcess, 0, H, kProcessBaseline, "process baseline");
    if (req_.device_in_host)
      table_.add(BufferKind::kDeviceArena, 0, H, table_.bytes(Tier::kDevice),
                 "device arena (CPU backend: host memory)");
    if (sizes_.elem_bytes < 4 && req_.device_in_host)
      table_.add(BufferKind::kKernelScratch, 0, H,
                 cpu_kernel_scratch_bytes(req_.model, req_.micro_batch),
                 "kernel scratch (CPU backend: fp32 views of bf16 tensors)");
    uint64_t ssd_ckpt_layers = 0;
    for (int l = 0; l < n_layer_; ++l) {
      if (acts[l] == ActPlacement::kHost)
        table_.add(BufferKind::kHostCkpt, l, H, sizes_.ckpt, "host checkpoints");
      if (acts[l] == ActPlacement::kSsd) {
        table_.add(BufferKind::kSsdCkpt, l, S, sizes_.ckpt, "checkpoints");
        ++ssd_ckpt_layers;
      }
    }
    // Staging for checkpoints on SSD: a forward's save waits for the write of the checkpoint
    // that last used its slot, and writes queue behind whatever else the disk writes (a
    // layer's updated weights: tens of MB). One slot per SSD checkpoint lets the forward run
    // on while the writes drain, when they take at most 1/16 of the host budget; else 2.
    if (ssd_ckpt_layers) {
      const uint64_t want = ssd_ckpt_layers * static_cast<uint64_t>(req_.grad_accum);
      const uint64_t fit = host_budget_ / 16 / std::max<uint64_t>(sizes_.ckpt, 1);
      plan_.pools.host_ckpt_slots =
          static_cast<int>(std::clamp<uint64_t>(std::min(want, fit), 2, 1024));
      table_.slots(BufferKind::kCkptStage, plan_.pools.host_ckpt_slots, H, sizes_.ckpt,
                   "checkpoint staging");
    }
    if (req_.device_optimizer) {
      // One group's fp32 weights or state between the device and a checkpoint.
      table_.add(BufferKind::kStateStage, 0, H, 4 * max_group_bytes() / sizes_.elem_bytes,
                 "checkpoint state staging");
      return;
    }
    // Two host gradient slots of the largest group: rotated between a layer's gradients and
    // its update, or (exact mode) holding the embedding's and the final group's until theirs.
    plan_.pools.host_grad_slots = 2;
    table_.slots(BufferKind::kHostGradSlot, 2, H, max_group_bytes(), "gradient slots");
    // Deferring the top layers' updates (Plan::deferred_updates) holds each one's gradient
    // through the next forward in a host slot of its own.
    if (deferred_ && hold_)
      throw ConfigError(str(
          "offload.deferred_updates is ", deferred_, ", but this step holds its gradients until ",
          req_.exact
              ? "the global norm is known (exact mode: optimizer.grad_clip > 0 or fp16)"
              : str("all ", req_.grad_accum, " micro-batches are done (schedule.grad_accum)"),
          "; use auto or 0"));
    if (deferred_ >= n_layer_)
      throw ConfigError(str("offload.deferred_updates is ", deferred_, " but the model has ",
                            n_layer_, " layers: at most ", n_layer_ - 1,
                            " (layer 0's update must precede the next forward)"));
    plan_.deferred_updates = deferred_;
    plan_.pools.host_grad_stage_slots = deferred_;
    table_.slots(BufferKind::kGradStage, deferred_, H, held_,
                 "top layers' gradients (deferred updates)");
    // 16-bit tensors: checkpoints move a group's fp32 state through host memory; with fp32
    // tensors a gradient slot holds it, with 16-bit ones (half its size) this buffer does.
    if (sizes_.elem_bytes < 4)
      table_.add(BufferKind::kStateStage, 0, H, 4 * max_group_bytes() / sizes_.elem_bytes,
                 "checkpoint state staging");
    table_.add(BufferKind::kHostEmbed, 0, H, sizes_.embed, "weights");
    table_.add(BufferKind::kHostFinal, 0, H, sizes_.final, "weights");
    // fp32 sums: the embedding's and final group's are held in host memory.
    if (accum_fp32_) {
      table_.add(BufferKind::kEmbedGradHold, 0, H,
                 held_grad_bytes(true, sizes_.elem_bytes, sizes_.embed), held_part());
      table_.add(BufferKind::kFinalGradHold, 0, H,
                 held_grad_bytes(true, sizes_.elem_bytes, sizes_.final), held_part());
    }
  }

  // Host memory that choosing SSD for anything adds: weight staging (4 layers' worth), the
  // optimizer's chunk slots and, with held gradients, their staging.
  uint64_t ssd_overhead(uint64_t staging_layers) const {
    return req_.have_ssd ? staging_layers * sizes_.weights + ooc_chunk_pool_bytes() : 0;
  }

  // Layer weights on the host while they fit, else on SSD. First,
  // the updates of the embedding and of layers 0 and 1 are the last of an iteration (at or
  // after the last layer backward, which is short beside an update streaming its state) and
  // the next iteration's forward starts with their results, so their state's SSD traffic
  // would lie on the critical path between iterations, where nothing else runs: their
  // optimizer state takes host memory before any layer's weights, when it fits beside the
  // SSD staging that the layers would then need.
  void place_weights() {
    for (int g = 0; g < 3 && g <= n_layer_ + 1; ++g) {
      const uint64_t state = state_bytes(g);
      if (!req_.have_ssd || req_.optim_on_ssd ||
          host_used() + state + 4 * sizes_.weights + ooc_chunk_pool_bytes() +
                  (hold_ ? 2 * held_ : 0) >
              host_budget_)
        break;
      table_.add(BufferKind::kHostOptim, g, H, state, "optimizer state");
      ++tail_groups_;
    }
    for (int l = 0; l < n_layer_; ++l) {
      const bool fits = !req_.weights_on_ssd && host_used() + sizes_.weights + ssd_overhead(4) +
                                                        (hold_ && req_.have_ssd ? 2 * held_ : 0) <=
                                                    host_budget_;
      if (fits || !req_.have_ssd) {
        plan_.layers[l].weights = Tier::kHost;
        table_.add(BufferKind::kHostWeights, l, H, sizes_.weights, "weights");
      } else {
        plan_.layers[l].weights = Tier::kSsd;
        table_.add(BufferKind::kSsdWeights, l, S, sizes_.weights, "weights");
        ++ssd_weight_layers_;
      }
    }
    if (ssd_weight_layers_) {
      plan_.pools.host_weight_slots = 2;
      plan_.pools.host_wout_slots = 2;
      table_.slots(BufferKind::kReadSlot, 2, H, sizes_.weights, "weight staging");
      table_.slots(BufferKind::kWoutSlot, 2, H, sizes_.weights, "weight staging");
    }
  }

  // Held gradients (exact mode, grad_accum > 1): a host buffer per layer while they fit,
  // else an SSD extent staged through two host slots. Placed after the weights and before
  // the optimizer state: holding a gradient on SSD costs one write and one read of it per
  // micro-batch boundary (or per step in exact mode), as a layer's weights on SSD do.
  void place_held_grads() {
    if (req_.grads_on_ssd && !req_.have_ssd)
      throw ConfigError("gradients on SSD need offload.ssd_paths");
    int ssd_grad_layers = 0;
    for (int l = 0; hold_ && l < n_layer_; ++l) {
      const bool fits =
          !req_.grads_on_ssd &&
          host_used() + held_ + (req_.have_ssd ? 2 * held_ : 0) + ssd_overhead(0) <= host_budget_;
      if (fits || !req_.have_ssd) {
        plan_.layers[l].grads = Tier::kHost;
        table_.add(BufferKind::kGradHold, l, H, held_, held_part());
      } else {
        plan_.layers[l].grads = Tier::kSsd;
        table_.add(BufferKind::kSsdGrads, l, S, held_, "held gradients");
        ++ssd_grad_layers;
      }
    }
    if (ssd_grad_layers) {
      plan_.pools.host_grad_stage_slots = 2;
      table_.slots(BufferKind::kGradStage, 2, H, held_, "held gradient staging");
    }
  }

  // Optimizer state with what is left, group by group (place_optimizer_state); without SSD
  // every group stays on the host (check_host_budget then reports the total).
  void place_optimizer_state() {
    std::vector<OptimGroup> groups;
    for (const ParamGroup& g : layout_.groups) groups.push_back({g.name, g.numel, {}});
    uint64_t optim_budget = 0;
    if (req_.have_ssd)
      table_.add(BufferKind::kOptimChunks, 0, H, ooc_chunk_pool_bytes(), "optimizer chunk slots");
    if (!req_.optim_on_ssd && host_used() < host_budget_) optim_budget = host_budget_ - host_used();
    if (req_.optim_on_ssd && !req_.have_ssd)
      throw ConfigError("optimizer state on SSD needs offload.ssd_paths");
    std::vector<Tier> tiers;
    if (!req_.have_ssd) {
      tiers.assign(groups.size(), Tier::kHost);
    } else {
      tiers = fuyou::place_optimizer_state(
          std::vector<OptimGroup>(groups.begin() + tail_groups_, groups.end()), optim_budget, true,
          req_.optim_format);
      tiers.insert(tiers.begin(), tail_groups_, Tier::kHost);
      if (req_.spread_host_state) spread_host_layers(tiers);
    }
    for (size_t g = tail_groups_; g < groups.size(); ++g) {
      const int gi = static_cast<int>(g);
      if (tiers[g] == Tier::kHost)
        table_.add(BufferKind::kHostOptim, gi, H, state_bytes(gi), "optimizer state");
      else
        table_.add(BufferKind::kSsdOptim, gi, S,
                   ooc_state_extent_bytes(req_.optim_format, groups[g].numel), "optimizer state");
    }
    plan_.embed_optim = tiers.front();
    plan_.final_optim = tiers.back();
    for (int l = 0; l < n_layer_; ++l) plan_.layers[l].optim = tiers[1 + l];
  }

  // The same number of host-state layers above the tail (layers are equal in size: the same
  // bytes), spread evenly from the top: layer j-th from the top is on the host where
  // floor((j + 1) k / n) > floor(j k / n), so the lowest is on the host and no two SSD
  // layers are adjacent while k >= n - k.
  void spread_host_layers(std::vector<Tier>& tiers) const {
    const int first = std::max(0, tail_groups_ - 1), n = n_layer_ - first;  // layers first .. L-1
    int k = 0;
    for (int l = first; l < n_layer_; ++l) k += tiers[1 + l] == Tier::kHost;
    for (int j = 0; j < n; ++j)
      tiers[n_layer_ - j] = (static_cast<int64_t>(j + 1) * k / n > static_cast<int64_t>(j) * k / n)
                                ? Tier::kHost
                                : Tier::kSsd;
  }

  // Host memory left after the optimizer state buys more weight slots, up to one per
  // SSD-weight layer each: weights-out slots first (an update waits for a free one, that is
  // for the SSD write of an earlier update: the optimizer then runs at the disk's write
  // speed and the embedding's update, last, with it), then read-ahead (the forward's reads
  // run further ahead of their layers, and a read whose write is done can pass one still
  // waiting for its write: the SSD queues reorder, reorders()).
  void buy_weight_slots() {
    const std::pair<int*, BufferKind> pools[] = {
        {&plan_.pools.host_wout_slots, BufferKind::kWoutSlot},
        {&plan_.pools.host_weight_slots, BufferKind::kReadSlot}};
    for (const auto& [slots, kind] : pools) {
      if (ssd_weight_layers_ <= 2 || host_used() >= host_budget_) break;
      const uint64_t extra =
          std::min<uint64_t>((host_budget_ - host_used()) / sizes_.weights, ssd_weight_layers_ - 2);
      *slots += static_cast<int>(extra);
      table_.slots(kind, static_cast<int>(extra), H, sizes_.weights, "weight staging");
    }
  }

  // The updates write new weights to the weights-out slots in turn, layers L-1 .. 0 (of
  // those on SSD): the last one per slot stays there until the next step uses it (retained),
  // so the next forward, and the backward until the slot is written again, load those
  // layers from host memory instead of reading back what was just written.
  void retain_weights() {
    if (!ssd_weight_layers_ || req_.exact) return;
    std::vector<int> order;  // SSD-weight layers in update order
    for (int l = n_layer_ - 1 - deferred_; l >= 0; --l)
      if (plan_.layers[l].weights == Tier::kSsd) order.push_back(l);
    for (int l = n_layer_ - deferred_; l < n_layer_;
         ++l)  // the deferred ones, in forward order (emitted so)
      if (plan_.layers[l].weights == Tier::kSsd) order.push_back(l);
    const int n = static_cast<int>(order.size()), w = plan_.pools.host_wout_slots;
    for (int i = std::max(0, n - w); i < n; ++i) plan_.layers[order[i]].retained = i % w;
  }

  // The host rows summed into the lines of the refusal, which names the largest ones.
  void check_host_budget() const {
    const uint64_t used = host_used();
    if (used <= host_budget_) return;
    using K = BufferKind;
    const uint64_t fixed =
        table_.bytes({K::kProcess, K::kDeviceArena, K::kKernelScratch, K::kStateStage});
    const uint64_t grad_slots = table_.bytes({K::kHostGradSlot});
    const uint64_t held = table_.bytes({K::kGradHold, K::kEmbedGradHold, K::kFinalGradHold});
    const uint64_t ckpts = table_.bytes({K::kHostCkpt}),
                   copies = table_.bytes({K::kHostEmbed, K::kHostFinal});
    const uint64_t rest = used - fixed - grad_slots - held - ckpts - copies;
    throw Error(
        str("host memory: the plan needs ", format_size(used), " but ",
            req_.host_budget_physical ? str("this machine has ", format_size(host_budget_),
                                            " of physical memory (offload.host_memory is unset)")
                                      : str("offload.host_memory is ", format_size(host_budget_)),
            " (", format_size(fixed), " process and device arena, ", format_size(grad_slots),
            " gradient slots, ",
            hold_ ? str(format_size(held), " held gradients (",
                        accum_fp32_  ? "fp32 sums over micro-batches"
                        : req_.exact ? "exact mode"
                                     : "gradient accumulation",
                        "), ")
                  : std::string(),
            format_size(ckpts), " host checkpoints, ", format_size(copies), " embedding copy, ",
            format_size(rest), " weights, optimizer state and staging)",
            req_.have_ssd
                ? ""
                : "; configure offload.ssd_paths to move weights and optimizer state to SSD"));
  }

  const PlanRequest& req_;
  const int n_layer_;
  const Sizes sizes_;
  const int deferred_;
  const ParamLayout layout_;
  const bool hold_;
  const bool accum_fp32_;  // Plan::accum_fp32
  const uint64_t held_;    // one layer's held gradient (held_grad_bytes)
  const uint64_t dev_budget_, host_budget_;
  Plan plan_;
  BufferRows table_;  // the plan's buffer table as placed so far
  int min_dw_ = 2;
  int tail_groups_ = 0;  // groups 0 .. tail_groups_-1 have their optimizer state on the host
  int ssd_weight_layers_ = 0;
};

// A plan for `deferred` deferred updates: placement, buffer table, ops.
Plan plan_with(const PlanRequest& req, int deferred) {
  Plan plan = Placer(req, deferred).place();
  plan.memory = sum_buffers(plan.buffers);
  plan.memory.device_in_host = req.device_in_host;
  lay_out_iteration(req, plan);
  return plan;
}

int state_groups_on_ssd(const Plan& p) {
  int n = (p.embed_optim == Tier::kSsd) + (p.final_optim == Tier::kSsd);
  for (const LayerDecision& d : p.layers) n += d.optim == Tier::kSsd;
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
  if (plain.holds_grads() || plain.model.n_layer < 2 || plain.layers.back().optim != Tier::kSsd)
    return plain;
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

PlanRequest with_device(PlanRequest req, const PlanDevice& device) {
  req.embed_rows_first = device.own_compute;
  req.spread_host_state = device.own_compute;
  req.device_in_host = device.device_in_host;
  req.device_sum_squares = device.sum_squares;
  return req;
}

}  // namespace fuyou
