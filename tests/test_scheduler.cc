// The offloading scheduler on the CPU backend: bitwise equal to in-memory training (losses
// and final weights over several steps) with budgets and decisions that force every path:
// weights from SSD, checkpoints to host and to SSD and back, recomputation, optimizer state
// from SSD; no stale weights; budgets refused with numbers. The executor's tests run twice:
// on the CPU backend and on its CUDA-ordered twin (cpu-streams) with random delays, where a
// wait missing in the executor or the model lets a copy or a reader overtake the compute it
// needs, and the numbers differ.
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "engine_run_support.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/rng.h"
#include "fuyou/scheduler.h"
#include "fuyou/simulator.h"
#include "fuyou/train.h"
#include "plan_support.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;
using Catch::Matchers::Contains;

namespace {

Config tiny_config(double clip, const char* device_tensors = "fp32") {
  return parse_config(
      str("model: {n_layer: 5, n_head: 2, d_model: 32, d_ff: 96, vocab_size: 64, seq_len: 16}\n"
          "optimizer: {lr: 3.0e-3, min_lr: 3.0e-4, grad_clip: ",
          clip,
          "}\nschedule: {steps: 6, warmup_steps: 2, micro_batch: 2}\n"
          "runtime: {backend: cpu, threads: 2, seed: 11, device_tensors: ",
          device_tensors, "}\n"),
      "<test>");
}

ElemType tensors_of(const Config& cfg) { return plan_request(cfg).tensors; }

std::string store_dir(const std::string& tag) { return test::fresh_test_dir("sched-" + tag); }

// The backend an executor test runs on: the plain CPU backend, or the same kernels under the
// CUDA backend's ordering rules with random delays of up to 300 us before every queued
// operation (a few times a small kernel's duration here: an operation nobody waited for has
// usually not run when its result is read).
enum class Twin { kCpu, kStreams };
constexpr int kTwinDelayUs = 300;

std::unique_ptr<Backend> twin_backend(Twin twin, uint64_t device_budget,
                                      ElemType tensors = ElemType::kF32) {
  std::unique_ptr<Backend> be;
  if (twin == Twin::kCpu) {
    be = make_cpu_backend(2, device_budget);
  } else {
    StreamOptions so;
    so.max_delay_us = kTwinDelayUs;
    so.seed = 5;
    be = make_cpu_stream_backend(2, device_budget, so);
  }
  be->set_storage_type(tensors);
  return be;
}

const char* twin_name(Twin t) { return t == Twin::kCpu ? "cpu" : "cpu-streams"; }

using Run = test::EngineRun;
using test::require_bitwise;
using test::run_steps;

Run in_memory(const Config& cfg, const std::vector<std::vector<int32_t>>& data) {
  return test::in_memory_run(cfg, data, tensors_of(cfg));
}

Run offloaded(const Config& cfg, const PlanRequest& req,
              const std::vector<std::vector<int32_t>>& data, SsdStore* store,
              Twin twin = Twin::kCpu) {
  auto be = twin_backend(twin, req.device_budget, req.tensors);
  PlanExecutor tr(cfg, *be, make_plan(req), store);
  return test::offloaded_run(tr, data);
}

// A trainer with every layer's checkpoint, weights and optimizer state on SSD (exact mode
// when the config clips), its parameters the model's initial ones. With `retain_all` one
// weights-out slot per layer; else two, so that the higher layers' weights are read back
// from SSD.
std::unique_ptr<PlanExecutor> all_on_ssd(const Config& cfg, Backend& be, SsdStore* store,
                                         bool retain_all = false) {
  PlanRequest req;
  req.model = cfg.model;
  req.micro_batch = cfg.schedule.micro_batch;
  req.tensors = tensors_of(cfg);
  req.exact = cfg.optimizer.grad_clip > 0;
  req.grad_accum = cfg.schedule.grad_accum;
  req.accum_fp32 = plan_request(cfg).accum_fp32;
  req.grads_on_ssd = req.grad_accum > 1;
  req.have_ssd = true;
  req.acts = std::vector<ActPlacement>(cfg.model.n_layer, ActPlacement::kSsd);
  req.weights_on_ssd = req.optim_on_ssd = true;
  if (!retain_all) req = test::with_wout_slots(req, 2);
  auto tr = std::make_unique<PlanExecutor>(cfg, be, make_plan(req), store);
  ParamLayout layout = make_gpt_layout(cfg.model);
  std::vector<float> init(layout.total);
  init_gpt_params(cfg.model, layout, init.data());
  tr->set_params(init.data());
  return tr;
}

// An on_op hook that holds the first op matching `hold` until an op matching `awaited` has
// started (20 s at most): `saw` tells whether it had by then.
struct HoldUntil {
  using Match = std::function<bool(int64_t, const PlanOp&)>;
  Match hold, awaited;
  std::mutex mu;
  std::condition_variable cv;
  bool started = false, held = false, saw = false;
  void attach(PlanExecutor& tr) {
    tr.on_op = [this](int64_t step, const PlanOp& op) {
      std::unique_lock<std::mutex> lock(mu);
      if (awaited(step, op)) {
        started = true;
        cv.notify_all();
      }
      if (!held && hold(step, op)) {
        held = true;
        saw = cv.wait_for(lock, std::chrono::seconds(20), [&] { return started; });
      }
    };
  }
};

}  // namespace

