// Training-state checkpoints end to end through run_training: a run resumed from a
// checkpoint continues bit for bit (every later loss, the final weights and both Adam
// moments) in memory and offloaded (weights, optimizer state and activations on SSD), with
// gradient accumulation, exact (clipping) mode and fp16 loss scaling, and across placements
// (offloaded and in memory, AdamW on the host and on the device);
// a graceful stop writes a resumable checkpoint; faults while checkpointing (ENOSPC, EIO,
// short writes in the checkpoint files, EIO reading the SSD store) leave the previous
// checkpoint intact and resumable; a resume that changes a trajectory key is refused.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "fuyou/checkpoint.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/rng.h"
#include "fuyou/safetensors.h"
#include "fuyou/stop.h"
#include "fuyou/tokenizer.h"
#include "fuyou/train.h"
#include "run_dir_support.h"
#include "src/storage/file_layer.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;
using Catch::Matchers::Contains;

namespace {

// Scratch directories with two SSD folders (tests/run_dir_support.h).
struct Scratch : test::RunScratch {
  explicit Scratch(const std::string& name) : RunScratch("ckpt", name, 2) {}
};
using test::check_offloaded_matches;
using test::check_resume;
using test::check_resumed_equals;
using test::check_resumes_across_optimizer_placement;
using test::check_resumes_both_ways;
using test::losses;
using test::offload_everything;
using test::resume;
using test::state_at;
using test::tensors;
using test::train;

Config base_config(const Scratch& s, const std::string& extra = "") {
  return parse_config(
      str("model: {n_layer: 3, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 256, seq_len: 16}\n"
          "data: {text: [",
          (s.root / "corpus.txt").string(),
          "], val_fraction: 0.1}\noptimizer: {lr: 3.0e-3, min_lr: 3.0e-4}\n"
          "schedule: {steps: 8, warmup_steps: 2, micro_batch: 2, grad_accum: 2, eval_every: 4, "
          "eval_batches: 2}\nruntime: {backend: cpu, threads: 2, seed: 11}\n"
          "checkpoint: {every_steps: 3, keep: 10}\n"),
      "<test>", extra.empty() ? std::vector<std::string>{} : std::vector<std::string>{extra});
}

// An engine for `cfg` on the CPU backend whose SSD store goes through `files`, its
// parameters initialised, and one fixed batch to step it with.
struct OffloadedRig {
  std::unique_ptr<Backend> be = make_cpu_backend(2, 0);
  std::unique_ptr<TrainEngine> engine;
  std::vector<int32_t> batch;
  OffloadedRig(const Config& cfg, std::shared_ptr<FileLayer> files) {
    EngineOptions eo;
    eo.store_files = std::move(files);
    engine = make_train_engine(cfg, *be, eo);
    engine->init_params();
    batch.resize(static_cast<size_t>(cfg.schedule.micro_batch) * (cfg.model.seq_len + 1));
    for (size_t i = 0; i < batch.size(); ++i) batch[i] = static_cast<int32_t>((i * 37 + 5) % 256);
  }
  StepResult step(int64_t i) { return engine->step(i, {batch.data(), batch.data()}); }
};

}  // namespace

TEST_CASE("resume continues bit for bit: in memory, offloaded, and across placements",
          "[checkpoint]") {
  Scratch s("resume");
  Config mem = base_config(s);  // grad_accum 2, grad_clip 1 (offloaded: exact mode)
  train(mem, s.run("mem"));
  CHECK(list_checkpoints(s.run("mem")).size() == 3);  // steps 3, 6 and the last, 8

  SECTION("in memory, from step 3 and from step 6") {
    check_resume(s, "mem", 3, 8);
    check_resume(s, "mem", 6, 8);
  }
  SECTION("in memory with AdamW on the device, resumed with it on the host and back") {
    // The plan's device state (Plan::device_optimizer) is read into and restored from the
    // same checkpoint files as the host optimizer's.
    check_resumes_across_optimizer_placement(s, mem, "mem", 8, 3, 6);
  }
  SECTION("offloaded with everything on SSD; resumed offloaded and in memory") {
    check_offloaded_matches(s, mem, "mem");
    check_resume(s, "off", 3, 8);
    // Placement may change on a resume: offloaded checkpoint in memory, and the reverse.
    check_resume(s, "off", 6, 8, "off-mem",
                 {"offload.ssd_paths=[]", "offload.weights=auto", "offload.optimizer_state=auto",
                  "offload.activations=auto"});
    check_resume(s, "mem", 3, 8, "mem-off",
                 {"offload.ssd_paths=" + s.ssd_list(), "offload.optimizer_state=ssd"});
    CHECK(s.ssd_empty());
  }
}

