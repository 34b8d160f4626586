// Generation: the decoding kernels against the training kernels they shortcut, the
// key/value-cache decoder against the model's whole-sequence forward for every family, the
// sampler, and how prompts become tokens (tokenizer_config.json, post-processors).
//
// Tolerance: the decoder and the whole-sequence forward sum the same terms in different orders
// (a decode step's attention over the cache against the blocked kernel; GEMMs of one row
// against GEMMs of many), each sum over at most a few hundred fp32 terms. We allow 2^7 fp32
// epsilons (1.5e-5) of the tensor's scale (rel_error); the measured errors are below 1e-6.
#include <catch2/catch.hpp>
#include <cfloat>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "fd_check.h"
#include "fuyou/backend.h"
#include "fuyou/config.h"
#include "fuyou/decoder.h"
#include "fuyou/error.h"
#include "fuyou/generate.h"
#include "fuyou/model.h"
#include "fuyou/rng.h"
#include "hf_support.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;
using namespace fuyou::test;
using Catch::Matchers::Contains;

namespace {

constexpr double kTol = 128 * FLT_EPSILON;

ModelConfig family_config(const std::string& family, bool gqa, int seq_len) {
  ModelConfig m;
  m.family = family;
  m.n_layer = 2;
  m.n_head = 4;
  m.d_model = 32;
  m.d_ff = family == "llama" ? 40 : 128;
  m.vocab_size = 96;
  m.seq_len = seq_len;
  if (family == "llama") {
    m.n_kv_head = gqa ? 2 : 4;
    m.tie_embeddings = !gqa;
    m.qkv_bias = !gqa;
    m.rope_theta = 500.0f;  // small, so that positions far apart rotate differently
  }
  return m;
}

// Random weights: the initialisation plus noise on every element (norm weights and biases
// too, so that a mix-up of any two tensors shows).
std::vector<float> random_params(const ModelConfig& m, uint64_t seed) {
  const ParamLayout layout = make_gpt_layout(m);
  std::vector<float> p(layout.total);
  init_gpt_params(m, layout, p.data());
  Rng rng(seed);
  for (float& x : p) x += 0.05f * rng.normal();
  return p;
}

std::vector<int32_t> random_tokens(int n, int vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng.below(vocab));
  return t;
}

// The whole-sequence forward's logits (T, V) of one sequence.
std::vector<float> forward_logits(const ModelConfig& m, const std::vector<float>& params,
                                  const std::vector<int32_t>& tokens) {
  auto be = make_cpu_backend(2, 0);
  Transformer model(m, *be, 1);
  be->copy_to_device(model.params(), params.data(), params.size() * sizeof(float));
  model.forward(tokens.data(), nullptr);
  std::vector<float> out(static_cast<size_t>(m.seq_len) * m.vocab_size);
  model.copy_logits(out.data());
  return out;
}

}  // namespace

TEST_CASE("rope_forward_at equals rope_forward at the same positions", "[decode]") {
  auto be = make_cpu_backend(2, 0);
  const int T = 12, Hq = 4, Hkv = 2, D = 8, row = (Hq + 2 * Hkv) * D, pos0 = 7;
  auto whole = randn(static_cast<size_t>(T) * row, 3);
  std::vector<float> part(whole.begin() + pos0 * row, whole.end());
  be->rope_forward(whole.data(), 1, T, Hq, Hkv, D, default_rope_table(D, 10000.0f), nullptr);
  be->rope_forward_at(part.data(), T - pos0, pos0, Hq, Hkv, D, default_rope_table(D, 10000.0f));
  for (size_t i = 0; i < part.size(); ++i) REQUIRE(part[i] == whole[pos0 * row + i]);
}

