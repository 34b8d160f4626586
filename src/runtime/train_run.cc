// run_training: one run of fuyou-train, new or resumed. A TrainingRun holds what the phases
// share (run directory, data, engine, metrics, progress); each phase is a method: the run
// directory, the data, the engine, preflight, the starting state (initialised or restored),
// the loop (steps, metrics, validation, checkpoints, stop requests), the final weights.
//
// Start-up checks everything before it changes anything in the run directory: a resume that
// is refused (its config, its data, the disk space, a damaged checkpoint) leaves the directory
// as it was, and a new run that fails or is stopped before training begins leaves it as it
// found it (empty, or not there), so the same command can be given again.
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "fuyou/backend_select.h"
#include "fuyou/checkpoint.h"
#include "fuyou/curves.h"
#include "fuyou/data.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/hf_checkpoint.h"
#include "fuyou/log.h"
#include "fuyou/read_file.h"
#include "fuyou/safetensors.h"
#include "fuyou/sizes.h"
#include "fuyou/stop.h"
#include "fuyou/timing.h"
#include "fuyou/tokenizer.h"
#include "fuyou/train.h"
#include "src/runtime/checkpoint_dirs.h"
#include "src/runtime/metrics_log.h"
#include "src/runtime/run_checks.h"
#include "src/runtime/run_dir.h"
#include "src/runtime/train_samples.h"
#include "src/storage/dir_lock.h"

namespace fs = std::filesystem;

namespace fuyou {
namespace {

using clock_type = std::chrono::steady_clock;

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  long t = static_cast<long>(s + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", t / 3600, t / 60 % 60);
  else if (t >= 60)
    std::snprintf(buf, sizeof buf, "%ldm%02lds", t / 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%lds", t);
  return buf;
}

std::string utc_now() {
  std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return buf;
}

constexpr const char* kStartingUp =
    "while starting, before training began (nothing was trained, so there is no "
    "checkpoint)";
// What the first stop signal says it will do, by phase (StopSignals::set_graceful).
constexpr const char* kStartingMessage =
    "stopping before training begins (nothing is trained yet, so no checkpoint "
    "is written)";
constexpr const char* kTrainingMessage =
    "stopping after this step; a checkpoint and the weights follow";

// Token shards concatenated, and their loss masks: a shard X.tok with X.mask beside it
// (fuyou-convert tokenize with --prompt-field/--completion-field) contributes its mask, one
// without contributes all ones (every target counts). When no shard has a mask, *mask stays
// empty and training runs exactly as without masks. Record indexes (X.rec, JSON Lines data)
// go into *records, offset to the concatenation: every shard of the list has one, or none.
// `tokenizer` is the run's tokenizer.json (carried from the base model), or empty: a shard
// must have been tokenized with it, so its vocabulary size is the tokenizer's (a model may pad
// its vocabulary beyond that); without one, the model's.
std::vector<int32_t> load_shards(const std::vector<std::string>& paths, int vocab_size,
                                 const std::string& tokenizer, uint32_t tokenizer_vocab,
                                 std::vector<uint8_t>* mask, std::vector<uint64_t>* records,
                                 const StopSignals* stop) {
  std::vector<int32_t> all;
  mask->clear();
  records->clear();
  bool any_mask = false;
  size_t with_records = 0;
  for (const auto& p : paths) {
    if (stop) stop->check(kStartingUp);
    std::error_code ec;
    if (!fs::is_regular_file(p, ec))  // a FIFO or a device could block or never end
      throw IoError(str(p, fs::exists(p, ec) ? ": not a regular file; token shards are files"
                                             : ": no such file"));
    TokenShard s = read_token_shard(p);
    check_shard_vocab(p, s.vocab_size, vocab_size, tokenizer, tokenizer_vocab);
    const std::string mask_path = fs::path(p).replace_extension(".mask").string();
    std::vector<uint8_t> m;
    if (mask_path != p && fs::exists(mask_path)) {
      m = read_loss_mask(mask_path).mask;
      if (m.size() != s.tokens.size())
        throw IoError(str(mask_path, ": loss mask has ", m.size(), " entries but its shard ", p,
                          " has ", s.tokens.size(), " tokens"));
      spdlog::info("data: {}: loss mask {} ({} of {} tokens count)", p, mask_path,
                   std::count(m.begin(), m.end(), uint8_t{1}), m.size());
      if (!any_mask) mask->assign(all.size(), 1);  // earlier shards had none: all count
      any_mask = true;
    } else {
      m.assign(s.tokens.size(), 1);
    }
    if (any_mask) mask->insert(mask->end(), m.begin(), m.end());
    const std::string rec_path = fs::path(p).replace_extension(".rec").string();
    if (rec_path != p && fs::exists(rec_path)) {
      ++with_records;
      for (uint64_t start : read_record_index(rec_path, s.tokens.size()))
        records->push_back(all.size() + start);
    }
    all.insert(all.end(), s.tokens.begin(), s.tokens.end());
  }
  if (with_records && with_records != paths.size())
    throw ConfigError(str(
        "data: ", with_records, " of the ", paths.size(),
        " shards have a record index (.rec) beside them; records and plain token streams do not "
        "mix in one split (retokenize the others as JSON Lines, or leave the .rec files out)"));
  return all;
}

// metrics.jsonl of a run resumed at `step`: the lines of steps after it belong to the
// trajectory the resume abandons, and a last line cut by a kill is not JSON; both go.
void truncate_metrics(const fs::path& path, int64_t step) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return;
  std::ifstream in(path);
  std::string line, kept;
  size_t dropped = 0;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded() && j.contains("step") && j["step"].is_number_integer() &&
        j["step"].get<int64_t>() <= step)
      kept += line + "\n";
    else
      ++dropped;
  }
  write_file_atomic(path.string(), kept.data(), kept.size());
  if (dropped)
    spdlog::info("metrics: {}: dropped {} line(s) after step {}", path.string(), dropped, step);
}

// What the first stop signal does in each phase of a run (StopSignals::set_graceful), and, when
// the run returns however it returns, back to the default: a signal ends the process at once,
// and no path of this run is removed by it.
class StopPhase {
 public:
  explicit StopPhase(StopSignals* stop) : stop_(stop) {}
  ~StopPhase() {
    if (!stop_) return;
    stop_->set_at_once();
    stop_->set_cleanup_paths({});
  }
  void set(const std::string& message) {
    if (stop_) stop_->set_graceful(message);
  }

 private:
  StopSignals* stop_;
};

class TrainingRun {
 public:
  TrainingRun(const Config& cfg, const TrainOptions& opts) : cfg_(cfg), opts_(opts) {}
  TrainSummary run();
  // --eval-only: the validation loss of the model the config starts from (model.checkpoint,
  // or the --resume checkpoint), nothing written.
  TrainSummary evaluate_only();

