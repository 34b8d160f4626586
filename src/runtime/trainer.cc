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

StepRunner::StepRunner(const Config& cfg, Backend& backend)
    : cfg_(cfg), be_(backend), model_(cfg.model, backend, cfg.schedule.micro_batch) {
  size_t n = model_.layout().total;
  master_.assign(n, 0.0f);
  m_.assign(n, 0.0f);
  v_.assign(n, 0.0f);
  grad_.assign(n, 0.0f);
  inputs_.resize(model_.tokens_per_batch());
  targets_.resize(model_.tokens_per_batch());
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
                                    const std::vector<const int32_t*>& micro_batches) {
  const int B = cfg_.schedule.micro_batch, T = cfg_.model.seq_len;
  const int accum = static_cast<int>(micro_batches.size());
  FY_CHECK(accum >= 1, "no micro-batches");
  Result r;
  model_.zero_grads();
  double loss_sum = 0;
  const float scale = 1.0f / (static_cast<float>(model_.tokens_per_batch()) * accum);
  for (const int32_t* mb : micro_batches) {
    split_batch(mb, B, T, inputs_.data(), targets_.data());
    loss_sum += model_.forward(inputs_.data(), targets_.data());
    model_.backward(scale);
  }
  r.loss = static_cast<float>(loss_sum / accum);
  be_.copy_to_host(grad_.data(), model_.grads(), grad_.size() * sizeof(float));

  // Per parameter group in order, each group summed sequentially in double: the same
  // reduction the offloading scheduler performs, so both clip identically. Padding between
  // tensors holds zero gradient.
  double sq = 0;
  for (const ParamGroup& g : model_.layout().groups) sq += group_sum_squares(grad_.data() + g.offset, g.numel);
  r.grad_norm = std::sqrt(sq);
  // Clipping multiplies each gradient by the coefficient inside the update kernel, in fp32,
  // as torch.nn.utils.clip_grad_norm_ does and as the offloading scheduler does.
  float grad_scale = 1.0f;
  if (cfg_.optimizer.grad_clip > 0) {
    double coef = cfg_.optimizer.grad_clip / (r.grad_norm + 1e-6);
    if (coef < 1.0) grad_scale = static_cast<float>(coef);
  }
  r.lr = learning_rate(cfg_.optimizer, cfg_.schedule, step_index);
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

float StepRunner::eval_loss(const int32_t* batch) {
  split_batch(batch, cfg_.schedule.micro_batch, cfg_.model.seq_len, inputs_.data(), targets_.data());
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

std::vector<int32_t> load_shards(const std::vector<std::string>& paths, int vocab_size) {
  std::vector<int32_t> all;
  for (const auto& p : paths) {
    TokenShard s = read_token_shard(p);
    if (s.vocab_size > static_cast<uint32_t>(vocab_size))
      throw ConfigError(str(p, ": shard vocab size ", s.vocab_size, " exceeds model.vocab_size ",
                            vocab_size));
    all.insert(all.end(), s.tokens.begin(), s.tokens.end());
  }
  return all;
}

}  // namespace

TrainSummary run_training(const Config& cfg, const TrainOptions& opts) {
  using clock = std::chrono::steady_clock;
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
  auto backend = make_backend(cfg.runtime, cfg.offload.device_memory, &why);
  spdlog::info("{}", why);

  // Data
  std::vector<int32_t> train_tokens, val_tokens;
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
    train_tokens = load_shards(cfg.data.train_shards, cfg.model.vocab_size);
    val_tokens = load_shards(cfg.data.val_shards, cfg.model.vocab_size);
  } else {
    throw ConfigError("data: give data.text (plain-text files or directories) or data.train_shards");
  }
  const int B = cfg.schedule.micro_batch, T = cfg.model.seq_len;
  BatchSampler train_sampler(&train_tokens, B, T, cfg.runtime.seed);
  bool have_val = val_tokens.size() >= static_cast<size_t>(T + 1);
  if (!have_val) spdlog::warn("data: no validation split with at least {} tokens; validation is off", T + 1);
  std::unique_ptr<BatchSampler> val_sampler;
  if (have_val) val_sampler = std::make_unique<BatchSampler>(&val_tokens, B, T, cfg.runtime.seed);

  auto engine = make_train_engine(cfg, *backend);
  const ParamLayout layout = make_gpt_layout(cfg.model);
  spdlog::info("model: {} layers, d_model {}, {} heads, d_ff {}, vocab {}, seq {}: {:.2f}M parameters",
               cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head, cfg.model.d_ff,
               cfg.model.vocab_size, cfg.model.seq_len, layout.num_params() / 1e6);
  for (std::string line, text = engine->describe(); !text.empty();) {
    size_t nl = text.find('\n');
    line = text.substr(0, nl);
    text = nl == std::string::npos ? "" : text.substr(nl + 1);
    spdlog::info("{}", line);
  }
  engine->init_params();
  if (have_val && engine->offloaded()) {
    spdlog::warn("validation is not available with the offloading scheduler yet; training losses only");
    have_val = false;
  }

  std::ofstream metrics(fs::path(sum.run_dir) / "metrics.jsonl");
  auto evaluate = [&](int64_t step) {
    std::vector<int32_t> batch(static_cast<size_t>(B) * (T + 1));
    double s = 0;
    for (int i = 0; i < cfg.schedule.eval_batches; ++i) {
      val_sampler->fixed(i, cfg.schedule.eval_batches, batch.data());
      float l = 0;
      engine->eval_loss(batch.data(), &l);
      s += l;
    }
    double loss = s / cfg.schedule.eval_batches;
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
  const double tokens_per_step = static_cast<double>(B) * T * accum;
  auto start = clock::now();
  double train_time = 0;
  for (int64_t s = 0; s < cfg.schedule.steps; ++s) {
    for (int k = 0; k < accum; ++k) {
      train_sampler.next(mbs[k].data());
      ptrs[k] = mbs[k].data();
    }
    auto t0 = clock::now();
    EngineStep r = engine->step(s, ptrs);
    double dt = std::chrono::duration<double>(clock::now() - t0).count();
    train_time += dt;
    if (!std::isfinite(r.loss))
      throw Error(str("step ", s + 1, ": loss is ", r.loss, "; stopping (try a lower optimizer.lr)"));
    sum.final_train_loss = r.loss;
    double tps = tokens_per_step * (s + 1) / train_time;
    double eta = train_time / (s + 1) * (cfg.schedule.steps - s - 1);
    int64_t step = s + 1;
    if (step % cfg.schedule.log_every == 0 || step == cfg.schedule.steps) {
      nlohmann::json line{{"step", step}, {"loss", r.loss}, {"lr", r.lr}, {"grad_norm", r.grad_norm},
                          {"step_s", dt}, {"tokens_per_s", tokens_per_step / dt}};
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
