#include "fuyou/scheduler.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <thread>

#include <omp.h>
#include <spdlog/spdlog.h>

#include "fuyou/error.h"
#include "fuyou/loss_scale.h"
#include "fuyou/model.h"
#include "fuyou/ooc_adamw.h"
#include "fuyou/optim.h"
#include "fuyou/sizes.h"
#include "fuyou/train.h"

namespace fuyou {
namespace {

using clock_type = std::chrono::steady_clock;

uint64_t pad4k(uint64_t b) { return (b + kIoAlign - 1) / kIoAlign * kIoAlign; }

}  // namespace

class OffloadTrainer::Impl {
  // The op lists of one plan, per resource.
  struct Run {
    const std::vector<PlanOp>* ops = nullptr;
    std::vector<int> queue[kNumResources];
    int returns = 0;  // ops step() waits for (step_waits_for)
    std::vector<OpBuffers> bufs;  // per op: what it touches (a reordering queue's check)
  };

  // One iteration in flight. Iteration t+1 starts while t's updates and writes still run,
  // so everything an op reads besides the buffers (tokens, learning rate, loss scale, the
  // step's decision) lives here, one copy per iteration.
  struct Iter {
    const Run* run = nullptr;
    int64_t step = -1;
    bool prev = false;  // overlaps the other slot's iteration: waits on it by prev_deps_
    bool forward_only = false;  // the validation plan
    std::vector<std::vector<int32_t>> inputs, targets;  // per micro-batch
    std::vector<float> losses;     // per micro-batch: mean over its counted targets
    std::vector<int64_t> counts;   // per micro-batch: counted targets
    std::vector<double> sum_sq;    // per group (exact mode)
    float loss_scale = 0;          // head gradient scale: loss scale / counted targets
    double step_loss_scale = 1;    // fp16 loss scale of this step (1 without fp16)
    bool apply = true;             // false: this step's updates are skipped (fp16 overflow)
    double grad_norm = 0, lr = 0;
    float grad_scale = 1.0f;
    int64_t t = 0;                 // Adam's step count
    float eval_loss = 0;
    // Progress, guarded by mu_: per op done flag and times (s since epoch_, -1: not yet).
    std::vector<char> done;
    std::vector<double> start, end;
    int pending = 0;    // ops not finished
    int returning = 0;  // step_waits_for ops not finished
    // The embedding's first update part (Plan::embed_rows_first): the element ranges it
    // updated (the next step's first micro-batch's token rows, then the position table),
    // and whether those were the next step's rows (false: the next step was not queued yet,
    // so its embedding forward waits for every part's refresh).
    std::vector<std::pair<size_t, size_t>> first_rows;
    bool first_rows_next = false;
  };

  // A fixed-capacity queue in submission order (sized before the first step: no allocation
  // while running). Ops leave it from the front once done; a reordering queue may run one
  // behind the front first (next_op).
  struct Ring {
    std::vector<std::pair<int, int>> items;
    size_t head = 0, tail = 0;
    size_t size() const { return (tail + items.size() - head) % items.size(); }
    const std::pair<int, int>& front() const { return items[head]; }
    const std::pair<int, int>& at(size_t k) const { return items[(head + k) % items.size()]; }
    void push(std::pair<int, int> x) {
      FY_CHECK(size() + 1 < items.size(), "executor queue full");
      items[tail] = x;
      tail = (tail + 1) % items.size();
    }
    void pop() { head = (head + 1) % items.size(); }
    void clear() { head = tail; }
  };

