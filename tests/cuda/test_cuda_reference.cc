// The PyTorch fixtures of tests/test_reference.cc (logits, loss, every gradient, ten AdamW
// steps) through the CUDA backend at fp32 GEMM precision. The bounds are the CPU test's: the
// fixtures were made in fp32 and the CUDA fp32 path differs from PyTorch's CPU run by
// reduction order only, as the CPU backend does.
#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>

#include "../test_support.h"
#include "fuyou/cuda.h"
#include "fuyou/error.h"
#include "fuyou/safetensors.h"
#include "fuyou/train.h"

namespace fs = std::filesystem;
using namespace fuyou;

namespace {

Config fixture_config(const SafetensorsReader& f) {
  auto md = [&](const char* k) { return f.metadata().at(k); };
  std::string yaml =
      str("model: {n_layer: ", md("n_layer"), ", n_head: ", md("n_head"),
          ", d_model: ", md("d_model"), ", d_ff: ", md("d_ff"), ", vocab_size: ", md("vocab_size"),
          ", seq_len: ", md("seq_len"), "}\n", "optimizer: {lr: ", md("lr"),
          ", min_lr: ", md("min_lr"), ", beta1: ", md("beta1"), ", beta2: ", md("beta2"),
          ", eps: ", md("eps"), ", weight_decay: ", md("weight_decay"), ", grad_clip: ", md("clip"),
          "}\n", "schedule: {steps: ", md("steps"), ", warmup_steps: ", md("warmup"),
          ", micro_batch: ", md("batch"), ", grad_accum: ", md("grad_accum"), "}\n",
          "runtime: {backend: cuda, precision: fp32, threads: 2}\n");
  return parse_config(yaml, f.path());
}

void load_fixture_params(const SafetensorsReader& f, StepRunner& runner) {
  const ParamLayout& layout = runner.model().layout();
  std::vector<float> params(layout.total, 0.0f);
  for (const TensorSpec& t : layout.tensors) {
    auto v = f.read_f32("param." + t.name, t.shape);
    std::copy(v.begin(), v.end(), params.begin() + t.offset);
  }
  runner.set_params(params.data());
}

}  // namespace

TEST_CASE("PyTorch fixtures through the CUDA backend", "[cuda][reference]") {
  std::vector<std::string> files;
  for (auto& e : fs::directory_iterator(test::source_path("tests/reference/fixtures")))
    if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  REQUIRE(files.size() >= 2);
  for (const auto& path : files) {
    SafetensorsReader f(path);
    Config cfg = fixture_config(f);
    INFO("fixture " << path);
    auto backend = make_cuda_backend(0, 0);
    backend->set_matmul_precision(MatmulPrecision::kFp32);
    StepRunner runner(cfg, *backend);
    GptModel& model = runner.model();
    const ParamLayout& layout = model.layout();
    load_fixture_params(f, runner);
    const int B = cfg.schedule.micro_batch, T = cfg.model.seq_len, V = cfg.model.vocab_size;
    const size_t N = static_cast<size_t>(B) * T;

    auto tokens = f.read_i32("tokens");
    std::vector<int32_t> in(N), tg(N);
    split_batch(tokens.data(), B, T, in.data(), tg.data());
    float loss = model.forward(in.data(), tg.data());
    std::vector<float> logits(N * V);
    backend->copy_to_host(logits.data(), model.logits(), sizeof(float) * logits.size());
    auto ref_logits = f.read_f32("logits", {B, T, V});
    float ref_loss = f.read_f32("loss")[0];
    CHECK(test::rel_error(logits.data(), ref_logits.data(), N * V) < 1e-5);
    CHECK(std::fabs(loss - ref_loss) / std::fabs(ref_loss) < 1e-5);

    model.zero_grads();
    model.backward(1.0f / static_cast<float>(N));
    std::vector<float> grads(layout.total);
    backend->copy_to_host(grads.data(), model.grads(), sizeof(float) * grads.size());
    for (const TensorSpec& t : layout.tensors) {
      auto ref = f.read_f32("grad." + t.name, t.shape);
      double err = test::rel_error(grads.data() + t.offset, ref.data(), t.numel);
      INFO("gradient " << t.name << " rel error " << err);
      CHECK(err < 1e-4);
    }

    load_fixture_params(f, runner);
    auto train_tokens = f.read_i32("train.tokens");
    auto ref_losses = f.read_f32("train.losses");
    const int accum = cfg.schedule.grad_accum;
    const size_t mb = static_cast<size_t>(B) * (T + 1);
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
}
