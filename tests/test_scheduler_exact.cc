// The offloading scheduler's validation pass, gradient accumulation and exact mode with
// gradients held on SSD, each bitwise against in-memory training (InMemoryStep) on the CPU
// backend, with weights and optimizer state forced to SSD. Bitwise, not within a tolerance:
// both paths run the same kernels in the same order on the same values, so any difference is
// a scheduling bug (a stale buffer, a missed accumulation, a wrong slot). The validation and
// accumulation tests run the executor on the CPU backend and on its CUDA-ordered twin
// (cpu-streams, random delays), where a missing wait changes the numbers.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>

#include "engine_run_support.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/rng.h"
#include "fuyou/scheduler.h"
#include "fuyou/train.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;
using Catch::Matchers::Contains;

namespace {

// `tensors`: the device tensors, and with 16-bit ones what micro-batch gradients are summed
// in: "bf16" (schedule.grad_accum_type auto: fp32 sums on the host) or "bf16-tensors"; "fp16"
// (fp32 sums) comes with precision fp16 and its loss scaling.
Config accum_config(double clip, int accum, const std::string& tensors = "fp32") {
  const bool in_tensors = tensors == "bf16-tensors";
  const bool fp16 = tensors == "fp16";
  return parse_config(
      str("model: {n_layer: 5, n_head: 2, d_model: 32, d_ff: 96, vocab_size: 64, seq_len: 16}\n"
          "optimizer: {lr: 3.0e-3, min_lr: 3.0e-4, grad_clip: ",
          clip, "}\nschedule: {steps: 4, warmup_steps: 2, micro_batch: 2, grad_accum: ", accum,
          in_tensors ? ", grad_accum_type: tensors" : "",
          "}\nruntime: {backend: cpu, threads: 2, seed: 5, device_tensors: ",
          in_tensors ? "bf16" : tensors, fp16 ? ", precision: fp16" : "", "}\n"),
      "<test>");
}

std::string store_dir(const std::string& tag) { return test::fresh_test_dir("sched-x-" + tag); }

std::unique_ptr<SsdStore> open_store(const std::string& tag) {
  StoreConfig sc;
  sc.dirs = {store_dir(tag + "a"), store_dir(tag + "b")};
  sc.stripe_unit = 64 * 1024;
  return SsdStore::open(sc);
}

std::vector<int32_t> tokens(const Config& cfg, uint64_t stream) {
  Rng rng(91, stream);
  std::vector<int32_t> b(static_cast<size_t>(cfg.schedule.micro_batch) * (cfg.model.seq_len + 1));
  for (auto& t : b) t = static_cast<int32_t>(rng.below(cfg.model.vocab_size));
  return b;
}

// steps x grad_accum micro-batches.
std::vector<std::vector<std::vector<int32_t>>> step_data(const Config& cfg, int steps) {
  std::vector<std::vector<std::vector<int32_t>>> out(steps);
  for (int s = 0; s < steps; ++s)
    for (int k = 0; k < cfg.schedule.grad_accum; ++k) out[s].push_back(tokens(cfg, 100 * s + k));
  return out;
}

using Run = test::EngineRun;
using test::require_bitwise;

Run in_memory(const Config& cfg, const std::vector<std::vector<std::vector<int32_t>>>& data) {
  return test::in_memory_run(cfg, data, plan_request(cfg).tensors);
}

// The executor's backend: the CPU's, or (streams) its twin under CUDA's ordering rules with
// random delays of up to 300 us before every queued operation.
std::unique_ptr<Backend> executor_backend(bool streams, ElemType tensors) {
  std::unique_ptr<Backend> be;
  if (!streams) {
    be = make_cpu_backend(2, 0);
  } else {
    StreamOptions so;
    so.max_delay_us = 300;
    so.seed = 9;
    be = make_cpu_stream_backend(2, 0, so);
  }
  be->set_storage_type(tensors);
  return be;
}

Run offloaded(const Config& cfg, const Plan& plan,
              const std::vector<std::vector<std::vector<int32_t>>>& data, SsdStore* store,
              bool streams = false) {
  auto be = executor_backend(streams, plan.tensors);
  PlanExecutor tr(cfg, *be, plan, store);
  return test::offloaded_run(tr, data);
}

PlanRequest ssd_request(const Config& cfg) {
  PlanRequest req;
  req.model = cfg.model;
  req.micro_batch = cfg.schedule.micro_batch;
  req.tensors = plan_request(cfg).tensors;
  req.exact = plan_request(cfg).exact;  // clipping, or fp16's overflow check
  req.grad_accum = cfg.schedule.grad_accum;
  req.accum_fp32 = plan_request(cfg).accum_fp32;
  req.have_ssd = true;
  // Every activation path, as in test_scheduler.cc: keep, SSD, recompute, host, device.
  req.acts = {ActPlacement::kKeep, ActPlacement::kSsd, ActPlacement::kRecompute,
              ActPlacement::kHost, ActPlacement::kDevice};
  req.weights_on_ssd = true;
  req.optim_on_ssd = true;
  return req;
}

int count_kind(const Plan& p, OpKind k) {
  int n = 0;
  for (const PlanOp& op : p.ops) n += op.kind == k;
  return n;
}

}  // namespace

