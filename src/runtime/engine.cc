#include "fuyou/engine.h"

#include <sys/statvfs.h>
#include <unistd.h>

#include <set>

#include "fuyou/backend_select.h"
#include "fuyou/error.h"
#include "fuyou/hf_checkpoint.h"
#include "fuyou/log.h"
#include "fuyou/model.h"
#include "fuyou/sizes.h"
#include "fuyou/swap_search.h"
#include "src/formats/safetensors_stream.h"
#include "src/runtime/lora_engine.h"
#include "src/runtime/run_checks.h"

namespace fuyou {
namespace {

// `buf` holds the largest group.
void save_streaming(const std::string& path, const ParamLayout& layout,
                    const std::map<std::string, std::string>& metadata, float* buf,
                    const std::function<void(int, float*)>& read_group) {
  std::vector<StEntry> entries;
  for (const TensorSpec& t : layout.tensors) entries.push_back({t.name, StDtype::kF32, t.shape});
  SafetensorsStreamWriter w(path, entries, metadata);
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    read_group(static_cast<int>(g), buf);
    const ParamGroup& pg = layout.groups[g];
    for (size_t i = pg.first_tensor; i < pg.first_tensor + pg.num_tensors; ++i) {
      const TensorSpec& t = layout.tensors[i];
      w.begin_tensor(t.name);
      w.append(buf + (t.offset - layout.groups[g].offset), 4 * t.numel);
    }
  }
  w.finish();
}

class InMemoryEngine final : public TrainEngine {
 public:
  InMemoryEngine(const Config& cfg, Backend& be) : cfg_(cfg), runner_(cfg, be), be_(be) {}
  bool offloaded() const override { return false; }
  bool optimizer_on_device() const override { return runner_.optimizer_on_device(); }
  std::string describe() const override {
    if (runner_.optimizer_on_device())
      return str(
          "in-memory training: parameters, gradients, activations, fp32 master weights and Adam "
          "moments on the device (",
          format_size(be_.memory().used), "), AdamW on the device (optimizer.placement)");
    const OptimFormat& f = runner_.optim_format();
    return str("in-memory training: parameters, gradients and activations on the device (",
               format_size(be_.memory().used), "), ", master_format_name(f.master),
               " master weights and ", moment_format_name(f.moments),
               " Adam moments in host memory (",
               format_size(optim_state_bytes(f, runner_.num_params())), "), AdamW on the host");
  }
  void init_params() override {
    if (cfg_.model.checkpoint.empty()) return runner_.init_params();
    // model.checkpoint: the weights come from the converted checkpoint, group by group.
    const ParamLayout& layout = runner_.model().layout();
    CheckpointGroupReader reader(cfg_.model.checkpoint, cfg_.model);
    std::vector<float> params(layout.total, 0.0f);
    for (size_t g = 0; g < layout.groups.size(); ++g)
      reader.read_group(static_cast<int>(g), params.data() + layout.groups[g].offset);
    runner_.set_params(params.data());
  }
  StepResult step(int64_t s, const std::vector<const int32_t*>& mbs,
                  const std::vector<const uint8_t*>& masks,
                  const std::vector<const int32_t*>& positions) override {
    return runner_.step(s, mbs, masks, positions);
  }
  float eval_loss(const int32_t* batch, const uint8_t* mask, const int32_t* positions) override {
    return runner_.eval_loss(batch, mask, positions);
  }
  void save_weights(const std::string& path,
                    const std::map<std::string, std::string>& md) override {
    const ParamLayout& layout = runner_.model().layout();
    // In memory the master array already holds every group: write from it directly.
    float* base = const_cast<float*>(runner_.master().data());
    std::vector<StEntry> entries;
    for (const TensorSpec& t : layout.tensors) entries.push_back({t.name, StDtype::kF32, t.shape});
    SafetensorsStreamWriter w(path, entries, md);
    for (const TensorSpec& t : layout.tensors) {
      w.begin_tensor(t.name);
      w.append(base + t.offset, 4 * t.numel);
    }
    w.finish();
  }
  void read_state(int g, StateKind kind, const StateSink& sink) override {
    runner_.read_state(g, kind, sink);
  }
  void write_state(int g, StateKind kind, const StateSource& source) override {
    runner_.write_state(g, kind, source);
  }
  OptimFormat optim_format() const override { return runner_.optim_format(); }
  void read_packed(int g, StateKind kind, const PackedSink& sink) override {
    runner_.read_packed(g, kind, sink);
  }
  void write_packed(int g, StateKind kind, const PackedSource& source) override {
    runner_.write_packed(g, kind, source);
  }
  OptimizerCounters counters() override { return runner_.counters(); }
  void set_counters(const OptimizerCounters& c) override { runner_.set_counters(c); }
  void write_trace(const std::string& path) const override {
    throw Error(str("--trace ", path,
                    ": traces come from the offloading scheduler; this run trains in memory "
                    "(set offload.ssd_paths or offload.activations: swap to use the scheduler)"));
  }

