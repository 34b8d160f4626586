// Training end to end on the CPU backend: the schedule, determinism, a short run that must
// learn, and the run directory contract (metrics, weights, nothing overwritten).
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/model.h"
#include "fuyou/optim.h"
#include "fuyou/safetensors.h"
#include "fuyou/sizes.h"
#include "fuyou/train.h"

namespace fs = std::filesystem;
using namespace fuyou;
using Catch::Matchers::Contains;

namespace {

Config small_config(const std::string& text_dir) {
  return parse_config(
      "model: {n_layer: 2, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 256, seq_len: 32}\n"
      "data: {text: [" +
          text_dir +
          "], val_fraction: 0.1}\noptimizer: {lr: 3.0e-3, min_lr: 3.0e-4}\n"
          "schedule: {steps: 60, warmup_steps: 5, micro_batch: 8, grad_accum: 2, eval_every: 30, "
          "eval_batches: 4, log_every: 10}\n"
          "runtime: {backend: cpu, threads: 2, seed: 7}\n",
      "<test>");
}

std::string make_text_dir() {
  fs::path dir = fs::temp_directory_path() / ("fuyou-train-text-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream f(dir / "corpus.txt");
  const char* lines[] = {"the quick brown fox jumps over the lazy dog.\n",
                         "a journey of a thousand miles begins with a single step.\n",
                         "all that glitters is not gold.\n"};
  for (int i = 0; i < 300; ++i) f << lines[i % 3];
  return dir.string();
}

}  // namespace

TEST_CASE("learning rate: linear warmup then cosine to min_lr", "[train]") {
  OptimizerConfig o;
  o.lr = 1.0;
  o.min_lr = 0.1;
  ScheduleConfig s;
  s.steps = 10;
  s.warmup_steps = 4;
  CHECK(learning_rate(o, s, 0) == Approx(0.25));
  CHECK(learning_rate(o, s, 3) == Approx(1.0));
  CHECK(learning_rate(o, s, 4) == Approx(1.0));
  CHECK(learning_rate(o, s, 7) == Approx(0.1 + 0.45 * (1 + std::cos(M_PI * 0.5))));
  CHECK(learning_rate(o, s, 10) == Approx(0.1));
}

TEST_CASE("training is deterministic: same config, same losses and weights, bit for bit",
          "[train]") {
  std::string text = make_text_dir();
  Config cfg = small_config(text);
  cfg.schedule.steps = 4;
  auto run = [&](std::vector<float>* losses) {
    auto be = make_cpu_backend(2, 0);
    InMemoryStep r(cfg, *be);
    r.init_params();
    std::vector<int32_t> batch(cfg.schedule.micro_batch * (cfg.model.seq_len + 1));
    for (size_t i = 0; i < batch.size(); ++i) batch[i] = static_cast<int32_t>((i * 31 + 7) % 256);
    for (int s = 0; s < 4; ++s) losses->push_back(r.step(s, {batch.data(), batch.data()}).loss);
    return r.master();
  };
  std::vector<float> l1, l2;
  auto w1 = run(&l1);
  auto w2 = run(&l2);
  CHECK(l1 == l2);
  CHECK(std::memcmp(w1.data(), w2.data(), w1.size() * sizeof(float)) == 0);
}

TEST_CASE("a short run learns, writes metrics and weights, and refuses to overwrite", "[train]") {
  std::string text = make_text_dir();
  Config cfg = small_config(text);
  std::string run_dir =
      (fs::temp_directory_path() / ("fuyou-run-" + std::to_string(::getpid()))).string();
  fs::remove_all(run_dir);
  TrainOptions opts;
  opts.run_dir = run_dir;
  TrainSummary s = run_training(cfg, opts);
  INFO("validation loss " << s.first_val_loss << " -> " << s.final_val_loss);
  // Byte-level text starts near ln(256) = 5.5; this repetitive corpus must fall well below.
  CHECK(s.first_val_loss > 5.0);
  CHECK(s.final_val_loss < 0.6 * s.first_val_loss);

  int train_lines = 0, val_lines = 0;
  std::ifstream m(fs::path(run_dir) / "metrics.jsonl");
  for (std::string line; std::getline(m, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) ++val_lines;
    if (j.contains("loss")) ++train_lines;
  }
  CHECK(train_lines == 6);
  CHECK(val_lines == 3);  // steps 0, 30, 60
  SafetensorsReader w((fs::path(run_dir) / "model.safetensors").string());
  CHECK(w.has("h.1.mlp.c_proj.weight"));
  CHECK(fs::exists(fs::path(run_dir) / "config.yaml"));

  auto before = fs::last_write_time(fs::path(run_dir) / "model.safetensors");
  CHECK_THROWS_WITH(run_training(cfg, opts), Contains("refusing to overwrite"));
  CHECK(fs::last_write_time(fs::path(run_dir) / "model.safetensors") == before);
}

TEST_CASE("a device budget too small for the model is refused with the numbers", "[train]") {
  Config cfg = small_config(make_text_dir());
  auto be = make_cpu_backend(2, 64 * 1024);
  CHECK_THROWS_WITH(InMemoryStep(cfg, *be), Contains("offload.device_memory") && Contains("needs"));
}

// offload.host_memory used to be ignored unless the run was offloaded.
TEST_CASE("an in-memory run checks offload.host_memory before it starts", "[train]") {
  Config cfg = small_config(make_text_dir());
  auto be = make_cpu_backend(2, 0);
  REQUIRE_FALSE(wants_offload(cfg));
  const uint64_t need =
      in_memory_host_bytes(cfg.model, cfg.schedule.micro_batch, /*device_in_host=*/true, 4);
  // The estimate covers the state the in-memory engine holds: 16 bytes per parameter, plus
  // the arena the CPU backend allocates in host memory.
  CHECK(need > 16 * make_gpt_layout(cfg.model).total +
                   in_memory_device_bytes(cfg.model, cfg.schedule.micro_batch, 4));
  CHECK(in_memory_host_bytes(cfg.model, cfg.schedule.micro_batch, /*device_in_host=*/false, 4) <
        need);
  // The in-memory step (runtime.in_memory step) checks its estimate.
  cfg.runtime.in_memory = "step";
  cfg.offload.host_memory = need - 1;
  CHECK_THROWS_WITH(make_train_engine(cfg, *be),
                    Contains("in-memory training needs " + format_size(need)) &&
                        Contains("offload.host_memory is " + format_size(need - 1)) &&
                        Contains("offload.ssd_paths"));
  cfg.offload.host_memory = need;
  CHECK(make_train_engine(cfg, *be)->offloaded() == false);
  // The in-memory plan holds its own buffer table to it; a plan over it trains offloaded, and
  // without SSD that plan is refused with its figures.
  cfg.runtime.in_memory = "plan";
  cfg.offload.host_memory = 0;
  std::string why;
  const std::optional<Plan> plan = in_memory_plan(cfg, *be, 0, &why);
  REQUIRE(plan);
  const uint64_t plan_need = plan->memory.host_bytes;
  cfg.offload.host_memory = plan_need - 1;
  CHECK_THROWS_WITH(make_train_engine(cfg, *be),
                    Contains("host memory: the plan needs") &&
                        Contains("offload.host_memory is " + format_size(plan_need - 1)) &&
                        Contains("offload.ssd_paths"));
  cfg.offload.host_memory = plan_need;
  CHECK(make_train_engine(cfg, *be)->offloaded() == false);
}
