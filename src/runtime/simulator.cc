// The plan simulator: a discrete-event run of a plan's per-resource queues.
//
// Without contention every operation runs at its full rate, so an op's end is its start plus
// its duration, and the start is max(previous op on the resource, every dependency): the
// executor's rule. With shared_cpu, a compute op and an optimizer op that overlap progress at
// compute_share and optimizer_share of their full rates for as long as both run (the CPU
// backend's GEMM threads and the optimizer's threads time-slice the same cores). Every op that
// moves bytes through the store shares the disks with the others running: reads, writes and
// the out-of-core updates' state streaming take turns on one disk set, each direction at its
// own rate.
#include "fuyou/simulator.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "fuyou/error.h"
#include "fuyou/model.h"
#include "fuyou/optim.h"
#include "fuyou/sizes.h"
#include "fuyou/storage.h"

namespace fuyou {

namespace {

double gemm_size_of(const Plan& plan) { return gemm_work_size(plan.model, plan.micro_batch); }

}  // namespace

OpTraffic op_traffic(const Plan& plan, const PlanOp& op) {
  const OpKindInfo k = op_kind_info(op.kind);
  OpTraffic t;
  switch (k.traffic) {
    case Traffic::kH2D:
      t.h2d = op.use(k.role).bytes;
      break;
    case Traffic::kD2H:
      t.d2h = op.use(k.role).bytes;
      break;
    case Traffic::kSsdRead:
      t.ssd_read = round_up(op.use(k.role).bytes, kIoAlign);
      break;
    case Traffic::kSsdWrite:
      t.ssd_write = round_up(op.use(k.role).bytes, kIoAlign);
      break;
    case Traffic::kState:
      // Out of core: master, m and v read and written back chunk by chunk, each request in
      // whole 4 KiB blocks, in the plan's state format (ooc_update_io_bytes).
      if (plan.buffers[op.use(k.role).buffer].tier == Tier::kSsd)
        t.ssd_read = t.ssd_write = ooc_update_io_bytes(plan.optim_format, op.params);
      break;
    case Traffic::kNone:
    case Traffic::kHostRead:
    case Traffic::kHostSum:
      break;  // no channel of OpTraffic: host memory, the simulator's demand()
  }
  return t;
}

namespace {

// What an op needs of each part of the machine, alone: CPU seconds (an update's kernel),
// disk seconds (its bytes at the striped read and write rates, one direction after the other)
// and the fixed-rate rest (compute, PCIe). An op that reads and writes (an out-of-core update)
// can use up to ssd_mixed of the disks' time at once (`cap`); alone it takes the longest of
// the three: the update pipelines its state streaming with the kernel.
struct Demand {
  double cpu = 0, disk = 0, other = 0;
  double cap = 1;  // the share of the disks it can use: ssd_mixed if it reads and writes
  bool reads = false, writes = false;
  double alone() const { return std::max({cpu, disk / cap, other}); }
};

double disk_seconds(uint64_t read, uint64_t write, const HardwareProfile& hw) {
  return (read ? read / hw.ssd_read_rate(read) : 0.0) +
         (write ? write / hw.ssd_write_rate(write) : 0.0);
}

Demand demand(const Plan& plan, const PlanOp& op, const HardwareProfile& hw, double gemm_size) {
  const OpTraffic t = op_traffic(plan, op);
  Demand d;
  d.disk = disk_seconds(t.ssd_read, t.ssd_write, hw);
  d.reads = t.ssd_read > 0;
  d.writes = t.ssd_write > 0;
  if (d.reads && d.writes) d.cap = hw.ssd_mixed;
  switch (op_kind_info(op.kind).traffic) {
    case Traffic::kNone:
    case Traffic::kSsdRead:
    case Traffic::kSsdWrite:
      break;  // compute below; the disks above
    case Traffic::kH2D:
      d.other = hw.h2d_seconds(static_cast<double>(t.h2d));
      break;
    case Traffic::kD2H:
      d.other = hw.d2h_seconds(static_cast<double>(t.d2h));
      break;
    case Traffic::kHostRead:
      // Exact mode: each group's sum of squares streams its held gradient once from host
      // memory (the tensors' type, or the fp32 sum), over the optimizer's threads; the norm
      // itself only adds the groups' sums.
      d.other = static_cast<double>(op_bytes(op)) / hw.host_mem_Bps;
      break;
    case Traffic::kHostSum:
      // An fp32 sum's accumulation: the 16-bit gradient read, the sum written (and read).
      for (const BufferUse& u : op.uses)
        d.other += (u.access == Access::kAccumulate ? 2.0 : 1.0) * u.bytes / hw.host_mem_Bps;
      break;
    case Traffic::kState:
      // 16-bit tensors or packed state: at the rate measured for the plan's state format
      // (with bf16 gradients and weights) where the profile has one; fp32 tensors and state
      // at the fp32 rate.
      d.cpu = op.params / (plan.tensors != ElemType::kF32 || plan.optim_format.packed()
                               ? hw.optimizer_rate(optim_format_name(plan.optim_format))
                               : hw.optimizer_params_per_s);
      break;
  }
  if (op.resource == Resource::kCompute)
    d.other = hw.compute_seconds(op.flops + op.recompute_flops, gemm_size);
  return d;
}

}  // namespace

double op_duration(const Plan& plan, const PlanOp& op, const HardwareProfile& hw) {
  return demand(plan, op, hw, gemm_size_of(plan)).alone();
}

void plan_memory_on(const Plan& plan, const HardwareProfile& hw, uint64_t* device, uint64_t* host,
                    uint64_t* ssd) {
  *device = plan.memory.device_bytes;
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
// optimizer share the cores on a shared_cpu profile, and every op that moves bytes through the
// store (SSD reads, SSD writes, out-of-core updates) shares the disks (rates()).
struct Timeline {
  std::vector<double> start, end;
};

class EventRun {
 public:
  EventRun(const Plan& plan, const std::vector<std::vector<int>>& prev,
           const std::vector<Demand>& dem, int iterations, const HardwareProfile& hw)
      : plan_(plan),
        prev_(prev),
        dem_(dem),
        hw_(hw),
        per_(plan.ops.size()),
        n_(per_ * iterations),
        bufs_(op_buffers(plan)) {
    for (const Demand& d : dem_) dur_.push_back(d.alone());
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
        if (remaining_[id] <= 0)
          finish(id);
        else
          running_[q] = id;
        changed = true;
      }
    }
  }