TEST_CASE(
    "a chunked LM head: in memory close to the whole head, offloaded equal to in memory bit for "
    "bit",
    "[scheduler]") {
  // model.head_chunk_tokens runs the head and its loss over 13 tokens at a time (the 32 of a
  // micro-batch: chunks of 13, 13 and 6), the backward computing each chunk's logits again.
  // Tied (gpt2) and untied (llama) heads; a masked target in the single pass.
  for (const char* model : {"family: gpt2", "family: llama, n_kv_head: 1, tie_embeddings: false"}) {
    INFO(model);
    auto cfg_with = [&](int chunk) {
      return parse_config(
          str("model: {", model,
              ", n_layer: 3, n_head: 2, d_model: 32, d_ff: 96, vocab_size: 64, "
              "seq_len: 16, head_chunk_tokens: ",
              chunk,
              "}\noptimizer: {lr: 3.0e-3, min_lr: 3.0e-4, grad_clip: 0.5}\n"
              "schedule: {steps: 4, warmup_steps: 1, micro_batch: 2, grad_accum: 2}\n"
              "runtime: {backend: cpu, threads: 2, seed: 11}\n"),
          "<test>");
    };
    const Config whole = cfg_with(0), chunked = cfg_with(13);
    auto data = test::random_batches(whole, 8, 77);
    // grad_accum 2: two micro-batches a step, from consecutive batches.
    auto run = [&](const Config& cfg) {
      auto be = make_cpu_backend(2, 0);
      InMemoryStep r(cfg, *be);
      r.init_params();
      CHECK(r.model().tokens_per_batch() == 32);
      Run out;
      for (size_t s = 0; s + 1 < data.size(); s += 2)
        out.losses.push_back(
            r.step(static_cast<int64_t>(s / 2), {data[s].data(), data[s + 1].data()}).loss);
      out.params = r.master();
      return out;
    };
    Run a = run(whole), b = run(chunked);
    // The same sums in other orders (the head's weight gradient is added chunk by chunk, the
    // chunks' GEMMs are smaller): one pass's loss and gradients within fp32 rounding of sums
    // of a few hundred terms (N u = 32 x 6e-8 per sum, with margin), and the training losses
    // too (the weights are not compared: Adam divides by sqrt(v) and turns rounding noise in
    // a near-zero gradient into a visible step).
    for (size_t s = 0; s < a.losses.size(); ++s)
      CHECK(std::fabs(a.losses[s] - b.losses[s]) <= 1e-5 * a.losses[s]);
    auto one_pass = [&](const Config& cfg, ElemType t, std::vector<float>& grads) {
      auto be = make_cpu_backend(2, 0);
      be->set_storage_type(t);
      Transformer m(cfg.model, *be, 2);
      const size_t P = m.layout().total;
      std::vector<float> init(P);
      init_gpt_params(cfg.model, m.layout(), init.data());
      std::vector<uint16_t> h(P);
      round_to(t, t == ElemType::kF32 ? m.params() : h.data(), init.data(), P);
      if (t != ElemType::kF32) be->copy_to_device(m.params(), h.data(), 2 * P);
      std::vector<int32_t> in(32), tg(32);
      split_batch(data[0].data(), 2, 16, in.data(), tg.data());
      tg[31] = kIgnoreTarget;
      const float loss = m.forward(in.data(), tg.data());
      m.zero_grads();
      m.backward(1.0f / static_cast<float>(m.counted_targets()));
      grads.resize(P);
      widen_from(t, grads.data(), m.grads(), P);
      return loss;
    };
    std::vector<float> ga, gb;
    const float la = one_pass(whole, ElemType::kF32, ga),
                lb = one_pass(chunked, ElemType::kF32, gb);
    CHECK(std::fabs(la - lb) <= 1e-6 * la);
    CHECK(test::rel_error(gb.data(), ga.data(), ga.size()) < 1e-5);
    // bf16 tensors: a chunked head adds each chunk's share of the head's weight gradient to the
    // stored bf16 gradient with a rounding (3 here, one without chunks), as accumulating
    // micro-batches does (docs/precision.md). Both runs are within 24u of the fp32 model
    // (tests/test_bf16_tensors.cc), so within 48u of each other, plus a u per extra rounding.
    const float lc = one_pass(whole, ElemType::kBF16, ga),
                ld = one_pass(chunked, ElemType::kBF16, gb);
    const double u = std::ldexp(1.0, -8), e = test::rel_error(gb.data(), ga.data(), ga.size());
    INFO("bf16: chunked head's gradients within " << e / u << "u of the whole head's");
    CHECK(e <= (48 + 3) * u);
    CHECK(std::fabs(lc - ld) <= (48 + 3) * u * lc);

    // Offloaded, every activation placement and everything on SSD: the executor's head op
    // runs the same chunks as in memory.
    PlanRequest req;
    req.model = chunked.model;
    req.micro_batch = chunked.schedule.micro_batch;
    req.grad_accum = 2;
    req.exact = true;
    req.have_ssd = true;
    req.acts = {ActPlacement::kSsd, ActPlacement::kRecompute, ActPlacement::kKeep};
    req.weights_on_ssd = req.optim_on_ssd = true;
    StoreConfig sc;
    sc.dirs = {store_dir("head-chunks")};
    auto store = SsdStore::open(sc);
    auto be = make_cpu_backend(2, 0);
    PlanExecutor tr(chunked, *be, make_plan(req), store.get());
    ParamLayout layout = make_gpt_layout(chunked.model);
    std::vector<float> init(layout.total);
    init_gpt_params(chunked.model, layout, init.data());
    tr.set_params(init.data());
    Run o;
    for (size_t s = 0; s + 1 < data.size(); s += 2)
      o.losses.push_back(
          tr.step(static_cast<int64_t>(s / 2), {data[s].data(), data[s + 1].data()}).loss);
    o.params.resize(layout.total);
    tr.read_params(o.params.data());
    CHECK(std::memcmp(o.losses.data(), b.losses.data(), 4 * b.losses.size()) == 0);
    CHECK(std::memcmp(o.params.data(), b.params.data(), 4 * b.params.size()) == 0);
    for (const auto& d : sc.dirs) fs::remove_all(d);

    // The whole micro-batch's logits do not exist: asking for them is an error, not stale data.
    Transformer m(chunked.model, *be, 2);
    CHECK_THROWS_WITH(m.forward(data[0].data(), nullptr), Contains("head_chunk_tokens"));
    CHECK_THROWS_WITH(m.logits(), Contains("head_chunk_tokens"));
  }
}

