// fp16 GEMM inputs and dynamic loss scaling on the CPU backend: the emulated fp16 GEMM
// against an exact product of fp16-rounded inputs, overflow skipping steps (weights, Adam
// state and step count untouched) and backing the scale off, and the offloading scheduler's
// exact mode making the same decisions bit for bit.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "engine_run_support.h"
#include "fuyou/backend_select.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/rng.h"
#include "fuyou/scheduler.h"
#include "fuyou/train.h"
#include "kernels/common/element_math.h"
#include "kernels/cpu/gemm.h"
#include "storage_values.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;
using test::as_stored;

namespace {

Config fp16_config(double initial_scale, double clip, const char* device_tensors = "fp32") {
  return parse_config(
      str("model: {n_layer: 3, n_head: 2, d_model: 32, d_ff: 96, vocab_size: 64, seq_len: 16}\n"
          "optimizer: {lr: 3.0e-3, min_lr: 3.0e-4, grad_clip: ",
          clip, ", initial_loss_scale: ", initial_scale,
          "}\nschedule: {steps: 12, warmup_steps: 2, micro_batch: 4}\n"
          "runtime: {backend: cpu, threads: 2, seed: 5, precision: fp16, device_tensors: ",
          device_tensors, "}\n"),
      "<test>");
}

std::vector<std::vector<int32_t>> batches(const Config& cfg, int steps) {
  std::vector<std::vector<int32_t>> out(steps);
  for (int s = 0; s < steps; ++s) {
    Rng rng(17, s);
    out[s].resize(static_cast<size_t>(cfg.schedule.micro_batch) * (cfg.model.seq_len + 1));
    // A learnable stream (each token predicts the next as t+1 mod V), so loss must fall.
    int32_t t = static_cast<int32_t>(rng.below(cfg.model.vocab_size));
    for (auto& x : out[s]) x = t = (t + 1) % cfg.model.vocab_size;
  }
  return out;
}

}  // namespace

TEST_CASE("gemm_fp16 is the exact product of the fp16-rounded inputs up to fp32 accumulation",
          "[fp16]") {
  Rng rng(3);
  const int M = 19, N = 23, K = 157;
  std::vector<float> A(M * K), B(K * N), C(M * N);
  for (auto& x : A) x = rng.normal();
  for (auto& x : B) x = rng.normal();
  A[5] = 1.0e5f;  // past fp16's 65504: rounds to inf, as a GPU's fp16 input would
  cpu::gemm_fp16(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N);
  double worst = 0;
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      double exact = 0, mag = 0;
      for (int k = 0; k < K; ++k) {
        double p = static_cast<double>(as_stored(ElemType::kF16, A[i * K + k])) *
                   as_stored(ElemType::kF16, B[k * N + j]);
        exact += p;
        mag += std::fabs(p);
      }
      if (i == 0) {  // row 0 holds the overflowed input
        CHECK(!std::isfinite(C[j]));
        continue;
      }
      // fp16 x fp16 products are exact in fp32; the fp32 sum of K of them is within K u32 sum|p|.
      worst = std::max(worst, std::fabs(C[i * N + j] - exact) / (K * std::ldexp(1.0, -24) * mag));
    }
  CHECK(worst <= 1.0);
}

TEST_CASE("fp16 overflow skips the step, backs the loss scale off, and training goes on",
          "[fp16]") {
  // 2^24 overflows the fp16 rounding of the backward's dlogits (about scale / 64 per element
  // for 64 counted targets): steps are skipped and the scale halves until it fits.
  Config cfg = fp16_config(16777216.0, 0.0);
  cfg.optimizer.lr = 1e-2;
  cfg.schedule.steps = 24;
  const int kSteps = 24;
  auto data = batches(cfg, kSteps);
  auto be = make_cpu_backend(2, 0);
  apply_precision(*be, cfg.runtime);
  REQUIRE(be->matmul_precision() == MatmulPrecision::kFp16);
  InMemoryStep r(cfg, *be);
  r.init_params();
  int skipped = 0, applied = 0;
  bool prev_skipped = false;
  double prev_scale = 0;
  std::vector<float> losses;
  for (int s = 0; s < kSteps; ++s) {
    std::vector<float> before = r.master();
    auto res = r.step(s, {data[s].data()});
    losses.push_back(res.loss);
    if (prev_skipped) CHECK(res.loss_scale == prev_scale / 2);  // backed off after the overflow
    if (res.skipped) {
      ++skipped;
      CHECK(std::memcmp(before.data(), r.master().data(), 4 * before.size()) == 0);
      CHECK(!std::isfinite(res.grad_norm));
    } else {
      ++applied;
      CHECK(std::isfinite(res.grad_norm));
      CHECK(std::memcmp(before.data(), r.master().data(), 4 * before.size()) != 0);
    }
    prev_skipped = res.skipped;
    prev_scale = res.loss_scale;
  }
  INFO("skipped " << skipped << ", applied " << applied << ", final scale " << prev_scale
                  << ", loss " << losses.front() << " -> " << losses.back());
  CHECK(skipped >= 2);
  CHECK(applied >= kSteps / 2);
  CHECK(losses.back() < losses.front() - 0.5f);  // it learns once the scale fits
}

