// Every CPU kernel's backward against central finite differences of its forward, and the
// shared element math against direct formulas.
// The finite-difference tolerance and its derivation are in fd_check.h.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>

#include "fd_check.h"
#include "fuyou/backend.h"
#include "fuyou/backend_select.h"
#include "fuyou/config.h"
#include "fuyou/error.h"
#include "fuyou/model.h"
#include "fuyou/rng.h"
#include "fuyou/train.h"
#include "kernels/common/element_math.h"
#include "storage_values.h"
#include "test_support.h"

using namespace fuyou;
using namespace fuyou::test;

TEST_CASE("layernorm backward matches finite differences", "[kernels]") {
  auto be = make_cpu_backend(2, 0);
  const int N = 5, C = 24;
  auto x = randn(N * C, 1), w = randn(C, 2), b = randn(C, 3), R = randn(N * C, 4);
  std::vector<float> out(N * C), mean(N), rstd(N);
  auto loss = [&] {
    be->layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    return dot(out, R);
  };
  loss();
  std::vector<float> dx(N * C, 0.0f), dw(C, 0.0f), db(C, 0.0f);
  be->layernorm_backward(dx.data(), dw.data(), db.data(), R.data(), x.data(), w.data(), mean.data(),
                         rstd.data(), N, C);
  check_grad("layernorm dx", x, dx, loss);
  check_grad("layernorm dw", w, dw, loss);
  check_grad("layernorm db", b, db, loss);
}

TEST_CASE("matmul backward matches finite differences", "[kernels]") {
  auto be = make_cpu_backend(2, 0);
  const int N = 7, IC = 12, OC = 9;
  auto x = randn(N * IC, 5), w = randn(OC * IC, 6), bias = randn(OC, 7), R = randn(N * OC, 8);
  std::vector<float> out(N * OC);
  auto loss = [&] {
    be->matmul_forward(out.data(), x.data(), w.data(), bias.data(), N, IC, OC);
    return dot(out, R);
  };
  loss();
  std::vector<float> dx(N * IC), dw(OC * IC, 0.0f), db(OC, 0.0f);
  be->matmul_backward(dx.data(), dw.data(), db.data(), R.data(), x.data(), w.data(), N, IC, OC);
  check_grad("matmul dx", x, dx, loss);
  check_grad("matmul dw", w, dw, loss);
  check_grad("matmul dbias", bias, db, loss);
}

TEST_CASE("causal attention backward matches finite differences", "[kernels]") {
  auto be = make_cpu_backend(2, 0);
  const int B = 2, T = 6, C = 8, H = 2;
  auto qkv = randn(B * T * 3 * C, 9), R = randn(B * T * C, 10);
  std::vector<float> out(B * T * C), lse(B * H * T), scratch(2 * T * T);
  auto loss = [&] {
    be->attention_forward(out.data(), lse.data(), scratch.data(), qkv.data(), B, T, C, H, nullptr);
    return dot(out, R);
  };
  loss();
  // Causality: row t's log-sum-exp covers the scores of keys 0..t only.
  const int hd = C / H;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) {
        double s = 0;
        for (int j = 0; j <= t; ++j) {
          double dotqk = 0;
          for (int d = 0; d < hd; ++d)
            dotqk += double(qkv[(b * T + t) * 3 * C + h * hd + d]) *
                     qkv[(b * T + j) * 3 * C + C + h * hd + d];
          s += std::exp(dotqk / std::sqrt(double(hd)));
        }
        CHECK(lse[(b * H + h) * T + t] == Approx(std::log(s)).epsilon(1e-5));
      }
  std::vector<float> dqkv(qkv.size());
  be->attention_backward(dqkv.data(), scratch.data(), R.data(), out.data(), qkv.data(), lse.data(),
                         B, T, C, H, nullptr);
  check_grad("attention dqkv", qkv, dqkv, loss);
}

TEST_CASE("gelu backward matches finite differences", "[kernels]") {
  auto be = make_cpu_backend(2, 0);
  auto x = randn(40, 11, 2.0f), R = randn(40, 12);
  std::vector<float> out(40);
  auto loss = [&] {
    be->gelu_forward(out.data(), x.data(), x.size());
    return dot(out, R);
  };
  loss();
  std::vector<float> dx(40);
  be->gelu_backward(dx.data(), x.data(), R.data(), x.size());
  check_grad("gelu dx", x, dx, loss);
}

