// The opt and llama families: their new kernels against finite differences, whole-model
// gradients against finite differences, converted Hugging Face checkpoints against
// transformers' logits (fixtures from tests/reference/make_hf_fixtures.py), bit-identical
// round trips, clear refusals, the offloading scheduler bitwise equal to in-memory training,
// and fine-tuning from a converted checkpoint through fuyou-train's config.
//
// Finite-difference tolerance, as in test_kernels.cc: a central difference in fp32 has
// truncation error ~h^2 |f'''| and rounding error ~eps |L| / h, smallest (~eps^(2/3) of the
// scale) near h = eps^(1/3); we allow 20 times that relative to the largest gradient element.
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "fd_check.h"
#include "fuyou/backend.h"
#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/hf_checkpoint.h"
#include "fuyou/model.h"
#include "fuyou/rng.h"
#include "fuyou/safetensors.h"
#include "fuyou/scheduler.h"
#include "fuyou/train.h"
#include "hf_support.h"
#include "kernels/common/element_math.h"
#include "src/formats/safetensors_stream.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;
using namespace fuyou::test;
using Catch::Matchers::Contains;

namespace {

std::string fixture(const std::string& rel) { return hf_fixture(rel); }

const char* kFamilyFixtures[] = {"opt_f32", "llama_gqa_f32", "llama_bf16_sharded", "qwen2_gqa_f32"};

}  // namespace

// ---- kernels ---------------------------------------------------------------------------

TEST_CASE("rmsnorm backward matches finite differences", "[families]") {
  auto be = make_cpu_backend(2, 0);
  const int N = 5, C = 24;
  auto x = randn(N * C, 1), w = randn(C, 2), R = randn(N * C, 4);
  std::vector<float> out(N * C), rstd(N);
  auto loss = [&] {
    be->rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), 1e-5f, N, C);
    return dot(out, R);
  };
  loss();
  // The forward against the formula, in double: rounding of a C-term mean, ~C eps relative.
  for (int n = 0; n < N; ++n) {
    double ss = 0;
    for (int c = 0; c < C; ++c) ss += double(x[n * C + c]) * x[n * C + c];
    double r = 1.0 / std::sqrt(ss / C + 1e-5);
    for (int c = 0; c < C; ++c)
      CHECK(out[n * C + c] ==
            Approx(x[n * C + c] * r * w[c]).epsilon(C * FLT_EPSILON).margin(1e-6));
  }
  std::vector<float> dx(N * C, 0.0f), dw(C, 0.0f);
  be->rmsnorm_backward(dx.data(), dw.data(), R.data(), x.data(), w.data(), rstd.data(), N, C);
  check_grad("rmsnorm dx", x, dx, loss);
  check_grad("rmsnorm dw", w, dw, loss);
}

TEST_CASE("rope backward matches finite differences and preserves norms", "[families]") {
  auto be = make_cpu_backend(2, 0);
  const int B = 2, T = 5, Hq = 4, Hkv = 2, D = 6;
  const int W = (Hq + 2 * Hkv) * D;
  auto x = randn(B * T * W, 3), R = randn(B * T * W, 4);
  std::vector<float> y;
  auto loss = [&] {
    y = x;
    be->rope_forward(y.data(), B, T, Hq, Hkv, D, default_rope_table(D, 10000.0f), nullptr);
    return dot(y, R);
  };
  loss();
  for (int n = 0; n < B * T; ++n) {
    // Position 0 is the identity; v is never touched; each head keeps its norm (a rotation).
    for (int i = 0; i < W; ++i) {
      bool is_v = i >= (Hq + Hkv) * D;
      if (n % T == 0 || is_v) CHECK(y[n * W + i] == x[n * W + i]);
    }
    for (int h = 0; h < Hq + Hkv; ++h) {
      double a = 0, b = 0;
      for (int i = 0; i < D; ++i) {
        a += double(x[n * W + h * D + i]) * x[n * W + h * D + i];
        b += double(y[n * W + h * D + i]) * y[n * W + h * D + i];
      }
      CHECK(b == Approx(a).epsilon(8 * FLT_EPSILON));
    }
  }
  std::vector<float> dx = R;
  be->rope_backward(dx.data(), B, T, Hq, Hkv, D, default_rope_table(D, 10000.0f), nullptr);
  check_grad("rope dx", x, dx, loss);
}