TEST_CASE("offloaded validation loss is bitwise the in-memory one", "[scheduler]") {
  Config cfg = accum_config(0.0, 1);
  auto data = step_data(cfg, 3);
  std::vector<int32_t> val = tokens(cfg, 999);
  // A loss mask that drops a few targets: the mean is then over the counted ones.
  std::vector<uint8_t> mask(static_cast<size_t>(cfg.schedule.micro_batch) * cfg.model.seq_len, 1);
  for (size_t i = 0; i < mask.size(); i += 3) mask[i] = 0;

  auto be = make_cpu_backend(2, 0);
  InMemoryStep ref(cfg, *be);
  ref.init_params();

  auto store = open_store("eval");
  const bool streams = GENERATE(false, true);
  INFO("backend " << (streams ? "cpu-streams" : "cpu"));
  auto be2 = executor_backend(streams, ElemType::kF32);
  PlanExecutor tr(cfg, *be2, make_plan(ssd_request(cfg)), store.get());
  ParamLayout layout = make_gpt_layout(cfg.model);
  std::vector<float> init(layout.total);
  init_gpt_params(cfg.model, layout, init.data());
  tr.set_params(init.data());
  REQUIRE(tr.plan().layers[2].weights == Tier::kSsd);

  // Before training, between steps (the forward-only plan must not disturb the training
  // plan's buffers) and after.
  for (size_t s = 0; s <= data.size(); ++s) {
    float a = tr.eval_loss(val.data()), b = ref.eval_loss(val.data());
    float am = tr.eval_loss(val.data(), mask.data()), bm = ref.eval_loss(val.data(), mask.data());
    INFO("after " << s << " steps: offloaded " << a << " / " << am << ", in memory " << b << " / "
                  << bm);
    CHECK(std::memcmp(&a, &b, 4) == 0);
    CHECK(std::memcmp(&am, &bm, 4) == 0);
    CHECK(a != am);  // the mask changes the value, so the masked comparison means something
    if (s == data.size()) break;
    float la = tr.step(static_cast<int64_t>(s), data[s][0].data()).loss;
    float lb = ref.step(static_cast<int64_t>(s), test::micro_batch_ptrs(data[s])).loss;
    CHECK(std::memcmp(&la, &lb, 4) == 0);
  }
  std::vector<float> pa(layout.total);
  tr.read_params(pa.data());
  CHECK(std::memcmp(pa.data(), ref.master().data(), 4 * pa.size()) == 0);

  // The forward-only plan: one forward per layer, the loss, nothing of a backward.
  Plan fp = make_forward_plan(tr.plan());
  CHECK(fp.forward_only);
  CHECK(count_kind(fp, OpKind::kForward) == cfg.model.n_layer);
  CHECK(count_kind(fp, OpKind::kHeadLoss) == 1);
  // Weights come as the training forward brings them: a layer retained in a weights-out slot
  // loads from there, every other layer on SSD is read once.
  int ssd_reads = 0, retained = 0;
  for (const auto& layer : fp.layers) {
    ssd_reads += layer.weights == Tier::kSsd && layer.retained < 0;
    retained += layer.retained >= 0;
  }
  CHECK(count_kind(fp, OpKind::kReadWeights) == ssd_reads);
  CHECK(count_kind(fp, OpKind::kLoadWeights) == cfg.model.n_layer);
  int from_wout = 0;
  for (const PlanOp& op : fp.ops)
    if (op.kind == OpKind::kLoadWeights)
      from_wout += fp.buffers[op.use(Role::kSource).buffer].kind == BufferKind::kWoutSlot;
  CHECK(from_wout == retained);
  CHECK(retained > 0);  // this plan covers both ways in
  CHECK(count_kind(fp, OpKind::kBackward) + count_kind(fp, OpKind::kSaveCheckpoint) +
            count_kind(fp, OpKind::kUpdate) ==
        0);
  for (const PlanOp& op : fp.ops)
    for (int d : op.deps) CHECK(d < op.id);
  CHECK_THAT(fp.table(), Contains("forward-only"));
}