TEST_CASE("attention_decode over a cache equals causal attention, grouped-query included",
          "[decode]") {
  auto be = make_cpu_backend(2, 0);
  for (int Hkv : {4, 2, 1}) {
    INFO("key/value heads " << Hkv);
    const int T = 19, Hq = 4, D = 8, C = Hq * D, KV = Hkv * D, row = C + 2 * KV;
    auto qkvc = randn(static_cast<size_t>(T) * row, 10 + Hkv);
    // Reference: the training path (k/v heads repeated, then the causal kernel).
    std::vector<float> qkv(static_cast<size_t>(T) * 3 * C), ref(static_cast<size_t>(T) * C),
        lse(Hq * T);
    std::vector<float> scratch(2 * T * T);
    be->repeat_kv_forward(qkv.data(), qkvc.data(), T, Hq, Hkv, D);
    be->attention_forward(ref.data(), lse.data(), scratch.data(), qkv.data(), 1, T, C, Hq, nullptr);
    // Decode: 6 rows at once, then one at a time, then the last 4 together.
    std::vector<float> kc(static_cast<size_t>(T) * KV), vc(static_cast<size_t>(T) * KV),
        out(ref.size());
    for (auto [pos, n] : std::vector<std::pair<int, int>>{{0, 6}, {6, 1}, {7, 1}, {8, 7}, {15, 4}})
      be->attention_decode(out.data() + pos * C, kc.data(), vc.data(), qkvc.data() + pos * row, n,
                           pos, Hq, Hkv, D);
    CHECK(rel_error(out.data(), ref.data(), out.size()) < kTol);
  }
}

TEST_CASE("the key/value-cache decoder gives the whole-sequence forward's logits", "[decode]") {
  struct Case {
    const char* family;
    bool gqa;
    bool qwen3 = false;  // heads wider than d_model / n_head, the q/k norm, llama3 rotary
  } cases[] = {
      {"gpt2", false}, {"opt", false}, {"llama", true}, {"llama", false}, {"llama", true, true}};
  for (const auto& c : cases) {
    INFO(c.family << (c.gqa ? " with grouped-query attention, untied head" : "")
                  << (c.qwen3 ? ", head_dim 12, q/k norm, llama3 rotary scaling" : ""));
    const int T = 24;
    ModelConfig m = family_config(c.family, c.gqa, T);
    if (c.qwen3) {
      m.head_dim = 12;
      m.qk_norm = true;
      m.rope_type = "llama3";
      m.rope_factor = 8;
      m.rope_original_context = 16;
      m.nope_layers.values = {1};  // SmolLM3's layers without rotary embeddings
    }
    auto params = random_params(m, 21);
    auto tokens = random_tokens(T, m.vocab_size, 22);
    auto ref = forward_logits(m, params, tokens);
    auto be = make_cpu_backend(2, 0);
    GptDecoder dec(m, *be, T);
    dec.set_params(params.data());
    // A prompt of 5, then one token per step: each step's logits are row pos of the forward's.
    const size_t V = m.vocab_size;
    double worst = 0;
    const std::vector<float>* logits = &dec.step(tokens.data(), 5);
    worst = std::max(worst, rel_error(logits->data(), ref.data() + 4 * V, V));
    for (int pos = 5; pos < T; ++pos) {
      logits = &dec.step(&tokens[pos], 1);
      worst = std::max(worst, rel_error(logits->data(), ref.data() + pos * V, V));
    }
    CHECK(worst < kTol);
    CHECK(dec.position() == T);
    CHECK_THROWS_WITH(dec.step(tokens.data(), 1), Contains("exceed its capacity of 24"));
  }
}

TEST_CASE("a prompt longer than one decoder chunk runs in several", "[decode]") {
  const int T = kDecoderChunkRows + 40;
  ModelConfig m = family_config("llama", true, T);
  auto params = random_params(m, 31);
  auto tokens = random_tokens(T, m.vocab_size, 32);
  auto ref = forward_logits(m, params, tokens);
  auto be = make_cpu_backend(2, 0);
  GptDecoder dec(m, *be, T);
  dec.set_params(params.data());
  const auto& logits = dec.step(tokens.data(), T - 1);
  CHECK(rel_error(logits.data(), ref.data() + static_cast<size_t>(T - 2) * m.vocab_size,
                  m.vocab_size) < kTol);
}