TEST_CASE("resume with fp16 loss scaling keeps the scale and the skipped steps",
          "[checkpoint][fp16]") {
  Scratch s("fp16");
  // A start scale of 2^24 overflows, so the first steps are skipped and the scale halves:
  // the checkpoint must carry the scale, the clean-step count and Adam's step.
  Config cfg = base_config(s, "optimizer.initial_loss_scale=16777216");
  cfg.runtime.precision = "fp16";
  cfg.checkpoint.every_steps = 2;
  train(cfg, s.run("full"));
  auto m = read_checkpoint_manifest(s.run("full") + "/checkpoints/step-4");
  REQUIRE(m.counters.has_loss_scale);
  CHECK(m.counters.loss_scale.skipped > 0);
  CHECK(m.counters.adam_step == 4 - m.counters.loss_scale.skipped);
  check_resumes_both_ways(s, cfg, "full", 8, {.in_memory = 2, .offloaded = 4});
}

TEST_CASE("resume with bf16 device tensors continues bit for bit, in memory and offloaded",
          "[checkpoint][bf16]") {
  // The checkpoint holds the fp32 master and moments; the device's bf16 weights are rounded
  // from the master on restore, as the update rounds them every step.
  Scratch s("bf16");
  Config cfg = base_config(s, "runtime.device_tensors=bf16");
  train(cfg, s.run("mem"));
  check_resumes_both_ways(s, cfg, "mem", 8, {.in_memory = 3, .offloaded = 6});
  // AdamW on the device keeps a separate fp32 master beside the bf16 weights: resumed into the
  // host optimizer and from it.
  check_resumes_across_optimizer_placement(s, cfg, "mem", 8, 6, 3);
  // The tensor type is part of the trajectory: a resume keeps it.
  CHECK_THROWS_WITH(
      resume_config(resolve_checkpoint(s.run("mem")), "", {"runtime.device_tensors=fp32"}),
      Contains("runtime.device_tensors"));
}

TEST_CASE("a resume refuses changed trajectory keys and data, and allows the documented ones",
          "[checkpoint]") {
  Scratch s("refuse");
  train(base_config(s), s.run("a"));
  const std::string ck = resolve_checkpoint(s.run("a"));
  CHECK(fs::path(ck).filename() == "step-8");  // `latest`
  CHECK_THROWS_WITH(
      resume_config(ck, "", {"optimizer.lr=0.002"}),
      Contains("optimizer.lr is 0.002") && Contains("changes the training trajectory"));
  CHECK_THROWS_WITH(resume_config(ck, "", {"model.n_layer=4"}), Contains("model.n_layer"));
  CHECK_THROWS_WITH(resume_config(ck, "", {"schedule.grad_accum=1"}),
                    Contains("schedule.grad_accum"));
  CHECK_THROWS_WITH(resume_config(ck, "", {"runtime.seed=12"}), Contains("runtime.seed"));
  CHECK_NOTHROW(
      resume_config(ck, "", {"schedule.steps=12", "runtime.threads=1", "checkpoint.keep=1"}));
  // A run killed after its last checkpoint but before its final weights: the resume only
  // writes them.
  fs::remove(fs::path(s.run("a")) / "model.safetensors");
  CHECK(resume(s.run("a"), "").steps == 8);
  CHECK(tensors(s.run("a") + "/model.safetensors") ==
        tensors(s.run("a") + "/checkpoints/step-8/model.safetensors"));
  // Different training tokens under the same path: refused by content.
  std::ofstream(s.root / "corpus.txt", std::ios::app) << "one more line\n";
  CHECK_THROWS_WITH(resume(s.run("a") + "/checkpoints/step-3", s.run("c")),
                    Contains("the training data differs from the checkpoint's"));
}

TEST_CASE("training longer from the last checkpoint of a finished run", "[checkpoint]") {
  Scratch s("extend");
  train(base_config(s), s.run("a"));
  TrainSummary r = resume(s.run("a"), "", {"schedule.steps=10"});  // continues in the same run
  CHECK(r.start_step == 8);
  CHECK(r.steps == 10);
  CHECK(fs::path(resolve_checkpoint(s.run("a"))).filename() == "step-10");
  auto l = losses(s.run("a"));
  CHECK(l.rbegin()->first == 10);
  CHECK(l.size() == 10);  // one line per step: none repeated, none lost
}

