#include <algorithm>
#include <cmath>
#include <cstddef>
#include <utility>
#include <vector>

#include "fuyou/error.h"
#include "fuyou/optim.h"
#include "fuyou/train.h"
#include "kernels/common/element_math.h"

namespace fuyou {

namespace {

// Elements per block of the sum of squares: blocks are summed in parallel, and their sums
// added in block order, so the result does not depend on the thread count.
constexpr size_t kSumBlock = size_t(1) << 16;

// One block [lo, hi) of the sum of squares in double: element i into lane (i - lo) % 8, the
// lanes added pairwise in a fixed order. Eight independent chains instead of one let the
// adds overlap and vectorise (one chain runs at one add's latency per element).
template <typename Widen>
double block_sum_squares(size_t lo, size_t hi, Widen widen) {
  double lane[8] = {};
  size_t i = lo;
  for (; i + 8 <= hi; i += 8)
    for (int l = 0; l < 8; ++l) {
      const double x = widen(i + l);
      lane[l] += x * x;
    }
  for (; i < hi; ++i) {
    const double x = widen(i);
    lane[(i - lo) % 8] += x * x;
  }
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

template <typename Widen>
double sum_squares(size_t n, Widen widen) {
  const size_t blocks = (n + kSumBlock - 1) / kSumBlock;
  if (blocks <= 1) return n ? block_sum_squares(0, n, widen) : 0.0;
  std::vector<double> sums(blocks);
#pragma omp parallel for schedule(static) if (blocks >= 8)
  for (ptrdiff_t b = 0; b < static_cast<ptrdiff_t>(blocks); ++b) {
    const size_t lo = static_cast<size_t>(b) * kSumBlock;
    sums[b] = block_sum_squares(lo, std::min(n, lo + kSumBlock), widen);
  }
  double s = 0;
  for (double x : sums) s += x;
  return s;
}

}  // namespace

double group_sum_squares(const void* g, ElemType type, size_t n) {
  if (type == ElemType::kF32) {
    const float* f = static_cast<const float*>(g);
    return sum_squares(n, [f](size_t i) { return static_cast<double>(f[i]); });
  }
  const uint16_t* h = static_cast<const uint16_t*>(g);
  if (type == ElemType::kBF16)
    return sum_squares(n, [h](size_t i) { return static_cast<double>(math::bf16_to_float(h[i])); });
  return sum_squares(n, [h](size_t i) { return static_cast<double>(math::fp16_to_float(h[i])); });
}

void add_to_fp32_sum(float* sum, const void* g, ElemType type, size_t n, bool first) {
  if (first) return widen_from(type, sum, g, n);  // exact: the sum is the gradient
  // Element by element, so the threads' shares do not change a bit of the result.
  const ptrdiff_t count = static_cast<ptrdiff_t>(n);
  const bool parallel = n >= (size_t(1) << 16);
  if (type == ElemType::kF32) {
    const float* f = static_cast<const float*>(g);
#pragma omp parallel for schedule(static) if (parallel)
    for (ptrdiff_t i = 0; i < count; ++i) sum[i] += f[i];
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(g);
  if (type == ElemType::kBF16) {
#pragma omp parallel for schedule(static) if (parallel)
    for (ptrdiff_t i = 0; i < count; ++i) sum[i] += math::bf16_to_float(h[i]);
  } else {
#pragma omp parallel for schedule(static) if (parallel)
    for (ptrdiff_t i = 0; i < count; ++i) sum[i] += math::fp16_to_float(h[i]);
  }
}

void split_batch(const int32_t* batch, int B, int T, int32_t* inputs, int32_t* targets) {
  for (int b = 0; b < B; ++b) {
    const int32_t* row = batch + static_cast<size_t>(b) * (T + 1);
    std::copy(row, row + T, inputs + static_cast<size_t>(b) * T);
    std::copy(row + 1, row + T + 1, targets + static_cast<size_t>(b) * T);
  }
}

int64_t split_batch(const int32_t* batch, const uint8_t* counted, int B, int T, int32_t* inputs,
                    int32_t* targets) {
  split_batch(batch, B, T, inputs, targets);
  if (!counted) return static_cast<int64_t>(B) * T;
  int64_t n = 0;
  for (size_t i = 0; i < static_cast<size_t>(B) * T; ++i) {
    if (counted[i]) ++n;
    else targets[i] = kIgnoreTarget;
  }
  return n;
}

int64_t count_targets(const uint8_t* counted, int B, int T) {
  const size_t n = static_cast<size_t>(B) * T;
  if (!counted) return static_cast<int64_t>(n);
  return std::count_if(counted, counted + n, [](uint8_t c) { return c != 0; });
}

double mean_over_counted(const std::vector<float>& means, const std::vector<int64_t>& counts) {
  FY_CHECK(means.size() == counts.size() && !means.empty(), "mean_over_counted: ", means.size(),
           " means for ", counts.size(), " counts");
  if (std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts[0]; })) {
    double s = 0;
    for (float m : means) s += m;
    return s / static_cast<double>(means.size());
  }
  double s = 0, total = 0;
  for (size_t i = 0; i < means.size(); ++i) {
    s += static_cast<double>(means[i]) * static_cast<double>(counts[i]);
    total += static_cast<double>(counts[i]);
  }
  return total > 0 ? s / total : 0.0;
}

std::vector<OptimGroup> optimizer_groups(const ParamLayout& layout) {
  std::vector<OptimGroup> groups;
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    OptimGroup og{layout.groups[g].name, layout.groups[g].numel, {}};
    for (const TensorSpec& t : layout.tensors)
      if (t.group == static_cast<int>(g)) og.tensors.push_back({t.offset - layout.groups[g].offset, t.numel, t.decay});
    groups.push_back(og);
  }
  return groups;
}

