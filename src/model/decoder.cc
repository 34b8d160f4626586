#include "fuyou/decoder.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <numeric>
#include <type_traits>

#include "fuyou/error.h"
#include "fuyou/sizes.h"
#include "fuyou/timing.h"

namespace fuyou {
namespace {

// The one list of a decoder's workspace: the constructor allocates from it and
// decoder_device_bytes sums it. Sizes in elements of the storage type (float: fp32).
struct DecoderBuffers {
  void *x, *ln, *qkvc, *atty, *res, *fch, *fcg, *logits;
  float *mean, *rstd, *qk_rstd;
};
template <typename Fn>
void for_each_decoder_buffer(const ModelConfig& cfg, int rows, DecoderBuffers& b, Fn&& fn) {
  const size_t C = cfg.d_model, F = cfg.d_ff, V = cfg.vocab_size, R = rows, A = cfg.attn_width();
  const size_t KV = static_cast<size_t>(cfg.kv_heads()) * cfg.head_size();
  const size_t fc = fc_outputs(family_traits(cfg.family), cfg.d_ff);
  fn(b.x, R * C, "decoder residual stream");
  fn(b.ln, R * C, "decoder norm output");
  fn(b.qkvc, R * (A + 2 * KV), "decoder q|k|v");
  fn(b.atty, R * A, "decoder attention output");
  fn(b.res, R * C, "decoder residual after attention");
  fn(b.fch, R * fc, "decoder MLP pre-activation");
  fn(b.fcg, R * F, "decoder MLP activation");
  fn(b.logits, V, "decoder logits");
  fn(b.mean, R, "decoder norm statistics");
  fn(b.rstd, R, "decoder norm statistics");
  if (cfg.qk_norm) fn(b.qk_rstd, R * (cfg.n_head + cfg.kv_heads()), "decoder q/k norm statistics");
}

template <typename P>
size_t bytes_of(P*, size_t n, size_t es) {
  return n * (std::is_same_v<P, float> ? sizeof(float) : es);
}

int chunk_rows(int capacity) { return std::min(capacity, kDecoderChunkRows); }

uint64_t cache_bytes(const ModelConfig& cfg, int capacity, size_t es) {
  return 2ull * cfg.n_layer * capacity * cfg.kv_heads() * cfg.head_size() * es;
}

uint64_t workspace_bytes(const ModelConfig& cfg, int capacity, size_t es) {
  DecoderBuffers b{};
  uint64_t n = sizeof(int32_t) * chunk_rows(capacity);
  for_each_decoder_buffer(cfg, chunk_rows(capacity), b,
                          [&](auto*& p, size_t k, const char*) { n += bytes_of(p, k, es); });
  return n;
}

// Elements of the largest layer group (every layer's is the same size; max for safety).
size_t layer_slot_numel(const ParamLayout& layout) {
  size_t n = 0;
  for (size_t g = 1; g + 1 < layout.groups.size(); ++g) n = std::max(n, layout.groups[g].numel);
  return n;
}

uint64_t streaming_weight_bytes(const ParamLayout& layout, size_t es) {
  return (layout.groups.front().numel + layout.groups.back().numel + 2 * layer_slot_numel(layout)) *
         es;
}

}  // namespace

uint64_t decoder_device_bytes(const ModelConfig& cfg, int capacity, size_t es) {
  return make_gpt_layout(cfg).total * es + cache_bytes(cfg, capacity, es) +
         workspace_bytes(cfg, capacity, es);
}

uint64_t decoder_streaming_device_bytes(const ModelConfig& cfg, int capacity, size_t es) {
  return streaming_weight_bytes(make_gpt_layout(cfg), es) + cache_bytes(cfg, capacity, es) +
         workspace_bytes(cfg, capacity, es);
}

GptDecoder::GptDecoder(const ModelConfig& cfg, Backend& backend, int capacity,
                       LayerStreaming streaming)
    : cfg_(cfg),
      be_(backend),
      capacity_(capacity),
      es_(backend.storage_bytes()),
      layout_(make_gpt_layout(cfg)),
      fam_(family_traits(cfg.family)),
      rope_(rope_table(cfg)) {
  if (capacity < 1)
    throw Error(str("decoder: capacity ", capacity, " positions; at least 1 is needed"));
  const int pos_rows = position_rows(cfg) - fam_.position_offset;
  if (!rotary(fam_) && capacity > pos_rows)
    throw Error(
        str("decoder: ", capacity, " positions, but the model's position table has ", pos_rows));
  const MemoryStats mem = be_.memory();
  const uint64_t free = mem.capacity == 0 ? UINT64_MAX : mem.capacity - mem.used;
  const uint64_t whole = decoder_device_bytes(cfg, capacity, es_);
  const uint64_t streamed = decoder_streaming_device_bytes(cfg, capacity, es_);
  streaming_ =
      streaming == LayerStreaming::kAlways || (streaming == LayerStreaming::kAuto && whole > free);
  const uint64_t need = streaming_ ? streamed : whole;
  if (need > free)
    throw Error(
        str("generation needs ", format_size(need), " of device memory (",
            streaming_ ? "with its layers streamed: the embedding and final weights and two layers "
                       : "weights ",
            format_size(streaming_ ? streaming_weight_bytes(layout_, es_) : layout_.total * es_),
            ", key/value cache of ", capacity, " positions ",
            format_size(cache_bytes(cfg, capacity, es_)), ", workspace ",
            format_size(workspace_bytes(cfg, capacity, es_)), ") but backend ", be_.name(), " has ",
            format_size(free), " free",
            streaming == LayerStreaming::kNever
                ? str("; streaming the layers would need ", format_size(streamed))
                : std::string(),
            ": use a shorter --max-tokens, bf16 weights, or the cpu backend"));
  auto alloc = [&](size_t bytes, const std::string& what) {
    void* p = be_.alloc(bytes, what);
    owned_.push_back(p);
    return p;
  };
  if (streaming_) {
    embed_ = alloc(layout_.groups.front().numel * es_, "decoder embedding weights");
    final_ = alloc(layout_.groups.back().numel * es_, "decoder final weights");
    for (int s = 0; s < 2; ++s)
      slot_[s] = alloc(layer_slot_numel(layout_) * es_, str("decoder layer slot ", s));
  } else {
    params_ = alloc(layout_.total * es_, "decoder weights");
  }
  const size_t kv_row = static_cast<size_t>(cfg.kv_heads()) * cfg.head_size();
  for (int l = 0; l < cfg.n_layer; ++l) {
    k_cache_.push_back(alloc(capacity * kv_row * es_, str("layer ", l, " key cache")));
    v_cache_.push_back(alloc(capacity * kv_row * es_, str("layer ", l, " value cache")));
  }
  const int rows = chunk_rows(capacity);
  tokens_ = static_cast<int32_t*>(alloc(sizeof(int32_t) * rows, "decoder tokens"));
  DecoderBuffers b{};
  for_each_decoder_buffer(cfg, rows, b, [&](auto*& p, size_t n, const char* what) {
    p = static_cast<std::remove_reference_t<decltype(p)>>(alloc(bytes_of(p, n, es_), what));
  });
  x_ = b.x, ln_ = b.ln, qkvc_ = b.qkvc, atty_ = b.atty, res_ = b.res, fch_ = b.fch, fcg_ = b.fcg;
  logits_ = b.logits, mean_ = b.mean, rstd_ = b.rstd, qk_rstd_ = b.qk_rstd;
  host_logits_raw_.resize(static_cast<size_t>(cfg.vocab_size) * es_);
  host_logits_.resize(cfg.vocab_size);
}

GptDecoder::~GptDecoder() {
  if (host_registered_) be_.unregister_host(host_layers_.data());
  for (void* p : owned_) be_.free(p);
}

uint64_t GptDecoder::streamed_bytes_per_step() const {
  if (!streaming_) return 0;
  uint64_t n = 0;
  for (int l = 0; l < cfg_.n_layer; ++l) n += layout_.groups[1 + l].numel * es_;
  return n;
}

void GptDecoder::set_params(const float* host_params) {
  // The weights in the storage type: the caller's fp32 values as they are, unless they must
  // be rounded or the decoder keeps its own copy to stream from.
  const char* stored = reinterpret_cast<const char*>(host_params);
  std::vector<char> rounded;
  if (be_.storage_type() != ElemType::kF32 || streaming_) {
    rounded.resize(layout_.total * es_);
    if (be_.storage_type() == ElemType::kF32)
      std::memcpy(rounded.data(), host_params, rounded.size());
    else
      round_to(be_.storage_type(), reinterpret_cast<uint16_t*>(rounded.data()), host_params,
               layout_.total);
    stored = rounded.data();
  }
  if (!streaming_) {
    be_.copy_to_device(params_, stored, layout_.total * es_);
  } else {
    const ParamGroup &ge = layout_.groups.front(), &gf = layout_.groups.back();
    be_.copy_to_device(embed_, stored + ge.offset * es_, ge.numel * es_);
    be_.copy_to_device(final_, stored + gf.offset * es_, gf.numel * es_);
    be_.synchronize();
    if (host_registered_) be_.unregister_host(host_layers_.data());
    host_layers_ = std::move(rounded);
    // Page-locked, the copies run at the link's speed and beside compute; refused (the
    // locked-memory limit), they still work, slower.
    host_registered_ = be_.register_host(host_layers_.data(), host_layers_.size());
  }
  be_.synchronize();
  pos_ = 0;
}

void GptDecoder::load_layer(int l) {
  const auto t0 = std::chrono::steady_clock::now();
  const ParamGroup& g = layout_.groups[1 + l];
  be_.copy_to_device(slot_[l % 2], host_layers_.data() + g.offset * es_, g.numel * es_);
  stats_.copy_s += seconds_since(t0);
  stats_.bytes += g.numel * es_;
}

void GptDecoder::norm(void* out, const void* in, const void* w, const void* b, int n) {
  norm_forward(be_, fam_, out, mean_, rstd_, in, w, b, cfg_.norm_eps, n, cfg_.d_model);
}

void GptDecoder::residual_norm(void* res, void* out, const void* a, const void* b, const void* w,
                               const void* bias, int n) {
  residual_norm_forward(be_, fam_, res, out, mean_, rstd_, a, b, w, bias, cfg_.norm_eps, n,
                        cfg_.d_model);
}

// One layer's forward of n rows at pos_ .. pos_+n-1 (block_forward's order of operations, with
// the cache's attention), x_ in and out.
void GptDecoder::run_layer(const LayerTensors& w, int l, int n) {
  const int C = cfg_.d_model, F = cfg_.d_ff;
  const int H = cfg_.n_head, Hkv = cfg_.kv_heads(), D = cfg_.head_size(), A = cfg_.attn_width();
  const int QKV = A + 2 * Hkv * D;
  const size_t nc = static_cast<size_t>(n) * C;
  const bool post = post_norm(cfg_);  // the norms on the sublayers' outputs (OLMo 2)
  if (!post) norm(ln_, x_, w.ln1_w, w.ln1_b, n);
  be_.matmul_forward(qkvc_, post ? x_ : ln_, w.qkv_w, w.qkv_b, n, C, QKV);
  if (cfg_.qk_norm)
    be_.qk_norm_forward(qkvc_, nullptr, qk_rstd_, w.q_norm_w, w.k_norm_w, cfg_.norm_eps, n,
                        qk_norm_spans(cfg_));
  if (rotary(fam_) && cfg_.rotates(l)) be_.rope_forward_at(qkvc_, n, pos_, H, Hkv, D, rope_);
  be_.attention_decode(atty_, k_cache_[l], v_cache_[l], qkvc_, n, pos_, H, Hkv, D);
  if (!post) {
    be_.matmul_forward(res_, atty_, w.proj_w, w.proj_b, n, A, C);
    residual_norm(res_, ln_, res_, x_, w.ln2_w, w.ln2_b, n);
  } else {
    be_.matmul_forward(ln_, atty_, w.proj_w, w.proj_b, n, A, C);
    norm(res_, ln_, w.ln1_w, w.ln1_b, n);
    be_.add(res_, res_, x_, nc);
  }
  be_.matmul_forward(fch_, post ? res_ : ln_, w.fc_w, w.fc_b, n, C, fc_outputs(fam_, F));
  mlp_activation_forward(be_, fam_, fcg_, fch_, n, F);
  // The block's input is not needed any more (res_ holds it plus attention): its buffer
  // takes the block's output.
  if (!post) {
    be_.matmul_forward(x_, fcg_, w.fcproj_w, w.fcproj_b, n, F, C);
  } else {
    be_.matmul_forward(ln_, fcg_, w.fcproj_w, w.fcproj_b, n, F, C);
    norm(x_, ln_, w.ln2_w, w.ln2_b, n);
  }
  be_.add(x_, x_, res_, nc);
}

// The forward of n tokens at pos_ .. pos_+n-1, leaving the last row's logits in logits_.
void GptDecoder::run_chunk(const int32_t* tokens, int n) {
  const int C = cfg_.d_model, V = cfg_.vocab_size;
  for (int i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= V)
      throw Error(str("token id ", tokens[i], " at position ", pos_ + i,
                      " is outside the vocabulary (", V, ")"));
  be_.copy_to_device(tokens_, tokens, sizeof(int32_t) * n);
  GlobalTensors g = streaming_ ? global_tensors(layout_, embed_, final_, es_)
                               : global_tensors(layout_, params_, es_);
  const void* wpe = nullptr;
  if (g.wpe) {  // row pos_ (+ OPT's offset) is the first new row's position
    const int row0 = pos_ + fam_.position_offset;
    wpe = static_cast<const char*>(g.wpe) + static_cast<size_t>(row0) * C * es_;
  }
  if (!streaming_) {
    be_.embedding_forward(x_, tokens_, g.wte, wpe, 1, n, C);
    for (int l = 0; l < cfg_.n_layer; ++l) run_layer(layer_tensors(layout_, l, params_, es_), l, n);
  } else {
    // Layer l+1 is copied into the other slot on a thread of its own while layer l computes
    // (layer 0 beside the embedding); a slot is refilled only after the layer that read it has
    // finished (finish_compute), so the copies wait for nothing but themselves
    // (caller-ordered).
    be_.finish_compute();
    be_.set_caller_ordered(true);
    struct Restore {
      Backend& be;
      ~Restore() { be.set_caller_ordered(false); }
    } restore{be_};
    std::future<void> next = std::async(std::launch::async, [this] { load_layer(0); });
    be_.embedding_forward(x_, tokens_, g.wte, wpe, 1, n, C);
    for (int l = 0; l < cfg_.n_layer; ++l) {
      const auto t0 = std::chrono::steady_clock::now();
      next.get();
      stats_.wait_s += seconds_since(t0);
      if (l + 1 < cfg_.n_layer)
        next = std::async(std::launch::async, [this, l] { load_layer(l + 1); });
      run_layer(layer_group_tensors(layout_, l, slot_[l % 2], es_), l, n);
      be_.finish_compute();
    }
  }
  const void* last = static_cast<const char*>(x_) + static_cast<size_t>(n - 1) * C * es_;
  norm(ln_, last, g.lnf_w, g.lnf_b, 1);
  be_.matmul_forward(logits_, ln_, g.lm_head, nullptr, 1, C, V);
  pos_ += n;
}

const std::vector<float>& GptDecoder::step(const int32_t* tokens, int n) {
  if (n < 1) throw Error("decoder: a step needs at least one token");
  if (pos_ + n > capacity_)
    throw Error(str("decoder: ", pos_, " cached + ", n, " new tokens exceed its capacity of ",
                    capacity_, " positions"));
  for (int done = 0; done < n;) {
    const int k = std::min(n - done, chunk_rows(capacity_));
    run_chunk(tokens + done, k);
    done += k;
  }
  be_.finish_compute();
  be_.copy_to_host(host_logits_raw_.data(), logits_, host_logits_raw_.size());
  be_.synchronize();
  widen_from(be_.storage_type(), host_logits_.data(), host_logits_raw_.data(), host_logits_.size());
  return host_logits_;
}

int32_t sample_token(const std::vector<float>& logits, const SamplingOptions& opts, Rng& rng) {
  FY_CHECK(!logits.empty(), "sample_token: no logits");
  if (opts.temperature <= 0)
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  const double m = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double sum = 0;
  for (size_t i = 0; i < p.size(); ++i) sum += p[i] = std::exp((logits[i] - m) / opts.temperature);
  std::vector<int32_t> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  // Most likely first; ties by id, so a seed gives the same draw everywhere.
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  size_t keep = 0;
  double mass = 0;
  while (keep < order.size() && (keep == 0 || mass < opts.top_p * sum)) mass += p[order[keep++]];
  double u = rng.uniform() * mass;
  for (size_t i = 0; i < keep; ++i) {
    u -= p[order[i]];
    if (u < 0) return order[i];
  }
  return order[keep - 1];
}

}  // namespace fuyou
