// Generation on the CUDA backend: the decoding kernels (rope_forward_at, attention_decode)
// against the CPU backend's on the same inputs, and the key/value-cache decoder's greedy
// tokens on the GPU against the CPU's for each family.
//
// Tolerances from fp32's unit roundoff u = FLT_EPSILON / 2, as test_cuda_kernels.cc:
// - RoPE: the same element_math.h functions; cosf / sinf of the device and the host may
//   differ by a few ulps and the rotation adds two roundings: 8 u of |x| per element;
// - attention over L cached rows: scores are sums of D products (2 (D + 1) u of sum |q k|),
//   the softmax's exponentials and sum of L terms add (2 L + 8) u relative, the weighted sum
//   of values another 2 (L + 1) u of max |v|. The GPU combines four warps' running sums, the
//   CPU one; both are sums of the same terms in other orders, within those bounds.
// - greedy tokens: the decoder's logits on both backends differ by a few of these bounds;
//   a token is compared only where the CPU's two largest logits are further apart than
//   1e-3 of the logits' scale (a tie within rounding may go either way; never seen below).
#include <catch2/catch.hpp>
#include <cfloat>
#include <cmath>

#include "cuda_test_support.h"
#include "fuyou/cuda.h"
#include "fuyou/decoder.h"
#include "fuyou/error.h"
#include "fuyou/model.h"

using namespace fuyou;
using test::check_within;
using test::DeviceVec;
using test::max_abs;
using test::random_normal;
using test::random_tokens;

namespace {

constexpr double kU = FLT_EPSILON / 2;
constexpr uint64_t kArena = 256ull << 20;

ModelConfig tiny(const std::string& family, int n_kv_head) {
  ModelConfig m;
  m.family = family;
  m.n_layer = 2;
  m.n_head = 4;
  m.d_model = 64;
  m.d_ff = family == "llama" ? 96 : 256;
  m.vocab_size = 128;
  m.seq_len = 48;
  if (family == "llama") {
    m.n_kv_head = n_kv_head;
    m.tie_embeddings = false;
  }
  return m;
}

}  // namespace

TEST_CASE("cuda rope_forward_at and attention_decode match the CPU", "[cuda][decode]") {
  auto cpu = make_cpu_backend(2, 0);
  auto gpu = make_cuda_backend(0, kArena);
  for (int Hkv : {4, 2}) {
    INFO("key/value heads " << Hkv);
    const int T = 37, Hq = 4, D = 32, C = Hq * D, KV = Hkv * D, row = C + 2 * KV, pos0 = 29,
              N = T - pos0;
    auto qkvc = random_normal(static_cast<size_t>(T) * row, 40 + Hkv);
    // RoPE of the rows at pos0 .. T-1.
    std::vector<float> part(qkvc.begin() + pos0 * row, qkvc.end());
    DeviceVec<float> gpart(*gpu, part);
    cpu->rope_forward_at(part.data(), N, pos0, Hq, Hkv, D, default_rope_table(D, 10000.0f));
    gpu->rope_forward_at(gpart.get(), N, pos0, Hq, Hkv, D, default_rope_table(D, 10000.0f));
    check_within("rope_forward_at", gpart.host(), part, 8 * kU * max_abs(qkvc));
    // Attention: the first pos0 rows in one step, the rest one at a time, on both.
    std::vector<float> kc(T * KV), vc(T * KV), out(T * C);
    DeviceVec<float> gq(*gpu, qkvc), gkc(*gpu, kc.size()), gvc(*gpu, vc.size()),
        gout(*gpu, out.size());
    for (auto [pos, n] :
         std::vector<std::pair<int, int>>{{0, pos0}, {pos0, 1}, {pos0 + 1, N - 1}}) {
      cpu->attention_decode(out.data() + pos * C, kc.data(), vc.data(), qkvc.data() + pos * row, n,
                            pos, Hq, Hkv, D);
      gpu->attention_decode(gout.get() + pos * C, gkc.get(), gvc.get(), gq.get() + pos * row, n,
                            pos, Hq, Hkv, D);
    }
    const double m = max_abs(qkvc);
    const double score_err = 2 * (D + 1) * kU * D * m * m / std::sqrt(double(D));
    const double p_rel = score_err + (2 * T + 8) * kU;
    check_within("attention_decode", gout.host(), out, (2 * p_rel + 2 * (T + 1) * kU) * m);
    check_within("key cache", gkc.host(), kc, 0);
  }
}