 public:
  Impl(OffloadTrainer& owner, const Config& cfg, Backend& be, Plan plan, SsdStore* store)
      : owner_(owner), cfg_(cfg), be_(be), plan_(std::move(plan)), store_(store),
        layout_(make_gpt_layout(cfg.model)),
        model_(cfg.model, be, plan_.micro_batch, ModelState::kWorkspace) {
    const int L = cfg.model.n_layer;
    const PlanPools& pp = plan_.pools;
    N_ = plan_.micro_batch * cfg.model.seq_len;
    if (be_.matmul_precision() == MatmulPrecision::kFp16) {
      // The overflow check needs every gradient before any update: only exact plans have it.
      if (!plan_.exact)
        throw Error("fp16 GEMM inputs need an exact-mode plan (the loss-scale overflow check "
                    "sees every gradient before any update)");
      LossScaleConfig ls;
      ls.initial = cfg.optimizer.initial_loss_scale;
      scaler_ = std::make_unique<DynamicLossScaler>(ls);
    }
    const uint64_t C = cfg.model.d_model;
    wbytes_ = 4 * layout_.groups[1].numel;
    cbytes_ = 4 * N_ * C;
    bool needs_store = false;
    for (const auto& d : plan_.layers)
      needs_store |= d.weights == StateTier::kSsd || d.act == ActPlacement::kSsd || d.optim == StateTier::kSsd;
    needs_store |= plan_.embed_optim == StateTier::kSsd || plan_.final_optim == StateTier::kSsd;
    for (const auto& d : plan_.layers) needs_store |= plan_.holds_grads() && d.grads == StateTier::kSsd;
    if (plan_.forward_only) throw Error("OffloadTrainer needs a training plan; it derives the forward-only one itself");
    if (needs_store && !store_) throw Error("the plan keeps state on SSD but no store is open (offload.ssd_paths)");

    // Device: resident embedding and final norm, pools, activation buffers.
    auto dalloc = [&](uint64_t bytes, const std::string& what) {
      void* p = be_.alloc(bytes, what);
      owned_.push_back(p);
      return static_cast<float*>(p);
    };
    const ParamGroup& ge = layout_.groups.front();
    const ParamGroup& gf = layout_.groups.back();
    embed_w_ = dalloc(4 * ge.numel, "embedding weights");
    embed_g_ = dalloc(4 * ge.numel, "embedding gradients");
    final_w_ = dalloc(4 * gf.numel, "final norm weights");
    final_g_ = dalloc(4 * gf.numel, "final norm gradients");
    for (int s = 0; s < pp.device_weight_slots; ++s) wslot_.push_back(dalloc(wbytes_, "weight slot"));
    for (int s = 0; s < pp.device_grad_slots; ++s) gslot_.push_back(dalloc(wbytes_, "gradient slot"));
    for (int s = 0; s < pp.device_ckpt_slots; ++s) cslot_.push_back(dalloc(cbytes_, "checkpoint slot"));
    stream_[0] = dalloc(cbytes_, "forward stream");
    stream_[1] = dalloc(cbytes_, "forward stream");
    scratch_ = dalloc(cbytes_, "recompute scratch");
    dres_ = dalloc(cbytes_, "residual gradient");
    work_ = model_.alloc_activations("working activations");
    layer_ckpt_.assign(L, nullptr);
    kept_.resize(L);
    for (int l = 0; l < L; ++l) {
      ActPlacement a = plan_.layers[l].act;
      if (a == ActPlacement::kKeep || a == ActPlacement::kDevice)
        layer_ckpt_[l] = dalloc(cbytes_, str("layer ", l, " checkpoint"));
      if (a == ActPlacement::kKeep) kept_[l] = model_.alloc_activations(str("layer ", l, " activations"));
    }

    // Host: pool slots, resident weights and checkpoints.
    uint64_t gmax = 0;
    for (const auto& g : layout_.groups) gmax = std::max<uint64_t>(gmax, 4 * g.numel);
    std::vector<SlotSpec> specs;
    if (pp.host_weight_slots) specs.push_back({"weights.read", wbytes_, static_cast<uint32_t>(pp.host_weight_slots)});
    if (pp.host_wout_slots) specs.push_back({"weights.out", wbytes_, static_cast<uint32_t>(pp.host_wout_slots)});
    if (pp.host_ckpt_slots) specs.push_back({"checkpoint.staging", cbytes_, static_cast<uint32_t>(pp.host_ckpt_slots)});
    specs.push_back({"gradients", gmax, static_cast<uint32_t>(pp.host_grad_slots)});
    if (pp.host_grad_stage_slots)
      specs.push_back({"gradients.staging", wbytes_, static_cast<uint32_t>(pp.host_grad_stage_slots)});
    pool_ = std::make_unique<HostPool>(specs);
    auto slots_of = [&](const char* name, int count) {
      std::vector<float*> v;
      if (!count) return v;
      int cls = pool_->slot_class(name);
      for (int i = 0; i < count; ++i) v.push_back(static_cast<float*>(pool_->slot(cls, i).ptr));
      return v;
    };
    hread_ = slots_of("weights.read", pp.host_weight_slots);
    hwout_ = slots_of("weights.out", pp.host_wout_slots);
    hckpt_ = slots_of("checkpoint.staging", pp.host_ckpt_slots);
    hgrad_ = slots_of("gradients", pp.host_grad_slots);
    hgstage_ = slots_of("gradients.staging", pp.host_grad_stage_slots);
    host_w_.resize(L);
    host_ckpt_.resize(L);
    for (int l = 0; l < L; ++l) {
      if (plan_.layers[l].weights == StateTier::kHost) host_w_[l].assign(layout_.groups[1 + l].numel, 0.0f);
      if (plan_.layers[l].act == ActPlacement::kHost) host_ckpt_[l].assign(N_ * C, 0.0f);
    }
    // Held gradients in host memory (exact mode, gradient accumulation), one buffer per layer.
    hold_.resize(L);
    for (int l = 0; l < L; ++l)
      if (plan_.holds_grads() && plan_.layers[l].grads == StateTier::kHost) hold_[l].assign(layout_.groups[1 + l].numel, 0.0f);
    host_embed_.assign(ge.numel, 0.0f);
    host_final_.assign(gf.numel, 0.0f);

    // SSD extents for weights and checkpoints; the optimizer defines its own.
    wext_.assign(L, 0);
    cext_.assign(L, 0);
    gext_.assign(L, 0);
    if (store_) {
      store_->register_pool(*pool_);
      for (int l = 0; l < L; ++l) {
        if (plan_.layers[l].weights == StateTier::kSsd) wext_[l] = store_->define_extent(str("layer.", l, "/weights"), wbytes_);
        if (plan_.layers[l].act == ActPlacement::kSsd) cext_[l] = store_->define_extent(str("layer.", l, "/checkpoint"), cbytes_);
        if (plan_.holds_grads() && plan_.layers[l].grads == StateTier::kSsd)
          gext_[l] = store_->define_extent(str("layer.", l, "/gradients"), wbytes_);
      }
    }
    std::vector<OptimGroup> groups;
    std::vector<StateTier> tiers;
    for (size_t g = 0; g < layout_.groups.size(); ++g) {
      OptimGroup og{layout_.groups[g].name, layout_.groups[g].numel, {}};
      for (const TensorSpec& t : layout_.tensors)
        if (t.group == static_cast<int>(g)) og.tensors.push_back({t.offset - layout_.groups[g].offset, t.numel, t.decay});
      groups.push_back(og);
      tiers.push_back(g == 0 ? plan_.embed_optim : g == layout_.groups.size() - 1 ? plan_.final_optim : plan_.layers[g - 1].optim);
    }
    OocAdamWOptions oo;
    oo.beta1 = static_cast<float>(cfg.optimizer.beta1);
    oo.beta2 = static_cast<float>(cfg.optimizer.beta2);
    oo.eps = static_cast<float>(cfg.optimizer.eps);
    oo.weight_decay = static_cast<float>(cfg.optimizer.weight_decay);
    opt_ = std::make_unique<OocAdamW>(groups, tiers, store_, oo);

    // Per-resource op lists for the training plan and the validation plan (a forward over
    // the same pools), the state of the two iterations that may be in flight, and one
    // thread per resource for the trainer's lifetime.
    eval_plan_ = make_forward_plan(plan_);
    train_.ops = &plan_.ops;
    eval_.ops = &eval_plan_.ops;
    size_t ring = 0;
    for (Run* run : {&train_, &eval_}) {
      for (const PlanOp& op : *run->ops) {
        run->queue[static_cast<int>(op.resource)].push_back(op.id);
        run->returns += step_waits_for(op);
      }
      run->bufs = op_buffers(run == &train_ ? plan_ : eval_plan_);
      for (auto& q : run->queue) ring = std::max(ring, q.size());
    }
    prev_deps_ = previous_iteration_deps(plan_);
    for (const PlanOp& op : plan_.ops)
      if (op.kind == OpKind::kLoadResident && op.layer == 0) embed_refresh_ops_.push_back(op.id);
    row_tokens_.reserve(N_);
    opt_ranges_.reserve(N_ + 2);
    h2d_ranges_.reserve(N_ + 2);
    d2h_ranges_.reserve(N_ + 2);
    const int K = plan_.grad_accum;
    const size_t max_ops = std::max(plan_.ops.size(), eval_plan_.ops.size());
    for (Iter& it : iters_) {
      it.inputs.assign(K, std::vector<int32_t>(N_));
      it.targets.assign(K, std::vector<int32_t>(N_));
      it.losses.assign(K, 0.0f);
      it.counts.assign(K, 0);
      it.sum_sq.assign(layout_.groups.size(), 0.0);
      it.done.assign(max_ops, 0);
      it.start.assign(max_ops, -1.0);
      it.end.assign(max_ops, -1.0);
      it.first_rows.reserve(N_ + 1);
    }
    // Two iterations of the longest queue, and one spare so that full and empty differ.
    for (Ring& r : rings_) r.items.resize(2 * ring + 1);
    // Every host buffer a copy reads or writes is page-locked (CUDA: full-speed
    // asynchronous copies), and the executor orders device work itself (Backend::
    // set_caller_ordered): a copy waits only for the ops it depends on.
    std::vector<std::pair<void*, size_t>> host_bufs;
    for (const HostPool::Region& r : pool_->regions()) host_bufs.push_back({r.base, r.bytes});
    for (auto* vs : {&host_w_, &host_ckpt_, &hold_})
      for (auto& v : *vs) host_bufs.push_back({v.data(), 4 * v.size()});
    host_bufs.push_back({host_embed_.data(), 4 * host_embed_.size()});
    host_bufs.push_back({host_final_.data(), 4 * host_final_.size()});
    uint64_t refused = 0;
    for (auto [p, n] : host_bufs) {
      if (!p || !n) continue;
      if (be_.register_host(p, n)) registered_.push_back(p);
      else refused += n;
    }
    if (refused)
      spdlog::warn("{}: {} of host buffers could not be page-locked (locked-memory limit?); copies from them "
                   "run slower", be_.name(), format_size(refused));
    be_.set_caller_ordered(true);
    update_threads_ = cfg.runtime.threads > 0 ? cfg.runtime.threads : omp_get_num_procs();
    epoch_ = clock_type::now();
    for (int r = 0; r < kNumResources; ++r) workers_.emplace_back([this, r] { worker(r); });
  }

