// Loss masks (prompt/completion data) end to end: the cross-entropy kernels' ignored targets,
// the sampler's mask windows, the masked loss and gradients against PyTorch's
// cross_entropy(ignore_index=-1) (tests/reference/make_mask_fixture.py), the offloading
// scheduler bit for bit equal to in-memory training with masks, and a JSONL prompt/completion
// dataset tokenized and trained, whose reported loss covers the completions only.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/rng.h"
#include "fuyou/safetensors.h"
#include "fuyou/scheduler.h"
#include "fuyou/tokenizer.h"
#include "fuyou/train.h"
#include "reference_fixture.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;
using Catch::Matchers::Contains;

namespace {

std::string temp_dir(const std::string& tag) {
  fs::path p =
      fs::path(FUYOU_BINARY_DIR) / "test-data" / ("mask-" + tag + "-" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

std::vector<uint8_t> to_mask(const std::vector<int32_t>& v) { return {v.begin(), v.end()}; }

}  // namespace

TEST_CASE("crossentropy: an ignored target gives no loss and no gradient, other rows unchanged",
          "[mask]") {
  const int N = 6, V = 11;
  auto be = make_cpu_backend(2, 0);
  std::vector<float> logits(N * V);
  Rng rng(3, 0);
  for (auto& x : logits) x = static_cast<float>(rng.below(1000)) / 100.0f - 5.0f;
  std::vector<int32_t> all = {3, 0, 10, 7, 7, 1}, some = all;
  some[1] = some[4] = kIgnoreTarget;
  auto run = [&](const std::vector<int32_t>& tg, std::vector<float>* losses,
                 std::vector<float>* grad) {
    std::vector<float> lse(N);
    losses->assign(N, -1.0f);
    *grad = logits;
    be->crossentropy_forward(losses->data(), lse.data(), logits.data(), tg.data(), N, V, V);
    be->crossentropy_backward(grad->data(), lse.data(), tg.data(), 0.25f, N, V, V);
  };
  std::vector<float> la, ga, ls, gs;
  run(all, &la, &ga);
  run(some, &ls, &gs);
  for (int n = 0; n < N; ++n) {
    INFO("row " << n);
    if (some[n] == kIgnoreTarget) {
      CHECK(ls[n] == 0.0f);
      for (int v = 0; v < V; ++v) CHECK(gs[n * V + v] == 0.0f);
    } else {
      // The counted rows compute exactly what they compute without a mask.
      CHECK(std::memcmp(&ls[n], &la[n], 4) == 0);
      CHECK(std::memcmp(&gs[n * V], &ga[n * V], 4 * V) == 0);
    }
  }
}

TEST_CASE("split_batch and the sampler: mask windows line up with the target tokens", "[mask]") {
  const int B = 3, T = 5;
  // Token i is i, so a window's first token tells where it starts.
  std::vector<int32_t> tokens(200);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i % 50);
  std::vector<uint8_t> mask(tokens.size(), 0);
  for (size_t i = 0; i < mask.size(); ++i) mask[i] = (i / 7) % 5 == 0;  // sparse runs of 1
  std::vector<int32_t> pos(tokens.size());
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int32_t>(i);
  BatchSampler s(&pos, &mask, B, T, 9);
  std::vector<int32_t> batch(B * (T + 1)), in(B * T), tg(B * T);
  std::vector<uint8_t> counted(B * T);
  for (int draw = 0; draw < 50; ++draw) {
    s.next(batch.data(), counted.data());
    for (int b = 0; b < B; ++b) {
      const int32_t start = batch[b * (T + 1)];
      int n = 0;
      for (int t = 0; t < T; ++t) {
        CHECK(counted[b * T + t] == mask[start + t + 1]);
        n += counted[b * T + t];
      }
      CHECK(n > 0);  // windows without a counted target are drawn again
    }
    int64_t c = split_batch(batch.data(), counted.data(), B, T, in.data(), tg.data());
    CHECK(c == count_targets(counted.data(), B, T));
    for (int i = 0; i < B * T; ++i)
      CHECK(tg[i] == (counted[i] ? batch[i / T * (T + 1) + i % T + 1] : kIgnoreTarget));
  }
  s.fixed(1, 4, batch.data(), counted.data());
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) CHECK(counted[b * T + t] == mask[batch[b * (T + 1)] + t + 1]);

