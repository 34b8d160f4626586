// Hugging Face fixture helpers shared by the conversion tests (tests/reference/fixtures/hf,
// written by tests/reference/make_hf_fixtures.py).
#pragma once

#include <catch2/catch.hpp>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/hf_checkpoint.h"
#include "fuyou/model.h"
#include "fuyou/safetensors.h"
#include "src/formats/safetensors_stream.h"
#include "test_support.h"

namespace fuyou::test {

inline std::string hf_fixture(const std::string& rel) {
  return source_path("tests/reference/fixtures/hf/" + rel);
}

// The engine's fp32 forward of a converted checkpoint on the fixture batch, against
// transformers' logits: max |diff| / max |reference|.
inline double engine_logits_error(const std::string& ckpt, const std::string& logits_file) {
  LoadedCheckpoint c = load_engine_checkpoint(ckpt);
  SafetensorsReader ref(logits_file);
  auto tokens = ref.read_i32("tokens");
  const int T = c.model.seq_len, V = c.model.vocab_size;
  const int B = static_cast<int>(tokens.size()) / T;
  REQUIRE(static_cast<size_t>(B) * T == tokens.size());
  auto logits = ref.read_f32("logits", {B, T, V});
  auto be = make_cpu_backend(2, 0);
  Transformer model(c.model, *be, B);
  be->copy_to_device(model.params(), c.params.data(), c.params.size() * sizeof(float));
  model.forward(tokens.data(), nullptr);
  std::vector<float> got(static_cast<size_t>(B) * T * V);
  model.copy_logits(got.data());
  be->synchronize();
  return rel_error(got.data(), logits.data(), got.size());
}

// Tensor name -> (header entry, raw bytes), over a single file or an index with shards.
inline std::map<std::string, std::pair<StTensorInfo, std::string>> all_tensors(
    const std::string& dir) {
  TensorSet set = TensorSet::open_dir(dir);
  std::map<std::string, std::pair<StTensorInfo, std::string>> out;
  for (const auto& n : set.names()) {
    const StTensorInfo& t = set.info(n);
    std::string bytes(t.end - t.begin, '\0');
    set.file(n).read(t, 0, bytes.data(), bytes.size());
    out[n] = {t, bytes};
  }
  return out;
}

// Every tensor of the source directory is in the output under out_name(name), with the same
// dtype, shape and bytes, and the output has no others.
inline void check_same_tensors(const std::string& src_dir, const std::string& out_dir,
                               const std::function<std::string(const std::string&)>& out_name) {
  auto before = all_tensors(src_dir);
  auto after = all_tensors(out_dir);
  CHECK(after.size() == before.size());
  for (const auto& [name, t] : before) {
    INFO("tensor " << name);
    auto it = after.find(out_name(name));
    REQUIRE(it != after.end());
    CHECK(it->second.first.dtype == t.first.dtype);
    CHECK(it->second.first.shape == t.first.shape);
    CHECK(it->second.second == t.second);
  }
}

}  // namespace fuyou::test
