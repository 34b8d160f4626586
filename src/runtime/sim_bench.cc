// `fuyou-bench simulate`: a config's plan on a hardware profile, with the automatic
// placement search, sweeps over micro-batch and SSD count. (`profile` is profile_bench.cc.)
#include "fuyou/sim_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "fuyou/config.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/model.h"
#include "fuyou/simulator.h"
#include "fuyou/sizes.h"
#include "fuyou/swap_search.h"

namespace fuyou {

namespace {

std::string tier_table_row(const SimResult& r) {
  return str(format_size(r.device_bytes), " / ", format_size(r.host_bytes), " / ",
             format_size(r.ssd_bytes));
}

struct Prediction {
  SimResult sim;
  Plan plan;
  std::string decisions;
  int micro_batch = 1;
  int plans_evaluated = 0;
  double search_s = 0;
};

Prediction predict(const Config& cfg, const HardwareProfile& hw, const SimulateOptions& o,
                   int batch) {
  // The device's rules are the profile's (on a GPU the sums of squares run on the device).
  PlanRequest req = with_device(plan_request(cfg), plan_device(hw));
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
    if (pol == ActivationPolicy::kSwap && !req.acts.empty())
      req.acts.assign(req.acts.size(), ActPlacement::kSsd);
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
  // Every micro-batch of the step (the plan lays out grad_accum of them).
  j["grad_accum"] = p.plan.grad_accum;
  j["tokens_per_step"] = static_cast<double>(p.micro_batch) * cfg.model.seq_len * p.plan.grad_accum;
  j["tokens_per_s"] = j["tokens_per_step"].get<double>() / p.sim.period_s;
  j["decisions"] = p.decisions;
  int wssd = 0, ossd = 0;
  for (const auto& d : p.plan.layers) {
    wssd += d.weights == Tier::kSsd;
    ossd += d.optim == Tier::kSsd;
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
    if (o.sweep != "batch" && o.sweep != "ssds")
      throw ConfigError(str("--sweep '", o.sweep, "': expected batch or ssds"));
    nlohmann::json rows = nlohmann::json::array();
    std::vector<int> values;
    if (o.sweep == "batch")
      for (int b = 1; b <= 64; b *= 2) values.push_back(b);
    else
      for (int s = 1; s <= 12; ++s) values.push_back(s);
    for (int v : values) {
      HardwareProfile h = hw;
      int b = batch;
      if (o.sweep == "batch")
        b = v;
      else
        h.ssds = v;
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
    std::printf("%s on %s: sweep over %s\n", o.config.empty() ? "default config" : o.config.c_str(),
                hw.name.c_str(), o.sweep.c_str());
    std::printf("%5s %5s %11s %9s %10s %-10s %s\n", "batch", "ssds", "step", "TFLOP/s", "tokens/s",
                "busiest", "decisions");
    for (const auto& r : rows) {
      if (r.contains("error")) {
        std::printf("%s %d: %s\n", o.sweep.c_str(),
                    r[o.sweep == "batch" ? "micro_batch" : "ssds"].get<int>(),
                    r["error"].get<std::string>().substr(0, 120).c_str());
        continue;
      }
      std::printf("%5d %5d %10.3fs %9.2f %10.1f %-10s %s\n", r["micro_batch"].get<int>(),
                  r["ssds"].get<int>(), r["period_s"].get<double>(), r["tflops"].get<double>(),
                  r["tokens_per_s"].get<double>(), r["busiest"].get<std::string>().c_str(),
                  r["decisions"].get<std::string>().c_str());
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
  std::printf("%-22s %.2fB parameters, %d layers, seq %d\n", "model", layout.num_params() / 1e9,
              cfg.model.n_layer, cfg.model.seq_len);
  std::printf("%-22s %s (%d SSD%s)\n", "hardware", hw.name.c_str(), hw.ssds,
              hw.ssds > 1 ? "s" : "");
  std::printf("%-22s %d\n", "micro-batch", p.micro_batch);
  std::printf("%-22s %s\n", "activations", p.decisions.c_str());
  std::printf("%-22s %d weights, %d optimizer state (of %d layers)\n", "on SSD",
              j["layers_weights_on_ssd"].get<int>(), j["layers_optimizer_on_ssd"].get<int>(),
              cfg.model.n_layer);
  std::printf("%-22s %.3f s (iterations overlapping; one alone: %.3f s)\n", "step", p.sim.period_s,
              p.sim.iteration_s);
  std::printf("%-22s %.2f (useful model FLOPs; %.3g recomputed FLOPs not counted)\n", "TFLOP/s",
              p.sim.tflops, p.sim.recompute_flops);
  std::printf("%-22s %.1f\n", "tokens/s", j["tokens_per_s"].get<double>());
  std::printf("%-22s %s\n", "peak device/host/SSD", tier_table_row(p.sim).c_str());
  for (int q = 0; q < kNumResources; ++q)
    std::printf(
        "  busy %-16s %.3f s%s\n", resource_name(static_cast<Resource>(q)), p.sim.busy_s[q],
        static_cast<Resource>(q) == p.sim.busiest && !p.sim.disk_busiest ? "  (busiest)" : "");
  std::printf("  busy %-16s %.3f s%s\n", "disk", p.sim.disk_busy_s,
              p.sim.disk_busiest ? "  (busiest)" : "");
  if (p.plans_evaluated)
    std::printf("%-22s %d plans simulated in %.2f s\n", "search", p.plans_evaluated, p.search_s);
  return 0;
}

}  // namespace fuyou
