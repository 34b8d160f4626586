// `fuyou-bench profile` and `fuyou-bench simulate`. The profile is measured with the same
// code paths the engine runs: oneDNN GEMMs of a layer's shapes, memcpy (the CPU backend's
// host<->device copy), the SSD store (fuyou-bench io), and the out-of-core AdamW on
// host-resident state, each alone and then GEMMs and AdamW together for the CPU sharing.
#include "src/runtime/sim_bench.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include <nlohmann/json.hpp>

#include "fuyou/config.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/model.h"
#include "fuyou/ooc_adamw.h"
#include "fuyou/simulator.h"
#include "fuyou/sizes.h"
#include "fuyou/swap_search.h"
#include "kernels/cpu/fma_peak.h"
#include "kernels/cpu/gemm.h"
#include "src/optim/mem_bandwidth.h"
#include "src/storage/io_bench.h"

namespace fuyou {

namespace {

using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

// A layer's GEMMs at d_model C, N tokens, d_ff 4C: the four forward projections and the MLP
// up-projection's two backward GEMMs. Returns their FLOPs; `run` does them once.
struct LayerGemms {
  int N, C, F;
  std::vector<float> x, w, y;
  LayerGemms(int n, int c) : N(n), C(c), F(4 * c) {
    size_t big = static_cast<size_t>(std::max(N, F)) * std::max(C, F);
    x.assign(static_cast<size_t>(N) * F, 0.01f);
    w.assign(big, 0.02f);
    y.assign(static_cast<size_t>(std::max(N, F)) * std::max(F, N), 0.0f);
  }
  double flops() const { return 2.0 * N * (3.0 * C * C + C * C + 2.0 * C * F) + 2 * 2.0 * N * C * F; }
  void run() {
    using cpu::gemm_f32;
    gemm_f32(false, true, N, 3 * C, C, 1, x.data(), C, w.data(), C, 0, y.data(), 3 * C);  // qkv
    gemm_f32(false, true, N, C, C, 1, x.data(), C, w.data(), C, 0, y.data(), C);          // attn proj
    gemm_f32(false, true, N, F, C, 1, x.data(), C, w.data(), C, 0, y.data(), F);          // fc
    gemm_f32(false, true, N, C, F, 1, x.data(), F, w.data(), F, 0, y.data(), C);          // fc proj
    gemm_f32(false, false, N, C, F, 1, x.data(), F, w.data(), C, 0, y.data(), C);         // fc dX
    gemm_f32(true, false, F, C, N, 1, x.data(), F, w.data(), C, 0, y.data(), C);          // fc dW
  }
};

// Runs `f` repeatedly for about `seconds`; returns the calls per second of the fastest
// call (`fastest`) or of all calls together. The fastest call is the figure of a machine
// without other load: this machine's two cores are shared with other work, and a profile
// describes the hardware, not the moment.
template <typename Fn>
double rate_for(double seconds, Fn&& f, const std::atomic<bool>* stop = nullptr, bool fastest = true) {
  auto t0 = clock_type::now();
  int n = 0;
  double best = 1e30;
  while (since(t0) < seconds && !(stop && stop->load())) {
    auto t1 = clock_type::now();
    f();
    best = std::min(best, since(t1));
    ++n;
  }
  return fastest ? 1.0 / best : n / since(t0);
}

}  // namespace

HardwareProfile measure_cpu_profile(const ProfileOptions& o, std::string* log) {
  if (o.dirs.empty()) throw ConfigError("fuyou-bench profile: --dir (a store directory on the SSD) is required");
  auto backend = make_cpu_backend(o.threads, 0);
  const int threads = backend->threads();
  auto say = [&](const std::string& s) { if (log) *log += s + "\n"; };
  HardwareProfile p;
  p.name = "this-cpu";
  p.backend = "cpu";
  p.element_bytes = 4;
  p.shared_cpu = true;

  cpu::FmaPeak peak = cpu::measure_fma_peak(threads, 0.1);
  for (int i = 0; i < 9; ++i) {  // the best of ten short runs, for the reason given at rate_for
    cpu::FmaPeak q = cpu::measure_fma_peak(threads, 0.1);
    if (q.gflops_all > peak.gflops_all) peak = q;
  }
  p.peak_flops = peak.gflops_all * 1e9;
  say(str("fp32 FMA peak (", peak.isa, ", ", threads, " threads): ", peak.gflops_all, " GFLOP/s"));

  // GEMM efficiency: layers with d_model s, d_ff 4s and 2s tokens have size cbrt(2s*s*4s) = 2s.
  // Only the rates matter to the simulator (time = flops / (peak * efficiency)); should a
  // GEMM have caught a quieter moment than the FMA run, the peak is raised to it so every
  // efficiency stays <= 1 without changing any rate.
  std::vector<double> rates;
  for (int s : {64, 128, 256, 512, 1024}) {
    LayerGemms g(2 * s, s);
    g.run();
    rates.push_back(g.flops() * rate_for(s >= 512 ? 1.5 : 0.5, [&] { g.run(); }));
    say(str("layer GEMMs at d_model ", s, " (size ", 2 * s, "): ", rates.back() / 1e9, " GFLOP/s"));
  }
  p.peak_flops = std::max(p.peak_flops, *std::max_element(rates.begin(), rates.end()));
  for (size_t i = 0; i < rates.size(); ++i) p.gemm_efficiency.push_back({128.0 * (1 << i), rates[i] / p.peak_flops});

  // Host <-> device on the CPU backend is memcpy.
  {
    const size_t bytes = 256ull << 20;
    std::vector<char> a(bytes, 1), b(bytes, 2);
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
      auto t0 = clock_type::now();
      backend->copy_to_device(b.data(), a.data(), bytes);
      best = std::min(best, since(t0));
    }
    p.h2d_Bps = p.d2h_Bps = bytes / best;
    say(str("memcpy (host<->device on the CPU backend): ", p.h2d_Bps / 1e9, " GB/s"));
  }
  MemBandwidth bw = measure_mem_bandwidth(256ull << 20);
  p.host_mem_Bps = bw.triad_GBps * 1e9;
  say(str("memory bandwidth (triad): ", bw.triad_GBps, " GB/s"));

