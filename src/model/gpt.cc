#include <cmath>
#include <numeric>

#include "fuyou/error.h"
#include "fuyou/model.h"
#include "fuyou/rng.h"

namespace fuyou {
namespace {

// Tensors start on 16-float (64-byte) boundaries so vector loops never straddle two.
constexpr size_t kAlign = 16;
constexpr int kTensorsPerLayer = 12;
constexpr int kFirstLayerTensor = 2;  // after wte, wpe

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

const TensorSpec& ParamLayout::tensor(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return t;
  throw Error(str("no parameter named '", name, "' in this model"));
}

size_t ParamLayout::num_params() const {
  size_t n = 0;
  for (const auto& t : tensors) n += t.numel;
  return n;
}

ParamLayout make_gpt_layout(const ModelConfig& cfg) {
  const int64_t C = cfg.d_model, F = cfg.d_ff, V = cfg.vocab_size, T = cfg.seq_len;
  ParamLayout layout;
  auto begin_group = [&](const std::string& name) {
    layout.groups.push_back({name, layout.total, 0});
  };
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    TensorSpec t;
    t.name = name;
    t.numel = 1;
    for (int64_t d : shape) t.numel *= static_cast<size_t>(d);
    t.shape = std::move(shape);
    t.group = static_cast<int>(layout.groups.size()) - 1;
    t.offset = layout.total;
    t.decay = t.shape.size() >= 2;
    layout.total += align_up(t.numel);
    layout.tensors.push_back(std::move(t));
  };
  auto end_group = [&] { layout.groups.back().numel = layout.total - layout.groups.back().offset; };

  begin_group("embed");
  add("wte.weight", {V, C});
  add("wpe.weight", {T, C});
  end_group();
  for (int l = 0; l < cfg.n_layer; ++l) {
    std::string p = str("h.", l, ".");
    begin_group(str("layer.", l));
    add(p + "ln_1.weight", {C});
    add(p + "ln_1.bias", {C});
    add(p + "attn.c_attn.weight", {3 * C, C});
    add(p + "attn.c_attn.bias", {3 * C});
    add(p + "attn.c_proj.weight", {C, C});
    add(p + "attn.c_proj.bias", {C});
    add(p + "ln_2.weight", {C});
    add(p + "ln_2.bias", {C});
    add(p + "mlp.c_fc.weight", {F, C});
    add(p + "mlp.c_fc.bias", {F});
    add(p + "mlp.c_proj.weight", {C, F});
    add(p + "mlp.c_proj.bias", {C});
    end_group();
  }
  begin_group("final");
  add("ln_f.weight", {C});
  add("ln_f.bias", {C});
  end_group();
  return layout;
}

LayerTensors layer_tensors(const ParamLayout& layout, int layer, float* base) {
  size_t first = kFirstLayerTensor + static_cast<size_t>(layer) * kTensorsPerLayer;
  FY_CHECK(first + kTensorsPerLayer <= layout.tensors.size(), "layer ", layer, " out of range");
  auto at = [&](int i) { return base + layout.tensors[first + i].offset; };
  return {at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7), at(8), at(9), at(10), at(11)};
}

GlobalTensors global_tensors(const ParamLayout& layout, float* base) {
  size_t n = layout.tensors.size();
  return {base + layout.tensors[0].offset, base + layout.tensors[1].offset,
          base + layout.tensors[n - 2].offset, base + layout.tensors[n - 1].offset};
}

