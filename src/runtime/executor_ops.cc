// What each op of a plan does on the backend, the store and the optimizer. Its operands are
// its uses (PlanOp::uses): the buffer, the byte range and the role of each.
#include <algorithm>
#include <cstring>

#include "fuyou/error.h"
#include "fuyou/op_class.h"
#include "fuyou/optim.h"
#include "fuyou/sizes.h"
#include "fuyou/train.h"
#include "src/runtime/executor.h"

namespace fuyou {

// Every kind has a case (an op kind the executor cannot run does not compile).
#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wswitch"
void PlanExecutor::Impl::run_op(Iter& it, const PlanOp& op) {
  switch (op.kind) {
    case OpKind::kReadWeights:
    case OpKind::kReadCheckpoint:
    case OpKind::kReadGrads:
      return store_read(op);
    case OpKind::kWriteCheckpoint:
    case OpKind::kWriteGrads:
      return store_write(op);
    case OpKind::kWriteWeights:
      if (it.apply) store_write(op);  // else no new weights were made; the SSD copy is current
      return;
    case OpKind::kLoadWeights:
    case OpKind::kLoadCheckpoint:
    case OpKind::kLoadGrads: {
      const BufferUse &src = op.use(Role::kSource), &dst = op.use(Role::kDest);
      return to_device(op, at(dst), at(src), dst.bytes);
    }
    case OpKind::kSaveCheckpoint: {
      const BufferUse &src = op.use(Role::kSource), &dst = op.use(Role::kDest);
      return to_host(op, at(dst), at(src), src.bytes);
    }
    case OpKind::kSaveGrads:
      return save_grads(it, op);
    case OpKind::kLoadResident:
      return load_resident(it, op);
    case OpKind::kEmbedForward: {
      // Each micro-batch's tokens go to the device here, on the compute queue, once the
      // previous micro-batch's head and embedding backward, which read them and may only be
      // queued (Run::sync), have run.
      be_.finish_compute();
      model_.set_tokens(it.inputs[op.micro].data(), it.targets[op.micro].data(),
                        it.packed ? it.positions[op.micro].data() : nullptr);
      GlobalTensors g = globals(embed_w_, final_w_);
      return model_.embed_forward(g.wte, g.wpe, at(op.use(Role::kOutput)));
    }
    case OpKind::kForward:
    case OpKind::kRecomputeInput:
    case OpKind::kRecompute:
      return run_forward(it, op);
    case OpKind::kZeroGrads:
      for (const BufferUse& u : op.uses) be_.zero(at(u), u.bytes);
      return;
    case OpKind::kHead:
    case OpKind::kHeadLoss:
      return run_head(it, op);
    case OpKind::kBackward:
      return run_backward(op);
    case OpKind::kEmbedBackward:
      return model_.embed_backward(globals(embed_g_, final_g_), at(op.use(Role::kResidual)));
    case OpKind::kGradSumSq:
      it.sum_sq[op.group] = group_sum_squares(at(op.use(Role::kSource)), grad_type(), op.params);
      return;
    case OpKind::kDeviceGradSumSq: {
      if (be_.timing_on())
        be_.timing_mark(timing_tag(StepPhase::kOptimizer, OpClass::kDeviceOptimizer));
      if (op.group >= 0) {
        // One group at offset 0: group_sum_squares's bits (Backend::sum_squares).
        it.sum_sq[op.group] =
            be_.sum_squares(at(op.use(Role::kSource)), tensors_, {{0, op.params}});
        return;
      }
      // Every group at once (Plan::device_optimizer), one use each in group order, fp32 where
      // they are sums over micro-batches: the total is what the norm's in-order addition of
      // the groups' sums gives, so it stands for all of them.
      const ElemType type = source_type(op);
      std::vector<SquareSpan> spans;
      for (const BufferUse& u : op.uses) spans.push_back({at(u), u.bytes / elem_type_size(type)});
      std::fill(it.sum_sq.begin(), it.sum_sq.end(), 0.0);
      it.sum_sq[0] = be_.sum_squares_spans(spans, type);
      return;
    }
    case OpKind::kDeviceAccumulate: {
      if (be_.timing_on())
        be_.timing_mark(timing_tag(StepPhase::kOptimizer, OpClass::kDeviceOptimizer));
      const BufferUse& sum = op.use(Role::kDest);
      be_.accumulate_fp32(at(sum), at(op.use(Role::kSource)), tensors_, op.params,
                          sum.access == Access::kWrite);
      return;
    }
    case OpKind::kDeviceUpdate:
      return device_update(it, op);
    case OpKind::kAccumulateGrads: {
      const BufferUse& sum = op.use(Role::kDest);
      add_to_fp32_sum(static_cast<float*>(at(sum)), at(op.use(Role::kSource)), tensors_, op.params,
                      sum.access == Access::kWrite);
      return;
    }
    case OpKind::kGradNorm: {
      // Group order 0..L+1, each group's own sum in group_sum_squares's fixed order: the
      // reduction InMemoryStep uses.
      double sq = 0;
      for (double g : it.sum_sq) sq += g;
      const StepDecision d =
          decide_step(sq, it.step_loss_scale, cfg_.optimizer.grad_clip, scaler_.get());
      it.grad_norm = d.grad_norm;
      it.grad_scale = d.grad_scale;
      it.apply = d.apply;
      return;
    }
    case OpKind::kUpdate:
      return update(it, op);
  }
}
#pragma GCC diagnostic pop

void PlanExecutor::Impl::to_device(const PlanOp& op, void* dst, const void* src, size_t bytes) {
  be_.copy_to_device(dst, src, bytes);
  moved_[static_cast<int>(op.resource)].h2d += bytes;
}

void PlanExecutor::Impl::to_host(const PlanOp& op, void* dst, const void* src, size_t bytes) {
  be_.copy_to_host(dst, src, bytes);
  moved_[static_cast<int>(op.resource)].d2h += bytes;
}

void PlanExecutor::Impl::store_read(const PlanOp& op) {
  const BufferUse &src = op.use(Role::kSource), &dst = op.use(Role::kDest);
  const uint64_t bytes = round_up(dst.bytes, kIoAlign);
  store_->read_sync(ext_[src.buffer], src.offset, at(dst), bytes);
  moved_[static_cast<int>(op.resource)].ssd_read += bytes;
}

void PlanExecutor::Impl::store_write(const PlanOp& op) {
  const BufferUse &src = op.use(Role::kSource), &dst = op.use(Role::kDest);
  const uint64_t bytes = round_up(src.bytes, kIoAlign);
  store_->write_sync(ext_[dst.buffer], dst.offset, at(src), bytes);
  moved_[static_cast<int>(op.resource)].ssd_write += bytes;
}

// A block forward: of `layer` (kForward, kRecompute: its internals rebuilt, the output to
// scratch), or of layer-1 rebuilding `layer`'s input (kRecomputeInput). The activations it
// saves go to its work buffer: the layer's own (keep) or the shared working ones.
void PlanExecutor::Impl::run_forward(Iter& it, const PlanOp& op) {
  (void)it;
  const int l = op.kind == OpKind::kRecomputeInput ? op.layer - 1 : op.layer;
  void* weights = at(op.use(Role::kWeights));
  LayerActivations a = acts_[op.use(Role::kWork).buffer];
  a.out = at(op.use(Role::kOutput));
  if (op.kind == OpKind::kForward && owner_.on_forward)
    owner_.on_forward(l, weights, layout_.groups[1 + l].numel);
  model_.block_forward(layer_view(weights, l), at(op.use(Role::kInput)), a);
}

void PlanExecutor::Impl::run_backward(const PlanOp& op) {
  const BufferUse& grads = op.use(Role::kGrads);
  // A fresh gradient (the step's first micro-batch) starts from zero; a later micro-batch
  // adds to what load_grads put back, so each sum is formed term by term as in-memory
  // training forms it.
  if (grads.access == Access::kWrite) be_.zero(at(grads), grads.bytes);
  model_.block_backward(layer_view(at(op.use(Role::kWeights)), op.layer),
                        layer_view(at(grads), op.layer), at(op.use(Role::kInput)),
                        acts_[op.use(Role::kWork).buffer], at(op.use(Role::kResidual)));
}

void PlanExecutor::Impl::run_head(Iter& it, const PlanOp& op) {
  GlobalTensors g = globals(embed_w_, final_w_);
  void* x = at(op.use(Role::kInput));
  if (op.kind == OpKind::kHeadLoss) {
    it.eval_loss = model_.head_forward(g, x, true);
    return;
  }
  it.losses[op.micro] = model_.head_train(g, globals(embed_g_, final_g_), x, it.loss_scale,
                                          at(op.use(Role::kResidual)));
}

void PlanExecutor::Impl::save_grads(Iter& it, const PlanOp& op) {
  const BufferUse &src = op.use(Role::kSource), &dst = op.use(Role::kDest);
  if (op.group == 0 && plan_.embed_rows_first) {
    // Rows first: part -1 fixes the rows (first_rows) and copies them; the parts copy the
    // rest of their ranges, never a range the rows update may be reading.
    if (op.part < 0)
      first_rows(it);
    else
      rows_complement(it, src.offset / es_, (src.offset + src.bytes) / es_, d2h_ranges_);
    void *from = ptr(src.buffer), *to = ptr(dst.buffer);
    for (const auto& [a, b] : op.part < 0 ? it.first_rows : d2h_ranges_)
      to_host(op, elem(to, a), elem(from, a), es_ * (b - a));
    return;
  }
  to_host(op, at(dst), at(src), src.bytes);
}

void PlanExecutor::Impl::load_resident(Iter& it, const PlanOp& op) {
  const BufferUse &src = op.use(Role::kSource), &dst = op.use(Role::kDest);
  if (op.group == 0 && plan_.embed_rows_first) {
    if (op.part >= 0)
      rows_complement(it, src.offset / es_, (src.offset + src.bytes) / es_, h2d_ranges_);
    void *from = ptr(src.buffer), *to = ptr(dst.buffer);
    for (const auto& [a, b] : op.part < 0 ? it.first_rows : h2d_ranges_)
      to_device(op, elem(to, a), elem(from, a), es_ * (b - a));
    return;
  }
  to_device(op, at(dst), at(src), src.bytes);
}

void PlanExecutor::Impl::update(Iter& it, const PlanOp& op) {
  if (!it.apply) return;  // fp16 overflow: weights and optimizer state stay as they are
  const BufferUse &grad = op.use(Role::kSource), &out = op.use(Role::kDest);
  OocAdamW::Update u;
  u.group = op.group;
  u.grad = ptr(grad.buffer);  // the group's element 0; the range below
  u.grad_type = grad_type();
  u.lowp = ptr(out.buffer);
  u.lowp_type = tensors_;
  if (op.part < 0) {  // the rows its gradient save fixed
    u.ranges = it.first_rows.data();
    u.nranges = it.first_rows.size();
  } else if (op.parts > 1) {
    u.begin = grad.offset / es_;
    u.end = (grad.offset + grad.bytes) / es_;
    if (op.group == 0 && plan_.embed_rows_first) {
      rows_complement(it, u.begin, u.end, opt_ranges_);
      u.ranges = opt_ranges_.data();
      u.nranges = opt_ranges_.size();
    }
  }
  u.grad_scale = plan_.exact ? it.grad_scale : 1.0f;
  u.lr = static_cast<float>(it.lr);
  u.t = it.t;
  // On the CPU backend the optimizer shares the cores with compute: updates take one thread,
  // except those the planner says run with the cores to themselves (update_has_cores).
  u.threads = be_.kind() == BackendKind::kCpu && !update_has_cores(plan_, op) ? 1 : update_threads_;
  // The optimizer runs one update at a time, and only this thread submits while steps run:
  // its store traffic in between is this update's.
  const uint64_t read = opt_->ssd_bytes_read(), written = opt_->ssd_bytes_written();
  opt_->wait(opt_->submit(u));
  OpTraffic& moved = moved_[static_cast<int>(op.resource)];
  moved.ssd_read += opt_->ssd_bytes_read() - read;
  moved.ssd_write += opt_->ssd_bytes_written() - written;
}

// Plan::device_optimizer: the group's AdamW on the device, queued on the compute queue behind
// the backward (or the norm) and ahead of the next forward; the same per-element math and
// constants as the host's (set_adamw_constants), so the same bits.
void PlanExecutor::Impl::device_update(Iter& it, const PlanOp& op) {
  if (!it.apply) return;  // fp16 overflow: weights and optimizer state stay as they are
  if (be_.timing_on())
    be_.timing_mark(timing_tag(StepPhase::kOptimizer, OpClass::kDeviceOptimizer));
  const auto [first, count] = group_pieces_[op.group];
  DeviceAdamW a;
  a.master = device_master(op.group);
  a.m = device_moment(op.group, StateKind::kAdamM);
  a.v = device_moment(op.group, StateKind::kAdamV);
  a.grad = at(op.use(Role::kSource));
  a.grad_type = source_type(op);
  a.lowp = tensors_ == ElemType::kF32 ? nullptr : at(op.use(Role::kDest));
  a.lowp_type = tensors_;
  a.pieces = static_cast<const AdamWPiece*>(ptr_[plan_.buffer(BufferKind::kAdamWPieces)]) + first;
  a.count = count;
  const OocAdamWOptions o = optimizer_options(cfg_.optimizer);
  set_adamw_constants(&a, AdamWStep{static_cast<float>(it.lr), o.beta1, o.beta2, o.eps, 0.0f, it.t},
                      o.weight_decay, plan_.exact ? it.grad_scale : 1.0f);
  be_.adamw(a);
}

// The embedding's first update part: the rows the next step's first micro-batch looks up
// (its tokens, sorted and without repeats) when that step is queued, and everything after
// the token table (the position table), as element ranges in it.first_rows.
void PlanExecutor::Impl::first_rows(Iter& it) {
  const size_t C = cfg_.model.d_model, table = C * cfg_.model.vocab_size,
               numel = layout_.groups[0].numel;
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
  // Adjacent rows make one range: one copy and one update range instead of one per row
  // (tens of thousands per step at large micro-batches, each a cudaMemcpyAsync on a GPU).
  auto add = [&](size_t a, size_t b) {
    if (!it.first_rows.empty() && it.first_rows.back().second == a)
      it.first_rows.back().second = b;
    else
      it.first_rows.push_back({a, b});
  };
  for (int32_t tok : row_tokens_) add(tok * C, tok * C + C);
  if (table < numel) add(table, numel);
}

// Elements [begin, end) of the embedding less the ranges its first part updated, into `out`.
void PlanExecutor::Impl::rows_complement(const Iter& it, size_t begin, size_t end,
                                         std::vector<std::pair<size_t, size_t>>& out) {
  out.clear();
  size_t at = begin;
  for (const auto& [a, b] : it.first_rows) {
    if (b <= at) continue;
    if (a >= end) break;
    if (a > at) out.push_back({at, a});
    at = std::max(at, b);
  }
  if (at < end) out.push_back({at, end});
}

}  // namespace fuyou