TEST_CASE("cuda decoder: greedy tokens equal the CPU's for every family", "[cuda][decode]") {
  for (const auto& [family, kv] :
       std::vector<std::pair<std::string, int>>{{"gpt2", 0}, {"opt", 0}, {"llama", 2}}) {
    INFO(family);
    const ModelConfig m = tiny(family, kv);
    const ParamLayout layout = make_gpt_layout(m);
    std::vector<float> params(layout.total);
    init_gpt_params(m, layout, params.data());
    auto noise = random_normal(params.size(), 50, 0.05f);
    for (size_t i = 0; i < params.size(); ++i) params[i] += noise[i];
    auto cpu = make_cpu_backend(2, 0);
    auto gpu = make_cuda_backend(0, kArena);
    GptDecoder dc(m, *cpu, m.seq_len), dg(m, *gpu, m.seq_len);
    dc.set_params(params.data());
    dg.set_params(params.data());
    auto prompt = random_tokens(9, m.vocab_size, 51);
    std::vector<float> lc = dc.step(prompt.data(), 9), lg = dg.step(prompt.data(), 9);
    int compared = 0;
    for (int step = 0; step + 9 < m.seq_len; ++step) {
      check_within("logits", lg, lc, 1e-4 * max_abs(lc));
      std::vector<float> sorted = lc;
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      const int32_t tc = static_cast<int32_t>(std::max_element(lc.begin(), lc.end()) - lc.begin());
      const int32_t tg = static_cast<int32_t>(std::max_element(lg.begin(), lg.end()) - lg.begin());
      if (sorted[0] - sorted[1] > 1e-3 * max_abs(lc)) {
        CHECK(tc == tg);
        ++compared;
      }
      lc = dc.step(&tc, 1);
      lg = dg.step(&tc, 1);  // both continue from the CPU's token
    }
    CHECK(compared > 20);
  }
}

TEST_CASE("cuda decoder on bf16 tensors stays near fp32", "[cuda][decode]") {
  const ModelConfig m = tiny("llama", 2);
  const ParamLayout layout = make_gpt_layout(m);
  std::vector<float> params(layout.total);
  init_gpt_params(m, layout, params.data());
  auto cpu = make_cpu_backend(2, 0);
  auto gpu = make_cuda_backend(0, kArena);
  gpu->set_storage_type(ElemType::kBF16);
  GptDecoder dc(m, *cpu, 32), dg(m, *gpu, 32);
  dc.set_params(params.data());
  dg.set_params(params.data());
  auto prompt = random_tokens(20, m.vocab_size, 52);
  const std::vector<float> lc = dc.step(prompt.data(), 20), lg = dg.step(prompt.data(), 20);
  // bf16 keeps 8 bits: every stored tensor within 2^-9 relative; through two layers and the
  // head, a few percent of the logits' scale (as the CPU's own bf16 decoder, test_decode.cc).
  check_within("bf16 logits", lg, lc, 0.05 * max_abs(lc));
}

TEST_CASE("cuda decoder with streamed layers gives the resident decoder's logits",
          "[cuda][decode]") {
  // The same kernels on the same values from other buffers: bit for bit. The copies run on the
  // copy stream beside the compute stream (caller-ordered), so a slot refilled before its
  // layer finished would show.
  for (const auto& [family, kv] :
       std::vector<std::pair<std::string, int>>{{"gpt2", 0}, {"llama", 2}}) {
    INFO(family);
    ModelConfig m = tiny(family, kv);
    m.n_layer = 5;
    const ParamLayout layout = make_gpt_layout(m);
    std::vector<float> params(layout.total);
    init_gpt_params(m, layout, params.data());
    auto noise = random_normal(params.size(), 60, 0.05f);
    for (size_t i = 0; i < params.size(); ++i) params[i] += noise[i];
    auto gpu = make_cuda_backend(0, kArena);
    GptDecoder resident(m, *gpu, m.seq_len, LayerStreaming::kNever);
    GptDecoder streamed(m, *gpu, m.seq_len, LayerStreaming::kAlways);
    REQUIRE(streamed.streaming());
    resident.set_params(params.data());
    streamed.set_params(params.data());
    auto prompt = random_tokens(9, m.vocab_size, 61);
    std::vector<float> a = resident.step(prompt.data(), 9), b = streamed.step(prompt.data(), 9);
    for (int step = 0; step + 9 < m.seq_len; ++step) {
      REQUIRE(a == b);
      const int32_t t = static_cast<int32_t>(std::max_element(a.begin(), a.end()) - a.begin());
      a = resident.step(&t, 1);
      b = streamed.step(&t, 1);
    }
    CHECK(streamed.stream_stats().bytes > 0);
  }
}
