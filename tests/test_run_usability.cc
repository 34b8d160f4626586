// What a user meets around a fine-tune, each friction with its test: shards tokenized with
// another vocabulary, JSON Lines without a field option, typed and timestamped metrics, the
// final line without validation, --set errors that name the --set, fine-tuning defaults and
// learning-rate schedules, samples during training, --eval-only and checkpoint.keep_best.

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "fuyou/checkpoint.h"
#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/generate.h"
#include "fuyou/hf_checkpoint.h"
#include "fuyou/log.h"
#include "fuyou/optim.h"
#include "fuyou/rng.h"
#include "fuyou/tokenizer.h"
#include "fuyou/train.h"
#include "hf_support.h"
#include "run_dir_support.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;
using namespace fuyou::test;
using Catch::Matchers::Contains;

namespace {

std::string tiny_model(int vocab) {
  return str("model: {n_layer: 2, n_head: 2, d_model: 32, d_ff: 64, vocab_size: ", vocab,
             ", seq_len: 16}\n");
}

std::vector<nlohmann::json> jsonl(const fs::path& p) {
  std::vector<nlohmann::json> out;
  std::ifstream in(p);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace

TEST_CASE("shards tokenized with another vocabulary are refused naming both", "[usability]") {
  TempDir tmp("vocab");
  const std::string small = random_shard(tmp.path + "/small.tok", 100, 4000, 1);
  Config cfg = parse_config(
      tiny_model(128) + "data: {train_shards: [" + small + "]}\n" +
          "schedule: {steps: 1, micro_batch: 2}\nruntime: {backend: cpu, threads: 2}\n",
      "<test>");
  TrainOptions o;
  o.run_dir = tmp.path + "/run";
  CHECK_THROWS_WITH(run_training(cfg, o), Contains("small.tok") &&
                                              Contains("vocabulary of 100 tokens") &&
                                              Contains("the model has 128 (model.vocab_size)"));

  // With the base model's tokenizer carried into the run, shards must match it: a model may
  // pad its vocabulary beyond the tokenizer's (520 > 512), a shard of the model's size is
  // then another tokenizer's.
  const std::string base = tmp.path + "/base";
  fs::create_directories(base);
  random_shard(base + "/data.tok", 520, 4000, 2);
  Config b = parse_config(
      tiny_model(520) + "data: {train_shards: [" + base + "/data.tok]}\n" +
          "schedule: {steps: 1, micro_batch: 2}\nruntime: {backend: cpu, threads: 2}\n",
      "<test>");
  TrainOptions ob;
  ob.run_dir = base + "/run";
  run_training(b, ob);
  fs::copy_file(hf_fixture("tok_bytelevel.json"), ob.run_dir + "/tokenizer.json");  // 512 tokens
  const std::string ok = random_shard(tmp.path + "/ok.tok", 512, 4000, 3);
  const std::string wrong = random_shard(tmp.path + "/wrong.tok", 520, 4000, 4);
  for (const auto& [shard, refused] : {std::pair{ok, false}, std::pair{wrong, true}}) {
    INFO(shard);
    Config f = parse_config(
        str("model: {checkpoint: ", ob.run_dir, "}\ndata: {train_shards: [", shard,
            "]}\nschedule: {steps: 1, micro_batch: 2}\nruntime: {backend: cpu, threads: 2}\n"),
        "<test>");
    TrainOptions of;
    of.run_dir = tmp.path + "/ft-" + fs::path(shard).stem().string();
    if (refused) {
      CHECK_THROWS_WITH(run_training(f, of), Contains("vocabulary of 520 tokens") &&
                                                 Contains("has 512") && Contains("tokenizer.json"));
    } else {
      CHECK_NOTHROW(run_training(f, of));
      // The tokenizer travels with the run and its checkpoints.
      CHECK(fs::exists(of.run_dir + "/tokenizer.json"));
    }
  }
}

TEST_CASE("a .jsonl tokenized without a field option is refused with the options", "[usability]") {
  TempDir tmp("jsonl");
  write_all(tmp.path + "/pairs.jsonl",
            "\n{\"question\": \"why?\", \"answer\": \"because\", \"n\": 3}\n");
  const Tokenizer tok = Tokenizer::from_file(hf_fixture("tok_bytelevel.json"));
  CHECK_THROWS_WITH(
      build_tokenized_dataset(tok, {tmp.path + "/pairs.jsonl"}, tmp.path + "/out", {}),
      Contains("pairs.jsonl") && Contains("--jsonl-field") && Contains("--prompt-field") &&
          Contains("string fields: answer, question"));
  CHECK_FALSE(fs::exists(tmp.path + "/out"));  // a refusal writes nothing
  DatasetOptions o;
  o.jsonl_field = "answer";
  CHECK_NOTHROW(build_tokenized_dataset(tok, {tmp.path + "/pairs.jsonl"}, tmp.path + "/out", o));
}

TEST_CASE("errors of a set override name the --set, on a resume too", "[usability]") {
  CHECK_THROWS_WITH(parse_config("", "<default>", {"schedule.steps=abc"}),
                    Contains("--set 'schedule.steps=abc': schedule.steps: expected an integer") &&
                        !Contains("<default>"));
  CHECK_THROWS_WITH(parse_config("", "<default>", {"schedule.stpes=3"}),
                    Contains("--set 'schedule.stpes=3': unknown key 'schedule.stpes'"));
  // A rule broken by another key's --set says which one.
  CHECK_THROWS_WITH(
      parse_config("schedule: {warmup_steps: 40}\n", "cfg.yaml", {"schedule.steps=10"}),
      Contains("cfg.yaml: schedule.warmup_steps") &&
          Contains("schedule.steps is from --set 'schedule.steps=10'"));
  // A value from the file is still the file's.
  CHECK_THROWS_WITH(parse_config("schedule: {steps: -1}\n", "cfg.yaml", {}),
                    Contains("cfg.yaml: schedule.steps"));

  TempDir tmp("set-resume");
  const std::string shard = random_shard(tmp.path + "/d.tok", 64, 4000, 5);
  Config cfg =
      parse_config(tiny_model(64) + "data: {train_shards: [" + shard + "]}\n" +
                       "schedule: {steps: 2, warmup_steps: 1, micro_batch: 2}\n"
                       "runtime: {backend: cpu, threads: 2}\ncheckpoint: {every_steps: 2}\n",
                   "<test>");
  TrainOptions o;
  o.run_dir = tmp.path + "/run";
  run_training(cfg, o);
  const std::string ck = resolve_checkpoint(o.run_dir);
  CHECK_THROWS_WITH(resume_config(ck, "", {"schedule.steps=many"}),
                    Contains("--set 'schedule.steps=many'") && !Contains("config.yaml"));
}

TEST_CASE("metrics lines are typed and timestamped, and a run without validation says so",
          "[usability]") {
  TempDir tmp("metrics");
  const std::string shard = random_shard(tmp.path + "/d.tok", 64, 4000, 6);
  const std::string val = random_shard(tmp.path + "/v.tok", 64, 400, 7);
  const std::string common =
      "schedule: {steps: 4, warmup_steps: 1, micro_batch: 2, eval_every: 2, eval_batches: 1}\n"
      "runtime: {backend: cpu, threads: 2}\n";
  Config cfg = parse_config(tiny_model(64) + "data: {train_shards: [" + shard + "], val_shards: [" +
                                val + "]}\n" + common,
                            "<test>");
  TrainOptions o;
  o.run_dir = tmp.path + "/run";
  std::string log = captured_log([&] { run_training(cfg, o); });
  const std::regex utc(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)");
  int train = 0, vals = 0;
  for (const auto& j : jsonl(o.run_dir + "/metrics.jsonl")) {
    REQUIRE(j.contains("time"));
    CHECK(std::regex_match(j["time"].get<std::string>(), utc));
    const std::string type = j["type"];
    if (type == "train") CHECK((++train, j.contains("loss")));
    if (type == "val") CHECK((++vals, j.contains("val_loss")));
    CHECK((type == "train" || type == "val"));
  }
  CHECK(train == 4);
  CHECK(vals == 3);  // steps 0, 2, 4
  CHECK(log.find("validation loss") != std::string::npos);

  // Without a validation split the last line says so instead of "0.0000 -> 0.0000".
  Config nov =
      parse_config(tiny_model(64) + "data: {train_shards: [" + shard + "]}\n" + common, "<test>");
  TrainOptions on;
  on.run_dir = tmp.path + "/noval";
  log = captured_log([&] { run_training(nov, on); });
  CHECK(log.find("no validation") != std::string::npos);
  CHECK(log.find("0.0000 -> 0.0000") == std::string::npos);
}

TEST_CASE("a fine-tune gets fine-tuning defaults, and schedules beside cosine", "[usability]") {
  TempDir tmp("ft-defaults");
  const std::string shard = random_shard(tmp.path + "/d.tok", 64, 4000, 8);
  Config base = parse_config(
      tiny_model(64) + "data: {train_shards: [" + shard + "]}\n" +
          "schedule: {steps: 1, micro_batch: 2}\nruntime: {backend: cpu, threads: 2}\n",
      "<test>");
  CHECK(base.optimizer.lr == 1e-3);  // pretraining defaults stay
  CHECK(base.optimizer.weight_decay == 0.1);
  CHECK(base.schedule.warmup_steps == 1);  // 20, but at most steps
  TrainOptions o;
  o.run_dir = tmp.path + "/base";
  run_training(base, o);
  const std::string ft =
      str("model: {checkpoint: ", o.run_dir, "}\ndata: {train_shards: [", shard, "]}\n");
  Config c = parse_config(ft + "schedule: {steps: 1000}\n", "<test>");
  CHECK(c.optimizer.lr == 2e-5);
  CHECK(c.optimizer.min_lr == 2e-6);
  CHECK(c.optimizer.weight_decay == 0.0);
  CHECK(c.schedule.warmup_steps == kFineTuneWarmupSteps);
  CHECK(parse_config(ft + "schedule: {steps: 4}\n", "<test>").schedule.warmup_steps == 4);
  // A resume that trains longer keeps the fine-tune's warmup.
  CHECK(parse_config(ft + "schedule: {steps: 5000}\n", "<test>").schedule.warmup_steps ==
        c.schedule.warmup_steps);
  Config given = parse_config(
      ft + "optimizer: {lr: 1.0e-4, weight_decay: 0.05}\nschedule: {warmup_steps: 7}\n", "<test>");
  CHECK(given.optimizer.lr == 1e-4);
  CHECK(given.optimizer.min_lr == Approx(1e-5));  // a tenth of the lr given
  CHECK(given.optimizer.weight_decay == 0.05);
  CHECK(given.schedule.warmup_steps == 7);
  // A run directory records them: its resume keeps them, fine-tune or not.
  const std::string yaml = config_to_self_contained_yaml(c);
  CHECK(parse_config(yaml, "<run>").optimizer.lr == 2e-5);

  OptimizerConfig opt;
  opt.lr = 1.0;
  opt.min_lr = 0.2;
  ScheduleConfig s;
  s.steps = 10;
  s.warmup_steps = 2;
  s.lr_decay = "linear";
  CHECK(learning_rate(opt, s, 1) == Approx(1.0));
  CHECK(learning_rate(opt, s, 6) == Approx(1.0 - 0.8 * 0.5));
  CHECK(learning_rate(opt, s, 10) == Approx(0.2));
  s.lr_decay = "constant";
  CHECK(learning_rate(opt, s, 9) == 1.0);
  CHECK_THROWS_WITH(parse_config("schedule: {lr_decay: step}\n", "<test>"),
                    Contains("schedule.lr_decay") && Contains("cosine, linear, constant"));
}

TEST_CASE("samples during training, --eval-only and checkpoint.keep_best", "[usability]") {
  BestRun b("samples");
  const TrainSummary s = b.train("sample_every: 2, sample_prompts: [ab, 'the '], sample_tokens: 5");

  // Samples at steps 0, 2, 4: greedy continuations with the weights of that step; the last
  // equal fuyou-generate's from the run's final weights.
  auto lines = jsonl(b.run + "/samples.jsonl");
  REQUIRE(lines.size() == 6);
  CHECK(lines[0]["step"] == 0);
  CHECK(lines[5]["step"] == 4);
  GenerationModel m = load_generation_model(b.run);
  const TextCodec codec = TextCodec::for_model(m.files, m.model);
  auto be = make_cpu_backend(2, 0);
  GptDecoder dec(m.model, *be, 16);
  dec.set_params(m.params.data());
  GenerateOptions g;
  g.max_new_tokens = 5;
  for (int i = 0; i < 2; ++i) {
    const auto& line = lines[4 + i];
    GenerateResult r =
        generate_tokens(dec, codec.encode_prompt(line["prompt"]), codec.stop_ids(), g);
    CHECK(line["ids"].get<std::vector<int32_t>>() == r.ids);
    CHECK(line["text"] == codec.decode(r.ids));
  }

  // --eval-only of the last checkpoint: the loss the run logged at that step, bit for bit.
  TrainOptions e;
  e.eval_only = true;
  e.resume = resolve_checkpoint(b.run);
  TrainSummary ev = run_training(resume_config(e.resume, "", {}), e);
  CHECK(ev.final_val_loss == s.final_val_loss);
  CHECK(ev.steps == 4);

  // keep_best: resumed on noisier validation data, later checkpoints are worse; the best
  // (step 4, validated on the clean data) stays beside the newest, keep: 1 notwithstanding.
  b.resume_to(b.run, 8, b.noise);
  std::vector<std::string> kept;
  for (const auto& c : list_checkpoints(b.run)) kept.push_back(fs::path(c).filename().string());
  CHECK(kept == std::vector<std::string>{"step-4", "step-8"});
  CHECK(read_all(b.run + "/checkpoints/best") == "step-4\n");
}

namespace {

// Records of 3 to 14 tokens, each a run of a short cycle from its own start, in `path` with
// its record index beside it (as fuyou-convert tokenize writes JSON Lines data).
std::string record_shard(const std::string& path, int records, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t;
  std::vector<uint64_t> starts;
  for (int r = 0; r < records; ++r) {
    starts.push_back(t.size());
    const int len = 3 + static_cast<int>(rng.below(12)), from = static_cast<int>(rng.below(23));
    for (int i = 0; i < len; ++i) t.push_back((from + i) * 7 % 23);
  }
  write_token_shard(path, t, 256);
  write_record_index(fs::path(path).replace_extension(".rec").string(), starts);
  return path;
}

// The validation loss metrics.jsonl logged last.
double logged_val_loss(const std::string& run_dir) {
  double v = std::nan("");
  for (const auto& line : jsonl(fs::path(run_dir) / "metrics.jsonl"))
    if (line["type"] == "val") v = line["val_loss"].get<double>();
  return v;
}

}  // namespace

TEST_CASE("eval-only gives the logged validation loss bit for bit, on records and token streams",
          "[usability]") {
  TempDir tmp("eval-only");
  const std::string train_rec = record_shard(tmp.path + "/train.tok", 60, 1),
                    val_rec = record_shard(tmp.path + "/val.tok", 12, 2);
  const std::string train_stream = pattern_shard(tmp.path + "/s.tok", 256, 3000),
                    val_stream = pattern_shard(tmp.path + "/sv.tok", 256, 400);
  const std::string rest =
      "optimizer: {lr: 3.0e-3}\nruntime: {backend: cpu, threads: 2}\n"
      "checkpoint: {every_steps: 100, every_minutes: 0}\n";
  // Records under schedule.epochs: every validation record whole, in its own segment.
  // Token streams: the fixed windows of schedule.eval_batches.
  for (const bool records : {true, false}) {
    INFO((records ? "records" : "token stream"));
    const std::string data =
        records ? str("data: {train_shards: [", train_rec, "], val_shards: [", val_rec, "]}\n",
                      "schedule: {epochs: 2, micro_batch: 2, warmup_steps: 1, eval_batches: 50}\n")
                : str("data: {train_shards: [", train_stream, "], val_shards: [", val_stream,
                      "]}\nschedule: {steps: 6, micro_batch: 2, warmup_steps: 1, "
                      "eval_batches: 3}\n");
    TrainOptions o;
    o.run_dir = tmp.path + (records ? "/run-records" : "/run-stream");
    const TrainSummary s = run_training(parse_config(tiny_model(256) + data + rest, "<test>"), o);
    const double logged = logged_val_loss(o.run_dir);
    REQUIRE(std::isfinite(logged));
    CHECK(logged == s.final_val_loss);
    CHECK(logged < s.first_val_loss);  // it trained: the final weights are not the start's
    // The run directory shows its curves (include/fuyou/curves.h).
    CHECK_THAT(read_all(o.run_dir + "/curves.svg"), Contains("<polyline"));

    TrainOptions e;
    e.eval_only = true;
    e.resume = resolve_checkpoint(o.run_dir);
    const TrainSummary ev = run_training(resume_config(e.resume, "", {}), e);
    CHECK(ev.final_val_loss == logged);  // bit for bit
    CHECK(ev.steps == s.steps);
    // Without the training shards, the validation shards' own index decides, as it did.
    const TrainSummary only_val =
        run_training(resume_config(e.resume, "", {"data.train_shards=[]"}), e);
    CHECK(only_val.final_val_loss == logged);
  }

  // A run on records validates records only: validation shards without an index have no
  // validation loss to give.
  TrainOptions e;
  e.eval_only = true;
  e.resume = resolve_checkpoint(tmp.path + "/run-records");
  CHECK_THROWS_WITH(
      run_training(resume_config(e.resume, "", {str("data.val_shards=[", val_stream, "]")}), e),
      Contains("validates records only"));
}