TEST_CASE("a graceful stop writes a resumable checkpoint and removes the store files",
          "[checkpoint][signals]") {
  Scratch s("stop");
  Config cfg = base_config(s);
  cfg.checkpoint.every_steps = 0;  // none before the stop, which writes one anyway
  cfg.checkpoint.every_minutes = 1e6;
  cfg.schedule.steps = 40;
  offload_everything(&cfg, s);
  train(cfg, s.run("full"));
  StopSignals& stop = test::stop_signals();
  stop.clear();
  TrainOptions o;
  o.run_dir = s.run("stopped");
  o.stop = &stop;
  // A real SIGINT to this process once the run has trained a step: StopSignals' thread only
  // asks, and the run finishes its step.
  std::thread sender([&] {
    while (test::read_all(fs::path(o.run_dir) / "metrics.jsonl").find("\"loss\"") ==
           std::string::npos)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    ::kill(::getpid(), SIGINT);
  });
  TrainSummary r = run_training(cfg, o);
  sender.join();
  stop.clear();
  CHECK(r.stop_signal == SIGINT);
  REQUIRE(r.steps < 40);
  CHECK(s.ssd_empty());
  CHECK(fs::exists(fs::path(o.run_dir) / "model.safetensors"));
  CHECK(fs::path(resolve_checkpoint(o.run_dir)).filename() == str("step-", r.steps));
  CHECK(losses(o.run_dir).rbegin()->first == r.steps);  // flushed up to the stop
  // Resumed from its latest checkpoint, into the same run.
  resume(o.run_dir, "");
  check_resumed_equals(s.run("full"), o.run_dir, r.steps, 40);
  CHECK(s.ssd_empty());
}

TEST_CASE("faults while writing a checkpoint leave the previous one intact and resumable",
          "[checkpoint]") {
  Scratch s("faults");
  Config cfg = base_config(s);
  cfg.checkpoint.every_steps = 2;
  train(cfg, s.run("full"));
  struct Fault {
    const char* what;
    int err;          // errno of the failing write; 0: short writes only, no failure
    uint64_t budget;  // bytes of the second checkpoint written before the fault
  };
  for (Fault f :
       {Fault{"ENOSPC", ENOSPC, 70000}, Fault{"EIO", EIO, 1000}, Fault{"short writes", 0, 0}}) {
    DYNAMIC_SECTION(f.what) {
      const std::string dir = s.run(str("run-", f.err));
      std::atomic<uint64_t> written{0};
      CheckpointIo io;
      io.write = [&](int fd, const void* p, size_t n, uint64_t at) -> ssize_t {
        // Short writes: at most 777 bytes per call, which the writer must complete.
        if (f.err == 0) return ::pwrite(fd, p, std::min<size_t>(n, 777), static_cast<off_t>(at));
        // The first checkpoint (step 2) goes through; the second (step 4) fails part-way.
        if (!list_checkpoints(dir).empty() && (written += n) > f.budget) {
          errno = f.err;
          return -1;
        }
        return ::pwrite(fd, p, n, static_cast<off_t>(at));
      };
      TrainOptions o;
      o.run_dir = dir;
      o.checkpoint_io = &io;
      if (f.err == 0) {
        run_training(cfg, o);
        CHECK(tensors(dir + "/model.safetensors") == tensors(s.run("full") + "/model.safetensors"));
        CHECK(state_at(dir, 8) == state_at(s.run("full"), 8));
        continue;
      }
      CHECK_THROWS_WITH(run_training(cfg, o),
                        Contains("checkpoint at step 4 failed") && Contains(std::strerror(f.err)) &&
                            Contains("step-2 is intact") && Contains("--resume"));
      // Only the complete checkpoint, no staging directory, `latest` on it.
      std::vector<std::string> left;
      for (const auto& e : fs::directory_iterator(fs::path(dir) / "checkpoints"))
        left.push_back(e.path().filename());
      std::sort(left.begin(), left.end());
      CHECK(left == std::vector<std::string>{"latest", "step-2"});
      resume(dir, "");  // from step-2, into the same run
      check_resumed_equals(s.run("full"), dir, 2, 8);
    }
  }
}

