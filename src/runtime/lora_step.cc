#include "fuyou/lora_step.h"

#include <algorithm>

#include "fuyou/error.h"
#include "fuyou/hf_checkpoint.h"
#include "fuyou/log.h"
#include "fuyou/loss_scale.h"
#include "fuyou/optim.h"
#include "fuyou/peft_adapter.h"
#include "fuyou/sizes.h"
#include "fuyou/train.h"
#include "src/common/xxh3.h"

namespace fuyou {

LoraStep::LoraStep(const Config& cfg, Backend& backend)
    : cfg_(cfg),
      be_(backend),
      model_(cfg.model, backend, cfg.schedule.micro_batch, ModelState::kFrozenBase),
      layout_(make_lora_layout(cfg.model, cfg.lora)) {
  // The config check (lora section) refused what does not run; the backend that auto picked
  // is known only here.
  if (be_.kind() != BackendKind::kCpu)
    throw ConfigError(str("lora: runs on the CPU backend only for now, but runtime.backend ",
                          cfg.runtime.backend, " chose ", be_.name(),
                          " (set runtime.backend: cpu; docs/lora.md)"));
  FY_CHECK(!cfg.model.checkpoint.empty(), "a LoRA step needs model.checkpoint");
  // The base, group by group, straight into the device's fp32 parameters.
  {
    const ParamLayout& base = model_.layout();
    std::vector<float> host(base.total, 0.0f);
    CheckpointGroupReader reader(cfg.model.checkpoint, cfg.model);
    for (size_t g = 0; g < base.groups.size(); ++g)
      reader.read_group(static_cast<int>(g), host.data() + base.groups[g].offset);
    base_xxh3_ = hex64(xxh3_64(host.data(), 4 * host.size()));
    be_.copy_to_device(model_.params(), host.data(), 4 * host.size());
  }
  const size_t n = layout_.params.total;
  master_.assign(n, 0.0f);
  grad_.assign(n, 0.0f);
  if (cfg.lora.init == "peft")
    init_lora_params(layout_, cfg.runtime.seed, master_.data());
  else
    read_peft_adapter(cfg.lora.init, cfg.lora, cfg.model, layout_, master_.data());
  d_params_ = be_.alloc(4 * n, "LoRA adapters");
  d_grads_ = be_.alloc(4 * n, "LoRA adapter gradients");
  be_.copy_to_device(d_params_, master_.data(), 4 * n);
  model_.attach_lora(layout_, d_params_, d_grads_);
  opt_ = std::make_unique<OocAdamW>(optimizer_groups(layout_.params),
                                    std::vector<Tier>(layout_.params.groups.size(), Tier::kHost),
                                    nullptr, optimizer_options(cfg.optimizer));
  for (size_t g = 0; g < layout_.params.groups.size(); ++g)
    opt_->init_group(static_cast<int>(g), master_.data() + layout_.params.groups[g].offset);
  inputs_.resize(model_.tokens_per_batch());
  targets_.resize(model_.tokens_per_batch());
  spdlog::info(
      "LoRA: rank {}, scale {}, {} adapted linears, {} adapter parameters ({}), base "
      "frozen ({} parameters)",
      layout_.rank, layout_.scale, layout_.adapters.size(), layout_.params.num_params(),
      format_size(4 * n), model_.layout().num_params());
}

LoraStep::~LoraStep() {
  be_.free(d_params_);
  be_.free(d_grads_);
}

StepResult LoraStep::step(int64_t step_index, const std::vector<const int32_t*>& micro_batches,
                          const std::vector<const uint8_t*>& masks,
                          const std::vector<const int32_t*>& positions) {
  const int B = cfg_.schedule.micro_batch, T = cfg_.model.seq_len;
  const int accum = static_cast<int>(micro_batches.size());
  FY_CHECK(accum >= 1, "no micro-batches");
  FY_CHECK(masks.empty() || masks.size() == micro_batches.size(), "masks per micro-batch");
  FY_CHECK(positions.empty() || positions.size() == micro_batches.size(),
           "positions per micro-batch");
  StepResult r;
  // The mean over the step's counted targets, as InMemoryStep: the micro-batches' adapter
  // gradients add up on the device (fp32).
  model_.zero_grads();
  std::vector<int64_t> counts(accum);
  int64_t total = 0;
  for (int k = 0; k < accum; ++k)
    total += counts[k] = count_targets(masks.empty() ? nullptr : masks[k], B, T);
  const float scale = backward_scale(total, 1.0);
  std::vector<float> means(accum);
  for (int k = 0; k < accum; ++k) {
    split_batch(micro_batches[k], masks.empty() ? nullptr : masks[k], B, T, inputs_.data(),
                targets_.data());
    means[k] = model_.forward_backward(inputs_.data(), targets_.data(),
                                       positions.empty() ? nullptr : positions[k], scale);
  }
  r.loss = static_cast<float>(mean_over_counted(means, counts));
  r.lr = learning_rate(cfg_.optimizer, cfg_.schedule, step_index);
  be_.copy_to_host(grad_.data(), d_grads_, 4 * grad_.size());
  double sq = 0;
  for (const ParamGroup& g : layout_.params.groups)
    sq += group_sum_squares(grad_.data() + g.offset, ElemType::kF32, g.numel);
  const StepDecision d = decide_step(sq, 1.0, cfg_.optimizer.grad_clip, nullptr);
  r.grad_norm = d.grad_norm;
  ++t_;
  std::vector<OocAdamW::Handle> updates;
  for (size_t i = 0; i < layout_.params.groups.size(); ++i) {
    OocAdamW::Update u;
    u.group = static_cast<int>(i);
    u.grad = grad_.data() + layout_.params.groups[i].offset;
    u.grad_type = ElemType::kF32;
    u.lowp = master_.data() + layout_.params.groups[i].offset;
    u.lowp_type = ElemType::kF32;
    u.grad_scale = d.grad_scale;
    u.lr = static_cast<float>(r.lr);
    u.t = t_;
    updates.push_back(opt_->submit(u));
  }
  for (OocAdamW::Handle h : updates) opt_->wait(h);
  be_.copy_to_device(d_params_, master_.data(), 4 * master_.size());
  return r;
}

float LoraStep::eval_loss(const int32_t* batch, const uint8_t* mask, const int32_t* positions) {
  split_batch(batch, mask, cfg_.schedule.micro_batch, cfg_.model.seq_len, inputs_.data(),
              targets_.data());
  return model_.forward(inputs_.data(), targets_.data(), positions);
}

void LoraStep::logits(const int32_t* inputs, float* dst) {
  model_.forward(inputs, nullptr);
  model_.copy_logits(dst);
}

void LoraStep::write_peft(const std::string& dir) const {
  write_peft_adapter(dir, cfg_.lora, cfg_.model, layout_, master_.data());
}

void LoraStep::read_state(int group, StateKind kind, const StateSink& sink) {
  opt_->read_state(group, kind, sink);
}

void LoraStep::write_state(int group, StateKind kind, const StateSource& source) {
  if (kind != StateKind::kMaster) return opt_->write_state(group, kind, source);
  const ParamGroup& g = layout_.params.groups.at(group);
  float* master = master_.data() + g.offset;
  source(0, master, g.numel);
  opt_->write_state(group, kind, [&](size_t begin, float* data, size_t n) {
    std::copy(master + begin, master + begin + n, data);
  });
  be_.copy_to_device(static_cast<char*>(d_params_) + 4 * g.offset, master, 4 * g.numel);
}

OptimizerCounters LoraStep::counters() const { return optimizer_counters(t_, nullptr); }

void LoraStep::set_counters(const OptimizerCounters& c) {
  restore_optimizer_counters(c, &t_, nullptr);
}

}  // namespace fuyou
