// The executor behind PlanExecutor (include/fuyou/scheduler.h): one worker thread per
// resource runs the plan's ops in order (the reordering queues: next_in_queue), each once its
// dependencies are done; two iterations may be in flight. Its buffers come from the plan's
// buffer table and every op finds its operands in its uses, so an op means here what it
// means to the hazard analysis and the simulator.
//
// scheduler.cc: queues, workers, steps; executor_buffers.cc: the buffers and parameters in
// and out; executor_ops.cc: what each op does.
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "fuyou/loss_scale.h"
#include "fuyou/model.h"
#include "fuyou/ooc_adamw.h"
#include "fuyou/scheduler.h"

namespace fuyou {

class PlanExecutor::Impl {
 public:
  Impl(PlanExecutor& owner, const Config& cfg, Backend& be, Plan plan, SsdStore* store);
  ~Impl();

  const Plan& plan() const { return plan_; }
  void set_group_params(int g, const float* src);
  void set_group_weights(int g, const float* src);
  void set_params(const float* params);
  void read_group_params(int g, float* dst);
  void read_params(float* params);
  float* group_staging();
  void read_group_state(int g, StateKind kind, const StateSink& sink);
  void write_group_state(int g, StateKind kind, const StateSource& source);
  void read_group_packed(int g, StateKind kind, const PackedSink& sink);
  void write_group_packed(int g, StateKind kind, const PackedSource& source);
  OptimizerCounters counters();
  void set_counters(const OptimizerCounters& c);
  StepResult step(int64_t step_index, const std::vector<const int32_t*>& micro_batches,
                  const std::vector<const uint8_t*>& masks,
                  const std::vector<const int32_t*>& positions);
  float eval_loss(const int32_t* batch, const uint8_t* mask, const int32_t* positions);
  void write_trace(const std::string& path);

 private:
  using clock_type = std::chrono::steady_clock;

  // The op lists of one plan, per resource.
  struct Run {
    const Plan* plan = nullptr;
    std::vector<int> queue[kNumResources];
    int returns = 0;              // ops step() waits for (step_waits_for)
    std::vector<OpBuffers> bufs;  // per op: what it touches (a reordering queue's check)
    // Per op: a compute op that must be finished on the device before it counts as done
    // (Backend::finish_compute): an op of another queue waits for it, in its iteration or the
    // next, or step() returns at it. The compute queue runs in order, so an op that only
    // compute ops wait for counts as done once queued: one host sync fewer.
    std::vector<char> sync;
  };

  // One iteration in flight. Iteration t+1 starts while t's updates and writes still run,
  // so everything an op reads besides the buffers (tokens, learning rate, loss scale, the
  // step's decision) lives here, one copy per iteration.
  struct Iter {
    const Run* run = nullptr;
    int64_t step = -1;
    bool prev = false;          // overlaps the other slot's iteration: waits on it by prev_deps_
    bool forward_only = false;  // the validation plan
    std::vector<std::vector<int32_t>> inputs, targets;  // per micro-batch
    std::vector<std::vector<int32_t>> positions;        // per micro-batch of packed records (B*T)
    bool packed = false;                                // positions hold this iteration's records
    std::vector<float> losses;    // per micro-batch: mean over its counted targets
    std::vector<int64_t> counts;  // per micro-batch: counted targets
    std::vector<double> sum_sq;   // per group (exact mode)
    float loss_scale = 0;         // head gradient scale: loss scale / counted targets
    double step_loss_scale = 1;   // fp16 loss scale of this step (1 without fp16)
    bool apply = true;            // false: this step's updates are skipped (fp16 overflow)
    double grad_norm = 0, lr = 0;
    float grad_scale = 1.0f;
    int64_t t = 0;  // Adam's step count
    float eval_loss = 0;
    // Progress, guarded by mu_: per op done flag and times (s since epoch_, -1: not yet).
    std::vector<char> done;
    std::vector<double> start, end;
    int pending = 0;    // ops not finished
    int returning = 0;  // step_waits_for ops not finished
    // The embedding's first update part (Plan::embed_rows_first): the element ranges it
    // updated (the next step's first micro-batch's token rows, then the position table),
    // and whether those were the next step's rows (false: the next step was not queued yet,
    // so its embedding forward waits for every part's refresh).
    std::vector<std::pair<size_t, size_t>> first_rows;
    bool first_rows_next = false;
  };

