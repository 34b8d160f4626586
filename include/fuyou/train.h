// Training: one optimizer step over in-memory state (InMemoryStep), and the whole run that
// fuyou-train performs (run_training): data, loop, validation, metrics, final weights.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/config.h"
#include "fuyou/loss_scale.h"
#include "fuyou/model.h"
#include "fuyou/ooc_adamw.h"
#include "fuyou/step_result.h"
#include "fuyou/train_state.h"

namespace fuyou {

// Splits micro-batch rows of T+1 tokens into inputs (B*T) and next-token targets (B*T).
void split_batch(const int32_t* batch, int B, int T, int32_t* inputs, int32_t* targets);
// The same with a loss mask: counted (B*T, may be null = every target counts) says which
// targets count (BatchSampler fills it); a target that does not is set to kIgnoreTarget.
// Returns the number of counted targets.
int64_t split_batch(const int32_t* batch, const uint8_t* counted, int B, int T, int32_t* inputs,
                    int32_t* targets);
// Counted targets of one micro-batch's mask (B*T entries; null: all B*T count).
int64_t count_targets(const uint8_t* counted, int B, int T);

// The loss of a step (or of a validation pass) from its micro-batches' mean losses and
// counted targets: the mean over every counted target, as PyTorch's cross_entropy with
// ignore_index over the concatenated micro-batches gives. When every micro-batch counts the
// same number of targets (always without masks) that is exactly the plain mean of the means,
// computed that way so unmasked runs keep their arithmetic bit for bit; otherwise each mean is
// weighted by its count. 0 when nothing counts.
double mean_over_counted(const std::vector<float>& means, const std::vector<int64_t>& counts);

// Sum of squares of one parameter group's gradient in double, in an order fixed by n alone
// (blocks of 2^16 elements in eight lanes each, the blocks' sums added in order), over the
// calling thread's OpenMP team: the same bits whatever the thread count. Global-norm
// clipping adds these over groups in layout order, in-memory and offloaded alike.
double group_sum_squares(const void* g, ElemType type, size_t n);

// Gradient accumulation in fp32 (schedule.grad_accum_type): one micro-batch's gradient of
// `type` widened and added into the fp32 sum (first: the sum becomes it), element by element
// in micro-batch order, in-memory and offloaded alike.
void add_to_fp32_sum(float* sum, const void* g, ElemType type, size_t n, bool first);

// The optimizer's groups for a model's parameters (one per ParamLayout group, each tensor's
// range and decay flag) and its options from the config: what both engines give OocAdamW.
std::vector<OptimGroup> optimizer_groups(const ParamLayout& layout);
OocAdamWOptions optimizer_options(const OptimizerConfig& o);
// optimizer.state and optimizer.master as the optimizer's format.
OptimFormat optim_format(const OptimizerConfig& o);
// ConfigError for a format this run cannot use: a split master needs bf16 device tensors.
void check_optim_format(const OptimizerConfig& o, ElemType tensors);

// Whether in-memory training keeps AdamW on the device (optimizer.placement for this config
// and backend), with `device_free` bytes of the device left beside the model (UINT64_MAX: no
// limit): host, or packed state (optimizer.state / master), no; device, yes, or ConfigError
// naming what stops it (a backend without it, packed state, too little memory); auto, on a
// GPU's own memory when the state fits with a sixteenth to spare. The in-memory step decides
// with the memory its model left; make_train_engine first, from the model's estimate, to
// choose the engine.
bool in_memory_optimizer_on_device(const Config& cfg, Backend& be, uint64_t device_free);

// fp32 values per parameter of AdamW's state on the device: the master (unless the device's
// weights are fp32: then they are the master), m and v.
constexpr uint64_t device_state_floats(ElemType tensors) {
  return tensors == ElemType::kF32 ? 2 : 3;
}

// AdamW's pieces on the device (Backend::adamw) over the tensors of `layout` whose elements lie
// in [begin, end) (a group's range, or the whole layout): each tensor cut into pieces of at
// most kDeviceAdamWPiece elements, `begin` counted from `begin`. Padding between tensors is
// not updated, as on the host.
std::vector<AdamWPiece> adamw_pieces(const ParamLayout& layout, size_t begin, size_t end);

// The in-memory step: the model on a backend, and the fp32 master weights and AdamW moments
// either on the host (an OocAdamW with every group in host memory, the driver the offloading
// engine uses too: gradients copied down, AdamW, weights copied up) or on the device beside
// the model (optimizer.placement; Backend: the optimizer on the device), with the same bits.
// step() runs grad_accum micro-batches, reduces, clips and updates.
class InMemoryStep {
 public:
  InMemoryStep(const Config& cfg, Backend& backend);
  ~InMemoryStep();
  InMemoryStep(const InMemoryStep&) = delete;
  InMemoryStep& operator=(const InMemoryStep&) = delete;

