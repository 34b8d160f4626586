// Step timing (Backend: step timing; fuyou-bench train --breakdown): the marks of one
// in-memory step tile the step's timeline, every op class the model runs appears once per
// layer and direction, and the per-phase, per-class and per-(phase, class) sums each add up
// to the timeline; on the CPU backend and on cpu-streams (marks queued as CUDA's are).
#include <catch2/catch.hpp>
#include <map>
#include <string>

#include "fuyou/backend.h"
#include "fuyou/backend_select.h"
#include "fuyou/breakdown.h"
#include "fuyou/config.h"
#include "fuyou/error.h"
#include "fuyou/train.h"

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
    // attention, one activation; two norms (and the final norm), two residual adds forward.
    for (OpClass c : {OpClass::kGemmQkv, OpClass::kGemmAttnProj, OpClass::kGemmMlpUp,
                      OpClass::kGemmMlpDown, OpClass::kAttention, OpClass::kActivation}) {
      INFO(op_class_name(c));
      CHECK(n(StepPhase::kForward, c) == 3);
      CHECK(n(StepPhase::kBackward, c) == 3);
    }
    CHECK(n(StepPhase::kForward, OpClass::kNorm) == 7);
    CHECK(n(StepPhase::kForward, OpClass::kResidual) == 6);
    CHECK(n(StepPhase::kForward, OpClass::kEmbedding) == 1);
    CHECK(n(StepPhase::kBackward, OpClass::kEmbedding) == 1);
    CHECK(n(StepPhase::kOptimizer, OpClass::kHostAdamW) == 1);
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
