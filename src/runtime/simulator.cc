// The plan simulator: a discrete-event run of a plan's per-resource queues.
//
// Without contention every operation runs at its full rate, so an op's end is its start plus
// its duration, and the start is max(previous op on the resource, every dependency): the
// executor's rule. With shared_cpu, a compute op and an optimizer op that overlap progress at
// compute_share and optimizer_share of their full rates for as long as both run (the CPU
// backend's GEMM threads and the optimizer's threads time-slice the same cores).
#include "fuyou/simulator.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "fuyou/error.h"
#include "fuyou/model.h"

namespace fuyou {

namespace {

struct Shape {
  double gemm_size = 0;   // cbrt(tokens * d_model * d_ff)
  double byte_scale = 1;  // profile element bytes / plan's 4
};

}  // namespace

double gemm_work_size(const ModelConfig& m, int micro_batch) {
  const double N = static_cast<double>(micro_batch) * m.seq_len, C = m.d_model, F = m.d_ff ? m.d_ff : 4.0 * m.d_model;
  return std::cbrt(N * C * F);
}

namespace {

Shape shape_of(const Plan& plan, const HardwareProfile& hw) {
  const ModelConfig& m = plan.model;
  Shape s;
  s.gemm_size = gemm_work_size(m, plan.micro_batch);
  s.byte_scale = hw.element_bytes / 4.0;
  return s;
}

// An op's time from what it says of itself: FLOPs over the GEMM rate, bytes over a link's
// or the disks' rate, parameters over the optimizer's rate.
double duration(const Plan& plan, const PlanOp& op, const HardwareProfile& hw, const Shape& s) {
  const double bytes = static_cast<double>(op.bytes) * s.byte_scale;
  const uint64_t ibytes = static_cast<uint64_t>(bytes);
  switch (op.resource) {
    case Resource::kCompute: {
      return hw.compute_seconds(op.flops + op.recompute_flops, s.gemm_size);
    }
    case Resource::kH2D: return hw.h2d_seconds(static_cast<double>(op.bytes));
    case Resource::kD2H: return hw.d2h_seconds(static_cast<double>(op.bytes));
    case Resource::kSsdRead: return ibytes ? bytes / hw.ssd_read_rate(ibytes) : 0.0;
    case Resource::kSsdWrite: return ibytes ? bytes / hw.ssd_write_rate(ibytes) : 0.0;
    case Resource::kOptimizer: {
      // Exact mode: each group's sum of squares streams its gradient once from host memory;
      // the norm itself only adds the groups' sums.
      if (op.kind == OpKind::kGradSumSq) return 4.0 * op.params / hw.host_mem_Bps;
      if (op.kind != OpKind::kUpdate) return 0.0;
      double cpu = op.params / hw.optimizer_params_per_s;
      // Out of core: the state (master, m and v) is read and written back through the store,
      // pipelined with the update in chunks (ooc_adamw.h). Reads and writes proceed at once,
      // as the ssd_read and ssd_write queues do (the same full-duplex assumption); the slowest
      // of the three bounds the update.
      const BufferUse& state = op.use(Role::kState);
      if (plan.buffers[state.buffer].tier != Tier::kSsd) return cpu;
      const double b = static_cast<double>(state.bytes);
      return std::max({cpu, b / hw.ssd_read_rate(state.bytes), b / hw.ssd_write_rate(state.bytes)});
    }
  }
  return 0.0;
}

}  // namespace

double op_duration(const Plan& plan, const PlanOp& op, const HardwareProfile& hw) {
  return duration(plan, op, hw, shape_of(plan, hw));
}

void plan_memory_on(const Plan& plan, const HardwareProfile& hw, uint64_t* device, uint64_t* host, uint64_t* ssd) {
  const double scale = hw.element_bytes / 4.0;
  *device = static_cast<uint64_t>(plan.memory.device_bytes * scale);
  // The CPU backend's device arena is host memory; a GPU's is not. The plan says whether it
  // counted the arena (MemoryPlan::device_in_host).
  const uint64_t counted = plan.memory.device_in_host ? plan.memory.device_bytes : 0;
  *host = plan.memory.host_bytes - counted + (hw.backend == "cpu" ? plan.memory.device_bytes : 0);
  *ssd = plan.memory.ssd_bytes;
}

namespace {

// The event simulation itself, over `iterations` copies of the plan back to back: op k*n + i
// is op i of iteration k, waiting for its deps in iteration k and, from the second
// iteration on, for its cross-iteration deps (`prev`) in iteration k-1, and, as the executor
// submits them, for iteration k-1's return (step_waits_for) and the end of iteration k-2
// (two iterations in flight). Each resource runs its ops one at a time, each once its deps
// are done, in order, except that the reordering queues may start a ready op ahead of
// earlier ones it has no hazard with (next_in_queue, as the executor); compute and the
// optimizer share the cores on a shared_cpu profile.
struct Timeline {
  std::vector<double> start, end;
};

class EventRun {
 public:
  EventRun(const Plan& plan, const std::vector<std::vector<int>>& prev, const std::vector<double>& dur, int iterations,
           const HardwareProfile& hw)
      : plan_(plan), prev_(prev), dur_(dur), hw_(hw), per_(plan.ops.size()), n_(per_ * iterations),
        bufs_(op_buffers(plan)) {
    r_.start.assign(n_, 0.0);
    r_.end.assign(n_, 0.0);
    remaining_.resize(n_);
    for (size_t i = 0; i < n_; ++i) {
      remaining_[i] = dur_[i % per_];
      queue_[static_cast<int>(op_of(i).resource)].push_back(static_cast<int>(i));
    }
    done_.assign(n_, 0);
    started_.assign(n_, 0);
    // Per iteration: its ops not done, and its step_waits_for ops not done (its return). A
    // plan without such ops (a test's) returns at its end.
    size_t returning = 0;
    for (const PlanOp& op : plan.ops) returning += step_waits_for(op);
    returns_early_ = returning > 0;
    if (!returns_early_) returning = per_;
    left_.assign(iterations, per_);
    returns_left_.assign(iterations, returning);
    running_.fill(-1);
  }