OocAdamWOptions optimizer_options(const OptimizerConfig& o) {
  OocAdamWOptions oo;
  oo.beta1 = static_cast<float>(o.beta1);
  oo.beta2 = static_cast<float>(o.beta2);
  oo.eps = static_cast<float>(o.eps);
  oo.weight_decay = static_cast<float>(o.weight_decay);
  return oo;
}

StepRunner::StepRunner(const Config& cfg, Backend& backend)
    : cfg_(cfg), be_(backend), model_(cfg.model, backend, cfg.schedule.micro_batch),
      opt_(optimizer_groups(model_.layout()),
           std::vector<StateTier>(model_.layout().groups.size(), StateTier::kHost), nullptr,
           optimizer_options(cfg.optimizer)) {
  store_ = be_.storage_type();
  size_t n = model_.layout().total;
  master_.assign(n, 0.0f);
  grad_.assign(n * elem_type_size(store_), 0);
  fp32_sums_ = store_ != ElemType::kF32 && cfg.schedule.grad_accum_type != "tensors";
  if (store_ != ElemType::kF32) lowp_.assign(n, 0);
  inputs_.resize(model_.tokens_per_batch());
  targets_.resize(model_.tokens_per_batch());
  if (be_.matmul_precision() == MatmulPrecision::kFp16) {
    LossScaleConfig ls;
    ls.initial = cfg.optimizer.initial_loss_scale;
    scaler_ = std::make_unique<DynamicLossScaler>(ls);
  }
  // The step's two whole-model copies (gradients out, weights in) page-locked where the
  // backend can (CUDA: the bus's rate instead of the driver's staging); a refusal (the
  // locked-memory limit) is logged once and costs only speed.
  page_lock_host(be_,
                 {{grad_.data(), grad_.size()},
                  store_ == ElemType::kF32 ? std::pair<void*, size_t>{master_.data(), 4 * master_.size()}
                                           : std::pair<void*, size_t>{lowp_.data(), 2 * lowp_.size()}},
                 &pinned_, "the in-memory step's host buffers");
}

StepRunner::~StepRunner() {
  for (void* p : pinned_) be_.unregister_host(p);
}

void StepRunner::init_params() {
  init_gpt_params(cfg_.model, model_.layout(), master_.data());
  set_params(master_.data());
}

void StepRunner::set_params(const float* host_params) {
  if (host_params != master_.data()) std::copy(host_params, host_params + master_.size(), master_.begin());
  master_stale_ = false;
  const ParamLayout& layout = model_.layout();
  for (size_t g = 0; g < layout.groups.size(); ++g) opt_.init_group(static_cast<int>(g), master_.data() + layout.groups[g].offset);
  if (store_ != ElemType::kF32) round_to(store_, lowp_.data(), master_.data(), lowp_.size());
  upload_params(0, master_.size());
}

void StepRunner::upload_params(size_t begin, size_t n) {
  char* dst = static_cast<char*>(model_.params()) + begin * elem_type_size(store_);
  if (store_ == ElemType::kF32) return be_.copy_to_device(dst, master_.data() + begin, 4 * n);
  be_.copy_to_device(dst, lowp_.data() + begin, 2 * n);
}

void StepRunner::read_state(int group, StateKind kind, const StateSink& sink) { opt_.read_state(group, kind, sink); }

void StepRunner::write_state(int group, StateKind kind, const StateSource& source) {
  const ParamGroup& g = model_.layout().groups.at(group);
  if (kind != StateKind::kMaster) return opt_.write_state(group, kind, source);
  master();  // the other groups' masters current before this one is replaced
  float* master = master_.data() + g.offset;
  source(0, master, g.numel);
  opt_.write_state(group, kind, [&](size_t begin, float* data, size_t n) { std::copy(master + begin, master + begin + n, data); });
  if (store_ != ElemType::kF32) round_to(store_, lowp_.data() + g.offset, master, g.numel);
  upload_params(g.offset, g.numel);
}

OptimizerCounters StepRunner::counters() const {
  OptimizerCounters c;
  c.adam_step = t_;
  c.has_loss_scale = scaler_ != nullptr;
  if (scaler_) c.loss_scale = scaler_->state();
  return c;
}