TEST_CASE(
    "an SSD read error while checkpointing names the file, and the previous checkpoint restores",
    "[checkpoint]") {
  Scratch s("storeio");
  Config cfg = base_config(s);
  offload_everything(&cfg, s);
  struct Faults : FileLayer {
    std::atomic<bool> fail_reads{false};
    IoFault before_io(const IoAttempt& a) override {
      if (fail_reads && a.op == IoOp::kRead) return {EIO, 0};
      return {};
    }
  };
  auto faults = std::make_shared<Faults>();
  OffloadedRig rig(cfg, faults);
  TrainEngine* engine = rig.engine.get();
  rig.step(0);
  TrainProgress p;
  p.step = 1;
  // As a run's sampler would have drawn: micro_batch x grad_accum windows per step.
  const uint64_t per_step =
      static_cast<uint64_t>(cfg.schedule.micro_batch) * cfg.schedule.grad_accum;
  p.sampler_position = per_step;
  const std::string run = s.run("run");
  fs::create_directories(run);
  save_checkpoint(run, cfg, *engine, p, {});
  rig.step(1);
  p.step = 2;
  p.sampler_position = 2 * per_step;
  faults->fail_reads = true;
  CHECK_THROWS_WITH(save_checkpoint(run, cfg, *engine, p, {}), Contains("SSD store") &&
                                                                   Contains("fuyou.store") &&
                                                                   Contains("Input/output error"));
  faults->fail_reads = false;
  CHECK(list_checkpoints(run).size() == 1);
  CHECK(fs::path(resolve_checkpoint(run)).filename() == "step-1");
  // The intact checkpoint restores into a fresh engine (in memory here), checksums and all.
  Config mem = base_config(s);
  auto be2 = make_cpu_backend(2, 0);
  auto fresh = make_train_engine(mem, *be2);
  const std::string ck = resolve_checkpoint(run);
  restore_checkpoint(ck, read_checkpoint_manifest(ck), mem.model, *fresh);
  CHECK(fresh->counters().adam_step == 1);
}

TEST_CASE(
    "bytes changed in an SSD store file mid-run are reported as corruption, naming step and extent",
    "[checkpoint]") {
  Scratch s("storeflip");
  Config cfg = base_config(s);
  offload_everything(&cfg, s);
  // Just before the store reads a range back, one byte of it changes on the disk.
  struct Flip : FileLayer {
    std::atomic<bool> armed{false};
    std::string path;
    IoFault before_io(const IoAttempt& a) override {
      if (a.op != IoOp::kRead || !armed.exchange(false)) return {};
      path = *a.path;
      int fd = ::open(a.path->c_str(), O_RDWR);
      unsigned char c = 0;
      if (fd >= 0 && ::pread(fd, &c, 1, static_cast<off_t>(a.file_offset + 10)) == 1) {
        c ^= 0xff;
        if (::pwrite(fd, &c, 1, static_cast<off_t>(a.file_offset + 10)) != 1) path.clear();
      }
      if (fd >= 0) ::close(fd);
      return {};
    }
  };
  auto flip = std::make_shared<Flip>();
  OffloadedRig rig(cfg, flip);
  rig.step(0);
  flip->armed = true;
  CHECK_THROWS_WITH(rig.step(1),
                    // The step the damaged read served: this one, or the last one's update that
                    // runs beside this one's forward.
                    Catch::Matchers::Matches(
                        "step [12], [a-z ]+[0-9]*: SSD store: checksum mismatch reading extent "
                        "'[^']+': [0-9]+ bytes at extent offset [0-9]+ \\(.*fuyou\\.store offset "
                        "[0-9]+\\) .*changed after they were written.*"));
  CHECK(!flip->path.empty());
  CHECK_FALSE(flip->armed);
}