TEST_CASE("offloaded training is bitwise equal to in-memory training", "[scheduler]") {
  const Twin twin = GENERATE(Twin::kCpu, Twin::kStreams);
  const char* tensors = GENERATE("fp32", "bf16");
  INFO("backend " << twin_name(twin) << ", device tensors " << tensors);
  for (double clip : {0.0, 0.5}) {
    Config cfg = tiny_config(clip, tensors);
    auto data = test::random_batches(cfg, 6, 77);
    Run ref = in_memory(cfg, data);

    StoreConfig sc;
    sc.dirs = {store_dir("a"), store_dir("b")};
    sc.stripe_unit = 64 * 1024;
    auto store = SsdStore::open(sc);
    PlanRequest req;
    req.model = cfg.model;
    req.micro_batch = cfg.schedule.micro_batch;
    req.tensors = tensors_of(cfg);
    req.exact = clip > 0;
    req.have_ssd = true;
    // Every path: keep, device checkpoint, host, SSD, recompute (from an SSD checkpoint).
    req.acts = {ActPlacement::kKeep, ActPlacement::kSsd, ActPlacement::kRecompute,
                ActPlacement::kHost, ActPlacement::kDevice};
    req.weights_on_ssd = true;
    req.optim_on_ssd = true;
    INFO("clip " << clip);
    auto count = [](const Plan& p, auto pred) {
      return std::count_if(p.ops.begin(), p.ops.end(), [&](const PlanOp& o) { return pred(p, o); });
    };
    auto loads_from = [](const Plan& p, const PlanOp& o, BufferKind k) {
      return o.kind == OpKind::kLoadWeights && p.buffers[o.use(Role::kSource).buffer].kind == k;
    };
    auto from_wout = [&](const Plan& p, const PlanOp& o) {
      return loads_from(p, o, BufferKind::kWoutSlot);
    };
    auto ssd_read = [](const Plan&, const PlanOp& o) { return o.kind == OpKind::kReadWeights; };
    // Host memory for one weights-out slot per layer: without exact mode every layer's new
    // weights stay in their slot, the next forward loads them from there, and so does the
    // backward where the device dropped a layer (each layer's slot is rewritten only by its
    // own update, after its backward): no weights are read back from SSD.
    const Plan rp = make_plan(req);
    if (clip == 0)
      CHECK(count(rp, from_wout) > cfg.model.n_layer);
    else
      CHECK(count(rp, from_wout) == 0);
    CHECK((count(rp, ssd_read) == 0) == (clip == 0));
    auto roomy_store = SsdStore::open({{store_dir("roomy")}});
    require_bitwise(offloaded(cfg, req, data, roomy_store.get(), twin), ref);
    const PlanRequest roomy = req;
    // Two weights-out slots: the two lowest layers are retained, the forward reads the
    // others from SSD.
    req = test::with_wout_slots(req, 2);
    const Plan sp = make_plan(req);
    CHECK(count(sp, from_wout) == (clip > 0 ? 0 : 2));
    CHECK(count(sp, ssd_read) > 0);
    require_bitwise(offloaded(cfg, req, data, store.get(), twin), ref);
    // Every byte read back from the store was checked against the checksum of its write:
    // the executor and the optimizer read exactly the ranges they wrote.
    INFO("verified " << store->stats().verified_bytes << ", unverified "
                     << store->stats().unverified_bytes);
    CHECK(store->stats().verified_bytes > 0);
    CHECK(store->stats().unverified_bytes == 0);

    // One device weight slot fewer than the roomy plan: the backward reloads the lowest
    // layers. Retained (plain mode), from their weights-out slots, not yet rewritten; in exact
    // mode (nothing retained) one read in the forward whose host staging slot was not reused
    // since loads from there again instead of being read a second time.
    PlanRequest tight = roomy;
    tight.device_budget = rp.memory.device_bytes -
                          elem_type_size(req.tensors) * make_gpt_layout(cfg.model).groups[1].numel;
    const Plan tp = make_plan(tight);
    REQUIRE(tp.pools.device_weight_slots == rp.pools.device_weight_slots - 1);
    const auto reads = count(tp, ssd_read);
    const auto staged_loads = count(tp, [&](const Plan& p, const PlanOp& o) {
      return loads_from(p, o, BufferKind::kReadSlot);
    });
    INFO("reads " << reads << ", loads from staging " << staged_loads);
    if (clip == 0) {
      CHECK(reads == 0);
      CHECK(count(tp, from_wout) > count(rp, from_wout));
    } else {
      CHECK(staged_loads > reads);
    }
    auto tight_store = SsdStore::open({{store_dir("tight")}});
    require_bitwise(offloaded(cfg, tight, data, tight_store.get(), twin), ref);

    // Everything in host memory, no store: the same numbers again; the embedding's save,
    // update and refresh in three parts (PlanOp::parts; not in exact mode), and with rows
    // first, its update and refresh starting with the rows the next step looks up first
    // (part -1).
    for (bool rows_first : {false, true}) {
      INFO("rows first " << rows_first);
      PlanRequest host = req;
      host.embed_parts = 3;
      host.embed_rows_first = rows_first;
      host.have_ssd = false;
      host.acts = {ActPlacement::kHost, ActPlacement::kRecompute, ActPlacement::kHost,
                   ActPlacement::kDevice, ActPlacement::kKeep};
      host.weights_on_ssd = host.optim_on_ssd = false;
      const Plan hp = make_plan(host);
      const auto parted =
          std::count_if(hp.ops.begin(), hp.ops.end(), [](const PlanOp& o) { return o.parts == 3; });
      // Save, update and refresh, three parts each, and the three rows-first ops.
      CHECK(parted == (clip > 0 ? 0 : rows_first ? 12 : 9));
      const auto first =
          std::count_if(hp.ops.begin(), hp.ops.end(), [](const PlanOp& o) { return o.part < 0; });
      CHECK(first == (clip == 0 && rows_first ? 3 : 0));
      CHECK(hp.embed_rows_first == (clip == 0 && rows_first));
      require_bitwise(offloaded(cfg, host, data, nullptr, twin), ref);
    }
  }
}