 private:
  Config cfg_;
  InMemoryStep runner_;
  Backend& be_;
};

// A plan on the executor: offloaded, or in memory (in_memory_plan: the weights and
// activations stay on the device, AdamW on the host).
class PlanEngine final : public TrainEngine {
 public:
  PlanEngine(const Config& cfg, Backend& be, std::unique_ptr<SsdStore> store, Plan plan)
      : cfg_(cfg),
        be_(be),
        store_(std::move(store)),
        layout_(make_gpt_layout(cfg.model)),
        trainer_(cfg, be, std::move(plan), store_.get()),
        optim_format_(fuyou::optim_format(cfg.optimizer)) {}
  bool offloaded() const override { return !trainer_.plan().resident_weights; }
  bool optimizer_on_device() const override { return trainer_.plan().device_optimizer; }
  std::string describe() const override {
    const Plan& plan = trainer_.plan();
    if (!plan.resident_weights) return plan.table();
    if (plan.device_optimizer)
      return str(
          "in-memory training as a plan of the scheduler: weights, activations, gradients, fp32 "
          "master weights and Adam moments on the device (",
          format_size(plan.memory.device_bytes),
          "); each group's AdamW runs there on the compute queue as soon as its gradients are "
          "made (with clipping or fp16, once the last backward has given the norm) and nothing "
          "crosses the bus (",
          be_.name(), ")\n", plan.table());
    return str(
        "in-memory training as a plan of the scheduler: weights, activations and the "
        "gradients being made on the device (",
        format_size(plan.memory.device_bytes), "), ", master_format_name(optim_format_.master),
        " master weights and ", moment_format_name(optim_format_.moments),
        " Adam moments in host memory (",
        format_size(optim_state_bytes(optim_format_, layout_.total)),
        "); each layer's gradients come down during the backward, its AdamW runs on the "
        "host as soon as they are there (with clipping or fp16, once the last backward "
        "has given the norm) and its new weights go up while the next forward runs (",
        be_.name(), ")\n", plan.table());
  }
  void init_params() override {
    float* buf = trainer_.group_staging();
    // model.checkpoint: streamed from the converted checkpoint one group at a time, so a
    // model larger than host memory starts from it too.
    std::unique_ptr<CheckpointGroupReader> reader;
    if (!cfg_.model.checkpoint.empty())
      reader = std::make_unique<CheckpointGroupReader>(cfg_.model.checkpoint, cfg_.model);
    for (size_t g = 0; g < layout_.groups.size(); ++g) {
      if (reader)
        reader->read_group(static_cast<int>(g), buf);
      else
        init_gpt_group(cfg_.model, layout_, static_cast<int>(g), buf);
      trainer_.set_group_params(static_cast<int>(g), buf);
    }
  }
  // The plan was built for schedule.grad_accum micro-batches (plan_request); the trainer
  // checks the count.
  StepResult step(int64_t s, const std::vector<const int32_t*>& mbs,
                  const std::vector<const uint8_t*>& masks,
                  const std::vector<const int32_t*>& positions) override {
    return trainer_.step(s, mbs, masks, positions);
  }
  // The plan's forward-only counterpart on the same pools (PlanExecutor::eval_loss).
  float eval_loss(const int32_t* batch, const uint8_t* mask, const int32_t* positions) override {
    return trainer_.eval_loss(batch, mask, positions);
  }
  void save_weights(const std::string& path,
                    const std::map<std::string, std::string>& md) override {
    save_streaming(path, layout_, md, trainer_.group_staging(),
                   [&](int g, float* dst) { trainer_.read_group_params(g, dst); });
  }
  void write_trace(const std::string& path) const override { trainer_.write_trace(path); }
  void read_state(int g, StateKind kind, const StateSink& sink) override {
    trainer_.read_group_state(g, kind, sink);
  }
  void write_state(int g, StateKind kind, const StateSource& source) override {
    trainer_.write_group_state(g, kind, source);
  }
  OptimFormat optim_format() const override { return optim_format_; }
  void read_packed(int g, StateKind kind, const PackedSink& sink) override {
    trainer_.read_group_packed(g, kind, sink);
  }
  void write_packed(int g, StateKind kind, const PackedSource& source) override {
    trainer_.write_group_packed(g, kind, source);
  }
  OptimizerCounters counters() override { return trainer_.counters(); }
  void set_counters(const OptimizerCounters& c) override { trainer_.set_counters(c); }
  std::vector<std::string> store_cleanup_paths() const override {
    return store_ ? store_->cleanup_paths() : std::vector<std::string>{};
  }
  const Plan* plan() const override { return &trainer_.plan(); }
  double predicted_iteration_s() const override { return predicted_; }
  double predicted_ = 0;  // set by make_train_engine after an automatic placement

