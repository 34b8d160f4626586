// Hugging Face checkpoints: fixtures written by tests/reference/make_hf_fixtures.py with
// transformers' save_pretrained (fp32 single file, bf16 sharded, f16 without the
// "transformer." prefix) and transformers' logits for a batch. Converted models must give
// those logits; HF -> engine -> HF must give the same bytes; malformed input must be refused
// with the file and the field, and leave no output behind.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "fuyou/backend.h"
#include "fuyou/error.h"
#include "fuyou/hf_checkpoint.h"
#include "fuyou/model.h"
#include "fuyou/rng.h"
#include "fuyou/safetensors.h"
#include "hf_support.h"
#include "src/formats/safetensors_stream.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;
using namespace fuyou::test;
using Catch::Matchers::Contains;

namespace {

std::string fixture(const std::string& rel) { return hf_fixture(rel); }

// Copies a fixture model directory so a test can damage it.
std::string copy_fixture(const std::string& name, const std::string& dst_root) {
  fs::path dst = fs::path(dst_root) / name;
  fs::copy(fixture(name), dst, fs::copy_options::recursive);
  for (auto& e : fs::directory_iterator(dst))
    fs::permissions(e.path(), fs::perms::owner_all, fs::perm_options::add);
  return dst.string();
}

std::string strip_prefix(const std::string& n) {
  return n.rfind("transformer.", 0) == 0 ? n.substr(12) : n;
}

// Runs the engine's forward on the fixture batch and compares with transformers' logits.
void check_logits(const std::string& ckpt, const std::string& logits_file) {
  double err = engine_logits_error(ckpt, logits_file);
  INFO(ckpt << ": logits relative error " << err);
  // The bound for fp32: 1e-4 relative (the CPU backend's exp_fast and a different
  // summation order in the GEMMs put us near 1e-6).
  CHECK(err < 1e-4);
}

const char* kVariants[] = {"gpt2_f32", "gpt2_bf16_sharded", "gpt2_f16_noprefix"};

}  // namespace

TEST_CASE("converted Hugging Face GPT-2 checkpoints give transformers' logits", "[hf]") {
  TempDir tmp("logits");
  const std::string& dir = tmp.path;
  for (const char* v : kVariants) {
    INFO("variant " << v);
    std::string ckpt = dir + "/" + v;
    ConvertOptions opts;
    size_t calls = 0;
    opts.progress = [&](size_t i, size_t n, const std::string&) {
      CHECK(i == calls++);
      CHECK(n == 2 + 12 * 2 + 2);
    };
    ConvertResult r = convert_hf_to_engine(fixture(v), ckpt, opts);
    CHECK(calls == r.tensors);
    CHECK(r.model.n_layer == 2);
    CHECK(r.model.d_model == 64);
    CHECK(r.model.d_ff == 256);
    CHECK(r.model.seq_len == 32);
    CHECK(fs::exists(ckpt + "/config.yaml"));
    CHECK(fs::exists(ckpt + "/model.safetensors"));
    CHECK(fs::exists(ckpt + "/hf_config.json"));
    check_logits(ckpt, fixture(std::string("logits_") + v + ".safetensors"));
    // Nothing but the checkpoint is left beside it.
    for (auto& e : fs::directory_iterator(dir))
      CHECK(e.path().filename().string().find(".partial-") == std::string::npos);
  }
  CHECK(fs::exists(dir + "/gpt2_f32/tokenizer.json"));
}

