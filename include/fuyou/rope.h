// The rotary embedding's frequencies as every backend's kernels take them: one inverse
// frequency per rotated pair of a head and one scale on cos and sin. The model computes the
// table once from its config (rope_table in fuyou/model.h) for every variant transformers has
// (default, linear, dynamic, yarn, llama3), so a kernel only ever rotates pair i of a head at
// position p by the angle p * inv_freq[i], in fp32, as transformers' rotary embedding does.
#pragma once

#include <cmath>

namespace fuyou {

// Head sizes up to 512 (256 pairs); the model config refuses larger ones.
inline constexpr int kMaxRopePairs = 256;

struct RopeTable {
  int pairs = 0;       // D / 2: pair i is (x[i], x[i + D/2]) of a head of size D
  float scale = 1.0f;  // cos and sin are multiplied by it (yarn's attention factor; else 1)
  float inv_freq[kMaxRopePairs] = {};
};

// The cos/sin scales transformers derives where a config gives no attention_factor, in
// double as it computes them: yarn's mscale (0.1 k ln(factor) + 1, or 1 for factor <= 1; the
// attention factor is mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
// given, else mscale(factor, 1)) and longrope's sqrt(1 + ln(factor) / ln(original context)).
inline double yarn_mscale(double factor, double k) {
  return factor <= 1 ? 1.0 : 0.1 * k * std::log(factor) + 1.0;
}
inline double longrope_attention_factor(double factor, int original_context) {
  return factor <= 1 ? 1.0 : std::sqrt(1 + std::log(factor) / std::log(original_context));
}

}  // namespace fuyou
