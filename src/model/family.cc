#include "fuyou/family.h"

#include "fuyou/config.h"
#include "fuyou/error.h"

namespace fuyou {

const std::vector<FamilyTraits>& family_table() {
  using N = NormKind;
  using M = MlpKind;
  using P = Positions;
  static const std::vector<FamilyTraits> table = {
      // id, name, summary, norm, mlp, positions, position_offset, biases, open_shape
      {Family::kGpt2, "gpt2", "GPT-2 / GPT-3: learned positions, LayerNorm, GELU, tied head",
       N::kLayerNorm, M::kGelu, P::kLearned, 0, true, false},
      {Family::kOpt, "opt", "OPT: learned positions at offset 2, pre-LN LayerNorm, ReLU, tied head",
       N::kLayerNorm, M::kRelu, P::kLearned, 2, true, false},
      {Family::kLlama, "llama",
       "Llama and its kin (Qwen2/3, Mistral): RMSNorm, rotary positions, SwiGLU, "
       "grouped-query attention",
       N::kRmsNorm, M::kSwiglu, P::kRotary, 0, false, true},
  };
  return table;
}

std::vector<std::string> family_names() {
  std::vector<std::string> names;
  for (const FamilyTraits& t : family_table()) names.push_back(t.name);
  return names;
}

const FamilyTraits& family_traits(const std::string& name) {
  for (const FamilyTraits& t : family_table())
    if (name == t.name) return t;
  std::string names;
  for (const FamilyTraits& t : family_table())
    names += std::string(names.empty() ? "" : ", ") + t.name;
  throw ConfigError(str("model.family: '", name, "' is not one of ", names));
}

const FamilyTraits& family_traits(const ModelConfig& cfg) { return family_traits(cfg.family); }

}  // namespace fuyou
