// In-memory training as a plan of the executor (in_memory_plan, make_train_engine): every
// layer's weights in a device slot of its own and its activations kept, AdamW on the host.
// Its shape (one weight load per layer a step, none in the backward, no SSD), where the
// in-memory step runs instead (AdamW on the device), and its results: bitwise those of the
// in-memory step, on the CPU backend and on its CUDA-ordered twin with random delays, for
// fp32 and bf16 tensors, with and without clipping, over one and two micro-batches, with fp32
// and int8 + split optimizer state.
#include <algorithm>
#include <catch2/catch.hpp>
#include <memory>
#include <vector>

#include "engine_run_support.h"
#include "fuyou/backend_select.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/train.h"
#include "test_support.h"

using namespace fuyou;

namespace {

Config plan_config(const char* tensors, double clip, int accum, const char* state,
                   const char* placement = "auto", const char* accum_type = "auto") {
  const bool packed = std::string(state) == "int8";
  return parse_config(
      str("model: {n_layer: 5, n_head: 2, d_model: 32, d_ff: 96, vocab_size: 64, seq_len: 16}\n"
          "optimizer: {lr: 3.0e-3, min_lr: 3.0e-4, grad_clip: ",
          clip, ", state: ", state, ", master: ", packed ? "split" : "fp32", ", placement: ",
          placement, "}\nschedule: {steps: 4, warmup_steps: 1, micro_batch: 2, grad_accum: ", accum,
          ", grad_accum_type: ", accum_type,
          "}\nruntime: {backend: cpu, threads: 2, seed: 11, device_tensors: ", tensors,
          ", precision: ", std::string(tensors) == "bf16" ? "bf16" : "fp32", "}\n"),
      "<test>");
}

std::unique_ptr<Backend> backend_for(const Config& cfg, bool streams) {
  std::unique_ptr<Backend> be;
  if (streams) {
    StreamOptions so;
    so.max_delay_us = 300;
    so.seed = 5;
    be = make_cpu_stream_backend(2, 0, so);
  } else {
    be = make_cpu_backend(2, 0);
  }
  be->set_storage_type(plan_request(cfg).tensors);
  if (cfg.runtime.precision == "bf16") be->set_matmul_precision(MatmulPrecision::kBf16);
  return be;
}

// `steps` steps of grad_accum random micro-batches each.
std::vector<std::vector<std::vector<int32_t>>> step_batches(const Config& cfg, int steps) {
  const auto flat = test::random_batches(cfg, steps * cfg.schedule.grad_accum, 31);
  std::vector<std::vector<std::vector<int32_t>>> out(steps);
  for (int s = 0; s < steps; ++s)
    for (int k = 0; k < cfg.schedule.grad_accum; ++k)
      out[s].push_back(flat[s * cfg.schedule.grad_accum + k]);
  return out;
}

// A TrainEngine's run over `data` from the model's initial parameters, its fp32 master
// weights read back group by group.
test::EngineRun engine_run(TrainEngine& engine, const ParamLayout& layout,
                           const std::vector<std::vector<std::vector<int32_t>>>& data) {
  engine.init_params();
  test::EngineRun out;
  for (size_t s = 0; s < data.size(); ++s)
    out.record(engine.step(static_cast<int64_t>(s), test::micro_batch_ptrs(data[s])));
  out.params = test::engine_master(engine, layout);
  return out;
}

}  // namespace

