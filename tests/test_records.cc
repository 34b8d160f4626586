// Records kept whole: packed rows equal each record run alone (the attention kernel, the whole
// model's loss and gradients, fp32 and bf16 tensors, every family), offloaded training with
// packed rows equals in-memory training bit for bit, and the record sampler (whole records,
// positions, targets, epochs, resume, the truncate policy, the record index file).
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>

#include "fuyou/backend_select.h"
#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/model.h"
#include "fuyou/plan.h"
#include "fuyou/rng.h"
#include "fuyou/scheduler.h"
#include "fuyou/train.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;
using Catch::Matchers::Contains;

namespace {

// Positions of records of `lengths` packed into a row of T inputs: 0.. within each record,
// the rest of the row one more segment (padding).
std::vector<int32_t> row_positions(const std::vector<int>& lengths, int T) {
  std::vector<int32_t> pos;
  for (int len : lengths)
    for (int i = 0; i < len && static_cast<int>(pos.size()) < T; ++i) pos.push_back(i);
  for (int i = 0; static_cast<int>(pos.size()) < T; ++i) pos.push_back(i);
  return pos;
}

}  // namespace

TEST_CASE("packed attention equals each record alone, forward and backward",
          "[records][attention]") {
  // Records of several lengths in rows of T = 200: the CPU kernel's row blocks (64) start
  // inside records and span their boundaries; one record of a single token.
  const int T = 200, C = 48, H = 3, B = 2;
  const std::vector<std::vector<int>> rows = {{37, 90, 1, 50, 22}, {130, 70}};
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> qkv(static_cast<size_t>(B) * T * 3 * C), dout(static_cast<size_t>(B) * T * C);
  for (float& x : qkv) x = nd(rng);
  for (float& x : dout) x = nd(rng);
  std::vector<int32_t> pos;
  for (const auto& r : rows) {
    auto p = row_positions(r, T);
    pos.insert(pos.end(), p.begin(), p.end());
  }
  auto be = make_cpu_backend(2, 0);
  std::vector<float> out(dout.size(), 7.0f), lse(static_cast<size_t>(B) * H * T, 7.0f),
      dqkv(qkv.size(), 7.0f), scratch(2 * static_cast<size_t>(T) * T);
  be->attention_forward(out.data(), lse.data(), scratch.data(), qkv.data(), B, T, C, H, pos.data());
  be->attention_backward(dqkv.data(), scratch.data(), dout.data(), out.data(), qkv.data(),
                         lse.data(), B, T, C, H, pos.data());
  // Each record alone (B 1, T its length, no positions), copied back into a packed layout.
  std::vector<float> a_out(out.size()), a_lse(lse.size()), a_dqkv(dqkv.size());
  for (int b = 0; b < B; ++b) {
    int o = 0;
    for (int len : rows[b]) {
      const size_t q0 = (static_cast<size_t>(b) * T + o) * 3 * C,
                   o0 = (static_cast<size_t>(b) * T + o) * C;
      std::vector<float> q(qkv.begin() + q0, qkv.begin() + q0 + static_cast<size_t>(len) * 3 * C);
      std::vector<float> d(dout.begin() + o0, dout.begin() + o0 + static_cast<size_t>(len) * C);
      std::vector<float> ro(d.size()), rl(static_cast<size_t>(H) * len), rd(q.size());
      be->attention_forward(ro.data(), rl.data(), scratch.data(), q.data(), 1, len, C, H, nullptr);
      be->attention_backward(rd.data(), scratch.data(), d.data(), ro.data(), q.data(), rl.data(), 1,
                             len, C, H, nullptr);
      std::copy(ro.begin(), ro.end(), a_out.begin() + o0);
      std::copy(rd.begin(), rd.end(), a_dqkv.begin() + q0);
      for (int h = 0; h < H; ++h)
        std::copy(rl.begin() + h * len, rl.begin() + (h + 1) * len,
                  a_lse.begin() + (static_cast<size_t>(b) * H + h) * T + o);
      o += len;
    }
  }
  // The same sums in another association (another block split, other GEMM shapes): fp32 sums
  // of up to T terms differ by at most about T u32 relative to the tensor's scale; 4 T u32.
  const double tol = 4.0 * T * std::ldexp(1.0, -24);
  CHECK(test::rel_error(out.data(), a_out.data(), out.size()) <= tol);
  CHECK(test::rel_error(dqkv.data(), a_dqkv.data(), dqkv.size()) <= tol);
  CHECK(test::rel_error(lse.data(), a_lse.data(), lse.size()) <= tol);
  // And the packed rows are not what unpacked attention gives (the mask does something).
  std::vector<float> dense(out.size());
  be->attention_forward(dense.data(), lse.data(), scratch.data(), qkv.data(), B, T, C, H, nullptr);
  CHECK(test::rel_error(dense.data(), a_out.data(), out.size()) > 0.01);
}