 private:
  std::string eval_model_dir() const;
  void start();
  void open_resume();
  void claim_run_dir();
  void commit_run_dir();
  void abandon();
  void remove_start_debris();
  void set_cleanup(bool finishing = false);
  void check_stop() const {
    if (opts_.stop) opts_.stop->check(kStartingUp);
  }
  void carry_model_files();
  void load_data();
  bool eval_reads_records() const;
  void load_records();
  void load_train_records();
  void load_val_records();
  void check_resumed_position() const;
  void make_engine();
  void preflight();
  void start_state();
  void setup_validation();
  bool evaluate(int64_t step, double* loss);
  StepResult train_step(int64_t s);
  void log_step(int64_t step, const StepResult& r, double dt);
  bool checkpoint_due(int64_t step) const;
  void checkpoint(int64_t step);
  void finish(clock_type::time_point start);
  void keep_if_best(int64_t step);
  void find_best();
  void restore_best();
  // Every line says what it is ("train", "val") and when it was written (UTC).
  void metrics_line(nlohmann::json j, const char* type);
  void write_curves();
  void log(const std::string& line) {
    if (opts_.progress_line) std::fprintf(stderr, "\n");
    spdlog::info("{}", line);
  }

  Config cfg_;
  TrainOptions opts_;
  StopPhase phase_{opts_.stop};
  TrainSummary sum_;
  fs::path dir_;
  bool created_dir_ = false;     // this process created dir_
  bool fresh_ = false;           // dir_ was new or empty: everything in it is this run's
  bool restart_killed_ = false;  // dir_ holds a killed run's files, set aside at the commit
  bool committed_ = false;       // the run directory has been changed (commit_run_dir)
  bool trained_ = false;  // dir_ holds progress: a step completed, or a checkpoint is written
  std::unique_ptr<DirLock> lock_;
  std::shared_ptr<const CheckpointSource> source_;  // the checkpoint resumed from
  CheckpointManifest resumed_;
  std::string carry_from_;  // where the base model's files come from (carry_model_files)
  bool same_run_ = false;   // a resume continuing in its checkpoint's run directory
  fs::path data_staging_;   // text data tokenized before the run directory is committed to
  std::unique_ptr<Backend> backend_;
  std::vector<int32_t> train_tokens_, val_tokens_;
  std::vector<uint8_t> train_mask_, val_mask_;       // empty: every target counts
  std::vector<uint64_t> train_starts_, val_starts_;  // record indexes; empty: token streams
  DataIdentity data_id_;
  std::unique_ptr<BatchSampler> train_sampler_, val_sampler_;
  // Record data (docs/data.md, "Records"): whole records packed into rows.
  std::unique_ptr<RecordSampler> train_records_, val_records_;
  int64_t val_micro_batches_ = 0;  // micro-batches of one validation pass over records
  uint64_t records_limit_ = 0;     // where the training record stream ends (schedule.epochs)
  double attention_keys_ = 0;      // PlanRequest::attention_keys of the training records
  bool have_val_ = false;
  std::unique_ptr<TrainEngine> engine_;
  std::unique_ptr<MetricsLog> metrics_;
  TrainProgress progress_;
  int64_t last_checkpoint_step_ = -1;
  clock_type::time_point last_checkpoint_time_ = clock_type::now();
  double train_time_ = 0;  // this process's steps
  std::vector<double> step_times_;
  std::unique_ptr<RunSamples> samples_;  // schedule.sample_every
  int64_t last_eval_step_ = -1;          // the step of progress_.last_val_loss
  std::string best_;                     // checkpoint.keep_best: the best checkpoint's name
  double best_loss_ = 0;
  bool repair_best_ = false;  // checkpoints/best disagrees with the manifests (find_best)
};

// The checkpoint a resume continues from, opened and verified before anything else.
void TrainingRun::open_resume() {
  if (opts_.resume.empty() && !opts_.resume_source) return;
  source_ = opts_.resume_source ? opts_.resume_source
                                : std::make_shared<const CheckpointSource>(opts_.resume);
  opts_.resume = source_->dir();
  resumed_ = source_->manifest();
  check_resume_config(source_->config(), cfg_);
  if (opts_.run_dir.empty()) opts_.run_dir = checkpoint_run_dir(opts_.resume);
}

// Refuses a directory that holds another run's files (check_before_run, which --dry-run
// shares), creates it if needed and locks it; nothing else is written here.
void TrainingRun::claim_run_dir() {
  std::error_code ec;
  sum_.run_dir = resolved_run_dir(opts_);
  dir_ = sum_.run_dir;
  check_before_run(cfg_, opts_, sum_.run_dir);
  const bool same_run =
      !opts_.resume.empty() && fs::equivalent(checkpoint_run_dir(opts_.resume), dir_, ec);
  same_run_ = same_run;
  const RunDirUse use = opts_.restart_killed ? RunDirUse::kRestart : RunDirUse::kNew;
  created_dir_ = !fs::exists(dir_, ec);
  fs::create_directories(dir_, ec);
  if (ec) throw IoError(str(sum_.run_dir, ": cannot create run directory: ", ec.message()));
  lock_ = std::make_unique<DirLock>(dir_.string(), "run directory");
  if (!same_run) {
    // Checked again under the lock: another run may have started here since.
    if (const std::string r = run_dir_refusal(sum_.run_dir, use, !opts_.resume.empty());
        !r.empty()) {
      lock_.reset();
      throw Error(r);
    }
    // A run killed before its first checkpoint: its files are set aside once everything is
    // checked (commit_run_dir); until then they are not this process's to remove.
    restart_killed_ = !foreign_run_dir_entries(sum_.run_dir, RunDirUse::kNew).empty();
    if (!restart_killed_) remove_start_debris();
    fresh_ = true;
  }
  // The base model's files come from the checkpoint's run (a new run directory branching
  // from it) or from model.checkpoint (a new run); a run continuing in its directory has them.
  carry_from_ = carry_source(cfg_, opts_, same_run);
  set_cleanup();
}