 private:
  Config cfg_;
  Backend& be_;
  std::unique_ptr<SsdStore> store_;
  ParamLayout layout_;
  PlanExecutor trainer_;
  OptimFormat optim_format_;
};

}  // namespace

size_t device_tensor_bytes(const RuntimeConfig& runtime) {
  return elem_type_size(device_tensor_type(runtime));
}

uint64_t in_memory_device_bytes(const ModelConfig& m, int B, size_t elem_bytes) {
  ParamLayout layout = make_gpt_layout(m);
  const uint64_t N = static_cast<uint64_t>(B) * m.seq_len, C = m.d_model;
  // Parameters and gradients, every layer's activations, the embedding output, workspace:
  // the model's own allocation lists (src/model/gpt.cc).
  return elem_bytes * (2 * layout.total + N * C) +
         m.n_layer * layer_activation_bytes(m, B, elem_bytes) +
         model_workspace_bytes(m, B, elem_bytes);
}

bool wants_offload(const Config& cfg) {
  if (!cfg.offload.ssd_paths.empty()) return true;
  ActivationPolicy a = cfg.offload.activations;
  return a == ActivationPolicy::kSwap || a == ActivationPolicy::kRecompute;
}

PlanRequest plan_request(const Config& cfg) {
  // Every plan (the engines', fuyou-bench plan and simulate, --dry-run) starts here: a LoRA
  // config would otherwise be planned as a full fine-tune.
  if (cfg.lora.enabled())
    throw ConfigError(
        "lora: the planner and the simulator do not know LoRA yet (a frozen base, no optimizer "
        "stream): no plan is made for a lora config (docs/lora.md)");
  PlanRequest req;
  req.model = cfg.model;
  req.micro_batch = cfg.schedule.micro_batch;
  req.tensors = device_tensor_type(cfg.runtime);
  // Clipping and the fp16 overflow check both need every gradient before any update.
  req.exact = cfg.optimizer.grad_clip > 0 || cfg.runtime.precision == "fp16";
  req.grad_accum = cfg.schedule.grad_accum;
  req.accum_fp32 = sums_grads_in_fp32(cfg);
  req.optim_format = optim_format(cfg.optimizer);
  req.device_budget = cfg.offload.device_memory;
  req.host_budget = cfg.offload.host_memory;
  req.have_ssd = !cfg.offload.ssd_paths.empty();
  req.weights_on_ssd = cfg.offload.weights == "ssd";
  req.optim_on_ssd = cfg.offload.optimizer_state == "ssd";
  req.deferred_updates = cfg.offload.deferred_updates;
  const int L = cfg.model.n_layer;
  switch (cfg.offload.activations) {
    case ActivationPolicy::kAuto:
      req.default_act = ActPlacement::kKeep;
      break;
    case ActivationPolicy::kKeep:
      req.acts.assign(L, ActPlacement::kKeep);
      break;
    case ActivationPolicy::kSwap:
      req.acts.assign(L, req.have_ssd ? ActPlacement::kSsd : ActPlacement::kHost);
      break;
    case ActivationPolicy::kRecompute:
      // Checkpoint every other layer on the device; rebuild the ones between.
      req.acts.assign(L, ActPlacement::kDevice);
      for (int l = 1; l < L; l += 2) req.acts[l] = ActPlacement::kRecompute;
      break;
  }
  return req;
}

uint64_t in_memory_state_bytes(const ModelConfig& m, bool fp32_sums, const OptimFormat& format) {
  const uint64_t params = make_gpt_layout(m).total;
  return (fp32_sums ? 8 : 4) * params + optim_state_bytes(format, params);
}