TEST_CASE("offloaded gradient accumulation is bitwise in-memory training", "[scheduler]") {
  const bool streams = GENERATE(false, true);
  // fp32 tensors; bf16 tensors summed in fp32 on the host (the default); bf16 tensors summed
  // in the device's bf16 gradients (schedule.grad_accum_type: tensors); fp16 tensors (fp32
  // sums, loss scaling, exact mode).
  const std::string tensors = GENERATE("fp32", "bf16", "bf16-tensors", "fp16");
  INFO("backend " << (streams ? "cpu-streams" : "cpu") << ", tensors " << tensors);
  const int K = 3;  // micro-batches: a first, a middle and a last
  for (double clip : {0.0, 0.05}) {
    Config cfg = accum_config(clip, K, tensors);
    auto data = step_data(cfg, 4);
    Run ref = in_memory(cfg, data);
    const int L = cfg.model.n_layer;
    for (bool grads_ssd : {false, true}) {
      INFO("clip " << clip << ", held gradients on " << (grads_ssd ? "SSD" : "host"));
      auto store = open_store(str("acc", grads_ssd));
      PlanRequest req = ssd_request(cfg);
      req.grads_on_ssd = grads_ssd;
      Plan plan = make_plan(req);
      CHECK(plan.grad_accum == K);
      CHECK(plan.accum_fp32 == (tensors == "bf16" || tensors == "fp16"));
      CHECK(plan.layers[0].grads == (grads_ssd ? Tier::kSsd : Tier::kHost));
      if (plan.accum_fp32) {
        // Every micro-batch's gradient of every group is saved and added on the host; none
        // goes back to the device. A sum on SSD is read back before each addition but the
        // first (and, in exact mode, once more for the update).
        CHECK(count_kind(plan, OpKind::kLoadGrads) == 0);
        CHECK(count_kind(plan, OpKind::kSaveGrads) == K * (L + 2));
        CHECK(count_kind(plan, OpKind::kAccumulateGrads) == K * (L + 2));
        CHECK(count_kind(plan, OpKind::kReadGrads) ==
              (grads_ssd ? L * (K - 1 + (plan.exact ? 1 : 0)) : 0));
        const uint64_t layer_params = make_gpt_layout(cfg.model).groups[1].numel;
        for (const PlanBuffer& b : plan.buffers)
          if (b.kind == BufferKind::kGradHold || b.kind == BufferKind::kSsdGrads ||
              b.kind == BufferKind::kGradStage)
            CHECK(b.bytes == 4 * layer_params);
      } else {
        // Each micro-batch after the first brings every layer's gradient back before adding to it.
        CHECK(count_kind(plan, OpKind::kLoadGrads) == L * (K - 1));
        CHECK(count_kind(plan, OpKind::kAccumulateGrads) == 0);
        CHECK(count_kind(plan, OpKind::kReadGrads) ==
              (grads_ssd ? L * (K - 1 + (clip > 0 ? 1 : 0)) : 0));
      }
      CHECK(count_kind(plan, OpKind::kUpdate) == L + 2);
      require_bitwise(offloaded(cfg, plan, data, store.get(), streams), ref, plan.exact);
    }
  }
}