// Everything checked: from here the run directory changes. Leftovers of a run killed while
// writing go; the config, the data, and metrics.jsonl (up to the checkpoint's step) take
// their places.
void TrainingRun::commit_run_dir() {
  std::error_code ec;
  if (restart_killed_) {
    const std::string aside = set_aside_killed_run(dir_.string(), data_staging_.string());
    spdlog::warn(
        "--resume-or-start: {} holds no checkpoint, only the files of a run killed before its "
        "first one: starting over in it{}",
        dir_.string(),
        aside.empty() ? std::string() : str("; its old metrics and config are kept in ", aside));
    restart_killed_ = false;
  }
  for (const RunFile& f : kRunFiles)
    if (fs::remove(dir_ / run_temp_file(f), ec))
      spdlog::warn("{}: removed, left half-written by a run that stopped while writing it",
                   (dir_ / run_temp_file(f)).string());
  if (!opts_.resume.empty()) remove_checkpoint_leftovers(dir_.string());
  remove_start_debris();
  committed_ = true;
  carry_model_files();
  // The config as it runs (schedule.steps resolved from schedule.epochs).
  const std::string yaml = config_to_self_contained_yaml(cfg_);
  write_file_atomic((dir_ / "config.yaml").string(), yaml.data(), yaml.size());
  if (!data_staging_.empty()) {
    // The same run's data/ holds the same tokens (check_resume_data): it stays.
    if (!fs::exists(dir_ / "data", ec)) {
      if (::rename(data_staging_.c_str(), (dir_ / "data").c_str()) != 0)
        throw IoError(str((dir_ / "data").string(), ": rename from ", data_staging_.string(),
                          " failed: ", std::strerror(errno)));
      fsync_dir(dir_.string());
    }
    fs::remove_all(data_staging_, ec);
    data_staging_.clear();
  }
  if (!opts_.resume.empty()) {
    const fs::path from = fs::path(checkpoint_run_dir(opts_.resume)) / "metrics.jsonl";
    const fs::path to = dir_ / "metrics.jsonl";
    if (fresh_ && fs::exists(from, ec)) {
      fs::copy_file(from, to, ec);
      if (ec)
        throw IoError(str(to.string(), ": cannot copy from ", from.string(), ": ", ec.message()));
    }
    truncate_metrics(to, resumed_.step);
    truncate_metrics(dir_ / "samples.jsonl", resumed_.step);
  }
  const MetricsIo no_faults;
  const MetricsIo& mio = opts_.metrics_io ? *opts_.metrics_io : no_faults;
  metrics_ =
      std::make_unique<MetricsLog>((dir_ / "metrics.jsonl").string(), mio.retry_seconds, mio.write);
  set_cleanup();
}

// The data staging directories of starts that were killed (ours, data_staging_, is kept).
void TrainingRun::remove_start_debris() {
  std::error_code ec;
  std::vector<fs::path> found;
  for (const auto& e : fs::directory_iterator(dir_, ec))
    if (e.path().filename().string().rfind(".data-staging-", 0) == 0 && e.path() != data_staging_)
      found.push_back(e.path());
  for (const fs::path& p : found) {
    fs::remove_all(p, ec);
    spdlog::warn("{}: removed, left by a start that was killed", p.string());
  }
}

// Start-up failed or was stopped: nothing of it stays. A resumed run's directory was not
// changed before commit_run_dir, and a new run's held nothing before it, so what is removed
// is this process's own.
void TrainingRun::abandon() {
  std::error_code ec;
  engine_.reset();  // the SSD store's files go with it
  metrics_.reset();
  if (!data_staging_.empty()) fs::remove_all(data_staging_, ec);
  // A killed run's files not yet set aside are not this process's (claim_run_dir); the old
  // metrics set aside are kept.
  if (fresh_ && lock_ && !restart_killed_) {
    for (const auto& e : fs::directory_iterator(dir_, ec)) {
      const std::string n = e.path().filename().string();
      if (n != kDirLockName && n.rfind(kRestartedPrefix, 0) != 0) fs::remove_all(e.path(), ec);
    }
  }
  lock_.reset();
  if (created_dir_) fs::remove(dir_, ec);  // only if empty
}

// What a second stop signal (or a first one while a signal ends the process at once) removes
// before the process ends: the SSD store's files and the lock; before training, everything a
// new run has created; while the final weights are written, their temporary file.
void TrainingRun::set_cleanup(bool finishing) {
  if (!opts_.stop) return;
  std::vector<std::string> paths;
  if (engine_) paths = engine_->store_cleanup_paths();
  const bool only_ours = fresh_ && !trained_ && !finishing;  // nothing in dir_ is worth keeping
  if (only_ours) {
    for (const fs::path& d : {data_staging_, committed_ ? dir_ / "data" : fs::path()}) {
      if (d.empty()) continue;
      for (const char* f : {"train.tok", "val.tok", "train.tok.tmp", "val.tok.tmp"})
        paths.push_back((d / f).string());
      paths.push_back(d.string() + "/");
    }
    if (committed_)
      for (const RunFile& f : kRunFiles)
        if (f.before_first_checkpoint) paths.push_back((dir_ / f.name).string());
  }
  if (finishing)
    for (const RunFile& f : kRunFiles) paths.push_back((dir_ / run_temp_file(f)).string());
  if (lock_) paths.push_back(lock_->path());
  if (created_dir_ && only_ours) paths.push_back(dir_.string() + "/");
  opts_.stop->set_cleanup_paths(paths);
}

// The base model's config.json and tokenizer files travel with the run (its directory, then
// each checkpoint), so that to-hf and fuyou-generate find them without the base directory.
void TrainingRun::carry_model_files() {
  if (carry_from_.empty()) return;
  std::vector<std::string> copied = copy_carried_files(carry_from_, dir_.string());
  if (!copied.empty()) {
    std::string names;
    for (const auto& n : copied) names += (names.empty() ? "" : ", ") + n;
    spdlog::info("model files from {}: {}", carry_from_, names);
  }
}

namespace {

// What select_records did to a split, logged before the first step.
void report_records(const RecordSelection& s, const char* split, const DataConfig& data, int T) {
  spdlog::info(
      "data: {} {} records ({} tokens), each kept whole from position 0 and packed into rows of "
      "seq_len + 1 = {} tokens with attention masked at record boundaries",
      s.records.size(), split, s.kept_tokens, T + 1);
  if (s.too_long)
    spdlog::warn(
        "data: {} of {} {} records are longer than {} tokens (longest {}): {} by data.truncate: "
        "{} ({} tokens not trained on)",
        s.too_long, s.total, split, T + 1, s.longest,
        data.truncate == "drop" ? "left out" : "cut to their first tokens", data.truncate,
        s.cut_tokens);
  if (s.no_target)
    spdlog::warn(
        "data: {} {} records have no counted target (an empty completion, or cut before it) and "
        "are skipped",
        s.no_target, split);
}

}  // namespace

// --eval-only validates as the run did: on records when the training data has record indexes
// (beside data.train_shards; training then validates records only), else on windows of a
// token stream; with no training data named, as the validation shards are.
bool TrainingRun::eval_reads_records() const {
  if (!cfg_.data.text.empty()) return false;
  if (cfg_.data.train_shards.empty()) return !val_starts_.empty();
  std::error_code ec;
  for (const auto& p : cfg_.data.train_shards) {
    const std::string rec = fs::path(p).replace_extension(".rec").string();
    if (rec != p && fs::exists(rec, ec)) return true;
  }
  return false;
}

// Record data: the truncate policy applied and reported, the samplers, and the steps of
// schedule.epochs. Every choice about the data is logged here, before the first step.
void TrainingRun::load_records() {
  if (!opts_.eval_only) load_train_records();
  load_val_records();
}