TEST_CASE("cross-entropy backward matches finite differences", "[kernels]") {
  auto be = make_cpu_backend(2, 0);
  const int N = 4, V = 11;
  auto logits = randn(N * V, 13, 2.0f);
  std::vector<int32_t> targets = {3, 0, 10, 7};
  std::vector<float> losses(N), lse(N);
  auto loss = [&] {
    be->crossentropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V, V);
    double s = 0;
    for (float l : losses) s += l;
    return s;
  };
  double l0 = loss();
  // Forward against the direct formula in double.
  double direct = 0;
  for (int n = 0; n < N; ++n) {
    double z = 0;
    for (int v = 0; v < V; ++v) z += std::exp(double(logits[n * V + v]));
    direct += std::log(z) - logits[n * V + targets[n]];
  }
  CHECK(l0 == Approx(direct).epsilon(1e-6));
  std::vector<float> d = logits;
  be->crossentropy_backward(d.data(), lse.data(), targets.data(), 1.0f, N, V, V);
  check_grad("cross-entropy dlogits", logits, d, loss);
}

TEST_CASE("cross-entropy over a padded vocabulary: the padding ignored, its gradient zero",
          "[kernels]") {
  // Rows ld = 16 apart, V = 11 real columns, the padding columns holding what the head's GEMM
  // leaves there (garbage here, to show they are not read): the same losses, lse and real
  // gradients as the unpadded rows, bit for bit, and zero gradient in the padding.
  auto be = make_cpu_backend(2, 0);
  const int N = 5, V = 11, ld = 16;
  auto logits = randn(N * V, 23, 2.0f);
  auto padded = randn(N * ld, 24, 50.0f);
  for (int n = 0; n < N; ++n) std::copy(&logits[n * V], &logits[n * V] + V, &padded[n * ld]);
  std::vector<int32_t> targets = {3, kIgnoreTarget, 10, 7, 0};
  std::vector<float> losses(N), lse(N), plosses(N), plse(N);
  be->crossentropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V, V);
  be->crossentropy_forward(plosses.data(), plse.data(), padded.data(), targets.data(), N, V, ld);
  CHECK(losses == plosses);
  CHECK(lse == plse);
  be->crossentropy_backward(logits.data(), lse.data(), targets.data(), 0.5f, N, V, V);
  be->crossentropy_backward(padded.data(), plse.data(), targets.data(), 0.5f, N, V, ld);
  for (int n = 0; n < N; ++n) {
    INFO("row " << n);
    CHECK(std::equal(&logits[n * V], &logits[n * V] + V, &padded[n * ld]));
    CHECK(
        std::all_of(&padded[n * ld + V], &padded[n * ld + ld], [](float x) { return x == 0.0f; }));
  }
}

namespace {}  // namespace

TEST_CASE("cross-entropy forward and backward in one pass: the two kernels' bits", "[kernels]") {
  // Padded rows holding garbage past V, an ignored target, and each storage type: the fused
  // kernel's losses, lse and gradient (padding included) equal forward then backward's.
  const std::string tensors = GENERATE("fp32", "bf16", "fp16");
  INFO("device_tensors " << tensors);
  auto be = make_cpu_backend(2, 0);
  RuntimeConfig rt;
  rt.device_tensors = tensors;
  rt.precision = tensors == "fp16" ? "fp16" : "auto";
  apply_precision(*be, rt);
  const int N = 6, V = 11, ld = 16;
  const auto values = randn(N * ld, 31, 4.0f);
  std::vector<char> a = stored_bytes(values, device_tensor_type(rt)), b = a;
  const std::vector<int32_t> targets = {3, kIgnoreTarget, 10, 7, 0, 10};
  std::vector<float> la(N), za(N), lb(N, -1.0f), zb(N, -1.0f);
  be->crossentropy_forward(la.data(), za.data(), a.data(), targets.data(), N, V, ld);
  be->crossentropy_backward(a.data(), za.data(), targets.data(), 0.25f, N, V, ld);
  be->crossentropy_forward_backward(lb.data(), zb.data(), b.data(), targets.data(), 0.25f, N, V,
                                    ld);
  CHECK(std::memcmp(la.data(), lb.data(), sizeof(float) * N) == 0);
  CHECK(std::memcmp(za.data(), zb.data(), sizeof(float) * N) == 0);
  CHECK(a == b);
}