  // SSD: the store's sequential rates over the given directories, as one drive each.
  {
    IoBenchOptions io;
    io.dirs = o.dirs;
    io.size = o.io_size;
    nlohmann::json r = run_io_bench(io);
    p.ssds = static_cast<int>(o.dirs.size());
    p.ssd_read_Bps = r["read_MBps"].get<double>() * 1e6 / p.ssds;
    p.ssd_write_Bps = r["write_MBps"].get<double>() * 1e6 / p.ssds;
    say(str("SSD store over ", p.ssds, " directories: read ", r["read_MBps"].get<double>(), " MB/s, write ",
            r["write_MBps"].get<double>(), " MB/s"));
  }

  // The optimizer as the engine calls it: fp32 gradients in, fp32 weights out, state in
  // host memory, one 16M-parameter group.
  const size_t n = 16u << 20;
  std::vector<OptimGroup> groups{{"g", n, {{0, n, true}}}};
  OocAdamW opt(groups, {StateTier::kHost}, nullptr, {});
  std::vector<float> init(n, 0.01f), grad(n, 1e-3f), lowp(n);
  opt.init_group(0, init.data());
  int64_t t = 1;
  auto update = [&] {
    OocAdamW::Update u;
    u.grad = grad.data();
    u.lowp = lowp.data();
    u.lr = 1e-4f;
    u.t = t++;
    opt.wait(opt.submit(u));
  };
  update();
  double upd_alone = rate_for(2.0, update);
  p.optimizer_params_per_s = upd_alone * n;
  say(str("AdamW (host state, fp32 in/out): ", p.optimizer_params_per_s / 1e6, " M params/s"));