  Timeline run() {
    while (finished_ < n_) {
      start_ready();
      if (finished_ == n_) break;
      advance();
    }
    return r_;
  }

 private:
  const PlanOp& op_of(size_t id) const { return plan_.ops[id % per_]; }

  bool is_ready(int id) const {
    const size_t k = id / per_, base = k * per_;
    if ((k >= 1 && returns_left_[k - 1]) || (k >= 2 && left_[k - 2])) return false;
    for (int d : op_of(id).deps)
      if (!done_[base + d]) return false;
    if (base > 0)
      for (int d : prev_[id % per_])
        if (!done_[base - per_ + d]) return false;
    return true;
  }

  void finish(int id) {
    r_.end[id] = now_;
    done_[id] = 1;
    ++finished_;
    const size_t k = id / per_;
    --left_[k];
    if (!returns_early_ || step_waits_for(op_of(id))) --returns_left_[k];
  }

  // The op resource q starts next (next_in_queue): its queue from its first op not started,
  // where a started op counts as done.
  long next_in(int q) {
    const std::vector<int>& Q = queue_[q];
    size_t h = head_[q];
    while (h < Q.size() && started_[Q[h]]) ++h;
    head_[q] = h;
    const long k = next_in_queue(
        static_cast<Resource>(q), Q.size() - h, [&](size_t k) { return Q[h + k]; },
        [&](int id) { return started_[id] != 0; }, [&](int id) { return is_ready(id); },
        [&](int a, int b) { return buffers_conflict(bufs_[a % per_], bufs_[b % per_]); });
    return k < 0 ? -1 : static_cast<long>(h) + k;
  }

  // Starts every op whose resource is idle and whose dependencies are done. Zero-length ops
  // finish at once, which may make more ops ready: loops until nothing changes.
  void start_ready() {
    for (bool changed = true; changed;) {
      changed = false;
      for (int q = 0; q < kNumResources; ++q) {
        if (running_[q] >= 0) continue;
        const long k = next_in(q);
        if (k < 0) continue;
        const int id = queue_[q][k];
        r_.start[id] = now_;
        started_[id] = 1;
        if (remaining_[id] <= 0) finish(id);
        else running_[q] = id;
        changed = true;
      }
    }
  }

  // Runs time forward to the next op's end: every resource at full rate, except compute and
  // the optimizer sharing the cores.
  void advance() {
    const int kC = static_cast<int>(Resource::kCompute), kO = static_cast<int>(Resource::kOptimizer);
    std::array<double, kNumResources> rate;
    rate.fill(1.0);
    if (hw_.shared_cpu && running_[kC] >= 0 && running_[kO] >= 0) {
      rate[kC] = hw_.compute_share;
      rate[kO] = hw_.optimizer_share;
    }
    int next = -1;
    double dt = std::numeric_limits<double>::infinity();
    for (int q = 0; q < kNumResources; ++q) {
      if (running_[q] < 0) continue;
      const double t = remaining_[running_[q]] / rate[q];
      if (t < dt) dt = t, next = q;
    }
    if (next < 0) {
      // Nothing runs and nothing can start: a dependency can never be met.
      for (int q = 0; q < kNumResources; ++q)
        if (head_[q] < queue_[q].size())
          throw Error(str("simulate: ", resource_name(static_cast<Resource>(q)), " is stuck at op ", queue_[q][head_[q]],
                          " (", op_kind_name(op_of(queue_[q][head_[q]]).kind), ")"));
      throw Error("simulate: nothing runs and ops are left");
    }
    now_ += dt;
    for (int q = 0; q < kNumResources; ++q) {
      const int id = running_[q];
      if (id < 0) continue;
      remaining_[id] = q == next ? 0.0 : remaining_[id] - rate[q] * dt;
      // Ops that end within rounding of the same instant end together.
      if (remaining_[id] <= 1e-12 * dur_[id % per_]) {
        finish(id);
        running_[q] = -1;
      }
    }
  }

