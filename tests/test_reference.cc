// The CPU backend against PyTorch: fixtures written by tests/reference/make_fixtures.py hold
// initial weights, a batch, its logits, loss and every gradient, and the losses (and final
// weights) of 10 AdamW steps with warmup + cosine, gradient accumulation and clipping.
#include <catch2/catch.hpp>
#include <filesystem>

#include "fuyou/error.h"
#include "fuyou/safetensors.h"
#include "fuyou/train.h"
#include "reference_fixture.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;

TEST_CASE("PyTorch fixtures: logits, loss, gradients and a 10-step AdamW run", "[reference]") {
  auto files = test::reference_fixtures();
  REQUIRE(files.size() >= 2);
  for (const auto& path : files) {
    SafetensorsReader f(path);
    Config cfg = test::reference_fixture_config(f, "cpu");
    INFO("fixture " << path);
    auto backend = make_cpu_backend(cfg.runtime.threads, 0);
    InMemoryStep runner(cfg, *backend);
    Transformer& model = runner.model();
    const ParamLayout& layout = model.layout();
    test::load_fixture_params(f, runner, "param.");
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
    std::vector<float> got(N * V);
    model.copy_logits(got.data());
    CHECK(test::rel_error(got.data(), ref_logits.data(), N * V) < 1e-5);
    CHECK(std::fabs(loss - ref_loss) / std::fabs(ref_loss) < 1e-5);

    model.zero_grads();
    model.backward(1.0f / static_cast<float>(N));
    for (const TensorSpec& t : layout.tensors) {
      auto ref = f.read_f32("grad." + t.name, t.shape);
      double err = test::rel_error(test::f32(model.grads()) + t.offset, ref.data(), t.numel);
      INFO("gradient " << t.name << " rel error " << err);
      CHECK(err < 1e-4);
    }

    // Ten optimizer steps from the initial weights.
    test::check_fixture_training(f, runner, cfg);
  }
}