TEST_CASE("no stale weights: each forward sees the weights of the previous update", "[scheduler]") {
  // Steps overlap (the next step starts while this one's updates run), so nothing is read
  // back between steps: the weights each forward used are recorded and compared afterwards
  // with in-memory training's weights after the step before.
  const Twin twin = GENERATE(Twin::kCpu, Twin::kStreams);
  INFO("backend " << twin_name(twin));
  for (double clip : {0.0, 0.5}) {
    INFO("clip " << clip);
    Config cfg = tiny_config(clip);
    const int steps = 4, L = cfg.model.n_layer;
    auto data = test::random_batches(cfg, steps, 77);
    ParamLayout layout = make_gpt_layout(cfg.model);
    std::vector<std::vector<float>> expected;  // weights before step s
    {
      auto be = make_cpu_backend(2, 0);
      InMemoryStep r(cfg, *be);
      r.init_params();
      for (int s = 0; s < steps; ++s) {
        expected.push_back(r.master());
        r.step(s, {data[s].data()});
      }
    }
    // Weights read back from SSD after their write, and weights kept in host slots.
    for (bool retain_all : {false, true}) {
      INFO("retain all " << retain_all);
      auto store = SsdStore::open({{store_dir("stale")}});
      auto be = twin_backend(twin, 0);
      auto trainer = all_on_ssd(cfg, *be, store.get(), retain_all);
      PlanExecutor& tr = *trainer;
      // With every layer retained no weights are read from SSD, and the top layer's update
      // (its state on SSD) is deferred into the next step's forward.
      CHECK(tr.plan().deferred_updates == (clip == 0 && retain_all ? 1 : 0));
      int calls = 0, stale = 0;
      tr.on_forward = [&](int l, const void* w, size_t n) {
        const int s = calls++ / L;  // forwards run in order on the compute thread, L per step
        if (std::memcmp(w, expected[s].data() + layout.groups[1 + l].offset, 4 * n) != 0) ++stale;
      };
      for (int s = 0; s < steps; ++s) tr.step(s, data[s].data());
      std::vector<float> final_params(layout.total);
      tr.read_params(final_params.data());
      CHECK(calls == steps * L);
      CHECK(stale == 0);
    }
  }
}