  const Plan& plan_;
  const std::vector<std::vector<int>>& prev_;
  const std::vector<double>& dur_;
  const HardwareProfile& hw_;
  const size_t per_, n_;
  const std::vector<OpBuffers> bufs_;
  Timeline r_;
  std::vector<double> remaining_;
  std::array<std::vector<int>, kNumResources> queue_;
  std::vector<char> done_, started_;
  std::array<size_t, kNumResources> head_{};  // first op not started in each queue
  bool returns_early_ = false;
  std::vector<size_t> left_, returns_left_;
  std::array<int, kNumResources> running_{};  // op running on each resource, -1 if idle
  double now_ = 0;
  size_t finished_ = 0;
};

// The event simulation over `iterations` copies of the plan back to back (see EventRun).
Timeline run_timeline(const Plan& plan, const std::vector<std::vector<int>>& prev, const std::vector<double>& dur,
                      int iterations, const HardwareProfile& hw) {
  return EventRun(plan, prev, dur, iterations, hw).run();
}

}  // namespace

SimResult simulate(const Plan& plan, const HardwareProfile& hw) {
  const Shape s = shape_of(plan, hw);
  const size_t n = plan.ops.size();
  SimResult r;
  std::vector<double> dur(n);
  for (size_t i = 0; i < n; ++i) {
    const PlanOp& op = plan.ops[i];
    if (op.id != static_cast<int>(i)) throw Error(str("simulate: op at index ", i, " has id ", op.id));
    for (int d : op.deps)
      if (d < 0 || d >= static_cast<int>(i))
        throw Error(str("simulate: op ", i, " (", op_kind_name(op.kind), ") depends on op ", d,
                        ", which is not an earlier op"));
    dur[i] = duration(plan, op, hw, s);
    r.useful_flops += op.flops;
    r.recompute_flops += op.recompute_flops;
  }

  // One iteration from an idle machine, and kSteadyIterations back to back as the executor
  // overlaps them (each op also waiting for its previous_iteration_deps): the period is the
  // time between the last two steps' returns (step_waits_for).
  constexpr int kSteadyIterations = 3;
  const std::vector<std::vector<int>> prev = previous_iteration_deps(plan);
  Timeline one = run_timeline(plan, prev, dur, 1, hw);
  r.start = one.start;
  r.end = one.end;
  for (size_t i = 0; i < n; ++i) {
    r.busy_s[static_cast<int>(plan.ops[i].resource)] += r.end[i] - r.start[i];
    r.iteration_s = std::max(r.iteration_s, r.end[i]);
  }
  Timeline steady = run_timeline(plan, prev, dur, kSteadyIterations, hw);
  const bool returns_early = std::any_of(plan.ops.begin(), plan.ops.end(), step_waits_for);
  auto returned = [&](int k) {
    double t = 0;
    for (size_t i = 0; i < n; ++i)
      if (!returns_early || step_waits_for(plan.ops[i])) t = std::max(t, steady.end[k * n + i]);
    return t;
  };
  r.period_s = n ? returned(kSteadyIterations - 1) - returned(kSteadyIterations - 2) : 0.0;
  r.tflops = r.period_s > 0 ? r.useful_flops / r.period_s / 1e12 : 0.0;
  for (int q = 0; q < kNumResources; ++q)
    if (r.busy_s[q] > r.busy_s[static_cast<int>(r.busiest)]) r.busiest = static_cast<Resource>(q);
  plan_memory_on(plan, hw, &r.device_bytes, &r.host_bytes, &r.ssd_bytes);
  return r;
}

nlohmann::json SimResult::to_json() const {
  nlohmann::json j{{"iteration_s", iteration_s},
                   {"period_s", period_s},
                   {"tflops", tflops},
                   {"useful_flops", useful_flops},
                   {"recompute_flops", recompute_flops},
                   {"busiest", resource_name(busiest)},
                   {"peak_device_bytes", device_bytes},
                   {"peak_host_bytes", host_bytes},
                   {"ssd_bytes", ssd_bytes}};
  for (int q = 0; q < kNumResources; ++q) j["busy_s"][resource_name(static_cast<Resource>(q))] = busy_s[q];
  return j;
}

}  // namespace fuyou
