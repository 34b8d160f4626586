// What a stop, a refusal or a damaged file must not do: a stop signal never runs on a
// thread inside a library (every thread blocks it); a stop before training leaves the run
// directory as it was found, and one during validation does not wait for it; a resume that is
// refused changes nothing on disk; an edited manifest or config, or a tensor file changed
// after it was written, is refused by every reader; metrics.jsonl loses no line in silence;
// and inputs that would expand beyond any bound (YAML aliases, a tokenizer's normalizer) are
// refused before they expand.
#include <signal.h>
#include <unistd.h>
#include <xxhash.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "fuyou/backend.h"
#include "fuyou/backend_select.h"
#include "fuyou/checkpoint.h"
#include "fuyou/config.h"
#include "fuyou/data.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/hardware.h"
#include "fuyou/hf_checkpoint.h"
#include "fuyou/safetensors.h"
#include "fuyou/sizes.h"
#include "fuyou/stop.h"
#include "fuyou/tokenizer.h"
#include "fuyou/train.h"
#include "hf_support.h"
#include "src/formats/safetensors_stream.h"
#include "src/storage/dir_lock.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;
using Catch::Matchers::Contains;

namespace {

// A directory under the build tree with a small text corpus, removed at the end.
struct Work {
  fs::path root;
  explicit Work(const std::string& name)
      : root(fs::path(FUYOU_BINARY_DIR) / "test-data" /
             ("durable-" + name + "-" + std::to_string(::getpid()))) {
    fs::remove_all(root);
    fs::create_directories(root / "ssd");
    std::ofstream f(root / "corpus.txt");
    for (int i = 0; i < 300; ++i)
      f << "line " << i << ": the quick brown fox jumps over the lazy dog.\n";
  }
  ~Work() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
  std::string path(const std::string& name) const { return (root / name).string(); }
};

Config small_config(const Work& w, const std::vector<std::string>& sets = {}) {
  return parse_config(
      str("model: {n_layer: 2, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 256, seq_len: 16}\n"
          "data: {text: [",
          w.path("corpus.txt"),
          "], val_fraction: 0.1}\noptimizer: {lr: 3.0e-3, min_lr: 3.0e-4}\n"
          "schedule: {steps: 8, warmup_steps: 2, micro_batch: 2, eval_every: 4, eval_batches: 2, "
          "log_every: 1}\nruntime: {backend: cpu, threads: 2, seed: 5}\n"
          "checkpoint: {every_steps: 3, keep: 10}\n"),
      "<test>", sets);
}

TrainSummary train(const Config& cfg, const std::string& run_dir, StopSignals* stop = nullptr,
                   const MetricsIo* mio = nullptr) {
  TrainOptions o;
  o.run_dir = run_dir;
  o.stop = stop;
  o.metrics_io = mio;
  return run_training(cfg, o);
}

// As fuyou-train --resume PATH [--run-dir DIR] [--set ...] does it.
TrainSummary resume(const std::string& path, const std::string& run_dir = "",
                    const std::vector<std::string>& sets = {}) {
  TrainOptions o;
  o.resume_source = open_resume_checkpoint(path);
  o.resume = o.resume_source->dir();
  o.run_dir = run_dir;
  return run_training(resume_config(*o.resume_source, "", sets), o);
}

// Every file under `dir` (relative path -> bytes).
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    out[fs::relative(e.path(), dir).string()] =
        e.is_regular_file() ? test::read_all(e.path()) : "<dir>";
  return out;
}

// Lines of metrics.jsonl with `key`, by step.
std::map<int64_t, int> lines_with(const std::string& run, const char* key) {
  std::map<int64_t, int> out;
  std::ifstream in(fs::path(run) / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains(key)) ++out[j["step"].get<int64_t>()];
  }
  return out;
}