TEST_CASE("offloaded fp16 training, and AdamW on the device as a plan, skip and scale as in memory",
          "[fp16][scheduler][in_memory_plan]") {
  // fp16 GEMM inputs on fp32 tensors, and fp16 tensors as well (weights, activations and
  // gradients stored in fp16: the loss scale keeps the gradients in range).
  const char* tensors = GENERATE("fp32", "fp16");
  INFO("device tensors " << tensors);
  Config cfg = fp16_config(16777216.0, 1.0, tensors);
  auto data = batches(cfg, 8);
  auto ref_be = make_cpu_backend(2, 0);
  apply_precision(*ref_be, cfg.runtime);
  const test::EngineRun ref = test::in_memory_run(cfg, data, *ref_be);
  test::EngineRun off;
  {
    const std::string dir = test::fresh_test_dir("fp16");
    StoreConfig sc;
    sc.dirs = {dir};
    sc.stripe_unit = 64 * 1024;
    auto store = SsdStore::open(sc);
    PlanRequest req;
    req.model = cfg.model;
    req.micro_batch = cfg.schedule.micro_batch;
    req.tensors = device_tensor_type(cfg.runtime);
    req.exact = true;
    req.have_ssd = true;
    req.acts = {ActPlacement::kSsd, ActPlacement::kRecompute, ActPlacement::kHost};
    req.weights_on_ssd = true;
    req.optim_on_ssd = true;
    auto be = make_cpu_backend(2, 0);
    apply_precision(*be, cfg.runtime);
    PlanExecutor tr(cfg, *be, make_plan(req), store.get());
    off = test::offloaded_run(tr, data);
    store.reset();
    fs::remove_all(dir);
  }
  CHECK(off.skipped == ref.skipped);
  CHECK(off.loss_scales == ref.loss_scales);
  CHECK(std::count(ref.skipped.begin(), ref.skipped.end(), true) >= 2);
  test::require_bitwise(off, ref);  // every step's loss and every parameter

  // In memory as a plan with AdamW on the device: the skipped steps leave the device's state
  // and weights as they were (the device updates follow the norm's decision).
  cfg.optimizer.placement = "device";
  auto be = make_cpu_backend(2, 0);
  apply_precision(*be, cfg.runtime);
  auto engine = make_train_engine(cfg, *be);
  REQUIRE(engine->plan() != nullptr);
  REQUIRE(engine->plan()->device_optimizer);
  engine->init_params();
  test::EngineRun dev;
  for (size_t s = 0; s < data.size(); ++s)
    dev.record(engine->step(static_cast<int64_t>(s), {data[s].data()}));
  dev.params = test::engine_master(*engine, make_gpt_layout(cfg.model));
  CHECK(dev.skipped == ref.skipped);
  CHECK(dev.loss_scales == ref.loss_scales);
  test::require_bitwise(dev, ref);
}

TEST_CASE("an offloaded fp16 plan without exact mode is refused", "[fp16][scheduler]") {
  Config cfg = fp16_config(1024.0, 0.0);
  PlanRequest req;
  req.model = cfg.model;
  req.micro_batch = cfg.schedule.micro_batch;
  req.exact = false;
  auto be = make_cpu_backend(2, 0);
  apply_precision(*be, cfg.runtime);
  CHECK_THROWS_WITH(PlanExecutor(cfg, *be, make_plan(req), nullptr),
                    Catch::Matchers::Contains("exact"));
}