TEST_CASE("steps overlap: the next step starts while the previous one's updates run",
          "[scheduler]") {
  // A step's last update is held back until the next step has visibly started: without
  // overlap it would wait until the timeout and the check would fail. Plain mode: the
  // embedding's update comes last, and the next step's first weight read (layer 2, whose
  // update was written before; layers 0 and 1 are retained in host slots) starts meanwhile.
  // Exact mode: updates run in forward order after the norm, and the next step's first
  // layer forward starts while the last layer's update (the last one) waits.
  const Twin twin = GENERATE(Twin::kCpu, Twin::kStreams);
  INFO("backend " << twin_name(twin));
  for (double clip : {0.0, 0.5}) {
    INFO("clip " << clip);
    Config cfg = tiny_config(clip);
    const int L = cfg.model.n_layer;
    auto data = test::random_batches(cfg, 3, 77);
    Run ref = in_memory(cfg, data);
    auto store = SsdStore::open({{store_dir("overlap")}});
    auto be = twin_backend(twin, 0);
    auto trainer = all_on_ssd(cfg, *be, store.get());
    PlanExecutor& tr = *trainer;
    const int held_group = clip > 0 ? L : 0;
    const OpKind next_kind = clip > 0 ? OpKind::kForward : OpKind::kReadWeights;
    HoldUntil h;
    h.hold = [&](int64_t step, const PlanOp& op) {
      return step == 0 && op.kind == OpKind::kUpdate && op.group == held_group;
    };
    h.awaited = [&](int64_t step, const PlanOp& op) { return step == 1 && op.kind == next_kind; };
    h.attach(tr);
    Run got = run_steps(tr, data);
    CHECK(h.held);
    CHECK(h.saw);
    require_bitwise(got, ref);
  }
}

TEST_CASE("the top layers' updates are deferred beside the next forward, results bitwise",
          "[scheduler]") {
  Config cfg = tiny_config(0);
  const int L = cfg.model.n_layer;
  auto data = test::random_batches(cfg, 4, 77);
  Run ref = in_memory(cfg, data);
  PlanRequest req;
  req.model = cfg.model;
  req.micro_batch = cfg.schedule.micro_batch;
  req.have_ssd = true;
  req.optim_on_ssd = true;  // weights in host memory: the forward reads nothing from SSD
  CHECK(make_plan(req).deferred_updates == 1);  // auto
  for (int D : {1, 2, 3}) {
    INFO(D << " deferred");
    req.deferred_updates = D;
    const Plan p = make_plan(req);
    REQUIRE(p.deferred_updates == D);
    REQUIRE(p.pools.host_grad_stage_slots == D);
    // The deferred updates are the step's last optimizer ops, lowest layer first; their
    // gradients wait in their slots.
    std::vector<int> updates;
    for (const PlanOp& op : p.ops) {
      if (op.resource == Resource::kOptimizer)
        updates.push_back(op.kind == OpKind::kUpdate ? op.group : -1);
      if (op.kind == OpKind::kSaveGrads && op.group > L - D && op.group <= L)
        CHECK(op.use(Role::kDest).buffer == p.buffer(BufferKind::kGradStage, L - op.group));
    }
    REQUIRE(updates.size() >= static_cast<size_t>(D));
    for (int i = 0; i < D; ++i) CHECK(updates[updates.size() - D + i] == L - D + 1 + i);

    // The step-0 update of the lowest deferred layer is held until step 1's forward of the
    // layer below it has started: with the updates in gradient order, the updates of that
    // layer and of those below would queue behind it, that forward would wait for them, and
    // the hold would time out.
    auto store = SsdStore::open({{store_dir("defer")}});
    auto be = make_cpu_backend(2, 0);
    PlanExecutor tr(cfg, *be, p, store.get());
    ParamLayout layout = make_gpt_layout(cfg.model);
    std::vector<float> init(layout.total);
    init_gpt_params(cfg.model, layout, init.data());
    tr.set_params(init.data());
    HoldUntil h;
    h.hold = [&](int64_t step, const PlanOp& op) {
      return step == 0 && op.kind == OpKind::kUpdate && op.group == L - D + 1;
    };
    h.awaited = [&](int64_t step, const PlanOp& op) {
      return step == 1 && op.kind == OpKind::kForward && op.layer == L - D - 1;
    };
    h.attach(tr);
    Run got = run_steps(tr, data);
    CHECK(h.held);
    CHECK(h.saw);
    require_bitwise(got, ref);
  }

  // Weights on SSD too, every layer retained in a weights-out slot or (two slots) most read
  // back: the deferred layers come last in the slots' update order.
  for (int slots : {0, 2}) {
    INFO("weights-out slots " << slots);
    PlanRequest w = req;
    w.weights_on_ssd = true;
    w.deferred_updates = 2;
    if (slots) w = test::with_wout_slots(w, slots);
    REQUIRE(make_plan(w).deferred_updates == 2);
    auto st = SsdStore::open({{store_dir("defer-w")}});
    require_bitwise(offloaded(cfg, w, data, st.get()), ref);
  }

  // Auto declines where the forward reads weights from SSD (the deferred update would share
  // the disk with it) and where gradients are held; a count with held gradients, or one that
  // leaves layer 0 deferred, is refused.
  req.deferred_updates = -1;
  PlanRequest reads = req;
  reads.weights_on_ssd = true;
  reads = test::with_wout_slots(reads, 2);
  CHECK(make_plan(reads).deferred_updates == 0);
  reads.deferred_updates = 1;  // forced: its slot does not fit this budget, cut to the byte
  CHECK_THROWS_WITH(make_plan(reads), Contains("host memory: the plan needs"));
  PlanRequest exact = req;
  exact.exact = true;
  CHECK(make_plan(exact).deferred_updates == 0);
  exact.deferred_updates = 1;
  CHECK_THROWS_WITH(make_plan(exact),
                    Contains("offload.deferred_updates is 1, but this step holds its gradients"));
  PlanRequest all = req;
  all.deferred_updates = L;
  CHECK_THROWS_WITH(make_plan(all), Contains("at most 4"));
  PlanRequest none = req;
  none.deferred_updates = 0;
  CHECK(make_plan(none).deferred_updates == 0);
}