TEST_CASE("the decoder on bf16 tensors stays near fp32", "[decode]") {
  // bf16 keeps 8 bits of mantissa: each stored tensor is within 2^-9 relative of fp32; through
  // two layers and the head the logits stay within a few percent of their scale.
  const int T = 16;
  ModelConfig m = family_config("llama", true, T);
  auto params = random_params(m, 41);
  auto tokens = random_tokens(T, m.vocab_size, 42);
  auto ref = forward_logits(m, params, tokens);
  auto be = make_cpu_backend(2, 0);
  be->set_storage_type(ElemType::kBF16);
  GptDecoder dec(m, *be, T);
  dec.set_params(params.data());
  const auto& logits = dec.step(tokens.data(), T);
  CHECK(rel_error(logits.data(), ref.data() + static_cast<size_t>(T - 1) * m.vocab_size,
                  m.vocab_size) < 0.05);
}

TEST_CASE("a model larger than the device streams its layers, with the resident logits",
          "[decode]") {
  // The streamed decoder runs the same kernels on the same values, only from other buffers,
  // so its logits equal the resident decoder's bit for bit. cpu-streams queues compute and
  // copies apart, with random delays: a slot refilled before the layer reading it finished
  // would show as a mismatch.
  for (const char* family : {"gpt2", "llama"}) {
    for (bool queued : {false, true}) {
      INFO(family << (queued ? " on cpu-streams" : " on cpu"));
      const int T = 20;
      ModelConfig m = family_config(family, std::string(family) == "llama", T);
      m.n_layer = 5;
      auto params = random_params(m, 51);
      auto tokens = random_tokens(T, m.vocab_size, 52);
      auto ref_be = make_cpu_backend(2, 0);
      GptDecoder ref(m, *ref_be, T);
      ref.set_params(params.data());
      const uint64_t whole = decoder_device_bytes(m, T, sizeof(float));
      const uint64_t streamed = decoder_streaming_device_bytes(m, T, sizeof(float));
      REQUIRE(streamed < whole);
      // Room for the streaming form (plus the arena's alignment), not for the whole model.
      const uint64_t cap = streamed + 64 * 64;
      REQUIRE(cap < whole);
      auto be = queued ? make_cpu_stream_backend(2, cap, StreamOptions{0, 200, 7})
                       : make_cpu_backend(2, cap);
      CHECK_THROWS_WITH(GptDecoder(m, *be, T, LayerStreaming::kNever),
                        Contains("streaming the layers would need"));
      GptDecoder dec(m, *be, T);
      REQUIRE(dec.streaming());
      dec.set_params(params.data());
      int steps = 0;
      for (int pos = 0; pos < T; pos += pos == 0 ? 7 : 1, ++steps) {
        const int n = pos == 0 ? 7 : 1;
        const std::vector<float> want = ref.step(&tokens[pos], n);
        const std::vector<float>& got = dec.step(&tokens[pos], n);
        REQUIRE(got.size() == want.size());
        for (size_t i = 0; i < got.size(); ++i) REQUIRE(got[i] == want[i]);
      }
      CHECK(dec.stream_stats().bytes == steps * dec.streamed_bytes_per_step());
      CHECK(ref.stream_stats().bytes == 0);
    }
  }
}

TEST_CASE("a decoder larger than the device is refused with the sizes", "[decode]") {
  ModelConfig m = family_config("gpt2", false, 16);
  auto be = make_cpu_backend(2, 64 << 10);  // 64 KiB of "device memory"
  CHECK_THROWS_WITH(GptDecoder(m, *be, 16),
                    Contains("layers streamed") && Contains("key/value cache"));
  CHECK(be->memory().used == 0);
  auto big = make_cpu_backend(2, 0);
  CHECK_THROWS_WITH(GptDecoder(m, *big, 17), Contains("position table has 16"));
}