  ~Impl() {
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Let whatever was submitted finish (or fail) before the buffers go away.
      cv_.wait(lock, [&] { return failed_ || (iters_[0].pending == 0 && iters_[1].pending == 0); });
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    be_.set_caller_ordered(false);
    for (void* p : registered_) be_.unregister_host(p);
    for (void* p : owned_) be_.free(p);
  }

  const Plan& plan() const { return plan_; }

  // Pointers to layer l's tensors inside a slot holding that layer's group.
  LayerTensors layer_view(float* slot, int l) {
    return layer_tensors(layout_, l, slot - layout_.groups[1 + l].offset);
  }
  // The embed and final groups live in separate device buffers; an untied LM head is in the
  // final group, a tied one is wte (so its gradient lands in the embed group).
  GlobalTensors globals(float* embed, float* fin) { return global_tensors(layout_, embed, fin); }
  float* buf(const BufRef& b) {
    switch (b.kind) {
      case BufRef::kStream: return stream_[b.index];
      case BufRef::kLayerCkpt: return layer_ckpt_[b.index];
      case BufRef::kCkptSlot: return cslot_[b.index];
      case BufRef::kScratch: return scratch_;
      case BufRef::kNone:
      case BufRef::kHostGrad:
      case BufRef::kGradHold:
      case BufRef::kGradStage:
      case BufRef::kWeightsOut: break;  // host buffers: host_grad(), hwout_
    }
    FY_CHECK(false, "op without a device activation buffer");
    return nullptr;
  }
  float* host_grad(const BufRef& b) {
    switch (b.kind) {
      case BufRef::kHostGrad: return hgrad_[b.index];
      case BufRef::kGradHold: return hold_[b.index].data();
      case BufRef::kGradStage: return hgstage_[b.index];
      default: break;
    }
    FY_CHECK(false, "gradient op without a host gradient buffer");
    return nullptr;
  }
  float* group_host_weights(int g) {
    const int L = cfg_.model.n_layer;
    if (g == 0) return host_embed_.data();
    if (g == L + 1) return host_final_.data();
    return host_w_[g - 1].data();
  }

