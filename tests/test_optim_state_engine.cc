// Packed optimizer state in the engines: offloaded training equals in-memory training bit for
// bit in every format (state in host memory and streamed from SSD, weights read back from SSD
// into the update's slot for a split master, exact mode), the simulator charges the bytes the
// executor moves, the planner counts the formats' bytes, and the refusals.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>

#include "engine_run_support.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/rng.h"
#include "fuyou/scheduler.h"
#include "fuyou/simulator.h"
#include "fuyou/sizes.h"
#include "fuyou/train.h"
#include "plan_support.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;
using Catch::Matchers::Contains;

namespace {

Config packed_config(const std::string& state, const std::string& master, double clip) {
  return parse_config(
      str("model: {n_layer: 4, n_head: 2, d_model: 32, d_ff: 96, vocab_size: 64, seq_len: 16}\n"
          "optimizer: {lr: 3.0e-3, min_lr: 3.0e-4, grad_clip: ",
          clip, ", state: ", state, ", master: ", master,
          "}\nschedule: {steps: 5, warmup_steps: 2, micro_batch: 2}\n"
          "runtime: {backend: cpu, threads: 2, seed: 11, device_tensors: bf16}\n"),
      "<test>");
}

std::string store_dir(const std::string& tag) { return test::fresh_test_dir("optstate-" + tag); }

using Run = test::EngineRun;
using test::require_bitwise;

Run in_memory(const Config& cfg, const std::vector<std::vector<int32_t>>& data) {
  return test::in_memory_run(cfg, data, ElemType::kBF16);
}

Run offloaded(const Config& cfg, const PlanRequest& req,
              const std::vector<std::vector<int32_t>>& data, SsdStore* store) {
  auto be = make_cpu_backend(2, req.device_budget);
  be->set_storage_type(req.tensors);
  PlanExecutor tr(cfg, *be, make_plan(req), store);
  return test::offloaded_run(tr, data);
}

int count_ops(const Plan& p, OpKind k, BufferKind dest) {
  int n = 0;
  for (const PlanOp& o : p.ops)
    if (o.kind == k && p.buffers[o.use(Role::kDest).buffer].kind == dest) ++n;
  return n;
}

}  // namespace

TEST_CASE("packed optimizer state: offloaded training equals in-memory training bit for bit",
          "[optim_state]") {
  const std::string state = GENERATE("bf16", "int8", "fp32");
  const std::string master = GENERATE("fp32", "split");
  if (state == "fp32" && master == "fp32") return;  // the reference format: tests/test_scheduler.cc
  for (double clip : {0.0, 0.5}) {
    INFO("state " << state << ", master " << master << ", clip " << clip);
    Config cfg = packed_config(state, master, clip);
    auto data = test::random_batches(cfg, 5, 91);
    const Run ref = in_memory(cfg, data);
    // The format moves the weights: the last step's differ from the first's.
    PlanRequest req = plan_request(cfg);
    req.have_ssd = true;
    req.acts = {ActPlacement::kSsd, ActPlacement::kRecompute, ActPlacement::kHost,
                ActPlacement::kKeep};
    req.weights_on_ssd = req.optim_on_ssd = true;
    // Two weights-out slots: the higher layers' weights are read back from SSD, and a split
    // master's update first reads its layer's weights into the slot it rewrites.
    req = test::with_wout_slots(req, 2);
    const Plan p = make_plan(req);
    CHECK(p.optim_format == optim_format(cfg.optimizer));
    const int refills = count_ops(p, OpKind::kReadWeights, BufferKind::kWoutSlot);
    if (master == "split")
      CHECK(refills >= cfg.model.n_layer - (clip > 0 ? 0 : 2));
    else
      CHECK(refills == 0);
    StoreConfig sc;
    sc.dirs = {store_dir("a"), store_dir("b")};
    sc.stripe_unit = 64 * 1024;
    auto store = SsdStore::open(sc);
    require_bitwise(offloaded(cfg, req, data, store.get()), ref);
    CHECK(store->stats().unverified_bytes == 0);
    // Everything in host memory, the embedding's update in three parts (int8: on whole blocks;
    // rows first is not used with int8 blocks).
    PlanRequest host = plan_request(cfg);
    host.embed_parts = 3;
    host.embed_rows_first = true;
    const Plan hp = make_plan(host);
    CHECK(hp.embed_rows_first == (clip == 0 && state != "int8"));
    require_bitwise(offloaded(cfg, host, data, nullptr), ref);
  }
}