TEST_CASE("sampling: greedy, temperature, top-p, seeded", "[decode]") {
  Rng rng(1);
  std::vector<float> logits = {0.5f, 2.0f, 2.0f, -1.0f};
  CHECK(sample_token(logits, {}, rng) == 1);  // the first of the largest, as torch.argmax
  SamplingOptions narrow{1.0, 0.1};
  for (int i = 0; i < 50; ++i)
    CHECK(sample_token(logits, narrow, rng) == 1);  // top-p keeps one token
  // Two tokens with probabilities 1/4 and 3/4 at temperature 1: the share of the second over
  // n draws is within 5 standard deviations (sqrt(p (1 - p) / n)) of 3/4.
  std::vector<float> two = {0.0f, std::log(3.0f)};
  const int n = 20000;
  int second = 0;
  for (int i = 0; i < n; ++i) second += sample_token(two, {1.0, 1.0}, rng) == 1;
  CHECK(std::fabs(second / double(n) - 0.75) < 5 * std::sqrt(0.75 * 0.25 / n));
  // Temperature 2 flattens: p = 3^(1/2) / (1 + 3^(1/2)).
  second = 0;
  for (int i = 0; i < n; ++i) second += sample_token(two, {2.0, 1.0}, rng) == 1;
  const double p = std::sqrt(3.0) / (1 + std::sqrt(3.0));
  CHECK(std::fabs(second / double(n) - p) < 5 * std::sqrt(p * (1 - p) / n));
  // The same seed draws the same tokens.
  Rng a(7), b(7);
  for (int i = 0; i < 20; ++i)
    CHECK(sample_token(logits, {1.5, 0.9}, a) == sample_token(logits, {1.5, 0.9}, b));
}