TEST_CASE("repeated k/v heads: backward sums the copies", "[families]") {
  auto be = make_cpu_backend(2, 0);
  const int N = 6, Hq = 6, Hkv = 2, D = 4, C = Hq * D;
  auto x = randn(N * (C + 2 * Hkv * D), 5), R = randn(N * 3 * C, 6);
  std::vector<float> y(N * 3 * C);
  auto loss = [&] {
    be->repeat_kv_forward(y.data(), x.data(), N, Hq, Hkv, D);
    return dot(y, R);
  };
  loss();
  // Query head h reads k/v head h / (Hq / Hkv), as transformers' repeat_kv.
  CHECK(y[3 * (3 * C) + 2 * C + 5 * D + 1] == x[3 * (C + 2 * Hkv * D) + C + Hkv * D + 1 * D + 1]);
  std::vector<float> dx(x.size());
  be->repeat_kv_backward(dx.data(), R.data(), N, Hq, Hkv, D);
  check_grad("repeat_kv dx", x, dx, loss);
}

TEST_CASE("swiglu and relu backward match finite differences", "[families]") {
  auto be = make_cpu_backend(2, 0);
  const int N = 4, F = 10;
  auto gu = randn(N * 2 * F, 7), R = randn(N * F, 8);
  std::vector<float> out(N * F);
  auto loss = [&] {
    be->swiglu_forward(out.data(), gu.data(), N, F);
    return dot(out, R);
  };
  loss();
  for (int f = 0; f < F; ++f) {
    double g = gu[f], u = gu[F + f];
    // exp_fast is ~2 ulp; the product and quotient add a few more.
    CHECK(out[f] == Approx(g / (1 + std::exp(-g)) * u).epsilon(16 * FLT_EPSILON).margin(1e-7));
  }
  std::vector<float> dgu(gu.size());
  be->swiglu_backward(dgu.data(), gu.data(), R.data(), N, F);
  check_grad("swiglu dgu", gu, dgu, loss);

  // ReLU: inputs kept at least 0.1 from the kink so the differences never straddle it.
  auto x = randn(N * F, 9);
  for (auto& v : x) v = v < 0 ? v - 0.1f : v + 0.1f;
  std::vector<float> y(x.size());
  auto rloss = [&] {
    be->relu_forward(y.data(), x.data(), x.size());
    return dot(y, R);
  };
  rloss();
  std::vector<float> dx(x.size());
  be->relu_backward(dx.data(), x.data(), R.data(), x.size());
  check_grad("relu dx", x, dx, rloss);
}

TEST_CASE("element math of the new families", "[families]") {
  for (float x : {-30.0f, -3.0f, -0.5f, 0.0f, 0.7f, 4.0f, 30.0f}) {
    double s = 1 / (1 + std::exp(-double(x)));
    CHECK(math::silu(x) == Approx(x * s).epsilon(8 * FLT_EPSILON).margin(1e-30));
    CHECK(math::silu_grad(x) ==
          Approx(s * (1 + x * (1 - s))).epsilon(8 * FLT_EPSILON).margin(1e-7));
  }
  CHECK(math::relu(-1.0f) == 0.0f);
  CHECK(math::relu_grad(0.0f) == 0.0f);
  // theta^(-2i/D) computed in fp32: a few ulp of the double value.
  for (int i : {0, 1, 7}) {
    double want = 5 * std::pow(10000.0, -2.0 * i / 16);
    CHECK(math::rope_angle(5, math::rope_default_inv_freq(i, 16, 10000.0f)) ==
          Approx(want).epsilon(8 * FLT_EPSILON));
  }
}

namespace {

// The rotary variants' inverse frequencies as transformers defines them
// (modeling_rope_utils), written here in double from their formulas.
std::vector<double> reference_inv_freq(const ModelConfig& m) {
  const int D = m.head_size(), half = D / 2;
  std::vector<double> f(half);
  for (int i = 0; i < half; ++i) f[i] = 1 / std::pow(double(m.rope_theta), 2.0 * i / D);
  if (m.rope_type == "linear")
    for (double& x : f) x /= m.rope_factor;
  if (m.rope_type == "llama3") {
    const double ctx = m.rope_original_context, lo = ctx / m.rope_low_freq_factor,
                 hi = ctx / m.rope_high_freq_factor;
    for (double& x : f) {
      const double wavelen = 2 * M_PI / x;
      if (wavelen > lo) {
        x /= m.rope_factor;
      } else if (wavelen >= hi) {
        const double s = (ctx / wavelen - m.rope_low_freq_factor) /
                         (m.rope_high_freq_factor - m.rope_low_freq_factor);
        x = (1 - s) * x / m.rope_factor + s * x;
      }
    }
  }
  if (m.rope_type == "yarn") {
    auto dim_at = [&](double rot) {
      return D * std::log(m.rope_original_context / (rot * 2 * M_PI)) /
             (2 * std::log(double(m.rope_theta)));
    };
    double lo = std::max(0.0, std::floor(dim_at(m.rope_beta_fast)));
    double hi = std::min(double(D - 1), std::ceil(dim_at(m.rope_beta_slow)));
    for (int i = 0; i < half; ++i) {
      const double ramp = std::clamp((i - lo) / (hi - lo), 0.0, 1.0);
      f[i] = f[i] / m.rope_factor * ramp + f[i] * (1 - ramp);
    }
  }
  return f;
}

}  // namespace