TEST_CASE("exact mode stages gradients on SSD when host memory cannot hold them", "[scheduler]") {
  Config cfg = accum_config(0.05, 1);
  auto data = step_data(cfg, 4);
  Run ref = in_memory(cfg, data);
  // Clipping must fire for the test to cover the scaled update: the threshold is below every
  // step's norm.
  for (double n : ref.norms) CHECK(n > cfg.optimizer.grad_clip);

  PlanRequest req = ssd_request(cfg);
  // The host budget: what holding every gradient in host memory needs (without the weight
  // slots beyond two each that an unlimited budget buys), less one layer's gradient, so the
  // planner must move some to SSD.
  Plan all_host = make_plan(req);
  for (const auto& d : all_host.layers) REQUIRE(d.grads == Tier::kHost);
  const uint64_t layer_bytes = 4 * make_gpt_layout(cfg.model).groups[1].numel;
  const int extra_slots = all_host.pools.host_weight_slots - 2 + all_host.pools.host_wout_slots - 2;
  req.host_budget = all_host.memory.host_bytes - (extra_slots + 1) * layer_bytes;
  Plan mixed = make_plan(req);
  int on_ssd = 0;
  for (const auto& d : mixed.layers) on_ssd += d.grads == Tier::kSsd;
  CHECK(on_ssd > 0);
  CHECK(on_ssd < cfg.model.n_layer);  // the rest still fit in host memory
  CHECK(mixed.memory.host_bytes <= req.host_budget);
  CHECK(mixed.pools.host_grad_stage_slots == 2);
  CHECK(count_kind(mixed, OpKind::kWriteGrads) == on_ssd);
  CHECK(count_kind(mixed, OpKind::kGradSumSq) == cfg.model.n_layer + 2);
  CHECK_THAT(mixed.table(), Contains("gradients") && Contains("held gradients"));
  auto j = mixed.to_json();
  CHECK(j["pools"]["host_grad_stage_slots"] == 2);
  CHECK(j["layers"][cfg.model.n_layer - 1]["gradients"] == "ssd");
  for (const PlanOp& op : mixed.ops)
    for (int d : op.deps) CHECK(d < op.id);
  {
    auto store = open_store("exact-mixed");
    require_bitwise(offloaded(cfg, mixed, data, store.get()), ref, true);
  }
  {
    req.host_budget = 0;
    req.grads_on_ssd = true;
    auto store = open_store("exact-ssd");
    require_bitwise(offloaded(cfg, make_plan(req), data, store.get()), ref, true);
  }
  // Without SSD the same budget is refused, naming the held gradients.
  PlanRequest no_ssd = req;
  no_ssd.have_ssd = false;
  no_ssd.grads_on_ssd = no_ssd.weights_on_ssd = no_ssd.optim_on_ssd = false;
  no_ssd.acts = std::vector<ActPlacement>(cfg.model.n_layer, ActPlacement::kKeep);
  no_ssd.host_budget = make_plan(no_ssd).memory.host_bytes - layer_bytes;
  CHECK_THROWS_WITH(make_plan(no_ssd),
                    Contains("held gradients (exact mode)") && Contains("offload.ssd_paths"));
}

TEST_CASE("exact mode's sums of squares on the device are bitwise the host's", "[scheduler]") {
  const bool streams = GENERATE(false, true);
  // fp32 tensors; bf16 summed in the device's gradients; fp16 (loss scaling, one micro-batch:
  // no fp32 sums); bf16 with fp32 sums on the host, where the sums stay on the host.
  const std::string tensors = GENERATE("fp32", "bf16-tensors", "fp16", "bf16");
  const int K = tensors == "fp16" ? 1 : 3;
  INFO("backend " << (streams ? "cpu-streams" : "cpu") << ", tensors " << tensors);
  Config cfg = accum_config(0.05, K, tensors);
  auto data = step_data(cfg, 4);
  Run ref = in_memory(cfg, data);
  const int L = cfg.model.n_layer;
  for (bool grads_ssd : {false, true}) {
    INFO("held gradients on " << (grads_ssd ? "SSD" : "host"));
    PlanRequest req = ssd_request(cfg);
    req.grads_on_ssd = grads_ssd;
    req.device_sum_squares = true;
    const Plan plan = make_plan(req);
    REQUIRE(plan.exact);
    const bool on_device = !plan.accum_fp32;
    CHECK(plan.device_sum_squares == on_device);
    CHECK(count_kind(plan, OpKind::kDeviceGradSumSq) == (on_device ? L + 2 : 0));
    CHECK(count_kind(plan, OpKind::kGradSumSq) == (on_device ? 0 : L + 2));
    for (const PlanOp& op : plan.ops) {
      if (op.kind != OpKind::kDeviceGradSumSq) continue;
      // On the compute queue, reading the gradient on the device after the last micro-batch's
      // backward made it.
      CHECK(op.resource == Resource::kCompute);
      CHECK(plan.buffers[op.use(Role::kSource).buffer].tier == Tier::kDevice);
      CHECK(op.micro == K - 1);
    }
    auto store = open_store(str("devsq", grads_ssd));
    require_bitwise(offloaded(cfg, plan, data, store.get(), streams), ref, true);
  }
}