void init_gpt_group(const ModelConfig& cfg, const ParamLayout& layout, int group, float* dst) {
  const ParamGroup& g = layout.groups.at(group);
  std::fill(dst, dst + g.numel, 0.0f);
  const float resid_std = cfg.init_std / std::sqrt(2.0f * cfg.n_layer);
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const TensorSpec& t = layout.tensors[i];
    if (t.group != group) continue;
    float* p = dst + (t.offset - g.offset);
    bool is_norm = t.name.find("ln_") != std::string::npos;
    if (is_norm && t.name.ends_with(".weight")) {
      std::fill(p, p + t.numel, 1.0f);
    } else if (t.shape.size() >= 2) {
      // One stream per (tensor, 64 Ki-element chunk): values depend neither on the tensors
      // before nor on the thread count, and large models initialise in parallel.
      bool resid = t.name.ends_with("c_proj.weight");
      float std = resid ? resid_std : cfg.init_std;
      constexpr size_t kChunk = 1 << 16;
      const size_t chunks = (t.numel + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
      for (size_t c = 0; c < chunks; ++c) {
        Rng rng(cfg.seed, (static_cast<uint64_t>(i) << 32) | c);
        for (size_t k = c * kChunk; k < std::min(t.numel, (c + 1) * kChunk); ++k) p[k] = std * rng.normal();
      }
    }
  }
}

void init_gpt_params(const ModelConfig& cfg, const ParamLayout& layout, float* params) {
  for (size_t g = 0; g < layout.groups.size(); ++g)
    init_gpt_group(cfg, layout, static_cast<int>(g), params + layout.groups[g].offset);
}

double forward_flops_per_token(const ModelConfig& cfg) {
  const double C = cfg.d_model, F = cfg.d_ff, V = cfg.vocab_size, T = cfg.seq_len;
  double per_layer = 2 * C * 3 * C  // qkv
                     + 2 * T * C    // q k^T
                     + 2 * T * C    // att v
                     + 2 * C * C    // attention projection
                     + 2 * C * F    // fc
                     + 2 * F * C;   // fc projection
  return cfg.n_layer * per_layer + 2 * C * V;  // + LM head
}

GptModel::GptModel(const ModelConfig& cfg, Backend& backend, int micro_batch, ModelState state)
    : cfg_(cfg), be_(backend), B_(micro_batch), N_(micro_batch * cfg.seq_len),
      layout_(make_gpt_layout(cfg)) {
  const size_t C = cfg.d_model, F = cfg.d_ff, V = cfg.vocab_size, T = cfg.seq_len;
  const size_t N = N_, H = cfg.n_head, B = B_;
  if (state == ModelState::kFull) {
    params_ = alloc_floats(layout_.total, "parameters");
    grads_ = alloc_floats(layout_.total, "gradients");
  }
  inputs_ = static_cast<int32_t*>(be_.alloc(N * sizeof(int32_t), "input tokens"));
  owned_.push_back(inputs_);
  targets_ = static_cast<int32_t*>(be_.alloc(N * sizeof(int32_t), "target tokens"));
  owned_.push_back(targets_);
  if (state == ModelState::kFull) {
    x0_ = alloc_floats(N * C, "embedding output");
    acts_.resize(cfg.n_layer);
    for (int l = 0; l < cfg.n_layer; ++l) acts_[l] = alloc_activations(str("layer ", l, " activations"));
  }
  lnf_ = alloc_floats(N * C, "final layernorm");
  lnf_mean_ = alloc_floats(N, "final layernorm");
  lnf_rstd_ = alloc_floats(N, "final layernorm");
  logits_ = alloc_floats(N * V, "logits");
  losses_ = alloc_floats(N, "losses");
  lse_ = alloc_floats(N, "losses");
  dres_ = alloc_floats(N * C, "backward scratch");
  dtmp_ = alloc_floats(N * C, "backward scratch");
  dqkv_ = alloc_floats(N * 3 * C, "backward scratch");
  datt_ = alloc_floats(B * H * T * T, "backward scratch");
  dfc_ = alloc_floats(N * F, "backward scratch");
  host_losses_.resize(N);
}