TEST_CASE("rotary variants: the frequencies transformers computes", "[families][rope]") {
  ModelConfig m;
  m.family = "llama";
  m.n_head = 2;
  m.d_model = 64;  // head size 32: 16 pairs spanning high, middle and low frequencies
  m.rope_theta = 500000.0f;
  struct Variant {
    const char* type;
    float factor;
    int context;
  };
  for (const Variant& v :
       {Variant{"default", 1, 0}, Variant{"linear", 4, 0}, Variant{"dynamic", 2, 64},
        Variant{"llama3", 8, 64}, Variant{"yarn", 4, 64}}) {
    m.rope_type = v.type;
    m.rope_factor = v.factor;
    m.rope_original_context = v.context;
    const RopeTable t = rope_table(m);
    const std::vector<double> want = reference_inv_freq(m);
    INFO("rope_type " << v.type);
    REQUIRE(t.pairs == 16);
    // fp32 arithmetic of a few operations on values the double formula gives exactly.
    for (int i = 0; i < t.pairs; ++i)
      CHECK(t.inv_freq[i] == Approx(want[i]).epsilon(16 * FLT_EPSILON));
    // yarn's attention factor, 0.1 ln(factor) + 1; 1 for every other variant.
    CHECK(t.scale == Approx(std::string(v.type) == "yarn" ? 0.1 * std::log(4.0) + 1 : 1.0)
                         .epsilon(4 * FLT_EPSILON));
  }
  // llama3 leaves the highest frequencies and divides the lowest by the factor: both happen
  // in this table, so the blend between them is exercised too.
  m.rope_type = "llama3";
  m.rope_factor = 8;
  m.rope_original_context = 64;
  const RopeTable t = rope_table(m);
  m.rope_type = "default";
  const RopeTable plain = rope_table(m);
  CHECK(t.inv_freq[0] == plain.inv_freq[0]);
  CHECK(t.inv_freq[15] == Approx(plain.inv_freq[15] / 8).epsilon(4 * FLT_EPSILON));
  int blended = 0;
  for (int i = 0; i < 16; ++i)
    blended += t.inv_freq[i] != plain.inv_freq[i] &&
               std::fabs(t.inv_freq[i] * 8 / plain.inv_freq[i] - 1) > 1e-5;
  CHECK(blended > 0);
}