TEST_CASE("the simulator charges every op the bytes the executor moves for it",
          "[scheduler][simulator]") {
  // Weights, checkpoints and optimizer state on SSD, two weights-out slots (weights read back):
  // every kind of transfer runs. Each op's bytes as the executor counts them at the backend's
  // copies, the store's requests and the optimizer's store traffic must equal op_traffic's.
  // "bf16-accum": three micro-batches summed in fp32 on the host, the sums on SSD.
  const std::string mode = GENERATE("fp32", "bf16", "bf16-accum");
  INFO("mode " << mode);
  const int K = mode == "bf16-accum" ? 3 : 1;
  Config cfg = tiny_config(0.0, mode == "fp32" ? "fp32" : "bf16");
  cfg.schedule.grad_accum = K;
  const auto mbs = test::random_batches(cfg, 2 * K, 77);
  std::vector<std::vector<const int32_t*>> data(2);
  for (int s = 0; s < 2; ++s)
    for (int k = 0; k < K; ++k) data[s].push_back(mbs[s * K + k].data());
  auto store = SsdStore::open({{store_dir("traffic")}});
  auto be = make_cpu_backend(2, 0);
  be->set_storage_type(tensors_of(cfg));
  auto trainer = all_on_ssd(cfg, *be, store.get());
  PlanExecutor& tr = *trainer;
  const Plan& plan = tr.plan();
  CHECK(plan.accum_fp32 == (K > 1));
  std::mutex mu;
  std::vector<std::vector<OpTraffic>> moved(data.size(), std::vector<OpTraffic>(plan.ops.size()));
  std::vector<std::vector<int>> ran(data.size(), std::vector<int>(plan.ops.size(), 0));
  tr.on_op_done = [&](int64_t step, const PlanOp& op, const OpTraffic& t) {
    std::lock_guard<std::mutex> lock(mu);
    moved[step][op.id] = t;
    ++ran[step][op.id];
  };
  // A GPU profile whose CPU optimizer never bounds an update.
  HardwareProfile bf16_gpu;
  bf16_gpu.backend = "cuda";
  bf16_gpu.element_bytes = 2;
  bf16_gpu.h2d_Bps = bf16_gpu.d2h_Bps = 25e9;
  bf16_gpu.ssd_read_Bps = 7e9;
  bf16_gpu.ssd_write_Bps = 6e9;
  bf16_gpu.optimizer_params_per_s = 1e15;
  const StoreStats before = store->stats();
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t s = 0; s < data.size(); ++s) tr.step(static_cast<int64_t>(s), data[s]);
  // The last step's updates and writes run on after it returns: wait for every op (not by
  // draining, whose parameter read-back would use the store too).
  auto all_ran = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return std::all_of(ran.back().begin(), ran.back().end(), [](int n) { return n > 0; });
  };
  for (int ms = 0; !all_ran() && ms < 20000; ++ms)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const StoreStats after = store->stats();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  OpTraffic total;
  for (size_t s = 0; s < data.size(); ++s) {
    for (const PlanOp& op : plan.ops) {
      const OpTraffic want = op_traffic(plan, op), got = moved[s][op.id];
      INFO("step " << s << ", op " << op.id << " (" << op_kind_name(op.kind) << " layer "
                   << op.layer << "): simulator h2d " << want.h2d << " d2h " << want.d2h << " read "
                   << want.ssd_read << " write " << want.ssd_write << "; executor " << got.h2d
                   << " / " << got.d2h << " / " << got.ssd_read << " / " << got.ssd_write);
      REQUIRE(ran[s][op.id] == 1);
      CHECK(got == want);
      // And the time it charges is for those bytes, also on a profile that names 2-byte elements.
      if (op.resource != Resource::kCompute && op.kind != OpKind::kGradSumSq &&
          op.kind != OpKind::kAccumulateGrads)
        CHECK(op_duration(plan, op, bf16_gpu) ==
              Approx(std::max(got.ssd_read / bf16_gpu.ssd_read_Bps +
                                  got.ssd_write / bf16_gpu.ssd_write_Bps,
                              got.h2d / bf16_gpu.h2d_Bps + got.d2h / bf16_gpu.d2h_Bps))
                  .epsilon(1e-12));
      total.h2d += got.h2d, total.d2h += got.d2h, total.ssd_read += got.ssd_read,
          total.ssd_write += got.ssd_write;
    }
  }
  // Every channel carried bytes, and the store saw what the ops moved.
  CHECK(total.h2d > 0);
  CHECK(total.d2h > 0);
  CHECK(total.ssd_read > 0);
  CHECK(total.ssd_write > 0);
  CHECK(after.bytes_read - before.bytes_read == total.ssd_read);
  CHECK(after.bytes_written - before.bytes_written == total.ssd_write);
  // The store was busy for part of the run, never longer than it.
  CHECK(after.busy_s > before.busy_s);
  CHECK(after.busy_s - before.busy_s <= wall);
}