  void set_group_params(int g, const float* src) {
    drain();
    const int L = cfg_.model.n_layer;
    const ParamGroup& pg = layout_.groups.at(g);
    opt_->init_group(g, src);
    if (g == 0 || g == L + 1 || plan_.layers[g - 1].weights == StateTier::kHost) {
      std::memcpy(group_host_weights(g), src, 4 * pg.numel);
      if (g == 0) be_.copy_to_device(embed_w_, host_embed_.data(), 4 * host_embed_.size());
      if (g == L + 1) be_.copy_to_device(final_w_, host_final_.data(), 4 * host_final_.size());
    } else {
      // To SSD through a read-staging slot (free between steps); a retained layer's
      // weights-out slot gets them too, where the first step's forward loads them.
      std::memcpy(hread_[0], src, 4 * pg.numel);
      std::memset(reinterpret_cast<char*>(hread_[0]) + 4 * pg.numel, 0, pad4k(4 * pg.numel) - 4 * pg.numel);
      store_->write_sync(wext_[g - 1], 0, hread_[0], pad4k(wbytes_));
      if (plan_.layers[g - 1].retained >= 0) std::memcpy(hwout_[plan_.layers[g - 1].retained], src, 4 * pg.numel);
    }
  }

  void set_params(const float* params) {
    for (size_t g = 0; g < layout_.groups.size(); ++g)
      set_group_params(static_cast<int>(g), params + layout_.groups[g].offset);
  }

  void read_group_params(int g, float* dst) {
    drain();
    opt_->read_master(g, dst);
  }
  float* group_staging() {
    drain();
    return hgrad_[0];
  }

  void read_params(float* params) {
    drain();
    std::fill(params, params + layout_.total, 0.0f);
    for (size_t g = 0; g < layout_.groups.size(); ++g) opt_->read_master(static_cast<int>(g), params + layout_.groups[g].offset);
  }