TEST_CASE("in-memory training runs as a plan: weights resident, one load per layer a step",
          "[in_memory_plan]") {
  Config cfg = plan_config("bf16", 0.5, 2, "fp32");
  auto be = backend_for(cfg, false);
  auto engine = make_train_engine(cfg, *be);
  REQUIRE(engine->plan() != nullptr);
  CHECK_FALSE(engine->offloaded());
  CHECK_THAT(engine->describe(), Catch::Matchers::Contains("in-memory training as a plan"));
  const Plan& plan = *engine->plan();
  const int L = cfg.model.n_layer;
  CHECK(plan.resident_weights);
  CHECK(plan.pools.device_weight_slots == L);
  CHECK(plan.memory.ssd_bytes == 0);
  for (const LayerDecision& d : plan.layers) CHECK(d.act == ActPlacement::kKeep);
  // Every block input stays on the device: no checkpoint slots to bring one back into, where a
  // plan with a layer's activations on the host has 2 or 3.
  CHECK(plan.pools.device_ckpt_slots == 0);
  CHECK(std::none_of(plan.buffers.begin(), plan.buffers.end(),
                     [](const PlanBuffer& b) { return b.kind == BufferKind::kCkptSlot; }));
  PlanRequest host_acts = plan_request(cfg);
  host_acts.acts.assign(L, ActPlacement::kKeep);
  host_acts.acts[1] = ActPlacement::kHost;
  CHECK(make_plan(host_acts).pools.device_ckpt_slots >= 2);
  // Each layer's weights come up once a step, in the first micro-batch's forward, and stay for
  // the second micro-batch and both backwards; nothing is read from or written to SSD.
  std::vector<int> loads(L, 0);
  for (const PlanOp& op : plan.ops) {
    if (op.kind == OpKind::kLoadWeights) {
      ++loads.at(op.layer);
      CHECK(op.micro == 0);
    }
    CHECK(op.resource != Resource::kSsdRead);
    CHECK(op.resource != Resource::kSsdWrite);
  }
  for (int l = 0; l < L; ++l) {
    INFO("layer " << l);
    CHECK(loads[l] == 1);
  }
  // Every layer's backward reads the slot its forward read.
  for (const PlanOp& b : plan.ops) {
    if (b.kind != OpKind::kBackward) continue;
    const auto f = std::find_if(plan.ops.begin(), plan.ops.end(), [&](const PlanOp& o) {
      return o.kind == OpKind::kForward && o.layer == b.layer && o.micro == b.micro;
    });
    REQUIRE(f != plan.ops.end());
    CHECK(f->use(Role::kWeights).buffer == b.use(Role::kWeights).buffer);
  }

  // runtime.in_memory step: the in-memory step, no plan.
  cfg.runtime.in_memory = "step";
  std::string why;
  CHECK(make_train_engine(cfg, *be)->plan() == nullptr);
  CHECK_FALSE(in_memory_plan(cfg, *be, 0, &why));
  CHECK(why == "runtime.in_memory is step");
  cfg.runtime.in_memory = "plan";

  // AdamW on the device: a plan too, its state on the device.
  cfg.optimizer.placement = "device";
  auto be2 = backend_for(cfg, false);
  auto device_engine = make_train_engine(cfg, *be2);
  REQUIRE(device_engine->plan() != nullptr);
  CHECK(device_engine->plan()->device_optimizer);
  CHECK_THAT(device_engine->describe(), Catch::Matchers::Contains("Adam moments on the device"));
}

// One choice of engine for the run and for fuyou-train --dry-run (choose_engine): a device
// budget decides between the in-memory plan, the in-memory step and offloading by what each
// needs, and the dry run reports the engine the run takes.
TEST_CASE("the device budget chooses the engine, and the dry run reports the same one",
          "[in_memory_plan]") {
  using Catch::Matchers::Contains;
  Config cfg = plan_config("bf16", 0.5, 2, "fp32");
  auto be = backend_for(cfg, false);
  std::string why;
  const std::optional<Plan> unbounded = in_memory_plan(cfg, *be, 0, &why);
  REQUIRE(unbounded);
  const uint64_t plan_bytes = unbounded->memory.device_bytes;
  const uint64_t step_bytes =
      in_memory_device_bytes(cfg.model, cfg.schedule.micro_batch, be->storage_bytes());
  // The plan holds two layers' gradients at a time, the step every layer's.
  REQUIRE(plan_bytes < step_bytes);
  const test::TempDir dir("engine-choice");
  auto engine_line = [&](const Config& c) {
    for (const std::string& l : dry_run(c, dir.path).lines)
      if (l.rfind("engine: ", 0) == 0) return l;
    return std::string();
  };
  struct Case {
    uint64_t budget;
    EngineKind kind;
    const char* line;
  };
  for (const Case& k : {Case{0, EngineKind::kInMemoryPlan, "engine: in memory as a plan"},
                        Case{(plan_bytes + step_bytes) / 2, EngineKind::kInMemoryPlan,
                             "engine: in memory as a plan"},
                        Case{plan_bytes - 1, EngineKind::kOffloaded, "engine: offloaded"}}) {
    INFO("offload.device_memory " << k.budget << " (the plan needs " << plan_bytes << ", the step "
                                  << step_bytes << ")");
    cfg.offload.device_memory = k.budget;
    auto b = make_backend(cfg, nullptr);
    const EngineChoice c = choose_engine(cfg, *b, 0);
    CHECK(c.kind == k.kind);
    CHECK(c.plan.has_value() == (k.kind == EngineKind::kInMemoryPlan));
    if (k.kind == EngineKind::kOffloaded)
      CHECK_THAT(c.why, Contains("in memory as a plan: the plan needs"));
    CHECK_THAT(engine_line(cfg), Contains(k.line));
  }
  // The step where it is asked for and fits; offloaded where it does not.
  cfg.runtime.in_memory = "step";
  for (const Case& k :
       {Case{step_bytes, EngineKind::kInMemoryStep, "engine: in memory, the in-memory step"},
        Case{step_bytes - 1, EngineKind::kOffloaded, "engine: offloaded"}}) {
    INFO("runtime.in_memory step, offload.device_memory " << k.budget);
    cfg.offload.device_memory = k.budget;
    auto b = make_backend(cfg, nullptr);
    CHECK(choose_engine(cfg, *b, 0).kind == k.kind);
    CHECK_THAT(engine_line(cfg), Contains(k.line));
  }
}

