#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "fuyou/data.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/log.h"
#include "fuyou/optim.h"
#include "fuyou/safetensors.h"
#include "fuyou/sizes.h"
#include "fuyou/tokenizer.h"
#include "fuyou/train.h"

namespace fs = std::filesystem;

namespace fuyou {

double group_sum_squares(const float* g, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += static_cast<double>(g[i]) * g[i];
  return s;
}

void split_batch(const int32_t* batch, int B, int T, int32_t* inputs, int32_t* targets) {
  for (int b = 0; b < B; ++b) {
    const int32_t* row = batch + static_cast<size_t>(b) * (T + 1);
    std::copy(row, row + T, inputs + static_cast<size_t>(b) * T);
    std::copy(row + 1, row + T + 1, targets + static_cast<size_t>(b) * T);
  }
}

int64_t split_batch(const int32_t* batch, const uint8_t* counted, int B, int T, int32_t* inputs,
                    int32_t* targets) {
  split_batch(batch, B, T, inputs, targets);
  if (!counted) return static_cast<int64_t>(B) * T;
  int64_t n = 0;
  for (size_t i = 0; i < static_cast<size_t>(B) * T; ++i) {
    if (counted[i]) ++n;
    else targets[i] = kIgnoreTarget;
  }
  return n;
}

int64_t count_targets(const uint8_t* counted, int B, int T) {
  const size_t n = static_cast<size_t>(B) * T;
  if (!counted) return static_cast<int64_t>(n);
  return std::count_if(counted, counted + n, [](uint8_t c) { return c != 0; });
}

double mean_over_counted(const std::vector<float>& means, const std::vector<int64_t>& counts) {
  FY_CHECK(means.size() == counts.size() && !means.empty(), "mean_over_counted: ", means.size(),
           " means for ", counts.size(), " counts");
  if (std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts[0]; })) {
    double s = 0;
    for (float m : means) s += m;
    return s / static_cast<double>(means.size());
  }
  double s = 0, total = 0;
  for (size_t i = 0; i < means.size(); ++i) {
    s += static_cast<double>(means[i]) * static_cast<double>(counts[i]);
    total += static_cast<double>(counts[i]);
  }
  return total > 0 ? s / total : 0.0;
}

StepRunner::StepRunner(const Config& cfg, Backend& backend)
    : cfg_(cfg), be_(backend), model_(cfg.model, backend, cfg.schedule.micro_batch) {
  size_t n = model_.layout().total;
  master_.assign(n, 0.0f);
  m_.assign(n, 0.0f);
  v_.assign(n, 0.0f);
  grad_.assign(n, 0.0f);
  inputs_.resize(model_.tokens_per_batch());
  targets_.resize(model_.tokens_per_batch());
  if (be_.matmul_precision() == MatmulPrecision::kFp16) {
    LossScaleConfig ls;
    ls.initial = cfg.optimizer.initial_loss_scale;
    scaler_ = std::make_unique<DynamicLossScaler>(ls);
  }
}

void StepRunner::init_params() {
  init_gpt_params(cfg_.model, model_.layout(), master_.data());
  set_params(master_.data());
}

void StepRunner::set_params(const float* host_params) {
  if (host_params != master_.data()) std::copy(host_params, host_params + master_.size(), master_.begin());
  be_.copy_to_device(model_.params(), master_.data(), master_.size() * sizeof(float));
}

