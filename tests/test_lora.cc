// LoRA over a frozen base (docs/lora.md): the adapters' gradients against finite differences
// of the loss, the frozen base's forward against the full model's, and the packed linears'
// off-block gradient cleared. The arithmetic against PEFT: tests/reference/check_lora_peft.py.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cfloat>
#include <cmath>
#include <vector>

#include "fd_check.h"
#include "fuyou/backend.h"
#include "fuyou/config.h"
#include "fuyou/error.h"
#include "fuyou/lora.h"
#include "fuyou/model.h"
#include "fuyou/rng.h"

using namespace fuyou;

namespace {

struct Case {
  const char* model;
  std::vector<std::string> targets;
};

const Case kCases[] = {
    {"family: llama, n_layer: 2, n_head: 4, n_kv_head: 2, d_model: 16, d_ff: 24, vocab_size: 64, "
     "seq_len: 8",
     {"all-linear"}},
    {"family: llama, n_layer: 2, n_head: 4, n_kv_head: 2, d_model: 16, d_ff: 24, vocab_size: 64, "
     "seq_len: 8",
     {"k_proj", "up_proj"}},
    {"family: gpt2, n_layer: 2, n_head: 2, d_model: 16, vocab_size: 64, seq_len: 8",
     {"c_attn", "c_proj"}},
};

LoraConfig lora_config(const std::vector<std::string>& targets) {
  LoraConfig l;
  l.rank = 2;
  l.alpha = 3;
  l.targets = targets;
  return l;
}

}  // namespace

TEST_CASE("LoRA adapter gradients match finite differences of the loss", "[lora]") {
  for (const Case& c : kCases) {
    INFO(c.model);
    const ModelConfig m = parse_config(str("model: {", c.model, "}"), "x.yaml").model;
    const LoraLayout lora = make_lora_layout(m, lora_config(c.targets));
    auto be = make_cpu_backend(2, 0);
    const int B = 2, T = m.seq_len, N = B * T;
    Transformer model(m, *be, B, ModelState::kFrozenBase);
    std::vector<float> base(model.layout().total);
    init_gpt_params(m, model.layout(), base.data());
    Rng rng(5);
    for (const TensorSpec& t : model.layout().tensors)
      for (size_t i = 0; i < t.numel; ++i) base[t.offset + i] += 0.2f * rng.normal();
    be->copy_to_device(model.params(), base.data(), 4 * base.size());
    // Adapters of both kinds nonzero (PEFT's B starts at zero, which leaves A's gradient zero).
    std::vector<float> x(lora.params.total, 0.0f);
    init_lora_params(lora, 9, x.data());  // A as PEFT initialises it
    const std::vector<PeftTensor> names = peft_tensors(lora);
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i].name.find("lora_B") == std::string::npos) continue;
      std::vector<float> b =
          test::randn(static_cast<size_t>(names[i].rows) * names[i].cols, 11 + i, 0.3f);
      set_peft_tensor(lora, i, x.data(), b.data());
    }
    void* dp = be->alloc(4 * x.size(), "adapters");
    void* dg = be->alloc(4 * x.size(), "adapter gradients");
    be->copy_to_device(dp, x.data(), 4 * x.size());
    model.attach_lora(lora, dp, dg);
    std::vector<int32_t> in(N), tg(N);
    for (int i = 0; i < N; ++i)
      in[i] = static_cast<int32_t>(rng.below(64)), tg[i] = static_cast<int32_t>(rng.below(64));
    model.zero_grads();
    model.forward_backward(in.data(), tg.data(), nullptr, 1.0f / N);
    std::vector<float> g(x.size());
    be->copy_to_host(g.data(), dg, 4 * g.size());
    // The off-block elements of every B (and padding) got no gradient: they stay zero.
    for (const LoraAdapter& a : lora.adapters) {
      const TensorSpec& bt = lora.params.tensors[a.b_tensor];
      std::vector<bool> in_block(bt.numel, false);
      for (const LoraPart& p : a.parts)
        for (int o = p.row0; o < p.row0 + p.rows; ++o)
          for (int j = 0; j < lora.rank; ++j)
            in_block[static_cast<size_t>(o) * a.width + p.slot * lora.rank + j] = true;
      size_t nonzero = 0;
      for (size_t e = 0; e < bt.numel; ++e)
        if (!in_block[e] && g[bt.offset + e] != 0) ++nonzero;
      INFO(bt.name);
      CHECK(nonzero == 0);
    }
    // Per PEFT tensor (the parameters; a packed B's off-block zeros are not), the derivative
    // along the unit direction of its analytic gradient, which equals |g| only if the gradient
    // is right (as the families' test): central differences at h and h/2 combined by Richardson
    // extrapolation (4 D(h/2) - D(h)) / 3 cancel the h^2 term; what remains is the rounding of
    // the loss differences, at most ~eps |L| / (h/2) for each of the four evaluations, times 5/3
    // from the combination. The allowance is that (relative to |g|) or kFdTolerance if larger.
    const double h = 2e-2;
    be->copy_to_device(dp, x.data(), 4 * x.size());
    const double L0 = model.forward(in.data(), tg.data());
    for (size_t i = 0; i < names.size(); ++i) {
      INFO(names[i].name);
      const size_t n = static_cast<size_t>(names[i].rows) * names[i].cols;
      std::vector<float> xt(n), gt(n);
      get_peft_tensor(lora, i, x.data(), xt.data());
      get_peft_tensor(lora, i, g.data(), gt.data());
      double norm = 0;
      for (float v : gt) norm += static_cast<double>(v) * v;
      norm = std::sqrt(norm);
      REQUIRE(norm > 0);
      auto loss_at = [&](double step) {
        std::vector<float> q(n), y = x;
        for (size_t e = 0; e < n; ++e) q[e] = xt[e] + static_cast<float>(step * gt[e] / norm);
        set_peft_tensor(lora, i, y.data(), q.data());
        be->copy_to_device(dp, y.data(), 4 * y.size());
        return static_cast<double>(model.forward(in.data(), tg.data()));
      };
      const double d1 = (loss_at(h) - loss_at(-h)) / (2 * h);
      const double d2 = (loss_at(h / 2) - loss_at(-h / 2)) / h;
      const double fd = (4 * d2 - d1) / 3;
      const double tol =
          std::max(test::kFdTolerance, 4 * FLT_EPSILON * std::fabs(L0) / (h / 2) * 5 / 3 / norm);
      INFO("|g| " << norm << ", finite difference " << fd);
      CHECK(std::fabs(fd - norm) / norm < tol);
    }
    be->free(dp);
    be->free(dg);
  }
}

