// The executor's memory: every buffer of the plan's table allocated once, before the first
// step (device buffers from the backend's arena, host slots from one pinned pool, resident
// host buffers, SSD extents), the optimizer over the plan's state tiers, and parameters in
// and out.
#include <spdlog/spdlog.h>

#include <cstring>

#include "fuyou/error.h"
#include "fuyou/sizes.h"
#include "fuyou/train.h"
#include "kernels/common/element_math.h"
#include "src/runtime/executor.h"

namespace fuyou {
namespace {

// The host pool's slot class of each kind of host slot (names for the pool's messages).
const char* pool_class(BufferKind k) {
  switch (k) {
    case BufferKind::kReadSlot:
      return "weights.read";
    case BufferKind::kWoutSlot:
      return "weights.out";
    case BufferKind::kCkptStage:
      return "checkpoint.staging";
    case BufferKind::kHostGradSlot:
      return "gradients";
    case BufferKind::kGradStage:
      return "gradients.staging";
    case BufferKind::kStateStage:
      return "state.staging";
    default:
      return nullptr;
  }
}

// The store extent of an SSD buffer the executor owns (the optimizer defines its own).
std::string extent_name(const PlanBuffer& b) {
  switch (b.kind) {
    case BufferKind::kSsdWeights:
      return str("layer.", b.index, "/weights");
    case BufferKind::kSsdCkpt:
      return str("layer.", b.index, "/checkpoint");
    case BufferKind::kSsdGrads:
      return str("layer.", b.index, "/gradients");
    default:
      return "";
  }
}

}  // namespace

void PlanExecutor::Impl::check_plan() {
  check_optim_format(cfg_.optimizer, be_.storage_type());
  if (plan_.optim_format != optim_format(cfg_.optimizer))
    throw Error(str("the plan is for optimizer state ",
                    moment_format_name(plan_.optim_format.moments), " / master ",
                    master_format_name(plan_.optim_format.master), " but the config asks for ",
                    cfg_.optimizer.state, " / ", cfg_.optimizer.master,
                    " (optimizer.state, optimizer.master)"));
  if (be_.storage_type() != plan_.tensors)
    throw Error(str("the plan is for ", elem_type_name(plan_.tensors),
                    " device tensors but the backend stores ", elem_type_name(be_.storage_type()),
                    " (runtime.device_tensors)"));
  if (plan_.forward_only)
    throw Error("PlanExecutor needs a training plan; it derives the forward-only one itself");
  if (plan_.device_optimizer && !be_.supports_device_optimizer())
    throw Error(str("the plan runs AdamW on the device, but backend ", be_.name(),
                    " has no optimizer on the device (optimizer.placement host)"));
  if (be_.matmul_precision() == MatmulPrecision::kFp16) {
    // The overflow check needs every gradient before any update: only exact plans have it.
    if (!plan_.exact)
      throw Error(
          "fp16 GEMM inputs need an exact-mode plan (the loss-scale overflow check "
          "sees every gradient before any update)");
    LossScaleConfig ls;
    ls.initial = cfg_.optimizer.initial_loss_scale;
    scaler_ = std::make_unique<DynamicLossScaler>(ls);
  }
  for (const PlanBuffer& b : plan_.buffers)
    if (b.tier == Tier::kSsd && !store_)
      throw Error(str("the plan keeps state on SSD (", b.name(),
                      ") but no store is open (offload.ssd_paths)"));
}

void PlanExecutor::Impl::allocate_device(int id, const PlanBuffer& b) {
  switch (b.kind) {
    case BufferKind::kModelWorkspace:
      return;  // the model's own
    case BufferKind::kEmbedRows:
      return;  // a view, resolved after the embedding
    case BufferKind::kWorkActs:
      acts_[id] = model_.alloc_activations("working activations");
      return;
    case BufferKind::kLayerActs:
      acts_[id] = model_.alloc_activations(str("layer ", b.index, " activations"));
      return;
    default: {
      void* p = be_.alloc(b.bytes, b.name());
      owned_.push_back(p);
      ptr_[id] = p;
    }
  }
}

void PlanExecutor::Impl::allocate_buffers() {
  const size_t n = plan_.buffers.size();
  ptr_.assign(n, nullptr);
  ext_.assign(n, 0);
  acts_.assign(n, LayerActivations{});
  // Host slots: one pool, a class per kind of slot, counted from the table.
  std::vector<SlotSpec> specs;
  for (const PlanBuffer& b : plan_.buffers) {
    const char* cls = pool_class(b.kind);
    if (!cls) continue;
    auto it =
        std::find_if(specs.begin(), specs.end(), [&](const SlotSpec& s) { return s.name == cls; });
    if (it == specs.end())
      specs.push_back({cls, b.bytes, 1});
    else
      ++it->count;
  }
  pool_ = std::make_unique<HostPool>(specs);
  if (store_) store_->register_pool(*pool_);
  for (size_t id = 0; id < n; ++id) {
    const PlanBuffer& b = plan_.buffers[id];
    if (b.tier == Tier::kDevice) {
      allocate_device(static_cast<int>(id), b);
    } else if (const char* cls = pool_class(b.kind)) {
      ptr_[id] = pool_->slot(pool_->slot_class(cls), static_cast<uint32_t>(b.index)).ptr;
    } else if (b.tier == Tier::kHost &&
               (b.kind == BufferKind::kHostWeights || b.kind == BufferKind::kHostCkpt ||
                b.kind == BufferKind::kGradHold || b.kind == BufferKind::kEmbedGradHold ||
                b.kind == BufferKind::kFinalGradHold || b.kind == BufferKind::kHostEmbed ||
                b.kind == BufferKind::kHostFinal)) {
      host_owned_.emplace_back((b.bytes + 3) / 4, 0.0f);
      ptr_[id] = host_owned_.back().data();
    } else if (b.tier == Tier::kSsd && !extent_name(b).empty()) {
      ext_[id] = store_->define_extent(extent_name(b), b.bytes);
    }
  }
  ptr_[plan_.buffer(BufferKind::kEmbedRows)] = ptr_[plan_.buffer(BufferKind::kEmbedWeights)];
  embed_w_ = ptr(plan_.buffer(BufferKind::kEmbedWeights));
  embed_g_ = ptr(plan_.buffer(BufferKind::kEmbedGrads));
  final_w_ = ptr(plan_.buffer(BufferKind::kFinalWeights));
  final_g_ = ptr(plan_.buffer(BufferKind::kFinalGrads));
}

void PlanExecutor::Impl::make_optimizer() {
  if (plan_.device_optimizer) {
    // AdamW's pieces per group, counted from the group's start, in one device table.
    std::vector<AdamWPiece> all;
    for (const ParamGroup& g : layout_.groups) {
      const std::vector<AdamWPiece> p = adamw_pieces(layout_, g.offset, g.offset + g.numel);
      group_pieces_.push_back({all.size(), p.size()});
      all.insert(all.end(), p.begin(), p.end());
    }
    const int table = plan_.buffer(BufferKind::kAdamWPieces);
    FY_CHECK(sizeof(AdamWPiece) * all.size() == plan_.buffers[table].bytes,
             "the plan sized AdamW's pieces for ", plan_.buffers[table].bytes, " bytes, not ",
             sizeof(AdamWPiece) * all.size());
    be_.copy_to_device(ptr_[table], all.data(), sizeof(AdamWPiece) * all.size());
    return;
  }
  std::vector<Tier> tiers;
  for (size_t g = 0; g < layout_.groups.size(); ++g)
    tiers.push_back(plan_.optim_tier(static_cast<int>(g)));
  opt_ = std::make_unique<OocAdamW>(optimizer_groups(layout_), tiers, store_,
                                    optimizer_options(cfg_.optimizer));
}

// Every host buffer a copy reads or writes is page-locked (CUDA: full-speed asynchronous
// copies); a refusal (locked-memory limit) is logged once and those copies go through the
// driver's staging.
void PlanExecutor::Impl::register_host_buffers() {
  std::vector<std::pair<void*, size_t>> host_bufs;
  for (const HostPool::Region& r : pool_->regions()) host_bufs.push_back({r.base, r.bytes});
  for (auto& v : host_owned_) host_bufs.push_back({v.data(), 4 * v.size()});
  page_lock_host(be_, host_bufs, &registered_, "the executor's host buffers");
}

void PlanExecutor::Impl::put_weights(void* dst, const float* src, size_t n) const {
  if (plan_.optim_format.master != MasterFormat::kSplit) return round_to(tensors_, dst, src, n);
  uint16_t* hi = static_cast<uint16_t*>(dst);
  for (size_t i = 0; i < n; ++i) hi[i] = math::split_hi(src[i]);
}

const uint16_t* PlanExecutor::Impl::group_working_weights(int g) {
  const int L = cfg_.model.n_layer;
  if (g == 0 || g == L + 1 || plan_.layers[g - 1].weights == Tier::kHost)
    return static_cast<const uint16_t*>(group_host_weights(g));
  const int slot = plan_.buffer(BufferKind::kReadSlot, 0),
            ext = plan_.buffer(BufferKind::kSsdWeights, g - 1);
  store_->read_sync(ext_[ext], 0, ptr(slot), round_up(plan_.buffers[ext].bytes, kIoAlign));
  return static_cast<const uint16_t*>(ptr_[slot]);
}

void* PlanExecutor::Impl::group_host_weights(int g) const {
  const int L = cfg_.model.n_layer;
  if (g == 0) return ptr(plan_.buffer(BufferKind::kHostEmbed));
  if (g == L + 1) return ptr(plan_.buffer(BufferKind::kHostFinal));
  return ptr(plan_.buffer(BufferKind::kHostWeights, g - 1));
}

void* PlanExecutor::Impl::device_weights(int g) const {
  const int L = cfg_.model.n_layer;
  return g == 0       ? embed_w_
         : g == L + 1 ? final_w_
                      : ptr(plan_.buffer(BufferKind::kWeightSlot, g - 1));
}

// Plan::device_optimizer: the group's kDeviceOptim buffer holds master (16-bit tensors only),
// m and v, each numel floats (device_state_floats).
float* PlanExecutor::Impl::device_master(int g) const {
  if (tensors_ == ElemType::kF32) return static_cast<float*>(device_weights(g));
  return ptr(plan_.buffer(BufferKind::kDeviceOptim, g));
}

float* PlanExecutor::Impl::device_moment(int g, StateKind kind) const {
  const size_t n = layout_.groups.at(g).numel;
  float* state = ptr(plan_.buffer(BufferKind::kDeviceOptim, g));
  if (tensors_ != ElemType::kF32) state += n;
  return kind == StateKind::kAdamV ? state + n : state;
}

void PlanExecutor::Impl::set_group_params(int g, const float* src) {
  drain();
  if (plan_.device_optimizer) {
    const size_t n = layout_.groups.at(g).numel;
    if (tensors_ != ElemType::kF32) be_.copy_to_device(device_master(g), src, 4 * n);
    be_.zero(device_moment(g, StateKind::kAdamM), 4 * n);
    be_.zero(device_moment(g, StateKind::kAdamV), 4 * n);
  } else {
    opt_->init_group(g, src);
  }
  set_group_weights(g, src);
}

// The weights the forward reads, on the group's tier: host memory (and the device's resident
// copy for the embedding and final groups), or the SSD extent.
void PlanExecutor::Impl::set_group_weights(int g, const float* src) {
  const int L = cfg_.model.n_layer;
  const ParamGroup& pg = layout_.groups.at(g);
  const size_t bytes = es_ * pg.numel;
  if (plan_.device_optimizer) {  // straight into the device's copy (`src` may be the staging)
    if (tensors_ == ElemType::kF32) return be_.copy_to_device(device_weights(g), src, bytes);
    std::vector<uint16_t> lowp(pg.numel);
    put_weights(lowp.data(), src, pg.numel);
    return be_.copy_to_device(device_weights(g), lowp.data(), bytes);
  }
  if (g == 0 || g == L + 1 || plan_.layers[g - 1].weights == Tier::kHost) {
    void* host = group_host_weights(g);
    put_weights(host, src, pg.numel);
    if (g == 0) be_.copy_to_device(embed_w_, host, bytes);
    if (g == L + 1) be_.copy_to_device(final_w_, host, bytes);
    return;
  }
  // To SSD through a read-staging slot (free between steps); a retained layer's weights-out
  // slot gets them too, where the first step's forward loads them.
  const int l = g - 1;
  const PlanBuffer& ssd = plan_.buffers[plan_.buffer(BufferKind::kSsdWeights, l)];
  char* staging = reinterpret_cast<char*>(ptr(plan_.buffer(BufferKind::kReadSlot, 0)));
  put_weights(staging, src, pg.numel);
  std::memset(staging + bytes, 0, round_up(bytes, kIoAlign) - bytes);
  store_->write_sync(ext_[plan_.buffer(BufferKind::kSsdWeights, l)], 0, staging,
                     round_up(ssd.bytes, kIoAlign));
  if (plan_.layers[l].retained >= 0)
    std::memcpy(ptr(plan_.buffer(BufferKind::kWoutSlot, plan_.layers[l].retained)), staging, bytes);
}

void PlanExecutor::Impl::set_params(const float* params) {
  for (size_t g = 0; g < layout_.groups.size(); ++g)
    set_group_params(static_cast<int>(g), params + layout_.groups[g].offset);
}

void PlanExecutor::Impl::read_group_params(int g, float* dst) {
  drain();
  if (plan_.device_optimizer)
    return be_.copy_to_host(dst, device_master(g), 4 * layout_.groups.at(g).numel);
  const bool split = plan_.optim_format.master == MasterFormat::kSplit;
  opt_->read_master(g, dst, split ? group_working_weights(g) : nullptr);
}

// A group's fp32 state between the optimizer and a checkpoint: a gradient slot (free between
// steps) where gradients are fp32, the plan's state staging where they are 16-bit.
float* PlanExecutor::Impl::group_staging() {
  drain();
  return ptr(plan_.buffer(tensors_ == ElemType::kF32 && !plan_.device_optimizer
                              ? BufferKind::kHostGradSlot
                              : BufferKind::kStateStage,
                          0));
}

void PlanExecutor::Impl::read_group_state(int g, StateKind kind, const StateSink& sink) {
  drain();
  if (kind == StateKind::kMaster && plan_.optim_format.master == MasterFormat::kSplit) {
    float* staging = group_staging();  // joined from the working halves and the remainders
    read_group_params(g, staging);
    return sink(0, staging, layout_.groups.at(g).numel);
  }
  if (plan_.device_optimizer) {
    const size_t n = layout_.groups.at(g).numel;
    float* staging = group_staging();
    be_.copy_to_host(staging,
                     kind == StateKind::kMaster ? device_master(g) : device_moment(g, kind), 4 * n);
    return sink(0, staging, n);
  }
  opt_->read_state(g, kind, sink);
}

void PlanExecutor::Impl::read_group_packed(int g, StateKind kind, const PackedSink& sink) {
  drain();
  FY_CHECK(opt_, "packed state is the host optimizer's; this plan runs AdamW on the device");
  opt_->read_packed(g, kind, sink);
}

void PlanExecutor::Impl::write_group_packed(int g, StateKind kind, const PackedSource& source) {
  drain();
  FY_CHECK(opt_, "packed state is the host optimizer's; this plan runs AdamW on the device");
  opt_->write_packed(g, kind, source);
}

// kMaster goes through the host gradient staging slot into the optimizer's master and the
// group's weights on every tier; the moments are left to their own write_state (a restore
// writes all three), so a group on SSD moves each kind once.
void PlanExecutor::Impl::write_group_state(int g, StateKind kind, const StateSource& source) {
  drain();
  const size_t n = layout_.groups.at(g).numel;
  if (plan_.device_optimizer) {
    float* staging = group_staging();
    source(0, staging, n);
    if (kind != StateKind::kMaster)
      return be_.copy_to_device(device_moment(g, kind), staging, 4 * n);
    // The master, then the weights rounded from it (fp32 tensors: the same buffer, whose
    // value the staging still holds).
    if (tensors_ != ElemType::kF32) be_.copy_to_device(device_master(g), staging, 4 * n);
    return set_group_weights(g, staging);
  }
  if (kind != StateKind::kMaster) return opt_->write_state(g, kind, source);
  float* staging = group_staging();
  source(0, staging, n);
  opt_->write_state(g, StateKind::kMaster, [&](size_t begin, float* data, size_t n) {
    std::memcpy(data, staging + begin, 4 * n);
  });
  set_group_weights(g, staging);
}

OptimizerCounters PlanExecutor::Impl::counters() {
  drain();
  return optimizer_counters(t_, scaler_.get());
}

void PlanExecutor::Impl::set_counters(const OptimizerCounters& c) {
  drain();
  restore_optimizer_counters(c, &t_, scaler_.get());
}

void PlanExecutor::Impl::read_params(float* params) {
  drain();
  std::fill(params, params + layout_.total, 0.0f);
  for (size_t g = 0; g < layout_.groups.size(); ++g)
    read_group_params(static_cast<int>(g), params + layout_.groups[g].offset);
}

}  // namespace fuyou
