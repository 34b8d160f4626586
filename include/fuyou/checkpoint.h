// Training-state checkpoints: everything a run needs to continue bit for bit where it
// stopped, written so that a crash at any instant leaves the previous complete checkpoint
// or the new complete one, never a mix. The on-disk format is in docs/checkpoints.md.
//
//   RUN_DIR/checkpoints/step-N/   config.yaml          the resolved, self-contained config
//                                 model.safetensors    fp32 master weights (engine names)
//                                 optimizer.safetensors  AdamW moments: adam_m.NAME, adam_v.NAME
//                                 manifest.json        version, step, counters, sampler, data
//                                                      identity, checksums (its own and those
//                                                      of config.yaml and of every tensor
//                                                      group); written last
//   RUN_DIR/checkpoints/latest    "step-N\n": the newest complete checkpoint
//
// A checkpoint is assembled in checkpoints/.staging-step-N-PID, each file fsynced, the
// directory renamed to step-N and its parent fsynced; `latest` is replaced (write, fsync,
// rename) last. Tensors stream group by group through the engine's own buffers
// (TrainEngine::read_state), so saving a model larger than host memory stays within the
// host budget.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fuyou/config.h"
#include "fuyou/model.h"
#include "fuyou/optim.h"
#include "fuyou/train_state.h"

namespace fuyou {

class TrainEngine;

inline constexpr int kCheckpointVersion = 2;
inline constexpr const char* kCheckpointsDir = "checkpoints";
inline constexpr const char* kLatestFile = "latest";
// checkpoint.keep_best: "step-N\n", the checkpoint of lowest validation loss, kept by pruning.
inline constexpr const char* kBestFile = "best";
inline constexpr const char* kManifestFile = "manifest.json";
inline constexpr const char* kOptimizerFile = "optimizer.safetensors";

// What the run trains on, by content rather than by path: a resume whose training tokens
// differ is refused (the paths may move; the tokens must not).
struct ShardIdentity {
  std::string path;
  uint64_t bytes = 0;
  std::string head_xxh3;  // of the first 4 KiB (the header and the first tokens)
};
struct DataSplitIdentity {
  uint64_t tokens = 0;
  std::string
      xxh3;  // of the tokens (int32), the loss mask bytes and the record starts (u64), if any
  std::vector<ShardIdentity> shards;
};
struct DataIdentity {
  DataSplitIdentity train, val;
};
DataSplitIdentity split_identity(const std::vector<int32_t>& tokens,
                                 const std::vector<uint8_t>& mask,
                                 const std::vector<std::string>& shard_paths,
                                 const std::vector<uint64_t>& records = {});

// The loop's position beside the engine state.
struct TrainProgress {
  int64_t step = 0;  // optimizer steps completed
  uint64_t sampler_position =
      0;                      // position() of the training sampler (BatchSampler or RecordSampler)
  double first_val_loss = 0;  // validation loss at step 0 (0: none)
  double last_val_loss = 0;   // the most recent one (0: none)
  double train_seconds = 0;   // time spent in steps so far
};

struct CheckpointFile {
  std::string name;
  uint64_t bytes = 0;
};

struct CheckpointManifest {
  int version = kCheckpointVersion;
  int64_t step = 0;
  int micro_batch_in_step = 0;  // checkpoints are taken at step boundaries: always 0
  std::string engine;           // "in-memory" or "offloaded": where the state was taken from
  OptimizerCounters counters;
  TrainProgress progress;
  DataIdentity data;
  std::string created;  // UTC, ISO 8601
  std::vector<CheckpointFile> files;
  // Per state kind (master, adam_m, adam_v), per parameter group: XXH3-64 of the group's
  // tensor bytes in file order, checked while restoring.
  std::vector<std::vector<std::string>> group_xxh3;
  // How the moments are stored in optimizer.safetensors (manifest "optimizer_state"; absent:
  // fp32) and the master format of the run that wrote it (the master is fp32 in the file).
  OptimFormat optim_format;
  // A LoRA run's (manifest "lora_base_xxh3"): TrainEngine::base_xxh3 of the frozen base it
  // trained over; empty for a full fine-tune.
  std::string base_xxh3;
};

// The parameters a checkpoint of this config holds, group by group: the model's
// (make_gpt_layout), or with a lora section the adapters' only (LoraLayout::params; the base
// is model.checkpoint's, named by its checksum).
ParamLayout checkpoint_layout(const Config& cfg);

// Test seam: replaces pwrite(2) for the bytes of the checkpoint's tensor files (ENOSPC, EIO,
// short writes); called from the file writer's background threads, several at once.
struct CheckpointIo {
  std::function<ssize_t(int fd, const void* data, size_t bytes, uint64_t offset)> write;
};

struct SavedCheckpoint {
  std::string dir;
  uint64_t bytes = 0;  // all files
  double seconds = 0;
  int pruned = 0;  // older checkpoints removed to keep checkpoint.keep
};

// Writes RUN_DIR/checkpoints/step-N (N = progress.step) as above, points `latest` at it and
// removes the oldest complete checkpoints beyond cfg.checkpoint.keep. On any error the
// staging directory is removed, the previous checkpoints and `latest` are untouched, and the
// IoError names the file.
SavedCheckpoint save_checkpoint(const std::string& run_dir, const Config& cfg, TrainEngine& engine,
                                const TrainProgress& progress, const DataIdentity& data,
                                const CheckpointIo& io = {});

// A path given to --resume: a step directory as is; a run directory (or its checkpoints/)
// by `latest`, falling back (with a warning) to the newest complete step directory when
// `latest` is missing or names none. Throws Error naming what was looked for.
std::string resolve_checkpoint(const std::string& path);
// The run directory a step directory belongs to (RUN_DIR of RUN_DIR/checkpoints/step-N).
std::string checkpoint_run_dir(const std::string& checkpoint_dir);

// A checkpoint opened for reading: manifest.json and config.yaml read and verified (their
// checksums, every field's type and range, the step against the directory's name and the
// config) and the tensor files opened, so that a run pruning its checkpoints meanwhile (another
// process) cannot take them away. The tensors are verified group by group by restore().
// IoError naming the file and the field; a damaged checkpoint's error names the run's
// earlier complete checkpoint, when there is one, to resume from instead.
class CheckpointSource {
 public:
  explicit CheckpointSource(const std::string& dir);
  ~CheckpointSource();
  CheckpointSource(const CheckpointSource&) = delete;
  CheckpointSource& operator=(const CheckpointSource&) = delete;