void flip_byte(const fs::path& file, uint64_t offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c ^= 0x10;
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

// A byte in the middle of tensor `name`'s data.
void flip_tensor_byte(const fs::path& file, const std::string& name) {
  SafetensorsReader r(file.string());
  const StTensorInfo& t = r.info(name);
  unsigned char len[8];
  std::ifstream(file, std::ios::binary).read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | len[i];
  flip_byte(file, 8 + n + (t.begin + t.end) / 2);
}

// Rewrites a manifest with `edit` applied and its checksum made to match again (the engine's
// rule: XXH3-64 of the compact dump without the field): what a consistent but wrong manifest
// looks like, so that the field checks are tested, not only the checksum.
void reseal_manifest(const fs::path& dir, const std::function<void(nlohmann::json&)>& edit) {
  auto j = nlohmann::json::parse(test::read_all(dir / "manifest.json"));
  j.erase("xxh3");
  edit(j);
  const std::string text = j.dump();
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx",
                static_cast<unsigned long long>(XXH3_64bits(text.data(), text.size())));
  j["xxh3"] = hex;
  test::write_all(dir / "manifest.json", j.dump(2));
}

// metrics.jsonl's writes, which ask for a stop with `signal`, as a signal would, when the
// training line of `step` is written: the stop arrives just before that step's validation.
MetricsIo stop_at_step(StopSignals& stop, int64_t step, int signal) {
  MetricsIo io;
  io.write = [&stop, step, signal](int fd, const void* p, size_t n) {
    auto j = nlohmann::json::parse(std::string(static_cast<const char*>(p), n), nullptr, false);
    if (!j.is_discarded() && j.contains("loss") && j["step"] == step) stop.request(signal);
    return ::write(fd, p, n);
  };
  return io;
}

}  // namespace