namespace {

Config family_config(const std::string& family, const std::string& tensors) {
  const std::string extra = family == "llama" ? ", n_kv_head: 2, tie_embeddings: false" : "";
  return parse_config(
      str("model: {family: ", family,
          ", n_layer: 2, n_head: 4, d_model: 32, d_ff: 48, vocab_size: 64, "
          "seq_len: 48",
          extra, "}\n", "runtime: {backend: cpu, threads: 2, device_tensors: ", tensors, "}\n",
          "schedule: {steps: 4, warmup_steps: 1, micro_batch: 2, grad_accum: 1}\n"),
      "<test>");
}

// Two packed rows (records of these lengths, then padding) of random tokens: inputs, targets
// (kIgnoreTarget across record ends and in the padding) and positions; and each record alone.
struct Packed {
  std::vector<std::vector<int>> rows = {{13, 20, 9}, {30, 19}};
  std::vector<int32_t> inputs, targets, positions;
  std::vector<std::vector<int32_t>> records;  // tokens of each record
  int64_t counted = 0;
  Packed(int T, int V) {
    Rng rng(9, 0);
    for (const auto& lens : rows) {
      std::vector<int32_t> row;
      std::vector<uint8_t> same;  // token i and i+1 in one record
      for (int len : lens) {
        std::vector<int32_t> rec(len);
        for (auto& t : rec) t = static_cast<int32_t>(rng.below(V));
        records.push_back(rec);
        for (int i = 0; i < len; ++i) same.push_back(i + 1 < len);
        row.insert(row.end(), rec.begin(), rec.end());
      }
      while (static_cast<int>(row.size()) < T + 1) {
        row.push_back(0);
        same.push_back(0);
      }
      auto pos = row_positions(lens, T);
      for (int t = 0; t < T; ++t) {
        inputs.push_back(row[t]);
        targets.push_back(same[t] ? row[t + 1] : kIgnoreTarget);
        positions.push_back(pos[t]);
        counted += same[t];
      }
    }
  }
};

struct LossAndGrad {
  double loss_sum = 0;
  std::vector<float> grad;
};

LossAndGrad grads_of(Transformer& m, Backend& be) {
  LossAndGrad r;
  r.grad.resize(m.layout().total);
  std::vector<char> raw(m.layout().total * m.elem_bytes());
  be.copy_to_host(raw.data(), m.grads(), raw.size());
  widen_from(be.storage_type(), r.grad.data(), raw.data(), r.grad.size());
  return r;
}

}  // namespace

