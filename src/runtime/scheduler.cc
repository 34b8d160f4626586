// The executor's queues: one worker thread per resource, two iterations in flight, steps that
// return at their loss, validation, the trace. Buffers: executor_buffers.cc; what each op
// does: executor_ops.cc.
#include "fuyou/scheduler.h"

#include <omp.h>

#include <algorithm>
#include <fstream>

#include "fuyou/error.h"
#include "fuyou/optim.h"
#include "fuyou/threads.h"
#include "fuyou/train.h"
#include "src/runtime/executor.h"

namespace fuyou {

void PlanExecutor::Impl::Ring::push(std::pair<int, int> x) {
  FY_CHECK(size() + 1 < items.size(), "executor queue full");
  items[tail] = x;
  tail = (tail + 1) % items.size();
}

PlanExecutor::Impl::Impl(PlanExecutor& owner, const Config& cfg, Backend& be, Plan plan,
                         SsdStore* store)
    : owner_(owner),
      cfg_(cfg),
      be_(be),
      plan_(std::move(plan)),
      store_(store),
      layout_(make_gpt_layout(cfg.model)),
      model_(cfg.model, be, plan_.micro_batch, ModelState::kWorkspace),
      tensors_(plan_.tensors),
      es_(elem_type_size(plan_.tensors)) {
  N_ = static_cast<size_t>(plan_.micro_batch) * cfg.model.seq_len;
  check_plan();
  allocate_buffers();
  make_optimizer();
  prepare_runs();
  register_host_buffers();
  // The executor orders device work itself (Backend::set_caller_ordered): a copy waits only
  // for the ops it depends on.
  be_.set_caller_ordered(true);
  update_threads_ = cfg.runtime.threads > 0 ? cfg.runtime.threads : omp_get_num_procs();
  epoch_ = clock_type::now();
  for (int r = 0; r < kNumResources; ++r) workers_.emplace_back([this, r] { worker(r); });
}

PlanExecutor::Impl::~Impl() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    // Let whatever was submitted finish (or fail) before the buffers go away.
    cv_.wait(lock, [&] { return failed_ || (iters_[0].pending == 0 && iters_[1].pending == 0); });
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
  be_.finish_compute();  // queued compute may still use the buffers freed below (Run::sync)
  be_.set_caller_ordered(false);
  for (void* p : registered_) be_.unregister_host(p);
  for (void* p : owned_) be_.free(p);
}

