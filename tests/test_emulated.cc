// The emulated device (runtime.backend: emulated, kernels/emulated/emulated_backend.h): kernels
// count the model's FLOPs and take the profile's time, copies take the PCIe time and follow
// CUDA's ordering rules, the host reads back NaN, and an offloaded run's compute and copy busy
// times are what the simulator gives the same plan.
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "fuyou/backend.h"
#include "fuyou/backend_select.h"
#include "fuyou/config.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/hardware.h"
#include "fuyou/model.h"
#include "fuyou/scheduler.h"
#include "fuyou/simulator.h"
#include "fuyou/timing.h"
#include "fuyou/train.h"
#include "kernels/emulated/emulated_backend.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;
using Catch::Matchers::Contains;
using clock_type = std::chrono::steady_clock;

namespace {

// A slow device, so that its times are long beside this machine's scheduling noise: one
// layer's forward of tiny_config() takes about 20 ms.
const char* kSlowGpu =
    "name: slow-gpu\nbackend: cuda\ncompute: {peak_tflops: 0.000036, element_bytes: 2, "
    "gemm_efficiency: [[64, 1.0]]}\n"
    "pcie: {h2d_GBps: 0.5, d2h_GBps: 0.25}\nssd: {read_GBps: 2.0, write_GBps: 1.0}\n"
    "optimizer: {params_per_s: 1.0e9}\nmemory: {device: 64MiB, host_bandwidth_GBps: 10}\n";

Config tiny_config() {
  return parse_config(
      "model: {n_layer: 2, n_head: 2, d_model: 32, d_ff: 96, vocab_size: 64, seq_len: 16}\n"
      "optimizer: {grad_clip: 0}\n"
      "schedule: {steps: 3, warmup_steps: 1, micro_batch: 2}\n"
      "runtime: {threads: 2, seed: 3}\n",
      "<test>");
}

emulated::EmulatedOptions slow_device(const Config& cfg, double scale = 1.0) {
  emulated::EmulatedOptions o;
  o.gpu = parse_hardware_profile(kSlowGpu, "<slow-gpu>");
  o.scale = scale;
  o.gemm_size = gemm_work_size(cfg.model, cfg.schedule.micro_batch);
  o.capacity = 256ull << 20;
  o.threads = 2;
  return o;
}

std::string store_dir(const std::string& tag) { return test::fresh_test_dir("emulated-" + tag); }

}  // namespace

TEST_CASE("emulated device: the model's kernels count its FLOPs and take the profile's time",
          "[emulated]") {
  Config cfg = tiny_config();
  emulated::EmulatedBackend be(slow_device(cfg, 2.0));
  CHECK_THAT(be.name(), Contains("emulated slow-gpu") && Contains("NaN"));
  CHECK_FALSE(be.device_is_host_memory());
  Transformer model(cfg.model, be, cfg.schedule.micro_batch);
  const int N = cfg.schedule.micro_batch * cfg.model.seq_len;
  std::vector<int32_t> tokens(N, 1);
  be.finish_compute();
  const auto t0 = clock_type::now();
  const float loss = model.forward(tokens.data(), tokens.data());
  model.backward(1.0f / N);
  const double queued = seconds_since(t0);
  be.finish_compute();
  const double elapsed = seconds_since(t0);
  // forward + backward = 3 forwards (model.h's count, which the planner's op FLOPs use too).
  const double flops = 3.0 * N * forward_flops_per_token(cfg.model);
  CHECK(be.flops_queued() == Approx(flops).epsilon(1e-12));
  // The profile's time at twice its throughput (scale 2); sleeping never ends early.
  const HardwareProfile hw = parse_hardware_profile(kSlowGpu, "<slow-gpu>");
  const double want =
      hw.compute_seconds(flops, gemm_work_size(cfg.model, cfg.schedule.micro_batch)) / 2.0;
  INFO("predicted " << want << " s, elapsed " << elapsed << " s (calls returned after " << queued
                    << " s)");
  CHECK(elapsed >= want * 0.999);
  CHECK(elapsed <= want * 1.5 + 0.05);
  CHECK(std::isnan(loss));  // read back from a device that holds no data
}

