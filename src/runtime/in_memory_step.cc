// The in-memory step (InMemoryStep): the model on the device, and AdamW either on the host (an
// OocAdamW with every group in host memory, gradients copied down and weights copied up each
// step) or on the device beside the model (optimizer.placement). Both placements compute the
// same bits: the device's reductions and update follow the host's order
// (kernels/common/grad_math.h, math::adamw_element).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/log.h"
#include "fuyou/optim.h"
#include "fuyou/sizes.h"
#include "fuyou/train.h"
#include "kernels/common/element_math.h"

namespace fuyou {

namespace {

// Device bytes of the optimizer's state on the device: master (unless the device's fp32
// weights are the master), two moments, the fp32 gradient sums when micro-batches are summed
// in fp32, and the pieces' table.
uint64_t device_optimizer_bytes(size_t n, ElemType tensors, bool fp32_sums, size_t pieces) {
  return 4ull * n * (device_state_floats(tensors) + (fp32_sums ? 1 : 0)) +
         sizeof(AdamWPiece) * pieces;
}

}  // namespace

std::vector<AdamWPiece> adamw_pieces(const ParamLayout& layout, size_t begin, size_t end) {
  std::vector<AdamWPiece> pieces;
  for (const TensorSpec& t : layout.tensors) {
    if (t.offset < begin || t.offset >= end) continue;
    for (size_t b = 0; b < t.numel; b += kDeviceAdamWPiece) {
      AdamWPiece p;
      p.begin = t.offset - begin + b;
      p.n = static_cast<uint32_t>(std::min<size_t>(kDeviceAdamWPiece, t.numel - b));
      p.decay = t.decay ? 1 : 0;
      pieces.push_back(p);
    }
  }
  return pieces;
}

InMemoryStep::InMemoryStep(const Config& cfg, Backend& backend)
    : cfg_(cfg), be_(backend), model_(cfg.model, backend, cfg.schedule.micro_batch) {
  store_ = be_.storage_type();
  check_optim_format(cfg.optimizer, store_);
  format_ = fuyou::optim_format(cfg.optimizer);
  const size_t n = model_.layout().total;
  master_.assign(n, 0.0f);
  fp32_sums_ = store_ != ElemType::kF32 && cfg.schedule.grad_accum_type != "tensors";
  if (store_ != ElemType::kF32) lowp_.assign(n, 0);
  inputs_.resize(model_.tokens_per_batch());
  targets_.resize(model_.tokens_per_batch());
  if (be_.matmul_precision() == MatmulPrecision::kFp16) {
    LossScaleConfig ls;
    ls.initial = cfg.optimizer.initial_loss_scale;
    scaler_ = std::make_unique<DynamicLossScaler>(ls);
  }
  for (const ParamGroup& g : model_.layout().groups) square_groups_.push_back({g.offset, g.numel});
  if (choose_device_optimizer()) {
    place_on_device();
    return;
  }
  opt_ = std::make_unique<OocAdamW>(optimizer_groups(model_.layout()),
                                    std::vector<Tier>(model_.layout().groups.size(), Tier::kHost),
                                    nullptr, optimizer_options(cfg.optimizer));
  grad_.assign(n * elem_type_size(store_), 0);
  // The step's two whole-model copies (gradients out, weights in) page-locked where the
  // backend can (CUDA: the bus's rate instead of the driver's staging); a refusal (the
  // locked-memory limit) is logged once and costs only speed.
  page_lock_host(
      be_,
      {{grad_.data(), grad_.size()},
       store_ == ElemType::kF32 ? std::pair<void*, size_t>{master_.data(), 4 * master_.size()}
                                : std::pair<void*, size_t>{lowp_.data(), 2 * lowp_.size()}},
      &pinned_, "the in-memory step's host buffers");
}

InMemoryStep::~InMemoryStep() {
  for (void* p : pinned_) be_.unregister_host(p);
  for (void* p : device_owned_) be_.free(p);
}

bool in_memory_optimizer_on_device(const Config& cfg, Backend& be, uint64_t device_free) {
  const std::string& want = cfg.optimizer.placement;
  if (want == "host") return false;
  // The device's optimizer keeps fp32 state only; packed state is the host optimizer's.
  if (optim_format(cfg.optimizer).packed()) {
    if (want == "device")
      throw ConfigError(
          str("optimizer.placement is device, but optimizer.state ", cfg.optimizer.state,
              " and optimizer.master ", cfg.optimizer.master,
              " are kept by the host optimizer only (use auto or host, or fp32 state)"));
    return false;
  }
  const ParamLayout layout = make_gpt_layout(cfg.model);
  const ElemType store = be.storage_type();
  const uint64_t need =
      device_optimizer_bytes(layout.total, store, sums_grads_in_fp32(cfg.schedule, store),
                             adamw_pieces(layout, 0, layout.total).size());
  if (want == "device") {
    if (!be.supports_device_optimizer())
      throw ConfigError(str("optimizer.placement is device, but backend ", be.name(),
                            " has no optimizer on the device (use auto or host)"));
    if (need > device_free) {
      const MemoryStats mem = be.memory();
      throw ConfigError(str("optimizer.placement is device, but the optimizer's state needs ",
                            format_size(need), " of device memory and ", format_size(device_free),
                            " is left beside the model (", format_size(mem.used), " of ",
                            format_size(mem.capacity),
                            "); use auto or host, or raise offload.device_memory"));
    }
    return true;
  }
  // auto: a GPU's own memory only (on the CPU backend the host optimizer's SIMD paths are the
  // faster way to the same bits), with room to spare for the step's transient buffers.
  return be.supports_device_optimizer() && !be.device_is_host_memory() &&
         need + need / 16 <= device_free;
}

bool InMemoryStep::choose_device_optimizer() const {
  const MemoryStats mem = be_.memory();
  // Capacity 0: no limit (the CPU backend without offload.device_memory).
  const uint64_t free_b = mem.capacity == 0         ? UINT64_MAX
                          : mem.capacity > mem.used ? mem.capacity - mem.used
                                                    : 0;
  return in_memory_optimizer_on_device(cfg_, be_, free_b);
}

void InMemoryStep::place_on_device() {
  on_device_ = true;
  const size_t n = model_.layout().total;
  auto floats = [&](const char* what) {
    float* p = static_cast<float*>(be_.alloc(4 * n, what));
    device_owned_.push_back(p);
    return p;
  };
  d_master_ = store_ == ElemType::kF32 ? static_cast<float*>(model_.params())
                                       : floats("fp32 master weights");
  d_m_ = floats("Adam first moments");
  d_v_ = floats("Adam second moments");
  if (fp32_sums_ && cfg_.schedule.grad_accum > 1) d_sum_ = floats("fp32 gradient sums");
  const std::vector<AdamWPiece> pieces = adamw_pieces(model_.layout(), 0, model_.layout().total);
  d_pieces_ =
      static_cast<AdamWPiece*>(be_.alloc(sizeof(AdamWPiece) * pieces.size(), "AdamW pieces"));
  device_owned_.push_back(d_pieces_);
  be_.copy_to_device(d_pieces_, pieces.data(), sizeof(AdamWPiece) * pieces.size());
  n_pieces_ = pieces.size();
  spdlog::info(
      "optimizer on the device: fp32 master weights and Adam moments beside the model ({})",
      format_size(device_optimizer_bytes(n, store_, d_sum_ != nullptr, n_pieces_)));
}

void InMemoryStep::init_params() {
  init_gpt_params(cfg_.model, model_.layout(), master_.data());
  set_params(master_.data());
}

void InMemoryStep::set_params(const float* host_params) {
  if (host_params != master_.data())
    std::copy(host_params, host_params + master_.size(), master_.begin());
  master_stale_ = false;
  const ParamLayout& layout = model_.layout();
  if (on_device_) {
    if (d_master_ != model_.params())
      be_.copy_to_device(d_master_, master_.data(), 4 * master_.size());
    be_.zero(d_m_, 4 * master_.size());
    be_.zero(d_v_, 4 * master_.size());
  } else {
    for (size_t g = 0; g < layout.groups.size(); ++g)
      opt_->init_group(static_cast<int>(g), master_.data() + layout.groups[g].offset);
  }
  if (store_ != ElemType::kF32) working_weights(lowp_.data(), master_.data(), lowp_.size());
  upload_params(0, master_.size());
}

void InMemoryStep::working_weights(uint16_t* dst, const float* src, size_t n) const {
  if (format_.master != MasterFormat::kSplit) return round_to(store_, dst, src, n);
  for (size_t i = 0; i < n; ++i) dst[i] = math::split_hi(src[i]);
}

void InMemoryStep::upload_params(size_t begin, size_t n) {
  char* dst = static_cast<char*>(model_.params()) + begin * elem_type_size(store_);
  if (store_ == ElemType::kF32) return be_.copy_to_device(dst, master_.data() + begin, 4 * n);
  be_.copy_to_device(dst, lowp_.data() + begin, 2 * n);
}

float* InMemoryStep::device_state(StateKind kind) const {
  switch (kind) {
    case StateKind::kMaster:
      return d_master_;
    case StateKind::kAdamM:
      return d_m_;
    case StateKind::kAdamV:
      return d_v_;
  }
  return nullptr;
}

void InMemoryStep::read_state(int group, StateKind kind, const StateSink& sink) {
  if (kind == StateKind::kMaster && format_.master == MasterFormat::kSplit) {
    const ParamGroup& g = model_.layout().groups.at(group);
    return sink(0, master().data() + g.offset, g.numel);  // joined from the working halves
  }
  if (!on_device_) return opt_->read_state(group, kind, sink);
  const ParamGroup& g = model_.layout().groups.at(group);
  std::vector<float> host(g.numel);
  be_.copy_to_host(host.data(), device_state(kind) + g.offset, 4 * g.numel);
  sink(0, host.data(), g.numel);
}

void InMemoryStep::write_state(int group, StateKind kind, const StateSource& source) {
  const ParamGroup& g = model_.layout().groups.at(group);
  if (kind != StateKind::kMaster && !on_device_) return opt_->write_state(group, kind, source);
  if (kind != StateKind::kMaster) {
    std::vector<float> host(g.numel);
    source(0, host.data(), g.numel);
    return be_.copy_to_device(device_state(kind) + g.offset, host.data(), 4 * g.numel);
  }
  master();  // the other groups' masters current before this one is replaced
  float* master = master_.data() + g.offset;
  source(0, master, g.numel);
  if (on_device_) {
    if (d_master_ != model_.params()) be_.copy_to_device(d_master_ + g.offset, master, 4 * g.numel);
  } else {
    opt_->write_state(group, kind, [&](size_t begin, float* data, size_t n) {
      std::copy(master + begin, master + begin + n, data);
    });
  }
  if (store_ != ElemType::kF32) working_weights(lowp_.data() + g.offset, master, g.numel);
  upload_params(g.offset, g.numel);
}

void InMemoryStep::read_packed(int group, StateKind kind, const PackedSink& sink) {
  FY_CHECK(!on_device_ && kind != StateKind::kMaster,
           "packed state is the host optimizer's moments");
  opt_->read_packed(group, kind, sink);
}

void InMemoryStep::write_packed(int group, StateKind kind, const PackedSource& source) {
  FY_CHECK(!on_device_ && kind != StateKind::kMaster,
           "packed state is the host optimizer's moments");
  opt_->write_packed(group, kind, source);
}

OptimizerCounters InMemoryStep::counters() const { return optimizer_counters(t_, scaler_.get()); }

void InMemoryStep::set_counters(const OptimizerCounters& c) {
  restore_optimizer_counters(c, &t_, scaler_.get());
}

StepResult InMemoryStep::step(int64_t step_index, const std::vector<const int32_t*>& micro_batches,
                              const std::vector<const uint8_t*>& masks,
                              const std::vector<const int32_t*>& positions) {
  const int B = cfg_.schedule.micro_batch, T = cfg_.model.seq_len;
  const int accum = static_cast<int>(micro_batches.size());
  FY_CHECK(accum >= 1, "no micro-batches");
  FY_CHECK(masks.empty() || masks.size() == micro_batches.size(), masks.size(), " loss masks for ",
           accum, " micro-batches");
  FY_CHECK(positions.empty() || positions.size() == micro_batches.size(), positions.size(),
           " position arrays for ", accum, " micro-batches");
  StepResult r;
  mark(OpClass::kHost);  // the step's start: batch preparation until the device's first work
  model_.zero_grads();
  // The loss is the mean over the counted targets of the whole step (every micro-batch), the
  // mean PyTorch's cross_entropy(ignore_index=-1) gives over the concatenated micro-batches:
  // each counted target weighs the same whichever micro-batch it is in (a mean of per-micro-
  // batch means would overweight the targets of a mostly-masked micro-batch). So the gradient
  // scale is 1 / (counted targets of the step), known before the first backward. Without
  // masks that is N * accum, and float(N * accum) is exactly the float(N) * accum used before
  // masks existed (both exact below 2^24). Nothing counted: scale 0, zero gradient.
  std::vector<int64_t> counts(accum);
  int64_t total = 0;
  for (int k = 0; k < accum; ++k)
    total += counts[k] = count_targets(masks.empty() ? nullptr : masks[k], B, T);
  r.loss_scale = scaler_ ? scaler_->scale() : 1.0;
  const float scale = backward_scale(total, r.loss_scale);
  std::vector<float> means(accum);
  // Summed in fp32 (16-bit tensors, several micro-batches): each micro-batch's gradient starts
  // from zero on the device and is added into the fp32 sum (on the host, or on the device
  // beside the state), as the offloading executor adds each group's (kAccumulateGrads); else
  // the device's gradients are the sum.
  const bool sums = fp32_sums_ && accum > 1;
  summed_ = sums;
  if (sums && !on_device_) sum_.resize(master_.size());
  FY_CHECK(!sums || !on_device_ || d_sum_,
           "fp32 gradient sums on the device were not allocated for ", accum,
           " micro-batches (schedule.grad_accum is ", cfg_.schedule.grad_accum, ")");
  for (int k = 0; k < accum; ++k) {
    if (sums && k > 0) model_.zero_grads();
    split_batch(micro_batches[k], masks.empty() ? nullptr : masks[k], B, T, inputs_.data(),
                targets_.data());
    means[k] = model_.forward_backward(inputs_.data(), targets_.data(),
                                       positions.empty() ? nullptr : positions[k], scale);
    if (!sums) continue;
    if (on_device_) {
      mark(OpClass::kDeviceOptimizer);
      be_.accumulate_fp32(d_sum_, model_.grads(), store_, master_.size(), k == 0);
      continue;
    }
    mark(OpClass::kCopyToHost);
    be_.copy_to_host(grad_.data(), model_.grads(), grad_.size());
    mark(OpClass::kHostSums);
    add_to_fp32_sum(sum_.data(), grad_.data(), store_, sum_.size(), k == 0);
  }
  r.loss = static_cast<float>(mean_over_counted(means, counts));
  r.lr = learning_rate(cfg_.optimizer, cfg_.schedule, step_index);
  // The step's gradient where the optimizer is: its fp32 sums, or the device's gradients (on
  // the host, copied down first).
  StepGradient g;
  g.type = sums ? ElemType::kF32 : store_;
  // The norm's sum of squares, per parameter group in order, each group summed in double: the
  // reduction the offloading scheduler performs too (kernels/common/grad_math.h), so all clip
  // identically. It runs where the gradient is: the device's gradients (or its fp32 sums there)
  // through the backend's sum_squares, the same bits on the device (the CPU backend's is this
  // host loop), before a host AdamW's copy down, so a GPU sums them instead of the host; fp32
  // sums kept on the host, on the host. Padding between tensors holds zero gradient.
  const void* device_grad = sums ? static_cast<const void*>(d_sum_) : model_.grads();
  const bool sum_on_device = on_device_ || (!sums && be_.supports_device_optimizer());
  double sq = 0;
  if (sum_on_device) {
    mark(on_device_ || !be_.device_is_host_memory() ? OpClass::kDeviceOptimizer
                                                    : OpClass::kHostNorm);
    sq = be_.sum_squares(device_grad, g.type, square_groups_);
  }
  if (on_device_) {
    g.data = device_grad;
  } else {
    mark(OpClass::kCopyToHost);
    if (!sums) be_.copy_to_host(grad_.data(), model_.grads(), grad_.size());
    g.data = sums ? static_cast<const void*>(sum_.data()) : grad_.data();
  }
  if (!sum_on_device) {
    mark(OpClass::kHostNorm);
    const size_t es = elem_type_size(g.type);
    for (const auto& [offset, n] : square_groups_)
      sq += group_sum_squares(static_cast<const char*>(g.data) + es * offset, g.type, n);
  }
  mark(OpClass::kHost);
  const StepDecision d = decide_step(sq, r.loss_scale, cfg_.optimizer.grad_clip, scaler_.get());
  r.grad_norm = d.grad_norm;
  // An fp16 overflow skips the whole update, Adam's step count included (as GradScaler).
  if (!d.apply) {
    r.skipped = true;
    return r;
  }
  ++t_;
  if (on_device_)
    update_on_device(g, static_cast<float>(d.grad_scale), static_cast<float>(r.lr));
  else
    update_on_host(g, static_cast<float>(d.grad_scale), static_cast<float>(r.lr));
  return r;
}

// Every group's update; the new working weights come back into master_ (fp32 tensors) or
// lowp_ (16-bit, rounded in the update's pass) and go to the device. All updates are queued
// at once (the optimizer's worker runs them in order) and each group goes to the device as
// soon as its update is done, while the worker updates the next: the copies hide behind the
// updates instead of following them. With 16-bit tensors the fp32 master stays in the
// optimizer until master() asks for it.
void InMemoryStep::update_on_host(const StepGradient& g, float grad_scale, float lr) {
  const ParamLayout& layout = model_.layout();
  const size_t es = elem_type_size(g.type);
  std::vector<OocAdamW::Handle> updates;
  for (size_t i = 0; i < layout.groups.size(); ++i) {
    OocAdamW::Update u;
    u.group = static_cast<int>(i);
    u.grad = static_cast<const char*>(g.data) + es * layout.groups[i].offset;
    u.grad_type = g.type;
    u.lowp = store_ == ElemType::kF32 ? static_cast<void*>(master_.data() + layout.groups[i].offset)
                                      : lowp_.data() + layout.groups[i].offset;
    u.lowp_type = store_;
    u.grad_scale = grad_scale;
    u.lr = lr;
    u.t = t_;
    updates.push_back(opt_->submit(u));
  }
  // Group i's range runs to the next group's start (the last: to the end), so the uploads
  // cover every element, padding included, as one whole-model copy would.
  for (size_t i = 0; i < layout.groups.size(); ++i) {
    mark(OpClass::kHostAdamW);
    opt_->wait(updates[i]);
    const size_t begin = layout.groups[i].offset;
    const size_t end = i + 1 < layout.groups.size() ? layout.groups[i + 1].offset : master_.size();
    mark(OpClass::kCopyToDevice);
    upload_params(begin, end - begin);
  }
  master_stale_ = store_ != ElemType::kF32;
}

// The same update on the device, queued behind the backward and ahead of the next forward:
// nothing crosses the bus.
void InMemoryStep::update_on_device(const StepGradient& g, float grad_scale, float lr) {
  DeviceAdamW a;
  a.master = d_master_;
  a.m = d_m_;
  a.v = d_v_;
  a.grad = g.data;
  a.grad_type = g.type;
  a.lowp = store_ == ElemType::kF32 ? nullptr : model_.params();
  a.lowp_type = store_;
  a.pieces = d_pieces_;
  a.count = n_pieces_;
  const OocAdamWOptions o = optimizer_options(cfg_.optimizer);
  set_adamw_constants(&a, AdamWStep{lr, o.beta1, o.beta2, o.eps, 0.0f, t_}, o.weight_decay,
                      grad_scale);
  mark(OpClass::kDeviceOptimizer);
  be_.adamw(a);
  master_stale_ = true;
}

const std::vector<float>& InMemoryStep::master() {
  if (!master_stale_) return master_;
  if (on_device_) {
    be_.copy_to_host(master_.data(), d_master_, 4 * master_.size());
  } else {
    const ParamLayout& layout = model_.layout();
    const bool split = format_.master == MasterFormat::kSplit;
    for (size_t g = 0; g < layout.groups.size(); ++g)
      opt_->read_master(static_cast<int>(g), master_.data() + layout.groups[g].offset,
                        split ? lowp_.data() + layout.groups[g].offset : nullptr);
  }
  master_stale_ = false;
  return master_;
}

std::vector<float> InMemoryStep::step_gradient() const {
  std::vector<float> g(master_.size());
  if (on_device_) {
    if (summed_) {
      be_.copy_to_host(g.data(), d_sum_, 4 * g.size());
      return g;
    }
    std::vector<char> stored(g.size() * elem_type_size(store_));
    be_.copy_to_host(stored.data(), const_cast<Transformer&>(model_).grads(), stored.size());
    widen_from(store_, g.data(), stored.data(), g.size());
    return g;
  }
  if (summed_) return sum_;
  widen_from(store_, g.data(), grad_.data(), g.size());
  return g;
}

float InMemoryStep::eval_loss(const int32_t* batch, const uint8_t* mask, const int32_t* positions) {
  split_batch(batch, mask, cfg_.schedule.micro_batch, cfg_.model.seq_len, inputs_.data(),
              targets_.data());
  return model_.forward(inputs_.data(), targets_.data(), positions);
}

}  // namespace fuyou