  void run_op(Iter& it, const PlanOp& op) {
    const int L = cfg_.model.n_layer;
    switch (op.kind) {
      case OpKind::kReadWeights:
        store_->read_sync(wext_[op.layer], 0, hread_[op.slot], pad4k(wbytes_));
        break;
      case OpKind::kLoadWeights: {
        const float* src = op.in.kind == BufRef::kWeightsOut ? hwout_[op.in.index]
                           : op.slot2 >= 0                  ? hread_[op.slot2]
                                                            : host_w_[op.layer].data();
        be_.copy_to_device(wslot_[op.slot], src, wbytes_);
        break;
      }
      case OpKind::kEmbedForward: {
        // Each micro-batch's tokens go to the device here, on the compute queue: the previous
        // micro-batch's head and embedding backward, which read them, ran before.
        model_.set_tokens(it.inputs[op.micro].data(), it.targets[op.micro].data());
        GlobalTensors g = globals(embed_w_, final_w_);
        model_.embed_forward(g.wte, g.wpe, buf(op.out));
        break;
      }
      case OpKind::kForward: {
        // Validation keeps nothing for a backward: every layer uses the working buffers.
        LayerActivations a =
            plan_.layers[op.layer].act == ActPlacement::kKeep && !it.forward_only ? kept_[op.layer] : work_;
        a.out = buf(op.out);
        if (owner_.on_forward) owner_.on_forward(op.layer, wslot_[op.slot], layout_.groups[1 + op.layer].numel);
        model_.block_forward(layer_view(wslot_[op.slot], op.layer), buf(op.in), a);
        break;
      }
      case OpKind::kSaveCheckpoint:
        be_.copy_to_host(op.slot >= 0 ? hckpt_[op.slot] : host_ckpt_[op.layer].data(), buf(op.in), cbytes_);
        break;
      case OpKind::kWriteCheckpoint:
        store_->write_sync(cext_[op.layer], 0, hckpt_[op.slot], pad4k(cbytes_));
        break;
      case OpKind::kReadCheckpoint:
        store_->read_sync(cext_[op.layer], 0, hckpt_[op.slot], pad4k(cbytes_));
        break;
      case OpKind::kLoadCheckpoint:
        be_.copy_to_device(buf(op.out), op.slot >= 0 ? hckpt_[op.slot] : host_ckpt_[op.layer].data(), cbytes_);
        break;
      case OpKind::kHead: {
        // The embedding and final groups' gradients accumulate on the device over the step,
        // from the first micro-batch's head on; the previous step's saves of them are this
        // op's cross-iteration dependencies (not the embedding forward's, which with rows
        // first starts before the last of those saves).
        if (op.micro == 0) {
          be_.zero(embed_g_, 4 * layout_.groups.front().numel);
          be_.zero(final_g_, 4 * layout_.groups.back().numel);
        }
        GlobalTensors g = globals(embed_w_, final_w_), dg = globals(embed_g_, final_g_);
        it.losses[op.micro] = model_.head_forward(g, buf(op.in), true);
        model_.head_backward(g, dg, buf(op.in), it.loss_scale, dres_);
        break;
      }
      case OpKind::kHeadLoss:
        it.eval_loss = model_.head_forward(globals(embed_w_, final_w_), buf(op.in), true);
        break;
      case OpKind::kRecomputeInput: {
        LayerActivations a = work_;
        a.out = buf(op.out);
        model_.block_forward(layer_view(wslot_[op.slot], op.layer - 1), buf(op.in), a);
        break;
      }
      case OpKind::kRecompute: {
        LayerActivations a = work_;
        a.out = scratch_;
        model_.block_forward(layer_view(wslot_[op.slot], op.layer), buf(op.in), a);
        break;
      }
      case OpKind::kBackward: {
        LayerActivations a = plan_.layers[op.layer].act == ActPlacement::kKeep ? kept_[op.layer] : work_;
        // Micro-batch 0 starts from zero; a later one adds to what its load_grads put back,
        // so each sum is formed term by term as in-memory training forms it.
        if (op.micro == 0) be_.zero(gslot_[op.slot2], wbytes_);
        model_.block_backward(layer_view(wslot_[op.slot], op.layer), layer_view(gslot_[op.slot2], op.layer),
                              buf(op.in), a, dres_);
        break;
      }
      case OpKind::kEmbedBackward:
        model_.embed_backward(globals(embed_g_, final_g_), dres_);
        break;
      case OpKind::kSaveGrads: {
        const float* src = op.layer == 0 ? embed_g_ : op.layer == L + 1 ? final_g_ : gslot_[op.slot];
        float* dst = host_grad(op.out);
        if (op.layer == 0 && plan_.embed_rows_first) {
          // Rows first: part -1 fixes the rows (first_rows) and copies them; the parts copy
          // the rest of their ranges, never a range the rows update may be reading.
          if (op.part < 0) first_rows(it);
          else rows_complement(it, part_range(layout_.groups[0].numel, op.part, op.parts), d2h_ranges_);
          for (const auto& [a, b] : op.part < 0 ? it.first_rows : d2h_ranges_)
            be_.copy_to_host(dst + a, src + a, 4 * (b - a));
          break;
        }
        const ParamRange r = part_range(layout_.groups[op.layer].numel, op.part, op.parts);
        be_.copy_to_host(dst + r.begin, src + r.begin, 4 * (r.end - r.begin));
        break;
      }
      case OpKind::kWriteGrads:
        store_->write_sync(gext_[op.layer - 1], 0, host_grad(op.in), pad4k(wbytes_));
        break;
      case OpKind::kReadGrads:
        store_->read_sync(gext_[op.layer - 1], 0, host_grad(op.out), pad4k(wbytes_));
        break;
      case OpKind::kLoadGrads:
        be_.copy_to_device(gslot_[op.slot], host_grad(op.in), wbytes_);
        break;
      case OpKind::kGradSumSq:
        it.sum_sq[op.layer] = group_sum_squares(host_grad(op.in), layout_.groups[op.layer].numel);
        break;
      case OpKind::kGradNorm: {
        // Group order 0..L+1, each group's own sum sequential: the reduction StepRunner uses.
        double sq = 0;
        for (double g : it.sum_sq) sq += g;
        const StepDecision d = decide_step(sq, it.step_loss_scale, cfg_.optimizer.grad_clip, scaler_.get());
        it.grad_norm = d.grad_norm;
        it.grad_scale = d.grad_scale;
        it.apply = d.apply;
        break;
      }
      case OpKind::kUpdate: {
        if (!it.apply) break;  // fp16 overflow: weights and optimizer state stay as they are
        OocAdamW::Update u;
        u.group = op.layer;
        u.grad = host_grad(op.in);
        u.grad_type = ElemType::kF32;
        u.lowp = op.slot2 >= 0 ? hwout_[op.slot2] : group_host_weights(op.layer);
        u.lowp_type = ElemType::kF32;
        if (op.part < 0) {  // the rows its gradient save fixed
          u.ranges = it.first_rows.data();
          u.nranges = it.first_rows.size();
        } else {
          const ParamRange r = part_range(layout_.groups[op.layer].numel, op.part, op.parts);
          u.begin = r.begin;
          u.end = r.end;
          if (op.layer == 0 && plan_.embed_rows_first) {
            rows_complement(it, r, opt_ranges_);
            u.ranges = opt_ranges_.data();
            u.nranges = opt_ranges_.size();
          }
        }
        u.grad_scale = plan_.exact ? it.grad_scale : 1.0f;
        u.lr = static_cast<float>(it.lr);
        u.t = it.t;
        // On the CPU backend the optimizer shares the cores with compute: two OpenMP teams
        // on two cores spin against each other at every barrier (measured: compute 1.7-3x
        // slower while the optimizer ran), so updates take one thread. The exceptions run
        // after the last layer backward, when compute has nothing to do until the next
        // step's forward, which waits for them: the embedding's and layer 0's, and in exact
        // mode (every update after the norm) the final group's, updated before layer 0's.
        // With the rows first, the embedding's other parts run beside the next forward.
        const bool tail = (op.layer == 0 && !(plan_.embed_rows_first && op.part >= 0)) || op.layer == 1 ||
                          (plan_.exact && op.layer == cfg_.model.n_layer + 1);
        u.threads = be_.kind() == BackendKind::kCpu && !tail ? 1 : update_threads_;
        opt_->wait(opt_->submit(u));
        break;
      }
      case OpKind::kWriteWeights:
        if (!it.apply) break;  // no new weights were made; the SSD copy is current
        store_->write_sync(wext_[op.layer - 1], 0, hwout_[op.slot], pad4k(wbytes_));
        break;
      case OpKind::kLoadResident: {
        float* dst = op.layer == 0 ? embed_w_ : final_w_;
        const float* src = group_host_weights(op.layer);
        if (op.layer == 0 && plan_.embed_rows_first) {
          if (op.part >= 0) rows_complement(it, part_range(layout_.groups[0].numel, op.part, op.parts), h2d_ranges_);
          for (const auto& [a, b] : op.part < 0 ? it.first_rows : h2d_ranges_)
            be_.copy_to_device(dst + a, src + a, 4 * (b - a));
          break;
        }
        const ParamRange r = part_range(layout_.groups[op.layer].numel, op.part, op.parts);
        be_.copy_to_device(dst + r.begin, src + r.begin, 4 * (r.end - r.begin));
        break;
      }
    }
  }

  // The embedding's first update part: the rows the next step's first micro-batch looks up
  // (its tokens, sorted and without repeats) when that step is queued, and everything after
  // the token table (the position table), as element ranges in it.first_rows.
  void first_rows(Iter& it) {
    const size_t C = cfg_.model.d_model, table = C * cfg_.model.vocab_size, numel = layout_.groups[0].numel;
    it.first_rows.clear();
    row_tokens_.clear();
    {
      std::lock_guard<std::mutex> lock(mu_);
      const Iter& next = iters_[&it == &iters_[0] ? 1 : 0];
      it.first_rows_next = next.run == &train_ && next.step == it.step + 1;
      if (it.first_rows_next) row_tokens_.assign(next.inputs[0].begin(), next.inputs[0].end());
    }
    std::sort(row_tokens_.begin(), row_tokens_.end());
    row_tokens_.erase(std::unique(row_tokens_.begin(), row_tokens_.end()), row_tokens_.end());
    for (int32_t tok : row_tokens_) it.first_rows.push_back({tok * C, tok * C + C});
    if (table < numel) it.first_rows.push_back({table, numel});
  }

