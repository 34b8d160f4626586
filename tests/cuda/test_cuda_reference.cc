// The PyTorch fixtures of tests/test_reference.cc (logits, loss, every gradient, ten AdamW
// steps) through the CUDA backend at fp32 GEMM precision. The bounds are the CPU test's: the
// fixtures were made in fp32 and the CUDA fp32 path differs from PyTorch's CPU run by
// reduction order only, as the CPU backend does.
#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>

#include "../reference_fixture.h"
#include "../test_support.h"
#include "fuyou/cuda.h"
#include "fuyou/error.h"
#include "fuyou/safetensors.h"
#include "fuyou/train.h"

namespace fs = std::filesystem;
using namespace fuyou;

namespace {

// One forward and backward of a fixture's batch from its initial weights on `runner`: the
// logits, the loss, and each gradient's error relative to PyTorch's (per tensor).
struct FixturePass {
  double logits_error = 0, loss_error = 0;
  std::vector<std::pair<std::string, double>> grad_errors;
};

FixturePass fixture_pass(const SafetensorsReader& f, const Config& cfg, Backend& backend,
                         InMemoryStep& runner) {
  Transformer& model = runner.model();
  const ParamLayout& layout = model.layout();
  test::load_fixture_params(f, runner, "param.");
  const int B = cfg.schedule.micro_batch, T = cfg.model.seq_len, V = cfg.model.vocab_size;
  const size_t N = static_cast<size_t>(B) * T;
  auto tokens = f.read_i32("tokens");
  std::vector<int32_t> in(N), tg(N);
  split_batch(tokens.data(), B, T, in.data(), tg.data());
  FixturePass r;
  const float loss = model.forward(in.data(), tg.data());
  std::vector<float> logits(N * V);
  model.copy_logits(logits.data());
  const auto ref_logits = f.read_f32("logits", {B, T, V});
  const float ref_loss = f.read_f32("loss")[0];
  r.logits_error = test::rel_error(logits.data(), ref_logits.data(), N * V);
  r.loss_error = std::fabs(loss - ref_loss) / std::fabs(ref_loss);
  model.zero_grads();
  model.backward(1.0f / static_cast<float>(N));
  std::vector<float> grads(layout.total);
  backend.copy_to_host(grads.data(), model.grads(), sizeof(float) * grads.size());
  for (const TensorSpec& t : layout.tensors) {
    auto ref = f.read_f32("grad." + t.name, t.shape);
    r.grad_errors.push_back(
        {t.name, test::rel_error(grads.data() + t.offset, ref.data(), t.numel)});
  }
  return r;
}

}  // namespace

TEST_CASE("PyTorch fixtures through the CUDA backend", "[cuda][reference]") {
  std::vector<std::string> files = test::reference_fixtures();
  REQUIRE(files.size() >= 2);
  for (const auto& path : files) {
    SafetensorsReader f(path);
    Config cfg = test::reference_fixture_config(f, "cuda");
    INFO("fixture " << path);
    auto backend = make_cuda_backend(0, 0);
    backend->set_matmul_precision(MatmulPrecision::kFp32);
    InMemoryStep runner(cfg, *backend);
    const FixturePass p = fixture_pass(f, cfg, *backend, runner);
    CHECK(p.logits_error < 1e-5);
    CHECK(p.loss_error < 1e-5);
    for (const auto& [name, err] : p.grad_errors) {
      INFO("gradient " << name << " rel error " << err);
      CHECK(err < 1e-4);
    }
    test::check_fixture_training(f, runner, cfg);
  }
}

TEST_CASE("PyTorch fixtures through the CUDA backend with bf16 GEMM inputs", "[cuda][reference]") {
  // The fixtures are fp32; with bf16 inputs to the projection and head GEMMs (tensor cores,
  // fp32 accumulation) each GEMM adds a relative error of about one bf16 rounding, u = 2^-8,
  // and those of the GEMMs on a path through the model add: 3 per layer (q/k/v, attention
  // output, MLP's two count as one path each way) plus the head, with a factor 2 of margin.
  // Training is not compared step by step: ten AdamW steps amplify these differences past any
  // bound worth stating (tests/test_precision.cc bounds one step the same way).
  const double u = std::ldexp(1.0, -8);
  for (const auto& path : test::reference_fixtures()) {
    SafetensorsReader f(path);
    Config cfg = test::reference_fixture_config(f, "cuda");
    INFO("fixture " << path);
    auto backend = make_cuda_backend(0, 0);
    backend->set_matmul_precision(MatmulPrecision::kBf16);
    InMemoryStep runner(cfg, *backend);
    const double bound = 2 * (3 * cfg.model.n_layer + 1) * u;
    const FixturePass p = fixture_pass(f, cfg, *backend, runner);
    INFO("logits rel error " << p.logits_error << ", bound " << bound);
    CHECK(p.logits_error < bound);
    CHECK(p.logits_error > 0);  // the bf16 path ran
    CHECK(p.loss_error < bound);
    double worst = 0;
    for (const auto& [name, err] : p.grad_errors) worst = std::max(worst, err);
    INFO("worst gradient rel error " << worst);
    CHECK(worst < 2 * bound);  // the backward runs each GEMM path twice (dX and dW)
  }
}

TEST_CASE("PyTorch's bf16 recipe through the CUDA backend with bf16 tensors", "[cuda][reference]") {
  // The check and bounds of the CPU backend's test (tests/test_bf16_tensors.cc): bf16
  // weights, activations and gradients on the device, fp32 master weights and AdamW.
  for (const char* name : {"tiny_a", "tiny_b"}) {
    SafetensorsReader f(
        test::source_path(str("tests/reference/fixtures/bf16/", name, ".safetensors")));
    INFO("fixture " << name);
    test::check_bf16_recipe(f, "cuda", [] { return make_cuda_backend(0, 256ull << 20); });
  }
}