void TrainingRun::load_train_records() {
  const int B = cfg_.schedule.micro_batch, T = cfg_.model.seq_len, accum = cfg_.schedule.grad_accum;
  const TruncatePolicy policy = truncate_policy(cfg_.data.truncate);
  RecordSelection train =
      select_records(train_starts_, train_tokens_.size(),
                     train_mask_.empty() ? nullptr : &train_mask_, T + 1, policy, "training");
  report_records(train, "training", cfg_.data, T);
  if (train.records.empty()) throw ConfigError("data: no training record has a counted target");
  const uint64_t n = train.records.size();
  // The keys a query attends on average (each record a dense square, as FLOPs are counted):
  // what the plan's attention costs, where the simulator times it.
  double sq = 0;
  for (const Record& r : train.records) sq += static_cast<double>(r.length) * r.length;
  attention_keys_ = sq / static_cast<double>(train.kept_tokens);
  const uint64_t limit =
      cfg_.schedule.epochs > 0 ? n * static_cast<uint64_t>(cfg_.schedule.epochs) : UINT64_MAX;
  records_limit_ = limit;
  train_records_ = std::make_unique<RecordSampler>(
      &train_tokens_, train_mask_.empty() ? nullptr : &train_mask_, std::move(train.records), B, T,
      cfg_.runtime.seed, true, limit);
  const uint64_t epoch_rows = train_records_->rows_between(0, n);
  const uint64_t rows_per_step = static_cast<uint64_t>(B) * accum;
  spdlog::info(
      "data: one epoch packs into {} rows ({:.1f}% of their tokens are training records, the rest "
      "padding): {:.1f} steps of {} rows; order shuffled per epoch (runtime.seed {})",
      epoch_rows,
      100.0 * static_cast<double>(train.kept_tokens) / (static_cast<double>(epoch_rows) * (T + 1)),
      static_cast<double>(epoch_rows) / rows_per_step, rows_per_step, cfg_.runtime.seed);
  if (cfg_.schedule.epochs > 0) {
    const uint64_t rows = train_records_->rows_between(0, limit);
    cfg_.schedule.steps = static_cast<int64_t>((rows + rows_per_step - 1) / rows_per_step);
    spdlog::info("schedule: {} epochs = {} steps (schedule.steps follows from schedule.epochs)",
                 cfg_.schedule.epochs, cfg_.schedule.steps);
    if (cfg_.schedule.warmup_steps > cfg_.schedule.steps)
      throw ConfigError(str("schedule.warmup_steps ", cfg_.schedule.warmup_steps,
                            " is more than the ", cfg_.schedule.steps, " steps of schedule.epochs ",
                            cfg_.schedule.epochs));
  }
}

void TrainingRun::load_val_records() {
  const int B = cfg_.schedule.micro_batch, T = cfg_.model.seq_len;
  if (val_starts_.empty()) {
    have_val_ = false;
    spdlog::warn("data: no validation records; validation is off");
    return;
  }
  RecordSelection val =
      select_records(val_starts_, val_tokens_.size(), val_mask_.empty() ? nullptr : &val_mask_,
                     T + 1, truncate_policy(cfg_.data.truncate), "validation");
  report_records(val, "validation", cfg_.data, T);
  have_val_ = !val.records.empty();
  if (!have_val_)
    return spdlog::warn("data: no validation record has a counted target; validation is off");
  const uint64_t vn = val.records.size();
  val_records_ =
      std::make_unique<RecordSampler>(&val_tokens_, val_mask_.empty() ? nullptr : &val_mask_,
                                      std::move(val.records), B, T, cfg_.runtime.seed, false, vn);
  const int64_t all = static_cast<int64_t>((val_records_->rows_between(0, vn) + B - 1) / B);
  val_micro_batches_ = std::min<int64_t>(all, cfg_.schedule.eval_batches);
  spdlog::info("validation: {} of {} micro-batches of records (schedule.eval_batches {}): {}",
               val_micro_batches_, all, cfg_.schedule.eval_batches,
               val_micro_batches_ == all
                   ? "every validation record, each once"
                   : "the first records in file order; raise eval_batches for all");
}

void TrainingRun::load_data() {
  std::vector<std::string> train_paths = cfg_.data.train_shards, val_paths = cfg_.data.val_shards;
  if (!cfg_.data.text.empty()) {
    auto t0 = clock_type::now();
    // Into a staging directory: the run directory's data/ is replaced only once everything
    // has been checked (commit_run_dir).
    data_staging_ = dir_ / str(".data-staging-", ::getpid());
    std::error_code ec;
    fs::remove_all(data_staging_, ec);
    set_cleanup();
    TextShardResult r =
        build_text_shards(cfg_.data.text, data_staging_.string(), cfg_.data.val_fraction);
    spdlog::info(
        "data: tokenized {} text files ({} skipped) into {} train + {} validation byte tokens in "
        "{:.1f}s",
        r.files, r.skipped, r.train_tokens, r.val_tokens, seconds_since(t0));
    if (kByteVocab > static_cast<uint32_t>(cfg_.model.vocab_size))
      throw ConfigError(str("model.vocab_size is ", cfg_.model.vocab_size,
                            " but the byte tokenizer needs at least 256"));
    train_tokens_ = read_token_shard(r.train_path).tokens;
    val_tokens_ = read_token_shard(r.val_path).tokens;
    train_paths = {r.train_path};
    val_paths = {r.val_path};
  } else if (!cfg_.data.train_shards.empty() ||
             (opts_.eval_only && !cfg_.data.val_shards.empty())) {
    // The run's tokenizer: the base model's, carried into the run directory (or, evaluating
    // only, beside the model the config names).
    std::string tok;
    std::error_code ec;
    if (!opts_.eval_only) {
      tok = run_tokenizer_path(cfg_, opts_, dir_.string(), same_run_);
    } else if (const fs::path where = eval_model_dir();
               !where.empty() && fs::is_regular_file(where / "tokenizer.json", ec)) {
      tok = (where / "tokenizer.json").string();
    }
    const uint32_t tok_vocab = tok.empty() ? 0 : Tokenizer::from_file(tok).vocab_size();
    if (!opts_.eval_only)
      train_tokens_ = load_shards(cfg_.data.train_shards, cfg_.model.vocab_size, tok, tok_vocab,
                                  &train_mask_, &train_starts_, opts_.stop);
    val_tokens_ = load_shards(cfg_.data.val_shards, cfg_.model.vocab_size, tok, tok_vocab,
                              &val_mask_, &val_starts_, opts_.stop);
  } else {
    throw ConfigError(
        "data: give data.text (plain-text files or directories) or data.train_shards");
  }
  data_id_.train = split_identity(train_tokens_, train_mask_, train_paths, train_starts_);
  data_id_.val = split_identity(val_tokens_, val_mask_, val_paths, val_starts_);
  if (!data_staging_.empty()) {  // the paths the shards will have
    data_id_.train.shards[0].path = (dir_ / "data" / "train.tok").string();
    data_id_.val.shards[0].path = (dir_ / "data" / "val.tok").string();
  }
  if (!opts_.resume.empty() && !opts_.eval_only) check_resume_data(resumed_.data, data_id_);
  if (opts_.eval_only ? eval_reads_records() : !train_starts_.empty()) {
    load_records();
    return check_resumed_position();
  }
  if (cfg_.schedule.epochs > 0 && !opts_.eval_only)
    throw ConfigError(
        str("schedule.epochs is ", cfg_.schedule.epochs,
            " but the training data is a token stream "
            "without records (data.text, or shards without a .rec index); epochs need records "
            "(fuyou-convert tokenize with JSON Lines): set schedule.steps instead"));
  const int B = cfg_.schedule.micro_batch, T = cfg_.model.seq_len;
  if (!opts_.eval_only)
    train_sampler_ = std::make_unique<BatchSampler>(
        &train_tokens_, train_mask_.empty() ? nullptr : &train_mask_, B, T, cfg_.runtime.seed);
  have_val_ = val_tokens_.size() >= static_cast<size_t>(T + 1);
  if (!have_val_)
    spdlog::warn("data: no validation split with at least {} tokens; validation is off", T + 1);
  if (have_val_ && !val_mask_.empty() &&
      std::count(val_mask_.begin() + 1, val_mask_.end(), uint8_t{1}) == 0) {
    spdlog::warn("data: the validation loss mask counts no target; validation is off");
    have_val_ = false;
  }
  if (have_val_)
    val_sampler_ = std::make_unique<BatchSampler>(
        &val_tokens_, val_mask_.empty() ? nullptr : &val_mask_, B, T, cfg_.runtime.seed);
  check_resumed_position();
}