  // Part `r` of the embedding less the ranges its first part updated, into `out`.
  static void rows_complement(const Iter& it, ParamRange r, std::vector<std::pair<size_t, size_t>>& out) {
    out.clear();
    size_t at = r.begin;
    for (const auto& [a, b] : it.first_rows) {
      if (b <= at) continue;
      if (a >= r.end) break;
      if (a > at) out.push_back({at, a});
      at = std::max(at, b);
    }
    if (at < r.end) out.push_back({at, r.end});
  }

  // Adds the time each of x's ops was busy within [window_start_, t_end] (to t_end where still
  // running) to `busy`, per resource.
  template <typename Busy>
  void add_busy(const Iter& x, double t_end, Busy& busy) const {
    for (const PlanOp& op : plan_.ops) {
      if (x.start[op.id] < 0) continue;
      const double b = std::max(x.start[op.id], window_start_), e = x.end[op.id] < 0 ? t_end : x.end[op.id];
      if (e > b) busy[static_cast<int>(op.resource)] += e - b;
    }
  }

  double now() const { return std::chrono::duration<double>(clock_type::now() - epoch_).count(); }

  // Caller holds mu_. Whether op `id` of iteration `i` may start: its deps in its own
  // iteration are done and, when it overlaps the previous iteration of the same plan, the
  // ops of that iteration it waits for (previous_iteration_deps) are done too.
  bool ready(int i, int id) const {
    const Iter& it = iters_[i];
    for (int d : (*it.run->ops)[id].deps)
      if (!it.done[d]) return false;
    if (it.prev) {
      const Iter& before = iters_[1 - i];
      for (int d : prev_deps_[id])
        if (!before.done[d]) return false;
      // The embedding forward waits only for the rows refreshed first, if those were its own.
      const PlanOp& op = (*it.run->ops)[id];
      if (plan_.embed_rows_first && op.kind == OpKind::kEmbedForward && op.micro == 0 && !before.first_rows_next)
        for (int d : embed_refresh_ops_)
          if (!before.done[d]) return false;
    }
    return true;
  }

  // Caller holds mu_. The queue position of the op resource `r` runs next, -1 for none yet:
  // the front once it is ready; on a reordering queue (reorders(): SSD reads and writes, host
  // to device), the first ready op among the next kReorderWindow not done that touches
  // nothing that an op queued ahead of it and not yet done touches with a write (its hazards
  // with those are what the queue's order otherwise keeps; the ones with other queues are its
  // deps). A read of the next step's layer 3 thereby goes ahead while the read of layer 2
  // waits for its write.
  long next_op(int r) const {
    const Ring& q = rings_[r];
    if (!q.size()) return -1;
    if (!reorders(static_cast<Resource>(r))) return ready(q.front().first, q.front().second) ? 0 : -1;
    size_t seen = 0;
    for (size_t k = 0; k < q.size() && seen < kReorderWindow; ++k) {
      const auto [i, id] = q.at(k);
      if (iters_[i].done[id]) continue;
      ++seen;
      if (!ready(i, id)) continue;
      bool passes = true;
      for (size_t j = 0; j < k && passes; ++j) {
        const auto [i2, id2] = q.at(j);
        if (iters_[i2].done[id2]) continue;
        passes = iters_[i2].run == iters_[i].run && !buffers_conflict(iters_[i].run->bufs[id2], iters_[i].run->bufs[id]);
      }
      if (passes) return static_cast<long>(k);
    }
    return -1;
  }

  // One thread per resource: runs the ops queued for it, each when ready, in order (the
  // reordering queues: see next_op).
  void worker(int r) {
    // runtime.threads for the kernels and sums run here: an OpenMP thread count is per thread.
    omp_set_num_threads(update_threads_);
    Ring& q = rings_[r];
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      long k = -1;
      cv_.wait(lock, [&] { return stop_ || failed_ || (k = next_op(r)) >= 0; });
      if (stop_) return;
      if (failed_) {
        q.clear();  // the waiters rethrow the error; nothing more runs
        cv_.wait(lock, [&] { return stop_ || !failed_; });
        continue;
      }
      const auto [i, id] = q.at(static_cast<size_t>(k));
      Iter& it = iters_[i];
      const PlanOp& op = (*it.run->ops)[id];
      it.start[id] = now();
      lock.unlock();
      std::exception_ptr err;
      try {
        if (owner_.on_op) owner_.on_op(it.step, op);
        run_op(it, op);
        // Done means done on the device: the ops that wait for this one (copies of what it
        // wrote, loads into what it read) start right after.
        if (op.resource == Resource::kCompute) be_.finish_compute();
      } catch (...) {
        err = std::current_exception();
      }
      const double t1 = now();
      lock.lock();
      if (err) {
        if (!error_) error_ = err;
        failed_ = true;
      } else {
        it.end[id] = t1;
        it.done[id] = 1;
        --it.pending;
        if (step_waits_for(op)) --it.returning;
        while (q.size() && iters_[q.front().first].done[q.front().second]) q.pop();
      }
      cv_.notify_all();
    }
  }

  // Caller holds `lock`. Waits until `pred` holds; rethrows an op's error.
  template <class Pred>
  void wait_for(std::unique_lock<std::mutex>& lock, Pred pred) {
    cv_.wait(lock, [&] { return failed_ || pred(); });
    if (failed_) std::rethrow_exception(error_);
  }