TEST_CASE("residual add and norm in one pass: the two kernels' bits", "[kernels]") {
  // Sums that round in 16-bit storage, each norm, and res written in place over a (as the
  // layer does) or to a buffer of its own: the fused kernel's sum, output and statistics
  // equal add then the norm's.
  const std::string tensors = GENERATE("fp32", "bf16", "fp16");
  const bool rms = GENERATE(false, true);
  const bool in_place = GENERATE(false, true);
  INFO("device_tensors " << tensors << (rms ? ", rmsnorm" : ", layernorm")
                         << (in_place ? ", res over a" : ""));
  auto be = make_cpu_backend(2, 0);
  RuntimeConfig rt;
  rt.device_tensors = tensors;
  rt.precision = tensors == "fp16" ? "fp16" : "auto";
  apply_precision(*be, rt);
  const int N = 5, C = 24;
  const std::vector<char> a = stored_bytes(randn(N * C, 41, 3.0f), device_tensor_type(rt)),
                          b = stored_bytes(randn(N * C, 42, 0.7f), device_tensor_type(rt)),
                          w = stored_bytes(randn(C, 43, 1.0f), device_tensor_type(rt)),
                          bias = stored_bytes(randn(C, 44, 0.5f), device_tensor_type(rt));
  const size_t es = be->storage_bytes();
  std::vector<char> res1(N * C * es), out1(N * C * es), a2 = a, res2(N * C * es),
                                                        out2(N * C * es, 7);
  std::vector<float> mean1(N), rstd1(N), mean2(N, -1.0f), rstd2(N, -1.0f);
  be->add(res1.data(), a.data(), b.data(), N * C);
  if (rms)
    be->rmsnorm_forward(out1.data(), rstd1.data(), res1.data(), w.data(), 1e-5f, N, C);
  else
    be->layernorm_forward(out1.data(), mean1.data(), rstd1.data(), res1.data(), w.data(),
                          bias.data(), N, C);
  void* res = in_place ? a2.data() : res2.data();
  if (rms) {
    be->residual_rmsnorm_forward(res, out2.data(), rstd2.data(), a2.data(), b.data(), w.data(),
                                 1e-5f, N, C);
    mean2 = mean1;  // RMSNorm keeps no mean
  } else {
    be->residual_layernorm_forward(res, out2.data(), mean2.data(), rstd2.data(), a2.data(),
                                   b.data(), w.data(), bias.data(), N, C);
  }
  CHECK(std::memcmp(res, res1.data(), res1.size()) == 0);
  CHECK(out1 == out2);
  CHECK(std::memcmp(mean1.data(), mean2.data(), sizeof(float) * N) == 0);
  CHECK(std::memcmp(rstd1.data(), rstd2.data(), sizeof(float) * N) == 0);
}

TEST_CASE("forward_backward is forward then backward, bit for bit, chunked head or not",
          "[kernels]") {
  // Training's pass (the loss's gradient in the forward's pass over the logits, no chunk's
  // logits computed twice) against the two calls the tests and the reference fixtures use:
  // every family, the head whole and in chunks, a masked target, 16-bit tensors.
  const std::string family = GENERATE("gpt2", "opt", "llama");
  const int chunk = GENERATE(0, 5);
  const std::string tensors = GENERATE("fp32", "bf16");
  INFO(family << ", head_chunk_tokens " << chunk << ", device_tensors " << tensors);
  Config cfg = parse_config(
      str("model: {family: ", family, ", n_layer: 2, n_head: 2, d_model: 16, d_ff: 32, ",
          "vocab_size: 61, seq_len: 8, head_chunk_tokens: ", chunk, "}\n",
          "runtime: {backend: cpu, threads: 1, device_tensors: ", tensors, "}\n"),
      "<test>");
  auto be = make_cpu_backend(1, 0);
  apply_precision(*be, cfg.runtime);
  const int B = 2, T = cfg.model.seq_len;
  Transformer a(cfg.model, *be, B), b(cfg.model, *be, B);
  const ParamLayout& layout = a.layout();
  std::vector<float> p(layout.total);
  init_gpt_params(cfg.model, layout, p.data());
  const size_t bytes = be->storage_bytes() * layout.total;
  const std::vector<char> stored = stored_bytes(p, device_tensor_type(cfg.runtime));
  be->copy_to_device(a.params(), stored.data(), bytes);
  be->copy_to_device(b.params(), stored.data(), bytes);
  std::vector<int32_t> in(B * T), tg(B * T);
  for (int i = 0; i < B * T; ++i)
    in[i] = (i * 7 + 3) % 61, tg[i] = i == 4 ? kIgnoreTarget : (i * 11 + 1) % 61;
  a.zero_grads();
  b.zero_grads();
  const float scale = 1.0f / static_cast<float>(B * T - 1);
  const float la = a.forward(in.data(), tg.data());
  a.backward(scale);
  const float lb = b.forward_backward(in.data(), tg.data(), nullptr, scale);
  CHECK(std::memcmp(&la, &lb, 4) == 0);
  std::vector<char> ga(bytes), gb(bytes);
  be->copy_to_host(ga.data(), a.grads(), bytes);
  be->copy_to_host(gb.data(), b.grads(), bytes);
  CHECK(ga == gb);
  CHECK(std::any_of(ga.begin(), ga.end(), [](char c) { return c != 0; }));
}