TEST_CASE("packed optimizer state: the simulator charges the bytes the executor moves",
          "[optim_state][simulator]") {
  const std::string state = GENERATE("int8", "bf16");
  Config cfg = packed_config(state, "split", 0.0);
  auto store = SsdStore::open({{store_dir("traffic")}});
  auto be = make_cpu_backend(2, 0);
  be->set_storage_type(ElemType::kBF16);
  PlanRequest req = plan_request(cfg);
  req.have_ssd = true;
  req.acts.assign(cfg.model.n_layer, ActPlacement::kSsd);
  req.weights_on_ssd = req.optim_on_ssd = true;
  req = test::with_wout_slots(req, 2);
  PlanExecutor tr(cfg, *be, make_plan(req), store.get());
  const Plan& plan = tr.plan();
  ParamLayout layout = make_gpt_layout(cfg.model);
  std::vector<float> init(layout.total);
  init_gpt_params(cfg.model, layout, init.data());
  tr.set_params(init.data());
  auto data = test::random_batches(cfg, 2, 91);
  std::mutex mu;
  std::vector<std::vector<OpTraffic>> moved(2, std::vector<OpTraffic>(plan.ops.size()));
  std::vector<std::vector<int>> ran(2, std::vector<int>(plan.ops.size(), 0));
  tr.on_op_done = [&](int64_t step, const PlanOp& op, const OpTraffic& t) {
    std::lock_guard<std::mutex> lock(mu);
    moved[step][op.id] = t;
    ++ran[step][op.id];
  };
  for (int s = 0; s < 2; ++s) tr.step(s, data[s].data());
  auto all_ran = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return std::all_of(ran[1].begin(), ran[1].end(), [](int n) { return n > 0; });
  };
  for (int ms = 0; !all_ran() && ms < 20000; ++ms)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  uint64_t state_read = 0;
  for (int s = 0; s < 2; ++s)
    for (const PlanOp& op : plan.ops) {
      const OpTraffic want = op_traffic(plan, op), got = moved[s][op.id];
      INFO("step " << s << ", op " << op.id << " (" << op_kind_name(op.kind) << " group "
                   << op.group << "): simulator " << want.ssd_read << " / " << want.ssd_write
                   << ", executor " << got.ssd_read << " / " << got.ssd_write);
      REQUIRE(ran[s][op.id] == 1);
      CHECK(got == want);
      if (op.kind == OpKind::kUpdate) state_read += got.ssd_read;
    }
  // The update streams the packed bytes: a layer's remainders (2 B), moments (1 or 2 B each)
  // and int8 scales, each request in whole 4 KiB blocks.
  uint64_t want_state = 0;
  for (const ParamGroup& g : layout.groups)
    want_state += 2 * ooc_update_io_bytes(optim_format(cfg.optimizer), g.numel);
  CHECK(state_read == want_state);
}

TEST_CASE("packed optimizer state: the planner and the optimizer count its bytes per parameter",
          "[optim_state]") {
  const uint64_t n = 10 * 1024 * 1024 + 300;  // more than one chunk, a ragged block
  const OptimFormat f32{}, bf16{MomentFormat::kBF16, MasterFormat::kF32},
      int8s{MomentFormat::kInt8, MasterFormat::kSplit};
  CHECK(optim_state_bytes(f32, n) == 12 * n);
  CHECK(optim_state_bytes(bf16, n) == 8 * n);
  // Remainder 2 B, two codes, two fp32 scales per 256 elements.
  CHECK(optim_state_bytes(int8s, n) == 4 * n + 8 * state_blocks(n));
  // The store: each kind's values and scales in whole 4 KiB blocks; an update moves them all.
  const uint64_t C = 1 << 20;
  CHECK(ooc_update_io_bytes(f32, n) == 3 * round_up(4 * n, kIoAlign));
  uint64_t want = 0;
  for (uint64_t b = 0; b < n; b += C) {
    const uint64_t k = std::min(C, n - b);
    want += round_up(2 * k, kIoAlign) +
            2 * (round_up(k, kIoAlign) + round_up(4 * state_blocks(k), kIoAlign));
  }
  CHECK(ooc_update_io_bytes(int8s, n) == want);
  // A plan with every group's state on SSD holds those extents; in host memory, the buffers.
  Config cfg = packed_config("int8", "split", 0.0);
  PlanRequest req = plan_request(cfg);
  req.have_ssd = req.optim_on_ssd = true;
  const Plan p = make_plan(req);
  const ParamLayout layout = make_gpt_layout(cfg.model);
  uint64_t ssd = 0;
  for (const ParamGroup& g : layout.groups) ssd += ooc_state_extent_bytes(int8s, g.numel);
  uint64_t ssd_optim = 0;
  for (const PlanBuffer& b : p.buffers)
    if (b.kind == BufferKind::kSsdOptim) ssd_optim += b.bytes;
  CHECK(ssd_optim == ssd);
  const Plan h = make_plan(plan_request(cfg));
  uint64_t host_optim = 0;
  for (const PlanBuffer& b : h.buffers)
    if (b.kind == BufferKind::kHostOptim) host_optim += b.bytes;
  uint64_t want_host = 0;
  for (const ParamGroup& g : layout.groups) want_host += optim_state_bytes(int8s, g.numel);
  CHECK(host_optim == want_host);
}

TEST_CASE("packed optimizer state: refusals name the key", "[optim_state]") {
  // A split master needs bf16 working weights.
  Config cfg = packed_config("int8", "split", 0.0);
  cfg.runtime.device_tensors = "fp32";
  auto be = make_cpu_backend(2, 0);
  REQUIRE_THROWS_WITH(InMemoryStep(cfg, *be),
                      Contains("optimizer.master is split") && Contains("device_tensors: bf16"));
  // The device's optimizer keeps fp32 state only.
  Config dev = packed_config("int8", "fp32", 0.0);
  dev.optimizer.placement = "device";
  auto be16 = make_cpu_backend(2, 0);
  be16->set_storage_type(ElemType::kBF16);
  REQUIRE_THROWS_WITH(InMemoryStep(dev, *be16), Contains("optimizer.placement is device") &&
                                                    Contains("optimizer.state int8"));
  // Unknown values.
  REQUIRE_THROWS_WITH(parse_config("optimizer: {state: fp8}\n", "<test>"),
                      Contains("state") && Contains("fp8"));
  REQUIRE_THROWS_WITH(parse_config("optimizer: {master: bf16}\n", "<test>"),
                      Contains("master") && Contains("bf16"));
}
