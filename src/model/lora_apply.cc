// The Transformer's LoRA pieces (include/fuyou/lora.h): the adapters' forward and backward
// beside each adapted linear, as GEMMs on the backend, and the frozen base's gradients.
#include <algorithm>
#include <vector>

#include "fuyou/error.h"
#include "fuyou/lora.h"
#include "fuyou/model.h"

namespace fuyou {

void Transformer::attach_lora(const LoraLayout& layout, const void* params, void* grads) {
  FY_CHECK(frozen_, "LoRA adapters need a model built with ModelState::kFrozenBase");
  FY_CHECK(!lora_, "the model already has adapters");
  if (es_ != 4)
    throw ConfigError(
        str("lora: the adapters run on fp32 tensors only for now, but the device "
            "stores ",
            es_ * 8, "-bit tensors (runtime.device_tensors: fp32)"));
  lora_ = &layout;
  lora_params_ = params;
  lora_grads_ = grads;
  lora_total_ = layout.params.total;
  size_t width = 1, wide = 1;
  for (const LoraAdapter& a : layout.adapters) {
    width = std::max<size_t>(width, a.width);
    wide = std::max<size_t>({wide, static_cast<size_t>(a.in), static_cast<size_t>(a.out)});
  }
  lora_u_ = alloc_tensor(static_cast<size_t>(N_) * width, "LoRA scratch");
  lora_v_ = alloc_tensor(static_cast<size_t>(N_) * width, "LoRA scratch");
  lora_dx_ = alloc_tensor(static_cast<size_t>(N_) * wide, "LoRA scratch");
  for (const LoraAdapter& a : layout.adapters) {
    // s I: the scale applied by a GEMM, one rounding of each element times s.
    std::vector<float> s(static_cast<size_t>(a.width) * a.width, 0.0f);
    for (int i = 0; i < a.width; ++i) s[static_cast<size_t>(i) * a.width + i] = layout.scale;
    void* d = alloc_tensor(s.size(), "LoRA scale");
    be_.copy_to_device(d, s.data(), 4 * s.size());
    lora_scales_.push_back(d);
    // B's elements outside every part's block, as merged ranges (element offsets in B).
    std::vector<int> owner(a.out, -1);
    for (const LoraPart& p : a.parts)
      for (int o = p.row0; o < p.row0 + p.rows; ++o) owner[o] = p.slot;
    std::vector<std::pair<size_t, size_t>> zero;
    auto clear = [&](size_t begin, size_t n) {
      if (n == 0) return;
      if (!zero.empty() && zero.back().first + zero.back().second == begin)
        zero.back().second += n;
      else
        zero.push_back({begin, n});
    };
    const size_t r = layout.rank, W = a.width;
    for (int o = 0; o < a.out; ++o) {
      const size_t row = static_cast<size_t>(o) * W;
      if (owner[o] < 0) {
        clear(row, W);
        continue;
      }
      clear(row, owner[o] * r);
      clear(row + (owner[o] + 1) * r, W - (owner[o] + 1) * r);
    }
    lora_zero_.push_back(std::move(zero));
  }
}

namespace {
size_t adapter_index(const LoraLayout& layout, const LoraAdapter* a) {
  return static_cast<size_t>(a - layout.adapters.data());
}
}  // namespace

void Transformer::lora_forward(int layer, int k, void* out, const void* in) {
  if (!lora_) return;
  const LoraAdapter* a = lora_->find(layer, static_cast<LoraLinear>(k));
  if (!a) return;
  const char* p = static_cast<const char*>(lora_params_);
  const void* A = p + es_ * lora_->params.tensors[a->a_tensor].offset;
  const void* B = p + es_ * lora_->params.tensors[a->b_tensor].offset;
  const void* S = lora_scales_[adapter_index(*lora_, a)];
  be_.matmul_forward(lora_u_, in, A, nullptr, N_, a->in, a->width);          // u = A x
  be_.matmul_forward(lora_v_, lora_u_, S, nullptr, N_, a->width, a->width);  // v = s u
  be_.matmul_forward(lora_dx_, lora_v_, B, nullptr, N_, a->width, a->out);   // B v
  be_.add(out, out, lora_dx_, static_cast<size_t>(N_) * a->out);
}

bool Transformer::lora_backward(int layer, int k, const void* dout, const void* in) {
  if (!lora_) return false;
  const LoraAdapter* a = lora_->find(layer, static_cast<LoraLinear>(k));
  if (!a) return false;
  const TensorSpec& At = lora_->params.tensors[a->a_tensor];
  const TensorSpec& Bt = lora_->params.tensors[a->b_tensor];
  const char* p = static_cast<const char*>(lora_params_);
  char* g = static_cast<char*>(lora_grads_);
  const void* S = lora_scales_[adapter_index(*lora_, a)];
  // The forward's u and v again (cheaper than keeping them: r columns per token).
  be_.matmul_forward(lora_u_, in, p + es_ * At.offset, nullptr, N_, a->in, a->width);
  be_.matmul_forward(lora_v_, lora_u_, S, nullptr, N_, a->width, a->width);
  // dB += dout^T v; dv = dout B (over v: the GEMM reads v before it writes dv).
  be_.matmul_backward(lora_v_, g + es_ * Bt.offset, nullptr, dout, lora_v_, p + es_ * Bt.offset, N_,
                      a->width, a->out);
  // du = s dv (S is symmetric); dA += du^T in; the input's share du A.
  be_.matmul_forward(lora_u_, lora_v_, S, nullptr, N_, a->width, a->width);
  be_.matmul_backward(lora_dx_, g + es_ * At.offset, nullptr, lora_u_, in, p + es_ * At.offset, N_,
                      a->in, a->width);
  for (const auto& [begin, n] : lora_zero_[adapter_index(*lora_, a)])
    be_.zero(g + es_ * (Bt.offset + begin), es_ * n);
  return true;
}

void Transformer::lora_add_input_grad(int layer, int k, void* din) {
  const LoraAdapter* a = lora_->find(layer, static_cast<LoraLinear>(k));
  be_.add(din, din, lora_dx_, static_cast<size_t>(N_) * a->in);
}

LayerTensors Transformer::layer_grads(int layer) {
  if (!frozen_) return layer_tensors(layout_, layer, grads_, es_);
  LayerTensors d;
  d.layer = layer;
  char* f = static_cast<char*>(frozen_grads_);
  const size_t C = cfg_.d_model;
  d.ln1_w = f;
  d.ln1_b = f + es_ * C;
  d.ln2_w = f + es_ * 2 * C;
  d.ln2_b = f + es_ * 3 * C;
  d.q_norm_w = f + es_ * 4 * C;
  d.k_norm_w = f + es_ * (4 * C + qk_norm_spans(cfg_).q_width);
  return d;  // matrices and biases null: their gradients are not computed
}

GlobalTensors Transformer::global_grads() {
  if (!frozen_) return global_tensors(layout_, grads_, es_);
  GlobalTensors d;
  d.lnf_w = frozen_grads_;
  d.lnf_b = static_cast<char*>(frozen_grads_) + es_ * cfg_.d_model;
  return d;  // wte, wpe, lm_head null: the head's weight gradient is skipped
}

}  // namespace fuyou