// The manifest's sampler position against the steps it claims: what step x micro_batch x
// grad_accum rows draw from this data (check_sampler_position for token streams; for records,
// the rows the records before it pack into).
void TrainingRun::check_resumed_position() const {
  if (!source_ || opts_.eval_only) return;
  const std::string path = (fs::path(opts_.resume) / kManifestFile).string();
  if (!train_records_)
    return check_sampler_position(resumed_, source_->config(), train_sampler_->has_mask(), path);
  const uint64_t pos = resumed_.progress.sampler_position;
  const uint64_t rows =
      static_cast<uint64_t>(resumed_.step) * cfg_.schedule.micro_batch * cfg_.schedule.grad_accum;
  // The stream stops at its limit (schedule.epochs), and the rows after it are padding.
  const uint64_t packed = pos <= records_limit_ ? train_records_->rows_between(0, pos) : 0;
  if (pos > records_limit_ || (pos < records_limit_ ? packed != rows : packed > rows))
    throw IoError(str(path, ": sampler_position ", pos, " (records) does not fit step ",
                      resumed_.step, ": the records before it pack into ", packed,
                      " rows, the steps drew ", rows,
                      " (the checkpoint is damaged or was edited)"));
}

void TrainingRun::make_engine() {
  std::string why;
  backend_ = make_backend(cfg_, &why);
  spdlog::info("{}", why);
  EngineOptions eo;
  eo.attention_keys = attention_keys_;
  engine_ = make_train_engine(cfg_, *backend_, eo);
  set_cleanup();  // a second stop signal can still unlink the store's files
  const ParamLayout layout = make_gpt_layout(cfg_.model);
  spdlog::info(
      "model: {}{}, {} layers, d_model {}, {} heads, d_ff {}, vocab {}, seq {}: {:.2f}M parameters",
      cfg_.model.family,
      cfg_.model.checkpoint.empty() ? std::string() : " from " + cfg_.model.checkpoint,
      cfg_.model.n_layer, cfg_.model.d_model, cfg_.model.n_head, cfg_.model.d_ff,
      cfg_.model.vocab_size, cfg_.model.seq_len, layout.num_params() / 1e6);
  for (std::string line, text = engine_->describe(); !text.empty();) {
    size_t nl = text.find('\n');
    line = text.substr(0, nl);
    text = nl == std::string::npos ? "" : text.substr(nl + 1);
    spdlog::info("{}", line);
  }
}

// Before the first step: the run directory must hold the final weights and the checkpoints
// the run keeps (plus the one being written before the oldest goes), beyond those already
// there. A graceful stop writes one even with checkpoints off.
void TrainingRun::preflight() { check_run_dir_space(cfg_, dir_.string()); }

void TrainingRun::start_state() {
  if (opts_.resume.empty()) {
    engine_->init_params();
    return;
  }
  auto t0 = clock_type::now();
  check_resume_base(resumed_, opts_.resume, cfg_.model, *engine_);
  try {
    source_->restore(cfg_.model, *engine_, [this] { check_stop(); });
  } catch (const Error& e) {
    throw IoError(str(e.what(), earlier_checkpoint_hint(opts_.resume)));
  }
  progress_ = resumed_.progress;
  if (train_records_)
    train_records_->set_position(progress_.sampler_position);
  else if (train_sampler_)
    train_sampler_->set_position(progress_.sampler_position);
  last_checkpoint_step_ = resumed_.step;
  sum_.first_val_loss = progress_.first_val_loss;
  sum_.final_val_loss = progress_.last_val_loss;
  spdlog::info("resumed from {} (step {}, written {} by the {} engine) in {:.1f}s", opts_.resume,
               resumed_.step, resumed_.created, resumed_.engine, seconds_since(t0));
}

// Validation: the mean over the counted targets of all eval batches (mean_over_counted, as a
// training step). A fixed window with no counted target has mean 0 and weight 0, so it is
// skipped; when no eval window has a counted target at all, validation is switched off
// rather than dividing by zero.
void TrainingRun::setup_validation() {
  if (!have_val_ || !val_sampler_ || !val_sampler_->has_mask()) return;
  const int B = cfg_.schedule.micro_batch, T = cfg_.model.seq_len;
  std::vector<int32_t> batch(static_cast<size_t>(B) * (T + 1));
  std::vector<uint8_t> counted(static_cast<size_t>(B) * T);
  int64_t n = 0;
  for (int i = 0; i < cfg_.schedule.eval_batches; ++i) {
    val_sampler_->fixed(i, cfg_.schedule.eval_batches, batch.data(), counted.data());
    n += count_targets(counted.data(), B, T);
  }
  if (n == 0) {
    spdlog::warn(
        "data: the {} validation windows hold no counted (completion) target; validation is off",
        cfg_.schedule.eval_batches * B);
    have_val_ = false;
  }
}

