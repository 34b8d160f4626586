// Helpers shared by the tests that train through fuyou-train's run (run_training) and compare
// run directories: a scratch directory with a small corpus and SSD folders, training and
// resuming, reading back what a run wrote (its metrics, tensors and checkpoints), and the
// checks that a resumed or offloaded run matches the run it repeats, bit for bit.
#pragma once

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fuyou/checkpoint.h"
#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/rng.h"
#include "fuyou/safetensors.h"
#include "fuyou/train.h"
#include "test_support.h"

namespace fuyou::test {

// A fresh directory under the build tree (O_DIRECT works there) holding corpus.txt (200
// lines of three proverbs) and `ssd_dirs` empty folders ssd0, ssd1, ...; removed at the end.
struct RunScratch {
  std::filesystem::path root;
  int ssd_dirs;
  RunScratch(const std::string& prefix, const std::string& name, int ssd_dirs_ = 1)
      : root(fresh_test_dir(prefix + "-" + name)), ssd_dirs(ssd_dirs_) {
    for (int i = 0; i < ssd_dirs; ++i) std::filesystem::create_directories(ssd(i));
    std::ofstream f(root / "corpus.txt");
    const char* lines[] = {"the quick brown fox jumps over the lazy dog.\n",
                           "all that glitters is not gold.\n",
                           "a journey of a thousand miles begins with a single step.\n"};
    for (int i = 0; i < 200; ++i) f << lines[i % 3];
  }
  ~RunScratch() {
    std::error_code ec;
    std::filesystem::remove_all(root, ec);
  }
  RunScratch(const RunScratch&) = delete;
  RunScratch& operator=(const RunScratch&) = delete;
  std::string run(const std::string& name) const { return (root / name).string(); }
  std::string corpus() const { return (root / "corpus.txt").string(); }
  std::filesystem::path ssd(int i) const { return root / ("ssd" + std::to_string(i)); }
  std::vector<std::string> ssd_paths() const {
    std::vector<std::string> out;
    for (int i = 0; i < ssd_dirs; ++i) out.push_back(ssd(i).string());
    return out;
  }
  // The SSD folders as a YAML list, for --set offload.ssd_paths=...
  std::string ssd_list() const {
    std::string out = "[";
    for (int i = 0; i < ssd_dirs; ++i) out += (i ? ", " : "") + ssd(i).string();
    return out + "]";
  }
  bool ssd_empty() const {
    for (int i = 0; i < ssd_dirs; ++i)
      if (!std::filesystem::is_empty(ssd(i))) return false;
    return true;
  }
};

// A shard of random tokens below `vocab`, its header saying `vocab` (validation on it is worse
// than on the pattern).
inline std::string random_shard(const std::string& path, int vocab, size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng.below(vocab));
  write_token_shard(path, t, vocab);
  return path;
}

// A learnable shard: a short cycle of tokens.
inline std::string pattern_shard(const std::string& path, int vocab, size_t n) {
  std::vector<int32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>(i * 7 % 23);
  write_token_shard(path, t, vocab);
  return path;
}

// Every file under `dir` (relative path -> bytes; "<dir>" for a directory), to compare a run
// directory byte for byte before and after a refusal.
inline std::map<std::string, std::string> snapshot(const std::filesystem::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir))
    out[std::filesystem::relative(e.path(), dir).string()] =
        e.is_regular_file() ? read_all(e.path()) : "<dir>";
  return out;
}

// A keep_best run: a two-layer model on the pattern shard, validated on the clean pattern,
// 4 steps, a checkpoint every 2, checkpoint.keep 1 with keep_best. Resumed on the noise shard,
// its later checkpoints are worse, so the best is an older one.
struct BestRun {
  TempDir tmp;
  std::string shard = pattern_shard(tmp.path + "/d.tok", 256, 6000);
  std::string clean = pattern_shard(tmp.path + "/v.tok", 256, 600);
  std::string noise = random_shard(tmp.path + "/noise.tok", 256, 600, 11);
  std::string run = tmp.path + "/run";

  explicit BestRun(const std::string& name = "rundir-best") : tmp(name) {}
  // The config; `schedule_more` adds keys to its schedule mapping ("sample_every: 2, ...").
  Config config(const std::string& schedule_more = "") const {
    return parse_config(
        str("model: {n_layer: 2, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 256, seq_len: 16}\n"
            "data: {train_shards: [",
            shard, "], val_shards: [", clean,
            "]}\noptimizer: {lr: 3.0e-3}\n"
            "schedule: {steps: 4, warmup_steps: 1, micro_batch: 2, eval_every: 0, eval_batches: 2",
            schedule_more.empty() ? "" : ", ", schedule_more,
            "}\nruntime: {backend: cpu, threads: 2}\n"
            "checkpoint: {every_steps: 2, keep: 1, keep_best: true}\n"),
        "<test>");
  }
  // Trains the config into `run`.
  TrainSummary train(const std::string& schedule_more = "") const {
    TrainOptions o;
    o.run_dir = run;
    return run_training(config(schedule_more), o);
  }
  // Resumes `dir` to `steps` steps validated on `val`.
  void resume_to(const std::string& dir, int64_t steps, const std::string& val) const {
    TrainOptions o;
    o.resume_source = open_resume_checkpoint(dir);
    o.resume = o.resume_source->dir();
    run_training(resume_config(*o.resume_source, "",
                               {str("schedule.steps=", steps), str("data.val_shards=[", val, "]")}),
                 o);
  }
};

// Weights, optimizer state and checkpoints on the scratch's SSD folders, activations swapped.
inline void offload_everything(Config* c, const RunScratch& s) {
  c->offload.ssd_paths = s.ssd_paths();
  c->offload.weights = "ssd";
  c->offload.optimizer_state = "ssd";
  c->offload.activations = ActivationPolicy::kSwap;
}