TEST_CASE("config.json: the rotary settings of transformers 5 and 4.x, and dtype",
          "[families][rope]") {
  auto j = nlohmann::json::parse(read_all(fixture("llama_gqa_f32/config.json")));
  // transformers 5 writes only rope_parameters (the silent bug: rope_theta read as 10000).
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_type", "llama3"},   {"rope_theta", 500000.0},
                          {"factor", 8.0},           {"low_freq_factor", 1.0},
                          {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  ModelConfig m = parse_hf_config(j.dump(), "x/config.json");
  CHECK(m.rope_theta == 500000.0f);
  CHECK(m.rope_type == "llama3");
  CHECK(m.rope_factor == 8.0f);
  CHECK(m.rope_high_freq_factor == 4.0f);
  CHECK(m.rope_original_context == 8192);
  // The same settings in the 4.x form.
  auto legacy = j;
  legacy.erase("rope_parameters");
  legacy["rope_theta"] = 500000.0;
  legacy["rope_scaling"] = {{"rope_type", "llama3"},
                            {"factor", 8.0},
                            {"low_freq_factor", 1.0},
                            {"high_freq_factor", 4.0},
                            {"original_max_position_embeddings", 8192}};
  ModelConfig m4 = parse_hf_config(legacy.dump(), "x/config.json");
  CHECK(m4.rope_theta == m.rope_theta);
  CHECK(m4.rope_type == m.rope_type);
  CHECK(m4.rope_original_context == m.rope_original_context);
  // Both forms, disagreeing: refused, not one of them picked.
  auto both = legacy;
  both["rope_theta"] = 10000.0;
  both["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 500000.0}};
  CHECK_THROWS_WITH(parse_hf_config(both.dump(), "x/config.json"), Contains("rope_scaling"));
  both.erase("rope_scaling");
  CHECK_THROWS_WITH(parse_hf_config(both.dump(), "x/config.json"),
                    Contains("'rope_theta'") && Contains("give it once"));
  // The converted config.yaml says what the model computes.
  const std::string yaml = engine_config_yaml(m);
  CHECK_THAT(yaml, Contains("rope_theta: 500000") && Contains("rope_type: llama3") &&
                       Contains("rope_original_context: 8192"));
  // The export writes both forms, saying the same, and one dtype under both names.
  auto out = nlohmann::json::parse(hf_config_json(m, StDtype::kBF16, j.dump()));
  CHECK(out["rope_parameters"]["rope_type"] == "llama3");
  CHECK(out["rope_parameters"]["rope_theta"] == 500000.0);
  CHECK(out["rope_scaling"]["factor"] == 8.0);
  CHECK(out["rope_theta"] == 500000.0);
  CHECK(out["dtype"] == "bfloat16");
  CHECK(out["torch_dtype"] == "bfloat16");
  ModelConfig again = parse_hf_config(out.dump(), "export/config.json");
  CHECK(again.rope_type == m.rope_type);
  CHECK(again.rope_factor == m.rope_factor);
  // transformers 5's `dtype` is the one read.
  auto dt = j;
  dt.erase("torch_dtype");
  dt["dtype"] = "bfloat16";
  CHECK(hf_torch_dtype(dt.dump()) == StDtype::kBF16);
}

// ---- whole model -----------------------------------------------------------------------

namespace {

Config family_config(const std::string& model, double clip = 0.0, int layers = 3) {
  return parse_config(str("model: {", model, ", n_layer: ", layers,
                          ", vocab_size: 64, seq_len: 8}\n"
                          "optimizer: {lr: 3.0e-3, min_lr: 3.0e-4, grad_clip: ",
                          clip,
                          "}\nschedule: {steps: 4, warmup_steps: 1, micro_batch: 2}\n"
                          "runtime: {backend: cpu, threads: 2, seed: 5}\n"),
                      "<test>");
}

const char* kFamilies[] = {
    "family: opt, n_head: 2, d_model: 16, d_ff: 24",
    "family: llama, n_head: 4, n_kv_head: 2, d_model: 16, d_ff: 24, tie_embeddings: false",
    "family: llama, n_head: 2, d_model: 16, d_ff: 24, qkv_bias: true, norm_eps: 1.0e-6",
    // Qwen3's shape: heads wider than d_model / n_head, and the q/k norm; SmolLM3's layer
    // without rotary embeddings.
    "family: llama, n_head: 4, n_kv_head: 2, d_model: 16, head_dim: 6, d_ff: 24, qk_norm: true, "
    "nope_layers: [1]",
    // OLMo 2's shape: norms after the sublayers, q/k norms over the whole projections.
    "family: llama, n_head: 4, n_kv_head: 2, d_model: 16, d_ff: 24, qk_norm: true, "
    "qk_norm_span: projection, norm_position: post, tie_embeddings: false",
};

}  // namespace

// Finite differences need a smooth loss: the llama family is (SiLU, RMSNorm, RoPE). opt's
// ReLU kinks make differences of a whole model unreliable, so its gradients are compared
// with PyTorch's instead (the next test).
TEST_CASE("llama gradients match finite differences of the loss", "[families]") {
  for (const char* fam : {kFamilies[1], kFamilies[2], kFamilies[3], kFamilies[4]}) {
    INFO(fam);
    Config cfg = family_config(fam, 0.0, 2);
    auto be = make_cpu_backend(2, 0);
    const int B = 2, T = cfg.model.seq_len;
    Transformer model(cfg.model, *be, B);
    const ParamLayout& layout = model.layout();
    std::vector<float> p(layout.total);
    init_gpt_params(cfg.model, layout, p.data());
    // Larger weights than init so every path carries gradient well above rounding.
    Rng rng(3);
    for (const TensorSpec& t : layout.tensors)
      for (size_t i = 0; i < t.numel; ++i) p[t.offset + i] += 0.3f * rng.normal();
    std::vector<int32_t> in(B * T), tg(B * T);
    for (int i = 0; i < B * T; ++i)
      in[i] = static_cast<int32_t>(rng.below(64)), tg[i] = static_cast<int32_t>(rng.below(64));
    be->copy_to_device(model.params(), p.data(), 4 * p.size());
    const float L0 = model.forward(in.data(), tg.data());
    model.zero_grads();
    model.backward(1.0f / (B * T));
    std::vector<float> g(layout.total);
    be->copy_to_host(g.data(), model.grads(), 4 * g.size());
    // Per tensor, the derivative along the unit direction of its analytic gradient: equals
    // |g| only if the gradient is right. Central differences at h and h/2 combined by
    // Richardson extrapolation (4 D(h/2) - D(h)) / 3 cancel the h^2 term, which these
    // deliberately curved models make large; what remains is the rounding of the loss
    // differences, at most ~eps |L| / (h/2) for each of the four evaluations, times 5/3 from
    // the combination. The allowance is that (relative to |g|) or kFdTolerance if larger.
    const double h = 2e-2;
    for (const TensorSpec& t : layout.tensors) {
      double norm = 0;
      for (size_t i = 0; i < t.numel; ++i) norm += double(g[t.offset + i]) * g[t.offset + i];
      norm = std::sqrt(norm);
      INFO("tensor " << t.name << " |g| " << norm);
      REQUIRE(norm > 0);
      auto loss_at = [&](double s) {
        std::vector<float> q = p;
        for (size_t i = 0; i < t.numel; ++i)
          q[t.offset + i] += static_cast<float>(s * g[t.offset + i] / norm);
        be->copy_to_device(model.params(), q.data(), 4 * q.size());
        return double(model.forward(in.data(), tg.data()));
      };
      double d1 = (loss_at(h) - loss_at(-h)) / (2 * h);
      double d2 = (loss_at(h / 2) - loss_at(-h / 2)) / h;
      double fd = (4 * d2 - d1) / 3;
      double tol = std::max(kFdTolerance, 4 * FLT_EPSILON * std::fabs(L0) / (h / 2) * 5 / 3 / norm);
      CHECK(std::fabs(fd - norm) / norm < tol);
    }
  }
}

TEST_CASE("opt gradients equal PyTorch's for a converted checkpoint", "[hf][families]") {
  TempDir tmp("optgrad");
  const std::string ckpt = tmp.path + "/opt";
  convert_hf_to_engine(fixture("opt_f32"), ckpt, {});
  LoadedCheckpoint c = load_engine_checkpoint(ckpt);
  SafetensorsReader ref(fixture("logits_opt_f32.safetensors"));
  auto train = ref.read_i32("train_tokens");
  const int T = c.model.seq_len;
  REQUIRE(train.size() == static_cast<size_t>(T) + 1);
  auto be = make_cpu_backend(2, 0);
  Transformer model(c.model, *be, 1);
  be->copy_to_device(model.params(), c.params.data(), c.params.size() * sizeof(float));
  float loss = model.forward(train.data(), train.data() + 1);
  CHECK(loss == Approx(ref.read_f32("train_loss", {1})[0]).epsilon(1e-4));
  model.zero_grads();
  model.backward(1.0f / T);
  std::vector<float> g(model.layout().total);
  be->copy_to_host(g.data(), model.grads(), 4 * g.size());
  // Errors are relative to the largest reference gradient of the whole engine tensor: the
  // key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by a
  // query's scores), so on its own it would be rounding noise compared with rounding noise.
  std::map<std::string, double> scale;
  for (const HfTensorMap& m : hf_tensor_map(c.model))
    for (float v : ref.read_f32("grad." + m.hf, m.hf_shape))
      scale[m.engine] = std::max(scale[m.engine], std::fabs(double(v)));
  for (const HfTensorMap& m : hf_tensor_map(c.model)) {
    INFO("tensor " << m.hf);
    auto want = ref.read_f32("grad." + m.hf, m.hf_shape);
    const float* got = g.data() + model.layout().tensor(m.engine).offset + m.engine_offset;
    double diff = 0;
    for (size_t i = 0; i < want.size(); ++i)
      diff = std::max(diff, std::fabs(double(got[i]) - want[i]));
    INFO("relative error " << diff / scale[m.engine]);
    // fp32 on both sides, different summation orders: the 1e-4 relative bound.
    CHECK(diff < 1e-4 * scale[m.engine]);
  }
}

TEST_CASE("offloaded training of every family is bitwise equal to in-memory training",
          "[families]") {
  for (const char* fam : kFamilies) {
    for (double clip : {0.0, 0.5}) {
      INFO(fam << ", clip " << clip);
      Config cfg = family_config(fam, clip);
      std::vector<std::vector<int32_t>> data;
      for (int s = 0; s < 3; ++s) {
        Rng rng(77, s);
        std::vector<int32_t> b(static_cast<size_t>(2) * (cfg.model.seq_len + 1));
        for (auto& t : b) t = static_cast<int32_t>(rng.below(cfg.model.vocab_size));
        data.push_back(b);
      }
      auto be = make_cpu_backend(2, 0);
      InMemoryStep r(cfg, *be);
      r.init_params();
      std::vector<float> ref_losses;
      for (size_t s = 0; s < data.size(); ++s)
        ref_losses.push_back(r.step(static_cast<int64_t>(s), {data[s].data()}).loss);

      PlanRequest req;
      req.model = cfg.model;
      req.micro_batch = 2;
      req.exact = clip > 0;
      req.acts = {ActPlacement::kHost, ActPlacement::kRecompute, ActPlacement::kKeep};
      auto be2 = make_cpu_backend(2, 0);
      PlanExecutor tr(cfg, *be2, make_plan(req), nullptr);
      ParamLayout layout = make_gpt_layout(cfg.model);
      std::vector<float> init(layout.total);
      init_gpt_params(cfg.model, layout, init.data());
      tr.set_params(init.data());
      for (size_t s = 0; s < data.size(); ++s) {
        float l = tr.step(static_cast<int64_t>(s), data[s].data()).loss;
        CHECK(std::memcmp(&l, &ref_losses[s], 4) == 0);
      }
      std::vector<float> params(layout.total);
      tr.read_params(params.data());
      CHECK(std::memcmp(params.data(), r.master().data(), 4 * params.size()) == 0);
    }
  }
}

TEST_CASE("FLOPs and sizes per family", "[families]") {
  Config llama = family_config(kFamilies[1], 0.0, 2);
  const ModelConfig& m = llama.model;
  const double C = 16, F = 24, KV = 8, T = 8, V = 64;
  double layer = 2 * C * (C + 2 * KV) + 4 * T * C + 2 * C * C + 3 * 2 * C * F;
  CHECK(layer_forward_flops_per_token(m) == layer);
  CHECK(forward_flops_per_token(m) == 2 * layer + 2 * C * V);
  Config opt = family_config(kFamilies[0], 0.0, 2);
  CHECK(layer_forward_flops_per_token(opt.model) ==
        2 * C * 3 * C + 4 * T * C + 2 * C * C + 2 * 2 * C * F);
  // The untied head is in the final group; llama has no position table or biases.
  ParamLayout lay = make_gpt_layout(m);
  CHECK(lay.tensors.back().name == "lm_head.weight");
  CHECK(lay.tensors.back().group == static_cast<int>(lay.groups.size()) - 1);
  CHECK(lay.groups.front().num_tensors == 1);
  CHECK(lay.tensor("h.0.attn.c_attn.weight").shape == std::vector<int64_t>{32, 16});
  CHECK(make_gpt_layout(opt.model).tensor("wpe.weight").shape == std::vector<int64_t>{10, 16});
  // The planner's per-layer activation bytes are what the model allocates, for either
  // storage type of the device's tensors.
  for (ElemType t : {ElemType::kF32, ElemType::kBF16}) {
    INFO("device tensors " << elem_type_name(t));
    auto be = make_cpu_backend(2, 0);
    be->set_storage_type(t);
    uint64_t before = be->memory().used;
    Transformer model(m, *be, 2, ModelState::kWorkspace);
    CHECK(be->memory().used - before == model_workspace_bytes(m, 2, elem_type_size(t)));
    before = be->memory().used;
    model.alloc_activations("test");
    CHECK(be->memory().used - before == layer_activation_bytes(m, 2, elem_type_size(t)));
  }
}

// ---- Hugging Face checkpoints ----------------------------------------------------------

TEST_CASE("converted opt, llama and qwen2 checkpoints give transformers' logits",
          "[hf][families]") {
  TempDir tmp("logits");
  for (const char* v : kFamilyFixtures) {
    INFO("variant " << v);
    std::string ckpt = tmp.path + "/" + v;
    ConvertResult r = convert_hf_to_engine(fixture(v), ckpt, {});
    CHECK(r.model.n_layer == 2);
    CHECK(r.model.d_model == 32);
    double err = engine_logits_error(ckpt, fixture(std::string("logits_") + v + ".safetensors"));
    INFO("logits relative error " << err);
    // The bound for fp32: 1e-4 relative.
    CHECK(err < 1e-4);
  }
}

TEST_CASE("opt and llama: HF -> engine -> HF gives bit-identical tensors", "[hf][families]") {
  TempDir tmp("roundtrip");
  struct {
    const char* variant;
    StDtype dtype;
    uint64_t shard;
  } cases[] = {{"opt_f32", StDtype::kF32, 5'000'000'000ull},
               {"llama_gqa_f32", StDtype::kF32, 30'000},
               {"llama_bf16_sharded", StDtype::kBF16, 20'000},
               {"qwen2_gqa_f32", StDtype::kF32, 5'000'000'000ull}};
  for (const auto& c : cases) {
    INFO("variant " << c.variant);
    std::string ckpt = tmp.path + "/" + c.variant + "_engine",
                out = tmp.path + "/" + c.variant + "_hf";
    convert_hf_to_engine(fixture(c.variant), ckpt, {});
    ConvertOptions opts;
    opts.dtype = c.dtype;
    opts.max_shard_bytes = c.shard;
    ConvertResult r = convert_engine_to_hf(ckpt, out, opts);
    if (c.shard < 1'000'000) CHECK(fs::exists(out + "/model.safetensors.index.json"));
    check_same_tensors(fixture(c.variant), out, [](const std::string& n) { return n; });
    ModelConfig a = load_hf_config(fixture(c.variant) + "/config.json");
    ModelConfig b = load_hf_config(out + "/config.json");
    CHECK(engine_config_yaml(a) == engine_config_yaml(b));
    auto j = nlohmann::json::parse(read_all(out + "/config.json"));
    auto src = nlohmann::json::parse(read_all(fixture(c.variant) + "/config.json"));
    CHECK(j["architectures"] == src["architectures"]);
    CHECK(j["model_type"] == src["model_type"]);
  }
}

TEST_CASE("opt and llama configs the engine cannot compute are refused by field",
          "[hf][families]") {
  auto refuse = [](const std::string& variant, const std::function<void(nlohmann::json&)>& edit,
                   const std::string& field, const std::string& why) {
    auto j = nlohmann::json::parse(read_all(fixture(variant + "/config.json")));
    edit(j);
    INFO(variant << " -> " << j.dump());
    CHECK_THROWS_WITH(parse_hf_config(j.dump(), "x/config.json"),
                      Contains("x/config.json") && Contains("'" + field + "'") && Contains(why));
  };
  refuse(
      "opt_f32", [](auto& j) { j["do_layer_norm_before"] = false; }, "do_layer_norm_before",
      "post-LN");
  // Positive in a double, 0 in the engine's 32-bit float (a fuzzer's find): refused here, not
  // later by the config it would have written.
  refuse(
      "llama_gqa_f32", [](auto& j) { j["rms_norm_eps"] = 1e-46; }, "rms_norm_eps", "32-bit float");
  refuse(
      "llama_gqa_f32", [](auto& j) { j["rope_theta"] = 1.00000001; }, "rope_theta", "32-bit float");
  refuse(
      "opt_f32", [](auto& j) { j["word_embed_proj_dim"] = 16; }, "word_embed_proj_dim",
      "project_in");
  refuse(
      "opt_f32", [](auto& j) { j["activation_function"] = "gelu"; }, "activation_function", "relu");
  refuse(
      "opt_f32", [](auto& j) { j.erase("ffn_dim"); }, "ffn_dim", "missing");
  refuse(
      "llama_gqa_f32",
      [](auto& j) {
        j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}, {"alpha", 1.0}};
      },
      "rope_scaling", "'alpha'");
  refuse(
      "llama_gqa_f32",
      [](auto& j) {
        j["rope_scaling"] = {{"rope_type", "llama3"}};
      },
      "rope_scaling", "needs 'factor'");
  refuse(
      "llama_gqa_f32",
      [](auto& j) {
        j["rope_scaling"] = {{"rope_type", "longrope"}, {"short_factor", {1.0}}};
      },
      "rope_scaling", "'short_factor' has 1 entries");
  // Phi-3's class has only default and longrope, and reads su and yarn as longrope.
  auto phi3 = [](nlohmann::json& j) {
    j["model_type"] = "phi3";
    j.erase("attention_bias");
    j.erase("mlp_bias");
    j.erase("pretraining_tp");
  };
  refuse(
      "llama_gqa_f32",
      [&](auto& j) {
        phi3(j);
        j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
      },
      "rope_scaling", "only default and longrope");
  refuse(
      "llama_gqa_f32",
      [&](auto& j) {
        phi3(j);
        j["rope_scaling"] = {{"type", "yarn"}, {"factor", 2.0}};
      },
      "rope_scaling", "longrope needs 'short_factor'");
  // A key no parser reads is refused, with its value; one that cannot change the model is not.
  refuse(
      "llama_gqa_f32", [](auto& j) { j["logit_scale"] = 0.5; }, "logit_scale", "is not modelled");
  refuse(
      "llama_gqa_f32",
      [](auto& j) {
        j["quantization_config"] = {{"bits", 4}};
      },
      "quantization_config", "is not modelled");
  refuse(
      "llama_gqa_f32", [](auto& j) { j["mlp_bias"] = true; }, "mlp_bias", "no biases");
  refuse(
      "llama_gqa_f32", [](auto& j) { j["pretraining_tp"] = 2; }, "pretraining_tp", "as 1");
  refuse(
      "qwen2_gqa_f32",
      [](auto& j) {
        j["layer_types"] = {"full_attention", "sliding_attention"};
      },
      "layer_types", "full_attention");
  {
    auto j = nlohmann::json::parse(read_all(fixture("gpt2_f32/config.json")));
    j["use_cache"] = false;
    j["attn_pdrop"] = 0.3;
    CHECK_NOTHROW(parse_hf_config(j.dump(), "x/config.json"));
  }
  // Qwen2's config class unties the head when config.json does not say.
  {
    auto j = nlohmann::json::parse(read_all(fixture("qwen2_gqa_f32/config.json")));
    j.erase("tie_word_embeddings");
    CHECK_FALSE(parse_hf_config(j.dump(), "x/config.json").tie_embeddings);
  }
  // Mistral: its window bounds the context; MistralConfig's default window is 4096.
  {
    auto j = nlohmann::json::parse(read_all(fixture("llama_gqa_f32/config.json")));
    j["model_type"] = "mistral";
    j.erase("attention_bias");
    j.erase("pretraining_tp");
    j["max_position_embeddings"] = 32768;
    ModelConfig m = parse_hf_config(j.dump(), "x/config.json");
    CHECK(m.sliding_window == 4096);
    CHECK(m.seq_len == 4096);
    j["sliding_window"] = nullptr;
    m = parse_hf_config(j.dump(), "x/config.json");
    CHECK(m.sliding_window == 0);
    CHECK(m.seq_len == 32768);
  }
  refuse(
      "llama_gqa_f32", [](auto& j) { j["num_key_value_heads"] = 3; }, "num_key_value_heads",
      "does not divide");
  refuse(
      "llama_gqa_f32", [](auto& j) { j["hidden_act"] = "gelu"; }, "hidden_act", "silu");
  refuse(
      "llama_gqa_f32", [](auto& j) { j["attention_bias"] = true; }, "attention_bias", "o_proj");
  refuse(
      "llama_gqa_f32", [](auto& j) { j["num_attention_heads"] = "4"; }, "num_attention_heads",
      "integer");
  refuse(
      "llama_gqa_f32", [](auto& j) { j["model_type"] = "gemma"; }, "model_type", "not supported");

  // An untied checkpoint without its LM head, and a tied one given the wrong head shape.
  TempDir tmp("refuse");
  fs::path d = fs::path(tmp.path) / "llama";
  fs::copy(fixture("llama_gqa_f32"), d, fs::copy_options::recursive);
  auto j = nlohmann::json::parse(read_all(d / "config.json"));
  j["num_hidden_layers"] = 1;
  write_all(d / "config.json", j.dump());
  CHECK_THROWS_WITH(convert_hf_to_engine(d.string(), tmp.path + "/out", {}),
                    Contains("model.layers.1.") && Contains("not part of a Llama model"));
  CHECK_FALSE(fs::exists(tmp.path + "/out"));
}

// ---- fine-tuning from a converted checkpoint -------------------------------------------

TEST_CASE("fuyou-train fine-tunes a converted llama: the first loss is transformers' loss",
          "[families]") {
  TempDir tmp("finetune");
  const std::string ckpt = tmp.path + "/llama";
  convert_hf_to_engine(fixture("llama_gqa_f32"), ckpt, {});
  SafetensorsReader ref(fixture("logits_llama_gqa_f32.safetensors"));
  auto tokens = ref.read_i32("train_tokens");
  const float hf_loss = ref.read_f32("train_loss", {1})[0];
  // Exactly T + 1 tokens: the only window the sampler can draw is the whole shard.
  const std::string shard = tmp.path + "/train.bin";
  write_token_shard(shard, tokens, 128);

  for (const char* offload : {"", "offload: {activations: swap}\n"}) {
    INFO("engine: " << (*offload ? "offloaded" : "in memory"));
    std::string run = tmp.path + (*offload ? "/run-offload" : "/run-memory");
    Config cfg =
        parse_config(str("model: {checkpoint: ", ckpt, "}\n", "data: {train_shards: [", shard,
                         "]}\n", "optimizer: {lr: 1.0e-3, grad_clip: 1.0}\n",
                         "schedule: {steps: 2, warmup_steps: 1, micro_batch: 1, eval_every: 0}\n",
                         "runtime: {backend: cpu, threads: 2}\n", offload),
                     "<test>");
    CHECK(cfg.model.family == "llama");
    CHECK(cfg.model.n_kv_head == 2);
    CHECK_FALSE(cfg.model.tie_embeddings);
    TrainOptions opts;
    opts.run_dir = run;
    run_training(cfg, opts);
    std::ifstream metrics(run + "/metrics.jsonl");
    std::vector<float> losses;
    for (std::string line; std::getline(metrics, line);) {
      auto j = nlohmann::json::parse(line);
      if (j.contains("loss")) losses.push_back(j["loss"].get<float>());
    }
    REQUIRE(losses.size() == 2);
    INFO("engine " << losses[0] << ", transformers " << hf_loss);
    // fp32 on both sides: the 1e-4 relative bound of the logits comparison.
    CHECK(std::fabs(losses[0] - hf_loss) <= 1e-4 * std::fabs(hf_loss));
    CHECK(losses[1] != losses[0]);  // the weights were updated
  }

  // A key that contradicts the checkpoint is refused by name.
  CHECK_THROWS_WITH(parse_config(str("model: {checkpoint: ", ckpt, ", n_layer: 3}\n"), "<t>"),
                    Contains("model.n_layer") && Contains("checkpoint"));
  CHECK_THROWS_WITH(parse_config("model: {checkpoint: /nonexistent/ckpt}\n", "<t>"),
                    Contains("model.checkpoint") && Contains("/nonexistent/ckpt"));
}