TEST_CASE("packed records give each record's own loss and gradient: every family, fp32 and bf16",
          "[records][train]") {
  for (const std::string family : {"gpt2", "opt", "llama"})
    for (const std::string tensors : {"fp32", "bf16"}) {
      INFO(family << ", " << tensors << " tensors");
      const Config cfg = family_config(family, tensors);
      const int T = cfg.model.seq_len, V = cfg.model.vocab_size;
      const Packed p(T, V);
      ParamLayout layout = make_gpt_layout(cfg.model);
      std::vector<float> init(layout.total);
      init_gpt_params(cfg.model, layout, init.data());
      const float scale = 1.0f / static_cast<float>(p.counted);

      auto be = make_cpu_backend(2, 0);
      apply_precision(*be, cfg.runtime);
      InMemoryStep packed_runner(cfg, *be);
      packed_runner.set_params(init.data());
      Transformer& pm = packed_runner.model();
      pm.zero_grads();
      const float mean = pm.forward(p.inputs.data(), p.targets.data(), p.positions.data());
      pm.backward(scale);
      LossAndGrad packed = grads_of(pm, *be);
      packed.loss_sum = static_cast<double>(mean) * static_cast<double>(p.counted);

      // Each record alone at the start of its own row (the rest ignored), no positions: the
      // unpacked path. Gradients accumulate over the records with the packed step's scale.
      Config one = cfg;
      one.schedule.micro_batch = 1;
      auto be1 = make_cpu_backend(2, 0);
      apply_precision(*be1, one.runtime);
      InMemoryStep alone_runner(one, *be1);
      alone_runner.set_params(init.data());
      Transformer& am = alone_runner.model();
      am.zero_grads();
      double alone_sum = 0;
      for (const auto& rec : p.records) {
        std::vector<int32_t> in(T, 0), tg(T, kIgnoreTarget);
        const int len = static_cast<int>(rec.size());
        for (int i = 0; i < len && i < T; ++i) in[i] = rec[i];
        for (int i = 0; i + 1 < len; ++i) tg[i] = rec[i + 1];
        alone_sum += static_cast<double>(am.forward(in.data(), tg.data())) * (len - 1);
        am.backward(scale);
      }
      LossAndGrad alone = grads_of(am, *be1);
      // fp32: the same sums in other orders (GEMMs over 96 rows or 48, attention blocks):
      // about N u32 relative each, through two layers and the head; 16 N u32 (N = 96 rows).
      // bf16: activations rounded to bf16 (u = 2^-8) at every kernel, so the two orders may
      // round a value differently: a few bf16 units relative to the tensor's scale; 4 u.
      const double tol =
          tensors == "fp32" ? 16.0 * 96 * std::ldexp(1.0, -24) : 4.0 * std::ldexp(1.0, -8);
      const double loss_err = std::fabs(packed.loss_sum - alone_sum) / alone_sum;
      INFO("loss sums " << packed.loss_sum << " packed, " << alone_sum << " alone (rel " << loss_err
                        << ")");
      CHECK(loss_err <= tol);
      const double gerr =
          test::rel_error(packed.grad.data(), alone.grad.data(), packed.grad.size());
      INFO("gradient relative error " << gerr);
      CHECK(gerr <= tol);
      // Without positions the same rows attend across records: another loss.
      const float unpacked = pm.forward(p.inputs.data(), p.targets.data());
      CHECK(std::fabs(unpacked - mean) > 1e-3);
    }
}