// False, with nothing logged, when a stop was asked during the pass: a long validation does
// not hold up a stop.
bool TrainingRun::evaluate(int64_t step, double* loss_out) {
  const int B = cfg_.schedule.micro_batch, T = cfg_.model.seq_len;
  std::vector<int32_t> batch(static_cast<size_t>(B) * (T + 1));
  const auto stopped = [&](int64_t i, int64_t of) {
    if (!opts_.stop || !opts_.stop->requested()) return false;
    log(str("step ", step, ": validation stopped after ", i, " of ", of, " batches"));
    return true;
  };
  if (step > 0)
    phase_.set(
        "stopping now: this validation pass is cut short; a checkpoint and the weights follow");
  std::vector<float> means;
  std::vector<int64_t> counts;
  if (val_records_) {
    // Every validation record once (or those of the first eval_batches micro-batches), each
    // alone in its segment: the mean over their counted targets, what transformers gives run
    // on each record by itself with the losses summed over the records' counted tokens.
    std::vector<uint8_t> counted(static_cast<size_t>(B) * T);
    std::vector<int32_t> positions(static_cast<size_t>(B) * T);
    val_records_->set_position(0);
    for (int64_t i = 0; i < val_micro_batches_; ++i) {
      if (stopped(i, val_micro_batches_)) return false;
      val_records_->next(batch.data(), counted.data(), positions.data());
      counts.push_back(count_targets(counted.data(), B, T));
      means.push_back(counts.back()
                          ? engine_->eval_loss(batch.data(), counted.data(), positions.data())
                          : 0.0f);
    }
  } else {
    std::vector<uint8_t> counted(val_sampler_->has_mask() ? static_cast<size_t>(B) * T : 0);
    uint8_t* cp = counted.empty() ? nullptr : counted.data();
    for (int i = 0; i < cfg_.schedule.eval_batches; ++i) {
      if (stopped(i, cfg_.schedule.eval_batches)) return false;
      val_sampler_->fixed(i, cfg_.schedule.eval_batches, batch.data(), cp);
      counts.push_back(count_targets(cp, B, T));
      means.push_back(counts.back() ? engine_->eval_loss(batch.data(), cp) : 0.0f);
    }
  }
  if (step > 0) phase_.set(kTrainingMessage);
  const double loss = mean_over_counted(means, counts);
  metrics_line({{"step", step}, {"val_loss", loss}}, "val");
  write_curves();
  progress_.last_val_loss = loss;
  last_eval_step_ = step;
  *loss_out = loss;
  return true;
}

void TrainingRun::metrics_line(nlohmann::json j, const char* type) {
  if (!metrics_) return;  // --eval-only writes no run directory
  j["type"] = type;
  j["time"] = utc_now();
  try {
    metrics_->append(j.dump());  // written at once: a killed run keeps every line it logged
  } catch (const IoError& e) {
    std::vector<std::string> have = list_checkpoints(dir_.string());
    throw IoError(str(e.what(), "; the run stops here (a line of step ",
                      j.value("step", int64_t{-1}), " could not be logged), ",
                      have.empty()
                          ? std::string("and it has no checkpoint yet")
                          : str("its last checkpoint, ", have.back(),
                                ", is intact: fix the cause and resume with fuyou-train --resume ",
                                dir_.string())));
  }
}

// curves.svg beside metrics.jsonl, drawn from it (include/fuyou/curves.h). It is a picture of
// what metrics.jsonl holds, so a failure to write it is said and the run goes on.
void TrainingRun::write_curves() {
  if (!metrics_) return;
  try {
    const std::string name = dir_.lexically_normal().filename().string();
    write_curves_svg((dir_ / "curves.svg").string(),
                     {read_run_curves(metrics_->path(), name.empty() ? dir_.string() : name)});
  } catch (const Error& e) {
    spdlog::warn("curves: {}", e.what());
  }
}

StepResult TrainingRun::train_step(int64_t s) {
  const int B = cfg_.schedule.micro_batch, T = cfg_.model.seq_len, accum = cfg_.schedule.grad_accum;
  std::vector<std::vector<int32_t>> mbs(accum,
                                        std::vector<int32_t>(static_cast<size_t>(B) * (T + 1)));
  const bool records = train_records_ != nullptr;
  std::vector<std::vector<uint8_t>> masks(records || train_sampler_->has_mask() ? accum : 0,
                                          std::vector<uint8_t>(static_cast<size_t>(B) * T));
  std::vector<std::vector<int32_t>> positions(records ? accum : 0,
                                              std::vector<int32_t>(static_cast<size_t>(B) * T));
  std::vector<const int32_t*> ptrs(accum), pos_ptrs(positions.size());
  std::vector<const uint8_t*> mask_ptrs(masks.size());
  for (int k = 0; k < accum; ++k) {
    if (records)
      train_records_->next(mbs[k].data(), masks[k].data(), positions[k].data());
    else
      train_sampler_->next(mbs[k].data(), masks.empty() ? nullptr : masks[k].data());
    ptrs[k] = mbs[k].data();
    if (!masks.empty()) mask_ptrs[k] = masks[k].data();
    if (records) pos_ptrs[k] = positions[k].data();
  }
  auto t0 = clock_type::now();
  StepResult r = engine_->step(s, ptrs, mask_ptrs, pos_ptrs);
  const double dt = seconds_since(t0);
  train_time_ += dt;
  progress_.train_seconds += dt;
  step_times_.push_back(dt);
  if (!std::isfinite(r.loss))
    throw Error(str("step ", s + 1, ": loss is ", r.loss, "; stopping (try a lower optimizer.lr)"));
  sum_.final_train_loss = r.loss;
  if (r.skipped)
    spdlog::warn(
        "step {}: fp16 gradients overflowed at loss scale {}; update skipped, scale halved", s + 1,
        r.loss_scale);
  progress_.step = s + 1;
  progress_.sampler_position = records ? train_records_->position() : train_sampler_->position();
  log_step(s + 1, r, dt);
  return r;
}

void TrainingRun::log_step(int64_t step, const StepResult& r, double dt) {
  const double tokens_per_step = static_cast<double>(cfg_.schedule.micro_batch) *
                                 cfg_.model.seq_len * cfg_.schedule.grad_accum;
  const int64_t done = step - sum_.start_step;
  const double tps = tokens_per_step * done / train_time_;
  const double eta = train_time_ / done * (cfg_.schedule.steps - step);
  if (step % cfg_.schedule.log_every != 0 && step != cfg_.schedule.steps) return;
  nlohmann::json line{{"step", step}, {"loss", r.loss},
                      {"lr", r.lr},   {"grad_norm", r.grad_norm},
                      {"step_s", dt}, {"tokens_per_s", tokens_per_step / dt}};
  if (r.loss_scale != 1.0) {
    line["loss_scale"] = r.loss_scale;
    line["skipped"] = r.skipped;
  }
  if (r.offloaded) {
    line["ssd_read_bytes"] = r.ssd_read_bytes;
    line["ssd_write_bytes"] = r.ssd_write_bytes;
    for (int k = 0; k < kNumResources; ++k)
      line["busy_s"][resource_name(static_cast<Resource>(k))] = r.busy_s[k];
    line["busy_s"]["disk"] = r.disk_busy_s;
  }
  metrics_line(line, "train");
  if (opts_.progress_line) {
    std::fprintf(stderr, "\rstep %lld/%lld | loss %.4f | lr %.2e | %.0f tok/s | ETA %s   ",
                 static_cast<long long>(step), static_cast<long long>(cfg_.schedule.steps), r.loss,
                 r.lr, tps, format_duration(eta).c_str());
    std::fflush(stderr);
  } else {
    spdlog::info("step {}/{} loss {:.4f} lr {:.2e} grad_norm {:.3f} {:.0f} tok/s ETA {}", step,
                 cfg_.schedule.steps, r.loss, r.lr, r.grad_norm, tps, format_duration(eta));
  }
}