LayerActivations GptModel::alloc_activations(const std::string& what) {
  const size_t C = cfg_.d_model, F = cfg_.d_ff, T = cfg_.seq_len, H = cfg_.n_head;
  const size_t N = N_, B = B_;
  LayerActivations a;
  a.ln1 = alloc_floats(N * C, what);
  a.ln1_mean = alloc_floats(N, what);
  a.ln1_rstd = alloc_floats(N, what);
  a.qkv = alloc_floats(N * 3 * C, what);
  a.att = alloc_floats(B * H * T * T, what);
  a.atty = alloc_floats(N * C, what);
  a.res2 = alloc_floats(N * C, what);
  a.ln2 = alloc_floats(N * C, what);
  a.ln2_mean = alloc_floats(N, what);
  a.ln2_rstd = alloc_floats(N, what);
  a.fch = alloc_floats(N * F, what);
  a.fcg = alloc_floats(N * F, what);
  a.out = alloc_floats(N * C, what);
  return a;
}

void GptModel::set_tokens(const int32_t* inputs, const int32_t* targets) {
  const size_t N = N_;
  for (size_t i = 0; i < N; ++i)
    if (inputs[i] < 0 || inputs[i] >= cfg_.vocab_size || (targets && (targets[i] < 0 || targets[i] >= cfg_.vocab_size)))
      throw Error(str("token id out of range at position ", i, ": input ", inputs[i],
                      targets ? str(", target ", targets[i]) : std::string(),
                      " (model.vocab_size is ", cfg_.vocab_size, ")"));
  be_.copy_to_device(inputs_, inputs, N * sizeof(int32_t));
  if (targets) be_.copy_to_device(targets_, targets, N * sizeof(int32_t));
}

GptModel::~GptModel() {
  for (void* p : owned_) be_.free(p);
}

float* GptModel::alloc_floats(size_t n, const std::string& what) {
  void* p = be_.alloc(n * sizeof(float), what);
  owned_.push_back(p);
  return static_cast<float*>(p);
}

size_t GptModel::activation_bytes_per_layer() const {
  const size_t C = cfg_.d_model, F = cfg_.d_ff, T = cfg_.seq_len, H = cfg_.n_head;
  const size_t N = N_;
  return sizeof(float) * (N * (7 * C + 2 * F + 4) + B_ * H * T * T);
}

void GptModel::zero_grads() { be_.zero(grads_, layout_.total * sizeof(float)); }

void GptModel::embed_forward(const float* wte, const float* wpe, float* x) {
  be_.embedding_forward(x, inputs_, wte, wpe, B_, cfg_.seq_len, cfg_.d_model);
}

void GptModel::block_forward(const LayerTensors& w, const float* x_in, const LayerActivations& a) {
  const int N = N_, C = cfg_.d_model, F = cfg_.d_ff;
  be_.layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x_in, w.ln1_w, w.ln1_b, N, C);
  be_.matmul_forward(a.qkv, a.ln1, w.qkv_w, w.qkv_b, N, C, 3 * C);
  be_.attention_forward(a.atty, a.att, a.qkv, B_, cfg_.seq_len, C, cfg_.n_head);
  be_.matmul_forward(a.res2, a.atty, w.proj_w, w.proj_b, N, C, C);
  be_.add(a.res2, a.res2, x_in, static_cast<size_t>(N) * C);
  be_.layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, w.ln2_w, w.ln2_b, N, C);
  be_.matmul_forward(a.fch, a.ln2, w.fc_w, w.fc_b, N, C, F);
  be_.gelu_forward(a.fcg, a.fch, static_cast<size_t>(N) * F);
  be_.matmul_forward(a.out, a.fcg, w.fcproj_w, w.fcproj_b, N, F, C);
  be_.add(a.out, a.out, a.res2, static_cast<size_t>(N) * C);
}

float GptModel::head_forward(const GlobalTensors& g, const float* x, bool with_loss) {
  const int N = N_, C = cfg_.d_model, V = cfg_.vocab_size;
  be_.layernorm_forward(lnf_, lnf_mean_, lnf_rstd_, x, g.lnf_w, g.lnf_b, N, C);
  be_.matmul_forward(logits_, lnf_, g.wte, nullptr, N, C, V);
  if (!with_loss) return 0.0f;
  be_.crossentropy_forward(losses_, lse_, logits_, targets_, N, V);
  be_.copy_to_host(host_losses_.data(), losses_, sizeof(float) * N);
  double s = 0;
  for (float l : host_losses_) s += l;
  last_loss_ = static_cast<float>(s / N);
  return last_loss_;
}