TEST_CASE("offloaded training on packed records equals in-memory training bit for bit",
          "[records][scheduler]") {
  for (const std::string family : {"gpt2", "llama"}) {
    INFO(family);
    Config cfg = family_config(family, "fp32");
    cfg.schedule.grad_accum = 2;
    const int T = cfg.model.seq_len, V = cfg.model.vocab_size, B = cfg.schedule.micro_batch;
    const Packed p(T, V);
    // Micro-batch k of step s: the packed rows with tokens shifted by (s, k), so steps differ.
    const int steps = 3;
    std::vector<std::vector<int32_t>> batches, positions;
    std::vector<std::vector<uint8_t>> masks;
    for (int s = 0; s < steps; ++s)
      for (int k = 0; k < 2; ++k) {
        std::vector<int32_t> batch;
        std::vector<uint8_t> counted;
        for (int b = 0; b < B; ++b) {
          for (int t = 0; t < T; ++t) batch.push_back((p.inputs[b * T + t] + s + 3 * k) % V);
          batch.push_back(0);
          for (int t = 0; t < T; ++t) counted.push_back(p.targets[b * T + t] != kIgnoreTarget);
        }
        batches.push_back(batch);
        masks.push_back(counted);
        positions.push_back(p.positions);
      }
    auto ptrs = [&](int s, std::vector<const int32_t*>* d, std::vector<const uint8_t*>* m,
                    std::vector<const int32_t*>* q) {
      *d = {batches[2 * s].data(), batches[2 * s + 1].data()};
      *m = {masks[2 * s].data(), masks[2 * s + 1].data()};
      *q = {positions[2 * s].data(), positions[2 * s + 1].data()};
    };
    ParamLayout layout = make_gpt_layout(cfg.model);
    std::vector<float> init(layout.total);
    init_gpt_params(cfg.model, layout, init.data());
    std::vector<const int32_t*> d, q;
    std::vector<const uint8_t*> m;
    std::vector<float> ref_losses, off_losses;
    std::vector<float> ref_params(layout.total), off_params(layout.total);
    {
      auto be = make_cpu_backend(2, 0);
      InMemoryStep r(cfg, *be);
      r.set_params(init.data());
      for (int s = 0; s < steps; ++s) {
        ptrs(s, &d, &m, &q);
        ref_losses.push_back(r.step(s, d, m, q).loss);
      }
      ref_params = r.master();
      // Validation on packed rows too, against the offloaded forward-only plan below.
      ref_losses.push_back(r.eval_loss(batches[0].data(), masks[0].data(), positions[0].data()));
    }
    PlanRequest req;
    req.model = cfg.model;
    req.micro_batch = B;
    req.grad_accum = 2;
    req.exact = true;
    req.acts = {ActPlacement::kHost, ActPlacement::kRecompute};
    auto be = make_cpu_backend(2, 0);
    PlanExecutor tr(cfg, *be, make_plan(req), nullptr);
    tr.set_params(init.data());
    for (int s = 0; s < steps; ++s) {
      ptrs(s, &d, &m, &q);
      off_losses.push_back(tr.step(s, d, m, q).loss);
    }
    tr.read_params(off_params.data());
    off_losses.push_back(tr.eval_loss(batches[0].data(), masks[0].data(), positions[0].data()));
    CHECK(std::memcmp(ref_losses.data(), off_losses.data(), 4 * ref_losses.size()) == 0);
    CHECK(std::memcmp(ref_params.data(), off_params.data(), 4 * layout.total) == 0);
  }
}

namespace {

// A split of `lengths` records with distinct tokens (record r's token i is 1000 r + i + 1) and
// a mask counting the second half of each record.
struct Split {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  std::vector<uint64_t> starts;
  explicit Split(const std::vector<int>& lengths) {
    for (size_t r = 0; r < lengths.size(); ++r) {
      starts.push_back(tokens.size());
      for (int i = 0; i < lengths[r]; ++i) {
        tokens.push_back(static_cast<int32_t>(1000 * r + i + 1));
        mask.push_back(i >= lengths[r] / 2);
      }
    }
  }
};

}  // namespace

