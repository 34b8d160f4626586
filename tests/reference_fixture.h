// The PyTorch fixtures of tests/reference/fixtures (make_fixtures.py), shared by the CPU
// reference test and the CUDA backend's: their configs, initial weights, and the check of a
// 10-step AdamW run against PyTorch's losses and final weights.
#pragma once

#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "fuyou/error.h"
#include "fuyou/safetensors.h"
#include "fuyou/train.h"
#include "test_support.h"

namespace fuyou::test {

// The fixture's model, optimizer and schedule, on `backend` with fp32 GEMMs.
inline Config reference_fixture_config(const SafetensorsReader& f, const std::string& backend) {
  auto md = [&](const char* k) { return f.metadata().at(k); };
  std::string yaml = str(
      "model: {n_layer: ", md("n_layer"), ", n_head: ", md("n_head"), ", d_model: ", md("d_model"),
      ", d_ff: ", md("d_ff"), ", vocab_size: ", md("vocab_size"), ", seq_len: ", md("seq_len"), "}\n",
      "optimizer: {lr: ", md("lr"), ", min_lr: ", md("min_lr"), ", beta1: ", md("beta1"),
      ", beta2: ", md("beta2"), ", eps: ", md("eps"), ", weight_decay: ", md("weight_decay"),
      ", grad_clip: ", md("clip"), "}\n",
      "schedule: {steps: ", md("steps"), ", warmup_steps: ", md("warmup"), ", micro_batch: ",
      md("batch"), ", grad_accum: ", md("grad_accum"), "}\n",
      "runtime: {backend: ", backend, ", precision: fp32, threads: 2}\n");
  return parse_config(yaml, f.path());
}

inline std::vector<std::string> reference_fixtures() {
  std::vector<std::string> out;
  for (auto& e : std::filesystem::directory_iterator(source_path("tests/reference/fixtures")))
    if (e.path().extension() == ".safetensors") out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Sets the runner's weights from the fixture tensors named prefix + engine name.
inline void load_fixture_params(const SafetensorsReader& f, StepRunner& runner, const char* prefix) {
  const ParamLayout& layout = runner.model().layout();
  std::vector<float> params(layout.total, 0.0f);
  for (const TensorSpec& t : layout.tensors) {
    auto v = f.read_f32(prefix + t.name, t.shape);
    std::copy(v.begin(), v.end(), params.begin() + t.offset);
  }
  runner.set_params(params.data());
}

// Ten optimizer steps from the fixture's initial weights: every step's loss within 1e-4
// relative of PyTorch's, and the final weights within 1% of how far training moved them
// (Adam divides by sqrt(v), so a gradient element near zero turns a 1e-5 difference into a
// visible one; the distance moved is the scale that matters).
inline void check_fixture_training(const SafetensorsReader& f, StepRunner& runner, const Config& cfg) {
  const ParamLayout& layout = runner.model().layout();
  load_fixture_params(f, runner, "param.");
  auto train_tokens = f.read_i32("train.tokens");
  auto ref_losses = f.read_f32("train.losses");
  const int accum = cfg.schedule.grad_accum;
  const size_t mb = static_cast<size_t>(cfg.schedule.micro_batch) * (cfg.model.seq_len + 1);
  REQUIRE(train_tokens.size() == ref_losses.size() * accum * mb);
  for (size_t s = 0; s < ref_losses.size(); ++s) {
    std::vector<const int32_t*> ptrs;
    for (int k = 0; k < accum; ++k) ptrs.push_back(train_tokens.data() + (s * accum + k) * mb);
    auto r = runner.step(static_cast<int64_t>(s), ptrs);
    INFO("step " << s << ": loss " << r.loss << " reference " << ref_losses[s]);
    CHECK(std::fabs(r.loss - ref_losses[s]) / std::fabs(ref_losses[s]) < 1e-4);
  }
  for (const TensorSpec& t : layout.tensors) {
    auto ref = f.read_f32("final." + t.name, t.shape);
    auto init = f.read_f32("param." + t.name, t.shape);
    double diff = 0, moved = 0;
    for (size_t i = 0; i < t.numel; ++i) {
      diff = std::max(diff, std::fabs(double(runner.master()[t.offset + i]) - ref[i]));
      moved = std::max(moved, std::fabs(double(ref[i]) - init[i]));
    }
    INFO("final weight " << t.name << ": max diff " << diff << ", max movement " << moved);
    CHECK(diff <= 1e-2 * moved);
  }
}

}  // namespace fuyou::test
