#include "fuyou/family.h"

#include "fuyou/error.h"

namespace fuyou {

const std::vector<FamilyTraits>& family_table() {
  using N = NormKind;
  using M = MlpKind;
  using P = Positions;
  static const std::vector<FamilyTraits> table = {
      // name, norm, mlp, positions, position_offset, biases, open_shape
      // GPT-2 / GPT-3: learned positions, LayerNorm, GELU, tied head.
      {"gpt2", N::kLayerNorm, M::kGelu, P::kLearned, 0, true, false},
      // OPT: learned positions at offset 2, pre-LN LayerNorm, ReLU, tied head.
      {"opt", N::kLayerNorm, M::kRelu, P::kLearned, 2, true, false},
      // Llama and its kin (Qwen2/3, Mistral, Phi-3, SmolLM3): RMSNorm, rotary positions,
      // SwiGLU, grouped-query attention.
      {"llama", N::kRmsNorm, M::kSwiglu, P::kRotary, 0, false, true},
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
  throw ConfigError(str("model.family: '", name, "' is not one of ", join(family_names())));
}

}  // namespace fuyou