  Transformer& model() { return model_; }
  // The fp32 master weights, layout() order. With 16-bit tensors the optimizer keeps them and
  // this copies them out when a step has changed them since the last call (exports,
  // checkpoints and tests read them; a step does not pay for a copy nobody reads).
  const std::vector<float>& master();
  size_t num_params() const { return master_.size(); }

  void init_params();  // init_gpt_params with model.seed
  // layout() order, layout().total elements; the moments start from zero.
  void set_params(const float* host_params);

  // Checkpoints: one kind of one group's state in pieces (OocAdamW::read_state); a master
  // written sets the group's weights on the device too.
  void read_state(int group, StateKind kind, const StateSink& sink);
  void write_state(int group, StateKind kind, const StateSource& source);
  // Packed moments as the optimizer stores them (OocAdamW::read_packed).
  const OptimFormat& optim_format() const { return format_; }
  void read_packed(int group, StateKind kind, const PackedSink& sink);
  void write_packed(int group, StateKind kind, const PackedSource& source);
  OptimizerCounters counters() const;
  void set_counters(const OptimizerCounters& c);

  // `micro_batches` holds grad_accum pointers to B*(T+1) tokens each; `masks` is empty (every
  // target counts) or holds one B*T loss mask per micro-batch (see split_batch); `positions`
  // is empty (one record per row) or holds one B*T array per micro-batch of packed records
  // (Transformer::set_tokens). The gradient is that of the mean over all counted targets of the
  // step.
  StepResult step(int64_t step_index, const std::vector<const int32_t*>& micro_batches,
                  const std::vector<const uint8_t*>& masks = {},
                  const std::vector<const int32_t*>& positions = {});
  // Mean loss over the counted targets of one B*(T+1) batch (mask B*T or null; positions B*T
  // or null) at the current weights, no gradients; 0 when none counts.
  float eval_loss(const int32_t* batch, const uint8_t* mask = nullptr,
                  const int32_t* positions = nullptr);
  // The last step's gradient (the sum over its micro-batches, scaled by the loss scale, before
  // clipping) as its norm and updates read it, widened to fp32; layout() order.
  std::vector<float> step_gradient() const;

 private:
  Config cfg_;
  Backend& be_;
  Transformer model_;
  std::unique_ptr<OocAdamW> opt_;  // the host optimizer (null on the device)
  // Writes the device's parameters from master_: as they are (fp32 tensors) or through
  // lowp_, the master rounded to 16 bits by the update (16-bit tensors).
  void upload_params(size_t begin, size_t n);
  bool choose_device_optimizer() const;  // optimizer.placement for this backend and model
  void place_on_device();                // allocates the device optimizer's state
  // The step's gradient as the optimizer reads it (host or device memory).
  struct StepGradient {
    const void* data = nullptr;
    ElemType type = ElemType::kF32;
  };
  void update_on_host(const StepGradient& g, float grad_scale, float lr);
  void update_on_device(const StepGradient& g, float grad_scale, float lr);
  float* device_state(StateKind kind) const;
  // A timing mark of the optimizer's phase (Backend: step timing; only while timing).
  void mark(OpClass c) {
    if (be_.timing_on()) be_.timing_mark(timing_tag(StepPhase::kOptimizer, c));
  }

  ElemType store_;      // the device's tensors (Backend::storage_type)
  OptimFormat format_;  // optimizer.state / optimizer.master
  // 16-bit working weights from fp32 master values: rounded to nearest even, or a split
  // master's working halves (math::split_hi).
  void working_weights(uint16_t* dst, const float* src, size_t n) const;
  std::vector<float> master_;  // the optimizer's master weights (see master())
  bool master_stale_ =
      false;  // 16-bit tensors: the optimizer's master changed since master_ was copied
  std::vector<char> grad_;  // the device's gradients, as stored (store_)
  // 16-bit tensors summed in fp32 over micro-batches (sums_grads_in_fp32): each micro-batch's
  // gradient, copied from the device, is added here; the norm and the updates read it.
  bool fp32_sums_ = false;
  bool summed_ = false;  // the last step's gradient is sum_
  std::vector<float> sum_;
  std::vector<uint16_t> lowp_;  // 16-bit tensors only: the working weights the update writes
  std::vector<int32_t> inputs_, targets_;
  int64_t t_ = 0;
  std::unique_ptr<DynamicLossScaler> scaler_;  // with fp16 GEMM inputs only
  std::vector<void*> pinned_;  // host buffers the backend page-locked (register_host)
  // Each parameter group's (offset, elements): the sum of squares' groups, in layout order.
  std::vector<std::pair<size_t, size_t>> square_groups_;

