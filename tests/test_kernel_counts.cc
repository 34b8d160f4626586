// The kernels a Llama layer calls, counted: a backend that forwards every call to the CPU
// backend and counts the layer kernels by name (the FUYOU_LAYER_KERNELS list, so no kernel can
// be missed), run on a model of one layer and of two; the difference is one layer's calls.
// The table pins them: a change that adds a kernel call to every layer (on a GPU, at least one
// more launch a layer, a pass over its activations) fails here and has to say so by updating
// it. These are Backend calls; the CUDA backend launches one kernel for most, and more for the
// norms' backward (the input gradient, the weight gradient's partial sums, their sum: 3).
#include <catch2/catch.hpp>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/config.h"
#include "fuyou/model.h"

using namespace fuyou;

namespace {

class CountingBackend final : public Backend {
 public:
  explicit CountingBackend(std::unique_ptr<Backend> inner) : in_(std::move(inner)) {}
  std::map<std::string, int> counts;

  BackendKind kind() const override { return in_->kind(); }
  std::string name() const override { return "counting " + in_->name(); }
  int threads() const override { return in_->threads(); }
  bool device_is_host_memory() const override { return in_->device_is_host_memory(); }
  void set_matmul_precision(MatmulPrecision p) override { in_->set_matmul_precision(p); }
  MatmulPrecision matmul_precision() const override { return in_->matmul_precision(); }
  void set_storage_type(ElemType t) override { in_->set_storage_type(t); }
  ElemType storage_type() const override { return in_->storage_type(); }
  void* alloc(size_t bytes, const std::string& what) override { return in_->alloc(bytes, what); }
  void free(void* p) override { in_->free(p); }
  MemoryStats memory() const override { return in_->memory(); }
  void copy_to_device(void* d, const void* s, size_t n) override { in_->copy_to_device(d, s, n); }
  void copy_to_host(void* d, const void* s, size_t n) override { in_->copy_to_host(d, s, n); }
  void zero(void* p, size_t n) override { in_->zero(p, n); }
  void synchronize() override { in_->synchronize(); }

#define FY_KERNEL_COUNT(name, params, args) \
  void name params override {               \
    ++counts[#name];                        \
    in_->name args;                         \
  }
  FUYOU_LAYER_KERNELS(FY_KERNEL_COUNT)
#undef FY_KERNEL_COUNT

 private:
  std::unique_ptr<Backend> in_;
};

// Kernel calls of one forward and backward of a Llama-shaped model of n_layer layers.
std::map<std::string, int> llama_calls(int n_layer, bool qk_norm) {
  ModelConfig m;
  m.family = "llama";
  m.n_layer = n_layer;
  m.n_head = 4;
  m.n_kv_head = 2;
  m.d_model = 32;
  m.d_ff = 48;
  m.vocab_size = 64;
  m.seq_len = 8;
  m.tie_embeddings = false;
  m.qk_norm = qk_norm;
  CountingBackend be(make_cpu_backend(1, 0));
  const int B = 2, N = B * m.seq_len;
  Transformer model(m, be, B);
  std::vector<float> p(model.layout().total);
  init_gpt_params(m, model.layout(), p.data());
  be.copy_to_device(model.params(), p.data(), 4 * p.size());
  std::vector<int32_t> in(N), tg(N);
  for (int i = 0; i < N; ++i) in[i] = i % 64, tg[i] = (7 * i) % 64;
  be.counts.clear();
  model.forward(in.data(), tg.data());
  model.zero_grads();
  model.backward(1.0f / N);
  return be.counts;
}

std::map<std::string, int> per_layer(bool qk_norm) {
  const auto one = llama_calls(1, qk_norm), two = llama_calls(2, qk_norm);
  std::map<std::string, int> d;
  for (const auto& [k, v] : two) {
    const auto it = one.find(k);
    const int n = v - (it == one.end() ? 0 : it->second);
    if (n) d[k] = n;
  }
  return d;
}

}  // namespace

TEST_CASE("a Llama layer's forward and backward call the kernels the table pins",
          "[families][counts]") {
  // Forward: the input norm, the q/k/v projection, RoPE, the repeated k/v heads, attention, its
  // projection, the residual add with the post-attention norm in one pass, the MLP's gate|up
  // projection, SwiGLU, its down projection and the second residual add, a pass of its own
  // (the next layer's input norm does not take it in: a fusion not yet made). Backward: each
  // in reverse, the norms' backward adding into the residual stream's gradient.
  const std::map<std::string, int> llama = {
      {"rmsnorm_forward", 1},
      {"residual_rmsnorm_forward", 1},
      {"add", 1},
      {"matmul_forward", 4},
      {"matmul_backward", 4},
      {"rmsnorm_backward", 2},
      {"rope_forward", 1},
      {"rope_backward", 1},
      {"repeat_kv_forward", 1},
      {"repeat_kv_backward", 1},
      {"attention_forward", 1},
      {"attention_backward", 1},
      {"swiglu_forward", 1},
      {"swiglu_backward", 1},
  };
  auto listing = [](const std::map<std::string, int>& m) {
    std::string s;
    for (const auto& [k, v] : m) s += k + " " + std::to_string(v) + "; ";
    return s;
  };
  const auto got = per_layer(false);
  CHECK(listing(got) == listing(llama));
  // Qwen3's q/k norm adds its forward and backward, nothing else.
  auto qwen = llama;
  qwen["qk_norm_forward"] = 1;
  qwen["qk_norm_backward"] = 1;
  CHECK(listing(per_layer(true)) == listing(qwen));
}
