#include "fuyou/engine.h"

#include "fuyou/error.h"
#include "fuyou/log.h"
#include "fuyou/model.h"
#include "fuyou/sizes.h"
#include "src/formats/safetensors_stream.h"

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
    for (const TensorSpec& t : layout.tensors) {
      if (t.group != static_cast<int>(g)) continue;
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
  std::string describe() const override {
    return str("in-memory training: parameters, gradients and activations on the device (",
               format_size(be_.memory().used), "), fp32 master weights and Adam moments in host memory (",
               format_size(16ull * runner_.master().size()), ")");
  }
  void init_params() override { runner_.init_params(); }
  EngineStep step(int64_t s, const std::vector<const int32_t*>& mbs) override {
    auto r = runner_.step(s, mbs);
    EngineStep e;
    e.loss = r.loss;
    e.grad_norm = r.grad_norm;
    e.lr = r.lr;
    return e;
  }
  bool eval_loss(const int32_t* batch, float* loss) override {
    *loss = runner_.eval_loss(batch);
    return true;
  }
  void save_weights(const std::string& path, const std::map<std::string, std::string>& md) override {
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
  void write_trace(const std::string& path) const override {
    throw Error(str("--trace ", path, ": traces come from the offloading scheduler; this run trains in memory "
                    "(set offload.ssd_paths or offload.activations: swap to use the scheduler)"));
  }

 private:
  Config cfg_;
  StepRunner runner_;
  Backend& be_;
};

class OffloadEngine final : public TrainEngine {
 public:
  OffloadEngine(const Config& cfg, Backend& be, std::unique_ptr<SsdStore> store, Plan plan)
      : cfg_(cfg), store_(std::move(store)), layout_(make_gpt_layout(cfg.model)),
        trainer_(cfg, be, std::move(plan), store_.get()) {}
  bool offloaded() const override { return true; }
  std::string describe() const override { return trainer_.plan().table(); }
  void init_params() override {
    float* buf = trainer_.group_staging();
    for (size_t g = 0; g < layout_.groups.size(); ++g) {
      init_gpt_group(cfg_.model, layout_, static_cast<int>(g), buf);
      trainer_.set_group_params(static_cast<int>(g), buf);
    }
  }
  EngineStep step(int64_t s, const std::vector<const int32_t*>& mbs) override {
    if (mbs.size() != 1)
      throw ConfigError(str("schedule.grad_accum is ", mbs.size(), ": the offloading scheduler runs one micro-batch "
                            "per step for now; use grad_accum 1 and a larger micro_batch"));
    EngineStep e;
    e.detail = trainer_.step(s, mbs[0]);
    e.loss = e.detail.loss;
    e.grad_norm = e.detail.grad_norm;
    e.lr = e.detail.lr;
    e.offloaded = true;
    return e;
  }
  bool eval_loss(const int32_t*, float*) override { return false; }
  void save_weights(const std::string& path, const std::map<std::string, std::string>& md) override {
    save_streaming(path, layout_, md, trainer_.group_staging(),
                   [&](int g, float* dst) { trainer_.read_group_params(g, dst); });
  }
  void write_trace(const std::string& path) const override { trainer_.write_trace(path); }

 private:
  Config cfg_;
  std::unique_ptr<SsdStore> store_;
  ParamLayout layout_;
  OffloadTrainer trainer_;
};

}  // namespace

uint64_t in_memory_device_bytes(const ModelConfig& m, int B) {
  ParamLayout layout = make_gpt_layout(m);
  const uint64_t N = static_cast<uint64_t>(B) * m.seq_len, C = m.d_model, F = m.d_ff, V = m.vocab_size,
                 T = m.seq_len, H = m.n_head;
  uint64_t acts = 4 * (N * (7 * C + 2 * F + 4) + B * H * T * T);
  uint64_t workspace = 8 * N + 4 * (N * C + 4 * N + N * V + 5 * N * C + B * H * T * T + N * F);
  return 8 * layout.total + m.n_layer * acts + 4 * N * C + workspace;
}

bool wants_offload(const Config& cfg) {
  if (!cfg.offload.ssd_paths.empty()) return true;
  ActivationPolicy a = cfg.offload.activations;
  if (a == ActivationPolicy::kSwap || a == ActivationPolicy::kRecompute) return true;
  return cfg.offload.device_memory &&
         in_memory_device_bytes(cfg.model, cfg.schedule.micro_batch) > cfg.offload.device_memory;
}

std::unique_ptr<TrainEngine> make_train_engine(const Config& cfg, Backend& backend) {
  if (!wants_offload(cfg)) return std::make_unique<InMemoryEngine>(cfg, backend);
  PlanRequest req;
  req.model = cfg.model;
  req.micro_batch = cfg.schedule.micro_batch;
  req.exact = cfg.optimizer.grad_clip > 0;
  req.device_budget = cfg.offload.device_memory;
  req.host_budget = cfg.offload.host_memory;
  req.have_ssd = !cfg.offload.ssd_paths.empty();
  const int L = cfg.model.n_layer;
  switch (cfg.offload.activations) {
    case ActivationPolicy::kAuto: req.default_act = ActPlacement::kKeep; break;
    case ActivationPolicy::kKeep: req.acts.assign(L, ActPlacement::kKeep); break;
    case ActivationPolicy::kSwap:
      req.acts.assign(L, req.have_ssd ? ActPlacement::kSsd : ActPlacement::kHost);
      break;
    case ActivationPolicy::kRecompute:
      // Checkpoint every other layer on the device; rebuild the ones between.
      req.acts.assign(L, ActPlacement::kDevice);
      for (int l = 1; l < L; l += 2) req.acts[l] = ActPlacement::kRecompute;
      break;
  }
  Plan plan = make_plan(req);
  std::unique_ptr<SsdStore> store;
  if (req.have_ssd) {
    StoreConfig sc;
    sc.dirs = cfg.offload.ssd_paths;
    store = SsdStore::open(sc);
  }
  return std::make_unique<OffloadEngine>(cfg, backend, std::move(store), std::move(plan));
}

}  // namespace fuyou