TEST_CASE("every thread blocks the stop signals while training, in memory and offloaded",
          "[durable][signals]") {
  Work w("threads");
  for (bool offloaded : {false, true}) {
    INFO((offloaded ? "offloaded" : "in memory"));
    Config cfg = small_config(w, {"schedule.steps=40", "checkpoint.every_steps=0"});
    if (offloaded) {
      cfg.offload.ssd_paths = {w.path("ssd")};
      cfg.offload.optimizer_state = "ssd";
    }
    const std::string run = w.path(offloaded ? "off" : "mem");
    std::vector<int> open;
    int looks = 0;
    std::atomic<bool> done{false};
    // Looks while the OpenMP teams, oneDNN and the executor's threads exist.
    std::thread watcher([&] {
      while (!done) {
        if (fs::exists(fs::path(run) / "metrics.jsonl")) {
          ++looks;
          for (int t : threads_not_blocking_stop_signals()) open.push_back(t);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    });
    train(cfg, run);
    done = true;
    watcher.join();
    CHECK(looks > 0);
    CHECK(open.empty());
  }
}

TEST_CASE("a stop before training leaves a new run directory as it was found",
          "[durable][signals]") {
  Work w("early");
  StopSignals& stop = test::stop_signals();
  stop.clear();
  stop.request(SIGTERM);  // already asked when the run starts
  const std::string run = w.path("run");
  try {
    train(small_config(w), run, &stop);
    FAIL("the run did not stop");
  } catch (const StopRequested& e) {
    CHECK(e.signal() == SIGTERM);
    CHECK_THAT(e.what(), Contains("before training began"));
  }
  stop.clear();
  CHECK_FALSE(fs::exists(run));  // created by the run, so removed again
  fs::create_directories(run);   // an empty directory stays, empty
  stop.request(SIGINT);
  CHECK_THROWS_AS(train(small_config(w), run, &stop), StopRequested);
  stop.clear();
  CHECK(fs::is_empty(run));
  CHECK(train(small_config(w), run, &stop).steps == 8);  // the same command now runs
}

TEST_CASE("a run that fails before training leaves its directory reusable", "[durable]") {
  Work w("failstart");
  const std::string run = w.path("run");
  // The byte tokenizer's 256 symbols do not fit vocab_size 100: refused after the text was
  // tokenized into the run directory.
  CHECK_THROWS_WITH(train(small_config(w, {"model.vocab_size=100"}), run), Contains("vocab_size"));
  CHECK_FALSE(fs::exists(run));
  // The disk-space preflight, after the data was loaded.
  CHECK_THROWS_WITH(
      train(small_config(w, {"checkpoint.keep=1000", "model.n_layer=60", "model.d_model=2048",
                             "model.n_head=16", "model.d_ff=8192"}),
            run),
      Contains("free"));
  CHECK_FALSE(fs::exists(run));
  CHECK(train(small_config(w), run).steps == 8);
}

TEST_CASE("a stop during validation ends it at once, and the step's checkpoint follows",
          "[durable][signals]") {
  Work w("valstop");
  StopSignals& stop = test::stop_signals();
  stop.clear();
  // Validation after step 2 over 10,000 batches would take seconds; the stop is asked as it
  // begins.
  Config cfg = small_config(
      w, {"schedule.eval_every=2", "schedule.eval_batches=10000", "checkpoint.every_steps=0"});
  const std::string run = w.path("run");
  const MetricsIo io = stop_at_step(stop, 2, SIGINT);
  TrainSummary r = train(cfg, run, &stop, &io);
  stop.clear();
  CHECK(r.stop_signal == SIGINT);
  CHECK(r.steps == 2);
  CHECK(lines_with(run, "val_loss").count(2) == 0);  // the interrupted pass is not logged
  CHECK(fs::path(resolve_checkpoint(run)).filename() == "step-2");
}

TEST_CASE("a stop that arrives in the last step's validation: the run completes and reports it",
          "[durable][signals]") {
  Work w("laststop");
  StopSignals& stop = test::stop_signals();
  stop.clear();
  Config cfg =
      small_config(w, {"schedule.steps=4", "schedule.eval_every=0", "schedule.eval_batches=10000"});
  const std::string run = w.path("run");
  const MetricsIo io = stop_at_step(stop, 4, SIGTERM);
  TrainSummary r = train(cfg, run, &stop, &io);
  stop.clear();
  CHECK(r.steps == 4);
  CHECK(r.stop_signal == SIGTERM);  // fuyou-train exits 143
  CHECK(fs::exists(fs::path(run) / "model.safetensors"));
  CHECK(fs::path(resolve_checkpoint(run)).filename() == "step-4");
}

TEST_CASE("an edited or damaged checkpoint is refused, and the refusal changes nothing on disk",
          "[durable][checkpoint]") {
  Work w("edited");
  const std::string run = w.path("run");
  train(small_config(w), run);  // checkpoints at steps 3, 6 and 8
  const fs::path ck = fs::path(run) / "checkpoints" / "step-8";
  const fs::path saved = w.root / "saved";
  fs::copy(ck, saved, fs::copy_options::recursive);
  auto restore = [&] {
    fs::remove_all(ck);
    fs::copy(saved, ck, fs::copy_options::recursive);
  };
  auto refused = [&](const std::string& why,
                     const std::vector<std::string>& sets = {"schedule.steps=60"}) {
    INFO(why);
    const auto before = snapshot(run);
    CHECK_THROWS_WITH(resume(run, "", sets), Contains(why));
    CHECK(snapshot(run) ==
          before);  // config.yaml, metrics.jsonl, data/, every checkpoint as they were
    restore();
  };
  auto edit_text = [&](const char* file, const std::string& from, const std::string& to) {
    std::string t = test::read_all(ck / file);
    REQUIRE(t.find(from) != std::string::npos);
    test::write_all(ck / file, t.replace(t.find(from), from.size(), to));
  };

  edit_text("manifest.json", "\"adam_step\": 8", "\"adam_step\": 2");
  refused("manifest.json: its content has checksum");
  edit_text("config.yaml", "lr: 0.003", "lr: 0.03");
  refused("config.yaml: checksum");
  reseal_manifest(ck, [](nlohmann::json& j) { j["sampler_position"] = 999; });
  refused("sampler_position 999 does not fit step 8");
  reseal_manifest(ck, [](nlohmann::json& j) {
    j["step"] = 6;
    j["adam_step"] = 6;
  });
  refused("step 6 but the directory is step-8");
  reseal_manifest(ck, [](nlohmann::json& j) { j["step"] = 1e30; });
  refused("field 'step' is 1e+30; expected an integer");
  reseal_manifest(ck, [](nlohmann::json& j) { j["step"] = 9223372036854775807ll; });
  refused("field 'step' is 9223372036854775807; expected at most");
  reseal_manifest(ck, [](nlohmann::json& j) { j["files"][1]["name"] = "../../model.safetensors"; });
  refused("a checkpoint's files are");
  // A byte of the moments: found while restoring, after the data and the engine were set up;
  // the error offers the run's earlier checkpoint.
  flip_tensor_byte(ck / "optimizer.safetensors", "adam_v.wte.weight");
  refused("(resume from it with fuyou-train --resume " +
          (fs::path(run) / "checkpoints" / "step-6").string());
  // Different training data: refused after tokenizing it, before anything is replaced.
  test::write_all(w.root / "corpus.txt", "other text entirely, over and over.\n");
  refused("the training data differs");
}

TEST_CASE("every reader of a checkpoint the engine wrote verifies it",
          "[durable][checkpoint][hf]") {
  Work w("readers");
  const std::string run = w.path("run");
  train(small_config(w), run);
  // The run's final weights record their checksums, as every file the engine writes does.
  TensorSet final_set = TensorSet::open_file(run + "/model.safetensors");
  CHECK(final_set.file("wte.weight").checksummed());
  const fs::path step = fs::path(run) / "checkpoints" / "step-6";
  CHECK_NOTHROW(convert_engine_to_hf(step.string(), w.path("hf-ok"), {}));
  flip_tensor_byte(step / "model.safetensors", "h.1.mlp.c_fc.weight");
  CHECK_THROWS_WITH(convert_engine_to_hf(step.string(), w.path("hf"), {}),
                    Contains("h.1.mlp.c_fc.weight") && Contains("checksum"));
  CHECK_FALSE(fs::exists(w.path("hf")));
  CHECK_THROWS_WITH(load_engine_checkpoint(step.string()), Contains("checksum"));
  Config from = small_config(w, {str("model.checkpoint=", step.string())});
  CHECK_THROWS_WITH(train(from, w.path("finetune")),
                    Contains("h.1.mlp.c_fc.weight") && Contains("checksum"));
  flip_tensor_byte(fs::path(run) / "model.safetensors", "ln_f.weight");
  CHECK_THROWS_WITH(convert_engine_to_hf(run, w.path("hf2"), {}),
                    Contains("ln_f.weight") && Contains("checksum"));
}

TEST_CASE(
    "metrics.jsonl: a failed write is retried and no line is lost, and a lasting failure stops the "
    "run",
    "[durable]") {
  Work w("metrics");
  std::atomic<int> calls{0};
  MetricsIo flaky;
  flaky.retry_seconds = 5;
  // Calls 4 to 6 fail (a disk full for a moment), call 8 writes half its line first.
  flaky.write = [&](int fd, const void* p, size_t n) -> ssize_t {
    const int c = ++calls;
    if (c >= 4 && c <= 6) {
      errno = ENOSPC;
      return -1;
    }
    return ::write(fd, p, c == 8 ? n / 2 : n);
  };
  const std::string run = w.path("run");
  train(small_config(w), run, nullptr, &flaky);
  auto l = lines_with(run, "loss");
  CHECK(l.size() == 8);
  for (auto [step, n] : l) CHECK(n == 1);
  CHECK(lines_with(run, "val_loss").size() == 3);  // steps 0, 4, 8

  MetricsIo full;
  calls = 0;
  full.write = [&](int fd, const void* p, size_t n) -> ssize_t {
    if (++calls > 5) {
      errno = EFBIG;  // a file-size limit: no retry helps
      return -1;
    }
    return ::write(fd, p, n);
  };
  CHECK_THROWS_WITH(train(small_config(w), w.path("run2"), nullptr, &full),
                    Contains("metrics.jsonl") && Contains("File too large") && Contains("step-3"));
}

TEST_CASE("latest: a directory is refused, and a damaged latest checkpoint names the earlier one",
          "[durable][checkpoint]") {
  Work w("latest");
  const std::string run = w.path("run");
  train(small_config(w), run);
  const fs::path root = fs::path(run) / "checkpoints";
  flip_byte(root / "step-8" / "manifest.json", 40);
  CHECK_THROWS_WITH(resume(run), Contains("step-8/manifest.json") &&
                                     Contains("--resume " + (root / "step-6").string()));
  // Text in latest that names no checkpoint is said with its control bytes escaped, so an
  // escape sequence in the file does not reach the terminal.
  test::write_all(root / "latest", "\x1b[31mstep-9\a\n");
  const std::string said =
      test::captured_log([&] { CHECK(resolve_checkpoint(run) == (root / "step-8").string()); });
  CHECK_THAT(said, Contains("names '\\x1B[31mstep-9\\x07'"));
  CHECK(said.find('\x1b') == std::string::npos);
  fs::remove(root / "latest");
  fs::create_directory(root / "latest");
  CHECK_THROWS_WITH(resolve_checkpoint(run),
                    Contains("latest is not a regular file (a directory)"));
}

TEST_CASE("the checkpoint being resumed stays readable while its run prunes it",
          "[durable][checkpoint]") {
  Work w("pruned");
  const std::string run = w.path("run");
  train(small_config(w), run);
  auto src = open_resume_checkpoint(run + "/checkpoints/step-3");
  // The live run removes it as pruning does: renamed aside, then its files unlinked.
  fs::rename(fs::path(run) / "checkpoints" / "step-3",
             fs::path(run) / "checkpoints" / ".deleting-step-3-1");
  fs::remove_all(fs::path(run) / "checkpoints" / ".deleting-step-3-1");
  TrainOptions o;
  o.resume_source = src;
  o.resume = src->dir();
  o.run_dir = w.path("branch");
  run_training(resume_config(*src, "", {}), o);
  CHECK(test::read_all(w.path("branch") + "/model.safetensors") ==
        test::read_all(run + "/model.safetensors"));
}

TEST_CASE("a start removes what a run killed while writing its final files left",
          "[durable][checkpoint]") {
  Work w("tmp");
  const std::string run = w.path("run");
  train(small_config(w), run);
  for (const char* f : {"model.safetensors.tmp", "summary.json.tmp"})
    test::write_all(fs::path(run) / f, "half");
  resume(run, "", {"schedule.steps=9"});
  CHECK_FALSE(fs::exists(fs::path(run) / "model.safetensors.tmp"));
  CHECK_FALSE(fs::exists(fs::path(run) / "summary.json.tmp"));
}

TEST_CASE("one directory named twice is refused as such, not as another process's",
          "[durable][storage]") {
  Work w("twice");
  Config cfg = small_config(w);
  cfg.offload.ssd_paths = {w.path("run")};
  CHECK_THROWS_WITH(train(cfg, w.path("run")),
                    Contains("offload.ssd_paths[0]") && Contains("the run directory"));
  DirLock a(w.path("ssd"), "SSD store: directory");
  CHECK_THROWS_WITH(DirLock(w.path("ssd"), "SSD store: directory"),
                    Contains("already in use by this process"));
}

TEST_CASE("from-hf refuses NaN and infinite weights, naming the tensor and the element",
          "[durable][hf]") {
  Work w("nan");
  const fs::path src = w.root / "gpt2";
  fs::copy(test::hf_fixture("gpt2_f32"), src, fs::copy_options::recursive);
  for (auto& e : fs::directory_iterator(src))
    fs::permissions(e.path(), fs::perms::owner_all, fs::perm_options::add);
  SafetensorsReader r((src / "model.safetensors").string());
  const StTensorInfo& t = r.info("transformer.h.0.attn.c_proj.weight");
  unsigned char len[8];
  std::ifstream((src / "model.safetensors"), std::ios::binary)
      .read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | len[i];
  std::fstream f(src / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
  const float inf = std::numeric_limits<float>::infinity();
  f.seekp(static_cast<std::streamoff>(8 + n + t.begin + 4 * 5));
  f.write(reinterpret_cast<const char*>(&inf), 4);
  f.close();
  CHECK_THROWS_WITH(convert_hf_to_engine(src.string(), w.path("out"), {}),
                    Contains("transformer.h.0.attn.c_proj.weight") && Contains("NaN or infinite"));
  CHECK_FALSE(fs::exists(w.path("out")));
}

TEST_CASE("YAML aliases are bounded before the tree is walked", "[durable][config]") {
  // Nine lines, each naming the one before nine times: 9^9 nodes once expanded.
  std::string bomb = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i < 9; ++i) {
    bomb += str("a", i, ": &a", i, " [");
    for (int k = 0; k < 9; ++k) bomb += str(k ? ", " : "", "*a", i - 1);
    bomb += "]\n";
  }
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(parse_config(bomb, "bomb.yaml"),
                    Contains("bomb.yaml: line") && Contains("aliases"));
  CHECK_THROWS_WITH(parse_hardware_profile(bomb, "hw.yaml"),
                    Contains("hw.yaml: line") && Contains("aliases"));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  CHECK_THROWS_WITH(parse_config("a: &a [*a]\n", "self.yaml"), Contains("contains it"));
  // Aliases that stay small are still fine.
  Config c = parse_config("model: &m {n_layer: 2}\n", "ok.yaml");
  CHECK(c.model.n_layer == 2);
}

TEST_CASE("a tokenizer's normalizer cannot multiply its input beyond a bound",
          "[durable][tokenizer]") {
  const std::string vocab = R"("vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"])";
  const std::string sixty(60, 'a');
  std::string replaces;
  for (int i = 0; i < 4; ++i)
    replaces +=
        str(i ? ", " : "", R"({"type": "Replace", "pattern": {"String": "a"}, "content": ")", sixty,
            "\"}");
  Tokenizer t = Tokenizer::from_json(
      str(R"({"model": {"type": "BPE", )", vocab,
          R"(}, "normalizer": {"type": "Sequence", "normalizers": [)", replaces, "]}}"),
      "bomb.json");
  CHECK_THROWS_WITH(t.encode(std::string(57, 'a')),
                    Contains("bomb.json: normalizer.normalizers[1]") && Contains("Replace") &&
                        Contains("beyond"));
  CHECK(t.encode("b").size() == 1);  // what does not grow still encodes
  CHECK_THROWS_WITH(
      Tokenizer::from_json(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 0}, "merges": []}})",
                           "dup.json"),
      Contains("both have id 0"));
  CHECK_THROWS_WITH(
      Tokenizer::from_json(
          R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [], "unk_token": "<unk>"}})",
          "unk.json"),
      Contains("unk_token") && Contains("not in the vocabulary"));
}