TEST_CASE("the record sampler packs whole records with their positions and targets",
          "[records][data]") {
  const int B = 2, T = 16;
  Rng rng(4, 0);
  std::vector<int> lengths;
  for (int r = 0; r < 40; ++r)
    lengths.push_back(2 + static_cast<int>(rng.below(T)));  // 2 .. T+1 tokens
  const Split s(lengths);
  RecordSelection sel =
      select_records(s.starts, s.tokens.size(), &s.mask, T + 1, TruncatePolicy::kRefuse, "test");
  REQUIRE(sel.records.size() == lengths.size());
  const uint64_t n = sel.records.size(), epochs = 3;
  RecordSampler rs(&s.tokens, &s.mask, sel.records, B, T, 7, true, n * epochs);
  std::vector<int32_t> batch(B * (T + 1)), pos(B * T);
  std::vector<uint8_t> counted(B * T);
  std::vector<uint64_t> positions_at;       // sampler position before each micro-batch
  std::vector<std::vector<int32_t>> micro;  // every micro-batch's tokens
  while (rs.position() < n * epochs) {
    positions_at.push_back(rs.position());
    rs.next(batch.data(), counted.data(), pos.data());
    micro.push_back(batch);
    for (int b = 0; b < B; ++b) {
      const int32_t* row = batch.data() + b * (T + 1);
      for (int t = 0; t <= T; ++t) {
        if (row[t] == 0) {  // padding to the end of the row, no target, its own segment
          for (int u = t; u <= T; ++u) CHECK(row[u] == 0);
          for (int u = t; u < T; ++u) CHECK(counted[b * T + u] == 0);
          break;
        }
        const int r = (row[t] - 1) / 1000, i = (row[t] - 1) % 1000;
        if (t < T) {
          CHECK(pos[b * T + t] == i);  // position within the record
          const bool next_same =
              t + 1 <= T && row[t + 1] == row[t] + 1 && (row[t + 1] - 1) / 1000 == r;
          CHECK(counted[b * T + t] == (next_same && s.mask[s.starts[r] + i + 1]));
        }
        if (i == 0) {
          // A record starts here and is whole: all its tokens follow in this row.
          REQUIRE(t + lengths[r] <= T + 1);
          for (int k = 0; k < lengths[r]; ++k) CHECK(row[t + k] == 1000 * r + k + 1);
        }
      }
    }
  }
  // Every record once per epoch: replay the stream's order from the record starts.
  RecordSampler again(&s.tokens, &s.mask, sel.records, B, T, 7, true, n * epochs);
  std::vector<std::vector<int>> order(epochs);
  for (size_t k = 0; k < micro.size(); ++k)
    for (int b = 0; b < B; ++b)
      for (int t = 0; t <= T; ++t) {
        const int32_t x = micro[k][b * (T + 1) + t];
        if (x != 0 && (x - 1) % 1000 == 0) {
          size_t e = 0;
          while (e + 1 < epochs && order[e].size() == n) ++e;
          order[e].push_back((x - 1) / 1000);
        }
      }
  for (uint64_t e = 0; e < epochs; ++e) {
    INFO("epoch " << e);
    std::vector<int> sorted = order[e];
    std::sort(sorted.begin(), sorted.end());
    std::vector<int> all(n);
    std::iota(all.begin(), all.end(), 0);
    CHECK(sorted == all);
  }
  CHECK(order[0] != order[1]);  // a new order each epoch
  // Resuming at any saved position packs exactly the micro-batches that followed.
  for (size_t k : {size_t(1), micro.size() / 2, micro.size() - 1}) {
    RecordSampler resumed(&s.tokens, &s.mask, sel.records, B, T, 7, true, n * epochs);
    resumed.set_position(positions_at[k]);
    for (size_t j = k; j < micro.size(); ++j) {
      resumed.next(batch.data(), counted.data(), pos.data());
      CHECK(batch == micro[j]);
    }
  }
  // rows_between counts the rows the stream filled.
  CHECK(rs.rows_between(0, n * epochs) <= micro.size() * B);
  CHECK(rs.rows_between(0, n * epochs) > (micro.size() - 1) * B);
}

