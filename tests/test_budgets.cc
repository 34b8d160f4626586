// Budgets and threads per backend: the device arena counts against the host budget only where
// it is host memory (the CPU backend), and runtime.threads reaches every executor thread that
// computes or updates (OpenMP's thread count is a per-thread setting).
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <mutex>
#include <set>

#include "fuyou/backend_select.h"
#include "fuyou/config.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/hardware.h"
#include "fuyou/model.h"
#include "fuyou/plan.h"
#include "fuyou/scheduler.h"
#include "fuyou/simulator.h"
#include "fuyou/train.h"

using namespace fuyou;
using Catch::Matchers::Contains;

namespace {

Config small_config(int threads) {
  return parse_config(
      str("model: {n_layer: 4, n_head: 2, d_model: 32, d_ff: 96, vocab_size: 64, seq_len: 16}\n"
          "optimizer: {grad_clip: 0}\n"
          "schedule: {steps: 2, warmup_steps: 1, micro_batch: 2}\n"
          "runtime: {backend: cpu, threads: ",
          threads, ", seed: 3}\n"),
      "<test>");
}

uint64_t part(const MemoryPlan& m, const std::string& name) {
  for (const auto& [n, b] : m.host_parts)
    if (n.find(name) != std::string::npos) return b;
  return 0;
}

}  // namespace

TEST_CASE("the device arena counts against the host budget only where it is host memory",
          "[budgets]") {
  Config cfg = small_config(2);
  PlanRequest req;
  req.model = cfg.model;
  req.micro_batch = cfg.schedule.micro_batch;
  req.acts.assign(cfg.model.n_layer,
                  ActPlacement::kHost);  // every state in host memory: no choice left
  PlanRequest cpu = req, gpu = req;
  cpu.device_in_host = true;
  gpu.device_in_host = false;
  const Plan pc = make_plan(cpu), pg = make_plan(gpu);
  REQUIRE(pc.memory.device_bytes == pg.memory.device_bytes);
  REQUIRE(pc.memory.device_bytes > 0);
  const uint64_t arena = pc.memory.device_bytes;
  INFO("device " << arena << ", host: cpu " << pc.memory.host_bytes << ", gpu "
                 << pg.memory.host_bytes);
  CHECK(pc.memory.host_bytes == pg.memory.host_bytes + arena);
  CHECK(part(pc.memory, "device arena") == arena);
  CHECK(part(pg.memory, "device arena") == 0);

  // A host budget that holds everything but the arena: the GPU plan fits, the CPU one is
  // refused with the numbers.
  cpu.host_budget = gpu.host_budget = pg.memory.host_bytes;
  CHECK(make_plan(gpu).memory.host_bytes == pg.memory.host_bytes);
  CHECK_THROWS_WITH(make_plan(cpu), Contains("host memory: the plan needs") &&
                                        Contains("process and device arena"));

  // The simulator's figures for either plan on either kind of profile: the arena is in host
  // memory exactly on a CPU profile.
  HardwareProfile cpu_hw, gpu_hw;
  cpu_hw.backend = "cpu";
  gpu_hw.backend = "cuda";
  for (const Plan* p : {&pc, &pg}) {
    uint64_t d = 0, h = 0, s = 0;
    plan_memory_on(*p, cpu_hw, &d, &h, &s);
    CHECK(h == pc.memory.host_bytes);
    plan_memory_on(*p, gpu_hw, &d, &h, &s);
    CHECK(h == pg.memory.host_bytes);
  }
}

// Without offload.host_memory an offloaded plan is held to the machine's physical memory
// (train_plan): a plan beyond it is refused at start with its numbers instead of being killed by
// the kernel part-way through its allocations.
TEST_CASE("an offloaded plan without offload.host_memory is held to physical memory", "[budgets]") {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page_size = ::sysconf(_SC_PAGE_SIZE);
  REQUIRE(pages > 0);
  const double physical = static_cast<double>(pages) * static_cast<double>(page_size);
  // Layers of d_model 4096 (201M parameters each, 16 bytes of host state apiece at least):
  // enough of them to need more than this machine has.
  const int layers = static_cast<int>(physical / (16.0 * 201e6)) + 2;
  Config cfg = small_config(2);
  cfg.model.n_layer = layers;
  cfg.model.d_model = 4096;
  cfg.model.n_head = 32;
  cfg.model.d_ff = 16384;
  cfg.offload.activations = ActivationPolicy::kSwap;
  INFO(layers << " layers, " << physical / (1 << 30) << " GiB of physical memory");
  auto be = make_cpu_backend(2, 0);
  CHECK_THROWS_WITH(train_plan(cfg, *be), Contains("host memory: the plan needs") &&
                                              Contains("of physical memory") &&
                                              Contains("offload.host_memory is unset"));
  // A budget set by the key is named as the key.
  cfg.offload.host_memory = 8ull << 30;
  CHECK_THROWS_WITH(train_plan(cfg, *be), Contains("offload.host_memory is 8.00 GiB"));
}

TEST_CASE("runtime.threads governs the executor's compute and optimizer threads", "[budgets]") {
  // A thread count other than the one a new thread starts with (OpenMP's default: every
  // processor), so that a worker that never set it shows.
  const int want = omp_get_num_procs() > 1 ? 1 : 2;
  Config cfg = small_config(want);
  auto be = make_cpu_backend(want, 0);
  PlanRequest req;
  req.model = cfg.model;
  req.micro_batch = cfg.schedule.micro_batch;
  req.acts.assign(cfg.model.n_layer, ActPlacement::kHost);
  // What on_op writes outlives the executor: its workers may still run a step's deferred
  // updates when step() has returned, until the executor is destroyed.
  std::mutex mu;
  std::set<int> compute, optimizer;
  PlanExecutor tr(cfg, *be, make_plan(req), nullptr);
  ParamLayout layout = make_gpt_layout(cfg.model);
  std::vector<float> init(layout.total);
  init_gpt_params(cfg.model, layout, init.data());
  tr.set_params(init.data());
  tr.on_op = [&](int64_t, const PlanOp& op) {
    const int n = omp_get_max_threads();
    std::lock_guard<std::mutex> lock(mu);
    if (op.resource == Resource::kCompute) compute.insert(n);
    if (op.resource == Resource::kOptimizer) optimizer.insert(n);
  };
  std::vector<int32_t> batch(
      static_cast<size_t>(cfg.schedule.micro_batch) * (cfg.model.seq_len + 1), 1);
  for (int s = 0; s < 2; ++s) tr.step(s, batch.data());
  std::lock_guard<std::mutex> lock(mu);  // a worker may still be running an op
  INFO("runtime.threads " << want << "; OpenMP threads seen: compute " << *compute.begin() << ".."
                          << *compute.rbegin() << ", optimizer " << *optimizer.begin() << ".."
                          << *optimizer.rbegin());
  CHECK(compute == std::set<int>{want});
  CHECK(optimizer == std::set<int>{want});
}
