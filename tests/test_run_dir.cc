// A run directory a user can trust: checkpoint.keep_best keeps the lowest-loss checkpoint
// whatever checkpoints/best says; --resume-or-start starts over a run killed before its first
// checkpoint; a manifest's version cannot be edited to skip its checksums; and every refusal
// changes nothing in the directory. (--dry-run's refusals: tests/dry_run_refusals.sh.)
#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "fuyou/checkpoint.h"
#include "fuyou/error.h"
#include "fuyou/rng.h"
#include "fuyou/train.h"
#include "run_dir_support.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;
using Catch::Matchers::Contains;

namespace {

using test::BestRun;
using test::snapshot;

// name -> recorded validation loss of every complete checkpoint of `run`.
std::map<std::string, double> recorded_losses(const std::string& run) {
  std::map<std::string, double> out;
  for (const auto& c : list_checkpoints(run))
    out[fs::path(c).filename().string()] = read_checkpoint_manifest(c).progress.last_val_loss;
  return out;
}

}  // namespace

TEST_CASE("keep_best keeps the lowest-loss checkpoint when best is missing or damaged",
          "[rundir][keep_best]") {
  BestRun b;
  b.train();
  const auto first = recorded_losses(b.run);
  REQUIRE(first.count("step-4"));
  REQUIRE(test::read_all(b.run + "/checkpoints/best") == "step-4\n");
  const fs::path saved = b.tmp.path + "/saved";
  fs::copy(b.run, saved, fs::copy_options::recursive);

  const std::vector<std::pair<std::string, std::string>> damages = {
      {"", "is missing"},
      {"step-999\n", "names 'step-999', which is not a complete checkpoint"},
      {"step-5\x07\x1b[31m\n", "names 'step-5\\x07\\x1B[31m'"},
      {"../../other/checkpoints/step-4\n", "which is not a checkpoint name of this run"},
  };
  for (const auto& [text, said] : damages) {
    INFO("best: '" << printable(text) << "'");
    fs::remove_all(b.run);
    fs::copy(saved, b.run, fs::copy_options::recursive);
    const fs::path best = fs::path(b.run) / "checkpoints" / "best";
    if (text.empty())
      fs::remove(best);
    else
      test::write_all(best, text);
    const std::string log = test::captured_log([&] { b.resume_to(b.run, 8, b.noise); });
    CHECK_THAT(log, Contains(said) && Contains("the best is step-4"));
    CHECK_THAT(log, !Contains("step-6 is the best so far"));
    // Validated on noise, steps 6 and 8 are worse: step-4 stays beside the newest.
    const auto kept = recorded_losses(b.run);
    CHECK(kept.count("step-4"));
    CHECK(kept.count("step-8"));
    CHECK(kept.size() == 2);
    CHECK(test::read_all(best) == "step-4\n");
  }
}

TEST_CASE("a best that is not a file is refused before the run directory changes",
          "[rundir][keep_best]") {
  BestRun b;
  b.train();
  const fs::path best = fs::path(b.run) / "checkpoints" / "best";
  for (const char* kind : {"a directory", "a special file"}) {
    INFO(kind);
    fs::remove_all(best);
    if (std::string(kind) == "a directory")
      fs::create_directory(best);
    else
      REQUIRE(::mkfifo(best.c_str(), 0600) == 0);
    const auto before = snapshot(b.run);
    CHECK_THROWS_WITH(b.resume_to(b.run, 8, b.noise),
                      Contains(str("best is not a regular file (", kind, ")")));
    CHECK(snapshot(b.run) == before);  // config.yaml and metrics.jsonl included
  }
}

TEST_CASE("torture: best damaged at random between resumes, the lowest-loss checkpoint survives",
          "[rundir][keep_best]") {
  BestRun b;
  b.train();
  Rng rng(54);
  std::string lowest;
  double lowest_loss = 0;
  const auto remember = [&] {
    for (const auto& [name, loss] : recorded_losses(b.run))
      if (lowest.empty() || loss < lowest_loss) {
        lowest = name;
        lowest_loss = loss;
      }
  };
  remember();
  const fs::path best = fs::path(b.run) / "checkpoints" / "best";
  for (int64_t steps = 6; steps <= 20; steps += 2) {
    // Damage: removed, garbage, a step that does not exist, outside the run, or the newest
    // (a worse, complete checkpoint).
    switch (rng.below(5)) {
      case 0:
        fs::remove(best);
        break;
      case 1:
        test::write_all(best, "\x01\x02garbage");
        break;
      case 2:
        test::write_all(best, "step-999999\n");
        break;
      case 3:
        test::write_all(best, "../../elsewhere/step-2\n");
        break;
      default:
        test::write_all(best, fs::path(list_checkpoints(b.run).back()).filename().string());
    }
    b.resume_to(b.run, steps, rng.below(3) == 0 ? b.clean : b.noise);
    // The lowest recorded loss of every checkpoint ever written, this resume's included: an
    // older best may go only once a later checkpoint records less.
    remember();
    INFO("after the resume to step " << steps << ": lowest " << lowest << " (" << lowest_loss
                                     << ")");
    CHECK(recorded_losses(b.run).count(lowest));
    CHECK(test::read_all(best) == lowest + "\n");
  }
}

