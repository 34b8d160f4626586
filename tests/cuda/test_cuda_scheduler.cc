// The offloading executor on the CUDA backend: caller-ordered copies on their own streams,
// page-locked host buffers and the executor's worker threads, checked as on the CPU backend:
// offloaded training equals in-memory training bit for bit, with weights, optimizer state and
// activation checkpoints on SSD, in fp32, with bf16 GEMM inputs and with bf16 device tensors,
// plain and in exact (clipping) mode, and with three micro-batches per step summed in fp32 on
// the host (the sums held on SSD in the SSD plan); and in memory as a plan, AdamW on the host
// and on the device.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "../engine_run_support.h"
#include "fuyou/backend_select.h"
#include "fuyou/config.h"
#include "fuyou/cuda.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/rng.h"
#include "fuyou/scheduler.h"
#include "fuyou/storage.h"
#include "fuyou/train.h"

namespace fs = std::filesystem;
using namespace fuyou;

namespace {

Config tiny_config(double clip, const std::string& precision, const std::string& device_tensors,
                   int head_chunk, int grad_accum) {
  return parse_config(
      str("model: {n_layer: 4, n_head: 2, d_model: 64, d_ff: 256, vocab_size: 96, seq_len: 32, "
          "head_chunk_tokens: ",
          head_chunk, "}\noptimizer: {lr: 3.0e-3, min_lr: 3.0e-4, grad_clip: ", clip,
          "}\nschedule: {steps: 5, warmup_steps: 2, micro_batch: 2, grad_accum: ", grad_accum,
          "}\nruntime: {backend: cuda, precision: ", precision,
          ", device_tensors: ", device_tensors, ", threads: 2, seed: 11}\n"),
      "<test>");
}

// A fresh store directory on a disk that takes O_DIRECT: under $FUYOU_TEST_DATA where set
// (tools/gpu-validate.sh sets it), else under the build directory.
std::string store_dir(const std::string& tag) {
  const char* env = std::getenv("FUYOU_TEST_DATA");
  fs::path base = env && *env ? fs::path(env) : fs::path(FUYOU_BINARY_DIR) / "test-data";
  fs::path p = base / ("cuda-sched-" + tag + "-" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

using Run = test::EngineRun;
using test::require_bitwise;

std::unique_ptr<Backend> cuda_backend(const Config& cfg, uint64_t device_budget) {
  auto be = make_cuda_backend(0, device_budget);
  apply_precision(*be, cfg.runtime);
  return be;
}

// Step s's grad_accum micro-batches.
std::vector<const int32_t*> step_batches(const Config& cfg,
                                         const std::vector<std::vector<int32_t>>& data, size_t s) {
  std::vector<const int32_t*> out;
  for (int k = 0; k < cfg.schedule.grad_accum; ++k)
    out.push_back(data[s * cfg.schedule.grad_accum + k].data());
  return out;
}

Run in_memory(const Config& cfg, const std::vector<std::vector<int32_t>>& data) {
  auto be = cuda_backend(cfg, 256ull << 20);
  InMemoryStep r(cfg, *be);
  r.init_params();
  Run out;
  for (size_t s = 0; s < data.size() / cfg.schedule.grad_accum; ++s)
    out.losses.push_back(r.step(static_cast<int64_t>(s), step_batches(cfg, data, s)).loss);
  out.params = r.master();
  return out;
}

Run offloaded(const Config& cfg, const PlanRequest& req,
              const std::vector<std::vector<int32_t>>& data, SsdStore* store) {
  auto be = cuda_backend(cfg, req.device_budget ? req.device_budget : 256ull << 20);
  PlanExecutor tr(cfg, *be, make_plan(req), store);
  ParamLayout layout = make_gpt_layout(cfg.model);
  std::vector<float> init(layout.total);
  init_gpt_params(cfg.model, layout, init.data());
  tr.set_params(init.data());
  Run out;
  for (size_t s = 0; s < data.size() / cfg.schedule.grad_accum; ++s)
    out.losses.push_back(tr.step(static_cast<int64_t>(s), step_batches(cfg, data, s)).loss);
  out.params.resize(layout.total);
  tr.read_params(out.params.data());
  return out;
}

// In memory as a plan (make_train_engine), AdamW at `placement`: host (its gradients down and
// its weights up beside the compute) or device (Plan::device_optimizer: nothing crosses the
// bus); the fp32 master read back group by group.
Run in_memory_plan_run(Config cfg, const char* placement,
                       const std::vector<std::vector<int32_t>>& data) {
  cfg.optimizer.placement = placement;
  auto be = cuda_backend(cfg, 256ull << 20);
  auto engine = make_train_engine(cfg, *be);
  REQUIRE(engine->plan() != nullptr);
  REQUIRE(engine->plan()->resident_weights);
  REQUIRE(engine->plan()->device_optimizer == (std::string(placement) == "device"));
  engine->init_params();
  Run out;
  for (size_t s = 0; s < data.size() / cfg.schedule.grad_accum; ++s)
    out.losses.push_back(engine->step(static_cast<int64_t>(s), step_batches(cfg, data, s)).loss);
  out.params = test::engine_master(*engine, make_gpt_layout(cfg.model));
  return out;
}

}  // namespace

TEST_CASE("cuda: offloaded training is bitwise equal to in-memory training", "[cuda][scheduler]") {
  // GEMM precision and device tensors: fp32 throughout, bf16 GEMMs on fp32 tensors, and the
  // large-model recipe (bf16 tensors: 16-bit weights, gradients and checkpoints moved), also
  // with the LM head in chunks of 20 of the micro-batch's 64 tokens (the gpt3-175b configs').
  struct Mode {
    const char *precision, *device_tensors;
    int head_chunk, grad_accum;
  };
  for (const Mode& m :
       {Mode{"fp32", "fp32", 0, 1}, Mode{"bf16", "fp32", 0, 1}, Mode{"bf16", "bf16", 0, 1},
        Mode{"bf16", "bf16", 20, 1}, Mode{"bf16", "bf16", 0, 3}}) {
    for (double clip : {0.0, 0.5}) {
      INFO("precision " << m.precision << ", device tensors " << m.device_tensors << ", head chunk "
                        << m.head_chunk << ", grad_accum " << m.grad_accum << ", clip " << clip);
      Config cfg = tiny_config(clip, m.precision, m.device_tensors, m.head_chunk, m.grad_accum);
      auto data = test::random_batches(cfg, 5 * m.grad_accum, 77);
      Run ref = in_memory(cfg, data);

      // Everything on SSD: weights, optimizer state, and every kind of activation placement
      // (a checkpoint on SSD, recomputed, on the host, on the device).
      PlanRequest req;
      req.model = cfg.model;
      req.micro_batch = cfg.schedule.micro_batch;
      req.tensors = device_tensor_type(cfg.runtime);
      req.exact = clip > 0;
      req.grad_accum = m.grad_accum;
      req.accum_fp32 = sums_grads_in_fp32(cfg);
      req.grads_on_ssd = m.grad_accum > 1;
      req.have_ssd = true;
      REQUIRE(make_plan(req).accum_fp32 == (m.grad_accum > 1));
      req.acts = {ActPlacement::kSsd, ActPlacement::kRecompute, ActPlacement::kHost,
                  ActPlacement::kDevice};
      req.weights_on_ssd = req.optim_on_ssd = true;
      StoreConfig sc;
      sc.dirs = {store_dir("a"), store_dir("b")};
      sc.stripe_unit = 64 * 1024;
      auto store = SsdStore::open(sc);
      require_bitwise(offloaded(cfg, req, data, store.get()), ref);

      // All in host memory, no store: the copy streams and page-locked buffers alone.
      PlanRequest host = req;
      host.have_ssd = false;
      host.weights_on_ssd = host.optim_on_ssd = host.grads_on_ssd = false;
      host.acts = {ActPlacement::kHost, ActPlacement::kHost, ActPlacement::kRecompute,
                   ActPlacement::kKeep};
      require_bitwise(offloaded(cfg, host, data, nullptr), ref);
      for (const auto& d : sc.dirs) fs::remove_all(d);

      // In memory as a plan, AdamW on the host and on the device.
      for (const char* placement : {"host", "device"}) {
        INFO("in memory as a plan, optimizer.placement " << placement);
        require_bitwise(in_memory_plan_run(cfg, placement, data), ref);
      }
    }
  }
}