TEST_CASE("HF -> engine -> HF gives bit-identical tensors", "[hf]") {
  TempDir tmp("roundtrip");
  const std::string& dir = tmp.path;
  struct Case {
    const char* variant;
    StDtype dtype;
    uint64_t shard;
  } cases[] = {{"gpt2_f32", StDtype::kF32, 5'000'000'000ull},
               {"gpt2_bf16_sharded", StDtype::kBF16, 60'000},
               {"gpt2_f16_noprefix", StDtype::kF16, 100'000}};
  for (const auto& c : cases) {
    INFO("variant " << c.variant);
    std::string ckpt = dir + "/" + c.variant + "_engine", out = dir + "/" + c.variant + "_hf";
    convert_hf_to_engine(fixture(c.variant), ckpt, {});
    ConvertOptions opts;
    opts.dtype = c.dtype;
    opts.max_shard_bytes = c.shard;
    ConvertResult r = convert_engine_to_hf(ckpt, out, opts);
    check_same_tensors(fixture(c.variant), out,
                       [](const std::string& n) { return "transformer." + strip_prefix(n); });
    // The config survives too: the same model, and fields the engine does not model kept.
    ModelConfig a = load_hf_config(fixture(c.variant) + "/config.json");
    ModelConfig b = load_hf_config(out + "/config.json");
    CHECK(engine_config_yaml(a) == engine_config_yaml(b));
    auto j = nlohmann::json::parse(read_all(out + "/config.json"));
    CHECK(j["architectures"] == nlohmann::json::array({"GPT2LMHeadModel"}));
    CHECK(j["bos_token_id"] == 0);
    CHECK(j["torch_dtype"] == (c.dtype == StDtype::kF32    ? "float32"
                               : c.dtype == StDtype::kBF16 ? "bfloat16"
                                                           : "float16"));
    if (c.shard < 1'000'000) {
      CHECK(fs::exists(out + "/model.safetensors.index.json"));
      CHECK_FALSE(fs::exists(out + "/model.safetensors"));
      auto index = nlohmann::json::parse(read_all(out + "/model.safetensors.index.json"));
      CHECK(index["weight_map"].size() == all_tensors(fixture(c.variant)).size());
      CHECK(index["metadata"]["total_size"] == r.bytes);
      // Every shard but a lone oversized tensor's stays under the limit.
      for (const auto& f : r.files)
        if (f.find("-of-") != std::string::npos) {
          SafetensorsReader s(out + "/" + f);
          if (s.tensors().size() > 1) {
            uint64_t bytes = 0;
            for (const auto& t : s.tensors()) bytes += t.end - t.begin;
            CHECK(bytes <= c.shard);
          }
          CHECK(s.metadata().at("format") == "pt");
        }
    } else {
      CHECK(SafetensorsReader(out + "/model.safetensors").metadata().at("format") == "pt");
    }
  }
  CHECK(fs::exists(dir + "/gpt2_f32_hf/tokenizer.json"));
  CHECK(read_all(dir + "/gpt2_f32_hf/tokenizer.json") ==
        read_all(fixture("gpt2_f32/tokenizer.json")));
}

TEST_CASE("engine checkpoints and fuyou-train run directories export to HF and back", "[hf]") {
  TempDir tmp("engine");
  const std::string& dir = tmp.path;
  // A run directory as fuyou-train leaves it: config.yaml and model.safetensors with engine
  // names and the config in the metadata.
  Config cfg = parse_config(
      "model: {n_layer: 2, n_head: 2, d_model: 16, d_ff: 40, vocab_size: 50, seq_len: 8}\n"
      "runtime: {seed: 5}\n",
      "test");
  ParamLayout layout = make_gpt_layout(cfg.model);
  std::vector<float> params(layout.total, 0.0f);
  init_gpt_params(cfg.model, layout, params.data());
  fs::create_directories(dir + "/run");
  write_all(dir + "/run/config.yaml", config_to_yaml(cfg));
  SafetensorsWriter w;
  w.set_metadata("format", "fuyou");
  w.set_metadata("config", config_to_yaml(cfg));
  for (const TensorSpec& t : layout.tensors)
    w.add(t.name, StDtype::kF32, t.shape, params.data() + t.offset);
  w.write(dir + "/run/model.safetensors");

  ConvertOptions small;
  small.max_shard_bytes = 4000;
  ConvertResult r = convert_engine_to_hf(dir + "/run", dir + "/hf", small);
  CHECK(r.files.size() > 3);
  auto j = nlohmann::json::parse(read_all(dir + "/hf/config.json"));
  CHECK(j["n_inner"] == 40);
  CHECK(j["model_type"] == "gpt2");
  CHECK(j["n_positions"] == 8);
  // The HF shapes are the Conv1D ones.
  auto hf = all_tensors(dir + "/hf");
  CHECK(hf.at("transformer.h.1.mlp.c_fc.weight").first.shape == std::vector<int64_t>{16, 40});
  CHECK(hf.at("transformer.h.1.mlp.c_proj.weight").first.shape == std::vector<int64_t>{40, 16});
  CHECK_FALSE(hf.count("lm_head.weight"));

  // Back again, sharded engine checkpoint, then loaded: the same fp32 array, bit for bit.
  convert_hf_to_engine(dir + "/hf", dir + "/ckpt", small);
  CHECK(fs::exists(dir + "/ckpt/model.safetensors.index.json"));
  LoadedCheckpoint back = load_engine_checkpoint(dir + "/ckpt");
  REQUIRE(back.params.size() == params.size());
  CHECK(std::memcmp(back.params.data(), params.data(), params.size() * sizeof(float)) == 0);
  // The run's model.safetensors alone works too (config from its metadata).
  LoadedCheckpoint file = load_engine_checkpoint(dir + "/run/model.safetensors");
  CHECK(std::memcmp(file.params.data(), params.data(), params.size() * sizeof(float)) == 0);

  // A transposed tensor wider than one conversion chunk takes the column-block path.
  Config wide = parse_config(
      "model: {n_layer: 1, n_head: 1, d_model: 8, d_ff: 600000, vocab_size: 4, seq_len: 2}", "t");
  ParamLayout wl = make_gpt_layout(wide.model);
  std::vector<float> wp(wl.total, 0.0f);
  Rng rng(9);
  for (float& x : wp) x = rng.normal();
  fs::create_directories(dir + "/wide");
  write_all(dir + "/wide/config.yaml", engine_config_yaml(wide.model));
  SafetensorsWriter ww;
  for (const TensorSpec& t : wl.tensors)
    ww.add(t.name, StDtype::kF32, t.shape, wp.data() + t.offset);
  ww.write(dir + "/wide/model.safetensors");
  convert_engine_to_hf(dir + "/wide", dir + "/wide_hf", {});
  convert_hf_to_engine(dir + "/wide_hf", dir + "/wide_back", {});
  LoadedCheckpoint wb = load_engine_checkpoint(dir + "/wide_back");
  for (const TensorSpec& t : wl.tensors)
    CHECK(std::memcmp(wb.params.data() + t.offset, wp.data() + t.offset, t.numel * 4) == 0);
  auto whf = all_tensors(dir + "/wide_hf");
  const auto& fc = whf.at("transformer.h.0.mlp.c_fc.weight");
  const float* fcp = reinterpret_cast<const float*>(fc.second.data());
  const TensorSpec& fcs = wl.tensor("h.0.mlp.c_fc.weight");  // (F, C); HF (C, F)
  CHECK(fcp[3 * 600000 + 599999] == wp[fcs.offset + 599999 * 8 + 3]);
}

TEST_CASE("output directories are never overwritten", "[hf]") {
  TempDir tmp("out");
  const std::string& dir = tmp.path;
  fs::create_directories(dir + "/full");
  write_all(dir + "/full/keep.txt", "data");
  CHECK_THROWS_WITH(convert_hf_to_engine(fixture("gpt2_f32"), dir + "/full", {}),
                    Contains("not empty") && Contains("full"));
  CHECK(read_all(dir + "/full/keep.txt") == "data");
  fs::create_directories(dir + "/empty");
  convert_hf_to_engine(fixture("gpt2_f32"), dir + "/empty/", {});
  CHECK(fs::exists(dir + "/empty/model.safetensors"));
  CHECK_THROWS_WITH(convert_engine_to_hf(dir + "/empty", dir + "/empty", {}),
                    Contains("not empty"));
}

TEST_CASE("malformed Hugging Face input is refused with the file and the field", "[hf]") {
  TempDir tmp("bad");
  const std::string& dir = tmp.path;
  int n = 0;
  // Each case damages a fresh copy, converts, and expects an error naming `file_part` and
  // `what`, with no output directory left behind.
  auto refuse = [&](const std::string& variant, const std::function<void(const fs::path&)>& damage,
                    const std::string& file_part, const std::string& what) {
    std::string root = dir + "/" + std::to_string(n++);
    fs::create_directories(root);
    fs::path src = copy_fixture(variant, root);
    damage(src);
    INFO("case " << n << ": expecting '" << what << "'");
    CHECK_THROWS_WITH(convert_hf_to_engine(src.string(), root + "/out", {}),
                      Contains(file_part) && Contains(what));
    CHECK_FALSE(fs::exists(root + "/out"));
    for (auto& e : fs::directory_iterator(root)) CHECK(e.path().filename() == variant);
  };
  auto edit_config = [](const std::function<void(nlohmann::json&)>& f) {
    return [f](const fs::path& d) {
      auto j = nlohmann::json::parse(read_all(d / "config.json"));
      f(j);
      write_all(d / "config.json", j.dump());
    };
  };
  // Rewrites model.safetensors' header through `f`, keeping the data.
  auto edit_header = [](const std::function<void(nlohmann::json&)>& f) {
    return [f](const fs::path& d) {
      std::string all = read_all(d / "model.safetensors");
      uint64_t len;
      std::memcpy(&len, all.data(), 8);
      auto h = nlohmann::json::parse(all.substr(8, len));
      f(h);
      std::string nh = h.dump();
      uint64_t nl = nh.size();
      std::string out(8, '\0');
      std::memcpy(out.data(), &nl, 8);
      write_all(d / "model.safetensors", out + nh + all.substr(8 + len));
    };
  };
  const std::string st = "model.safetensors";
  refuse(
      "gpt2_f32",
      [](const fs::path& d) {
        std::string all = read_all(d / "model.safetensors");
        uint64_t huge = all.size();
        std::memcpy(all.data(), &huge, 8);
        write_all(d / "model.safetensors", all);
      },
      st, "runs past the end");
  refuse(
      "gpt2_f32",
      [](const fs::path& d) {
        fs::resize_file(d / "model.safetensors", fs::file_size(d / "model.safetensors") - 100);
      },
      st, "outside the");
  refuse("gpt2_f32", edit_header([](nlohmann::json& h) {
           h["transformer.wpe.weight"]["data_offsets"] =
               h["transformer.wte.weight"]["data_offsets"];
           h["transformer.wpe.weight"]["shape"] = h["transformer.wte.weight"]["shape"];
         }),
         st, "overlap");
  refuse("gpt2_f32", edit_header([](nlohmann::json& h) {
           auto& o = h["transformer.ln_f.bias"]["data_offsets"];
           o[1] = o[1].get<uint64_t>() + 1'000'000;
         }),
         st, "outside the");
  refuse("gpt2_f32",
         edit_header([](nlohmann::json& h) { h["transformer.ln_f.bias"]["dtype"] = "I32"; }), st,
         "'transformer.ln_f.bias' has dtype I32");
  refuse("gpt2_f32", edit_header([](nlohmann::json& h) {
           h["transformer.ln_f.bias"]["shape"] = {8, 8};
         }),
         st, "'transformer.ln_f.bias' has shape [8, 8] but the config needs [64]");
  refuse("gpt2_f32", edit_header([](nlohmann::json& h) {
           // Renamed, not erased: an erased entry would leave its bytes as a gap.
           h["transformer.h.1.mlp.c_fc.bias_x"] = h["transformer.h.1.mlp.c_fc.bias"];
           h.erase("transformer.h.1.mlp.c_fc.bias");
         }),
         st, "missing tensor 'transformer.h.1.mlp.c_fc.bias'");
  refuse("gpt2_f32",
         edit_header([](nlohmann::json& h) { h.erase("transformer.h.1.mlp.c_fc.bias"); }), st,
         "belong to no tensor (gap before");
  refuse("gpt2_f32", edit_header([](nlohmann::json& h) {
           h["transformer.h.2.ln_1.weight"] = {
               {"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {0, 0}}};
         }),
         st, "'transformer.h.2.ln_1.weight' is not part of a GPT-2 model");
  refuse("gpt2_f32", edit_config([](nlohmann::json& j) { j["n_inner"] = 128; }), st, "[64, 128]");
  refuse("gpt2_f32", edit_config([](nlohmann::json& j) { j.erase("n_embd"); }), "config.json",
         "field 'n_embd': missing");
  refuse("gpt2_f32", edit_config([](nlohmann::json& j) { j["n_layer"] = "two"; }), "config.json",
         "field 'n_layer': expected an integer");
  refuse("gpt2_f32", edit_config([](nlohmann::json& j) { j["n_head"] = 5; }), "config.json",
         "field 'n_embd'");
  refuse("gpt2_f32", edit_config([](nlohmann::json& j) { j["n_layer"] = -1; }), "config.json",
         "field 'n_layer': value -1");
  refuse("gpt2_f32", edit_config([](nlohmann::json& j) { j["vocab_size"] = 1e20; }), "config.json",
         "field 'vocab_size'");
  refuse("gpt2_f32", edit_config([](nlohmann::json& j) { j["activation_function"] = "relu"; }),
         "config.json", "field 'activation_function'");
  refuse("gpt2_f32", edit_config([](nlohmann::json& j) { j["layer_norm_epsilon"] = 1e-6; }),
         "config.json", "field 'layer_norm_epsilon'");
  refuse("gpt2_f32", edit_config([](nlohmann::json& j) { j["model_type"] = "gemma2"; }),
         "config.json", "field 'model_type': 'gemma2'");
  // A supported model type whose fields are missing: the first one is named.
  refuse("gpt2_f32", edit_config([](nlohmann::json& j) { j["model_type"] = "llama"; }),
         "config.json", "field 'num_hidden_layers': missing");
  refuse("gpt2_f32", edit_config([](nlohmann::json& j) { j["tie_word_embeddings"] = false; }),
         "config.json", "field 'tie_word_embeddings'");
  refuse(
      "gpt2_f32",
      [](const fs::path& d) { write_all(d / "config.json", "{\"model_type\": \"gpt2\", "); },
      "config.json", "not valid JSON");
  refuse(
      "gpt2_f32", [](const fs::path& d) { fs::remove(d / "config.json"); }, "config.json",
      "cannot open");
  refuse(
      "gpt2_f32", [](const fs::path& d) { fs::remove(d / "model.safetensors"); }, "gpt2_f32",
      "no model.safetensors");
  refuse(
      "gpt2_bf16_sharded",
      [](const fs::path& d) { fs::remove(d / "model-00003-of-00006.safetensors"); },
      "model-00003-of-00006.safetensors", "missing shard");
  refuse(
      "gpt2_bf16_sharded",
      [](const fs::path& d) {
        auto j = nlohmann::json::parse(read_all(d / "model.safetensors.index.json"));
        j["weight_map"]["transformer.wte.weight"] = "../../etc/passwd";
        write_all(d / "model.safetensors.index.json", j.dump());
      },
      "model.safetensors.index.json", "not a plain file name");
  refuse(
      "gpt2_bf16_sharded",
      [](const fs::path& d) {
        auto j = nlohmann::json::parse(read_all(d / "model.safetensors.index.json"));
        j["weight_map"]["transformer.wte.weight"] = "model-00006-of-00006.safetensors";
        write_all(d / "model.safetensors.index.json", j.dump());
      },
      "model-00006-of-00006.safetensors", "has no tensor 'transformer.wte.weight'");
  refuse(
      "gpt2_bf16_sharded",
      [](const fs::path& d) { write_all(d / "model.safetensors.index.json", "[1, 2]"); },
      "model.safetensors.index.json", "must be a JSON object");
  refuse(
      "gpt2_bf16_sharded",
      [](const fs::path& d) { fs::resize_file(d / "model-00002-of-00006.safetensors", 20); },
      "model-00002-of-00006.safetensors", "runs past the end");
}

TEST_CASE("the config.json reader survives random mutation", "[hf]") {
  const std::string good = read_all(fixture("gpt2_f32/config.json"));
  REQUIRE_NOTHROW(parse_hf_config(good, "config.json"));
  Rng rng(11);
  const std::string alphabet = "{}[]\":,0123456789.-eE+ truefalsnul\\\n";
  int accepted = 0, refused = 0;
  for (int i = 0; i < 5000; ++i) {
    std::string m = good;
    int edits = 1 + static_cast<int>(rng.below(5));
    for (int e = 0; e < edits && !m.empty(); ++e) {
      size_t at = rng.below(m.size());
      switch (rng.below(5)) {
        case 0:
          m[at] = static_cast<char>(rng.below(256));
          break;
        case 1:
          m[at] = alphabet[rng.below(alphabet.size())];
          break;
        case 2:
          m.erase(at, 1 + rng.below(12));
          break;
        case 3:
          m.insert(at, 1, alphabet[rng.below(alphabet.size())]);
          break;
        case 4:
          m.insert(at, m.substr(rng.below(m.size()), rng.below(20)));
          break;
      }
    }
    try {
      ModelConfig c = parse_hf_config(m, "config.json");
      // Whatever is accepted must be a model the engine can lay out.
      CHECK(c.n_layer >= 1);
      CHECK(c.d_model % c.n_head == 0);
      ++accepted;
    } catch (const Error& e) {
      CHECK_THAT(e.what(), Contains("config.json"));
      ++refused;
    }
  }
  CHECK(refused > 1000);
  CHECK(accepted > 10);
}