void GptModel::head_backward(const GlobalTensors& g, const GlobalTensors& dg, const float* x,
                             float loss_scale, float* dx) {
  const int N = N_, C = cfg_.d_model, V = cfg_.vocab_size;
  be_.crossentropy_backward(logits_, lse_, targets_, loss_scale, N, V);
  be_.matmul_backward(dtmp_, dg.wte, nullptr, logits_, lnf_, g.wte, N, C, V);
  be_.zero(dx, sizeof(float) * static_cast<size_t>(N) * C);
  be_.layernorm_backward(dx, dg.lnf_w, dg.lnf_b, dtmp_, x, g.lnf_w, lnf_mean_, lnf_rstd_, N, C);
}

void GptModel::block_backward(const LayerTensors& w, const LayerTensors& dw, const float* x_in,
                              const LayerActivations& a, float* dres) {
  const int N = N_, C = cfg_.d_model, F = cfg_.d_ff;
  // MLP: dres holds dL/d(block output), which is also dL/d(fc projection output).
  be_.matmul_backward(dfc_, dw.fcproj_w, dw.fcproj_b, dres, a.fcg, w.fcproj_w, N, F, C);
  be_.gelu_backward(dfc_, a.fch, dfc_, static_cast<size_t>(N) * F);
  be_.matmul_backward(dtmp_, dw.fc_w, dw.fc_b, dfc_, a.ln2, w.fc_w, N, C, F);
  be_.layernorm_backward(dres, dw.ln2_w, dw.ln2_b, dtmp_, a.res2, w.ln2_w, a.ln2_mean,
                         a.ln2_rstd, N, C);
  // Attention: dres now holds dL/d(res2).
  be_.matmul_backward(dtmp_, dw.proj_w, dw.proj_b, dres, a.atty, w.proj_w, N, C, C);
  be_.attention_backward(dqkv_, datt_, dtmp_, a.qkv, a.att, B_, cfg_.seq_len, C, cfg_.n_head);
  be_.matmul_backward(dtmp_, dw.qkv_w, dw.qkv_b, dqkv_, a.ln1, w.qkv_w, N, C, 3 * C);
  be_.layernorm_backward(dres, dw.ln1_w, dw.ln1_b, dtmp_, x_in, w.ln1_w, a.ln1_mean, a.ln1_rstd,
                         N, C);
}

void GptModel::embed_backward(const GlobalTensors& dg, const float* dx) {
  be_.embedding_backward(dg.wte, dg.wpe, dx, inputs_, B_, cfg_.seq_len, cfg_.d_model);
}

float GptModel::forward(const int32_t* inputs, const int32_t* targets) {
  FY_CHECK(params_, "forward() needs a model built with ModelState::kFull");
  set_tokens(inputs, targets);
  GlobalTensors g = global_tensors(layout_, params_);
  embed_forward(g.wte, g.wpe, x0_);
  const float* x = x0_;
  for (int l = 0; l < cfg_.n_layer; ++l) {
    block_forward(layer_tensors(layout_, l, params_), x, acts_[l]);
    x = acts_[l].out;
  }
  return head_forward(g, x, targets != nullptr);
}

void GptModel::backward(float loss_scale) {
  GlobalTensors g = global_tensors(layout_, params_);
  GlobalTensors dg = global_tensors(layout_, grads_);
  const float* x_last = cfg_.n_layer ? acts_.back().out : x0_;
  head_backward(g, dg, x_last, loss_scale, dres_);
  for (int l = cfg_.n_layer - 1; l >= 0; --l) {
    const float* x_in = l ? acts_[l - 1].out : x0_;
    block_backward(layer_tensors(layout_, l, params_), layer_tensors(layout_, l, grads_), x_in,
                   acts_[l], dres_);
  }
  embed_backward(dg, dres_);
}

}  // namespace fuyou
