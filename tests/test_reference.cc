// The CPU backend against PyTorch: fixtures written by tests/reference/make_fixtures.py hold
// initial weights, a batch, its logits, loss and every gradient, and the losses (and final
// weights) of 10 AdamW steps with warmup + cosine, gradient accumulation and clipping.
#include <catch2/catch.hpp>
#include <filesystem>

#include "fuyou/error.h"
#include "fuyou/safetensors.h"
#include "fuyou/train.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;

namespace {

Config fixture_config(const SafetensorsReader& f) {
  auto md = [&](const char* k) { return f.metadata().at(k); };
  std::string yaml = str(
      "model: {n_layer: ", md("n_layer"), ", n_head: ", md("n_head"), ", d_model: ", md("d_model"),
      ", d_ff: ", md("d_ff"), ", vocab_size: ", md("vocab_size"), ", seq_len: ", md("seq_len"), "}\n",
      "optimizer: {lr: ", md("lr"), ", min_lr: ", md("min_lr"), ", beta1: ", md("beta1"),
      ", beta2: ", md("beta2"), ", eps: ", md("eps"), ", weight_decay: ", md("weight_decay"),
      ", grad_clip: ", md("clip"), "}\n",
      "schedule: {steps: ", md("steps"), ", warmup_steps: ", md("warmup"), ", micro_batch: ",
      md("batch"), ", grad_accum: ", md("grad_accum"), "}\n",
      "runtime: {backend: cpu, threads: 2}\n");
  return parse_config(yaml, f.path());
}

std::vector<std::string> fixtures() {
  std::vector<std::string> out;
  for (auto& e : fs::directory_iterator(test::source_path("tests/reference/fixtures")))
    if (e.path().extension() == ".safetensors") out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

void load_fixture_params(const SafetensorsReader& f, StepRunner& runner, const char* prefix) {
  const ParamLayout& layout = runner.model().layout();
  std::vector<float> params(layout.total, 0.0f);
  for (const TensorSpec& t : layout.tensors) {
    auto v = f.read_f32(prefix + t.name, t.shape);
    std::copy(v.begin(), v.end(), params.begin() + t.offset);
  }
  runner.set_params(params.data());
}

}  // namespace

TEST_CASE("PyTorch fixtures: logits, loss, gradients and a 10-step AdamW run", "[reference]") {
  auto files = fixtures();
  REQUIRE(files.size() >= 2);
  for (const auto& path : files) {
    SafetensorsReader f(path);
    Config cfg = fixture_config(f);
    INFO("fixture " << path);
    auto backend = make_cpu_backend(cfg.runtime.threads, 0);
    StepRunner runner(cfg, *backend);
    GptModel& model = runner.model();
    const ParamLayout& layout = model.layout();
    load_fixture_params(f, runner, "param.");
    const int B = cfg.schedule.micro_batch, T = cfg.model.seq_len, V = cfg.model.vocab_size;
    const size_t N = static_cast<size_t>(B) * T;

    // Forward and backward on one batch.
    auto tokens = f.read_i32("tokens");
    REQUIRE(tokens.size() == static_cast<size_t>(B) * (T + 1));
    std::vector<int32_t> in(N), tg(N);
    split_batch(tokens.data(), B, T, in.data(), tg.data());
    float loss = model.forward(in.data(), tg.data());
    auto ref_logits = f.read_f32("logits", {B, T, V});
    float ref_loss = f.read_f32("loss")[0];
    // The bounds: logits and loss within 1e-5 relative.
    CHECK(test::rel_error(model.logits(), ref_logits.data(), N * V) < 1e-5);
    CHECK(std::fabs(loss - ref_loss) / std::fabs(ref_loss) < 1e-5);

    model.zero_grads();
    model.backward(1.0f / static_cast<float>(N));
    for (const TensorSpec& t : layout.tensors) {
      auto ref = f.read_f32("grad." + t.name, t.shape);
      double err = test::rel_error(model.grads() + t.offset, ref.data(), t.numel);
      INFO("gradient " << t.name << " rel error " << err);
      CHECK(err < 1e-4);
    }

    // Ten optimizer steps from the initial weights.
    load_fixture_params(f, runner, "param.");
    auto train_tokens = f.read_i32("train.tokens");
    auto ref_losses = f.read_f32("train.losses");
    const int accum = cfg.schedule.grad_accum;
    const size_t mb = static_cast<size_t>(B) * (T + 1);
    REQUIRE(train_tokens.size() == ref_losses.size() * accum * mb);
    for (size_t s = 0; s < ref_losses.size(); ++s) {
      std::vector<const int32_t*> ptrs;
      for (int k = 0; k < accum; ++k) ptrs.push_back(train_tokens.data() + (s * accum + k) * mb);
      auto r = runner.step(static_cast<int64_t>(s), ptrs);
      INFO("step " << s << ": loss " << r.loss << " reference " << ref_losses[s]);
      CHECK(std::fabs(r.loss - ref_losses[s]) / std::fabs(ref_losses[s]) < 1e-4);
    }
    // Final weights: Adam divides by sqrt(v), so a gradient element near zero turns a 1e-5
    // difference into a visible one; the weights are compared relative to how far training
    // moved them, and must agree to 1% of that distance.
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
}
