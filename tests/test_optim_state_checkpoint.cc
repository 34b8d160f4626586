// Checkpoints of packed optimizer state: a resume in the same format continues bit for bit, in
// memory and offloaded (the checkpoint keeps the moments as stored, per group); a resume in
// another format converts them (fp32 -> int8 and int8 -> fp32), and the files say what they hold.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "fuyou/checkpoint.h"
#include "fuyou/config.h"
#include "fuyou/error.h"
#include "fuyou/model.h"
#include "fuyou/safetensors.h"
#include "fuyou/train.h"
#include "run_dir_support.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;

namespace {

struct Scratch : test::RunScratch {
  explicit Scratch(const std::string& name) : RunScratch("optstate-ckpt", name, 1) {}
};
using test::check_resumes_both_ways;
using test::resume;
using test::state_at;
using test::train;

Config config(const Scratch& s, const std::string& state, const std::string& master) {
  return parse_config(
      str("model: {n_layer: 3, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 256, seq_len: 16}\n"
          "data: {text: [",
          (s.root / "corpus.txt").string(),
          "], val_fraction: 0.1}\noptimizer: {lr: 3.0e-3, min_lr: 3.0e-4, state: ", state,
          ", master: ", master,
          "}\nschedule: {steps: 6, warmup_steps: 2, micro_batch: 2, eval_every: 3, eval_batches: "
          "2}\nruntime: {backend: cpu, threads: 2, seed: 11, device_tensors: bf16}\n"
          "checkpoint: {every_steps: 3, keep: 10}\n"),
      "<test>");
}

}  // namespace

TEST_CASE("packed optimizer state resumes bit for bit, in memory and offloaded",
          "[optim_state][checkpoint]") {
  // Every packed format (fp32 / fp32, the reference: tests/test_checkpoint.cc).
  const auto [state, master] = GENERATE(std::pair<std::string, std::string>{"int8", "split"},
                                        std::pair<std::string, std::string>{"int8", "fp32"},
                                        std::pair<std::string, std::string>{"bf16", "split"},
                                        std::pair<std::string, std::string>{"bf16", "fp32"},
                                        std::pair<std::string, std::string>{"fp32", "split"});
  INFO("state " << state << ", master " << master);
  Scratch s("resume");
  const Config cfg = config(s, state, master);
  train(cfg, s.run("mem"));
  // The checkpoint says its format and keeps the moments as stored, per group.
  const std::string ck3 = s.run("mem") + "/checkpoints/step-3";
  const CheckpointManifest m = read_checkpoint_manifest(ck3);
  CHECK(m.optim_format == optim_format(cfg.optimizer));
  SafetensorsReader opt(ck3 + "/" + kOptimizerFile);
  if (state == "fp32") {  // fp32 moments stay per tensor (a split master changes only the master)
    CHECK_FALSE(opt.has("adam_m.layer.0"));
  } else {
    REQUIRE(opt.has("adam_m.layer.0"));
    CHECK(opt.info("adam_m.layer.0").dtype == (state == "int8" ? StDtype::kU8 : StDtype::kBF16));
    CHECK(opt.has("adam_v.layer.0.scale") == (state == "int8"));
  }
  // Resumed in memory; offloaded with weights, state and checkpoints on SSD: the same weights,
  // and its resume too.
  check_resumes_both_ways(s, cfg, "mem", 6, {.in_memory = 3, .offloaded = 3});
  // A damaged group is refused naming it (the packed entries are checksummed like the others).
  {
    const std::string path = ck3 + "/" + kOptimizerFile;
    SafetensorsReader r(path);
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    uint64_t header = 0;  // the data follows the 8-byte length and the JSON header
    f.read(reinterpret_cast<char*>(&header), 8);
    // Packed moments are one entry per group; fp32 ones one per tensor (layer 1's first).
    std::string entry = "adam_v.layer.1";
    if (state == "fp32") {
      const ParamLayout layout = make_gpt_layout(cfg.model);
      for (const auto& t : layout.tensors)
        if (layout.groups[t.group].name == "layer.1") {
          entry = "adam_v." + t.name;
          break;
        }
    }
    const uint64_t at = 8 + header + r.info(entry).begin + 3;
    f.seekp(static_cast<std::streamoff>(at));
    char c = 0x5a;
    f.write(&c, 1);
  }
  CHECK_THROWS_WITH(resume(ck3, s.run("damaged")), Catch::Matchers::Contains("layer.1"));
}

TEST_CASE("a resume in another state format converts the moments", "[optim_state][checkpoint]") {
  Scratch s("convert");
  const Config f32 = config(s, "fp32", "fp32");
  train(f32, s.run("fp32"));
  // fp32 -> int8 with a split master: the master exactly (hi + remainder), the moments
  // rounded to nearest; training goes on.
  const TrainSummary a = resume(s.run("fp32") + "/checkpoints/step-3", s.run("to-int8"),
                                {"optimizer.state=int8", "optimizer.master=split"});
  CHECK(std::isfinite(a.final_val_loss));
  const auto st = state_at(s.run("to-int8"), 6);
  CHECK(st.count("adam_m.layer.0"));
  CHECK(st.count("adam_m.layer.0.scale"));
  // int8 -> fp32: decoded; the run's moments are fp32 tensors again.
  const TrainSummary b =
      resume(s.run("to-int8") + "/checkpoints/step-6", s.run("back"),
             {"optimizer.state=fp32", "optimizer.master=fp32", "schedule.steps=8"});
  CHECK(std::isfinite(b.final_val_loss));
  CHECK(state_at(s.run("back"), 8).count("adam_m." + make_gpt_layout(f32.model).tensors[0].name));
  // The preflight's and --dry-run's estimates follow the format: each covers what was written
  // (within its header slack), and the estimates differ by what the written checkpoints differ by.
  auto dir_bytes = [](const fs::path& d) {
    uint64_t n = 0;
    for (const auto& e : fs::directory_iterator(d)) n += fs::file_size(e.path());
    return n;
  };
  const Config i8 = config(s, "int8", "split");
  const uint64_t w32 = dir_bytes(fs::path(s.run("fp32")) / "checkpoints" / "step-3");
  const uint64_t w8 = dir_bytes(fs::path(s.run("to-int8")) / "checkpoints" / "step-6");
  const uint64_t e32 = checkpoint_bytes(f32.model, optim_format(f32.optimizer));
  const uint64_t e8 = checkpoint_bytes(i8.model, optim_format(i8.optimizer));
  INFO("written " << w32 << " / " << w8 << ", estimated " << e32 << " / " << e8);
  CHECK(w32 <= e32);
  CHECK(w8 <= e8);
  REQUIRE(w32 > w8);
  const double ratio = static_cast<double>(e32 - e8) / static_cast<double>(w32 - w8);
  CHECK(ratio > 0.9);
  CHECK(ratio < 1.1);
  CHECK(fs::file_size(fs::path(s.run("fp32")) / "model.safetensors") <=
        weights_file_bytes(f32.model));
}