inline TrainSummary train(const Config& cfg, const std::string& run_dir) {
  TrainOptions o;
  o.run_dir = run_dir;
  return run_training(cfg, o);
}

// Resumes the checkpoint `ckpt` (a checkpoint or a run directory) into run_dir, the
// checkpoint's config changed by `sets`.
inline TrainSummary resume(const std::string& ckpt, const std::string& run_dir,
                           const std::vector<std::string>& sets = {}) {
  TrainOptions o;
  o.resume = resolve_checkpoint(ckpt);
  o.run_dir = run_dir;
  return run_training(resume_config(o.resume, "", sets), o);
}

// step -> loss (training lines) and step -> val_loss, as the run logged them.
inline std::map<int64_t, double> losses(const std::string& run_dir, const char* key = "loss") {
  std::map<int64_t, double> out;
  std::ifstream in(std::filesystem::path(run_dir) / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains(key)) out[j["step"].get<int64_t>()] = j[key].get<double>();
  }
  return out;
}

// Every tensor of the file, by name.
inline std::map<std::string, std::string> tensors(const std::string& path) {
  SafetensorsReader r(path);
  std::map<std::string, std::string> out;
  for (const auto& t : r.tensors()) {
    std::string bytes(t.end - t.begin, '\0');
    r.read_raw(t.name, bytes.data());
    out[t.name] = bytes;
  }
  return out;
}

// The weights and both moments of a run's checkpoint at `step`.
inline std::map<std::string, std::string> state_at(const std::string& run_dir, int64_t step) {
  const std::filesystem::path d =
      std::filesystem::path(run_dir) / "checkpoints" / str("step-", step);
  auto out = tensors((d / "model.safetensors").string());
  for (auto& [k, v] : tensors((d / kOptimizerFile).string())) out[k] = v;
  return out;
}

// The run resumed from a checkpoint at step `from` into `resumed` equals `full` from there on:
// every later training loss and validation loss, the final weights, and the final
// checkpoint's weights and moments, bit for bit.
inline void check_resumed_equals(const std::string& full, const std::string& resumed, int64_t from,
                                 int64_t steps) {
  auto a = losses(full), b = losses(resumed);
  for (int64_t s = from + 1; s <= steps; ++s) {
    INFO("step " << s);
    REQUIRE(b.count(s));
    CHECK(std::memcmp(&a[s], &b[s], sizeof(double)) == 0);
  }
  CHECK(losses(full, "val_loss") == losses(resumed, "val_loss"));
  CHECK(tensors(full + "/model.safetensors") == tensors(resumed + "/model.safetensors"));
  CHECK(state_at(full, steps) == state_at(resumed, steps));
}

// Run `run` of scratch `s`, trained for `steps` steps, resumed from its checkpoint at step
// `from` into run `into` (by default `<run>-r<from>`) with the config changed by `sets`:
// the resumed run continues as `run` did, bit for bit (check_resumed_equals).
inline void check_resume(const RunScratch& s, const std::string& run, int64_t from, int64_t steps,
                         const std::string& into = "", const std::vector<std::string>& sets = {}) {
  const std::string to = s.run(into.empty() ? str(run, "-r", from) : into);
  INFO("run " << run << " resumed from step " << from << " into " << to);
  resume(s.run(run) + str("/checkpoints/step-", from), to, sets);
  check_resumed_equals(s.run(run), to, from, steps);
}

// `cfg` trained in memory into run `mem` already, `steps` steps: trained with AdamW on the
// device as a plan (Plan::device_optimizer) into run "dev", it ends with the same weights; "dev"
// resumed from step `from_dev` with AdamW on the host, and `mem` resumed from step `from_mem`
// with it on the device, continue bit for bit (the device state to and from checkpoints).
inline void check_resumes_across_optimizer_placement(const RunScratch& s, Config cfg,
                                                     const std::string& mem, int64_t steps,
                                                     int64_t from_dev, int64_t from_mem) {
  cfg.optimizer.placement = "device";
  train(cfg, s.run("dev"));
  CHECK(tensors(s.run("dev") + "/model.safetensors") == tensors(s.run(mem) + "/model.safetensors"));
  check_resume(s, "dev", from_dev, steps, "dev-host", {"optimizer.placement=host"});
  check_resume(s, mem, from_mem, steps, "mem-dev", {"optimizer.placement=device"});
}

// `cfg` trained offloaded, with everything on the scratch's SSD folders, into run "off":
// its final weights are run `mem`'s, bit for bit.
inline void check_offloaded_matches(const RunScratch& s, Config cfg, const std::string& mem) {
  offload_everything(&cfg, s);
  train(cfg, s.run("off"));
  CHECK(tensors(s.run(mem) + "/model.safetensors") == tensors(s.run("off") + "/model.safetensors"));
}

// The steps a run's checkpoints are resumed from: one in memory, one offloaded.
struct ResumeSteps {
  int64_t in_memory;
  int64_t offloaded;
};

// `cfg` trained in memory into run `mem` already, `steps` steps: resumed from step
// `from.in_memory` it continues bit for bit; trained offloaded into run "off" it ends with the
// same weights, and resumed from step `from.offloaded` continues bit for bit too.
inline void check_resumes_both_ways(const RunScratch& s, const Config& cfg, const std::string& mem,
                                    int64_t steps, ResumeSteps from) {
  check_resume(s, mem, from.in_memory, steps);
  check_offloaded_matches(s, cfg, mem);
  check_resume(s, "off", from.offloaded, steps);
}

}  // namespace fuyou::test