TEST_CASE("a damaged checkpoint is refused naming the file and the group", "[checkpoint]") {
  Scratch s("damage");
  train(base_config(s), s.run("a"));
  const fs::path ck = fs::path(s.run("a")) / "checkpoints" / "step-6";
  auto be = make_cpu_backend(2, 0);
  Config cfg = base_config(s);
  {
    // One flipped bit in the middle of the moments: caught by the group checksum.
    std::fstream f(ck / kOptimizerFile, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(ck / kOptimizerFile) / 2));
    char c = 0;
    f.read(&c, 1);
    c ^= 4;
    f.seekp(static_cast<std::streamoff>(fs::file_size(ck / kOptimizerFile) / 2));
    f.write(&c, 1);
  }
  auto engine = make_train_engine(cfg, *be);
  CHECK_THROWS_WITH(
      restore_checkpoint(ck.string(), read_checkpoint_manifest(ck.string()), cfg.model, *engine),
      Contains("has checksum") && Contains("the checkpoint is damaged"));
  // A truncated file: caught by the manifest's sizes before anything is read.
  fs::resize_file(ck / "model.safetensors", 1000);
  CHECK_THROWS_WITH(read_checkpoint_manifest(ck.string()),
                    Contains("model.safetensors") && Contains("1000-byte"));
  // A half-written staging directory is removed at the next start, with a log line.
  fs::create_directories(fs::path(s.run("a")) / "checkpoints" / ".staging-step-9-1");
  CHECK(remove_checkpoint_leftovers(s.run("a")) == 1);
  // `latest` naming something gone falls back to the newest complete checkpoint.
  test::write_all(fs::path(s.run("a")) / "checkpoints" / "latest", "step-99\n");
  CHECK(fs::path(resolve_checkpoint(s.run("a"))).filename() == "step-8");
}

TEST_CASE("a run directory too small for the weights and checkpoints is refused before step 1",
          "[checkpoint]") {
  Scratch s("preflight");
  // 2.4B parameters: 29 GB per checkpoint, 5 of them (keep 4, plus the one being written),
  // far more than the build filesystem holds. Refused from the config alone, before the
  // engine allocates anything.
  Config cfg = base_config(s, "checkpoint.keep=4");
  cfg.model.n_layer = 48;
  cfg.model.d_model = 2048;
  cfg.model.d_ff = 8192;
  CHECK_THROWS_WITH(train(cfg, s.run("a")), Contains("run directory") &&
                                                Contains("checkpoint(s) of") &&
                                                Contains("checkpoint.keep 4") && Contains("free"));
  CHECK_FALSE(fs::exists(fs::path(s.run("a")) / "metrics.jsonl"));
}

TEST_CASE("record data with schedule.epochs resumes mid-epoch bit for bit, in memory and offloaded",
          "[checkpoint][records]") {
  // 60 prompt/completion records of 6 to 20 byte-level tokens, packed into rows of 33: an epoch
  // is a few steps, so checkpoints fall inside epochs.
  Scratch s("records");
  {
    std::ofstream f(s.root / "pairs.jsonl");
    Rng rng(2, 0);
    for (int r = 0; r < 60; ++r) {
      std::string p = "q";
      for (uint64_t k = 0, n = 2 + rng.below(10); k < n; ++k)
        p += static_cast<char>('a' + rng.below(26));
      f << "{\"prompt\": \"" << p << "\", \"completion\": \" " << p.substr(1, 3) << "\"}\n";
    }
  }
  Tokenizer tok =
      Tokenizer::from_file(test::source_path("tests/reference/fixtures/hf/tok_bytelevel.json"));
  DatasetOptions d;
  d.prompt_field = "prompt";
  d.completion_field = "completion";
  d.eos_token = "<|endoftext|>";
  d.val_fraction = 0.2;
  DatasetResult data =
      build_tokenized_dataset(tok, {(s.root / "pairs.jsonl").string()}, s.run("data"), d);
  Config cfg = parse_config(
      str("model: {n_layer: 2, n_head: 2, d_model: 32, d_ff: 64, vocab_size: ", tok.vocab_size(),
          ", seq_len: 32}\n", "data: {train_shards: [", data.train_path, "], val_shards: [",
          data.val_path, "]}\n",
          "optimizer: {lr: 3.0e-3, min_lr: 3.0e-4}\n"
          "schedule: {epochs: 2, warmup_steps: 1, micro_batch: 2, grad_accum: 2, eval_every: 3, "
          "eval_batches: 4}\nruntime: {backend: cpu, threads: 2, seed: 5}\n"
          "checkpoint: {every_steps: 3, keep: 10}\n"),
      "<test>");
  TrainSummary full = train(cfg, s.run("mem"));
  INFO("steps " << full.steps);
  REQUIRE(full.steps >= 6);
  REQUIRE(full.steps % 3 != 0);  // the last checkpoint is not one of every_steps'
  check_resumes_both_ways(s, cfg, "mem", full.steps, {.in_memory = 3, .offloaded = 3});
}