TEST_CASE("a padded vocabulary's rows stay zero through training and out of checkpoints",
          "[kernels]") {
  // vocab 61 computes over 64 rows; the 3 padding rows of the tied table get no gradient and
  // no update, and the layout's tensors (what checkpoints and exports write) have 61 rows.
  Config cfg = parse_config(
      "model: {n_layer: 1, n_head: 2, d_model: 16, d_ff: 32, vocab_size: 61, seq_len: 8}\n"
      "schedule: {micro_batch: 2}\nruntime: {backend: cpu, threads: 1, seed: 3}\n",
      "<test>");
  REQUIRE(padded_vocab(cfg.model) == 64);
  auto be = make_cpu_backend(1, 0);
  apply_precision(*be, cfg.runtime);
  InMemoryStep r(cfg, *be);
  r.init_params();
  std::vector<int32_t> batch(2 * 9);
  for (size_t i = 0; i < batch.size(); ++i) batch[i] = static_cast<int32_t>((i * 13 + 5) % 61);
  for (int s = 0; s < 3; ++s) r.step(s, {batch.data()});
  const TensorSpec& wte = r.model().layout().tensor("wte.weight");
  CHECK(wte.numel == 61u * 16);
  CHECK(wte.shape == std::vector<int64_t>{61, 16});
  const size_t P = r.model().layout().total;
  std::vector<float> params(P), grads(P);
  be->copy_to_host(params.data(), r.model().params(), 4 * P);
  be->copy_to_host(grads.data(), r.model().grads(), 4 * P);
  const float* pad = params.data() + wte.offset + wte.numel;
  const float* gpad = grads.data() + wte.offset + wte.numel;
  CHECK(std::all_of(pad, pad + 3 * 16, [](float x) { return x == 0.0f; }));
  CHECK(std::all_of(gpad, gpad + 3 * 16, [](float x) { return x == 0.0f; }));
  // The real rows did train (the last real row's token occurs in the batch).
  CHECK(std::any_of(grads.data() + wte.offset, grads.data() + wte.offset + wte.numel,
                    [](float x) { return x != 0; }));
}

TEST_CASE("embedding backward matches finite differences", "[kernels]") {
  auto be = make_cpu_backend(2, 0);
  const int B = 2, T = 3, C = 5, V = 4;
  auto wte = randn(V * C, 14), wpe = randn(T * C, 15), R = randn(B * T * C, 16);
  std::vector<int32_t> tokens = {1, 3, 1, 0, 1, 2};  // token 1 repeats: gradients must add up
  std::vector<float> out(B * T * C);
  auto loss = [&] {
    be->embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    return dot(out, R);
  };
  loss();
  std::vector<float> dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
  be->embedding_backward(dwte.data(), dwpe.data(), R.data(), tokens.data(), B, T, C);
  check_grad("embedding dwte", wte, dwte, loss);
  check_grad("embedding dwpe", wpe, dwpe, loss);
}

TEST_CASE("shared element math", "[kernels]") {
  // gelu against its definition in double; gelu_grad against a double central difference.
  for (double x = -6; x <= 6; x += 0.37) {
    double ref = 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
    CHECK(math::gelu(float(x)) == Approx(ref).margin(1e-6).epsilon(1e-5));
    double h = 1e-5;
    auto g = [](double v) {
      return 0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
    };
    double fd = (g(x + h) - g(x - h)) / (2 * h);
    CHECK(math::gelu_grad(float(x)) == Approx(fd).margin(1e-5).epsilon(1e-5));
  }
  // bf16 rounding: round-to-nearest-even, exact values preserved, NaN kept.
  CHECK(math::bf16_to_float(math::float_to_bf16(1.0f)) == 1.0f);
  CHECK(math::float_to_bf16(1.0f + 1.0f / 256) == 0x3f80);  // tie, even stays
  CHECK(math::float_to_bf16(1.0f + 3.0f / 256) == 0x3f82);  // tie, odd rounds up
  CHECK(std::isnan(math::bf16_to_float(math::float_to_bf16(NAN))));
  for (float v : {3.14159f, -2.5e-3f, 65504.0f, 1e-30f}) {
    float r = math::bf16_to_float(math::float_to_bf16(v));
    CHECK(std::fabs(r - v) <= std::fabs(v) * std::ldexp(1.0f, -8));  // half a bf16 ulp
  }
}
