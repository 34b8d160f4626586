#include <algorithm>
#include <cmath>
#include <numeric>
#include <type_traits>

#include "fuyou/error.h"
#include "fuyou/lora.h"
#include "fuyou/model.h"
#include "fuyou/rng.h"

namespace fuyou {
namespace {

// Tensors start on 16-element boundaries (64 bytes of fp32, 32 of bf16).
constexpr size_t kAlign = 16;

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

bool has_layernorm(const FamilyTraits& t) { return t.norm == NormKind::kLayerNorm; }

constexpr int kLoraQkv = static_cast<int>(LoraLinear::kQkv);
constexpr int kLoraProj = static_cast<int>(LoraLinear::kProj);
constexpr int kLoraFc = static_cast<int>(LoraLinear::kFc);
constexpr int kLoraFcProj = static_cast<int>(LoraLinear::kFcProj);

}  // namespace

int position_rows(const ModelConfig& cfg) {
  const FamilyTraits& t = family_traits(cfg.family);
  return rotary(t) ? 0 : cfg.position_table() + t.position_offset;
}

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

// The one list of tensors of each family. Engine names follow GPT-2's for every family (a
// role has one name), so init rules, checkpoints and tools treat them alike; the Hugging
// Face names of each family are mapped in src/formats/hf_config.cc.
ParamLayout make_gpt_layout(const ModelConfig& cfg) {
  const FamilyTraits& fam = family_traits(cfg.family);
  const int64_t C = cfg.d_model, F = cfg.d_ff, V = cfg.vocab_size, A = cfg.attn_width();
  const int64_t D = cfg.head_size(), KV = static_cast<int64_t>(cfg.kv_heads()) * D;
  const bool ln = has_layernorm(fam), bias = fam.biases;
  ParamLayout layout;
  auto begin_group = [&](const std::string& name) {
    ParamGroup g;
    g.name = name;
    g.offset = layout.total;
    g.first_tensor = layout.tensors.size();
    layout.groups.push_back(g);
  };
  // rows: the rows reserved for a (V, C) table, padded_vocab(cfg) of them, the padding
  // rows past V left zero (no gradient reaches them: crossentropy_backward).
  auto add = [&](const std::string& name, std::vector<int64_t> shape, TensorRole role,
                 int64_t rows = 0) {
    TensorSpec t;
    t.name = name;
    t.numel = 1;
    for (int64_t d : shape) t.numel *= static_cast<size_t>(d);
    t.shape = std::move(shape);
    t.group = static_cast<int>(layout.groups.size()) - 1;
    t.offset = layout.total;
    t.decay = t.shape.size() >= 2;
    t.role = role;
    layout.total += align_up(rows ? static_cast<size_t>(rows) * t.shape[1] : t.numel);
    layout.tensors.push_back(std::move(t));
  };
  auto end_group = [&] {
    ParamGroup& g = layout.groups.back();
    g.numel = layout.total - g.offset;
    g.num_tensors = layout.tensors.size() - g.first_tensor;
  };

  begin_group("embed");
  add("wte.weight", {V, C}, kWte, padded_vocab(cfg));
  if (!rotary(fam)) add("wpe.weight", {position_rows(cfg), C}, kWpe);
  end_group();
  for (int l = 0; l < cfg.n_layer; ++l) {
    std::string p = str("h.", l, ".");
    begin_group(str("layer.", l));
    add(p + "ln_1.weight", {C}, kLn1W);
    if (ln) add(p + "ln_1.bias", {C}, kLn1B);
    add(p + "attn.c_attn.weight", {A + 2 * KV, C}, kQkvW);
    if (bias || cfg.qkv_bias) add(p + "attn.c_attn.bias", {A + 2 * KV}, kQkvB);
    if (cfg.qk_norm) {
      const QkNormSpans spans = qk_norm_spans(cfg);
      add(p + "attn.q_norm.weight", {spans.q_width}, kQNormW);
      add(p + "attn.k_norm.weight", {spans.k_width}, kKNormW);
    }
    add(p + "attn.c_proj.weight", {C, A}, kProjW);
    if (bias) add(p + "attn.c_proj.bias", {C}, kProjB);
    add(p + "ln_2.weight", {C}, kLn2W);
    if (ln) add(p + "ln_2.bias", {C}, kLn2B);
    add(p + "mlp.c_fc.weight", {fc_outputs(fam, cfg.d_ff), C}, kFcW);
    if (bias) add(p + "mlp.c_fc.bias", {F}, kFcB);
    add(p + "mlp.c_proj.weight", {C, F}, kFcProjW);
    if (bias) add(p + "mlp.c_proj.bias", {C}, kFcProjB);
    end_group();
  }
  begin_group("final");
  add("ln_f.weight", {C}, kLnfW);
  if (ln) add("ln_f.bias", {C}, kLnfB);
  // The untied head lives with the final norm: both are used (and their gradients made) by
  // the head, so the scheduler's resident final group holds everything the head touches.
  if (!cfg.tie_embeddings) add("lm_head.weight", {V, C}, kLmHead, padded_vocab(cfg));
  end_group();
  return layout;
}

namespace {
void* advance(void* p, size_t elems, size_t elem_bytes) {
  return p ? static_cast<char*>(p) + elems * elem_bytes : nullptr;
}
}  // namespace

LayerTensors layer_group_tensors(const ParamLayout& layout, int layer, void* group, size_t es) {
  FY_CHECK(layer >= 0 && static_cast<size_t>(layer) + 2 < layout.groups.size(), "layer ", layer,
           " out of range");
  const ParamGroup& g = layout.groups[1 + layer];
  LayerTensors w;
  w.layer = layer;
  for (size_t i = g.first_tensor; i < g.first_tensor + g.num_tensors; ++i) {
    const TensorSpec& t = layout.tensors[i];
    void* p = advance(group, t.offset - g.offset, es);
    switch (t.role) {
      case kLn1W:
        w.ln1_w = p;
        break;
      case kLn1B:
        w.ln1_b = p;
        break;
      case kQkvW:
        w.qkv_w = p;
        break;
      case kQkvB:
        w.qkv_b = p;
        break;
      case kProjW:
        w.proj_w = p;
        break;
      case kProjB:
        w.proj_b = p;
        break;
      case kLn2W:
        w.ln2_w = p;
        break;
      case kLn2B:
        w.ln2_b = p;
        break;
      case kFcW:
        w.fc_w = p;
        break;
      case kFcB:
        w.fc_b = p;
        break;
      case kFcProjW:
        w.fcproj_w = p;
        break;
      case kFcProjB:
        w.fcproj_b = p;
        break;
      case kQNormW:
        w.q_norm_w = p;
        break;
      case kKNormW:
        w.k_norm_w = p;
        break;
      default:
        FY_CHECK(false, "tensor ", t.name, " has no place in a layer");
    }
  }
  return w;
}

LayerTensors layer_tensors(const ParamLayout& layout, int layer, void* base, size_t es) {
  FY_CHECK(layer >= 0 && static_cast<size_t>(layer) + 2 < layout.groups.size(), "layer ", layer,
           " out of range");
  return layer_group_tensors(layout, layer, advance(base, layout.groups[1 + layer].offset, es), es);
}

GlobalTensors global_tensors(const ParamLayout& layout, void* embed, void* final_, size_t es) {
  GlobalTensors g;
  const ParamGroup& ge = layout.groups.front();
  const ParamGroup& gf = layout.groups.back();
  for (const ParamGroup* grp : {&ge, &gf}) {
    void* group = grp == &ge ? embed : final_;
    for (size_t i = grp->first_tensor; i < grp->first_tensor + grp->num_tensors; ++i) {
      const TensorSpec& t = layout.tensors[i];
      void* p = advance(group, t.offset - grp->offset, es);
      switch (t.role) {
        case kWte:
          g.wte = p;
          break;
        case kWpe:
          g.wpe = p;
          break;
        case kLnfW:
          g.lnf_w = p;
          break;
        case kLnfB:
          g.lnf_b = p;
          break;
        case kLmHead:
          g.lm_head = p;
          break;
        default:
          FY_CHECK(false, "tensor ", t.name, " has no place in the embed/final groups");
      }
    }
  }
  if (!g.lm_head) g.lm_head = g.wte;  // tied
  return g;
}

GlobalTensors global_tensors(const ParamLayout& layout, void* base, size_t es) {
  return global_tensors(layout, advance(base, layout.groups.front().offset, es),
                        advance(base, layout.groups.back().offset, es), es);
}

void init_gpt_group(const ModelConfig& cfg, const ParamLayout& layout, int group, float* dst) {
  const ParamGroup& g = layout.groups.at(group);
  std::fill(dst, dst + g.numel, 0.0f);
  const float resid_std = cfg.init_std / std::sqrt(2.0f * cfg.n_layer);
  for (size_t i = g.first_tensor; i < g.first_tensor + g.num_tensors; ++i) {
    const TensorSpec& t = layout.tensors[i];
    float* p = dst + (t.offset - g.offset);
    bool is_norm = t.role == kLn1W || t.role == kLn2W || t.role == kLnfW || t.role == kQNormW ||
                   t.role == kKNormW;
    if (is_norm) {
      std::fill(p, p + t.numel, 1.0f);
    } else if (t.shape.size() >= 2) {
      // One stream per (tensor, 64 Ki-element chunk): values depend neither on the tensors
      // before nor on the thread count, and large models initialise in parallel.
      bool resid = t.role == kProjW || t.role == kFcProjW;
      float std = resid ? resid_std : cfg.init_std;
      constexpr size_t kChunk = 1 << 16;
      const size_t chunks = (t.numel + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
      for (size_t c = 0; c < chunks; ++c) {
        Rng rng(cfg.seed, (static_cast<uint64_t>(i) << 32) | c);
        for (size_t k = c * kChunk; k < std::min(t.numel, (c + 1) * kChunk); ++k)
          p[k] = std * rng.normal();
      }
    }
  }
}

void init_gpt_params(const ModelConfig& cfg, const ParamLayout& layout, float* params) {
  for (size_t g = 0; g < layout.groups.size(); ++g)
    init_gpt_group(cfg, layout, static_cast<int>(g), params + layout.groups[g].offset);
}

double layer_forward_flops_per_token(const ModelConfig& cfg) {
  const double C = cfg.d_model, F = cfg.d_ff, T = cfg.seq_len, A = cfg.attn_width();
  const double KV = static_cast<double>(cfg.kv_heads()) * cfg.head_size();
  const double mlp_matrices = gated_mlp(family_traits(cfg.family)) ? 3 : 2;
  return 2 * C * (A + 2 * KV)         // q, k, v projections
         + 2 * T * A                  // q k^T
         + 2 * T * A                  // att v
         + 2 * A * C                  // attention projection
         + mlp_matrices * 2 * C * F;  // fc, fc projection (llama: gate, up, down)
}

double forward_flops_per_token(const ModelConfig& cfg) {
  return cfg.n_layer * layer_forward_flops_per_token(cfg) +
         2.0 * cfg.d_model * cfg.vocab_size;  // + LM head (tied or not)
}

namespace {

// The one list of a layer's saved activations: alloc_activations allocates from it and
// layer_activation_bytes sums it, so the planner's sizes are what the model allocates.
template <typename Fn>
void for_each_activation(const ModelConfig& cfg, int B, LayerActivations& a, Fn&& fn) {
  const size_t C = cfg.d_model, F = cfg.d_ff, T = cfg.seq_len, H = cfg.n_head;
  const size_t A = cfg.attn_width(), Hkv = cfg.kv_heads(), D = cfg.head_size();
  const size_t N = static_cast<size_t>(B) * T;
  const bool ln = has_layernorm(family_traits(cfg.family));
  const size_t fc = fc_outputs(family_traits(cfg.family), cfg.d_ff);
  fn(a.ln1, N * C);
  if (ln) fn(a.ln1_mean, N);
  fn(a.ln1_rstd, N);
  fn(a.qkv, N * 3 * A);
  if (cfg.qk_norm) {
    fn(a.qk, N * (H + Hkv) * D);
    fn(a.qk_rstd, N * (H + Hkv));
  }
  fn(a.lse, B * H * T);
  fn(a.atty, N * A);
  fn(a.res2, N * C);
  fn(a.ln2, N * C);
  if (ln) fn(a.ln2_mean, N);
  fn(a.ln2_rstd, N);
  fn(a.fch, N * fc);
  fn(a.fcg, N * F);
  fn(a.out, N * C);
}

// The one list of a model's own device buffers besides parameters, gradients and per-layer
// activations (those three exist only in ModelState::kFull).
struct Workspace {
  void *lnf, *logits, *dres, *dtmp, *dqkv, *qkvc, *dqkvc, *dgu;
  float *lnf_mean, *lnf_rstd, *losses, *lse, *att_scratch;
};
template <typename Fn>
void for_each_workspace(const ModelConfig& cfg, int B, Workspace& w, Fn&& fn) {
  const size_t C = cfg.d_model, F = cfg.d_ff, T = cfg.seq_len, A = cfg.attn_width();
  const size_t N = static_cast<size_t>(B) * T;
  const size_t KV = static_cast<size_t>(cfg.kv_heads()) * cfg.head_size();
  const FamilyTraits& fam = family_traits(cfg.family);
  fn(w.lnf, N * C, "final norm");
  if (has_layernorm(fam)) fn(w.lnf_mean, N, "final norm");
  fn(w.lnf_rstd, N, "final norm");
  fn(w.logits, static_cast<size_t>(head_chunk_rows(cfg, B)) * padded_vocab(cfg), "logits");
  fn(w.losses, N, "losses");
  fn(w.lse, N, "losses");
  fn(w.dres, N * C, "backward scratch");
  fn(w.dtmp, N * std::max(C, A), "backward scratch");  // d(ln1 output) and d(attention output)
  // Also the post-norm attention norm's input gradient (N, C).
  fn(w.dqkv, N * std::max(3 * A, C), "backward scratch");
  fn(w.att_scratch, 2 * T * T, "attention scratch");
  if (KV != A) {  // grouped-query attention: the compact q|k|v before heads are repeated
    fn(w.qkvc, N * (A + 2 * KV), "grouped-query attention scratch");
    fn(w.dqkvc, N * (A + 2 * KV), "grouped-query attention scratch");
  }
  if (gated_mlp(fam)) fn(w.dgu, N * 2 * F, "backward scratch");
}

}  // namespace

// Bytes of k elements of a list entry: fp32 statistics (float*) or storage-type tensors (void*).
template <typename P>
size_t entry_bytes(P*, size_t k, size_t es) {
  return k * (std::is_same_v<P, float> ? sizeof(float) : es);
}

// A frozen base's norm weight gradients (computed with the input gradients, read by nothing):
// ln_1 and ln_2 weight and bias (C each), then the q and k norms' weights.
size_t frozen_grad_elems(const ModelConfig& cfg) {
  const QkNormSpans s = qk_norm_spans(cfg);
  return 4 * static_cast<size_t>(cfg.d_model) + s.q_width + s.k_width;
}

int head_chunk_rows(const ModelConfig& cfg, int B) {
  const int N = B * cfg.seq_len;
  return cfg.head_chunk_tokens > 0 && cfg.head_chunk_tokens < N ? cfg.head_chunk_tokens : N;
}

size_t layer_activation_bytes(const ModelConfig& cfg, int B, size_t es) {
  LayerActivations a;
  size_t n = 0;
  for_each_activation(cfg, B, a, [&](auto*& p, size_t k) { n += entry_bytes(p, k, es); });
  return n;
}

size_t model_workspace_bytes(const ModelConfig& cfg, int B, size_t es) {
  Workspace w{};
  size_t n = 0;
  for_each_workspace(cfg, B, w,
                     [&](auto*& p, size_t k, const char*) { n += entry_bytes(p, k, es); });
  // + the input and target token ids and the packed records' positions
  return n + 3 * sizeof(int32_t) * static_cast<size_t>(B) * cfg.seq_len;
}

size_t cpu_kernel_scratch_bytes(const ModelConfig& cfg, int B) {
  const size_t V = padded_vocab(cfg), N = static_cast<size_t>(B) * cfg.seq_len;
  // The attention's width may exceed d_model (head_dim): the larger bounds every view.
  const size_t C = std::max<size_t>(cfg.d_model, cfg.attn_width());
  const size_t F = fc_outputs(family_traits(cfg.family), cfg.d_ff);  // fc's outputs
  const size_t QKV = cfg.attn_width() + 2 * static_cast<size_t>(cfg.kv_heads()) * cfg.head_size();
  // Every view of one call, per kernel: a matmul backward's din, dw, dbias, dout, in and w;
  // the attention backward's dqkv, dout and qkv (3C wide after repeating k/v heads); a norm
  // backward's din, dout, in and three weight vectors; the fused residual + norm's res, out, a,
  // b and two weight vectors.
  auto matmul_bwd = [&](size_t IC, size_t OC) { return 2 * N * IC + 2 * OC * IC + OC + N * OC; };
  const size_t most =
      std::max({matmul_bwd(C, V), matmul_bwd(C, QKV), matmul_bwd(C, F), matmul_bwd(cfg.d_ff, C),
                7 * N * C, 3 * N * C + 3 * C, 4 * N * C + 2 * C, 5 * N * cfg.d_ff});
  return sizeof(float) * most;
}

template <typename P>
P* Transformer::alloc_entry(P*, size_t n, const std::string& what) {
  if constexpr (std::is_same_v<P, float>)
    return alloc_floats(n, what);
  else
    return alloc_tensor(n, what);
}

void norm_forward(Backend& be, const FamilyTraits& fam, void* out, float* mean, float* rstd,
                  const void* in, const void* w, const void* b, float eps, int n, int C) {
  if (fam.norm == NormKind::kRmsNorm)
    be.rmsnorm_forward(out, rstd, in, w, eps, n, C);
  else
    be.layernorm_forward(out, mean, rstd, in, w, b, n, C);
}

void residual_norm_forward(Backend& be, const FamilyTraits& fam, void* res, void* out, float* mean,
                           float* rstd, const void* a, const void* b, const void* w,
                           const void* bias, float eps, int n, int C) {
  if (fam.norm == NormKind::kRmsNorm)
    be.residual_rmsnorm_forward(res, out, rstd, a, b, w, eps, n, C);
  else
    be.residual_layernorm_forward(res, out, mean, rstd, a, b, w, bias, n, C);
}

void mlp_activation_forward(Backend& be, const FamilyTraits& fam, void* fcg, const void* fch, int n,
                            int F) {
  switch (fam.mlp) {
    case MlpKind::kGelu:
      return be.gelu_forward(fcg, fch, static_cast<size_t>(n) * F);
    case MlpKind::kRelu:
      return be.relu_forward(fcg, fch, static_cast<size_t>(n) * F);
    case MlpKind::kSwiglu:
      return be.swiglu_forward(fcg, fch, n, F);
  }
}

Transformer::Transformer(const ModelConfig& cfg, Backend& backend, int micro_batch,
                         ModelState state)
    : cfg_(cfg),
      be_(backend),
      B_(micro_batch),
      N_(micro_batch * cfg.seq_len),
      es_(backend.storage_bytes()),
      layout_(make_gpt_layout(cfg)),
      fam_(family_traits(cfg.family)),
      rope_(rope_table(cfg)) {
  const size_t N = N_;
  if (cfg.n_head % cfg.kv_heads() != 0)
    throw ConfigError(
        str("model.n_kv_head ", cfg.kv_heads(), " does not divide model.n_head ", cfg.n_head));
  frozen_ = state == ModelState::kFrozenBase;
  if (state != ModelState::kWorkspace) params_ = alloc_tensor(layout_.total, "parameters");
  if (state == ModelState::kFull) grads_ = alloc_tensor(layout_.total, "gradients");
  if (frozen_)
    frozen_grads_ = alloc_tensor(frozen_grad_elems(cfg), "frozen norms' discarded gradients");
  inputs_ = static_cast<int32_t*>(be_.alloc(N * sizeof(int32_t), "input tokens"));
  owned_.push_back(inputs_);
  targets_ = static_cast<int32_t*>(be_.alloc(N * sizeof(int32_t), "target tokens"));
  owned_.push_back(targets_);
  positions_ = static_cast<int32_t*>(be_.alloc(N * sizeof(int32_t), "token positions"));
  owned_.push_back(positions_);
  if (state != ModelState::kWorkspace) {
    x0_ = alloc_tensor(N * cfg.d_model, "embedding output");
    acts_.resize(cfg.n_layer);
    for (int l = 0; l < cfg.n_layer; ++l)
      acts_[l] = alloc_activations(str("layer ", l, " activations"));
  }
  Workspace w{};
  for_each_workspace(cfg, B_, w,
                     [&](auto*& p, size_t n, const char* what) { p = alloc_entry(p, n, what); });
  lnf_ = w.lnf;
  lnf_mean_ = w.lnf_mean;
  lnf_rstd_ = w.lnf_rstd;
  logits_ = w.logits;
  head_rows_ = head_chunk_rows(cfg, B_);
  losses_ = w.losses;
  lse_ = w.lse;
  dres_ = w.dres;
  dtmp_ = w.dtmp;
  dqkv_ = w.dqkv;
  att_scratch_ = w.att_scratch;
  qkvc_ = w.qkvc;
  dqkvc_ = w.dqkvc;
  dgu_ = w.dgu;
  host_losses_.resize(N);
}

LayerActivations Transformer::alloc_activations(const std::string& what) {
  LayerActivations a;
  for_each_activation(cfg_, B_, a, [&](auto*& p, size_t n) { p = alloc_entry(p, n, what); });
  return a;
}

void Transformer::set_tokens(const int32_t* inputs, const int32_t* targets,
                             const int32_t* positions) {
  const size_t N = N_;
  const int T = cfg_.seq_len;
  // Positions restart at 0 with each record and count up by one within it, so every record is
  // a contiguous run and its position never reaches T (the position table's rows).
  for (size_t i = 0; positions && i < N; ++i) {
    const int32_t want = i % T == 0 ? 0 : positions[i - 1] + 1;
    if (positions[i] != 0 && positions[i] != want)
      throw Error(str("packed records: position ", positions[i], " of token ", i % T, " in row ",
                      i / T, " neither starts a record (0) nor follows the previous token's (",
                      want, ")"));
  }
  // A target of kIgnoreTarget is a masked-out position (loss mask): valid, not counted.
  auto bad_target = [&](int32_t t) {
    return t != kIgnoreTarget && (t < 0 || t >= cfg_.vocab_size);
  };
  for (size_t i = 0; i < N; ++i)
    if (inputs[i] < 0 || inputs[i] >= cfg_.vocab_size || (targets && bad_target(targets[i])))
      throw Error(str("token id out of range at position ", i, ": input ", inputs[i],
                      targets ? str(", target ", targets[i]) : std::string(),
                      " (model.vocab_size is ", cfg_.vocab_size, ")"));
  counted_ = 0;
  if (targets)
    for (size_t i = 0; i < N; ++i) counted_ += targets[i] != kIgnoreTarget;
  mark(StepPhase::kForward, OpClass::kCopyToDevice);
  be_.copy_to_device(inputs_, inputs, N * sizeof(int32_t));
  if (targets) be_.copy_to_device(targets_, targets, N * sizeof(int32_t));
  if (positions) be_.copy_to_device(positions_, positions, N * sizeof(int32_t));
  pos_ = positions ? positions_ : nullptr;
}

Transformer::~Transformer() {
  for (void* p : owned_) be_.free(p);
}

void* Transformer::alloc_tensor(size_t n, const std::string& what) {
  void* p = be_.alloc(n * es_, what);
  owned_.push_back(p);
  return p;
}

float* Transformer::alloc_floats(size_t n, const std::string& what) {
  void* p = be_.alloc(n * sizeof(float), what);
  owned_.push_back(p);
  return static_cast<float*>(p);
}

void Transformer::zero_grads() {
  mark(StepPhase::kOther, OpClass::kZeroGrads);
  if (grads_) be_.zero(grads_, layout_.total * es_);
  if (frozen_grads_) be_.zero(frozen_grads_, es_ * frozen_grad_elems(cfg_));
  if (lora_grads_) be_.zero(lora_grads_, lora_total_ * es_);
}

void Transformer::embed_forward(const void* wte, const void* wpe, void* x) {
  if (wpe)
    wpe = static_cast<const char*>(wpe) +
          static_cast<size_t>(fam_.position_offset) * cfg_.d_model * es_;
  mark(StepPhase::kForward, OpClass::kEmbedding);
  if (!pos_ || !wpe)
    return be_.embedding_forward(x, inputs_, wte, pos_ ? nullptr : wpe, B_, cfg_.seq_len,
                                 cfg_.d_model);
  // Packed records: the position rows are looked up by each token's position, with the
  // embedding kernel reading the position table as a token table (dtmp_ is free until the
  // backward), then added: one rounding of the same fp32 sum the fused lookup makes.
  be_.embedding_forward(x, inputs_, wte, nullptr, B_, cfg_.seq_len, cfg_.d_model);
  be_.embedding_forward(dtmp_, pos_, wpe, nullptr, B_, cfg_.seq_len, cfg_.d_model);
  be_.add(x, x, dtmp_, static_cast<size_t>(N_) * cfg_.d_model);
}

// Normalisation before attention, the MLP and the head: LayerNorm (gpt2, opt) or RMSNorm.
void Transformer::norm_forward(void* out, float* mean, float* rstd, const void* in, const void* w,
                               const void* b) {
  fuyou::norm_forward(be_, fam_, out, mean, rstd, in, w, b, cfg_.norm_eps, N_, cfg_.d_model);
}

void Transformer::residual_norm_forward(void* res, void* out, float* mean, float* rstd,
                                        const void* a, const void* b, const void* w,
                                        const void* bias) {
  fuyou::residual_norm_forward(be_, fam_, res, out, mean, rstd, a, b, w, bias, cfg_.norm_eps, N_,
                               cfg_.d_model);
}

void Transformer::norm_backward(void* din, void* dw, void* db, const void* dout, const void* in,
                                const void* w, const float* mean, const float* rstd) {
  if (fam_.norm == NormKind::kRmsNorm)
    be_.rmsnorm_backward(din, dw, dout, in, w, rstd, N_, cfg_.d_model);
  else
    be_.layernorm_backward(din, dw, db, dout, in, w, mean, rstd, N_, cfg_.d_model);
}

void Transformer::norm_backward_into(void* din, void* dw, void* db, const void* dout,
                                     const void* in, const void* w, const float* mean,
                                     const float* rstd) {
  be_.zero(din, es_ * static_cast<size_t>(N_) * cfg_.d_model);
  norm_backward(din, dw, db, dout, in, w, mean, rstd);
}

void Transformer::block_forward(const LayerTensors& w, const void* x_in,
                                const LayerActivations& a) {
  const int N = N_, C = cfg_.d_model, F = cfg_.d_ff, T = cfg_.seq_len;
  const int H = cfg_.n_head, Hkv = cfg_.kv_heads(), D = cfg_.head_size(), A = cfg_.attn_width();
  // Pre-norm: the sublayers read the norms' outputs ln1, ln2. Post-norm (OLMo 2): they read
  // the residual stream, and ln1, ln2 hold their outputs, which the norms read.
  const bool post = post_norm(cfg_);
  if (!post) {
    mark(StepPhase::kForward, OpClass::kNorm);
    norm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x_in, w.ln1_w, w.ln1_b);
  }
  const void* attn_in = post ? x_in : a.ln1;
  // Grouped-query attention in its simple form: project to the compact q|k|v, normalise and
  // rotate q and k, then copy each k/v head to the query heads sharing it so the ordinary
  // multi-head attention kernel runs; the backward sums the copies' gradients.
  void* qkvc = Hkv == H ? a.qkv : qkvc_;
  mark(StepPhase::kForward, OpClass::kGemmQkv);
  be_.matmul_forward(qkvc, attn_in, w.qkv_w, w.qkv_b, N, C, A + 2 * Hkv * D);
  lora_forward(w.layer, kLoraQkv, qkvc, attn_in);
  if (cfg_.qk_norm) {
    mark(StepPhase::kForward, OpClass::kNorm);
    be_.qk_norm_forward(qkvc, a.qk, a.qk_rstd, w.q_norm_w, w.k_norm_w, cfg_.norm_eps, N,
                        qk_norm_spans(cfg_));
  }
  const bool rope = rotary(fam_) && cfg_.rotates(w.layer);
  if (rope || Hkv != H) mark(StepPhase::kForward, OpClass::kRope);
  if (rope) be_.rope_forward(qkvc, B_, T, H, Hkv, D, rope_, pos_);
  if (Hkv != H) be_.repeat_kv_forward(a.qkv, qkvc, N, H, Hkv, D);
  mark(StepPhase::kForward, OpClass::kAttention);
  be_.attention_forward(a.atty, a.lse, att_scratch_, a.qkv, B_, T, A, H, pos_);
  mark(StepPhase::kForward, OpClass::kGemmAttnProj);
  void* proj_out = post ? a.ln1 : a.res2;
  be_.matmul_forward(proj_out, a.atty, w.proj_w, w.proj_b, N, A, C);
  lora_forward(w.layer, kLoraProj, proj_out, a.atty);
  mark(StepPhase::kForward, OpClass::kNorm);
  if (!post) {
    // The attention's residual add and the MLP's norm in one pass (timed as the norm).
    residual_norm_forward(a.res2, a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, x_in, w.ln2_w, w.ln2_b);
  } else {
    norm_forward(a.res2, a.ln1_mean, a.ln1_rstd, a.ln1, w.ln1_w, w.ln1_b);
    mark(StepPhase::kForward, OpClass::kResidual);
    be_.add(a.res2, a.res2, x_in, static_cast<size_t>(N) * C);
  }
  const void* mlp_in = post ? a.res2 : a.ln2;
  mark(StepPhase::kForward, OpClass::kGemmMlpUp);
  be_.matmul_forward(a.fch, mlp_in, w.fc_w, w.fc_b, N, C, fc_outputs(fam_, F));
  lora_forward(w.layer, kLoraFc, a.fch, mlp_in);
  mark(StepPhase::kForward, OpClass::kActivation);
  mlp_activation_forward(be_, fam_, a.fcg, a.fch, N, F);
  mark(StepPhase::kForward, OpClass::kGemmMlpDown);
  void* down_out = post ? a.ln2 : a.out;
  be_.matmul_forward(down_out, a.fcg, w.fcproj_w, w.fcproj_b, N, F, C);
  lora_forward(w.layer, kLoraFcProj, down_out, a.fcg);
  if (post) {
    mark(StepPhase::kForward, OpClass::kNorm);
    norm_forward(a.out, a.ln2_mean, a.ln2_rstd, a.ln2, w.ln2_w, w.ln2_b);
  }
  mark(StepPhase::kForward, OpClass::kResidual);
  be_.add(a.out, a.out, a.res2, static_cast<size_t>(N) * C);
}

const void* Transformer::logits() const {
  FY_CHECK(head_rows_ == N_, "the logits are computed ", head_rows_,
           " tokens at a time (model.head_chunk_tokens); ",
           "a whole micro-batch's logits need model.head_chunk_tokens: 0");
  return logits_;
}

void Transformer::copy_logits(void* dst) const {
  const size_t V = cfg_.vocab_size, Vp = padded_vocab(cfg_);
  const char* src = static_cast<const char*>(logits());
  if (V == Vp) return be_.copy_to_host(dst, src, es_ * V * N_);
  for (int n = 0; n < N_; ++n)
    be_.copy_to_host(static_cast<char*>(dst) + es_ * V * n, src + es_ * Vp * n, es_ * V);
}

// The LM head runs over the tokens in chunks of head_rows_ (all N when not chunked); row r0
// of a chunk is row r0 of lnf, losses, lse, targets and the head's input gradient.
float Transformer::head_forward(const GlobalTensors& g, const void* x, bool with_loss) {
  // The head's GEMMs run over the padded vocabulary Vp (aligned rows and tiles for the GPU's
  // GEMMs); its padding rows are zero, so their logits are 0 and the loss skips them.
  const int N = N_, C = cfg_.d_model, Vp = padded_vocab(cfg_);
  mark(StepPhase::kForward, OpClass::kNorm);
  norm_forward(lnf_, lnf_mean_, lnf_rstd_, x, g.lnf_w, g.lnf_b);
  mark(StepPhase::kForward, OpClass::kHeadGemm);
  if (!with_loss) {
    FY_CHECK(head_rows_ == N, "whole logits from a chunked head (forward() refuses this first)");
    be_.matmul_forward(logits_, lnf_, g.lm_head, nullptr, N, C, Vp);
    return 0.0f;
  }
  return head_loss(g, nullptr, 0.0f);
}

float Transformer::head_loss(const GlobalTensors& g, const GlobalTensors* dg, float loss_scale) {
  const int N = N_, C = cfg_.d_model, V = cfg_.vocab_size, Vp = padded_vocab(cfg_);
  for (int r0 = 0; r0 < N; r0 += head_rows_) {
    const int rows = std::min(head_rows_, N - r0);
    mark(StepPhase::kForward, OpClass::kHeadGemm);
    be_.matmul_forward(logits_, rows_at(lnf_, r0, C), g.lm_head, nullptr, rows, C, Vp);
    mark(StepPhase::kForward, OpClass::kLoss);
    if (!dg) {
      be_.crossentropy_forward(losses_ + r0, lse_ + r0, logits_, targets_ + r0, rows, V, Vp);
      continue;
    }
    be_.crossentropy_forward_backward(losses_ + r0, lse_ + r0, logits_, targets_ + r0, loss_scale,
                                      rows, V, Vp);
    head_gemm_backward(g, *dg, r0, rows);
  }
  return mean_loss();
}

float Transformer::mean_loss() {
  // A caller-ordered backend (the offload executor's) lets a copy skip the kernels queued
  // before it: the losses must be complete before they are read.
  be_.finish_compute();
  mark(StepPhase::kForward, OpClass::kCopyToHost);
  be_.copy_to_host(host_losses_.data(), losses_, sizeof(float) * N_);
  // Ignored targets hold loss 0, so the sum is over counted targets; the mean divides by
  // their number (N without a mask: the same arithmetic as before masks). No counted target:
  // the loss is defined as 0 (nothing to average; its gradient is zero too).
  double s = 0;
  for (float l : host_losses_) s += l;
  return counted_ ? static_cast<float>(s / static_cast<double>(counted_)) : 0.0f;
}

void Transformer::head_backward(const GlobalTensors& g, const GlobalTensors& dg, const void* x,
                                float loss_scale, void* dx) {
  const int N = N_, C = cfg_.d_model, V = cfg_.vocab_size, Vp = padded_vocab(cfg_);
  for (int r0 = 0; r0 < N; r0 += head_rows_) {
    const int rows = std::min(head_rows_, N - r0);
    // A chunked head's logits are gone (the next chunk overwrote them): computed again.
    mark(StepPhase::kBackward, OpClass::kHeadGemm);
    if (head_rows_ < N)
      be_.matmul_forward(logits_, rows_at(lnf_, r0, C), g.lm_head, nullptr, rows, C, Vp);
    mark(StepPhase::kBackward, OpClass::kLoss);
    be_.crossentropy_backward(logits_, lse_ + r0, targets_ + r0, loss_scale, rows, V, Vp);
    head_gemm_backward(g, dg, r0, rows);
  }
  head_norm_backward(g, dg, x, dx);
}

float Transformer::head_train(const GlobalTensors& g, const GlobalTensors& dg, const void* x,
                              float loss_scale, void* dx) {
  mark(StepPhase::kForward, OpClass::kNorm);
  norm_forward(lnf_, lnf_mean_, lnf_rstd_, x, g.lnf_w, g.lnf_b);
  const float loss = head_loss(g, &dg, loss_scale);
  head_norm_backward(g, dg, x, dx);
  return loss;
}

void Transformer::head_gemm_backward(const GlobalTensors& g, const GlobalTensors& dg, int r0,
                                     int rows) {
  // Tied: dg.lm_head is dg.wte (embed group); untied: the final group's own gradient. The
  // padding columns' gradient is zero, so the padding rows' gradient stays zero.
  const int C = cfg_.d_model, Vp = padded_vocab(cfg_);
  mark(StepPhase::kBackward, OpClass::kHeadGemm);
  be_.matmul_backward(rows_at(dtmp_, r0, C), dg.lm_head, nullptr, logits_, rows_at(lnf_, r0, C),
                      g.lm_head, rows, C, Vp);
}

void Transformer::head_norm_backward(const GlobalTensors& g, const GlobalTensors& dg, const void* x,
                                     void* dx) {
  mark(StepPhase::kBackward, OpClass::kNorm);
  norm_backward_into(dx, dg.lnf_w, dg.lnf_b, dtmp_, x, g.lnf_w, lnf_mean_, lnf_rstd_);
}

void Transformer::block_backward(const LayerTensors& w, const LayerTensors& dw, const void* x_in,
                                 const LayerActivations& a, void* dres) {
  const int N = N_, C = cfg_.d_model, F = cfg_.d_ff, T = cfg_.seq_len;
  const int H = cfg_.n_head, Hkv = cfg_.kv_heads(), D = cfg_.head_size(), A = cfg_.attn_width();
  const bool post = post_norm(cfg_);
  const size_t NC = static_cast<size_t>(N) * C;
  // dres holds dL/d(block output): the fc projection's output gradient (pre-norm), or the
  // MLP norm's output gradient (post-norm), whose input gradient goes to dtmp_.
  void* ddown = dres;
  if (post) {
    mark(StepPhase::kBackward, OpClass::kNorm);
    norm_backward_into(dtmp_, dw.ln2_w, dw.ln2_b, dres, a.ln2, w.ln2_w, a.ln2_mean, a.ln2_rstd);
    ddown = dtmp_;
  }
  // The activation's gradient dL/d(fcg) overwrites fcg itself (matmul_backward computes dw
  // from its input before din): the backward consumes the layer's activations, and the (N, F)
  // gradient needs no buffer of its own, the largest one of a layer's backward.
  void* dfc = a.fcg;
  mark(StepPhase::kBackward, OpClass::kGemmMlpDown);
  const bool lora_down = lora_backward(w.layer, kLoraFcProj, ddown, a.fcg);  // before fcg goes
  be_.matmul_backward(dfc, dw.fcproj_w, dw.fcproj_b, ddown, a.fcg, w.fcproj_w, N, F, C);
  if (lora_down) lora_add_input_grad(w.layer, kLoraFcProj, dfc);
  // The gradient at fc's output: in place of dfc, or (gated) the gate|up pair in dgu_.
  void* dfch = gated_mlp(fam_) ? dgu_ : dfc;
  mark(StepPhase::kBackward, OpClass::kActivation);
  switch (fam_.mlp) {
    case MlpKind::kGelu:
      be_.gelu_backward(dfc, a.fch, dfc, static_cast<size_t>(N) * F);
      break;
    case MlpKind::kRelu:
      be_.relu_backward(dfc, a.fch, dfc, static_cast<size_t>(N) * F);
      break;
    case MlpKind::kSwiglu:
      be_.swiglu_backward(dgu_, a.fch, dfc, N, F);
      break;
  }
  const void* mlp_in = post ? a.res2 : a.ln2;
  mark(StepPhase::kBackward, OpClass::kGemmMlpUp);
  be_.matmul_backward(dtmp_, dw.fc_w, dw.fc_b, dfch, mlp_in, w.fc_w, N, C, fc_outputs(fam_, F));
  if (lora_backward(w.layer, kLoraFc, dfch, mlp_in)) lora_add_input_grad(w.layer, kLoraFc, dtmp_);
  if (!post) {
    mark(StepPhase::kBackward, OpClass::kNorm);
    norm_backward(dres, dw.ln2_w, dw.ln2_b, dtmp_, a.res2, w.ln2_w, a.ln2_mean, a.ln2_rstd);
  } else {
    mark(StepPhase::kBackward, OpClass::kResidual);
    be_.add(dres, dres, dtmp_, NC);
  }
  // Attention: dres now holds dL/d(res2), the projection's output gradient (pre-norm) or the
  // attention norm's (post-norm), whose input gradient goes to dqkv_ (free until the
  // attention's backward, which the projection's backward precedes).
  void* dproj = dres;
  if (post) {
    mark(StepPhase::kBackward, OpClass::kNorm);
    norm_backward_into(dqkv_, dw.ln1_w, dw.ln1_b, dres, a.ln1, w.ln1_w, a.ln1_mean, a.ln1_rstd);
    dproj = dqkv_;
  }
  mark(StepPhase::kBackward, OpClass::kGemmAttnProj);
  be_.matmul_backward(dtmp_, dw.proj_w, dw.proj_b, dproj, a.atty, w.proj_w, N, A, C);
  if (lora_backward(w.layer, kLoraProj, dproj, a.atty))
    lora_add_input_grad(w.layer, kLoraProj, dtmp_);
  mark(StepPhase::kBackward, OpClass::kAttention);
  be_.attention_backward(dqkv_, att_scratch_, dtmp_, a.atty, a.qkv, a.lse, B_, T, A, H, pos_);
  void* dqkvc = Hkv == H ? dqkv_ : dqkvc_;
  const bool rope = rotary(fam_) && cfg_.rotates(w.layer);
  if (rope || Hkv != H) mark(StepPhase::kBackward, OpClass::kRope);
  if (Hkv != H) be_.repeat_kv_backward(dqkvc, dqkv_, N, H, Hkv, D);
  if (rope) be_.rope_backward(dqkvc, B_, T, H, Hkv, D, rope_, pos_);
  if (cfg_.qk_norm) {
    mark(StepPhase::kBackward, OpClass::kNorm);
    be_.qk_norm_backward(dqkvc, dw.q_norm_w, dw.k_norm_w, a.qk, w.q_norm_w, w.k_norm_w, a.qk_rstd,
                         N, qk_norm_spans(cfg_));
  }
  const void* attn_in = post ? x_in : a.ln1;
  mark(StepPhase::kBackward, OpClass::kGemmQkv);
  be_.matmul_backward(dtmp_, dw.qkv_w, dw.qkv_b, dqkvc, attn_in, w.qkv_w, N, C, A + 2 * Hkv * D);
  if (lora_backward(w.layer, kLoraQkv, dqkvc, attn_in))
    lora_add_input_grad(w.layer, kLoraQkv, dtmp_);
  if (!post) {
    mark(StepPhase::kBackward, OpClass::kNorm);
    norm_backward(dres, dw.ln1_w, dw.ln1_b, dtmp_, x_in, w.ln1_w, a.ln1_mean, a.ln1_rstd);
  } else {
    mark(StepPhase::kBackward, OpClass::kResidual);
    be_.add(dres, dres, dtmp_, NC);
  }
}

void Transformer::embed_backward(const GlobalTensors& dg, const void* dx) {
  if (frozen_) return;  // the token and position tables train nothing
  void* dwpe = dg.wpe;
  if (dwpe)
    dwpe =
        static_cast<char*>(dwpe) + static_cast<size_t>(fam_.position_offset) * cfg_.d_model * es_;
  mark(StepPhase::kBackward, OpClass::kEmbedding);
  if (!pos_ || !dwpe)
    return be_.embedding_backward(dg.wte, pos_ ? nullptr : dwpe, dx, inputs_, B_, cfg_.seq_len,
                                  cfg_.d_model);
  // Packed records: the position table's gradient is scattered by position, as the token
  // table's is by token.
  be_.embedding_backward(dg.wte, nullptr, dx, inputs_, B_, cfg_.seq_len, cfg_.d_model);
  be_.embedding_backward(dwpe, nullptr, dx, pos_, B_, cfg_.seq_len, cfg_.d_model);
}

float Transformer::forward(const int32_t* inputs, const int32_t* targets,
                           const int32_t* positions) {
  if (!targets && head_rows_ < N_)  // before the whole forward, not after it
    throw Error(str("a forward without targets returns the logits of all ", N_,
                    " tokens, but this model ", "computes them ", head_rows_,
                    " at a time (model.head_chunk_tokens); set it to 0"));
  const void* x = forward_layers(inputs, targets, positions);
  return head_forward(global_tensors(layout_, params_, es_), x, targets != nullptr);
}

const void* Transformer::forward_layers(const int32_t* inputs, const int32_t* targets,
                                        const int32_t* positions) {
  FY_CHECK(params_, "forward() needs a model built with ModelState::kFull");
  set_tokens(inputs, targets, positions);
  GlobalTensors g = global_tensors(layout_, params_, es_);
  embed_forward(g.wte, g.wpe, x0_);
  const void* x = x0_;
  for (int l = 0; l < cfg_.n_layer; ++l) {
    block_forward(layer_tensors(layout_, l, params_, es_), x, acts_[l]);
    x = acts_[l].out;
  }
  return x;
}

void Transformer::backward(float loss_scale) {
  GlobalTensors g = global_tensors(layout_, params_, es_);
  GlobalTensors dg = global_grads();
  head_backward(g, dg, last_layer_output(), loss_scale, dres_);
  backward_layers();
}

float Transformer::forward_backward(const int32_t* inputs, const int32_t* targets,
                                    const int32_t* positions, float loss_scale) {
  forward_layers(inputs, targets, positions);
  GlobalTensors g = global_tensors(layout_, params_, es_);
  GlobalTensors dg = global_grads();
  const float loss = head_train(g, dg, last_layer_output(), loss_scale, dres_);
  backward_layers();
  return loss;
}

const void* Transformer::last_layer_output() const { return cfg_.n_layer ? acts_.back().out : x0_; }

void Transformer::backward_layers() {
  GlobalTensors dg = global_grads();
  for (int l = cfg_.n_layer - 1; l >= 0; --l) {
    const void* x_in = l ? acts_[l - 1].out : x0_;
    block_backward(layer_tensors(layout_, l, params_, es_), layer_grads(l), x_in, acts_[l], dres_);
  }
  embed_backward(dg, dres_);
}

}  // namespace fuyou
