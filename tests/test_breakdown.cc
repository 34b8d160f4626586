// Step timing (Backend: step timing; fuyou-bench train --breakdown): the marks of one
// in-memory step tile the step's timeline, every op class the model runs appears once per
// layer and direction, and the per-phase, per-class and per-(phase, class) sums each add up
// to the timeline; on the CPU backend and on cpu-streams (marks queued as CUDA's are). And
// each family's kernel calls per layer, counted by a CPU backend that counts them.
#include <catch2/catch.hpp>
#include <map>
#include <string>

#include "fuyou/backend.h"
#include "fuyou/backend_select.h"
#include "fuyou/breakdown.h"
#include "fuyou/config.h"
#include "fuyou/error.h"
#include "fuyou/train.h"
#include "kernels/cpu/cpu_backend.h"

using namespace fuyou;

TEST_CASE("a step's timing marks tile its timeline, op class by op class", "[breakdown]") {
  for (const char* backend : {"cpu", "cpu-streams"}) {
    INFO(backend);
    Config cfg = parse_config(
        str("model: {n_layer: 3, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 61, seq_len: 16}\n"
            "schedule: {micro_batch: 2}\nruntime: {backend: ",
            backend, ", threads: 1}\n"),
        "<test>");
    std::unique_ptr<Backend> be =
        std::string(backend) == "cpu" ? make_cpu_backend(1, 0) : make_cpu_stream_backend(1, 0, {});
    apply_precision(*be, cfg.runtime);
    InMemoryStep r(cfg, *be);
    r.init_params();
    std::vector<int32_t> batch(2 * 17);
    for (size_t i = 0; i < batch.size(); ++i) batch[i] = static_cast<int32_t>((i * 7 + 1) % 61);
    r.step(0, {batch.data()});  // warm
    const int edge = timing_tag(StepPhase::kOther, OpClass::kHost);
    be->timing_start();
    be->timing_mark(edge);
    r.step(1, {batch.data()});
    be->timing_mark(edge);
    const std::vector<Backend::TimingMark> marks = be->timing_stop();
    CHECK_FALSE(be->timing_on());
    REQUIRE(marks.size() > 10);
    for (size_t i = 1; i < marks.size(); ++i) CHECK(marks[i].t >= marks[i - 1].t);  // queue order
    std::map<std::pair<int, int>, int> count;  // (phase, class) -> marks
    for (const auto& m : marks)
      ++count[{static_cast<int>(tag_phase(m.tag)), static_cast<int>(tag_class(m.tag))}];
    auto n = [&](StepPhase p, OpClass c) {
      return count[{static_cast<int>(p), static_cast<int>(c)}];
    };
    // gpt2: per layer and direction one qkv, projection, MLP up and MLP down GEMM, one
    // attention, one activation; two norms (and the final norm), two residual adds forward,
    // the first fused with the second norm (marked as the norm).
    for (OpClass c : {OpClass::kGemmQkv, OpClass::kGemmAttnProj, OpClass::kGemmMlpUp,
                      OpClass::kGemmMlpDown, OpClass::kAttention, OpClass::kActivation}) {
      INFO(op_class_name(c));
      CHECK(n(StepPhase::kForward, c) == 3);
      CHECK(n(StepPhase::kBackward, c) == 3);
    }
    CHECK(n(StepPhase::kForward, OpClass::kNorm) == 7);
    CHECK(n(StepPhase::kForward, OpClass::kResidual) == 3);
    CHECK(n(StepPhase::kForward, OpClass::kEmbedding) == 1);
    CHECK(n(StepPhase::kBackward, OpClass::kEmbedding) == 1);
    // Per parameter group (embedding, 3 layers, final norm): the wait for its update, then its
    // copy to the device while the next group updates.
    CHECK(n(StepPhase::kOptimizer, OpClass::kHostAdamW) == 5);
    CHECK(n(StepPhase::kOptimizer, OpClass::kCopyToDevice) == 5);
    CHECK(n(StepPhase::kOptimizer, OpClass::kHostNorm) == 1);

    const StepBreakdown b = summarize_marks(marks, marks.back().t - marks.front().t + 1e-3);
    CHECK(b.timeline_s == Approx(marks.back().t - marks.front().t));
    CHECK(b.unaccounted_s == Approx(1e-3));
    for (const auto* sums : {&b.by_phase, &b.by_class, &b.by_phase_class}) {
      double total = 0;
      for (const auto& [name, s] : *sums) total += s;
      CHECK(total == Approx(b.timeline_s).epsilon(1e-9));
    }
    CHECK(b.by_phase.count("forward"));
    CHECK(b.by_phase.count("backward"));
    CHECK(b.by_phase.count("optimizer"));
    const nlohmann::json trace = marks_trace(marks);
    CHECK(trace["traceEvents"].size() == marks.size() - 1 + static_cast<size_t>(StepPhase::kCount));
  }
}