StepRunner::Result StepRunner::step(int64_t step_index,
                                    const std::vector<const int32_t*>& micro_batches,
                                    const std::vector<const uint8_t*>& masks) {
  const int B = cfg_.schedule.micro_batch, T = cfg_.model.seq_len;
  const int accum = static_cast<int>(micro_batches.size());
  FY_CHECK(accum >= 1, "no micro-batches");
  FY_CHECK(masks.empty() || masks.size() == micro_batches.size(), masks.size(), " loss masks for ",
           accum, " micro-batches");
  Result r;
  model_.zero_grads();
  // The loss is the mean over the counted targets of the whole step (every micro-batch), the
  // mean PyTorch's cross_entropy(ignore_index=-1) gives over the concatenated micro-batches:
  // each counted target weighs the same whichever micro-batch it is in (a mean of per-micro-
  // batch means would overweight the targets of a mostly-masked micro-batch). So the gradient
  // scale is 1 / (counted targets of the step), known before the first backward. Without
  // masks that is N * accum, and float(N * accum) is exactly the float(N) * accum used before
  // masks existed (both exact below 2^24). Nothing counted: scale 0, zero gradient.
  std::vector<int64_t> counts(accum);
  int64_t total = 0;
  for (int k = 0; k < accum; ++k) total += counts[k] = count_targets(masks.empty() ? nullptr : masks[k], B, T);
  r.loss_scale = scaler_ ? scaler_->scale() : 1.0;
  const float scale = backward_scale(total, r.loss_scale);
  std::vector<float> means(accum);
  for (int k = 0; k < accum; ++k) {
    split_batch(micro_batches[k], masks.empty() ? nullptr : masks[k], B, T, inputs_.data(), targets_.data());
    means[k] = model_.forward(inputs_.data(), targets_.data());
    model_.backward(scale);
  }
  r.loss = static_cast<float>(mean_over_counted(means, counts));
  be_.copy_to_host(grad_.data(), model_.grads(), grad_.size() * sizeof(float));

  // Per parameter group in order, each group summed sequentially in double: the same
  // reduction the offloading scheduler performs, so both clip identically. Padding between
  // tensors holds zero gradient.
  double sq = 0;
  for (const ParamGroup& g : model_.layout().groups) sq += group_sum_squares(grad_.data() + g.offset, g.numel);
  const StepDecision d = decide_step(sq, r.loss_scale, cfg_.optimizer.grad_clip, scaler_.get());
  r.grad_norm = d.grad_norm;
  r.lr = learning_rate(cfg_.optimizer, cfg_.schedule, step_index);
  // An fp16 overflow skips the whole update, Adam's step count included (as GradScaler).
  if (!d.apply) {
    r.skipped = true;
    return r;
  }
  const float grad_scale = d.grad_scale;
  ++t_;
  for (const TensorSpec& ts : model_.layout().tensors) {
    AdamWStep s{static_cast<float>(r.lr),
                static_cast<float>(cfg_.optimizer.beta1),
                static_cast<float>(cfg_.optimizer.beta2),
                static_cast<float>(cfg_.optimizer.eps),
                ts.decay ? static_cast<float>(cfg_.optimizer.weight_decay) : 0.0f,
                t_};
    AdamWArgs a;
    a.master = master_.data() + ts.offset;
    a.m = m_.data() + ts.offset;
    a.v = v_.data() + ts.offset;
    a.grad = grad_.data() + ts.offset;
    a.n = ts.numel;
    a.grad_scale = grad_scale;
    adamw_update(a, s);
  }
  set_params(master_.data());
  return r;
}

float StepRunner::eval_loss(const int32_t* batch, const uint8_t* mask) {
  split_batch(batch, mask, cfg_.schedule.micro_batch, cfg_.model.seq_len, inputs_.data(), targets_.data());
  return model_.forward(inputs_.data(), targets_.data());
}

namespace {

std::string timestamp_dir() {
  std::time_t now = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "runs/%Y%m%d-%H%M%S", std::localtime(&now));
  return buf;
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  long t = static_cast<long>(s + 0.5);
  char buf[32];
  if (t >= 3600) std::snprintf(buf, sizeof buf, "%ldh%02ldm", t / 3600, t / 60 % 60);
  else if (t >= 60) std::snprintf(buf, sizeof buf, "%ldm%02lds", t / 60, t % 60);
  else std::snprintf(buf, sizeof buf, "%lds", t);
  return buf;
}

// Token shards concatenated, and their loss masks: a shard X.tok with X.mask beside it
// (fuyou-convert tokenize with --prompt-field/--completion-field) contributes its mask, one
// without contributes all ones (every target counts). When no shard has a mask, *mask stays
// empty and training runs exactly as without masks.
std::vector<int32_t> load_shards(const std::vector<std::string>& paths, int vocab_size,
                                 std::vector<uint8_t>* mask) {
  std::vector<int32_t> all;
  mask->clear();
  bool any_mask = false;
  for (const auto& p : paths) {
    TokenShard s = read_token_shard(p);
    if (s.vocab_size > static_cast<uint32_t>(vocab_size))
      throw ConfigError(str(p, ": shard vocab size ", s.vocab_size, " exceeds model.vocab_size ",
                            vocab_size));
    const std::string mask_path = fs::path(p).replace_extension(".mask").string();
    std::vector<uint8_t> m;
    if (mask_path != p && fs::exists(mask_path)) {
      m = read_loss_mask(mask_path).mask;
      if (m.size() != s.tokens.size())
        throw IoError(str(mask_path, ": loss mask has ", m.size(), " entries but its shard ", p, " has ",
                          s.tokens.size(), " tokens"));
      spdlog::info("data: {}: loss mask {} ({} of {} tokens count)", p, mask_path,
                   std::count(m.begin(), m.end(), uint8_t{1}), m.size());
      if (!any_mask) mask->assign(all.size(), 1);  // earlier shards had none: all count
      any_mask = true;
    } else {
      m.assign(s.tokens.size(), 1);
    }
    if (any_mask) mask->insert(mask->end(), m.begin(), m.end());
    all.insert(all.end(), s.tokens.begin(), s.tokens.end());
  }
  return all;
}

}  // namespace

