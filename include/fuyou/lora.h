// LoRA adapters over a frozen base (lora config section, docs/lora.md).
//
// An adapted linear computes y = W x + s B (A x): W the frozen base weight (out, in), A (r, in)
// and B (out, r) the adapter, s = alpha / r (alpha / sqrt(r) with use_rslora). The engine's
// linears are packed where Hugging Face's modules are not (llama's q|k|v and gate|up), so one
// engine linear may carry the adapters of several modules (its parts). Such a linear's adapter
// is stored as the GEMMs use it: A is the parts' A matrices stacked, (P r, in), and B is
// (out, P r) block-diagonal, part p's B in its own output rows and columns [p r, (p + 1) r),
// zero elsewhere. The zero blocks get their gradient cleared after each backward
// (Transformer::lora_backward), so AdamW keeps them zero (zero gradient, zero moments, zero
// weight: the update and the decay are zero), and the gradient norm does not see them.
//
// One list of adapter tensors (LoraLayout::params, a ParamLayout: one group per layer, an A
// and a B tensor per adapted linear) drives init, the optimizer, import and export; the parts
// name the PEFT tensors each block of it is.
#pragma once

#include <string>
#include <vector>

#include "fuyou/config.h"
#include "fuyou/model.h"

namespace fuyou {

// The linears of a block, as the engine computes them.
enum class LoraLinear { kQkv, kProj, kFc, kFcProj };
inline constexpr int kLoraLinears = 4;

// One Hugging Face module's adapter inside an engine linear.
struct LoraPart {
  std::string module;       // "q_proj", "c_attn", ...
  std::string peft_prefix;  // "base_model.model.model.layers.3.self_attn.q_proj"
  int row0 = 0, rows = 0;   // the module's output rows within the linear's
  int slot = 0;             // its block of A's rows and B's columns: [slot r, (slot + 1) r)
};

struct LoraAdapter {
  int layer = 0;
  LoraLinear linear = LoraLinear::kQkv;
  int in = 0, out = 0;
  int width = 0;                   // P r: A's rows, B's columns
  std::vector<LoraPart> parts;     // in slot order
  int a_tensor = 0, b_tensor = 0;  // indices into LoraLayout::params.tensors
};

struct LoraLayout {
  int rank = 0;
  float scale = 0;     // s
  ParamLayout params;  // adapter tensors: "h.L.<linear>.lora_A" (width, in), ".lora_B" (out, width)
  std::vector<LoraAdapter> adapters;  // layer by layer, in LoraLinear order
  // The adapter of (layer, linear), or null when that linear has none.
  const LoraAdapter* find(int layer, LoraLinear linear) const;
};

// The Hugging Face module names a family's LoRA targets may name (llama: q_proj, k_proj,
// v_proj, o_proj, gate_proj, up_proj, down_proj; gpt2: c_attn, c_proj, c_fc), in this order.
// Empty for a family LoRA does not support yet.
std::vector<std::string> lora_module_names(const ModelConfig& cfg);
// lora.targets with all-linear expanded; ConfigError naming the value that is not a module
// of the family.
std::vector<std::string> lora_target_modules(const ModelConfig& cfg, const LoraConfig& lora);
// The scale s of a config: alpha / rank, or alpha / sqrt(rank) with use_rslora.
float lora_scale(const LoraConfig& lora);

LoraLayout make_lora_layout(const ModelConfig& cfg, const LoraConfig& lora);

// PEFT's initial adapters (init: peft): each part's A Kaiming-uniform (a = sqrt(5), so
// uniform in +-1/sqrt(in)), B zero; deterministic in seed. `params` is the layout's flat array.
void init_lora_params(const LoraLayout& layout, uint64_t seed, float* params);

// A PEFT tensor (name, (rows, cols) row-major) of the adapters, and back: export and import
// walk the parts. The B of part p is rows [row0, row0 + rows) of columns [slot r, + r).
struct PeftTensor {
  std::string name;  // "<peft_prefix>.lora_A.weight" / ".lora_B.weight"
  int rows = 0, cols = 0;
};
// Every PEFT tensor of the layout, layer by layer, A before B.
std::vector<PeftTensor> peft_tensors(const LoraLayout& layout);
// Copies PEFT tensor `i` of peft_tensors() out of / into the flat adapter array.
void get_peft_tensor(const LoraLayout& layout, size_t i, const float* params, float* dst);
void set_peft_tensor(const LoraLayout& layout, size_t i, float* params, const float* src);

}  // namespace fuyou