  // Waits until nothing is in flight (before anything that reads or writes state from the
  // caller's thread: validation, parameters in or out, the trace).
  void drain() {
    std::unique_lock<std::mutex> lock(mu_);
    wait_for(lock, [&] { return iters_[0].pending == 0 && iters_[1].pending == 0; });
    window_start_ = -1;  // the next step's window starts at its own submission
  }

  // Takes the iteration slot after the last submitted one, once its previous occupant has
  // finished; `fill` sets the iteration's inputs before any op can see them. Training
  // iterations overlap the one before (previous_iteration_deps); the validation plan runs
  // alone (the caller drained).
  template <class Fill>
  Iter& submit(Run& run, int64_t step, Fill fill) {
    std::unique_lock<std::mutex> lock(mu_);
    const int i = next_slot_;
    Iter& it = iters_[i];
    Iter& other = iters_[1 - i];
    wait_for(lock, [&] { return it.pending == 0; });
    // The finished iteration's busy time within the current step window (it may have run
    // well into it: a write backlog) is counted before its times are cleared.
    if (window_start_ >= 0 && it.run == &train_) add_busy(it, now(), window_busy_);
    // `other` no longer needs the finished iteration in slot i: every op it waited for there
    // is done, and the slot is about to be reused.
    other.prev = false;
    it.run = &run;
    it.step = step;
    it.prev = &run == &train_ && other.run == &train_ && other.pending > 0;
    const size_t n = run.ops->size();
    std::fill(it.done.begin(), it.done.begin() + n, 0);
    std::fill(it.start.begin(), it.start.begin() + n, -1.0);
    std::fill(it.end.begin(), it.end.begin() + n, -1.0);
    it.pending = static_cast<int>(n);
    it.returning = run.returns;
    it.forward_only = &run == &eval_;
    it.first_rows_next = false;
    it.first_rows.clear();
    fill(it);
    if (window_start_ < 0) {
      window_busy_.fill(0);
      window_start_ = now();
      window_read_ = store_ ? store_->stats().bytes_read : 0;
      window_written_ = store_ ? store_->stats().bytes_written : 0;
    }
    for (int r = 0; r < kNumResources; ++r)
      for (int id : run.queue[r]) rings_[r].push({i, id});
    next_slot_ = 1 - i;
    cv_.notify_all();
    return it;
  }

  OffloadStepResult step(int64_t step_index, const std::vector<const int32_t*>& micro_batches,
                         const std::vector<const uint8_t*>& masks) {
    const int B = plan_.micro_batch, T = cfg_.model.seq_len, K = plan_.grad_accum;
    if (static_cast<int>(micro_batches.size()) != K)
      throw Error(str("offloaded step: ", micro_batches.size(), " micro-batches but the plan was built for grad_accum ", K));
    FY_CHECK(masks.empty() || masks.size() == micro_batches.size(), masks.size(), " loss masks for ", K,
             " micro-batches");
    // The previous step returned after its norm (exact mode), so the loss scale and Adam's
    // step count already reflect its decision.
    const double step_loss_scale = scaler_ ? scaler_->scale() : 1.0;
    const int64_t t = ++t_;
    Iter& it = submit(train_, step_index, [&](Iter& it) {
      // Mean over the counted targets of the whole step, as StepRunner: the scale 1 /
      // (counted targets of every micro-batch) is known before the first backward (1 / (N *
      // K) without masks); nothing counted: zero gradient.
      int64_t total = 0;
      for (int k = 0; k < K; ++k)
        total += it.counts[k] = split_batch(micro_batches[k], masks.empty() ? nullptr : masks[k], B, T,
                                            it.inputs[k].data(), it.targets[k].data());
      it.step_loss_scale = step_loss_scale;
      it.loss_scale = backward_scale(total, step_loss_scale);
      it.apply = true;
      it.grad_norm = 0;
      it.grad_scale = 1.0f;
      it.lr = learning_rate(cfg_.optimizer, cfg_.schedule, step_index);
      it.t = t;
    });
    std::unique_lock<std::mutex> lock(mu_);
    wait_for(lock, [&] { return it.returning == 0; });
    // The step's figures cover the window since the previous step returned: the time, each
    // resource's busy time within it (whichever iteration the op belongs to) and the bytes
    // the store moved. In steady state that window is one iteration.
    const double t_end = now();
    OffloadStepResult res;
    res.iteration_s = t_end - window_start_;
    std::copy(window_busy_.begin(), window_busy_.end(), res.busy_s.begin());
    window_busy_.fill(0);
    for (const Iter& x : iters_)
      if (x.run == &train_) add_busy(x, t_end, res.busy_s);
    if (store_) {
      const StoreStats st = store_->stats();
      res.ssd_read_bytes = st.bytes_read - window_read_;
      res.ssd_write_bytes = st.bytes_written - window_written_;
      window_read_ = st.bytes_read;
      window_written_ = st.bytes_written;
    }
    window_start_ = t_end;
    res.loss = static_cast<float>(mean_over_counted(it.losses, it.counts));
    res.grad_norm = plan_.exact ? it.grad_norm : 0.0;
    res.skipped = !it.apply;
    res.loss_scale = it.step_loss_scale;
    if (!it.apply) --t_;  // a skipped step does not count for Adam's bias correction
    res.lr = it.lr;
    return res;
  }

  // The forward-only plan on one micro-batch: the validation loss at the current weights
  // (the mean over its counted targets; 0 when none counts, as StepRunner::eval_loss).
  float eval_loss(const int32_t* batch, const uint8_t* mask) {
    drain();
    Iter& it = submit(eval_, -1, [&](Iter& it) {
      split_batch(batch, mask, plan_.micro_batch, cfg_.model.seq_len, it.inputs[0].data(), it.targets[0].data());
    });
    std::unique_lock<std::mutex> lock(mu_);
    wait_for(lock, [&] { return it.pending == 0; });
    window_start_ = -1;
    return it.eval_loss;
  }

