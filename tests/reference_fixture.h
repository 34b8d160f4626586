// The PyTorch fixtures of tests/reference/fixtures (make_fixtures.py), shared by the CPU
// reference test and the CUDA backend's: their configs, initial weights, the check of a
// 10-step AdamW run against PyTorch's losses and final weights, and the check against
// PyTorch's bf16 recipe (fixtures/bf16, make_bf16_fixture.py).
#pragma once

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "fuyou/backend_select.h"
#include "fuyou/error.h"
#include "fuyou/model.h"
#include "fuyou/safetensors.h"
#include "fuyou/train.h"
#include "storage_values.h"
#include "test_support.h"

namespace fuyou::test {

// The fixture's model, optimizer and schedule, on `backend` with fp32 GEMMs.
inline Config reference_fixture_config(const SafetensorsReader& f, const std::string& backend) {
  auto md = [&](const char* k) { return f.metadata().at(k); };
  std::string yaml =
      str("model: {n_layer: ", md("n_layer"), ", n_head: ", md("n_head"),
          ", d_model: ", md("d_model"), ", d_ff: ", md("d_ff"), ", vocab_size: ", md("vocab_size"),
          ", seq_len: ", md("seq_len"), "}\n", "optimizer: {lr: ", md("lr"),
          ", min_lr: ", md("min_lr"), ", beta1: ", md("beta1"), ", beta2: ", md("beta2"),
          ", eps: ", md("eps"), ", weight_decay: ", md("weight_decay"), ", grad_clip: ", md("clip"),
          "}\n", "schedule: {steps: ", md("steps"), ", warmup_steps: ", md("warmup"),
          ", micro_batch: ", md("batch"), ", grad_accum: ", md("grad_accum"), "}\n",
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
inline void load_fixture_params(const SafetensorsReader& f, InMemoryStep& runner,
                                const char* prefix) {
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
inline void check_fixture_training(const SafetensorsReader& f, InMemoryStep& runner,
                                   const Config& cfg) {
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

// bf16's unit roundoff: 8 significant bits, so one rounding to nearest errs by at most 2^-8
// relative (half a unit in the last place of a value in [1, 2)).
inline const double kBf16U = unit_roundoff(ElemType::kBF16);

// Against PyTorch's bf16 recipe (tests/reference/make_bf16_fixture.py: bf16 parameters and
// activations, fp32 accumulation, fp32 loss, fp32 master weights and AdamW, from the fp32
// fixtures' weights and tokens): both computations round every stored intermediate once; the
// engine's longest path stores about 12 values forward and as many backward (24u, the bound
// of the 16-bit model against fp32), PyTorch's rounds a few more (its attention scores,
// scaled and masked, before the softmax): their difference is within the sum of both bounds.
inline const double kBf16Bound = 48;

// One forward and backward of the bf16 fixture `f` on a backend of `backend_name` with bf16
// device tensors (made by make_backend): logits and every gradient within kBf16Bound u of
// PyTorch's, the loss within what the logits' difference allows; then ten training steps
// whose losses stay within the bound those imply.
template <class MakeBackend>
void check_bf16_recipe(const SafetensorsReader& f, const std::string& backend_name,
                       MakeBackend make_backend) {
  Config cfg = reference_fixture_config(f, backend_name);
  cfg.runtime.device_tensors = "bf16";
  auto be = make_backend();
  apply_precision(*be, cfg.runtime);
  REQUIRE(be->storage_type() == ElemType::kBF16);
  InMemoryStep runner(cfg, *be);
  Transformer& model = runner.model();
  const ParamLayout& layout = model.layout();
  load_fixture_params(f, runner, "param.");
  const int B = cfg.schedule.micro_batch, T = cfg.model.seq_len, V = cfg.model.vocab_size;
  const size_t N = static_cast<size_t>(B) * T;
  auto tokens = f.read_i32("tokens");
  std::vector<int32_t> in(N), tg(N);
  split_batch(tokens.data(), B, T, in.data(), tg.data());
  const float loss = model.forward(in.data(), tg.data());
  std::vector<uint16_t> h(std::max(N * V, layout.total));
  std::vector<float> logits(N * V), grads(layout.total);
  model.copy_logits(h.data());
  widen_from(ElemType::kBF16, logits.data(), h.data(), N * V);
  model.zero_grads();
  model.backward(1.0f / static_cast<float>(N));
  be->copy_to_host(h.data(), model.grads(), 2 * layout.total);
  widen_from(ElemType::kBF16, grads.data(), h.data(), layout.total);
  const float ref_loss = f.read_f32("loss")[0];
  const std::vector<float> ref_logits = f.read_f32("logits", {B, T, V});
  const double e_logits = rel_error(logits.data(), ref_logits.data(), N * V);
  double logit_diff = 0;
  for (size_t i = 0; i < N * V; ++i)
    logit_diff = std::max(logit_diff, std::fabs(double(logits[i]) - ref_logits[i]));
  INFO("logits rel error " << e_logits / kBf16U << "u, loss " << loss << " vs " << ref_loss);
  CHECK(e_logits <= kBf16Bound * kBf16U);
  // Each token's loss, logsumexp(z) - z_target, moves by at most 2 max|dz| when the logits
  // move by dz (its gradient has L1 norm 2), and so does their mean; plus fp32 rounding.
  CHECK(std::fabs(loss - ref_loss) <= 2 * logit_diff + 1e-6 * ref_loss);
  for (const TensorSpec& t : layout.tensors) {
    const double err =
        rel_error(grads.data() + t.offset, f.read_f32("grad." + t.name, t.shape).data(), t.numel);
    INFO("gradient " << t.name << " rel error " << err / kBf16U << "u");
    CHECK(err <= kBf16Bound * kBf16U);
  }
  // Ten steps from the same weights. Each step's loss moves by at most 2 max|dz| for a
  // logits error dz (above); the logits error stays within the bound on the logits, and
  // the logits within twice their starting size (the weights move by 0.02 at most).
  double logit_max = 0;
  for (float z : ref_logits) logit_max = std::max(logit_max, std::fabs(double(z)));
  const double step_bound = 2 * kBf16Bound * kBf16U * 2 * logit_max;
  auto train_tokens = f.read_i32("train.tokens");
  auto ref_losses = f.read_f32("train.losses");
  const int accum = cfg.schedule.grad_accum;
  const size_t mb = N + B;
  for (size_t s = 0; s < ref_losses.size(); ++s) {
    std::vector<const int32_t*> ptrs;
    for (int k = 0; k < accum; ++k) ptrs.push_back(train_tokens.data() + (s * accum + k) * mb);
    const StepResult r = runner.step(static_cast<int64_t>(s), ptrs);
    INFO("step " << s << ": loss " << r.loss << ", PyTorch " << ref_losses[s]);
    CHECK(std::fabs(r.loss - ref_losses[s]) <= step_bound);
  }
  // The final weights are not compared: the key bias's gradient is zero in exact arithmetic
  // (the softmax ignores a constant per query), so both runs' values for it are rounding
  // noise that Adam scales up to whole learning-rate steps (measured: up to 1.5x how far
  // the weights moved), while the losses agree to 1e-4.
}

}  // namespace fuyou::test