TEST_CASE("a frozen base with zero B computes the full model's loss bit for bit", "[lora]") {
  for (const Case& c : kCases) {
    INFO(c.model);
    const ModelConfig m = parse_config(str("model: {", c.model, "}"), "x.yaml").model;
    const LoraLayout lora = make_lora_layout(m, lora_config(c.targets));
    auto be = make_cpu_backend(2, 0);
    const int B = 2, N = B * m.seq_len;
    Transformer full(m, *be, B), frozen(m, *be, B, ModelState::kFrozenBase);
    std::vector<float> base(full.layout().total);
    init_gpt_params(m, full.layout(), base.data());
    be->copy_to_device(full.params(), base.data(), 4 * base.size());
    be->copy_to_device(frozen.params(), base.data(), 4 * base.size());
    std::vector<float> x(lora.params.total);
    init_lora_params(lora, 1, x.data());  // B zero: the adapted model is the base
    void* dp = be->alloc(4 * x.size(), "adapters");
    void* dg = be->alloc(4 * x.size(), "adapter gradients");
    be->copy_to_device(dp, x.data(), 4 * x.size());
    frozen.attach_lora(lora, dp, dg);
    Rng rng(2);
    std::vector<int32_t> in(N), tg(N);
    for (int i = 0; i < N; ++i)
      in[i] = static_cast<int32_t>(rng.below(64)), tg[i] = static_cast<int32_t>(rng.below(64));
    full.zero_grads();
    frozen.zero_grads();
    const float a = full.forward_backward(in.data(), tg.data(), nullptr, 1.0f / N);
    const float b = frozen.forward_backward(in.data(), tg.data(), nullptr, 1.0f / N);
    CHECK(a == b);
    CHECK(frozen.grads() == nullptr);  // no gradient for the base at all
    be->free(dp);
    be->free(dg);
  }
}