void StepRunner::set_counters(const OptimizerCounters& c) {
  if (c.has_loss_scale != (scaler_ != nullptr))
    throw Error(str("training state: the checkpoint ", c.has_loss_scale ? "has" : "has no",
                    " fp16 loss-scale state but this run ", scaler_ ? "uses" : "does not use", " fp16"));
  t_ = c.adam_step;
  if (scaler_) scaler_->restore(c.loss_scale);
}

StepResult StepRunner::step(int64_t step_index,
                                    const std::vector<const int32_t*>& micro_batches,
                                    const std::vector<const uint8_t*>& masks) {
  const int B = cfg_.schedule.micro_batch, T = cfg_.model.seq_len;
  const int accum = static_cast<int>(micro_batches.size());
  FY_CHECK(accum >= 1, "no micro-batches");
  FY_CHECK(masks.empty() || masks.size() == micro_batches.size(), masks.size(), " loss masks for ",
           accum, " micro-batches");
  StepResult r;
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
  for (int k = 0; k < accum; ++k) total += counts[k] = count_targets(masks.empty() ? nullptr : masks[k], B, T);
  r.loss_scale = scaler_ ? scaler_->scale() : 1.0;
  const float scale = backward_scale(total, r.loss_scale);
  std::vector<float> means(accum);
  // Summed in fp32 (16-bit tensors, several micro-batches): each micro-batch's gradient starts
  // from zero on the device and is added into sum_ on the host, as the offloading executor
  // adds each group's (kAccumulateGrads); else the device's gradients are the sum.
  const bool sums = fp32_sums_ && accum > 1;
  summed_ = sums;
  if (sums) sum_.resize(master_.size());
  for (int k = 0; k < accum; ++k) {
    if (sums && k > 0) model_.zero_grads();
    split_batch(micro_batches[k], masks.empty() ? nullptr : masks[k], B, T, inputs_.data(), targets_.data());
    means[k] = model_.forward(inputs_.data(), targets_.data());
    model_.backward(scale);
    if (!sums) continue;
    be_.copy_to_host(grad_.data(), model_.grads(), grad_.size());
    add_to_fp32_sum(sum_.data(), grad_.data(), store_, sum_.size(), k == 0);
  }
  r.loss = static_cast<float>(mean_over_counted(means, counts));
  if (!sums) be_.copy_to_host(grad_.data(), model_.grads(), grad_.size());
  const ElemType gtype = sums ? ElemType::kF32 : store_;
  const char* gbase = sums ? reinterpret_cast<const char*>(sum_.data()) : grad_.data();
  const size_t es = elem_type_size(gtype);

  // Per parameter group in order, each group summed in double by group_sum_squares: the same
  // reduction the offloading scheduler performs, so both clip identically. Padding between
  // tensors holds zero gradient.
  double sq = 0;
  for (const ParamGroup& g : model_.layout().groups) sq += group_sum_squares(gbase + es * g.offset, gtype, g.numel);
  const StepDecision d = decide_step(sq, r.loss_scale, cfg_.optimizer.grad_clip, scaler_.get());
  r.grad_norm = d.grad_norm;
  r.lr = learning_rate(cfg_.optimizer, cfg_.schedule, step_index);
  // An fp16 overflow skips the whole update, Adam's step count included (as GradScaler).
  if (!d.apply) {
    r.skipped = true;
    return r;
  }
  ++t_;
  // Every group's update; the new working weights come back into master_ (fp32 tensors) or
  // lowp_ (16-bit, rounded in the update's pass) and go to the device. With 16-bit tensors
  // the fp32 master stays in the optimizer until master() asks for it.
  const ParamLayout& layout = model_.layout();
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    OocAdamW::Update u;
    u.group = static_cast<int>(g);
    u.grad = gbase + es * layout.groups[g].offset;
    u.grad_type = gtype;
    u.lowp = store_ == ElemType::kF32 ? static_cast<void*>(master_.data() + layout.groups[g].offset)
                                      : lowp_.data() + layout.groups[g].offset;
    u.lowp_type = store_;
    u.grad_scale = d.grad_scale;
    u.lr = static_cast<float>(r.lr);
    u.t = t_;
    opt_.wait(opt_.submit(u));
  }
  master_stale_ = store_ != ElemType::kF32;
  upload_params(0, master_.size());
  return r;
}

const std::vector<float>& StepRunner::master() {
  if (master_stale_) {
    const ParamLayout& layout = model_.layout();
    for (size_t g = 0; g < layout.groups.size(); ++g)
      opt_.read_master(static_cast<int>(g), master_.data() + layout.groups[g].offset);
    master_stale_ = false;
  }
  return master_;
}

std::vector<float> StepRunner::step_gradient() const {
  if (summed_) return sum_;
  std::vector<float> g(master_.size());
  widen_from(store_, g.data(), grad_.data(), g.size());
  return g;
}

float StepRunner::eval_loss(const int32_t* batch, const uint8_t* mask) {
  split_batch(batch, mask, cfg_.schedule.micro_batch, cfg_.model.seq_len, inputs_.data(), targets_.data());
  return model_.forward(inputs_.data(), targets_.data());
}

}  // namespace fuyou