  // Both at once, as the executor runs them: GEMMs on one thread, updates on another.
  {
    LayerGemms g(512, 256);
    // Averages over whole windows here: the sharing is what is measured.
    double gemm_alone = rate_for(2.0, [&] { g.run(); }, nullptr, false);
    double upd_alone_avg = rate_for(2.0, update, nullptr, false);
    std::atomic<bool> stop{false};
    double upd_both = 0;
    std::thread th([&] { upd_both = rate_for(3.0, update, &stop, false); });
    double gemm_both = rate_for(3.0, [&] { g.run(); }, nullptr, false);
    stop = true;
    th.join();
    p.compute_share = std::min(1.0, gemm_both / gemm_alone);
    p.optimizer_share = std::min(1.0, upd_both / upd_alone_avg);
    say(str("GEMMs and AdamW together: compute at ", p.compute_share, ", optimizer at ", p.optimizer_share,
            " of their alone rates"));
  }
  return p;
}

namespace {

std::string tier_table_row(const SimResult& r) {
  return str(format_size(r.device_bytes), " / ", format_size(r.host_bytes), " / ", format_size(r.ssd_bytes));
}

struct Prediction {
  SimResult sim;
  Plan plan;
  std::string decisions;
  int micro_batch = 1;
  int plans_evaluated = 0;
  double search_s = 0;
};

Prediction predict(const Config& cfg, const HardwareProfile& hw, const SimulateOptions& o, int batch) {
  PlanRequest req = plan_request(cfg);
  req.micro_batch = batch;
  req.have_ssd = true;
  // Budgets: the config's where it sets them, else the profile's capacities.
  if (!req.device_budget) req.device_budget = hw.device_memory;
  if (!req.host_budget) req.host_budget = hw.host_memory;
  ActivationPolicy pol = cfg.offload.activations;
  Prediction out;
  if (pol == ActivationPolicy::kAuto) {
    SwapSearchOptions so;
    so.search_micro_batch = o.search_batch;
    SwapSearchResult s = search_swap(req, hw, so);
    out.sim = s.sim;
    out.plan = std::move(s.plan);
    out.decisions = s.summary();
    out.micro_batch = s.micro_batch;
    out.plans_evaluated = s.plans_evaluated;
    out.search_s = s.search_s;
  } else {
    if (pol == ActivationPolicy::kSwap && !req.acts.empty()) req.acts.assign(req.acts.size(), ActPlacement::kSsd);
    out.plan = make_plan(request_for_profile(req, hw));
    out.sim = simulate(out.plan, hw);
    std::vector<ActPlacement> acts;
    for (const auto& d : out.plan.layers) acts.push_back(d.act);
    SwapSearchResult tmp;
    tmp.acts = acts;
    out.decisions = tmp.summary();
    out.micro_batch = batch;
  }
  return out;
}

nlohmann::json prediction_json(const Prediction& p, const Config& cfg, const HardwareProfile& hw) {
  nlohmann::json j = p.sim.to_json();
  j["hardware"] = hw.name;
  j["ssds"] = hw.ssds;
  j["micro_batch"] = p.micro_batch;
  j["tokens_per_step"] = static_cast<double>(p.micro_batch) * cfg.model.seq_len;
  j["tokens_per_s"] = j["tokens_per_step"].get<double>() / p.sim.period_s;
  j["decisions"] = p.decisions;
  int wssd = 0, ossd = 0;
  for (const auto& d : p.plan.layers) {
    wssd += d.weights == StateTier::kSsd;
    ossd += d.optim == StateTier::kSsd;
  }
  j["layers_weights_on_ssd"] = wssd;
  j["layers_optimizer_on_ssd"] = ossd;
  if (p.plans_evaluated) {
    j["plans_evaluated"] = p.plans_evaluated;
    j["search_s"] = p.search_s;
  }
  return j;
}

}  // namespace

