// The in-memory step's optimizer on the device (optimizer.placement: device) against the
// host optimizer: the same weights, moments, gradient norms and losses, bit for bit, on the
// CPU backend and on cpu-streams (the CUDA backend's ordering rules); and the placement's
// choices and refusals.
#include <catch2/catch.hpp>
#include <cstring>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/backend_select.h"
#include "fuyou/config.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/optim.h"
#include "fuyou/rng.h"
#include "fuyou/train.h"
#include "kernels/common/element_math.h"

using namespace fuyou;

namespace {

struct Run {
  std::vector<float> master, m, v, grad_norms, losses;
  bool on_device = false;
};

Run train(const std::string& backend, const char* tensors, int accum, const char* placement,
          int steps) {
  const bool lowp = std::string(tensors) != "fp32";
  Config cfg = parse_config(
      str("model: {n_layer: 2, n_head: 2, d_model: 32, d_ff: 96, vocab_size: 61, seq_len: 16}\n"
          "optimizer: {lr: 1.0e-2, min_lr: 1.0e-3, grad_clip: 0.5, placement: ",
          placement,
          "}\nschedule: {steps: 20, warmup_steps: 2, micro_batch: 3, grad_accum: ", accum,
          "}\nruntime: {backend: ", backend, ", threads: 2, seed: 5, device_tensors: ", tensors,
          lowp ? ", precision: bf16" : "", "}\n"),
      "<test>");
  std::unique_ptr<Backend> be =
      backend == "cpu" ? make_cpu_backend(2, 0) : make_cpu_stream_backend(2, 0, {0, 20, 7});
  apply_precision(*be, cfg.runtime);
  InMemoryStep r(cfg, *be);
  r.init_params();
  Run out;
  out.on_device = r.optimizer_on_device();
  std::vector<std::vector<int32_t>> data(accum);
  for (int s = 0; s < steps; ++s) {
    std::vector<const int32_t*> mbs;
    for (int k = 0; k < accum; ++k) {
      Rng rng(31, s * accum + k);
      data[k].resize(3 * 17);
      for (auto& x : data[k]) x = static_cast<int32_t>(rng.below(61));
      mbs.push_back(data[k].data());
    }
    StepResult res = r.step(s, mbs);
    out.losses.push_back(res.loss);
    out.grad_norms.push_back(static_cast<float>(res.grad_norm));
  }
  out.master = r.master();
  const ParamLayout& layout = r.model().layout();
  out.m.assign(layout.total, 0.0f);
  out.v.assign(layout.total, 0.0f);
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    const size_t off = layout.groups[g].offset;
    r.read_state(static_cast<int>(g), StateKind::kAdamM, [&](size_t b, const float* d, size_t n) {
      std::copy(d, d + n, out.m.begin() + off + b);
    });
    r.read_state(static_cast<int>(g), StateKind::kAdamV, [&](size_t b, const float* d, size_t n) {
      std::copy(d, d + n, out.v.begin() + off + b);
    });
  }
  return out;
}

size_t first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return i;
  return a.size();
}

}  // namespace

TEST_CASE("the optimizer on the device gives the host optimizer's bits", "[device_optimizer]") {
  for (const char* backend : {"cpu", "cpu-streams"})
    for (const char* tensors : {"fp32", "bf16"})
      for (int accum : {1, 2}) {
        INFO(backend << ", " << tensors << " tensors, " << accum << " micro-batches");
        const Run host = train(backend, tensors, accum, "host", 4);
        const Run dev = train(backend, tensors, accum, "device", 4);
        REQUIRE_FALSE(host.on_device);
        REQUIRE(dev.on_device);
        CHECK(first_difference(host.losses, dev.losses) == host.losses.size());
        CHECK(first_difference(host.grad_norms, dev.grad_norms) == host.grad_norms.size());
        CHECK(first_difference(host.master, dev.master) == host.master.size());
        CHECK(first_difference(host.m, dev.m) == host.m.size());
        CHECK(first_difference(host.v, dev.v) == host.v.size());
        // Clipping was active (grad_clip 0.5), so the norm's bits reached every update.
        CHECK(host.grad_norms.front() > 0.5f);
      }
}

TEST_CASE("optimizer.placement: auto keeps the host optimizer where the device is host memory",
          "[device_optimizer]") {
  const Run a = train("cpu", "fp32", 1, "auto", 1);
  CHECK_FALSE(a.on_device);
}

TEST_CASE("optimizer.placement: device is refused where the state does not fit",
          "[device_optimizer]") {
  Config cfg = parse_config(
      "model: {n_layer: 2, n_head: 2, d_model: 64, d_ff: 256, vocab_size: 300, seq_len: 16}\n"
      "optimizer: {placement: device}\nschedule: {micro_batch: 2}\nruntime: {backend: cpu, "
      "threads: 1}\n",
      "<test>");
  // Room for the model (parameters, gradients, activations) but not for 8 more bytes per
  // parameter of moments.
  const uint64_t model_bytes = in_memory_device_bytes(cfg.model, 2, 4);
  auto be = make_cpu_backend(1, model_bytes + 4096);
  apply_precision(*be, cfg.runtime);
  try {
    InMemoryStep r(cfg, *be);
    FAIL("a device optimizer that does not fit was accepted");
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find("optimizer.placement is device") != std::string::npos);
    CHECK(what.find("left beside the model") != std::string::npos);
  }
  CHECK_THROWS_AS(parse_config("optimizer: {placement: gpu}\n", "<test>"), ConfigError);
}

TEST_CASE("AdamW on the device: the pieces' decay and the constants are the host's",
          "[device_optimizer]") {
  // One tensor with decay and one without, through Backend::adamw, against adamw_update.
  const size_t n = 1000;
  std::vector<float> p(2 * n), m(2 * n), v(2 * n), g(2 * n);
  Rng rng(3, 1);
  for (size_t i = 0; i < 2 * n; ++i) {
    p[i] = static_cast<float>(rng.uniform() - 0.5);
    m[i] = static_cast<float>(rng.uniform() - 0.5) * 1e-2f;
    v[i] = static_cast<float>(rng.uniform()) * 1e-4f;
    g[i] = static_cast<float>(rng.uniform() - 0.5);
  }
  std::vector<float> hp = p, hm = m, hv = v;
  const AdamWStep s{3e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 7};
  AdamWArgs pieces[2];
  const float decays[2] = {0.1f, 0.0f};
  for (int k = 0; k < 2; ++k) {
    pieces[k].master = hp.data() + k * n;
    pieces[k].m = hm.data() + k * n;
    pieces[k].v = hv.data() + k * n;
    pieces[k].grad = g.data() + k * n;
    pieces[k].n = n;
    pieces[k].grad_scale = 0.75f;
  }
  adamw_update(pieces, decays, 2, s, SimdPath::kScalar);

  auto be = make_cpu_backend(1, 0);
  AdamWPiece table[2] = {{0, static_cast<uint32_t>(n), 1}, {n, static_cast<uint32_t>(n), 0}};
  DeviceAdamW a;
  a.master = p.data();
  a.m = m.data();
  a.v = v.data();
  a.grad = g.data();
  a.pieces = table;
  a.count = 2;
  set_adamw_constants(&a, s, 0.1f, 0.75f);
  be->adamw(a);
  CHECK(first_difference(hp, p) == p.size());
  CHECK(first_difference(hm, m) == m.size());
  CHECK(first_difference(hv, v) == v.size());
}
