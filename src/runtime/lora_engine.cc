#include "src/runtime/lora_engine.h"

#include "fuyou/error.h"
#include "fuyou/lora_step.h"
#include "fuyou/sizes.h"
#include "src/formats/safetensors_stream.h"

namespace fuyou {
namespace {

class LoraEngine final : public TrainEngine {
 public:
  LoraEngine(const Config& cfg, Backend& be) : step_(cfg, be), be_(be) {}
  bool offloaded() const override { return false; }
  bool optimizer_on_device() const override { return false; }
  std::string describe() const override {
    const size_t n = step_.layout().params.num_params();
    return str("LoRA in memory: the frozen base and the adapters on the device (",
               format_size(be_.memory().used), "), the adapters' fp32 master weights and Adam ",
               "moments in host memory (", format_size(12 * n), "), AdamW over the ", n,
               " adapter parameters on the host");
  }
  // The adapters were set when the step was made (lora.init); a resume overwrites them.
  void init_params() override {}
  StepResult step(int64_t s, const std::vector<const int32_t*>& mbs,
                  const std::vector<const uint8_t*>& masks,
                  const std::vector<const int32_t*>& positions) override {
    return step_.step(s, mbs, masks, positions);
  }
  float eval_loss(const int32_t* batch, const uint8_t* mask, const int32_t* positions) override {
    return step_.eval_loss(batch, mask, positions);
  }
  // The adapters only, under their engine names (h.L.<linear>.lora_A / lora_B): the base is
  // model.checkpoint's, unchanged.
  void save_weights(const std::string& path,
                    const std::map<std::string, std::string>& md) override {
    const ParamLayout& layout = step_.layout().params;
    std::vector<StEntry> entries;
    for (const TensorSpec& t : layout.tensors) entries.push_back({t.name, StDtype::kF32, t.shape});
    SafetensorsStreamWriter w(path, entries, md);
    for (const TensorSpec& t : layout.tensors) {
      w.begin_tensor(t.name);
      w.append(step_.adapters().data() + t.offset, 4 * t.numel);
    }
    w.finish();
  }
  void write_trace(const std::string& path) const override {
    throw Error(str("--trace ", path,
                    ": traces come from the offloading scheduler; a LoRA run trains in memory "
                    "(docs/lora.md)"));
  }
  void read_state(int g, StateKind kind, const StateSink& sink) override {
    step_.read_state(g, kind, sink);
  }
  void write_state(int g, StateKind kind, const StateSource& source) override {
    step_.write_state(g, kind, source);
  }
  // The config check refuses packed state with a lora section: fp32 moments and master.
  OptimFormat optim_format() const override { return {}; }
  void read_packed(int, StateKind, const PackedSink&) override {
    FY_CHECK(false, "a LoRA run's optimizer state is fp32, never packed");
  }
  void write_packed(int, StateKind, const PackedSource&) override {
    FY_CHECK(false, "a LoRA run's optimizer state is fp32, never packed");
  }
  OptimizerCounters counters() override { return step_.counters(); }
  void set_counters(const OptimizerCounters& c) override { step_.set_counters(c); }
  std::string base_xxh3() const override { return step_.base_xxh3(); }

 private:
  LoraStep step_;
  Backend& be_;
};

}  // namespace

std::unique_ptr<TrainEngine> make_lora_engine(const Config& cfg, Backend& backend) {
  return std::make_unique<LoraEngine>(cfg, backend);
}

}  // namespace fuyou
