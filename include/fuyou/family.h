// The model families as one table. What a family computes is a row of traits (norm, MLP,
// positions, biases, which attention keys it takes), read by the parameter layout, the
// forward and backward passes, the decoder, the FLOP count, the config checks and the
// profiles; nothing else names a family. The Hugging Face model types that convert to each
// family are the rows of src/formats/hf_config.cc's table.
#pragma once

#include <string>
#include <vector>

namespace fuyou {

// LayerNorm (weight and bias, eps 1e-5) or RMSNorm (weight, eps model.norm_eps).
enum class NormKind { kLayerNorm, kRmsNorm };
// tanh-approximated GELU, ReLU, or SiLU-gated (fc packs gate|up: 2 d_ff outputs).
enum class MlpKind { kGelu, kRelu, kSwiglu };
// A learned position table added to the embedding, or rotary embeddings on q and k.
enum class Positions { kLearned, kRotary };

struct FamilyTraits {
  const char* name;  // model.family
  NormKind norm;
  MlpKind mlp;
  Positions positions;
  int position_offset;  // learned positions: the table's row of position 0 (OPT: 2)
  // Biases on the norms, the q/k/v and attention projections and the MLP; without, only
  // q/k/v may have them (model.qkv_bias).
  bool biases;
  // The attention's shape is configurable: model.n_kv_head, head_dim, qk_norm, qkv_bias, an
  // untied head, and (with rotary positions) rope_* and sliding_window. Otherwise each must
  // keep its default. Such a family also needs an explicit d_ff.
  bool open_shape;
};

// Every family, in the order model.family lists them.
const std::vector<FamilyTraits>& family_table();
// The row of a family name; ConfigError listing the names for any other.
const FamilyTraits& family_traits(const std::string& name);
std::vector<std::string> family_names();

inline bool gated_mlp(const FamilyTraits& t) { return t.mlp == MlpKind::kSwiglu; }
inline bool rotary(const FamilyTraits& t) { return t.positions == Positions::kRotary; }
// The MLP's up projection's outputs: gate and up packed for a gated MLP.
inline int fc_outputs(const FamilyTraits& t, int d_ff) { return gated_mlp(t) ? 2 * d_ff : d_ff; }

}  // namespace fuyou