TEST_CASE("emulated device: copies take the PCIe time and follow CUDA's ordering rules",
          "[emulated]") {
  Config cfg = tiny_config();
  emulated::EmulatedBackend be(slow_device(cfg));
  const HardwareProfile hw = parse_hardware_profile(kSlowGpu, "<slow-gpu>");
  const size_t bytes = 16 << 20;  // 34 ms up, 67 ms down
  std::vector<char> host(bytes, 0);
  void* dev = be.alloc(bytes, "x");
  be.finish_compute();
  auto t0 = clock_type::now();
  be.copy_to_device(dev, host.data(), bytes);
  const double up = seconds_since(t0);
  t0 = clock_type::now();
  be.copy_to_host(host.data(), dev, bytes);
  const double down = seconds_since(t0);
  INFO("h2d " << up << " s (profile " << hw.h2d_seconds(bytes) << "), d2h " << down
              << " s (profile " << hw.d2h_seconds(bytes) << ")");
  CHECK(up >= hw.h2d_seconds(bytes) * 0.999);
  CHECK(up <= hw.h2d_seconds(bytes) * 1.5 + 0.05);
  CHECK(down >= hw.d2h_seconds(bytes) * 0.999);
  // No data comes back: NaN in every 4 KiB of what was copied.
  size_t nan_pages = 0;
  for (size_t off = 0; off < bytes; off += 4096) {
    float f;
    std::memcpy(&f, host.data() + off, 4);
    nan_pages += std::isnan(f);
  }
  CHECK(nan_pages == bytes / 4096);

  // Many small copies (an embedding's rows) take their emulated time, not a sleep's overshoot
  // each (about 50 us of timer slack: 0.5 s for these).
  const size_t row = 8192, rows = 10000;
  const double rows_time = rows * hw.h2d_seconds(row);  // 82 ms
  t0 = clock_type::now();
  for (size_t r = 0; r < rows; ++r) be.copy_to_device(dev, host.data(), row);
  const double rows_took = seconds_since(t0);
  INFO(rows << " copies of " << row << " bytes: " << rows_took << " s, profile " << rows_time
            << " s");
  CHECK(rows_took >= rows_time * 0.9);
  CHECK(rows_took <= rows_time * 2 + 0.05);

  // A copy waits for the compute queued before it, unless the caller orders the work.
  const int N = 512;
  const double gemm = hw.compute_seconds(2.0 * N * N * 64, slow_device(cfg).gemm_size);  // ~0.9 s
  REQUIRE(gemm > 0.5);
  be.matmul_forward(nullptr, nullptr, nullptr, nullptr, N, N, 64);
  be.set_caller_ordered(true);
  t0 = clock_type::now();
  be.copy_to_device(dev, host.data(), 4096);
  CHECK(seconds_since(t0) < gemm / 2);
  be.set_caller_ordered(false);
  be.copy_to_device(dev, host.data(), 4096);
  CHECK(seconds_since(t0) >= gemm * 0.99);
  be.free(dev);
  CHECK(be.memory().used == 0);
}

TEST_CASE(
    "an emulated offloaded run: real SSD and optimizer, the simulator's compute and copy times",
    "[emulated]") {
  Config cfg = tiny_config();
  cfg.offload.ssd_paths = {store_dir("run")};
  cfg.offload.weights = cfg.offload.optimizer_state = "ssd";
  cfg.offload.activations = ActivationPolicy::kSwap;
  emulated::EmulatedBackend be(slow_device(cfg));
  auto engine = make_train_engine(cfg, be);
  REQUIRE(engine->offloaded());
  const Plan& plan = *engine->plan();
  CHECK_FALSE(plan.memory.device_in_host);  // the emulated arena is not host memory
  engine->init_params();
  const int N = cfg.schedule.micro_batch * (cfg.model.seq_len + 1);
  std::vector<int32_t> batch(N, 5);
  StepResult last;
  for (int s = 0; s < 3; ++s) {
    last = engine->step(s, {batch.data()});
    CHECK(std::isnan(last.loss));
  }
  // The simulator's busy times for this plan on the emulated GPU (compute and PCIe do not
  // depend on the host half of the machine).
  const HardwareProfile gpu = parse_hardware_profile(kSlowGpu, "<slow-gpu>");
  const SimResult sim = simulate(plan, emulated_machine(gpu, 1.0, gpu));
  for (Resource r : {Resource::kCompute, Resource::kH2D, Resource::kD2H}) {
    const double got = last.busy_s[static_cast<int>(r)], want = sim.busy_s[static_cast<int>(r)];
    // An op may end up to the device's sleep slack (100 us) early.
    const auto ops = std::count_if(plan.ops.begin(), plan.ops.end(),
                                   [&](const PlanOp& op) { return op.resource == r; });
    INFO(resource_name(r) << ": measured busy " << got << " s, simulated " << want << " s, " << ops
                          << " ops");
    CHECK(got >= want * 0.99 - 100e-6 * ops);
    CHECK(got <= want * 1.3 + 0.03);
  }
  CHECK(last.ssd_read_bytes > 0);  // the store ran for real
  // `fuyou-bench plan` shows the plan the engine runs: train_plan on the same backend.
  const Plan again = train_plan(cfg, be);
  CHECK(again.to_json() == plan.to_json());
  CHECK(again.listing() == plan.listing());
  // On the CPU backend the same config plans otherwise: its device is host memory.
  auto cpu = make_cpu_backend(2, 0);
  CHECK(train_plan(cfg, *cpu).memory.device_in_host);
}