TEST_CASE("a safetensors header that names a key twice is refused", "[durable][formats]") {
  Work w("dupkey");
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  file += header + std::string(4, '\0');
  test::write_all(w.root / "dup.safetensors", file);
  CHECK_THROWS_WITH(SafetensorsReader(w.path("dup.safetensors")), Contains("names 'a' twice"));
}

TEST_CASE("data and thread counts that cannot work are refused before anything starts",
          "[durable][budgets]") {
  Work w("bounds");
  CHECK_THROWS_WITH(build_text_shards({"/dev/zero"}, w.path("out"), 0.1),
                    Contains("/dev/zero: not a regular file"));
  Config cfg = small_config(w);
  cfg.runtime.threads = 4096;
  CHECK_THROWS_WITH(make_backend(cfg, nullptr),
                    Contains("runtime.threads is 4096") && Contains("per CPU"));
  // A micro-batch whose activations (the CPU backend's arena, in host memory) exceed this
  // machine's physical memory, with no offload.host_memory set: refused with the figures before
  // the arena is allocated, and the run directory is not left behind.
  Config big = small_config(
      w, {"model.seq_len=256", "model.n_layer=8", "model.n_head=4", "schedule.micro_batch=65536"});
  const uint64_t physical =
      uint64_t(::sysconf(_SC_PHYS_PAGES)) * uint64_t(::sysconf(_SC_PAGE_SIZE));
  REQUIRE(in_memory_host_bytes(big.model, 65536, true, 4) > physical);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(train(big, w.path("big")),
                    Contains("in-memory training needs") &&
                        Contains(str("this machine has ", format_size(physical))) &&
                        Contains("schedule.micro_batch (65536)"));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
  CHECK_FALSE(fs::exists(w.path("big")));
}