TEST_CASE("busy times count an iteration that finishes within a later step's window",
          "[scheduler]") {
  // Step 0's last weight write is slowed (the hook's sleep counts as its busy time) so that
  // it runs on after step 1 has returned: step 2's window, which starts at that return,
  // holds the rest of it, and step 2's submission waits for it to finish before the slot is
  // reused. That part must be counted in step 2's ssd_write busy time, not lost with the
  // finished iteration's times.
  using clock = std::chrono::steady_clock;
  Config cfg = tiny_config(0.0);
  auto data = test::random_batches(cfg, 3, 77);
  auto store = SsdStore::open({{store_dir("busy")}});
  auto be = make_cpu_backend(2, 0);
  clock::time_point write_end{};  // before the executor: its workers may outlive a step()
  auto trainer = all_on_ssd(cfg, *be, store.get());
  PlanExecutor& tr = *trainer;
  tr.on_op = [&](int64_t step, const PlanOp& op) {
    if (step == 0 && op.kind == OpKind::kWriteWeights && op.layer == 0) {  // written last
      std::this_thread::sleep_for(std::chrono::milliseconds(600));
      write_end = clock::now();
    }
  };
  tr.step(0, data[0].data());
  tr.step(1, data[1].data());
  const clock::time_point returned = clock::now();
  const StepResult r2 = tr.step(2, data[2].data());
  const double after_return = std::chrono::duration<double>(write_end - returned).count();
  INFO("the slowed write ran " << after_return << " s after step 1 returned; step 2: iteration "
                               << r2.iteration_s << " s, ssd_write busy "
                               << r2.busy_s[static_cast<int>(Resource::kSsdWrite)]);
  REQUIRE(after_return > 0.3);
  CHECK(r2.busy_s[static_cast<int>(Resource::kSsdWrite)] >= after_return - 0.005);
  CHECK(r2.busy_s[static_cast<int>(Resource::kSsdWrite)] <= r2.iteration_s + 1e-9);
}

TEST_CASE("SSD reads reorder: a read whose write is done passes one still waiting", "[scheduler]") {
  // Step 0's weight write of layer 2 is held until step 1 has started reading a higher
  // layer's weights (written earlier: updates and writes run in backward order). In queue
  // order step 1 reads layer 0 first (forward order), whose write comes after the held one:
  // no step-1 read could start, the wait would time out and the check fail. The run must
  // still be bitwise equal to in-memory training.
  Config cfg = tiny_config(0.0);
  auto data = test::random_batches(cfg, 3, 77);
  Run ref = in_memory(cfg, data);
  auto store = SsdStore::open({{store_dir("reorder")}});
  auto be = make_cpu_backend(2, 0);
  auto trainer = all_on_ssd(cfg, *be, store.get());
  PlanExecutor& tr = *trainer;
  REQUIRE(tr.plan().layers[2].weights == Tier::kSsd);
  REQUIRE(tr.plan().layers[2].retained < 0);
  HoldUntil h;
  h.hold = [](int64_t step, const PlanOp& op) {
    return step == 0 && op.kind == OpKind::kWriteWeights && op.layer == 2;
  };
  h.awaited = [](int64_t step, const PlanOp& op) {
    return step == 1 && op.kind == OpKind::kReadWeights && op.layer > 2;
  };
  h.attach(tr);
  Run got = run_steps(tr, data);
  CHECK(h.held);
  CHECK(h.saw);
  require_bitwise(got, ref);
}