TEST_CASE("prompts get the special tokens transformers' tokenizer adds", "[decode]") {
  TempDir tmp("codec");
  const fs::path d = tmp.path;
  fs::copy_file(hf_fixture("tok_llama2.json"), d / "tokenizer.json");
  ModelConfig llama = family_config("llama", true, 16);
  llama.vocab_size = 676;
  ModelFiles files;
  files.dir = tmp.path;
  files.model_type = "llama";
  files.hf_config = R"({"model_type": "llama", "bos_token_id": 1, "eos_token_id": 2})";
  const Tokenizer tok = Tokenizer::from_file(hf_fixture("tok_llama2.json"));
  const std::vector<int32_t> plain = tok.encode("the end");

  // Llama's tokenizer without tokenizer_config.json: BOS, as LlamaTokenizerFast's default.
  TextCodec c = TextCodec::for_model(files, llama);
  std::vector<int32_t> want = {1};
  want.insert(want.end(), plain.begin(), plain.end());
  CHECK(c.encode_prompt("the end") == want);
  CHECK(c.stop_ids() == std::set<int32_t>{2});
  // add_bos_token false, add_eos_token true.
  write_all(d / "tokenizer_config.json",
            R"({"tokenizer_class": "LlamaTokenizer", "add_bos_token": false,
                                            "add_eos_token": true, "eos_token": "</s>"})");
  want = plain;
  want.push_back(2);
  CHECK(TextCodec::for_model(files, llama).encode_prompt("the end") == want);
  // Another class: tokenizer.json's TemplateProcessing decides (here inside a Sequence, as
  // Llama 3's).
  write_all(d / "tokenizer_config.json", R"({"tokenizer_class": "PreTrainedTokenizerFast"})");
  nlohmann::json tj = nlohmann::json::parse(read_all(d / "tokenizer.json"));
  tj["post_processor"] = {
      {"type", "Sequence"},
      {"processors",
       {{{"type", "ByteLevel"}},
        {{"type", "TemplateProcessing"},
         {"single",
          {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
           {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
         {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}}}};
  write_all(d / "tokenizer.json", tj.dump());
  want = {1};
  want.insert(want.end(), plain.begin(), plain.end());
  CHECK(TextCodec::for_model(files, llama).encode_prompt("the end") == want);
  // Decoding skips special tokens; generation_config.json's eos ids replace config.json's.
  write_all(d / "generation_config.json", R"({"eos_token_id": [2, 0]})");
  TextCodec g = TextCodec::for_model(files, llama);
  CHECK(g.stop_ids() == std::set<int32_t>{0, 2});
  std::vector<int32_t> with_specials = {1};
  with_specials.insert(with_specials.end(), plain.begin(), plain.end());
  with_specials.push_back(2);
  CHECK(g.decode(with_specials) == "the end");
}

TEST_CASE("decoded text cleans up spaces as transformers does when asked", "[decode]") {
  TempDir tmp("cleanup");
  const fs::path d = tmp.path;
  fs::copy_file(hf_fixture("tok_bytelevel.json"), d / "tokenizer.json");
  ModelConfig gpt2 = family_config("gpt2", false, 16);
  gpt2.vocab_size = 512;
  ModelFiles files;
  files.dir = tmp.path;
  files.model_type = "gpt2";
  const Tokenizer tok = Tokenizer::from_file(hf_fixture("tok_bytelevel.json"));
  const std::string text = "it 's done , is n't it ? yes !";
  // GPT-2's tokenizer class cleans up by default (transformers' clean_up_tokenization).
  CHECK(TextCodec::for_model(files, gpt2).decode(tok.encode(text)) == "it's done, isn't it? yes!");
  write_all(d / "tokenizer_config.json", R"({"clean_up_tokenization_spaces": false})");
  CHECK(TextCodec::for_model(files, gpt2).decode(tok.encode(text)) == text);
  // No tokenizer.json: byte-level for a 256-token model, refused for any other.
  fs::remove(d / "tokenizer.json");
  CHECK_THROWS_WITH(TextCodec::for_model(files, gpt2), Contains("--tokenizer"));
  gpt2.vocab_size = 256;
  CHECK(TextCodec::for_model(files, gpt2).encode_prompt("ab") == std::vector<int32_t>{'a', 'b'});
}

TEST_CASE(
    "a run's data.chat_template_kwargs render its chat prompts, --chat-template-kwargs over them",
    "[decode][chat]") {
  TempDir tmp("codec-kwargs");
  const fs::path d = tmp.path;
  fs::copy_file(hf_fixture("tok_bytelevel.json"), d / "tokenizer.json");
  nlohmann::json tc = {
      {"tokenizer_class", "PreTrainedTokenizerFast"},
      {"chat_template",
       "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}"
       "{% if enable_thinking is defined and enable_thinking is false %} quiet{% else %} "
       "think{% endif %}{% endif %}"}};
  write_all(d / "tokenizer_config.json", tc.dump());
  ModelConfig gpt2 = family_config("gpt2", false, 16);
  gpt2.vocab_size = 512;
  const Tokenizer tok = Tokenizer::from_file(hf_fixture("tok_bytelevel.json"));
  const std::string messages = R"([{"role": "user", "content": "hi"}])";
  auto rendered = [&](const TextCodec& c) {
    return tok.decode(c.encode_chat_messages(messages, "--chat"));
  };
  // A directory without config.yaml: no variables.
  CHECK(rendered(TextCodec::for_model(find_model_files(tmp.path, gpt2), gpt2)) == "hi think");
  // A run directory's config.yaml: its variables, as its chat data was rendered with.
  Config cfg = parse_config("data: {chat_template_kwargs: {enable_thinking: false}}", "x");
  cfg.model = gpt2;
  write_all(d / "config.yaml", config_to_yaml(cfg));
  const ModelFiles files = find_model_files(tmp.path, gpt2);
  CHECK(files.chat_template_kwargs == R"({"enable_thinking":false})");
  TextCodec c = TextCodec::for_model(files, gpt2);
  CHECK(rendered(c) == "hi quiet");
  c.set_chat_template_kwargs(R"({"enable_thinking": true})");
  CHECK(rendered(c) == "hi think");
}