TEST_CASE("data.truncate: refuse names the records, right cuts, drop leaves out",
          "[records][data]") {
  const int T = 8;
  const Split s({5, 12, 9, 3, 20});  // 12, 20 longer than T + 1 = 9; 9 fits exactly
  REQUIRE_THROWS_WITH(
      select_records(s.starts, s.tokens.size(), &s.mask, T + 1, TruncatePolicy::kRefuse,
                     "training"),
      Contains("2 of 5 training records are longer than model.seq_len + 1 = 9 tokens") &&
          Contains("the longest has 20") && Contains("data.truncate"));
  RecordSelection right =
      select_records(s.starts, s.tokens.size(), &s.mask, T + 1, TruncatePolicy::kRight, "t");
  // The 20-token record's counted half lies past its first 9 tokens: cut, it has no target left.
  REQUIRE(right.records.size() == 4);
  CHECK(right.records[1].length == 9);
  CHECK(right.cut_tokens == 3 + 11);
  CHECK(right.no_target == 1);
  RecordSelection drop =
      select_records(s.starts, s.tokens.size(), &s.mask, T + 1, TruncatePolicy::kDrop, "t");
  REQUIRE(drop.records.size() == 3);
  CHECK(drop.records[1].start == s.starts[2]);
  CHECK(drop.too_long == 2);
  // A record whose counted tokens were all cut carries no signal: skipped and counted.
  std::vector<uint8_t> late(s.mask.size(), 0);
  for (size_t i = s.starts[4] + 15; i < s.starts[4] + 20; ++i) late[i] = 1;
  for (size_t i = 1; i < 5; ++i) late[i] = 1;
  RecordSelection cut =
      select_records(s.starts, s.tokens.size(), &late, T + 1, TruncatePolicy::kRight, "t");
  CHECK(cut.records.size() == 1);
  CHECK(cut.no_target == 4);
  CHECK_THROWS_WITH(truncate_policy("left"), Contains("refuse, right, drop"));
}

TEST_CASE("record index files: written, read, and refused with the file and offset",
          "[records][data]") {
  test::TempDir dir("recidx");
  const std::string path = dir.path + "/x.rec";
  write_record_index(path, {0, 5, 9});
  CHECK(read_record_index(path, 12) == std::vector<uint64_t>{0, 5, 9});
  CHECK_THROWS_WITH(read_record_index(path, 9),
                    Contains("x.rec: record 2 starts at token 9 (offset 48)"));
  write_record_index(path, {0, 5, 5});
  CHECK_THROWS_WITH(read_record_index(path, 12), Contains("record 2 starts at token 5"));
  write_record_index(path, {1});
  CHECK_THROWS_WITH(read_record_index(path, 12), Contains("the first record starts at 0"));
  std::string bytes = test::read_all(path);
  CHECK_THROWS_WITH(parse_record_index(bytes.substr(0, 36), path, 12),
                    Contains("header says 1 records"));
  bytes[0] = 'X';
  CHECK_THROWS_WITH(parse_record_index(bytes, path, 12), Contains("not a record index"));
}

TEST_CASE(
    "plans for packed records count attention over the records' keys, and bytes do not change",
    "[records][plan]") {
  Config cfg = family_config("gpt2", "fp32");
  PlanRequest req;
  req.model = cfg.model;
  req.micro_batch = 2;
  req.acts = {ActPlacement::kHost, ActPlacement::kRecompute};
  const Plan dense = make_plan(req);
  req.attention_keys = 12;  // records of 12 tokens in rows of seq_len 48
  const Plan packed = make_plan(req);
  REQUIRE(dense.ops.size() == packed.ops.size());
  const double N = 2.0 * cfg.model.seq_len, C = cfg.model.d_model;
  int compute = 0;
  for (size_t i = 0; i < dense.ops.size(); ++i) {
    const PlanOp &d = dense.ops[i], &p = packed.ops[i];
    CHECK(op_bytes(d) == op_bytes(p));
    if (d.kind != OpKind::kForward && d.kind != OpKind::kBackward) continue;
    ++compute;
    // The attention's two products cost 4 keys C FLOPs a token; the backward twice the forward.
    const double per_layer =
        4.0 * (cfg.model.seq_len - 12) * C * N * (d.kind == OpKind::kBackward ? 2 : 1);
    CHECK(d.flops - p.flops == Approx(per_layer).epsilon(1e-12));
  }
  CHECK(compute == 2 * cfg.model.n_layer);
  CHECK(dense.memory.device_bytes == packed.memory.device_bytes);
  CHECK(dense.memory.host_bytes == packed.memory.host_bytes);
}