TEST_CASE("embedding rows first: the next forward starts before the embedding's update ends",
          "[scheduler]") {
  // Rows first (PlanRequest::embed_rows_first): step 0's last embedding update part is held
  // until step 1's first layer forward has started; without the rows-first refresh that
  // forward's embedding lookup would wait for every part, the wait would time out and the
  // check fail. Step 2 is queued only after step 1's rows-first update has run (so it could
  // not use step 2's rows): step 2's lookup must then wait for every part. Both bitwise.
  Config cfg = tiny_config(0.0);
  auto data = test::random_batches(cfg, 4, 77);
  Run ref = in_memory(cfg, data);
  PlanRequest req;
  req.model = cfg.model;
  req.micro_batch = cfg.schedule.micro_batch;
  req.embed_parts = 3;
  req.embed_rows_first = true;
  req.acts.assign(cfg.model.n_layer, ActPlacement::kHost);
  const Twin twin = GENERATE(Twin::kCpu, Twin::kStreams);
  INFO("backend " << twin_name(twin));
  auto be = twin_backend(twin, 0);
  // What on_op touches outlives the executor, whose workers may run on after a step().
  std::mutex mu;
  std::condition_variable cv;
  bool forward_started = false, held = false, saw = false, rows_done = false;
  PlanExecutor tr(cfg, *be, make_plan(req), nullptr);
  REQUIRE(tr.plan().embed_rows_first);
  ParamLayout layout = make_gpt_layout(cfg.model);
  std::vector<float> init(layout.total);
  init_gpt_params(cfg.model, layout, init.data());
  tr.set_params(init.data());
  tr.on_op = [&](int64_t step, const PlanOp& op) {
    std::unique_lock<std::mutex> lock(mu);
    if (step == 1 && op.kind == OpKind::kForward && op.layer == 0) {
      forward_started = true;
      cv.notify_all();
    }
    if (step == 0 && op.kind == OpKind::kUpdate && op.group == 0 && op.part == op.parts - 1) {
      held = true;
      saw = cv.wait_for(lock, std::chrono::seconds(20), [&] { return forward_started; });
    }
    if (step == 1 && op.kind == OpKind::kLoadResident && op.group == 0 &&
        op.part < 0) {  // after its update
      rows_done = true;
      cv.notify_all();
    }
  };
  Run got;
  for (int s = 0; s < 4; ++s) {
    if (s == 2) {
      std::unique_lock<std::mutex> lock(mu);
      CHECK(cv.wait_for(lock, std::chrono::seconds(20), [&] { return rows_done; }));
    }
    got.losses.push_back(tr.step(s, data[s].data()).loss);
  }
  got.params.resize(layout.total);
  tr.read_params(got.params.data());
  CHECK(held);
  CHECK(saw);
  require_bitwise(got, ref);
}

TEST_CASE("budgets that cannot fit are refused with the numbers", "[scheduler]") {
  Config cfg = tiny_config(0.0);
  PlanRequest req;
  req.model = cfg.model;
  req.micro_batch = 2;
  req.device_budget = 64 * 1024;
  CHECK_THROWS_WITH(make_plan(req), Contains("device memory: the plan needs at least") &&
                                        Contains("smallest device budget"));
  req.device_budget = 0;
  req.host_budget = 1 << 20;
  CHECK_THROWS_WITH(make_plan(req), Contains("host memory: the plan needs") &&
                                        Contains("offload.host_memory is 1.00 MiB") &&
                                        Contains("offload.ssd_paths"));
  req.host_budget = 0;
  req.acts = std::vector<ActPlacement>(5, ActPlacement::kKeep);
  req.acts[0] = ActPlacement::kRecompute;
  CHECK_THROWS_WITH(make_plan(req), Contains("layer 0"));
  req.acts[0] = ActPlacement::kSsd;
  CHECK_THROWS_WITH(make_plan(req), Contains("offload.ssd_paths"));
}

TEST_CASE("plans print and dump", "[scheduler]") {
  Config cfg = tiny_config(0.0);
  PlanRequest req;
  req.model = cfg.model;
  req.micro_batch = 2;
  req.have_ssd = true;
  req.acts = {ActPlacement::kKeep, ActPlacement::kSsd, ActPlacement::kRecompute,
              ActPlacement::kHost, ActPlacement::kDevice};
  Plan p = make_plan(req);
  std::string t = p.table();
  CHECK_THAT(t, Contains("recompute") && Contains("peak device memory"));
  auto j = p.to_json();
  CHECK(j["ops"].size() == p.ops.size());
  // Every dependency points backwards: creation order is a topological order.
  for (const PlanOp& op : p.ops)
    for (int d : op.deps) CHECK(d < op.id);
}