  const std::string& dir() const;
  const CheckpointManifest& manifest() const;
  const Config& config() const;            // config.yaml, parsed from the bytes verified
  const std::string& config_text() const;  // those bytes
  // Sets the engine's state from the checkpoint, group by group, checking every group's
  // checksum; the engine may place its state differently from the run that wrote it.
  // `between_groups`, if given, runs before each group (a stop check: a restore may be long).
  void restore(const ModelConfig& model, TrainEngine& engine,
               const std::function<void()>& between_groups = {}) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Refuses (ConfigError naming both checksums and model.checkpoint) a resume whose engine's base
// (TrainEngine::base_xxh3) is not the one the checkpoint's adapters were trained over, and a
// LoRA checkpoint resumed without LoRA or the reverse. restore() checks it too; a run calls it
// first so that its refusal is not taken for a damaged checkpoint.
void check_resume_base(const CheckpointManifest& m, const std::string& dir,
                       const ModelConfig& model, const TrainEngine& engine);

// resolve_checkpoint and CheckpointSource together, for --resume: when the checkpoint that
// `latest` named was removed before its files could be opened (the run it belongs to is still
// training and pruned it), `latest` is read again.
std::shared_ptr<const CheckpointSource> open_resume_checkpoint(const std::string& path);

// "; an earlier complete checkpoint of the run: DIR (resume from it with ...)", or "" when the
// run has none older than `checkpoint_dir`: what an error about a damaged checkpoint adds.
std::string earlier_checkpoint_hint(const std::string& checkpoint_dir);

// The manifest's sampler position against step x micro_batch x grad_accum of `cfg`, for data
// that is a token stream (BatchSampler): exactly that many draws without a loss mask, up to
// BatchSampler::kMaxRedraws more per window with one. IoError naming `path` when it does not
// fit. (Record data is checked by the run against the rows its records pack into.)
void check_sampler_position(const CheckpointManifest& m, const Config& cfg, bool masked,
                            const std::string& path);

// CheckpointSource(dir).manifest(), .config(), .restore(): for callers that open once.
CheckpointManifest read_checkpoint_manifest(const std::string& dir);
Config read_checkpoint_config(const std::string& dir);
void restore_checkpoint(const std::string& dir, const CheckpointManifest& m,
                        const ModelConfig& model, TrainEngine& engine);

// The config of a resume: `config_path` (may be empty: the checkpoint's own config.yaml)
// with `overrides`, checked against the checkpoint's by check_resume_config.
Config resume_config(const CheckpointSource& checkpoint, const std::string& config_path,
                     const std::vector<std::string>& overrides);
Config resume_config(const std::string& checkpoint_dir, const std::string& config_path,
                     const std::vector<std::string>& overrides);

// Refuses (ConfigError naming the first key) a resume config that differs from the
// checkpoint's in a key that changes the training trajectory. Keys that may change are
// listed in docs/checkpoints.md (resume_changeable_keys()).
void check_resume_config(const Config& saved, const Config& now);
const std::vector<std::string>& resume_changeable_keys();
// Refuses a resume whose training data differs by content; warns for validation data.
void check_resume_data(const DataIdentity& saved, const DataIdentity& now);

// Removes what a run stopped while writing or deleting a checkpoint left in
// RUN_DIR/checkpoints (staging and half-deleted directories), with a log line each.
int remove_checkpoint_leftovers(const std::string& run_dir);
// Complete checkpoints of a run (step directories with a manifest), oldest first.
std::vector<std::string> list_checkpoints(const std::string& run_dir);

// Bytes the weights file of this model takes (fp32 tensors plus headers): a run's final
// weights, and a checkpoint's model.safetensors.
uint64_t weights_file_bytes(const ModelConfig& model);
// Bytes one checkpoint of this model takes with the optimizer's state in `format` (the fp32
// weights, both moments as stored, headers), for preflight and --dry-run.
uint64_t checkpoint_bytes(const ModelConfig& model, const OptimFormat& format = {});
// The same for a run of `cfg` (checkpoint_layout: a LoRA run's adapters only).
uint64_t weights_file_bytes(const Config& cfg);
uint64_t checkpoint_bytes(const Config& cfg);

}  // namespace fuyou
