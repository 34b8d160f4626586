#include "fuyou/lora.h"

#include <algorithm>
#include <cmath>

#include "fuyou/error.h"
#include "fuyou/rng.h"

namespace fuyou {
namespace {

constexpr size_t kAlign = 16;  // as the base's layout: tensors on 16-element boundaries
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// One Hugging Face module of a family: its name, the engine linear it lives in, its output
// rows there, and its path below the layer's prefix.
struct ModuleRow {
  std::string name;
  LoraLinear linear;
  int row0, rows;
  std::string path;
};

// The family's modules in lora_module_names() order (a name may have several rows: GPT-2's
// c_proj is the attention's and the MLP's projection, as PEFT's suffix match finds both), and
// the PEFT prefix of layer l.
std::vector<ModuleRow> module_rows(const ModelConfig& cfg, std::string* layer_prefix) {
  const int C = cfg.d_model, F = cfg.d_ff, A = cfg.attn_width();
  const int KV = cfg.kv_heads() * cfg.head_size();
  if (cfg.family == "llama") {
    if (layer_prefix) *layer_prefix = "base_model.model.model.layers.";
    return {{"q_proj", LoraLinear::kQkv, 0, A, "self_attn.q_proj"},
            {"k_proj", LoraLinear::kQkv, A, KV, "self_attn.k_proj"},
            {"v_proj", LoraLinear::kQkv, A + KV, KV, "self_attn.v_proj"},
            {"o_proj", LoraLinear::kProj, 0, C, "self_attn.o_proj"},
            {"gate_proj", LoraLinear::kFc, 0, F, "mlp.gate_proj"},
            {"up_proj", LoraLinear::kFc, F, F, "mlp.up_proj"},
            {"down_proj", LoraLinear::kFcProj, 0, C, "mlp.down_proj"}};
  }
  if (cfg.family == "gpt2") {
    if (layer_prefix) *layer_prefix = "base_model.model.transformer.h.";
    return {{"c_attn", LoraLinear::kQkv, 0, A + 2 * KV, "attn.c_attn"},
            {"c_proj", LoraLinear::kProj, 0, C, "attn.c_proj"},
            {"c_proj", LoraLinear::kFcProj, 0, C, "mlp.c_proj"},
            {"c_fc", LoraLinear::kFc, 0, F, "mlp.c_fc"}};
  }
  return {};
}

// The engine's name of a linear's weight in layer l, and its (out, in).
std::string linear_name(LoraLinear k) {
  switch (k) {
    case LoraLinear::kQkv:
      return "attn.c_attn";
    case LoraLinear::kProj:
      return "attn.c_proj";
    case LoraLinear::kFc:
      return "mlp.c_fc";
    case LoraLinear::kFcProj:
      return "mlp.c_proj";
  }
  return "";
}

void linear_shape(const ModelConfig& cfg, LoraLinear k, int* out, int* in) {
  const int C = cfg.d_model, F = cfg.d_ff, A = cfg.attn_width();
  const int KV = cfg.kv_heads() * cfg.head_size();
  switch (k) {
    case LoraLinear::kQkv:
      *out = A + 2 * KV, *in = C;
      return;
    case LoraLinear::kProj:
      *out = C, *in = A;
      return;
    case LoraLinear::kFc:
      *out = fc_outputs(family_traits(cfg.family), F), *in = C;
      return;
    case LoraLinear::kFcProj:
      *out = C, *in = F;
      return;
  }
}

}  // namespace

std::vector<std::string> lora_module_names(const ModelConfig& cfg) {
  std::vector<std::string> names;
  for (const ModuleRow& m : module_rows(cfg, nullptr))
    if (std::find(names.begin(), names.end(), m.name) == names.end()) names.push_back(m.name);
  return names;
}

std::vector<std::string> lora_target_modules(const ModelConfig& cfg, const LoraConfig& lora) {
  const std::vector<std::string> names = lora_module_names(cfg);
  if (names.empty())
    throw ConfigError(str("lora: family '", cfg.family,
                          "' has no LoRA targets yet (LoRA supports llama and gpt2)"));
  std::vector<std::string> out;
  for (const std::string& t : lora.targets) {
    if (t == "all-linear") {
      if (lora.targets.size() != 1)
        throw ConfigError("lora.targets: all-linear stands alone (it names every linear)");
      return names;
    }
    if (std::find(names.begin(), names.end(), t) == names.end())
      throw ConfigError(str("lora.targets: '", t, "' is not a module of family ", cfg.family,
                            " (its modules: ", join(names), ", or all-linear)"));
    if (std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
  }
  return out;
}

float lora_scale(const LoraConfig& lora) {
  const double r = lora.rank;
  return static_cast<float>(lora.use_rslora ? lora.alpha / std::sqrt(r) : lora.alpha / r);
}

const LoraAdapter* LoraLayout::find(int layer, LoraLinear linear) const {
  for (const LoraAdapter& a : adapters)
    if (a.layer == layer && a.linear == linear) return &a;
  return nullptr;
}

LoraLayout make_lora_layout(const ModelConfig& cfg, const LoraConfig& lora) {
  FY_CHECK(lora.enabled(), "a LoRA layout needs lora.rank > 0");
  const std::vector<std::string> targets = lora_target_modules(cfg, lora);
  std::string prefix;
  const std::vector<ModuleRow> rows = module_rows(cfg, &prefix);
  LoraLayout L;
  L.rank = lora.rank;
  L.scale = lora_scale(lora);
  ParamLayout& P = L.params;
  auto add = [&](const std::string& name, int64_t rows_, int64_t cols) {
    TensorSpec t;
    t.name = name;
    t.shape = {rows_, cols};
    t.numel = static_cast<size_t>(rows_ * cols);
    t.group = static_cast<int>(P.groups.size()) - 1;
    t.offset = P.total;
    t.decay = true;  // torch's AdamW over the adapters decays every one of them
    P.total += align_up(t.numel);
    P.tensors.push_back(t);
    return static_cast<int>(P.tensors.size()) - 1;
  };
  for (int l = 0; l < cfg.n_layer; ++l) {
    ParamGroup g;
    g.name = str("layer.", l);
    g.offset = P.total;
    g.first_tensor = P.tensors.size();
    P.groups.push_back(g);
    for (int k = 0; k < kLoraLinears; ++k) {
      LoraAdapter a;
      a.layer = l;
      a.linear = static_cast<LoraLinear>(k);
      linear_shape(cfg, a.linear, &a.out, &a.in);
      for (const ModuleRow& m : rows) {
        if (m.linear != a.linear) continue;
        if (std::find(targets.begin(), targets.end(), m.name) == targets.end()) continue;
        LoraPart p;
        p.module = m.name;
        p.peft_prefix = str(prefix, l, ".", m.path);
        p.row0 = m.row0;
        p.rows = m.rows;
        p.slot = static_cast<int>(a.parts.size());
        a.parts.push_back(p);
      }
      if (a.parts.empty()) continue;
      a.width = static_cast<int>(a.parts.size()) * lora.rank;
      const std::string base = str("h.", l, ".", linear_name(a.linear));
      a.a_tensor = add(base + ".lora_A", a.width, a.in);
      a.b_tensor = add(base + ".lora_B", a.out, a.width);
      L.adapters.push_back(a);
    }
    ParamGroup& last = P.groups.back();
    last.numel = P.total - last.offset;
    last.num_tensors = P.tensors.size() - last.first_tensor;
  }
  return L;
}

void init_lora_params(const LoraLayout& layout, uint64_t seed, float* params) {
  std::fill(params, params + layout.params.total, 0.0f);
  for (const LoraAdapter& a : layout.adapters) {
    float* A = params + layout.params.tensors[a.a_tensor].offset;
    const double bound = 1.0 / std::sqrt(static_cast<double>(a.in));
    Rng rng(seed ^ 0x4c6f5241ull, static_cast<uint64_t>(a.a_tensor));
    for (size_t i = 0; i < static_cast<size_t>(a.width) * a.in; ++i)
      A[i] = static_cast<float>((2 * rng.uniform() - 1) * bound);
  }  // B stays zero: the adapted model starts as the base
}

std::vector<PeftTensor> peft_tensors(const LoraLayout& layout) {
  std::vector<PeftTensor> out;
  for (const LoraAdapter& a : layout.adapters)
    for (const LoraPart& p : a.parts) {
      out.push_back({p.peft_prefix + ".lora_A.weight", layout.rank, a.in});
      out.push_back({p.peft_prefix + ".lora_B.weight", p.rows, layout.rank});
    }
  return out;
}

namespace {

// PEFT tensor i's adapter, part and whether it is the B.
struct PeftSlot {
  const LoraAdapter* a;
  const LoraPart* p;
  bool is_b;
};
PeftSlot peft_slot(const LoraLayout& layout, size_t i) {
  size_t k = 0;
  for (const LoraAdapter& a : layout.adapters)
    for (const LoraPart& p : a.parts) {
      if (k == i) return {&a, &p, false};
      if (k + 1 == i) return {&a, &p, true};
      k += 2;
    }
  FY_CHECK(false, "PEFT tensor ", i, " out of range");
  return {nullptr, nullptr, false};
}

// Calls f(engine element, PEFT element) over PEFT tensor i's elements.
template <typename F>
void walk_peft(const LoraLayout& layout, size_t i, F&& f) {
  const PeftSlot s = peft_slot(layout, i);
  const int r = layout.rank;
  const TensorSpec& A = layout.params.tensors[s.a->a_tensor];
  const TensorSpec& B = layout.params.tensors[s.a->b_tensor];
  if (!s.is_b) {  // rows [slot r, + r) of A (width, in)
    const size_t n = static_cast<size_t>(r) * s.a->in;
    const size_t first = A.offset + static_cast<size_t>(s.p->slot) * r * s.a->in;
    for (size_t e = 0; e < n; ++e) f(first + e, e);
    return;
  }
  for (int o = 0; o < s.p->rows; ++o)  // rows [row0, + rows), columns [slot r, + r) of B
    for (int j = 0; j < r; ++j)
      f(B.offset + static_cast<size_t>(s.p->row0 + o) * s.a->width +
            static_cast<size_t>(s.p->slot) * r + j,
        static_cast<size_t>(o) * r + j);
}

}  // namespace

void get_peft_tensor(const LoraLayout& layout, size_t i, const float* params, float* dst) {
  walk_peft(layout, i, [&](size_t e, size_t k) { dst[k] = params[e]; });
}

void set_peft_tensor(const LoraLayout& layout, size_t i, float* params, const float* src) {
  walk_peft(layout, i, [&](size_t e, size_t k) { params[e] = src[k]; });
}

}  // namespace fuyou