  // A fixed-capacity queue in submission order (sized before the first step: no allocation
  // while running). Ops leave it from the front once done; a reordering queue may run one
  // behind the front first (next_op).
  struct Ring {
    std::vector<std::pair<int, int>> items;
    size_t head = 0, tail = 0;
    size_t size() const { return (tail + items.size() - head) % items.size(); }
    const std::pair<int, int>& front() const { return items[head]; }
    const std::pair<int, int>& at(size_t k) const { return items[(head + k) % items.size()]; }
    void push(std::pair<int, int> x);
    void pop() { head = (head + 1) % items.size(); }
    void clear() { head = tail; }
  };

  // ---- executor_buffers.cc ----
  void check_plan();
  void allocate_device(int id, const PlanBuffer& b);
  void allocate_buffers();
  void make_optimizer();
  // Plan::device_optimizer: group g's fp32 master on the device (the weights themselves with
  // fp32 tensors), its moments, and its weights there.
  float* device_master(int g) const;
  float* device_moment(int g, StateKind kind) const;
  void* device_weights(int g) const;
  void register_host_buffers();
  float* ptr(int buffer) const { return static_cast<float*>(ptr_[buffer]); }
  // The use's bytes: its buffer's memory from its offset.
  float* at(const BufferUse& u) const {
    return reinterpret_cast<float*>(static_cast<char*>(ptr_[u.buffer]) + u.offset);
  }
  void* group_host_weights(int g) const;
  // The group's weights from fp32 (master) values into `dst`, as the device holds them (a
  // split master's working halves: math::split_hi).
  void put_weights(void* dst, const float* src, size_t n) const;
  // Group g's current working weights in host memory (a split master's halves): its host
  // buffer, or for a layer on SSD its extent read into a read-staging slot (between steps).
  const uint16_t* group_working_weights(int g);

  // ---- executor_ops.cc ----
  void run_op(Iter& it, const PlanOp& op);
  // The backend's copies, counting the bytes into the op's OpTraffic (moved_).
  void to_device(const PlanOp& op, void* dst, const void* src, size_t bytes);
  void to_host(const PlanOp& op, void* dst, const void* src, size_t bytes);
  void store_read(const PlanOp& op);
  void store_write(const PlanOp& op);
  void run_forward(Iter& it, const PlanOp& op);
  void run_backward(const PlanOp& op);
  void run_head(Iter& it, const PlanOp& op);
  void save_grads(Iter& it, const PlanOp& op);
  void load_resident(Iter& it, const PlanOp& op);
  void update(Iter& it, const PlanOp& op);
  void device_update(Iter& it, const PlanOp& op);
  void first_rows(Iter& it);
  static void rows_complement(const Iter& it, size_t begin, size_t end,
                              std::vector<std::pair<size_t, size_t>>& out);
  LayerTensors layer_view(void* slot, int l) { return layer_group_tensors(layout_, l, slot, es_); }
  GlobalTensors globals(void* embed, void* fin) { return global_tensors(layout_, embed, fin, es_); }
  // Element ranges [a, b) of a group's buffer of device-tensor elements, as bytes.
  char* elem(void* base, size_t i) const { return static_cast<char*>(base) + i * es_; }
  // What the norm and the updates read: the fp32 sums (Plan::accum_fp32), else the tensors.
  ElemType grad_type() const { return plan_.accum_fp32 ? ElemType::kF32 : tensors_; }
  // The type of a device op's source gradient: fp32 where it is a sum over micro-batches on
  // the device (kDeviceGradSum), else the tensors'.
  ElemType source_type(const PlanOp& op) const {
    return plan_.buffers[op.use(Role::kSource).buffer].kind == BufferKind::kDeviceGradSum
               ? ElemType::kF32
               : tensors_;
  }

