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
  double gemm_size = 0;      // cbrt(tokens * d_model * d_ff)
  double byte_scale = 1;     // profile element bytes / plan's 4
  std::vector<uint64_t> group_params;
  uint64_t total_params = 0;
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
  ParamLayout layout = make_gpt_layout(m);
  for (const ParamGroup& g : layout.groups) s.group_params.push_back(g.numel);
  s.total_params = layout.total;
  return s;
}

StateTier optim_tier(const Plan& plan, int group) {
  const int L = plan.model.n_layer;
  if (group == 0) return plan.embed_optim;
  if (group == L + 1) return plan.final_optim;
  return plan.layers.at(group - 1).optim;
}

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
      if (op.kind == OpKind::kGradSumSq) return 4.0 * s.group_params.at(op.layer) / hw.host_mem_Bps;
      if (op.kind == OpKind::kGradNorm) return 0.0;
      if (op.kind != OpKind::kUpdate) return 0.0;
      const double p = op.part < 0 ? static_cast<double>(embed_rows_first_params(plan))
                                   : static_cast<double>(s.group_params.at(op.layer)) / op.parts;
      double cpu = p / hw.optimizer_params_per_s;
      if (optim_tier(plan, op.layer) == StateTier::kHost) return cpu;
      // Out of core: master, m and v (12 bytes per parameter) read and written back through
      // the store, pipelined with the update in chunks (ooc_adamw.h). Reads and writes
      // proceed at once, as the ssd_read and ssd_write queues do (the same full-duplex
      // assumption); the slowest of the three bounds the update.
      const uint64_t state = static_cast<uint64_t>(12 * p);
      return std::max({cpu, 12 * p / hw.ssd_read_rate(state), 12 * p / hw.ssd_write_rate(state)});
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
// are done, in order, except that the reordering queues (reorders(): SSD reads and writes,
// host to device) may start a ready op ahead of earlier ones
// it has no hazard with (reorders(), as the executor); compute and the optimizer share the
// cores on a shared_cpu profile.
struct Timeline {
  std::vector<double> start, end;
};

Timeline run_timeline(const Plan& plan, const std::vector<std::vector<int>>& prev, const std::vector<double>& dur1,
                      int iterations, const HardwareProfile& hw) {
  const size_t per = plan.ops.size(), n = per * iterations;
  auto op_of = [&](size_t id) -> const PlanOp& { return plan.ops[id % per]; };
  auto dur = [&](size_t id) { return dur1[id % per]; };
  Timeline r;
  r.start.assign(n, 0.0);
  r.end.assign(n, 0.0);
  std::vector<double> remaining(n);
  std::vector<std::vector<int>> queue(kNumResources);
  for (size_t i = 0; i < n; ++i) {
    remaining[i] = dur(i);
    queue[static_cast<int>(op_of(i).resource)].push_back(static_cast<int>(i));
  }
  std::vector<char> done(n, 0), started(n, 0);
  std::array<size_t, kNumResources> head{};   // first op not started in each queue
  const std::vector<OpBuffers> bufs = op_buffers(plan);
  // Per iteration: its ops not done, and its step_waits_for ops not done (its return). A plan
  // without such ops (a test's) returns at its end.
  size_t returning = 0;
  for (const PlanOp& op : plan.ops) returning += step_waits_for(op);
  const bool returns_early = returning > 0;
  if (!returns_early) returning = per;
  std::vector<size_t> left(iterations, per), returns_left(iterations, returning);
  std::array<int, kNumResources> running{};   // op running on each resource, -1 if idle
  running.fill(-1);
  double now = 0;
  size_t finished = 0;
  const int kC = static_cast<int>(Resource::kCompute), kO = static_cast<int>(Resource::kOptimizer);
  auto is_ready = [&](int id) {
    const size_t k = id / per, base = k * per;
    if ((k >= 1 && returns_left[k - 1]) || (k >= 2 && left[k - 2])) return false;
    for (int d : op_of(id).deps)
      if (!done[base + d]) return false;
    if (base > 0)
      for (int d : prev[id % per])
        if (!done[base - per + d]) return false;
    return true;
  };
  auto finish = [&](int id) {
    done[id] = 1;
    ++finished;
    const size_t k = id / per;
    --left[k];
    if (!returns_early || step_waits_for(op_of(id))) --returns_left[k];
  };
  // The op resource q starts next: its first op not started, once ready; on a reordering
  // queue the first ready one among the next kReorderWindow not started that touches nothing
  // an earlier not-started one touches with a write (scheduler.cc, next_op).
  auto next_in = [&](int q) -> long {
    const std::vector<int>& Q = queue[q];
    size_t h = head[q];
    while (h < Q.size() && started[Q[h]]) ++h;
    head[q] = h;
    if (h >= Q.size()) return -1;
    if (!reorders(static_cast<Resource>(q))) return is_ready(Q[h]) ? static_cast<long>(h) : -1;
    size_t seen = 0;
    for (size_t k = h; k < Q.size() && seen < kReorderWindow; ++k) {
      if (started[Q[k]]) continue;
      ++seen;
      if (!is_ready(Q[k])) continue;
      bool passes = true;
      for (size_t j = h; j < k && passes; ++j)
        if (!started[Q[j]]) passes = !buffers_conflict(bufs[Q[j] % per], bufs[Q[k] % per]);
      if (passes) return static_cast<long>(k);
    }
    return -1;
  };
  while (finished < n) {
    // Start every op whose resource is idle and whose dependencies are done. Zero-length
    // ops finish at once, which may make more ops ready: loop until nothing changes.
    bool changed = true;
    while (changed) {
      changed = false;
      for (int q = 0; q < kNumResources; ++q) {
        if (running[q] >= 0) continue;
        const long k = next_in(q);
        if (k < 0) continue;
        const int id = queue[q][k];
        r.start[id] = now;
        started[id] = 1;
        if (remaining[id] <= 0) {
          r.end[id] = now;
          finish(id);
        } else {
          running[q] = id;
        }
        changed = true;
      }
    }
    if (finished == n) break;
    // Rates: full, except compute and optimizer sharing the cores.
    std::array<double, kNumResources> rate;
    rate.fill(1.0);
    if (hw.shared_cpu && running[kC] >= 0 && running[kO] >= 0) {
      rate[kC] = hw.compute_share;
      rate[kO] = hw.optimizer_share;
    }
    int next = -1;
    double dt = std::numeric_limits<double>::infinity();
    for (int q = 0; q < kNumResources; ++q) {
      if (running[q] < 0) continue;
      double t = remaining[running[q]] / rate[q];
      if (t < dt) dt = t, next = q;
    }
    if (next < 0) {
      // Nothing runs and nothing can start: a dependency can never be met.
      for (int q = 0; q < kNumResources; ++q)
        if (head[q] < queue[q].size())
          throw Error(str("simulate: ", resource_name(static_cast<Resource>(q)), " is stuck at op ", queue[q][head[q]],
                          " (", op_kind_name(op_of(queue[q][head[q]]).kind), ")"));
      break;
    }
    now += dt;
    for (int q = 0; q < kNumResources; ++q) {
      int id = running[q];
      if (id < 0) continue;
      remaining[id] = q == next ? 0.0 : remaining[id] - rate[q] * dt;
      // Ops that end within rounding of the same instant end together.
      if (remaining[id] <= 1e-12 * dur(id)) {
        r.end[id] = now;
        finish(id);
        running[q] = -1;
      }
    }
  }
  return r;
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