bool TrainingRun::checkpoint_due(int64_t step) const {
  const CheckpointConfig& c = cfg_.checkpoint;
  if (!checkpoints_on(c)) return false;
  if (step == cfg_.schedule.steps) return true;
  if (c.every_steps > 0 && step % c.every_steps == 0) return true;
  return c.every_minutes > 0 && seconds_since(last_checkpoint_time_) >= 60 * c.every_minutes;
}

void TrainingRun::checkpoint(int64_t step) {
  if (step == last_checkpoint_step_) return;  // this state is on disk already
  // keep_best compares checkpoints by their own validation loss: each gets one.
  if (cfg_.checkpoint.keep_best && have_val_ && last_eval_step_ != step &&
      evaluate(step, &sum_.final_val_loss))
    log(str("step ", step, ": validation loss ", sum_.final_val_loss));
  static const CheckpointIo no_faults;
  const bool stopping = opts_.stop && opts_.stop->requested();
  if (!stopping) phase_.set("stopping once this checkpoint is written; the weights follow");
  try {
    SavedCheckpoint c = save_checkpoint(dir_.string(), cfg_, *engine_, progress_, data_id_,
                                        opts_.checkpoint_io ? *opts_.checkpoint_io : no_faults);
    log(str("checkpoint: ", c.dir, " (", format_size(c.bytes), " in ", c.seconds, " s, ",
            c.seconds > 0 ? c.bytes / c.seconds / 1e6 : 0.0, " MB/s)",
            c.pruned ? str("; removed ", c.pruned, " older") : std::string()));
    sum_.last_checkpoint = c.dir;
  } catch (const Error& e) {
    std::vector<std::string> have = list_checkpoints(dir_.string());
    throw IoError(str("checkpoint at step ", step, " failed: ", e.what(), "; ",
                      have.empty()
                          ? std::string("there is no earlier checkpoint")
                          : str("the previous checkpoint ", have.back(),
                                " is intact: fix the cause and resume with fuyou-train --resume ",
                                dir_.string())));
  }
  last_checkpoint_step_ = step;
  last_checkpoint_time_ = clock_type::now();
  if (cfg_.checkpoint.keep_best && have_val_ && last_eval_step_ == step) keep_if_best(step);
  if (!stopping) phase_.set(kTrainingMessage);
}

// checkpoints/best names the checkpoint of lowest validation loss ("step-N", as `latest`);
// pruning keeps it beside the newest ones.
void TrainingRun::keep_if_best(int64_t step) {
  if (!best_.empty() && progress_.last_val_loss >= best_loss_) return;
  const fs::path root = dir_ / kCheckpointsDir;
  best_ = step_dir_name(step);
  best_loss_ = progress_.last_val_loss;
  write_best(root.string(), best_);
  const int pruned = prune_checkpoints(dir_.string(), cfg_.checkpoint.keep, true);
  log(str("checkpoint: ", best_, " is the best so far (validation loss ", best_loss_, ")",
          pruned ? str("; removed ", pruned, " older") : std::string()));
}

// A run continuing in its directory compares against the best checkpoint it has, from the
// checkpoints' own manifests (find_best_checkpoint), before the directory changes: a `best`
// that is not a file is refused here, and one that disagrees is said now and rewritten once
// the directory is committed to (restore_best).
void TrainingRun::find_best() {
  if (!cfg_.checkpoint.keep_best) return;
  const BestCheckpoint b = find_best_checkpoint(dir_.string());
  best_ = b.name;
  best_loss_ = b.loss;
  repair_best_ = !b.name.empty() && !b.pointer_agrees();
  if (const std::string w = best_pointer_warning(dir_.string(), b); !w.empty())
    spdlog::warn("checkpoints: {}", w);
}

void TrainingRun::restore_best() {
  if (repair_best_) write_best((dir_ / kCheckpointsDir).string(), best_);
  repair_best_ = false;
}

void TrainingRun::finish(clock_type::time_point start) {
  const int64_t steps_here = sum_.steps - sum_.start_step;
  const double tokens_per_step = static_cast<double>(cfg_.schedule.micro_batch) *
                                 cfg_.model.seq_len * cfg_.schedule.grad_accum;
  sum_.tokens_per_s = train_time_ > 0 ? tokens_per_step * steps_here / train_time_ : 0;
  if (engine_->predicted_iteration_s() > 0 && !step_times_.empty()) {
    // The automatic placement's prediction beside the measurement (median step; the first
    // step, which warms caches and the store, is left out when there are others).
    std::vector<double> t(step_times_.begin() + (step_times_.size() > 1 ? 1 : 0),
                          step_times_.end());
    std::sort(t.begin(), t.end());
    double measured =
        t.size() % 2 ? t[t.size() / 2] : 0.5 * (t[t.size() / 2 - 1] + t[t.size() / 2]);
    spdlog::info("step time: predicted {:.3f} s, measured {:.3f} s (median of {} steps)",
                 engine_->predicted_iteration_s(), measured, t.size());
  }
  write_curves();
  const std::string weights = (dir_ / "model.safetensors").string();
  engine_->save_weights(weights, {{"format", "fuyou"},
                                  {"step", std::to_string(sum_.steps)},
                                  {"config", config_to_self_contained_yaml(cfg_)}});
  if (!opts_.trace_path.empty()) engine_->write_trace(opts_.trace_path);
  const double wall = seconds_since(start);
  nlohmann::json summary{{"steps", sum_.steps},
                         {"start_step", sum_.start_step},
                         {"first_val_loss", sum_.first_val_loss},
                         {"final_val_loss", sum_.final_val_loss},
                         {"final_train_loss", sum_.final_train_loss},
                         {"tokens_per_s", sum_.tokens_per_s},
                         {"wall_s", wall},
                         {"peak_rss_bytes", peak_rss_bytes()},
                         {"device_peak_bytes", backend_->memory().peak}};
  if (sum_.stop_signal) summary["stopped_by"] = signal_name(sum_.stop_signal);
  const std::string text = summary.dump(2) + "\n";
  write_file_atomic((dir_ / "summary.json").string(), text.data(), text.size());
  if (sum_.stop_signal && sum_.steps < cfg_.schedule.steps) {
    log(str("stopped by ", signal_name(sum_.stop_signal), " at step ", sum_.steps, "/",
            cfg_.schedule.steps, "; weights in ", weights, "; continue with: fuyou-train --resume ",
            dir_.string()));
    return;
  }
  const std::string val = have_val_ ? fmt::format("validation loss {:.4f} -> {:.4f}",
                                                  sum_.first_val_loss, sum_.final_val_loss)
                                    : std::string("no validation (no validation split)");
  spdlog::info("done: {} steps in {}, {:.0f} tokens/s; {}; weights in {}{}", sum_.steps,
               format_duration(wall), sum_.tokens_per_s, val, weights,
               sum_.stop_signal ? str(" (", signal_name(sum_.stop_signal),
                                      " arrived at the end; the run is complete)")
                                : std::string());
}