TrainSummary run_training(const Config& cfg, const TrainOptions& opts) {
  using clock = std::chrono::steady_clock;
  // Refused before anything is written: an emulated run has no model to train or save.
  if (cfg.runtime.backend == "emulated")
    throw ConfigError("runtime.backend is emulated: the emulated device does no arithmetic (its losses are NaN), so "
                      "there is nothing to train; it times the engine with `fuyou-bench train`");
  TrainSummary sum;
  sum.run_dir = opts.run_dir.empty() ? timestamp_dir() : opts.run_dir;
  std::error_code ec;
  if (fs::exists(sum.run_dir, ec) && !fs::is_empty(sum.run_dir, ec))
    throw Error(str("run directory '", sum.run_dir, "' already holds files; refusing to overwrite "
                    "them (choose another --run-dir)"));
  fs::create_directories(sum.run_dir, ec);
  if (ec) throw IoError(str(sum.run_dir, ": cannot create run directory: ", ec.message()));
  {
    std::ofstream(fs::path(sum.run_dir) / "config.yaml") << config_to_yaml(cfg);
  }

  std::string why;
  auto backend = make_backend(cfg, &why);
  spdlog::info("{}", why);

  // Data
  std::vector<int32_t> train_tokens, val_tokens;
  std::vector<uint8_t> train_mask, val_mask;  // empty: every target counts
  if (!cfg.data.text.empty()) {
    auto t0 = clock::now();
    TextShardResult r = build_text_shards(cfg.data.text, (fs::path(sum.run_dir) / "data").string(),
                                          cfg.data.val_fraction);
    spdlog::info("data: tokenized {} text files ({} skipped) into {} train + {} validation byte tokens in {:.1f}s",
                 r.files, r.skipped, r.train_tokens, r.val_tokens,
                 std::chrono::duration<double>(clock::now() - t0).count());
    if (kByteVocab > static_cast<uint32_t>(cfg.model.vocab_size))
      throw ConfigError(str("model.vocab_size is ", cfg.model.vocab_size,
                            " but the byte tokenizer needs at least 256"));
    train_tokens = read_token_shard(r.train_path).tokens;
    val_tokens = read_token_shard(r.val_path).tokens;
  } else if (!cfg.data.train_shards.empty()) {
    train_tokens = load_shards(cfg.data.train_shards, cfg.model.vocab_size, &train_mask);
    val_tokens = load_shards(cfg.data.val_shards, cfg.model.vocab_size, &val_mask);
  } else {
    throw ConfigError("data: give data.text (plain-text files or directories) or data.train_shards");
  }
  const int B = cfg.schedule.micro_batch, T = cfg.model.seq_len;
  BatchSampler train_sampler(&train_tokens, train_mask.empty() ? nullptr : &train_mask, B, T,
                             cfg.runtime.seed);
  bool have_val = val_tokens.size() >= static_cast<size_t>(T + 1);
  if (!have_val) spdlog::warn("data: no validation split with at least {} tokens; validation is off", T + 1);
  std::unique_ptr<BatchSampler> val_sampler;
  if (have_val && !val_mask.empty() && std::count(val_mask.begin() + 1, val_mask.end(), uint8_t{1}) == 0) {
    spdlog::warn("data: the validation loss mask counts no target; validation is off");
    have_val = false;
  }
  if (have_val)
    val_sampler = std::make_unique<BatchSampler>(&val_tokens, val_mask.empty() ? nullptr : &val_mask,
                                                 B, T, cfg.runtime.seed);

  auto engine = make_train_engine(cfg, *backend);
  const ParamLayout layout = make_gpt_layout(cfg.model);
  spdlog::info("model: {}{}, {} layers, d_model {}, {} heads, d_ff {}, vocab {}, seq {}: {:.2f}M parameters",
               cfg.model.family,
               cfg.model.checkpoint.empty() ? std::string() : " from " + cfg.model.checkpoint,
               cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head, cfg.model.d_ff,
               cfg.model.vocab_size, cfg.model.seq_len, layout.num_params() / 1e6);
  for (std::string line, text = engine->describe(); !text.empty();) {
    size_t nl = text.find('\n');
    line = text.substr(0, nl);
    text = nl == std::string::npos ? "" : text.substr(nl + 1);
    spdlog::info("{}", line);
  }
  engine->init_params();

  std::ofstream metrics(fs::path(sum.run_dir) / "metrics.jsonl");
  // Validation: the mean over the counted targets of all eval batches (mean_over_counted, as a
  // training step). A fixed window with no counted target has mean 0 and weight 0, so it is
  // skipped; when no eval window has a counted target at all, validation is switched off below
  // rather than dividing by zero.
  const size_t mask_len = static_cast<size_t>(B) * T;
  if (have_val && val_sampler->has_mask()) {
    std::vector<int32_t> batch(static_cast<size_t>(B) * (T + 1));
    std::vector<uint8_t> counted(mask_len);
    int64_t n = 0;
    for (int i = 0; i < cfg.schedule.eval_batches; ++i) {
      val_sampler->fixed(i, cfg.schedule.eval_batches, batch.data(), counted.data());
      n += count_targets(counted.data(), B, T);
    }
    if (n == 0) {
      spdlog::warn("data: the {} validation windows hold no counted (completion) target; validation is off",
                   cfg.schedule.eval_batches * B);
      have_val = false;
    }
  }
  auto evaluate = [&](int64_t step) {
    std::vector<int32_t> batch(static_cast<size_t>(B) * (T + 1));
    std::vector<uint8_t> counted(val_sampler->has_mask() ? mask_len : 0);
    uint8_t* cp = counted.empty() ? nullptr : counted.data();
    std::vector<float> means;
    std::vector<int64_t> counts;
    for (int i = 0; i < cfg.schedule.eval_batches; ++i) {
      val_sampler->fixed(i, cfg.schedule.eval_batches, batch.data(), cp);
      counts.push_back(count_targets(cp, B, T));
      float l = 0;
      if (counts.back()) engine->eval_loss(batch.data(), &l, cp);
      means.push_back(l);
    }
    double loss = mean_over_counted(means, counts);
    metrics << nlohmann::json{{"step", step}, {"val_loss", loss}}.dump() << "\n";
    metrics.flush();
    return loss;
  };

  if (have_val) {
    sum.first_val_loss = evaluate(0);
    spdlog::info("step 0: validation loss {:.4f}", sum.first_val_loss);
  }

  const int accum = cfg.schedule.grad_accum;
  std::vector<std::vector<int32_t>> mbs(accum, std::vector<int32_t>(static_cast<size_t>(B) * (T + 1)));
  std::vector<const int32_t*> ptrs(accum);
  std::vector<std::vector<uint8_t>> masks(train_sampler.has_mask() ? accum : 0,
                                          std::vector<uint8_t>(mask_len));
  std::vector<const uint8_t*> mask_ptrs(masks.size());
  const double tokens_per_step = static_cast<double>(B) * T * accum;
  auto start = clock::now();
  double train_time = 0;
  std::vector<double> step_times;
  for (int64_t s = 0; s < cfg.schedule.steps; ++s) {
    for (int k = 0; k < accum; ++k) {
      train_sampler.next(mbs[k].data(), masks.empty() ? nullptr : masks[k].data());
      ptrs[k] = mbs[k].data();
      if (!masks.empty()) mask_ptrs[k] = masks[k].data();
    }
    auto t0 = clock::now();
    EngineStep r = engine->step(s, ptrs, mask_ptrs);
    double dt = std::chrono::duration<double>(clock::now() - t0).count();
    train_time += dt;
    step_times.push_back(dt);
    if (!std::isfinite(r.loss))
      throw Error(str("step ", s + 1, ": loss is ", r.loss, "; stopping (try a lower optimizer.lr)"));
    sum.final_train_loss = r.loss;
    if (r.skipped)
      spdlog::warn("step {}: fp16 gradients overflowed at loss scale {}; update skipped, scale halved",
                   s + 1, r.loss_scale);
    double tps = tokens_per_step * (s + 1) / train_time;
    double eta = train_time / (s + 1) * (cfg.schedule.steps - s - 1);
    int64_t step = s + 1;
    if (step % cfg.schedule.log_every == 0 || step == cfg.schedule.steps) {
      nlohmann::json line{{"step", step}, {"loss", r.loss}, {"lr", r.lr}, {"grad_norm", r.grad_norm},
                          {"step_s", dt}, {"tokens_per_s", tokens_per_step / dt}};
      if (r.loss_scale != 1.0) {
        line["loss_scale"] = r.loss_scale;
        line["skipped"] = r.skipped;
      }
      if (r.offloaded) {
        line["ssd_read_bytes"] = r.detail.ssd_read_bytes;
        line["ssd_write_bytes"] = r.detail.ssd_write_bytes;
        for (int k = 0; k < kNumResources; ++k)
          line["busy_s"][resource_name(static_cast<Resource>(k))] = r.detail.busy_s[k];
      }
      metrics << line.dump() << "\n";
      if (opts.progress_line) {
        std::fprintf(stderr, "\rstep %lld/%lld | loss %.4f | lr %.2e | %.0f tok/s | ETA %s   ",
                     static_cast<long long>(step), static_cast<long long>(cfg.schedule.steps), r.loss,
                     r.lr, tps, format_duration(eta).c_str());
        std::fflush(stderr);
      } else {
        spdlog::info("step {}/{} loss {:.4f} lr {:.2e} grad_norm {:.3f} {:.0f} tok/s ETA {}", step,
                     cfg.schedule.steps, r.loss, r.lr, r.grad_norm, tps, format_duration(eta));
      }
    }
    bool last = step == cfg.schedule.steps;
    if (have_val && (last || (cfg.schedule.eval_every && step % cfg.schedule.eval_every == 0))) {
      double vl = evaluate(step);
      if (opts.progress_line) std::fprintf(stderr, "\n");
      spdlog::info("step {}: validation loss {:.4f}", step, vl);
      sum.final_val_loss = vl;
    }
  }
  sum.steps = cfg.schedule.steps;
  sum.tokens_per_s = tokens_per_step * cfg.schedule.steps / train_time;
  if (engine->predicted_iteration_s() > 0) {
    // The automatic placement's prediction beside the measurement (median step; the first
    // step, which warms caches and the store, is left out when there are others).
    std::vector<double> t(step_times.begin() + (step_times.size() > 1 ? 1 : 0), step_times.end());
    std::sort(t.begin(), t.end());
    double measured = t.size() % 2 ? t[t.size() / 2] : 0.5 * (t[t.size() / 2 - 1] + t[t.size() / 2]);
    spdlog::info("step time: predicted {:.3f} s, measured {:.3f} s (median of {} steps)",
                 engine->predicted_iteration_s(), measured, t.size());
  }

  std::string weights = (fs::path(sum.run_dir) / "model.safetensors").string();
  engine->save_weights(weights, {{"format", "fuyou"}, {"step", std::to_string(sum.steps)},
                                 {"config", config_to_yaml(cfg)}});
  if (!opts.trace_path.empty()) engine->write_trace(opts.trace_path);
  double wall = std::chrono::duration<double>(clock::now() - start).count();
  nlohmann::json summary{{"steps", sum.steps},
                         {"first_val_loss", sum.first_val_loss},
                         {"final_val_loss", sum.final_val_loss},
                         {"final_train_loss", sum.final_train_loss},
                         {"tokens_per_s", sum.tokens_per_s},
                         {"wall_s", wall},
                         {"peak_rss_bytes", peak_rss_bytes()},
                         {"device_peak_bytes", backend->memory().peak}};
  std::ofstream(fs::path(sum.run_dir) / "summary.json") << summary.dump(2) << "\n";
  spdlog::info("done: {} steps in {}, {:.0f} tokens/s; validation loss {:.4f} -> {:.4f}; weights in {}",
               sum.steps, format_duration(wall), sum.tokens_per_s, sum.first_val_loss,
               sum.final_val_loss, weights);
  return sum;
}

}  // namespace fuyou
