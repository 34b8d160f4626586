// Text generation with a key/value cache: the model's forward for a few new tokens at a time
// over the keys and values of the tokens before them (GptDecoder), and the choice of the next
// token from its logits (greedy, temperature, top-p).
//
// The decoder holds the model's weights on a Backend in its storage type, and per layer a
// key cache and a value cache of (capacity, Hkv D) each. step() runs the new tokens through
// every layer with the backend's ordinary kernels (norms, GEMMs, MLP) and the two decoding
// kernels (Backend::rope_forward_at, attention_decode), and returns the last token's logits.
// A prompt runs in chunks of up to kDecoderChunkRows tokens; each generated token is one step.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/config.h"
#include "fuyou/model.h"
#include "fuyou/rng.h"

namespace fuyou {

// Rows of the longest step (a prompt longer than this runs in several): bounds the
// workspace a long prompt needs.
inline constexpr int kDecoderChunkRows = 256;

// Device bytes a decoder of `capacity` positions needs: weights, caches, workspace.
uint64_t decoder_device_bytes(const ModelConfig& cfg, int capacity, size_t elem_bytes);

class GptDecoder {
 public:
  // Allocates everything up front; throws Error, naming the sizes, when the weights and
  // caches do not fit the backend's device memory (a model larger than the device would need
  // its layers streamed, which generation does not do).
  GptDecoder(const ModelConfig& cfg, Backend& backend, int capacity);
  ~GptDecoder();
  GptDecoder(const GptDecoder&) = delete;
  GptDecoder& operator=(const GptDecoder&) = delete;

  // The weights: make_gpt_layout(cfg) order, layout().total fp32 values (rounded to the
  // backend's storage type on the way).
  void set_params(const float* host_params);
  // Empties the cache: the next step starts at position 0.
  void reset() { pos_ = 0; }
  int position() const { return pos_; }
  int capacity() const { return capacity_; }

  // Runs `n` tokens at positions position() .. position()+n-1 and returns the fp32 logits (V)
  // after the last of them. Throws Error when they would pass capacity().
  const std::vector<float>& step(const int32_t* tokens, int n);

 private:
  void run_chunk(const int32_t* tokens, int n);
  void norm(void* out, const void* in, const void* w, const void* b, int n);

  ModelConfig cfg_;
  Backend& be_;
  int capacity_;
  int pos_ = 0;
  size_t es_;
  ParamLayout layout_;
  Family family_;
  void* params_ = nullptr;
  std::vector<void*> k_cache_, v_cache_;  // per layer (capacity, Hkv D)
  int32_t* tokens_ = nullptr;             // (rows)
  void *x_ = nullptr, *ln_ = nullptr, *qkvc_ = nullptr, *atty_ = nullptr, *res_ = nullptr;
  void *fch_ = nullptr, *fcg_ = nullptr, *logits_ = nullptr;
  float *mean_ = nullptr, *rstd_ = nullptr;
  std::vector<char> host_logits_raw_;
  std::vector<float> host_logits_;
  std::vector<void*> owned_;
};

// How the next token is chosen: temperature 0 is greedy (the first of the largest logits, as
// torch.argmax); otherwise softmax(logits / temperature) restricted to the smallest set of
// most likely tokens whose probabilities reach top_p (nucleus sampling; 1 keeps all), drawn
// with `rng`.
struct SamplingOptions {
  double temperature = 0;
  double top_p = 1.0;
};
int32_t sample_token(const std::vector<float>& logits, const SamplingOptions& opts, Rng& rng);

}  // namespace fuyou