  // The optimizer on the device: fp32 master (the device's weights themselves with fp32
  // tensors), moments, the fp32 gradient sums over micro-batches (16-bit tensors, grad_accum
  // > 1), and AdamW's pieces (adamw_pieces), all in the backend's arena.
  bool on_device_ = false;
  float* d_master_ = nullptr;
  float* d_m_ = nullptr;
  float* d_v_ = nullptr;
  float* d_sum_ = nullptr;
  AdamWPiece* d_pieces_ = nullptr;
  size_t n_pieces_ = 0;
  std::vector<void*> device_owned_;

 public:
  // Whether AdamW runs on the device (optimizer.placement resolved for this backend).
  bool optimizer_on_device() const { return on_device_; }
};

class StopSignals;
class CheckpointSource;
struct CheckpointIo;

// Test seam for metrics.jsonl: replaces write(2) for its appends, and how long a write that
// fails with an error that may pass (ENOSPC, EIO) is retried before the run stops.
struct MetricsIo {
  std::function<ssize_t(int fd, const void* data, size_t bytes)> write;
  double retry_seconds = 30;
};

struct TrainOptions {
  std::string run_dir;         // empty: runs/<date-time>; with `resume`: the checkpoint's run
  bool progress_line = false;  // live \r progress line (stderr is a terminal)
  std::string trace_path;      // Chrome trace of the last iteration (offloaded runs)
  // A checkpoint directory (resolve_checkpoint) to continue from; empty: a new run. The
  // config must pass check_resume_config against the checkpoint's (resume_config builds one).
  std::string resume;
  // The same checkpoint already opened (open_resume_checkpoint); null: `resume` is opened.
  std::shared_ptr<const CheckpointSource> resume_source;
  // Stop signals (fuyou-train creates one first in main): the run sets what the first signal
  // does as it goes (graceful from start-up on), checks for stops at its safe points, and
  // leaves it in its at-once default when it returns; null: none.
  StopSignals* stop = nullptr;
  // Test seams for the checkpoint files' writes and metrics.jsonl's; null: write(2).
  const CheckpointIo* checkpoint_io = nullptr;
  const MetricsIo* metrics_io = nullptr;
  // Only the validation loss of the starting model (model.checkpoint, or `resume`'s
  // checkpoint) on the config's validation data; no run directory is written.
  bool eval_only = false;
  // --resume-or-start without a checkpoint: a run directory holding only the files of a run
  // killed before its first checkpoint is started over in (its metrics kept aside in
  // DIR/restarted-<date-time>/); anything else in it is still refused.
  bool restart_killed = false;
};

struct TrainSummary {
  std::string run_dir;
  int64_t steps = 0;       // the step the run reached
  int64_t start_step = 0;  // where this process began (the checkpoint's step on a resume)
  double first_val_loss = 0;
  double final_val_loss = 0;
  double final_train_loss = 0;
  double tokens_per_s = 0;
  int stop_signal = 0;          // the signal that stopped the run early, else 0
  std::string last_checkpoint;  // the newest checkpoint written by this process, if any
};

// fuyou-train --dry-run: whether the run fits this machine (device memory, MemAvailable, the
// run directory's and the SSD store's free space) and, with offload.hardware, the simulator's
// step, run and epoch times. Nothing is trained or written.
struct DryRun {
  bool fits = true;
  std::vector<std::string> lines;  // the report, one finding per line
  double step_s = 0, epoch_s = 0;  // 0: no prediction
  std::exception_ptr refused;      // null: the run would start
};
// `refused`: what the run would refuse before it starts (check_before_run), the same
// exception; the rest of the report is then left out.
DryRun dry_run(const Config& cfg, const TrainOptions& opts);
DryRun dry_run(const Config& cfg, const std::string& run_dir);

// Trains (or, with opts.resume, continues) a run: data, engine, loop with periodic
// checkpoints, validation, metrics.jsonl (flushed line by line), final weights and
// summary. Stops early, with a checkpoint and the weights, when opts.stop asks.
TrainSummary run_training(const Config& cfg, const TrainOptions& opts);

}  // namespace fuyou
