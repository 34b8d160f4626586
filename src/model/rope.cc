// The rotary frequencies of each variant transformers implements (its modeling_rope_utils),
// computed in fp32 in the order it computes them, so the engine's angles round as the
// reference's do. Variants the engine does not model are refused by the config, never here.
#include <algorithm>
#include <cmath>

#include "fuyou/error.h"
#include "fuyou/model.h"
#include "kernels/common/element_math.h"

namespace fuyou {
namespace {

// yarn: the dimension at which pairs complete `rotations` turns over `context` positions.
double yarn_correction_dim(double rotations, int dim, double base, int context) {
  return dim * std::log(context / (rotations * 2 * M_PI)) / (2 * std::log(base));
}

void apply_llama3(const ModelConfig& cfg, RopeTable& t) {
  const float factor = cfg.rope_factor;
  const float low = cfg.rope_low_freq_factor, high = cfg.rope_high_freq_factor;
  const double context = cfg.rope_original_context;
  const float low_wavelen = static_cast<float>(context / low);
  const float high_wavelen = static_cast<float>(context / high);
  for (int i = 0; i < t.pairs; ++i) {
    const float inv = t.inv_freq[i];
    const float wavelen = static_cast<float>(2 * M_PI) / inv;
    float scaled = wavelen > low_wavelen ? inv / factor : inv;
    if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
      const float smooth = (static_cast<float>(context) / wavelen - low) / (high - low);
      scaled = (1 - smooth) * scaled / factor + smooth * scaled;
    }
    t.inv_freq[i] = scaled;
  }
}

void apply_yarn(const ModelConfig& cfg, int dim, RopeTable& t) {
  const double base = cfg.rope_theta, factor = cfg.rope_factor;
  double lo = yarn_correction_dim(cfg.rope_beta_fast, dim, base, cfg.rope_original_context);
  double hi = yarn_correction_dim(cfg.rope_beta_slow, dim, base, cfg.rope_original_context);
  if (cfg.rope_truncate) {
    lo = std::floor(lo);
    hi = std::ceil(hi);
  }
  lo = std::max(lo, 0.0);
  hi = std::min(hi, static_cast<double>(dim - 1));
  if (lo == hi) hi += 0.001;  // transformers' guard against a zero-width ramp
  const float flo = static_cast<float>(lo), fwidth = static_cast<float>(hi - lo);
  for (int i = 0; i < t.pairs; ++i) {
    const float pos_freq =
        powf(cfg.rope_theta, static_cast<float>(2 * i) / static_cast<float>(dim));
    const float extrapolation = 1.0f / pos_freq;
    const float interpolation = 1.0f / (static_cast<float>(factor) * pos_freq);
    const float ramp = std::clamp((static_cast<float>(i) - flo) / fwidth, 0.0f, 1.0f);
    const float keep = 1 - ramp;  // the share of the unscaled (extrapolated) frequency
    t.inv_freq[i] = interpolation * (1 - keep) + extrapolation * keep;
  }
  t.scale = cfg.rope_attention_factor > 0 ? cfg.rope_attention_factor
                                          : static_cast<float>(yarn_mscale(factor, 1));
}

// longrope within the original context (the config holds seq_len there): each pair's
// frequency divided by its short factor, cos and sin scaled by the attention factor.
void apply_longrope(const ModelConfig& cfg, int dim, RopeTable& t) {
  FY_CHECK(cfg.rope_short_factor.size() == static_cast<size_t>(t.pairs),
           "longrope: ", cfg.rope_short_factor.size(), " short factors for ", t.pairs, " pairs");
  for (int i = 0; i < t.pairs; ++i) {
    const float pos_freq =
        powf(cfg.rope_theta, static_cast<float>(2 * i) / static_cast<float>(dim));
    t.inv_freq[i] = 1.0f / (cfg.rope_short_factor.values[i] * pos_freq);
  }
  t.scale = cfg.rope_attention_factor > 0 ? cfg.rope_attention_factor
                                          : static_cast<float>(longrope_attention_factor(
                                                cfg.rope_factor, cfg.rope_original_context));
}

}  // namespace

RopeTable default_rope_table(int D, float theta) {
  if (D % 2 != 0 || D / 2 > kMaxRopePairs || D < 2)
    throw ConfigError(str("rotary embeddings need an even head size of at most ", 2 * kMaxRopePairs,
                          ", got ", D));
  RopeTable t;
  t.pairs = D / 2;
  for (int i = 0; i < t.pairs; ++i) t.inv_freq[i] = math::rope_default_inv_freq(i, D, theta);
  return t;
}

RopeTable rope_table(const ModelConfig& cfg) {
  if (!rotary(family_traits(cfg.family))) return RopeTable{};
  const int D = cfg.head_size();
  RopeTable t = default_rope_table(D, cfg.rope_theta);
  const std::string& type = cfg.rope_type;
  if (type == "default" || type == "dynamic") {
    // dynamic NTK keeps the default frequencies within its context, which the config
    // holds seq_len to (parse_model).
  } else if (type == "linear") {
    for (int i = 0; i < t.pairs; ++i) t.inv_freq[i] /= cfg.rope_factor;
  } else if (type == "llama3") {
    apply_llama3(cfg, t);
  } else if (type == "yarn") {
    apply_yarn(cfg, D, t);
  } else if (type == "longrope") {
    apply_longrope(cfg, D, t);
  } else {
    throw ConfigError(str("model.rope_type '", type, "' has no frequencies in the engine"));
  }
  return t;
}

}  // namespace fuyou