  // Without a mask: the same draws as a sampler that never heard of masks.
  BatchSampler plain(&pos, B, T, 9), plain2(&pos, nullptr, B, T, 9);
  std::vector<int32_t> b2(batch.size());
  for (int draw = 0; draw < 5; ++draw) {
    plain.next(batch.data());
    plain2.next(b2.data(), counted.data());
    CHECK(batch == b2);
  }
  // The step / validation mean: weighted by counts; a batch that counts nothing is skipped.
  CHECK(mean_over_counted({2.0f, 0.0f, 4.0f}, {1, 0, 3}) == 3.5);
  CHECK(mean_over_counted({0.0f, 0.0f}, {0, 0}) == 0.0);
  CHECK(mean_over_counted({1.0f, 2.0f}, {5, 5}) == 1.5);

  std::vector<uint8_t> short_mask(10, 1), empty_mask(tokens.size(), 0);
  CHECK_THROWS_WITH(BatchSampler(&pos, &short_mask, B, T, 1),
                    Contains("10 entries for 200 tokens"));
  CHECK_THROWS_WITH(BatchSampler(&pos, &empty_mask, B, T, 1), Contains("counts none"));
}

TEST_CASE("masked loss, gradients and a 10-step run match PyTorch's cross_entropy(ignore_index)",
          "[mask][reference]") {
  SafetensorsReader f(test::source_path("tests/reference/fixtures/tiny_b.safetensors"));
  SafetensorsReader m(test::source_path("tests/reference/fixtures/mask/tiny_b_mask.safetensors"));
  Config cfg = test::reference_fixture_config(f, "cpu");
  auto be = make_cpu_backend(2, 0);
  InMemoryStep runner(cfg, *be);
  Transformer& model = runner.model();
  const ParamLayout& layout = model.layout();
  std::vector<float> init(layout.total, 0.0f);
  for (const TensorSpec& t : layout.tensors) {
    auto v = f.read_f32("param." + t.name, t.shape);
    std::copy(v.begin(), v.end(), init.begin() + t.offset);
  }
  runner.set_params(init.data());
  const int B = cfg.schedule.micro_batch, T = cfg.model.seq_len, A = cfg.schedule.grad_accum;
  const size_t N = static_cast<size_t>(B) * T;

  // One batch; row 1 has no counted target. Tolerances as tests/test_reference.cc: 1e-5
  // relative on the loss, 1e-4 relative to each gradient's scale (fp32 sums over <= 72 rows
  // of V = 61 in a different order from PyTorch's).
  auto tokens = f.read_i32("tokens");
  auto mask = to_mask(m.read_i32("mask"));
  REQUIRE(mask.size() == N);
  std::vector<int32_t> in(N), tg(N);
  const int64_t counted = split_batch(tokens.data(), mask.data(), B, T, in.data(), tg.data());
  REQUIRE(counted > 0);
  REQUIRE(counted < static_cast<int64_t>(N));
  float loss = model.forward(in.data(), tg.data());
  CHECK(model.counted_targets() == counted);
  const float ref_loss = m.read_f32("loss")[0];
  INFO("loss " << loss << " reference " << ref_loss);
  CHECK(std::fabs(loss - ref_loss) / std::fabs(ref_loss) < 1e-5);
  model.zero_grads();
  model.backward(1.0f / static_cast<float>(counted));
  for (const TensorSpec& t : layout.tensors) {
    auto ref = m.read_f32("grad." + t.name, t.shape);
    double err = test::rel_error(test::f32(model.grads()) + t.offset, ref.data(), t.numel);
    INFO("gradient " << t.name << " rel error " << err);
    CHECK(err < 1e-4);
  }

  // Ten steps, grad_accum 2: the loss and gradient of each step are the mean over all its
  // counted targets (step 3's second micro-batch counts none).
  runner.set_params(init.data());
  auto train_tokens = f.read_i32("train.tokens");
  auto train_mask = to_mask(m.read_i32("train.mask"));
  auto ref_losses = m.read_f32("train.losses");
  auto ref_norms = m.read_f32("train.grad_norms");
  const size_t mb = static_cast<size_t>(B) * (T + 1);
  REQUIRE(train_mask.size() == ref_losses.size() * A * N);
  for (size_t s = 0; s < ref_losses.size(); ++s) {
    std::vector<const int32_t*> ptrs;
    std::vector<const uint8_t*> masks;
    for (int k = 0; k < A; ++k) {
      ptrs.push_back(train_tokens.data() + (s * A + k) * mb);
      masks.push_back(train_mask.data() + (s * A + k) * N);
    }
    auto r = runner.step(static_cast<int64_t>(s), ptrs, masks);
    INFO("step " << s << ": loss " << r.loss << " reference " << ref_losses[s] << ", grad norm "
                 << r.grad_norm << " reference " << ref_norms[s]);
    CHECK(std::fabs(r.loss - ref_losses[s]) / std::fabs(ref_losses[s]) < 1e-4);
    CHECK(std::fabs(r.grad_norm - ref_norms[s]) / ref_norms[s] < 1e-4);
  }
}