uint64_t in_memory_host_bytes(const ModelConfig& m, int micro_batch, bool device_in_host,
                              size_t elem_bytes, bool fp32_sums, const OptimFormat& format) {
  uint64_t arena = device_in_host ? in_memory_device_bytes(m, micro_batch, elem_bytes) : 0;
  if (device_in_host && elem_bytes < 4) arena += cpu_kernel_scratch_bytes(m, micro_batch);
  return kProcessBaseline + in_memory_state_bytes(m, fp32_sums, format) + arena;
}

bool sums_grads_in_fp32(const ScheduleConfig& schedule, ElemType tensors) {
  return schedule.grad_accum > 1 && tensors != ElemType::kF32 &&
         schedule.grad_accum_type != "tensors";
}

bool sums_grads_in_fp32(const Config& cfg) {
  return sums_grads_in_fp32(cfg.schedule, device_tensor_type(cfg.runtime));
}

namespace {

// The machine's physical memory in bytes; 0 when unknown.
uint64_t physical_memory() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
}

// offload.host_memory binds in-memory runs too: the offloading planner checks its plans
// against it, and in memory the same budget is checked here, before anything is allocated.
// Without a budget the machine's physical memory is the bound where the device arena is host
// memory: an arena that can never fit (a micro-batch of 65,536 sequences) is refused here
// instead of being allocated and touched until the kernel kills the process.
void check_in_memory_host_budget(const Config& cfg, bool device_in_host) {
  const bool set = cfg.offload.host_memory != 0;
  const uint64_t budget = set ? cfg.offload.host_memory : device_in_host ? physical_memory() : 0;
  const bool sums = sums_grads_in_fp32(cfg);
  const OptimFormat format = optim_format(cfg.optimizer);
  const uint64_t need = in_memory_host_bytes(cfg.model, cfg.schedule.micro_batch, device_in_host,
                                             device_tensor_bytes(cfg.runtime), sums, format);
  if (budget == 0 || need <= budget) return;
  const uint64_t state = in_memory_state_bytes(cfg.model, sums, format);
  throw Error(str(
      "host memory: in-memory training needs ", format_size(need), " but ",
      set ? str("offload.host_memory is ", format_size(budget))
          : str("this machine has ", format_size(budget), " of physical memory"),
      " (", format_size(kProcessBaseline), " process, ", format_size(state),
      " master weights, gradients", sums ? " (and their fp32 sums over micro-batches)" : "",
      " and Adam moments (",
      format.packed() ? str("optimizer.state ", moment_format_name(format.moments),
                            ", optimizer.master ", master_format_name(format.master))
                      : std::string("fp32"),
      ")",
      device_in_host
          ? str(", ", format_size(need - kProcessBaseline - state),
                " device arena (and its kernels' scratch with bf16 tensors), which the CPU "
                "backend keeps in host memory; the arena's activations grow with "
                "schedule.micro_batch (",
                cfg.schedule.micro_batch, ")")
          : std::string(),
      "); ",
      set ? "raise offload.host_memory, lower schedule.micro_batch" : "lower schedule.micro_batch",
      ", or set offload.ssd_paths to train offloaded with optimizer state on SSD"));
}

}  // namespace
PlanDevice plan_device(const Backend& backend) {
  PlanDevice d;
  d.own_compute = backend.kind() != BackendKind::kCpu;
  d.device_in_host = backend.device_is_host_memory();
  d.sum_squares = backend.supports_device_optimizer() && !d.device_in_host;
  return d;
}

PlanRequest plan_request(const Config& cfg, const PlanDevice& device, double attention_keys) {
  PlanRequest req = with_device(plan_request(cfg), device);
  req.attention_keys = attention_keys;
  return req;
}

namespace {

// The device memory an in-memory run may take: offload.device_memory, else a device's capacity
// where it is not host memory (a GPU's, the emulated device's); 0: no limit.
uint64_t in_memory_device_limit(const Config& cfg, const Backend& backend) {
  if (cfg.offload.device_memory) return cfg.offload.device_memory;
  return backend.device_is_host_memory() ? 0 : backend.memory().capacity;
}

// in_memory_device_bytes for the config's model, micro-batch and device tensors.
uint64_t in_memory_step_bytes(const Config& cfg) {
  return in_memory_device_bytes(cfg.model, cfg.schedule.micro_batch,
                                device_tensor_bytes(cfg.runtime));
}

}  // namespace

