// Text generation with a key/value cache: the model's forward for a few new tokens at a time
// over the keys and values of the tokens before them (GptDecoder), and the choice of the next
// token from its logits (greedy, temperature, top-p).
//
// The decoder holds the model's weights on a Backend in its storage type, and per layer a
// key cache and a value cache of (capacity, Hkv D) each. step() runs the new tokens through
// every layer with the backend's ordinary kernels (norms, GEMMs, MLP) and the two decoding
// kernels (Backend::rope_forward_at, attention_decode), and returns the last token's logits.
// A prompt runs in chunks of up to kDecoderChunkRows tokens; each generated token is one step.
//
// A model whose weights do not fit the device beside the caches streams its layers: the
// embedding and final groups stay on the device, every layer's weights are kept in (page-locked)
// host memory, and each step copies layer l+1 into one of two device slots while layer l
// computes from the other. Every step then moves all layer weights across the host link, so a
// step costs at least (layer bytes) / (host-to-device bandwidth), whatever its number of tokens:
// a long prompt is cheap per token, each generated token pays the whole transfer.
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
// The same with the layers streamed: the embedding and final groups, two layer slots, caches
// and workspace.
uint64_t decoder_streaming_device_bytes(const ModelConfig& cfg, int capacity, size_t elem_bytes);

// Where the layer weights live: kAuto streams them only when the whole model does not fit.
enum class LayerStreaming { kAuto, kAlways, kNever };

// What streaming cost so far (zero when the weights are resident).
struct DecoderStreamStats {
  uint64_t bytes = 0;  // copied to the device
  double copy_s = 0;   // time spent copying (on the copy thread)
  double wait_s = 0;   // time compute waited for a layer's weights
};

class GptDecoder {
 public:
  // Allocates everything up front; throws Error, naming the sizes, when even the streaming
  // form (the globals, two layer slots, the caches and the workspace) does not fit the
  // backend's device memory, or when kNever is asked and the whole model does not fit.
  GptDecoder(const ModelConfig& cfg, Backend& backend, int capacity,
             LayerStreaming streaming = LayerStreaming::kAuto);
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
  bool streaming() const { return streaming_; }
  const DecoderStreamStats& stream_stats() const { return stats_; }
  // Bytes of the layer weights that every streamed step copies.
  uint64_t streamed_bytes_per_step() const;

  // Runs `n` tokens at positions position() .. position()+n-1 and returns the fp32 logits (V)
  // after the last of them. Throws Error when they would pass capacity().
  const std::vector<float>& step(const int32_t* tokens, int n);

 private:
  void run_chunk(const int32_t* tokens, int n);
  void run_layer(const LayerTensors& w, int l, int n);
  void norm(void* out, const void* in, const void* w, const void* b, int n);
  // res = a + b, then out = the norm of res (one fused kernel).
  void residual_norm(void* res, void* out, const void* a, const void* b, const void* w,
                     const void* bias, int n);
  void load_layer(int l);  // streaming: layer l's weights into slot_[l % 2]

  ModelConfig cfg_;
  Backend& be_;
  int capacity_;
  int pos_ = 0;
  size_t es_;
  ParamLayout layout_;
  const FamilyTraits& fam_;
  RopeTable rope_;  // llama: the rotary frequencies of cfg_
  bool streaming_ = false;
  void* params_ = nullptr;                    // resident: every group; streaming: null
  void *embed_ = nullptr, *final_ = nullptr;  // streaming: the first and last groups
  void* slot_[2] = {nullptr, nullptr};        // streaming: two layer slots
  std::vector<char> host_layers_;             // streaming: the flat parameters, storage type
  bool host_registered_ = false;
  DecoderStreamStats stats_;
  std::vector<void*> k_cache_, v_cache_;  // per layer (capacity, Hkv D)
  int32_t* tokens_ = nullptr;             // (rows)
  void *x_ = nullptr, *ln_ = nullptr, *qkvc_ = nullptr, *atty_ = nullptr, *res_ = nullptr;
  void *fch_ = nullptr, *fcg_ = nullptr, *logits_ = nullptr;
  float *mean_ = nullptr, *rstd_ = nullptr, *qk_rstd_ = nullptr;
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