  // ---- scheduler.cc ----
  void prepare_runs();
  template <typename Busy>
  void add_busy(const Iter& x, double t_end, Busy& busy) const;
  double now() const { return std::chrono::duration<double>(clock_type::now() - epoch_).count(); }
  bool ready(int i, int id) const;
  long next_op(int r) const;
  void worker(int r);
  template <class Pred>
  void wait_for(std::unique_lock<std::mutex>& lock, Pred pred);
  void drain();
  template <class Fill>
  Iter& submit(Run& run, int64_t step, Fill fill);
  StepResult step_result(Iter& it);

  PlanExecutor& owner_;
  Config cfg_;
  Backend& be_;
  Plan plan_;
  SsdStore* store_;
  ParamLayout layout_;
  Transformer model_;
  size_t N_ = 0;
  ElemType tensors_;  // the device's tensors (plan_.tensors, the backend's storage type)
  size_t es_;         // bytes per element of them

  // The buffer table's memory, by buffer id (null where the model, the optimizer or the
  // process owns it), and the SSD extents.
  std::vector<void*> ptr_;
  std::vector<ExtentId> ext_;
  std::vector<LayerActivations> acts_;          // kWorkActs, kLayerActs: the model's allocations
  std::vector<void*> owned_;                    // device allocations, freed at the end
  std::vector<std::vector<float>> host_owned_;  // resident host buffers
  std::unique_ptr<HostPool> pool_;              // the host slot pools
  void *embed_w_ = nullptr, *embed_g_ = nullptr, *final_w_ = nullptr, *final_g_ = nullptr;
  std::unique_ptr<OocAdamW> opt_;  // null with Plan::device_optimizer
  // Plan::device_optimizer: each group's first piece and count in the kAdamWPieces buffer.
  std::vector<std::pair<size_t, size_t>> group_pieces_;

  Plan eval_plan_;
  Run train_, eval_;
  std::vector<std::vector<int>> prev_deps_;  // previous_iteration_deps(plan_)
  std::vector<int> embed_refresh_ops_;       // the embedding's refresh parts in plan_
  std::vector<int32_t> row_tokens_;          // first_rows' scratch (d2h thread)
  std::vector<std::pair<size_t, size_t>> opt_ranges_, h2d_ranges_,
      d2h_ranges_;  // rows_complement's, per thread
  Iter iters_[2];   // the iterations that may be in flight; submissions alternate
  int next_slot_ = 0;
  Ring rings_[kNumResources];  // per resource: (iteration slot, op id) in submission order
  std::vector<std::thread> workers_;
  std::vector<void*> registered_;  // host buffers page-locked through the backend
  std::mutex mu_;                  // guards iters_' progress fields, rings_, failed_, error_, stop_
  std::condition_variable cv_;
  bool stop_ = false;
  bool failed_ = false;  // an op threw: nothing more runs, every later call rethrows
  std::exception_ptr error_;
  clock_type::time_point epoch_;
  double window_start_ = -1;  // when the current step window began (-1: at the next submission)
  uint64_t window_read_ = 0, window_written_ = 0;    // store counters at that moment
  std::array<double, kNumResources> window_busy_{};  // busy time of iterations retired within it
  double window_disk_ = 0;                           // the store's busy_s at that moment
  std::array<OpTraffic, kNumResources> moved_{};     // per resource thread: the running op's bytes
  int update_threads_ =
      1;  // runtime.threads: every worker's, and an update's that has the cores to itself
  std::unique_ptr<DynamicLossScaler> scaler_;
  int64_t t_ = 0;  // Adam's step count of the last submitted step
};

}  // namespace fuyou