  // The rate of each running op, in seconds of its work alone per second. Compute and the
  // optimizer share the cores on a shared_cpu profile; a host<->device copy slows the
  // optimizer to copy_share (both stream through host memory). The disks' time is shared by the ops
  // that use them, max-min fair: each asks for the share of the disks it would use at the
  // rate the rest of the machine gives it (an I/O op all of one direction, a CPU-bound update
  // less), the smallest ask is met first and what is left is split evenly among the others.
  // The disks give 1 (one direction's worth), or ssd_mixed while reads and writes both run.
  std::array<double, kNumResources> rates() const {
    const int kC = static_cast<int>(Resource::kCompute),
              kO = static_cast<int>(Resource::kOptimizer);
    std::array<double, kNumResources> rate;
    rate.fill(1.0);
    if (hw_.shared_cpu && running_[kC] >= 0 && running_[kO] >= 0) {
      rate[kC] = hw_.compute_share;
      rate[kO] = hw_.optimizer_share;
    }
    if (running_[static_cast<int>(Resource::kH2D)] >= 0 ||
        running_[static_cast<int>(Resource::kD2H)] >= 0)
      rate[kO] *= hw_.copy_share;
    std::array<std::pair<double, int>, kNumResources> asks;
    int users = 0;
    bool reads = false, writes = false;
    for (int q = 0; q < kNumResources; ++q) {
      if (running_[q] < 0) continue;
      const Demand& d = dem_[running_[q] % per_];
      if (d.disk <= 0) continue;
      asks[users++] = {std::min(d.cap, rate[q] * d.disk / d.alone()), q};
      reads |= d.reads;
      writes |= d.writes;
    }
    std::sort(asks.begin(), asks.begin() + users);
    double left = reads && writes ? hw_.ssd_mixed : 1.0;
    for (int k = 0; k < users; ++k) {
      const auto [ask, q] = asks[k];
      const double share = std::min(ask, left / (users - k));
      left -= share;
      const Demand& d = dem_[running_[q] % per_];
      if (share < ask) rate[q] = share * d.alone() / d.disk;
    }
    return rate;
  }