  // The last two training iterations (they overlap), times from the first op's start.
  void write_trace(const std::string& path) {
    drain();
    nlohmann::json events = nlohmann::json::array();
    for (int r = 0; r < kNumResources; ++r)
      events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", r},
                        {"args", {{"name", resource_name(static_cast<Resource>(r))}}}});
    double t0 = -1;
    for (const Iter& x : iters_)
      if (x.run == &train_)
        for (const PlanOp& op : plan_.ops)
          if (x.start[op.id] >= 0 && (t0 < 0 || x.start[op.id] < t0)) t0 = x.start[op.id];
    for (const Iter& x : iters_) {
      if (x.run != &train_) continue;
      for (const PlanOp& op : plan_.ops) {
        if (x.start[op.id] < 0) continue;
        std::string name = op_kind_name(op.kind);
        if (op.layer >= 0) name += str(" ", op.layer);
        if (plan_.grad_accum > 1) name += str(" mb", op.micro);
        name += str(" (step ", x.step, ")");
        events.push_back({{"name", name}, {"ph", "X"}, {"pid", 0}, {"tid", static_cast<int>(op.resource)},
                          {"ts", (x.start[op.id] - t0) * 1e6}, {"dur", (x.end[op.id] - x.start[op.id]) * 1e6},
                          {"args", {{"op", op.id}, {"step", x.step}, {"micro", op.micro}, {"bytes", op.bytes}}}});
      }
    }
    std::ofstream out(path);
    if (!out) throw IoError(str(path, ": cannot write trace"));
    out << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() << "\n";
  }

 private:
  OffloadTrainer& owner_;
  Config cfg_;
  Backend& be_;
  Plan plan_;
  SsdStore* store_;
  ParamLayout layout_;
  GptModel model_;
  size_t N_ = 0;
  uint64_t wbytes_ = 0, cbytes_ = 0;
  std::vector<void*> owned_;
  float *embed_w_, *embed_g_, *final_w_, *final_g_;
  std::vector<float*> wslot_, gslot_, cslot_, layer_ckpt_;
  float* stream_[2];
  float *scratch_, *dres_;
  LayerActivations work_;
  std::vector<LayerActivations> kept_;
  std::unique_ptr<HostPool> pool_;
  std::vector<float*> hread_, hwout_, hckpt_, hgrad_, hgstage_;
  std::vector<std::vector<float>> hold_;  // held gradients per layer (host tier)
  std::vector<std::vector<float>> host_w_, host_ckpt_;
  std::vector<float> host_embed_, host_final_;
  std::vector<ExtentId> wext_, cext_, gext_;
  std::unique_ptr<OocAdamW> opt_;

  Plan eval_plan_;
  Run train_, eval_;
  std::vector<std::vector<int>> prev_deps_;  // previous_iteration_deps(plan_)
  std::vector<int> embed_refresh_ops_;        // the embedding's refresh parts in plan_
  std::vector<int32_t> row_tokens_;           // first_rows' scratch (d2h thread)
  std::vector<std::pair<size_t, size_t>> opt_ranges_, h2d_ranges_, d2h_ranges_;  // rows_complement's, per thread
  Iter iters_[2];      // the iterations that may be in flight; submissions alternate
  int next_slot_ = 0;
  Ring rings_[kNumResources];  // per resource: (iteration slot, op id) in submission order
  std::vector<std::thread> workers_;
  std::vector<void*> registered_;  // host buffers page-locked through the backend
  std::mutex mu_;  // guards iters_' progress fields, rings_, failed_, error_, stop_
  std::condition_variable cv_;
  bool stop_ = false;
  bool failed_ = false;  // an op threw: nothing more runs, every later call rethrows
  std::exception_ptr error_;
  clock_type::time_point epoch_;
  double window_start_ = -1;  // when the current step window began (-1: at the next submission)
  uint64_t window_read_ = 0, window_written_ = 0;  // store counters at that moment
  std::array<double, kNumResources> window_busy_{};  // busy time of iterations retired within it
  int update_threads_ = 1;    // runtime.threads: every worker's, and an update's that has the cores to itself
  std::unique_ptr<DynamicLossScaler> scaler_;
  int64_t t_ = 0;  // Adam's step count of the last submitted step
};

OffloadTrainer::OffloadTrainer(const Config& cfg, Backend& backend, Plan plan, SsdStore* store)
    : impl_(std::make_unique<Impl>(*this, cfg, backend, std::move(plan), store)) {}
OffloadTrainer::~OffloadTrainer() = default;
const Plan& OffloadTrainer::plan() const { return impl_->plan(); }
void OffloadTrainer::set_params(const float* params) { impl_->set_params(params); }
void OffloadTrainer::read_params(float* params) { impl_->read_params(params); }
void OffloadTrainer::set_group_params(int g, const float* p) { impl_->set_group_params(g, p); }
void OffloadTrainer::read_group_params(int g, float* p) { impl_->read_group_params(g, p); }
float* OffloadTrainer::group_staging() { return impl_->group_staging(); }
OffloadStepResult OffloadTrainer::step(int64_t s, const int32_t* batch, const uint8_t* mask) {
  if (mask) return impl_->step(s, {batch}, {mask});
  return impl_->step(s, {batch}, {});
}
OffloadStepResult OffloadTrainer::step(int64_t s, const std::vector<const int32_t*>& mbs,
                                       const std::vector<const uint8_t*>& masks) {
  return impl_->step(s, mbs, masks);
}
float OffloadTrainer::eval_loss(const int32_t* batch, const uint8_t* mask) { return impl_->eval_loss(batch, mask); }
void OffloadTrainer::write_trace(const std::string& path) const { impl_->write_trace(path); }

}  // namespace fuyou