// Per-resource op lists for the training plan and the validation plan (a forward over the
// same pools), and the state of the two iterations that may be in flight.
void PlanExecutor::Impl::prepare_runs() {
  eval_plan_ = make_forward_plan(plan_);
  train_.plan = &plan_;
  eval_.plan = &eval_plan_;
  size_t ring = 0;
  for (Run* run : {&train_, &eval_}) {
    for (const PlanOp& op : run->plan->ops) {
      run->queue[static_cast<int>(op.resource)].push_back(op.id);
      run->returns += step_waits_for(op);
    }
    run->bufs = op_buffers(*run->plan);
    for (auto& q : run->queue) ring = std::max(ring, q.size());
  }
  prev_deps_ = previous_iteration_deps(plan_);
  for (Run* run : {&train_, &eval_}) {
    const std::vector<PlanOp>& ops = run->plan->ops;
    run->sync.assign(ops.size(), 0);
    auto mark = [&](int d) {
      if (ops[d].resource == Resource::kCompute) run->sync[d] = 1;
    };
    for (const PlanOp& op : ops) {
      if (step_waits_for(op)) mark(op.id);
      if (op.resource == Resource::kCompute) continue;
      for (int d : op.deps) mark(d);
      // The next iteration's ops of other queues wait for this one's (training only).
      if (run == &train_)
        for (int d : prev_deps_[op.id]) mark(d);
    }
  }
  for (const PlanOp& op : plan_.ops)
    if (op.kind == OpKind::kLoadResident && op.group == 0) embed_refresh_ops_.push_back(op.id);
  row_tokens_.reserve(N_);
  opt_ranges_.reserve(N_ + 2);
  h2d_ranges_.reserve(N_ + 2);
  d2h_ranges_.reserve(N_ + 2);
  const int K = plan_.grad_accum;
  const size_t max_ops = std::max(plan_.ops.size(), eval_plan_.ops.size());
  for (Iter& it : iters_) {
    it.inputs.assign(K, std::vector<int32_t>(N_));
    it.targets.assign(K, std::vector<int32_t>(N_));
    it.positions.assign(K, std::vector<int32_t>(N_));
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
}

// Adds the time each of x's ops was busy within [window_start_, t_end] (to t_end where still
// running) to `busy`, per resource.
template <typename Busy>
void PlanExecutor::Impl::add_busy(const Iter& x, double t_end, Busy& busy) const {
  for (const PlanOp& op : plan_.ops) {
    if (x.start[op.id] < 0) continue;
    const double b = std::max(x.start[op.id], window_start_),
                 e = x.end[op.id] < 0 ? t_end : x.end[op.id];
    if (e > b) busy[static_cast<int>(op.resource)] += e - b;
  }
}

// Caller holds mu_. Whether op `id` of iteration `i` may start: its deps in its own
// iteration are done and, when it overlaps the previous iteration of the same plan, the ops
// of that iteration it waits for (previous_iteration_deps) are done too.
bool PlanExecutor::Impl::ready(int i, int id) const {
  const Iter& it = iters_[i];
  const PlanOp& op = it.run->plan->ops[id];
  for (int d : op.deps)
    if (!it.done[d]) return false;
  if (!it.prev) return true;
  const Iter& before = iters_[1 - i];
  for (int d : prev_deps_[id])
    if (!before.done[d]) return false;
  // The embedding forward waits only for the rows refreshed first, if those were its own.
  if (plan_.embed_rows_first && op.kind == OpKind::kEmbedForward && op.micro == 0 &&
      !before.first_rows_next)
    for (int d : embed_refresh_ops_)
      if (!before.done[d]) return false;
  return true;
}

// Caller holds mu_. The queue position of the op resource `r` runs next, -1 for none yet
// (next_in_queue). Ops of the two plans (training, validation) never pass each other.
long PlanExecutor::Impl::next_op(int r) const {
  const Ring& q = rings_[r];
  return next_in_queue(
      static_cast<Resource>(r), q.size(), [&](size_t k) { return q.at(k); },
      [&](std::pair<int, int> x) { return iters_[x.first].done[x.second] != 0; },
      [&](std::pair<int, int> x) { return ready(x.first, x.second); },
      [&](std::pair<int, int> y, std::pair<int, int> x) {
        return iters_[y.first].run != iters_[x.first].run ||
               buffers_conflict(iters_[x.first].run->bufs[y.second],
                                iters_[x.first].run->bufs[x.second]);
      });
}

// One thread per resource: runs the ops queued for it, each when ready, in order (the
// reordering queues: see next_op).
void PlanExecutor::Impl::worker(int r) {
  // runtime.threads for the kernels and sums run here: an OpenMP thread count is per thread.
  set_thread_team(update_threads_);
  Ring& q = rings_[r];
  std::unique_lock<std::mutex> lock(mu_);
  const bool compute = r == static_cast<int>(Resource::kCompute);
  for (;;) {
    long k = -1;
    // The compute thread's wait for its next op's inputs (fuyou-bench train --breakdown).
    if (compute && be_.timing_on()) be_.timing_mark(timing_tag(StepPhase::kOther, OpClass::kWait));
    cv_.wait(lock, [&] { return stop_ || failed_ || (k = next_op(r)) >= 0; });
    if (stop_) return;
    if (failed_) {
      q.clear();  // the waiters rethrow the error; nothing more runs
      cv_.wait(lock, [&] { return stop_ || !failed_; });
      continue;
    }
    const auto [i, id] = q.at(static_cast<size_t>(k));
    Iter& it = iters_[i];
    const PlanOp& op = it.run->plan->ops[id];
    it.start[id] = now();
    lock.unlock();
    std::exception_ptr err;
    try {
      if (owner_.on_op) owner_.on_op(it.step, op);
      moved_[r] = OpTraffic{};
      run_op(it, op);
      // Done means done on the device where another queue waits for it (copies of what it
      // wrote, loads into what it read: they start right after); else done once queued.
      if (it.run->sync[id]) be_.finish_compute();
      if (owner_.on_op_done) owner_.on_op_done(it.step, op, moved_[r]);
    } catch (const IoError& e) {
      // A disk error (a failed request, bytes that changed on the disk) says where in the
      // run it struck.
      err = std::make_exception_ptr(IoError(str(
          it.forward_only ? "validation" : str("step ", it.step + 1), ", ", op_kind_name(op.kind),
          op.layer >= 0 ? str(" of layer ", op.layer) : "", ": ", e.what())));
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
void PlanExecutor::Impl::wait_for(std::unique_lock<std::mutex>& lock, Pred pred) {
  cv_.wait(lock, [&] { return failed_ || pred(); });
  if (failed_) std::rethrow_exception(error_);
}

// Waits until nothing is in flight (before anything that reads or writes state from the
// caller's thread: validation, parameters in or out, the trace).
void PlanExecutor::Impl::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  wait_for(lock, [&] { return iters_[0].pending == 0 && iters_[1].pending == 0; });
  window_start_ = -1;  // the next step's window starts at its own submission
  // Compute ops that only compute waited for count as done once queued (Run::sync): the
  // caller's reads and writes come after the device has run them.
  be_.finish_compute();
}

// Takes the iteration slot after the last submitted one, once its previous occupant has
// finished; `fill` sets the iteration's inputs before any op can see them. Training
// iterations overlap the one before (previous_iteration_deps); the validation plan runs
// alone (the caller drained).
template <class Fill>
PlanExecutor::Impl::Iter& PlanExecutor::Impl::submit(Run& run, int64_t step, Fill fill) {
  std::unique_lock<std::mutex> lock(mu_);
  const int i = next_slot_;
  Iter& it = iters_[i];
  Iter& other = iters_[1 - i];
  wait_for(lock, [&] { return it.pending == 0; });
  // The finished iteration's busy time within the current step window (it may have run well
  // into it: a write backlog) is counted before its times are cleared.
  if (window_start_ >= 0 && it.run == &train_) add_busy(it, now(), window_busy_);
  // `other` no longer needs the finished iteration in slot i: every op it waited for there
  // is done, and the slot is about to be reused.
  other.prev = false;
  it.run = &run;
  it.step = step;
  it.prev = &run == &train_ && other.run == &train_ && other.pending > 0;
  const size_t n = run.plan->ops.size();
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
    window_disk_ = store_ ? store_->stats().busy_s : 0;
  }
  for (int r = 0; r < kNumResources; ++r)
    for (int id : run.queue[r]) rings_[r].push({i, id});
  next_slot_ = 1 - i;
  cv_.notify_all();
  return it;
}

StepResult PlanExecutor::Impl::step(int64_t step_index,
                                    const std::vector<const int32_t*>& micro_batches,
                                    const std::vector<const uint8_t*>& masks,
                                    const std::vector<const int32_t*>& positions) {
  const int B = plan_.micro_batch, T = cfg_.model.seq_len, K = plan_.grad_accum;
  if (static_cast<int>(micro_batches.size()) != K)
    throw Error(str("offloaded step: ", micro_batches.size(),
                    " micro-batches but the plan was built for grad_accum ", K));
  FY_CHECK(masks.empty() || masks.size() == micro_batches.size(), masks.size(), " loss masks for ",
           K, " micro-batches");
  FY_CHECK(positions.empty() || positions.size() == micro_batches.size(), positions.size(),
           " position arrays for ", K, " micro-batches");
  // The previous step returned after its norm (exact mode), so the loss scale and Adam's
  // step count already reflect its decision.
  const double step_loss_scale = scaler_ ? scaler_->scale() : 1.0;
  const int64_t t = ++t_;
  Iter& it = submit(train_, step_index, [&](Iter& it) {
    // Mean over the counted targets of the whole step, as InMemoryStep: the scale 1 / (counted
    // targets of every micro-batch) is known before the first backward (1 / (N * K) without
    // masks); nothing counted: zero gradient.
    int64_t total = 0;
    for (int k = 0; k < K; ++k)
      total += it.counts[k] = split_batch(micro_batches[k], masks.empty() ? nullptr : masks[k], B,
                                          T, it.inputs[k].data(), it.targets[k].data());
    it.packed = !positions.empty();
    for (int k = 0; k < K && it.packed; ++k)
      std::copy(positions[k], positions[k] + B * T, it.positions[k].begin());
    it.step_loss_scale = step_loss_scale;
    it.loss_scale = backward_scale(total, step_loss_scale);
    it.apply = true;
    it.grad_norm = 0;
    it.grad_scale = 1.0f;
    it.lr = learning_rate(cfg_.optimizer, cfg_.schedule, step_index);
    it.t = t;
  });
  return step_result(it);
}

// Waits for the step's return (step_waits_for) and reports it. The figures cover the window
// since the previous step returned: the time, each resource's busy time within it (whichever
// iteration the op belongs to) and the bytes the store moved. In steady state that window is
// one iteration.
StepResult PlanExecutor::Impl::step_result(Iter& it) {
  std::unique_lock<std::mutex> lock(mu_);
  wait_for(lock, [&] { return it.returning == 0; });
  const double t_end = now();
  StepResult res;
  res.offloaded = true;
  res.iteration_s = t_end - window_start_;
  std::copy(window_busy_.begin(), window_busy_.end(), res.busy_s.begin());
  window_busy_.fill(0);
  for (const Iter& x : iters_)
    if (x.run == &train_) add_busy(x, t_end, res.busy_s);
  if (store_) {
    const StoreStats st = store_->stats();
    res.ssd_read_bytes = st.bytes_read - window_read_;
    res.ssd_write_bytes = st.bytes_written - window_written_;
    res.disk_busy_s = st.busy_s - window_disk_;
    window_read_ = st.bytes_read;
    window_written_ = st.bytes_written;
    window_disk_ = st.busy_s;
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

// The forward-only plan on one micro-batch: the validation loss at the current weights (the
// mean over its counted targets; 0 when none counts, as InMemoryStep::eval_loss).
float PlanExecutor::Impl::eval_loss(const int32_t* batch, const uint8_t* mask,
                                    const int32_t* positions) {
  drain();
  Iter& it = submit(eval_, -1, [&](Iter& it) {
    split_batch(batch, mask, plan_.micro_batch, cfg_.model.seq_len, it.inputs[0].data(),
                it.targets[0].data());
    it.packed = positions != nullptr;
    if (positions)
      std::copy(positions, positions + it.positions[0].size(), it.positions[0].begin());
  });
  std::unique_lock<std::mutex> lock(mu_);
  wait_for(lock, [&] { return it.pending == 0; });
  window_start_ = -1;
  return it.eval_loss;
}

// The last two training iterations (they overlap), times from the first op's start.
void PlanExecutor::Impl::write_trace(const std::string& path) {
  drain();
  nlohmann::json events = nlohmann::json::array();
  for (int r = 0; r < kNumResources; ++r)
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", r},
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
      if (op.layer >= 0)
        name += str(" ", op.layer);
      else if (op.group >= 0)
        name += str(" group ", op.group);
      if (plan_.grad_accum > 1) name += str(" mb", op.micro);
      name += str(" (step ", x.step, ")");
      events.push_back(
          {{"name", name},
           {"ph", "X"},
           {"pid", 0},
           {"tid", static_cast<int>(op.resource)},
           {"ts", (x.start[op.id] - t0) * 1e6},
           {"dur", (x.end[op.id] - x.start[op.id]) * 1e6},
           {"args",
            {{"op", op.id}, {"step", x.step}, {"micro", op.micro}, {"bytes", op_bytes(op)}}}});
    }
  }
  std::ofstream out(path);
  if (!out) throw IoError(str(path, ": cannot write trace"));
  out << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() << "\n";
}

PlanExecutor::PlanExecutor(const Config& cfg, Backend& backend, Plan plan, SsdStore* store)
    : impl_(std::make_unique<Impl>(*this, cfg, backend, std::move(plan), store)) {}
PlanExecutor::~PlanExecutor() = default;
const Plan& PlanExecutor::plan() const { return impl_->plan(); }
void PlanExecutor::set_params(const float* params) { impl_->set_params(params); }
void PlanExecutor::read_params(float* params) { impl_->read_params(params); }
void PlanExecutor::set_group_params(int g, const float* p) { impl_->set_group_params(g, p); }
void PlanExecutor::read_group_params(int g, float* p) { impl_->read_group_params(g, p); }
float* PlanExecutor::group_staging() { return impl_->group_staging(); }
StepResult PlanExecutor::step(int64_t s, const int32_t* batch, const uint8_t* mask) {
  if (mask) return impl_->step(s, {batch}, {mask}, {});
  return impl_->step(s, {batch}, {}, {});
}
StepResult PlanExecutor::step(int64_t s, const std::vector<const int32_t*>& mbs,
                              const std::vector<const uint8_t*>& masks,
                              const std::vector<const int32_t*>& positions) {
  return impl_->step(s, mbs, masks, positions);
}
void PlanExecutor::read_group_state(int g, StateKind k, const StateSink& sink) {
  impl_->read_group_state(g, k, sink);
}
void PlanExecutor::write_group_state(int g, StateKind k, const StateSource& source) {
  impl_->write_group_state(g, k, source);
}
void PlanExecutor::read_group_packed(int g, StateKind k, const PackedSink& sink) {
  impl_->read_group_packed(g, k, sink);
}
void PlanExecutor::write_group_packed(int g, StateKind k, const PackedSource& source) {
  impl_->write_group_packed(g, k, source);
}
OptimizerCounters PlanExecutor::counters() { return impl_->counters(); }
void PlanExecutor::set_counters(const OptimizerCounters& c) { impl_->set_counters(c); }
float PlanExecutor::eval_loss(const int32_t* batch, const uint8_t* mask, const int32_t* positions) {
  return impl_->eval_loss(batch, mask, positions);
}
void PlanExecutor::write_trace(const std::string& path) const { impl_->write_trace(path); }

}  // namespace fuyou
