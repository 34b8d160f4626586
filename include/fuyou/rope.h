// The rotary embedding's frequencies as every backend's kernels take them: one inverse
// frequency per rotated pair of a head and one scale on cos and sin. The model computes the
// table once from its config (rope_table in fuyou/model.h) for every variant transformers has
// (default, linear, dynamic, yarn, llama3), so a kernel only ever rotates pair i of a head at
// position p by the angle p * inv_freq[i], in fp32, as transformers' rotary embedding does.
#pragma once

namespace fuyou {

// Head sizes up to 512 (256 pairs); the model config refuses larger ones.
inline constexpr int kMaxRopePairs = 256;

struct RopeTable {
  int pairs = 0;       // D / 2: pair i is (x[i], x[i + D/2]) of a head of size D
  float scale = 1.0f;  // cos and sin are multiplied by it (yarn's attention factor; else 1)
  float inv_freq[kMaxRopePairs] = {};
};

}  // namespace fuyou