  // Runs time forward to the next op's end at the current rates.
  void advance() {
    const std::array<double, kNumResources> rate = rates();
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
          throw Error(str("simulate: ", resource_name(static_cast<Resource>(q)), " is stuck at op ",
                          queue_[q][head_[q]], " (", op_kind_name(op_of(queue_[q][head_[q]]).kind),
                          ")"));
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
  const std::vector<Demand>& dem_;
  std::vector<double> dur_;  // per op of the plan: alone
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
Timeline run_timeline(const Plan& plan, const std::vector<std::vector<int>>& prev,
                      const std::vector<Demand>& dem, int iterations, const HardwareProfile& hw) {
  return EventRun(plan, prev, dem, iterations, hw).run();
}

// The time within which at least one of `ops` runs (the union of their intervals).
double union_busy(const Timeline& t, const std::vector<int>& ops) {
  std::vector<std::pair<double, double>> spans;
  for (int i : ops)
    if (t.end[i] > t.start[i]) spans.push_back({t.start[i], t.end[i]});
  std::sort(spans.begin(), spans.end());
  double busy = 0, from = 0, to = -1;
  for (const auto& [a, b] : spans) {
    if (a > to) {
      busy += std::max(0.0, to - from);
      from = a;
      to = b;
    } else {
      to = std::max(to, b);
    }
  }
  return busy + std::max(0.0, to - from);
}

}  // namespace

SimResult simulate(const Plan& plan, const HardwareProfile& hw) {
  const double gemm_size = gemm_size_of(plan);
  const size_t n = plan.ops.size();
  SimResult r;
  std::vector<Demand> dur(n);
  std::vector<int> disk_ops;
  for (size_t i = 0; i < n; ++i) {
    const PlanOp& op = plan.ops[i];
    if (op.id != static_cast<int>(i))
      throw Error(str("simulate: op at index ", i, " has id ", op.id));
    for (int d : op.deps)
      if (d < 0 || d >= static_cast<int>(i))
        throw Error(str("simulate: op ", i, " (", op_kind_name(op.kind), ") depends on op ", d,
                        ", which is not an earlier op"));
    dur[i] = demand(plan, op, hw, gemm_size);
    if (dur[i].disk > 0) disk_ops.push_back(static_cast<int>(i));
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
  r.disk_busy_s = union_busy(one, disk_ops);
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
  r.disk_busiest = r.disk_busy_s > r.busy_s[static_cast<int>(r.busiest)];
  plan_memory_on(plan, hw, &r.device_bytes, &r.host_bytes, &r.ssd_bytes);
  return r;
}

nlohmann::json SimResult::to_json() const {
  nlohmann::json j{{"iteration_s", iteration_s},
                   {"period_s", period_s},
                   {"tflops", tflops},
                   {"useful_flops", useful_flops},
                   {"recompute_flops", recompute_flops},
                   {"busiest", disk_busiest ? "disk" : resource_name(busiest)},
                   {"peak_device_bytes", device_bytes},
                   {"peak_host_bytes", host_bytes},
                   {"ssd_bytes", ssd_bytes}};
  for (int q = 0; q < kNumResources; ++q)
    j["busy_s"][resource_name(static_cast<Resource>(q))] = busy_s[q];
  j["busy_s"]["disk"] = disk_busy_s;
  return j;
}

}  // namespace fuyou