namespace {

Config sched_config(int accum) {
  return parse_config(
      str("model: {n_layer: 3, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 64, seq_len: 16}\n"
          "optimizer: {lr: 3.0e-3, min_lr: 3.0e-4, grad_clip: 0.5}\n"
          "schedule: {steps: 5, warmup_steps: 2, micro_batch: 2, grad_accum: ",
          accum, "}\nruntime: {backend: cpu, threads: 2, seed: 11}\n"),
      "<test>");
}

struct MaskedRun {
  std::vector<float> losses;
  std::vector<float> params;
};

}  // namespace

TEST_CASE("offloaded training with loss masks is bitwise equal to in-memory training",
          "[mask][scheduler]") {
  for (int accum : {1, 2}) {
    INFO("grad_accum " << accum);
    Config cfg = sched_config(accum);
    const int B = cfg.schedule.micro_batch, T = cfg.model.seq_len, steps = 5;
    // data[s * accum + k]: micro-batch k of step s, and its mask.
    std::vector<std::vector<int32_t>> data;
    std::vector<std::vector<uint8_t>> masks;
    for (int i = 0; i < steps * accum; ++i) {
      Rng rng(21, i);
      std::vector<int32_t> b(static_cast<size_t>(B) * (T + 1));
      for (auto& t : b) t = static_cast<int32_t>(rng.below(cfg.model.vocab_size));
      std::vector<uint8_t> m(static_cast<size_t>(B) * T);
      // A random prompt prefix per row (so micro-batches count different numbers of
      // targets); step 2 counts nothing at all (zero gradient, loss 0).
      for (int r = 0; r < B; ++r) {
        uint64_t p = i / accum == 2 ? T : rng.below(T);
        for (int t = 0; t < T; ++t) m[r * T + t] = static_cast<uint64_t>(t) >= p;
      }
      data.push_back(b);
      masks.push_back(m);
    }
    auto step_ptrs = [&](int s, std::vector<const int32_t*>* d, std::vector<const uint8_t*>* m) {
      d->clear();
      m->clear();
      for (int k = 0; k < accum; ++k) {
        d->push_back(data[s * accum + k].data());
        m->push_back(masks[s * accum + k].data());
      }
    };
    ParamLayout layout = make_gpt_layout(cfg.model);
    std::vector<float> init(layout.total);
    init_gpt_params(cfg.model, layout, init.data());
    std::vector<const int32_t*> d;
    std::vector<const uint8_t*> m;

    MaskedRun ref, ones, unmasked;
    {
      auto be = make_cpu_backend(2, 0);
      InMemoryStep r(cfg, *be);
      r.set_params(init.data());
      for (int s = 0; s < steps; ++s) {
        step_ptrs(s, &d, &m);
        ref.losses.push_back(r.step(s, d, m).loss);
      }
      ref.params = r.master();
    }
    CHECK(ref.losses[2] == 0.0f);
    // An all-ones mask is no mask, bit for bit.
    std::vector<uint8_t> all(static_cast<size_t>(B) * T, 1);
    for (bool with_ones : {true, false}) {
      MaskedRun& out = with_ones ? ones : unmasked;
      auto be = make_cpu_backend(2, 0);
      InMemoryStep r(cfg, *be);
      r.set_params(init.data());
      for (int s = 0; s < steps; ++s) {
        step_ptrs(s, &d, &m);
        std::fill(m.begin(), m.end(), all.data());
        out.losses.push_back(with_ones ? r.step(s, d, m).loss : r.step(s, d).loss);
      }
      out.params = r.master();
    }
    CHECK(std::memcmp(ones.losses.data(), unmasked.losses.data(), 4 * steps) == 0);
    CHECK(std::memcmp(ones.params.data(), unmasked.params.data(), 4 * ones.params.size()) == 0);
    CHECK(ref.losses != unmasked.losses);

    // Offloaded with every activation path in host memory, and with an SSD store.
    for (bool ssd : {false, true}) {
      INFO((ssd ? "SSD store" : "host only"));
      PlanRequest req;
      req.model = cfg.model;
      req.micro_batch = B;
      req.grad_accum = accum;
      req.exact = true;
      req.have_ssd = ssd;
      req.acts = ssd ? std::vector<ActPlacement>{ActPlacement::kSsd, ActPlacement::kRecompute,
                                                 ActPlacement::kKeep}
                     : std::vector<ActPlacement>{ActPlacement::kHost, ActPlacement::kRecompute,
                                                 ActPlacement::kDevice};
      req.weights_on_ssd = req.optim_on_ssd = ssd;
      std::unique_ptr<SsdStore> store;
      if (ssd) store = SsdStore::open({{temp_dir("store")}});
      auto be = make_cpu_backend(2, 0);
      PlanExecutor tr(cfg, *be, make_plan(req), store.get());
      tr.set_params(init.data());
      MaskedRun off;
      for (int s = 0; s < steps; ++s) {
        step_ptrs(s, &d, &m);
        off.losses.push_back(tr.step(s, d, m).loss);
      }
      off.params.resize(layout.total);
      tr.read_params(off.params.data());
      for (int s = 0; s < steps; ++s) {
        INFO("step " << s << ": offloaded " << off.losses[s] << ", in memory " << ref.losses[s]);
        CHECK(std::memcmp(&off.losses[s], &ref.losses[s], 4) == 0);
      }
      CHECK(std::memcmp(off.params.data(), ref.params.data(), 4 * layout.total) == 0);
      // Validation on the same weights: the forward-only plan, bitwise the in-memory one.
      InMemoryStep r(cfg, *be);
      r.set_params(off.params.data());
      CHECK(tr.eval_loss(data[0].data(), masks[0].data()) ==
            r.eval_loss(data[0].data(), masks[0].data()));
    }
  }
}