TEST_CASE("an emulated run's automatic placement plans on the machine as emulated where given",
          "[emulated]") {
  // offload.hardware names the GPU; the machine the run is on has this machine's disks and
  // optimizer (here: a disk 5000x slower than the GPU profile's). The search runs on the
  // profile it is given: its predicted step is that profile's period for the plan it chose.
  const std::string dir = store_dir("placement");
  { std::ofstream(dir + "/gpu.yaml") << kSlowGpu; }
  Config cfg = tiny_config();
  cfg.offload.ssd_paths = {dir};
  cfg.offload.weights = cfg.offload.optimizer_state = "ssd";
  cfg.offload.hardware = dir + "/gpu.yaml";
  REQUIRE(cfg.offload.activations == ActivationPolicy::kAuto);
  emulated::EmulatedBackend be(slow_device(cfg));
  const HardwareProfile gpu = load_hardware_profile(cfg.offload.hardware);
  HardwareProfile host = gpu;
  host.name = "slow-disk host";
  host.ssd_read_Bps /= 5000;
  host.ssd_write_Bps /= 5000;
  const HardwareProfile here = emulated_machine(gpu, 1.0, host);
  double on_gpu = 0, on_here = 0;
  const Plan a = train_plan(cfg, be, &on_gpu);
  const Plan b = train_plan(cfg, be, &on_here, &here);
  CHECK(on_gpu == simulate(a, gpu).period_s);
  CHECK(on_here == simulate(b, here).period_s);
  INFO("predicted step on the GPU profile " << on_gpu << " s, on the machine as emulated "
                                            << on_here << " s");
  CHECK(on_here > 2 * on_gpu);  // the slow disk binds
  // Exact mode (clipping): the sums of squares stay on the optimizer's thread, whatever GPU the
  // profile describes, since the emulated backend has no kernel to run them on its device.
  cfg.optimizer.grad_clip = 1.0;
  CHECK_FALSE(be.supports_device_optimizer());
  CHECK_FALSE(train_plan(cfg, be).device_sum_squares);
  CHECK_FALSE(train_plan(cfg, be, nullptr, &here).device_sum_squares);
}

TEST_CASE("the emulated backend is selected by config, and never trains", "[emulated]") {
  CHECK_THROWS_WITH(parse_config("runtime: {backend: emulated}\n", "<test>"),
                    Contains("offload.hardware"));
  std::string dir = store_dir("cfg");
  { std::ofstream(dir + "/gpu.yaml") << kSlowGpu; }
  Config cfg = parse_config(str("offload: {hardware: ", dir,
                                "/gpu.yaml}\nruntime: {backend: emulated, emulated_scale: 0.5}\n"),
                            "<test>");
  std::string why;
  auto be = make_backend(cfg, &why);
  CHECK(be->kind() == BackendKind::kEmulated);
  CHECK_THAT(why, Contains("emulated") && Contains("NaN"));
  CHECK(be->matmul_precision() == MatmulPrecision::kBf16);
  CHECK_THROWS_WITH(be->set_matmul_precision(MatmulPrecision::kFp16), Contains("fp16"));
  TrainOptions opts;
  opts.run_dir = dir + "/run";
  CHECK_THROWS_WITH(run_training(cfg, opts), Contains("emulated") && Contains("fuyou-bench train"));
  CHECK_FALSE(fs::exists(opts.run_dir));
}