// The directory of the model an evaluation reads: the --resume checkpoint, or model.checkpoint.
std::string TrainingRun::eval_model_dir() const {
  if (!opts_.resume.empty()) return opts_.resume;
  if (cfg_.model.checkpoint.empty()) return "";
  std::error_code ec;
  const fs::path p(cfg_.model.checkpoint);
  return carried_files_dir((fs::is_directory(p, ec) ? p : p.parent_path()).string());
}

TrainSummary TrainingRun::evaluate_only() {
  if (!opts_.resume.empty() || opts_.resume_source) {
    source_ = opts_.resume_source ? opts_.resume_source
                                  : std::make_shared<const CheckpointSource>(opts_.resume);
    opts_.resume = source_->dir();
    resumed_ = source_->manifest();
  }
  // data.text is tokenized into a directory of its own, removed afterwards.
  std::string tmp = (fs::temp_directory_path() / "fuyou-eval-XXXXXX").string();
  if (!::mkdtemp(tmp.data())) throw IoError(str(tmp, ": mkdtemp: ", std::strerror(errno)));
  struct Remove {
    std::string path;
    ~Remove() {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  } remove{tmp};
  dir_ = tmp;
  load_data();
  if (!have_val_ && eval_reads_records() && val_starts_.empty())
    throw ConfigError(
        "--eval-only: the training data is records (a .rec index beside data.train_shards) but "
        "data.val_shards have no record index, and a run on records validates records only, so "
        "this data has no validation loss: tokenize the validation data as JSON Lines too "
        "(fuyou-convert tokenize)");
  if (!have_val_)
    throw ConfigError(
        "--eval-only: no validation data: give data.val_shards, or data.text with "
        "data.val_fraction > 0");
  make_engine();
  if (opts_.resume.empty() && cfg_.model.checkpoint.empty())
    spdlog::warn(
        "--eval-only: no model.checkpoint and no --resume: evaluating a randomly initialised "
        "model");
  start_state();
  setup_validation();
  if (!have_val_) throw ConfigError("--eval-only: the validation windows hold no counted target");
  auto t0 = clock_type::now();
  if (!evaluate(progress_.step, &sum_.final_val_loss)) check_stop();
  sum_.first_val_loss = sum_.final_val_loss;
  const int B = cfg_.schedule.micro_batch, T = cfg_.model.seq_len;
  // The loss in full as well: metrics.jsonl holds the run's with every digit.
  spdlog::info("validation loss {:.4f} ({}) of {} ({}) in {:.1f} s", sum_.final_val_loss,
               sum_.final_val_loss,
               !opts_.resume.empty()           ? opts_.resume
               : cfg_.model.checkpoint.empty() ? std::string("a random initialisation")
                                               : cfg_.model.checkpoint,
               val_records_ ? str(val_micro_batches_,
                                  " micro-batches of whole records, as training "
                                  "validates them")
                            : str(cfg_.schedule.eval_batches * B, " windows of ", T,
                                  " tokens, schedule.eval_batches ", cfg_.schedule.eval_batches,
                                  " x micro_batch ", B),
               seconds_since(t0));
  sum_.steps = sum_.start_step = progress_.step;
  return sum_;
}

// Everything before the first step. Nothing in the run directory changes before
// commit_run_dir, and everything before it is checked: the checkpoint and the config, the
// directory, the data, the disk space, the engine, the restored state.
void TrainingRun::start() {
  open_resume();
  claim_run_dir();
  check_stop();
  load_data();
  check_stop();
  preflight();
  make_engine();
  check_stop();
  start_state();
  check_stop();
  setup_validation();
  find_best();
  commit_run_dir();
  restore_best();
  sum_.start_step = progress_.step;
  if (have_val_ && opts_.resume.empty()) {
    if (!evaluate(0, &sum_.first_val_loss)) check_stop();
    progress_.first_val_loss = sum_.first_val_loss;
    spdlog::info("step 0: validation loss {:.4f}", sum_.first_val_loss);
  }
  if (cfg_.schedule.sample_every > 0) {
    samples_ = std::make_unique<RunSamples>(cfg_, dir_.string());
    if (opts_.resume.empty()) samples_->write(0, *engine_);
  }
}

TrainSummary TrainingRun::run() {
  phase_.set(kStartingMessage);
  try {
    start();
  } catch (...) {
    abandon();
    throw;
  }
  phase_.set(kTrainingMessage);
  // A run killed after its last checkpoint but before its final weights: finishing it is
  // writing them.
  if (sum_.start_step >= cfg_.schedule.steps)
    spdlog::warn(
        "resume: the checkpoint is at step {} and schedule.steps is {}: nothing to train; writing "
        "the final weights from it (train longer with --set schedule.steps=N)",
        sum_.start_step, cfg_.schedule.steps);
  auto start = clock_type::now();
  last_checkpoint_time_ = start;
  const auto stop_asked = [&] { return opts_.stop && opts_.stop->requested(); };
  for (int64_t s = sum_.start_step; s < cfg_.schedule.steps && !stop_asked(); ++s) {
    train_step(s);
    if (!trained_) {  // from now on a second signal leaves the run directory's files alone
      trained_ = true;
      set_cleanup();
    }
    const int64_t step = s + 1;
    const bool last = step == cfg_.schedule.steps;
    if (have_val_ && (last || (cfg_.schedule.eval_every && step % cfg_.schedule.eval_every == 0))) {
      if (!evaluate(step, &sum_.final_val_loss)) break;  // stopped: the checkpoint follows
      log(str("step ", step, ": validation loss ", sum_.final_val_loss));
    }
    if (samples_ && (last || step % cfg_.schedule.sample_every == 0))
      samples_->write(step, *engine_);
    if (checkpoint_due(step)) checkpoint(step);
  }
  sum_.steps = progress_.step;
  if (stop_asked()) {
    sum_.stop_signal = opts_.stop->requested();
    if (!trained_) {  // a stop before the first step still leaves a checkpoint: keep it
      trained_ = true;
      set_cleanup();
    }
    if (sum_.steps < cfg_.schedule.steps || checkpoints_on(cfg_.checkpoint))
      checkpoint(progress_.step);
  }
  phase_.set("stopping once the final weights are written");
  set_cleanup(/*finishing=*/true);
  finish(start);
  // A signal that arrived while the final weights were written: the run is complete, and
  // its status says it was signalled.
  if (stop_asked()) sum_.stop_signal = opts_.stop->requested();
  return sum_;
}

}  // namespace

TrainSummary run_training(const Config& cfg, const TrainOptions& opts) {
  // Refused before anything is written: an emulated run has no model to train or save.
  if (cfg.runtime.backend == "emulated")
    throw ConfigError(
        "runtime.backend is emulated: the emulated device does no arithmetic (its losses are NaN), "
        "so there is nothing to train; it times the engine with `fuyou-bench train`");
  TrainingRun run(cfg, opts);
  return opts.eval_only ? run.evaluate_only() : run.run();
}

}  // namespace fuyou