std::optional<Plan> in_memory_plan(const Config& cfg, Backend& backend, double attention_keys,
                                   std::string* why) {
  if (cfg.runtime.in_memory == "step") {
    *why = "runtime.in_memory is step";
    return std::nullopt;
  }
  const uint64_t limit = in_memory_device_limit(cfg, backend);
  const uint64_t model = in_memory_step_bytes(cfg);
  const uint64_t free_b = limit == 0 ? UINT64_MAX : limit > model ? limit - model : 0;
  PlanRequest req = plan_request(cfg, plan_device(backend), attention_keys);
  req.acts.assign(cfg.model.n_layer, ActPlacement::kKeep);
  req.resident_weights = true;
  req.device_optimizer = in_memory_optimizer_on_device(cfg, backend, free_b);
  // Sized unbounded, then held to the budgets: a plan over them leaves the run to the step.
  req.device_budget = 0;
  req.host_budget = 0;
  Plan plan = make_plan(req);
  if (limit && plan.memory.device_bytes > limit) {
    *why = str("the plan needs ", format_size(plan.memory.device_bytes),
               " of device memory, more than the ", format_size(limit),
               cfg.offload.device_memory ? " of offload.device_memory" : " the device holds");
    return std::nullopt;
  }
  if (cfg.offload.host_memory && plan.memory.host_bytes > cfg.offload.host_memory) {
    *why = str("the plan needs ", format_size(plan.memory.host_bytes),
               " of host memory, more than the ", format_size(cfg.offload.host_memory),
               " of offload.host_memory");
    return std::nullopt;
  }
  return plan;
}

Plan train_plan(const Config& cfg, Backend& backend, double* predicted_s,
                const HardwareProfile* placement, double attention_keys) {
  PlanRequest req = plan_request(cfg, plan_device(backend), attention_keys);
  // Without offload.host_memory the plan is held to the machine's physical memory: a plan
  // beyond it would be killed by the kernel part-way through its allocations instead of
  // refused here with its numbers (or, with offload.ssd_paths, placed partly on SSD).
  if (!req.host_budget) {
    req.host_budget = physical_memory();  // 0 where unknown: unlimited, as before
    req.host_budget_physical = req.host_budget != 0;
  }
  // A device of fixed capacity that is not host memory (a GPU, the emulated device) plans
  // within what it holds when offload.device_memory is unset.
  const uint64_t capacity = req.device_in_host ? 0 : backend.memory().capacity;
  Plan plan;
  double predicted = 0;
  if (cfg.offload.activations == ActivationPolicy::kAuto &&
      (placement || !cfg.offload.hardware.empty())) {
    // Automatic activation placement: the simulator's best plan on this profile.
    const HardwareProfile hw = placement ? *placement : run_hardware_profile(cfg);
    if (!req.device_budget) req.device_budget = capacity;
    SwapSearchResult s = search_swap(req, hw);
    spdlog::info(
        "automatic activation placement on {}: {} (micro-batch {}); predicted step {:.3f} s "
        "({} plans simulated in {:.2f} s)",
        placement ? hw.name : cfg.offload.hardware, s.summary(), s.micro_batch, s.sim.period_s,
        s.plans_evaluated, s.search_s);
    plan = std::move(s.plan);
    predicted = s.sim.period_s;
  } else {
    if (cfg.offload.activations == ActivationPolicy::kAuto)
      spdlog::info(
          "offload.activations auto without offload.hardware: activations placed by the memory "
          "rule (set offload.hardware to a profile, e.g. from fuyou-bench profile, for the "
          "cost-model search)");
    if (!req.device_budget) req.device_budget = capacity;
    plan = make_plan(req);
  }
  if (predicted_s) *predicted_s = predicted;
  return plan;
}