int run_simulate(const SimulateOptions& o) {
  std::vector<std::string> sets = o.sets;
  if (!o.acts.empty()) sets.push_back("offload.activations=" + o.acts);
  Config cfg = o.config.empty() ? parse_config(default_config_text(), "<default config>", sets)
                                : load_config_file(o.config, sets);
  HardwareProfile hw = load_hardware_profile(o.hardware);
  if (o.ssds) {
    if (o.ssds < 1 || o.ssds > 64) throw ConfigError(str("--ssds ", o.ssds, ": expected 1..64"));
    hw.ssds = o.ssds;
  }
  const int batch = o.batch ? o.batch : cfg.schedule.micro_batch;
  const ParamLayout layout = make_gpt_layout(cfg.model);

  if (!o.sweep.empty()) {
    if (o.sweep != "batch" && o.sweep != "ssds") throw ConfigError(str("--sweep '", o.sweep, "': expected batch or ssds"));
    nlohmann::json rows = nlohmann::json::array();
    std::vector<int> values;
    if (o.sweep == "batch") for (int b = 1; b <= 64; b *= 2) values.push_back(b);
    else for (int s = 1; s <= 12; ++s) values.push_back(s);
    for (int v : values) {
      HardwareProfile h = hw;
      int b = batch;
      if (o.sweep == "batch") b = v;
      else h.ssds = v;
      try {
        Prediction p = predict(cfg, h, o, b);
        rows.push_back(prediction_json(p, cfg, h));
      } catch (const Error& e) {
        rows.push_back({{o.sweep == "batch" ? "micro_batch" : "ssds", v}, {"error", e.what()}});
        if (o.sweep == "batch") break;  // larger micro-batches fit even less
      }
    }
    if (o.json) {
      std::printf("%s\n", nlohmann::json{{"sweep", o.sweep}, {"rows", rows}}.dump().c_str());
      return 0;
    }
    std::printf("%s on %s: sweep over %s\n", o.config.empty() ? "default config" : o.config.c_str(), hw.name.c_str(),
                o.sweep.c_str());
    std::printf("%5s %5s %11s %9s %10s %-10s %s\n", "batch", "ssds", "step", "TFLOP/s", "tokens/s", "busiest",
                "decisions");
    for (const auto& r : rows) {
      if (r.contains("error")) {
        std::printf("%s %d: %s\n", o.sweep.c_str(), r[o.sweep == "batch" ? "micro_batch" : "ssds"].get<int>(),
                    r["error"].get<std::string>().substr(0, 120).c_str());
        continue;
      }
      std::printf("%5d %5d %10.3fs %9.2f %10.1f %-10s %s\n", r["micro_batch"].get<int>(), r["ssds"].get<int>(),
                  r["period_s"].get<double>(), r["tflops"].get<double>(), r["tokens_per_s"].get<double>(),
                  r["busiest"].get<std::string>().c_str(), r["decisions"].get<std::string>().c_str());
    }
    return 0;
  }

  Prediction p = predict(cfg, hw, o, batch);
  nlohmann::json j = prediction_json(p, cfg, hw);
  j["params"] = layout.num_params();
  if (o.json) {
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("%-22s %.2fB parameters, %d layers, seq %d\n", "model", layout.num_params() / 1e9, cfg.model.n_layer,
              cfg.model.seq_len);
  std::printf("%-22s %s (%d SSD%s)\n", "hardware", hw.name.c_str(), hw.ssds, hw.ssds > 1 ? "s" : "");
  std::printf("%-22s %d\n", "micro-batch", p.micro_batch);
  std::printf("%-22s %s\n", "activations", p.decisions.c_str());
  std::printf("%-22s %d weights, %d optimizer state (of %d layers)\n", "on SSD", j["layers_weights_on_ssd"].get<int>(),
              j["layers_optimizer_on_ssd"].get<int>(), cfg.model.n_layer);
  std::printf("%-22s %.3f s (iterations overlapping; one alone: %.3f s)\n", "step", p.sim.period_s,
              p.sim.iteration_s);
  std::printf("%-22s %.2f (useful model FLOPs; %.3g recomputed FLOPs not counted)\n", "TFLOP/s", p.sim.tflops,
              p.sim.recompute_flops);
  std::printf("%-22s %.1f\n", "tokens/s", j["tokens_per_s"].get<double>());
  std::printf("%-22s %s\n", "peak device/host/SSD", tier_table_row(p.sim).c_str());
  for (int q = 0; q < kNumResources; ++q)
    std::printf("  busy %-16s %.3f s%s\n", resource_name(static_cast<Resource>(q)), p.sim.busy_s[q],
                static_cast<Resource>(q) == p.sim.busiest ? "  (busiest)" : "");
  if (p.plans_evaluated)
    std::printf("%-22s %d plans simulated in %.2f s\n", "search", p.plans_evaluated, p.search_s);
  return 0;
}

}  // namespace fuyou