TEST_CASE(
    "resume-or-start starts over a run killed before its first checkpoint, keeping its metrics",
    "[rundir][restart]") {
  BestRun b;
  // What a run killed in its first half hour leaves: its lock, config, data and metrics, and a
  // checkpoint half-written in staging.
  TrainOptions first;
  first.run_dir = b.run;
  run_training(b.config(), first);
  const fs::path run(b.run);
  fs::remove(run / "model.safetensors");
  fs::remove(run / "summary.json");
  fs::remove_all(run / "checkpoints");  // the final step's
  test::write_all(run / "fuyou.lock", "123456\n");
  fs::create_directories(run / "checkpoints" / ".staging-step-2-123456");
  test::write_all(run / "checkpoints" / ".staging-step-2-123456" / "model.safetensors.tmp", "x");
  const std::string old_metrics = test::read_all(run / "metrics.jsonl");
  REQUIRE(list_checkpoints(b.run).empty());

  // Anything else beside them: refused, naming it, and nothing changes.
  test::write_all(run / "checkpoints" / "notes.txt", "mine");
  TrainOptions o;
  o.run_dir = b.run;
  o.restart_killed = true;
  const auto before = snapshot(run);
  CHECK_THROWS_WITH(run_training(b.config(), o),
                    Contains("not a killed run's own (checkpoints/notes.txt)"));
  CHECK(snapshot(run) == before);
  // A plain new run is refused too, naming the files.
  TrainOptions plain;
  plain.run_dir = b.run;
  CHECK_THROWS_WITH(
      run_training(b.config(), plain),
      Contains("already holds files (checkpoints, config.yaml, curves.svg, metrics.jsonl)"));
  CHECK(snapshot(run) == before);

  fs::remove(run / "checkpoints" / "notes.txt");
  const std::string said = test::captured_log([&] { run_training(b.config(), o); });
  CHECK_THAT(said, Contains("only the files of a run killed before its first one: starting over"));
  std::vector<fs::path> aside;
  for (const auto& e : fs::directory_iterator(run))
    if (e.path().filename().string().rfind("restarted-", 0) == 0) aside.push_back(e.path());
  REQUIRE(aside.size() == 1);
  CHECK(test::read_all(aside[0] / "metrics.jsonl") == old_metrics);
  CHECK(fs::exists(aside[0] / "config.yaml"));
  CHECK(fs::exists(run / "checkpoints" / "step-4" / "manifest.json"));
  CHECK(!fs::exists(run / "checkpoints" / ".staging-step-2-123456"));
  CHECK(fs::exists(run / "summary.json"));
}

TEST_CASE("a manifest's version cannot be edited to switch its checksums off",
          "[rundir][manifest]") {
  BestRun b;
  b.train();
  const fs::path ck = fs::path(b.run) / "checkpoints" / "step-4";
  const fs::path saved = b.tmp.path + "/saved";
  fs::copy(ck, saved, fs::copy_options::recursive);
  const auto edit = [&](const char* file, const std::string& from, const std::string& to) {
    std::string t = test::read_all(ck / file);
    REQUIRE(t.find(from) != std::string::npos);
    test::write_all(ck / file, t.replace(t.find(from), from.size(), to));
  };
  const auto refused = [&](const std::string& why) {
    INFO(why);
    const auto before = snapshot(b.run);
    CHECK_THROWS_WITH(b.resume_to(b.run, 8, b.clean), Contains(why));
    CHECK(snapshot(b.run) == before);
    fs::remove_all(ck);
    fs::copy(saved, ck, fs::copy_options::recursive);
  };
  // The version alone, and with an edited lr that version 1 would not have verified.
  edit("manifest.json", "\"version\": 2", "\"version\": 1");
  edit("config.yaml", "lr: 0.003", "lr: 0.009");  // same length
  refused("version 1, but it carries the checksums version 2 added");
  // The checksums removed too, as a careful edit would: the tensor files say version 2.
  auto j = nlohmann::json::parse(test::read_all(ck / "manifest.json"));
  j["version"] = 1;
  j.erase("xxh3");
  for (auto& f : j["files"]) f.erase("xxh3");
  test::write_all(ck / "manifest.json", j.dump(2));
  edit("config.yaml", "lr: 0.003", "lr: 0.009");  // same length
  refused("model.safetensors was written as part of a version 2 checkpoint");
}