TEST_CASE("in-memory training as a plan is bitwise the in-memory step", "[in_memory_plan]") {
  const bool streams = GENERATE(false, true);
  const char* tensors = GENERATE("fp32", "bf16");
  const int accum = GENERATE(1, 2);
  for (double clip : {0.0, 0.5})
    for (const char* state : {"fp32", "int8"}) {
      if (std::string(state) == "int8" && std::string(tensors) == "fp32") continue;  // split
      Config cfg = plan_config(tensors, clip, accum, state);
      INFO((streams ? "cpu-streams" : "cpu") << ", tensors " << tensors << ", grad_accum " << accum
                                             << ", clip " << clip << ", state " << state);
      const auto data = step_batches(cfg, 4);
      auto ref_be = backend_for(cfg, false);
      const test::EngineRun ref = test::in_memory_run(cfg, data, *ref_be);
      auto be = backend_for(cfg, streams);
      auto engine = make_train_engine(cfg, *be);
      REQUIRE(engine->plan() != nullptr);
      REQUIRE(engine->plan()->resident_weights);
      const test::EngineRun run = engine_run(*engine, make_gpt_layout(cfg.model), data);
      // The executor reports the norm in exact mode (clipping) only.
      test::require_bitwise(run, ref, clip > 0);
    }
}

TEST_CASE("AdamW on the device as a plan is bitwise the in-memory step", "[in_memory_plan]") {
  // optimizer.placement device: the plan keeps every group's state on the device and updates
  // it on the compute queue (Plan::device_optimizer); the reference is the in-memory step with
  // its optimizer on the host (the device's AdamW gives the host's bits).
  const bool streams = GENERATE(false, true);
  const char* tensors = GENERATE("fp32", "bf16");
  const int accum = GENERATE(1, 2);
  for (double clip : {0.0, 0.5})
    for (const char* accum_type : {"fp32", "tensors"}) {
      if (std::string(accum_type) == "tensors" && (accum == 1 || std::string(tensors) == "fp32"))
        continue;  // the same plan as fp32 sums
      Config cfg = plan_config(tensors, clip, accum, "fp32", "device", accum_type);
      INFO((streams ? "cpu-streams" : "cpu") << ", tensors " << tensors << ", grad_accum " << accum
                                             << " (" << accum_type << "), clip " << clip);
      const auto data = step_batches(cfg, 4);
      Config host_cfg = cfg;
      host_cfg.optimizer.placement = "host";
      auto ref_be = backend_for(host_cfg, false);
      const test::EngineRun ref = test::in_memory_run(host_cfg, data, *ref_be);
      auto be = backend_for(cfg, streams);
      auto engine = make_train_engine(cfg, *be);
      REQUIRE(engine->plan() != nullptr);
      const Plan& plan = *engine->plan();
      REQUIRE(plan.device_optimizer);
      // Nothing of the model crosses the bus in a step, and every group updates on the device.
      // In exact mode one sum of squares over every group: one return to the host a step.
      int device_updates = 0, sums = 0;
      for (const PlanOp& op : plan.ops) {
        INFO(op_kind_name(op.kind));
        CHECK(op.resource != Resource::kH2D);
        CHECK(op.resource != Resource::kD2H);
        device_updates += op.kind == OpKind::kDeviceUpdate;
        sums += op.kind == OpKind::kDeviceGradSumSq;
      }
      CHECK(device_updates == cfg.model.n_layer + 2);
      CHECK(sums == (clip > 0 ? 1 : 0));
      CHECK(plan.memory.ssd_bytes == 0);
      const test::EngineRun run = engine_run(*engine, make_gpt_layout(cfg.model), data);
      test::require_bitwise(run, ref, clip > 0);
    }
}