EngineChoice choose_engine(const Config& cfg, Backend& backend, double attention_keys) {
  EngineChoice c;
  // A LoRA run is LoraStep's (include/fuyou/lora_step.h): the base in memory, frozen. The config
  // check refused the offloading settings it does not run.
  if (cfg.lora.enabled()) {
    c.kind = EngineKind::kLora;
    c.why = "a lora section: the base frozen in memory, the adapters trained";
    return c;
  }
  if (wants_offload(cfg)) {
    c.why = !cfg.offload.ssd_paths.empty()
                ? "offload.ssd_paths is set"
                : str("offload.activations is ", activation_policy_name(cfg.offload.activations));
    return c;
  }
  std::string why;
  c.plan = in_memory_plan(cfg, backend, attention_keys, &why);
  if (c.plan) {
    c.kind = EngineKind::kInMemoryPlan;
    c.why = "the model, its gradients being made and its activations fit the device";
    return c;
  }
  // A plan over a budget trains offloaded: the scheduler places what the device (or the host)
  // cannot hold. The in-memory step only where asked for (runtime.in_memory step: the
  // reference the plans are compared with) and the model fits the device.
  if (cfg.runtime.in_memory != "step") {
    c.why = str("in memory as a plan: ", why);
    return c;
  }
  const uint64_t limit = in_memory_device_limit(cfg, backend);
  const uint64_t step = in_memory_step_bytes(cfg);
  if (limit && step > limit) {
    c.why = str("in memory the model needs ", format_size(step),
                " of device memory, more than the ", format_size(limit),
                cfg.offload.device_memory ? " of offload.device_memory" : " the device holds", " (",
                why, ")");
    return c;
  }
  c.kind = EngineKind::kInMemoryStep;
  c.why = why;
  return c;
}

namespace {

// What the space check of a plan's SSD state calls it, the run's and --dry-run's alike.
constexpr const char* kPlanSsdState = "the plan's SSD state";

StoreConfig store_config(const Config& cfg, std::shared_ptr<FileLayer> files) {
  StoreConfig sc;
  sc.dirs = cfg.offload.ssd_paths;
  sc.files = std::move(files);
  sc.verify = cfg.offload.verify_store;
  return sc;
}

}  // namespace

HardwareProfile run_hardware_profile(const Config& cfg) {
  HardwareProfile hw = load_hardware_profile(cfg.offload.hardware);
  std::set<std::string> filesystems;  // a path whose filesystem is unknown counts as its own
  for (const std::string& p : cfg.offload.ssd_paths) {
    // The nearest existing directory's filesystem: the store creates the path there.
    const std::string at = existing_ancestor(p).string();
    struct statvfs sv {};
    filesystems.insert(::statvfs(at.c_str(), &sv) == 0 ? str("fs ", sv.f_fsid) : "path " + p);
  }
  if (!filesystems.empty()) hw.ssds = static_cast<int>(filesystems.size());
  return hw;
}

void check_plan_ssd_space(const Config& cfg, const Plan& plan) {
  if (cfg.offload.ssd_paths.empty() || plan.memory.ssd_bytes == 0) return;
  SsdStore::check_space_before_open(store_config(cfg, nullptr), plan.memory.ssd_bytes,
                                    kPlanSsdState);
}

std::unique_ptr<TrainEngine> make_train_engine(const Config& cfg, Backend& backend,
                                               const EngineOptions& opts) {
  EngineChoice choice = choose_engine(cfg, backend, opts.attention_keys);
  if (choice.kind == EngineKind::kLora) {
    spdlog::info("LoRA training: {}", choice.why);
    return make_lora_engine(cfg, backend);
  }
  if (choice.kind != EngineKind::kOffloaded)
    check_in_memory_host_budget(cfg, backend.device_is_host_memory());
  if (choice.kind == EngineKind::kInMemoryStep) {
    spdlog::info("in-memory training runs as one step: {}", choice.why);
    return std::make_unique<InMemoryEngine>(cfg, backend);
  }
  if (choice.kind == EngineKind::kInMemoryPlan)
    return std::make_unique<PlanEngine>(cfg, backend, nullptr, std::move(*choice.plan));
  spdlog::info("offloaded training: {}", choice.why);
  double predicted = 0;
  Plan plan =
      train_plan(cfg, backend, &predicted,
                 opts.placement_profile ? &*opts.placement_profile : nullptr, opts.attention_keys);
  std::unique_ptr<SsdStore> store;
  if (!cfg.offload.ssd_paths.empty()) {
    store = SsdStore::open(store_config(cfg, opts.store_files));
    // The whole plan's extents at once, so a run that cannot hold them stops here with the
    // total rather than at whichever extent happens to be defined last.
    store->check_space(plan.memory.ssd_bytes, kPlanSsdState);
  }
  auto engine = std::make_unique<PlanEngine>(cfg, backend, std::move(store), std::move(plan));
  engine->predicted_ = predicted;
  return engine;
}

}  // namespace fuyou