TEST_CASE("prompt/completion JSONL: tokenized, trained, and the loss covers completions only",
          "[mask][train]") {
  // Prompts are random letters (unpredictable: at least ln 26 nats per letter for any model);
  // every completion is the same answer. Trained on completions only, the loss must fall near
  // zero; had the prompts counted, it could not go below their share of that entropy.
  const std::string dir = temp_dir("e2e");
  {
    std::ofstream f(dir + "/pairs.jsonl");
    Rng rng(5, 0);
    for (int r = 0; r < 400; ++r) {
      std::string prompt = "Q:";
      for (int w = 0; w < 3; ++w) {
        prompt += ' ';
        for (int c = 0; c < 5; ++c) prompt += static_cast<char>('a' + rng.below(26));
      }
      f << "{\"prompt\": \"" << prompt << " A:\", \"completion\": \" yes\"}\n";
    }
  }
  Tokenizer tok =
      Tokenizer::from_file(test::source_path("tests/reference/fixtures/hf/tok_bytelevel.json"));
  DatasetOptions opts;
  opts.prompt_field = "prompt";
  opts.completion_field = "completion";
  opts.eos_token = "<|endoftext|>";
  opts.val_fraction = 0.1;
  DatasetResult d = build_tokenized_dataset(tok, {dir + "/pairs.jsonl"}, dir + "/data", opts);
  auto shard = read_token_shard(d.train_path).tokens;
  auto mask = read_loss_mask(d.train_mask_path).mask;
  const double counted_share =
      static_cast<double>(std::count(mask.begin(), mask.end(), uint8_t{1})) /
      static_cast<double>(mask.size());
  INFO("train tokens " << shard.size() << ", counted share " << counted_share);
  REQUIRE(counted_share < 0.5);

  Config cfg = parse_config(
      str("model: {n_layer: 2, n_head: 2, d_model: 32, d_ff: 64, vocab_size: ", tok.vocab_size(),
          ", seq_len: 32}\ndata: {train_shards: [", d.train_path, "], val_shards: [", d.val_path,
          "]}\noptimizer: {lr: 1.0e-2, min_lr: 1.0e-3}\n"
          "schedule: {steps: 60, warmup_steps: 5, micro_batch: 8, grad_accum: 2, eval_every: 60, "
          "eval_batches: 4, log_every: 10}\n"
          "runtime: {backend: cpu, threads: 2, seed: 3}\n"),
      "<test>");
  TrainOptions to;
  to.run_dir = dir + "/run";
  TrainSummary s = run_training(cfg, to);
  INFO("validation loss " << s.first_val_loss << " -> " << s.final_val_loss << ", final train loss "
                          << s.final_train_loss);
  // Untrained: about ln(vocab) = ln 512 = 6.2 on every target. The completion (" yes" then
  // the EOS) is fixed, so the masked loss heads to 0; every prompt letter would cost the
  // unmasked loss ln 26 = 3.3 nats times a share of targets above one half.
  CHECK(s.first_val_loss > 5.0);
  CHECK(s.final_train_loss < 0.2);
  CHECK(s.final_val_loss < 0.2);

  // The trained weights again: over the counted targets of the validation windows they give
  // the reported validation loss exactly; over every target (prompts too) far more.
  auto be = make_cpu_backend(2, 0);
  InMemoryStep r(cfg, *be);
  const ParamLayout& layout = r.model().layout();
  SafetensorsReader w(to.run_dir + "/model.safetensors");
  std::vector<float> params(layout.total, 0.0f);
  for (const TensorSpec& t : layout.tensors) {
    auto v = w.read_f32(t.name, t.shape);
    std::copy(v.begin(), v.end(), params.begin() + t.offset);
  }
  r.set_params(params.data());
  // JSON Lines records stay whole: validation packs every validation record once.
  auto val = read_token_shard(d.val_path).tokens;
  auto val_mask = read_loss_mask(d.val_mask_path).mask;
  const int B = cfg.schedule.micro_batch, T = cfg.model.seq_len;
  const auto starts = read_record_index(d.val_records_path, val.size());
  RecordSelection sel =
      select_records(starts, val.size(), &val_mask, T + 1, TruncatePolicy::kRefuse, "validation");
  const uint64_t n = sel.records.size();
  RecordSampler vs(&val, &val_mask, sel.records, B, T, cfg.runtime.seed, false, n);
  RecordSampler all(&val, nullptr, sel.records, B, T, cfg.runtime.seed, false, n);
  // The first eval_batches micro-batches of records (all of them when fewer), as the run does.
  const int64_t E = std::min<int64_t>(static_cast<int64_t>((vs.rows_between(0, n) + B - 1) / B),
                                      cfg.schedule.eval_batches);
  std::vector<int32_t> batch(static_cast<size_t>(B) * (T + 1));
  std::vector<uint8_t> counted(static_cast<size_t>(B) * T);
  std::vector<int32_t> positions(static_cast<size_t>(B) * T);
  std::vector<float> masked, unmasked;
  std::vector<int64_t> counts, full;
  for (int64_t i = 0; i < E; ++i) {
    vs.next(batch.data(), counted.data(), positions.data());
    counts.push_back(count_targets(counted.data(), B, T));
    masked.push_back(counts.back() ? r.eval_loss(batch.data(), counted.data(), positions.data())
                                   : 0.0f);
    all.next(batch.data(), counted.data(), positions.data());
    full.push_back(count_targets(counted.data(), B, T));
    unmasked.push_back(r.eval_loss(batch.data(), counted.data(), positions.data()));
  }
  const double all_targets = mean_over_counted(unmasked, full);
  INFO("same weights over every target: " << all_targets);
  CHECK(mean_over_counted(masked, counts) == s.final_val_loss);
  CHECK(all_targets > 1.0);
}
