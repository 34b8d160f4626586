// Helpers shared by the tests that compare training runs bit for bit (the scheduler, exact
// mode, fp16 loss scaling, packed optimizer state, the CUDA scheduler): what a run records,
// their comparison, and the random token batches they train on.
#pragma once

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/config.h"
#include "fuyou/engine.h"
#include "fuyou/model.h"
#include "fuyou/rng.h"
#include "fuyou/scheduler.h"
#include "fuyou/train.h"

namespace fuyou::test {

// One training run: every step's loss, gradient norm (the executor's: exact mode only, else
// 0), skip decision and loss scale (fp16), and every parameter after the last step.
struct EngineRun {
  std::vector<float> losses;
  std::vector<double> norms;
  std::vector<bool> skipped;
  std::vector<double> loss_scales;
  std::vector<float> params;
  void record(const StepResult& r) {
    losses.push_back(r.loss);
    norms.push_back(r.grad_norm);
    skipped.push_back(r.skipped);
    loss_scales.push_back(r.loss_scale);
  }
};

// Bit-for-bit equality of run `a` with the reference: every step's loss, every parameter, and
// with `norms` every step's gradient norm. A failure names the step, or counts the
// parameters that differ.
inline void require_bitwise(const EngineRun& a, const EngineRun& ref, bool norms = false) {
  REQUIRE(a.losses.size() == ref.losses.size());
  if (norms) REQUIRE((a.norms.size() == a.losses.size() && ref.norms.size() == ref.losses.size()));
  for (size_t s = 0; s < a.losses.size(); ++s) {
    INFO("step " << s << ": loss " << a.losses[s] << ", reference " << ref.losses[s]);
    CHECK(std::memcmp(&a.losses[s], &ref.losses[s], sizeof(float)) == 0);
    if (norms) CHECK(std::memcmp(&a.norms[s], &ref.norms[s], sizeof(double)) == 0);
  }
  REQUIRE(a.params.size() == ref.params.size());
  size_t differ = 0;
  for (size_t i = 0; i < a.params.size(); ++i)
    differ += std::memcmp(&a.params[i], &ref.params[i], sizeof(float)) != 0;
  INFO(differ << " of " << a.params.size() << " parameters differ");
  CHECK(differ == 0);
}

// A TrainEngine's fp32 master weights, read back group by group (read_state: wherever the
// engine keeps them), into a whole layout of `layout.total` values.
inline std::vector<float> engine_master(TrainEngine& engine, const ParamLayout& layout) {
  std::vector<float> params(layout.total, 0.0f);
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    float* dst = params.data() + layout.groups[g].offset;
    engine.read_state(
        static_cast<int>(g), StateKind::kMaster,
        [&](size_t begin, const float* d, size_t n) { std::copy(d, d + n, dst + begin); });
  }
  return params;
}

// `count` micro-batches of micro_batch x (seq_len + 1) random token ids; batch s draws from
// Rng(seed, s).
inline std::vector<std::vector<int32_t>> random_batches(const Config& cfg, int count,
                                                        uint64_t seed) {
  std::vector<std::vector<int32_t>> out;
  for (int s = 0; s < count; ++s) {
    Rng rng(seed, s);
    std::vector<int32_t> b(static_cast<size_t>(cfg.schedule.micro_batch) * (cfg.model.seq_len + 1));
    for (auto& t : b) t = static_cast<int32_t>(rng.below(cfg.model.vocab_size));
    out.push_back(b);
  }
  return out;
}

// One step's micro-batches as the engines' step() takes them. The runs below take their data
// as one entry a step: a micro-batch (std::vector<int32_t>), or a step's grad_accum
// micro-batches (std::vector<std::vector<int32_t>>).
inline std::vector<const int32_t*> micro_batch_ptrs(const std::vector<int32_t>& batch) {
  return {batch.data()};
}
inline std::vector<const int32_t*> micro_batch_ptrs(
    const std::vector<std::vector<int32_t>>& micro_batches) {
  std::vector<const int32_t*> out;
  for (const auto& m : micro_batches) out.push_back(m.data());
  return out;
}

// The in-memory step (the reference) over `data` on backend `be`, from the model's initial
// parameters.
template <class StepData>
EngineRun in_memory_run(const Config& cfg, const std::vector<StepData>& data, Backend& be) {
  InMemoryStep r(cfg, be);
  r.init_params();
  EngineRun out;
  for (size_t s = 0; s < data.size(); ++s)
    out.record(r.step(static_cast<int64_t>(s), micro_batch_ptrs(data[s])));
  out.params = r.master();
  return out;
}

// The same on the CPU backend storing tensors as `storage`.
template <class StepData>
EngineRun in_memory_run(const Config& cfg, const std::vector<StepData>& data, ElemType storage) {
  auto be = make_cpu_backend(2, 0);
  be->set_storage_type(storage);
  return in_memory_run(cfg, data, *be);
}

// Steps the executor `tr` over `data` from the parameters it holds.
template <class StepData>
EngineRun run_steps(PlanExecutor& tr, const std::vector<StepData>& data) {
  EngineRun out;
  for (size_t s = 0; s < data.size(); ++s)
    out.record(tr.step(static_cast<int64_t>(s), micro_batch_ptrs(data[s])));
  out.params.resize(make_gpt_layout(tr.plan().model).total);
  tr.read_params(out.params.data());
  return out;
}

// The executor `tr` from the model's initial parameters over `data`.
template <class StepData>
EngineRun offloaded_run(PlanExecutor& tr, const std::vector<StepData>& data) {
  const ParamLayout layout = make_gpt_layout(tr.plan().model);
  std::vector<float> init(layout.total);
  init_gpt_params(tr.plan().model, layout, init.data());
  tr.set_params(init.data());
  return run_steps(tr, data);
}

}  // namespace fuyou::test