namespace {

// The CPU backend counting each kernel's calls: a step's kernel calls per layer are pinned
// below, so that a fused kernel that stops being used, or an extra pass, fails a test.
class CountingBackend final : public cpu::CpuBackend {
 public:
  using CpuBackend::CpuBackend;
  std::map<std::string, int> calls;
#define FY_KERNEL_COUNTED(name, params, args) \
  void name params override {                 \
    ++calls[#name];                           \
    CpuBackend::name args;                    \
  }
  FUYOU_LAYER_KERNELS(FY_KERNEL_COUNTED)
#undef FY_KERNEL_COUNTED
};

// Kernel calls of one in-memory training step (one micro-batch) of `model` with n_layer layers.
std::map<std::string, int> step_calls(const std::string& model, int n_layer) {
  Config cfg = parse_config(str("model: {", model, ", n_layer: ", n_layer,
                                ", vocab_size: 61, seq_len: 16}\n"
                                "schedule: {micro_batch: 2}\nruntime: {threads: 1}\n"),
                            "<test>");
  CountingBackend be(1, 0);
  apply_precision(be, cfg.runtime);
  InMemoryStep r(cfg, be);
  r.init_params();
  std::vector<int32_t> batch(2 * 17);
  for (size_t i = 0; i < batch.size(); ++i) batch[i] = static_cast<int32_t>((i * 7 + 1) % 61);
  be.calls.clear();
  r.step(0, {batch.data()});
  return be.calls;
}

}  // namespace

TEST_CASE("a step's kernel calls, per layer and outside the layers, for every family",
          "[breakdown]") {
  using Calls = std::map<std::string, int>;
  struct Family {
    const char* model;
    Calls per_layer, outside;  // outside: embedding, final norm, LM head and loss
  };
  // gpt2 per layer: two LayerNorms, four projections (qkv, attention out, MLP up, MLP down),
  // attention, GELU and two residual adds forward, the attention's add fused with the MLP's
  // LayerNorm; each backward once (the norms' backward adds the residual stream's gradient
  // itself). opt: ReLU for GELU. llama: RMSNorm, RoPE on q and k, the k/v heads repeated for
  // grouped-query attention, SwiGLU on one packed gate|up projection.
  const Calls gpt2_layer = {{"layernorm_forward", 1},  {"residual_layernorm_forward", 1},
                            {"layernorm_backward", 2}, {"matmul_forward", 4},
                            {"matmul_backward", 4},    {"attention_forward", 1},
                            {"attention_backward", 1}, {"gelu_forward", 1},
                            {"gelu_backward", 1},      {"add", 1}};
  Calls opt_layer = gpt2_layer;
  opt_layer.erase("gelu_forward");
  opt_layer.erase("gelu_backward");
  opt_layer["relu_forward"] = opt_layer["relu_backward"] = 1;
  const Calls llama_layer = {{"rmsnorm_forward", 1},    {"residual_rmsnorm_forward", 1},
                             {"rmsnorm_backward", 2},   {"matmul_forward", 4},
                             {"matmul_backward", 4},    {"rope_forward", 1},
                             {"rope_backward", 1},      {"repeat_kv_forward", 1},
                             {"repeat_kv_backward", 1}, {"attention_forward", 1},
                             {"attention_backward", 1}, {"swiglu_forward", 1},
                             {"swiglu_backward", 1},    {"add", 1}};
  // The loss and its gradient in one pass over the logits.
  const Calls ln_outside = {{"embedding_forward", 1},
                            {"embedding_backward", 1},
                            {"layernorm_forward", 1},
                            {"layernorm_backward", 1},
                            {"matmul_forward", 1},
                            {"matmul_backward", 1},
                            {"crossentropy_forward_backward", 1}};
  Calls rms_outside = ln_outside;
  rms_outside.erase("layernorm_forward");
  rms_outside.erase("layernorm_backward");
  rms_outside["rmsnorm_forward"] = rms_outside["rmsnorm_backward"] = 1;
  const std::vector<Family> families = {
      {"family: gpt2, n_head: 2, d_model: 16, d_ff: 24", gpt2_layer, ln_outside},
      {"family: opt, n_head: 2, d_model: 16, d_ff: 24", opt_layer, ln_outside},
      {"family: llama, n_head: 4, n_kv_head: 2, d_model: 16, d_ff: 24, tie_embeddings: false",
       llama_layer, rms_outside}};
  for (const Family& f : families) {
    INFO(f.model);
    const Calls two = step_calls(f.model, 2), three = step_calls(f.model, 3);
    Calls per_layer, outside;
    for (const auto& [name, n] : three) {
      const int in_two = two.count(name) ? two.at(name) : 0;
      if (n != in_two) per_layer[name] = n - in_two;
      if (in_two - 2 * (n - in_two) != 0) outside[name] = in_two - 2 * (n - in_two);
    }
    CHECK(per_layer == f.per_layer);
    CHECK(outside == f.outside);
  }
}
