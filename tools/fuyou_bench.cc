// fuyou-bench: measures the engine. `train` times optimizer steps of a config's model on
// random tokens; `gemm` times the CPU GEMMs of a config's shapes against this CPU's FMA peak;
// `io` times sequential writes and reads through the SSD store; `simulate` predicts an
// iteration on a hardware profile and `profile` measures this machine's (docs/simulator.md);
// `plan` prints the plan a config trains with (docs/architecture.md).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "fuyou/adam_bench.h"
#include "fuyou/backend_select.h"
#include "fuyou/breakdown.h"
#include "fuyou/checkpoint_bench.h"
#include "fuyou/config.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/hardware.h"
#include "fuyou/io_bench.h"
#include "fuyou/log.h"
#include "fuyou/rng.h"
#include "fuyou/sim_bench.h"
#include "fuyou/simulator.h"
#include "fuyou/sizes.h"
#include "fuyou/stop.h"
#include "fuyou/timing.h"
#include "fuyou/train.h"
#include "tools/tool_errors.h"

namespace {

// "100M" -> 1e8, "1.5G" -> 1.5e9, "4096" -> 4096.
uint64_t parse_count(const std::string& text) {
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  std::string unit(end);
  double mult = unit.empty()                 ? 1
                : unit == "K" || unit == "k" ? 1e3
                : unit == "M"                ? 1e6
                : unit == "G" || unit == "B" ? 1e9
                                             : -1;
  // The range check also keeps the conversion to uint64_t defined (NaN fails it too).
  if (end == text.c_str() || mult < 0 || !(v * mult >= 1 && v * mult < 1.8e19))
    throw fuyou::ConfigError("--params: '" + text +
                             "' is not a count from 1 to 1.8e19 (examples: 100M, 1.5G, 4096)");
  return static_cast<uint64_t>(v * mult);
}

using clock_type = std::chrono::steady_clock;
using fuyou::median;
using fuyou::seconds_since;

fuyou::Config load(const std::string& path, const std::vector<std::string>& sets) {
  return path.empty() ? fuyou::parse_config(fuyou::default_config_text(), "<default config>", sets)
                      : fuyou::load_config_file(path, sets);
}

// --config and --set: the config that `train`, `plan`, `gemm` and `checkpoint` measure.
struct ConfigArgs {
  std::string path;
  std::vector<std::string> sets;
};

void add_config_options(CLI::App* sub, ConfigArgs& c) {
  sub->add_option("--config", c.path, "YAML config (default: the embedded default)");
  sub->add_option("--set", c.sets, "Override a key: section.key=value");
}

struct TrainArgs {
  int steps = 5, warmup = 1;
  bool json = false;
  std::string trace;
  double ssd_tbw = 600;    // drive endurance in TB written (see docs/performance.md)
  std::string predict_on;  // a hardware profile: the simulator's figures for the run's plan on it
  bool breakdown = false;  // one more step, timed op by op (include/fuyou/breakdown.h)
};

CLI::App* add_train_command(CLI::App& app, ConfigArgs& c, TrainArgs& a) {
  auto* train =
      app.add_subcommand("train", "Time training steps of a config's model on random tokens");
  add_config_options(train, c);
  train->add_option("--steps", a.steps, "Timed steps (the median is reported)")
      ->check(CLI::PositiveNumber);
  train->add_option("--warmup", a.warmup, "Untimed warm-up steps")->check(CLI::NonNegativeNumber);
  train->add_option(
      "--trace", a.trace,
      "Write a timeline (Chrome trace JSON): offloaded, the last iterations' ops; in memory, the "
      "breakdown step's op classes");
  train->add_flag("--breakdown", a.breakdown,
                  "Time one more step op class by op class: per phase, per class, and what is left "
                  "unaccounted");
  train->add_option("--ssd-tbw", a.ssd_tbw,
                    "Drive endurance in TB written, for the drive-life figure");
  train->add_flag("--json", a.json, "One JSON object on stdout");
  train->add_option(
      "--predict-on", a.predict_on,
      "Hardware profile of this machine: add the simulator's figures for the run's plan (emulated: "
      "the emulated GPU's compute and PCIe with this profile's SSDs and optimizer, which the "
      "automatic activation placement then plans on too)");
  return train;
}

// One more step with the backend's timing marks on: where its time goes. The in-memory step
// is bracketed by marks of this thread (the step's); a plan's (offloaded, or in memory on the
// executor), the executor's compute thread marks, and whatever lies outside its first and last
// mark is unaccounted.
fuyou::StepBreakdown breakdown_step(fuyou::TrainEngine& engine, fuyou::Backend& be, int64_t s,
                                    const std::vector<const int32_t*>& ptrs,
                                    std::vector<fuyou::Backend::TimingMark>* marks) {
  const int edge = fuyou::timing_tag(fuyou::StepPhase::kOther, fuyou::OpClass::kHost);
  const auto t0 = clock_type::now();
  be.timing_start();
  if (!engine.plan()) be.timing_mark(edge);
  engine.step(s, ptrs);
  if (!engine.plan()) be.timing_mark(edge);
  *marks = be.timing_stop();
  return fuyou::summarize_marks(*marks, seconds_since(t0));
}

// The machine a run is on, from this machine's profile: `profile` itself, or, on the emulated
// device, the emulated GPU's compute and PCIe (scaled) with `profile`'s SSDs and optimizer
// (emulated_machine).
fuyou::HardwareProfile run_machine(const fuyou::Config& cfg, const std::string& profile) {
  fuyou::HardwareProfile host = fuyou::load_hardware_profile(profile);
  return cfg.runtime.backend == "emulated"
             ? fuyou::emulated_machine(fuyou::load_hardware_profile(cfg.offload.hardware),
                                       cfg.runtime.emulated_scale, host)
             : host;
}

// The simulator's prediction for the plan a run executes, on the machine the run is on.
nlohmann::json predict_plan(const fuyou::Config& cfg, const fuyou::Plan& plan,
                            const std::string& profile) {
  const fuyou::HardwareProfile hw = run_machine(cfg, profile);
  nlohmann::json j = fuyou::simulate(plan, hw).to_json();
  j["profile"] = hw.name;
  return j;
}

// The figures of an offloaded step `d` into j: iteration and busy times, host<->device and
// SSD bytes, drive life.
void offload_figures(nlohmann::json& j, const fuyou::StepResult& d, const fuyou::Plan& plan,
                     double tokens, double ssd_tbw) {
  j["iteration_s"] = d.iteration_s;
  double busiest = 0;
  for (int k = 0; k < fuyou::kNumResources; ++k) {
    j["busy_s"][fuyou::resource_name(static_cast<fuyou::Resource>(k))] = d.busy_s[k];
    busiest = std::max(busiest, d.busy_s[k]);
  }
  // The disks as one resource: busy while any request (read, write, optimizer state) is in
  // flight, so that the busiest resource is the disk where it binds.
  j["busy_s"]["disk"] = d.disk_busy_s;
  busiest = std::max(busiest, d.disk_busy_s);
  j["iteration_over_busiest"] = d.iteration_s / busiest;
  // Host<->device bytes of a step: the plan's, which the executor moves op for op (a test
  // compares them).
  fuyou::OpTraffic pcie;
  for (const fuyou::PlanOp& op : plan.ops) {
    const fuyou::OpTraffic t = fuyou::op_traffic(plan, op);
    pcie.h2d += t.h2d;
    pcie.d2h += t.d2h;
  }
  j["h2d_bytes_per_step"] = pcie.h2d;
  j["d2h_bytes_per_step"] = pcie.d2h;
  j["ssd_read_bytes_per_step"] = d.ssd_read_bytes;
  j["ssd_write_bytes_per_step"] = d.ssd_write_bytes;
  j["ssd_write_bytes_per_token"] = d.ssd_write_bytes / tokens;
  // Drive life: tokens one drive of `ssd_tbw` TB endurance can train before it is worn.
  j["ssd_tbw_assumed"] = ssd_tbw;
  j["tokens_per_drive_life"] =
      d.ssd_write_bytes ? ssd_tbw * 1e12 / (d.ssd_write_bytes / tokens) : 0.0;
}

// `train`: a config's engine stepped on random tokens; the timed steps' times and results
// stay for the figures.
class TrainBench {
 public:
  TrainBench(const fuyou::Config& cfg, const TrainArgs& a);
  // The warm-up and the timed steps, each logged unless --json.
  void run_steps();
  // The breakdown step, when --breakdown or an in-memory --trace asks for it; writes --trace.
  std::optional<fuyou::StepBreakdown> breakdown_and_trace();
  // The run's figures; offloaded, those of its median step and the prediction too.
  nlohmann::json figures(const std::optional<fuyou::StepBreakdown>& bd) const;

 private:
  const fuyou::Config& cfg_;
  const TrainArgs& a_;
  std::unique_ptr<fuyou::Backend> backend_;
  std::unique_ptr<fuyou::TrainEngine> engine_;
  std::vector<std::vector<int32_t>> mbs_;  // the micro-batches of every step
  std::vector<const int32_t*> ptrs_;
  // An emulated device's losses are NaN and its TFLOP/s those of the profile it emulates at
  // runtime.emulated_scale: every figure says so.
  bool emulated_ = false;
  std::vector<double> times_;               // of the timed steps
  std::vector<fuyou::StepResult> results_;  // of the timed steps
};

TrainBench::TrainBench(const fuyou::Config& cfg, const TrainArgs& a) : cfg_(cfg), a_(a) {
  // Its FLOP count, engine label and figures are a full fine-tune's: a LoRA step (no
  // weight-gradient GEMMs of the base) would be reported as something it is not.
  if (cfg.lora.enabled())
    throw fuyou::ConfigError(fuyou::str(
        "lora: fuyou-bench train does not time LoRA yet (lora.rank ", cfg.lora.rank,
        "): its FLOP count and figures are a full fine-tune's; time a LoRA run with fuyou-train, "
        "whose metrics.jsonl has step_s and tokens_per_s (docs/lora.md)"));
  std::string why;
  backend_ = fuyou::make_backend(cfg, &why);
  if (!a.json) spdlog::info("{}", why);
  // An emulated run with this machine's profile plans its activations for the machine as
  // emulated, not for the GPU profile's own disks and CPU.
  fuyou::EngineOptions eo;
  if (cfg.runtime.backend == "emulated" && !a.predict_on.empty())
    eo.placement_profile = run_machine(cfg, a.predict_on);
  engine_ = fuyou::make_train_engine(cfg, *backend_, eo);
  if (!a.json) std::fputs(engine_->describe().c_str(), stderr), std::fputs("\n", stderr);
  engine_->init_params();
  const int B = cfg.schedule.micro_batch, T = cfg.model.seq_len, accum = cfg.schedule.grad_accum;
  mbs_.assign(accum, std::vector<int32_t>(static_cast<size_t>(B) * (T + 1)));
  fuyou::Rng rng(cfg.runtime.seed);
  for (auto& mb : mbs_) {
    for (auto& t : mb) t = static_cast<int32_t>(rng.below(cfg.model.vocab_size));
    ptrs_.push_back(mb.data());
  }
  emulated_ = backend_->kind() == fuyou::BackendKind::kEmulated;
}

void TrainBench::run_steps() {
  for (int s = 0; s < a_.warmup + a_.steps; ++s) {
    auto t0 = clock_type::now();
    fuyou::StepResult r = engine_->step(s, ptrs_);
    double dt = seconds_since(t0);
    if (s >= a_.warmup) {
      times_.push_back(dt);
      results_.push_back(r);
    }
    if (!a_.json && emulated_)
      spdlog::info("step {}/{}: {:.3f}s (emulated device: no loss){}", s + 1, a_.warmup + a_.steps,
                   dt, s < a_.warmup ? " (warm-up)" : "");
    else if (!a_.json)
      spdlog::info("step {}/{}: {:.3f}s loss {:.4f}{}", s + 1, a_.warmup + a_.steps, dt, r.loss,
                   s < a_.warmup ? " (warm-up)" : "");
  }
}

// The in-memory step's trace is the breakdown step's marks; a plan's, the executor's last
// iterations.
std::optional<fuyou::StepBreakdown> TrainBench::breakdown_and_trace() {
  std::optional<fuyou::StepBreakdown> bd;
  std::vector<fuyou::Backend::TimingMark> marks;
  if (a_.breakdown || (!a_.trace.empty() && !engine_->plan()))
    bd = breakdown_step(*engine_, *backend_, a_.warmup + a_.steps, ptrs_, &marks);
  if (!a_.trace.empty() && engine_->plan()) engine_->write_trace(a_.trace);
  if (!a_.trace.empty() && !engine_->plan()) {
    std::ofstream out(a_.trace);
    if (!(out << fuyou::marks_trace(marks).dump() << "\n"))
      throw fuyou::IoError(a_.trace + ": cannot write trace");
  }
  return bd;
}

nlohmann::json TrainBench::figures(const std::optional<fuyou::StepBreakdown>& bd) const {
  const int B = cfg_.schedule.micro_batch, T = cfg_.model.seq_len, accum = cfg_.schedule.grad_accum;
  // A plan's steps overlap and each is timed from the previous step's loss to its own, so
  // the first step after an idle start covers only its forward: without a warm-up step it
  // stays in step_s_all but out of the median, when other steps were timed.
  const bool first_partial = engine_->plan() && a_.warmup == 0 && times_.size() > 1;
  double step_s =
      median(std::vector<double>(times_.begin() + (first_partial ? 1 : 0), times_.end()));
  double tokens = static_cast<double>(B) * T * accum;
  double tps = tokens / step_s;
  double tflops = fuyou::training_tflops(cfg_.model, tps);
  const fuyou::ParamLayout layout = fuyou::make_gpt_layout(cfg_.model);
  nlohmann::json j{{"backend", backend_->name()},
                   {"offloaded", engine_->offloaded()},
                   {"engine", !engine_->plan()       ? "in-memory step"
                              : engine_->offloaded() ? "offloaded plan"
                                                     : "in-memory plan"},
                   {"adamw", engine_->optimizer_on_device() ? "device" : "host"},
                   {"params", layout.num_params()},
                   {"tokens_per_step", tokens},
                   {"steps_timed", a_.steps},
                   {"step_s", step_s},
                   {"step_s_all", times_},
                   {"first_step_partial", first_partial},
                   {"tokens_per_s", tps},
                   {"tflops", tflops},
                   {"flops_per_token", 3.0 * fuyou::forward_flops_per_token(cfg_.model)},
                   {"peak_rss_bytes", fuyou::peak_rss_bytes()},
                   {"device_peak_bytes", backend_->memory().peak},
                   {"device_tensors", fuyou::elem_type_name(backend_->storage_type())},
                   {"emulated", emulated_}};
  if (bd) j["breakdown"] = bd->to_json();
  if (emulated_) {
    j["emulated_profile"] = cfg_.offload.hardware;
    j["emulated_scale"] = cfg_.runtime.emulated_scale;
  }
  if (engine_->plan()) {
    // The step whose iteration time is the median, so busy times and iteration agree.
    // (With an even count, the nearer of the middle two; never a partial first step.)
    size_t mid = first_partial ? 1 : 0;
    for (size_t i = mid; i < times_.size(); ++i)
      if (std::abs(times_[i] - step_s) < std::abs(times_[mid] - step_s)) mid = i;
    const fuyou::StepResult& d = results_[mid];
    offload_figures(j, d, *engine_->plan(), tokens, a_.ssd_tbw);
    if (!a_.predict_on.empty()) {
      j["predicted"] = predict_plan(cfg_, *engine_->plan(), a_.predict_on);
      j["iteration_over_predicted"] = d.iteration_s / j["predicted"]["period_s"].get<double>();
    }
  }
  return j;
}

// The figures of TrainBench::figures as a table.
void print_train_figures(const nlohmann::json& j, const std::optional<fuyou::StepBreakdown>& bd,
                         const TrainArgs& a) {
  const bool emulated = j["emulated"].get<bool>();
  std::printf(
      "%-16s %s\n%-16s %.2fM\n%-16s %.4f s (median of %d)%s\n%-16s %.1f\n%-16s %.4f%s\n", "backend",
      j["backend"].get<std::string>().c_str(), "params", j["params"].get<double>() / 1e6, "step",
      j["step_s"].get<double>(), a.steps, emulated ? " EMULATED" : "", "tokens/s",
      j["tokens_per_s"].get<double>(), "TFLOP/s", j["tflops"].get<double>(),
      emulated ? " (emulated: the profile's compute at runtime.emulated_scale, no GPU ran)" : "");
  if (bd) std::fputs(bd->table().c_str(), stdout);
  std::printf("%-16s %s\n", "engine", j["engine"].get<std::string>().c_str());
  if (j["engine"] == "in-memory step") return;
  std::printf("%-16s %.3f s (%.2fx the busiest resource)\n", "iteration",
              j["iteration_s"].get<double>(), j["iteration_over_busiest"].get<double>());
  for (auto& [k, v] : j["busy_s"].items())
    std::printf("  busy %-10s %.3f s\n", k.c_str(), v.get<double>());
  std::printf("%-16s %.2f GB to the device, %.2f GB back per step\n", "PCIe",
              j["h2d_bytes_per_step"].get<double>() / 1e9,
              j["d2h_bytes_per_step"].get<double>() / 1e9);
  std::printf("%-16s %.2f GB read, %.2f GB written per step; %.0f bytes written per token\n", "SSD",
              j["ssd_read_bytes_per_step"].get<double>() / 1e9,
              j["ssd_write_bytes_per_step"].get<double>() / 1e9,
              j["ssd_write_bytes_per_token"].get<double>());
  if (j.contains("predicted"))
    std::printf("%-16s %.3f s on %s (measured iteration %.2fx that)\n", "predicted",
                j["predicted"]["period_s"].get<double>(),
                j["predicted"]["profile"].get<std::string>().c_str(),
                j["iteration_over_predicted"].get<double>());
  if (j["tokens_per_drive_life"].get<double>() > 0)
    std::printf("%-16s %.3g tokens per %.0f TBW drive\n", "drive life",
                j["tokens_per_drive_life"].get<double>(), a.ssd_tbw);
}

int bench_train(const fuyou::Config& cfg, const TrainArgs& a) {
  TrainBench bench(cfg, a);
  bench.run_steps();
  const std::optional<fuyou::StepBreakdown> bd = bench.breakdown_and_trace();
  const nlohmann::json j = bench.figures(bd);
  if (a.json)
    std::printf("%s\n", j.dump().c_str());
  else
    print_train_figures(j, bd, a);
  return 0;
}

// `adam`: src/optim/adam_bench.cc does the work.
struct AdamArgs {
  fuyou::AdamBenchOptions opts;
  std::string params = "100M", grad = "bf16", state = "fp32", master = "fp32", simd = "auto";
  bool json = false;
};

CLI::App* add_adam_command(CLI::App& app, AdamArgs& a) {
  auto* adam = app.add_subcommand(
      "adam", "AdamW throughput in memory and out of core against its rooflines");
  adam->add_option("--params", a.params, "Parameters (e.g. 100M, 1.5G)");
  adam->add_option("--dir", a.opts.dirs,
                   "Store directory for the out-of-core run (repeat to stripe)");
  adam->add_option("--grad", a.grad, "Gradient type: f32, bf16, f16");
  adam->add_option("--steps", a.opts.steps, "Timed updates (median)")->check(CLI::PositiveNumber);
  adam->add_option("--first-step", a.opts.first_step,
                   "Adam's step count at the first in-memory update (beta2 0.95: from about 324 "
                   "the second moment's bias correction is 1)")
      ->check(CLI::PositiveNumber);
  adam->add_flag("--json", a.json, "One JSON object on stdout");
  adam->add_option("--state", a.state, "Adam moments: fp32, bf16, int8 (optimizer.state)");
  adam->add_option("--master", a.master, "Master weights: fp32, split (optimizer.master)");
  adam->add_option("--simd", a.simd,
                   "The in-memory update's instruction set: auto (the widest), scalar, avx2, "
                   "avx512");
  return adam;
}

int bench_adam(AdamArgs& a) {
  a.opts.params = parse_count(a.params);
  if (a.grad == "f32")
    a.opts.grad_type = fuyou::ElemType::kF32;
  else if (a.grad == "f16")
    a.opts.grad_type = fuyou::ElemType::kF16;
  else if (a.grad != "bf16")
    throw fuyou::ConfigError("--grad: expected f32, bf16 or f16, got '" + a.grad + "'");
  fuyou::OptimizerConfig oc;
  oc.state = a.state;
  oc.master = a.master;
  if (a.state != "fp32" && a.state != "bf16" && a.state != "int8")
    throw fuyou::ConfigError("--state: expected fp32, bf16 or int8, got '" + a.state + "'");
  if (a.master != "fp32" && a.master != "split")
    throw fuyou::ConfigError("--master: expected fp32 or split, got '" + a.master + "'");
  a.opts.format = fuyou::optim_format(oc);
  a.opts.simd = fuyou::simd_path_from_name(a.simd, "--simd");
  nlohmann::json r = fuyou::run_adam_bench(a.opts);
  if (a.json)
    std::printf("%s\n", r.dump().c_str());
  else
    fuyou::print_adam_bench(r);
  return 0;
}

CLI::App* add_plan_command(CLI::App& app, ConfigArgs& c, bool& json) {
  auto* plan = app.add_subcommand(
      "plan", "Print the plan a config trains with: placement, memory, buffers, ops");
  add_config_options(plan, c);
  plan->add_flag("--json", json, "The plan as JSON (Plan::to_json)");
  return plan;
}

// The plan as the offloading engine would build it on the config's backend (train_plan),
// whether or not this config would run offloaded.
int bench_plan(const fuyou::Config& cfg, bool json) {
  std::string why;
  auto backend = fuyou::make_backend(cfg, &why);
  if (!json) spdlog::info("{}", why);
  const fuyou::Plan p = fuyou::train_plan(cfg, *backend);
  if (json)
    std::printf("%s\n", p.to_json().dump(1).c_str());
  else
    std::printf("%s%s", p.table().c_str(), p.listing().c_str());
  return 0;
}

struct GemmArgs {
  std::string backend = "cpu";
  int reps = 20;
  int threads = 0;  // 0: runtime.threads
  bool json = false;
};

CLI::App* add_gemm_command(CLI::App& app, ConfigArgs& c, GemmArgs& a) {
  auto* gemm = app.add_subcommand(
      "gemm",
      "Time a config's GEMMs: on the CPU against the FMA peak; on CUDA against plain cuBLASLt");
  gemm->add_option("--backend", a.backend, "cpu (default) or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  gemm->add_option("--reps", a.reps, "cuda: calls per timed batch")->check(CLI::Range(1, 10000));
  add_config_options(gemm, c);
  gemm->add_option("--threads", a.threads, "Threads (0: all)");
  gemm->add_flag("--json", a.json, "One JSON object on stdout");
  return gemm;
}

// --backend cuda: the engine's layer GEMMs beside plain cuBLASLt GEMMs of the same shapes.
int bench_cuda_gemm(const fuyou::Config& cfg, int reps, bool json) {
  const nlohmann::json j = fuyou::run_cuda_gemm_bench(cfg, reps);
  if (json) {
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("%s; bf16 tensors and GEMMs, median of %d calls\n",
              j["backend"].get<std::string>().c_str(), j["reps"].get<int>());
  std::printf("%-8s %6s %6s %7s  %-24s %-24s\n", "part", "in", "out", "tokens",
              "forward TFLOP/s (ratio)", "backward TFLOP/s (ratio)");
  for (const auto& r : j["shapes"]) {
    auto cell = [](const nlohmann::json& d) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.1f / %.1f (%.2f)", d["engine_tflops"].get<double>(),
                    d["cublaslt_tflops"].get<double>(), d["engine_over_cublaslt"].get<double>());
      return std::string(buf);
    };
    std::printf("%-8s %6d %6d %7d  %-24s %-24s\n", r["part"].get<std::string>().c_str(),
                r["in"].get<int>(), r["out"].get<int>(), r["tokens"].get<int>(),
                cell(r["forward"]).c_str(), cell(r["backward"]).c_str());
  }
  std::printf("layer GEMMs: engine %.1f TFLOP/s, cuBLASLt %.1f TFLOP/s: %.2f of the ceiling\n",
              j["layer_engine_tflops"].get<double>(), j["layer_cublaslt_tflops"].get<double>(),
              j["layer_engine_over_cublaslt"].get<double>());
  return 0;
}

int bench_gemm(const fuyou::Config& cfg, int threads, bool json) {
  const nlohmann::json j = fuyou::run_cpu_gemm_bench(cfg, threads);
  const nlohmann::json& rows = j["shapes"];
  if (json) {
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("%s, %d threads; FMA peak (%s) %.1f GFLOP/s (%.1f per thread)\n",
                j["library"].get<std::string>().c_str(), j["threads"].get<int>(),
                j["fma_isa"].get<std::string>().c_str(), j["fma_peak_gflops"].get<double>(),
                j["fma_peak_gflops_1thread"].get<double>());
    std::printf("%-12s %6s %6s %6s %9s %7s\n", "shape", "M", "N", "K", "GFLOP/s", "peak");
    for (const auto& r : rows)
      std::printf("%-12s %6d %6d %6d %9.1f %6.0f%%\n", r["shape"].get<std::string>().c_str(),
                  r["M"].get<int>(), r["N"].get<int>(), r["K"].get<int>(),
                  r["gflops"].get<double>(), 100 * r["fraction_of_peak"].get<double>());
  }
  return 0;
}

// `io`: the storage tier against the disk; src/storage/io_bench.cc does the work.
struct IoArgs {
  fuyou::IoBenchOptions opts;
  std::string size = "4GiB", request = "1MiB", stripe = "4MiB", block = "0";
  bool json = false;
};

CLI::App* add_io_command(CLI::App& app, IoArgs& a) {
  auto* io = app.add_subcommand(
      "io", "Sequential write then read through the SSD store (compare with fio)");
  io->add_option("--dir", a.opts.dirs, "Directory (one per SSD); repeat to stripe")->required();
  io->add_option("--size", a.size, "Bytes written then read");
  io->add_option("--queue-depth", a.opts.queue_depth, "io_uring requests in flight")
      ->check(CLI::Range(1, 4096));
  io->add_option("--request-size", a.request, "Largest io_uring request");
  io->add_option("--stripe-unit", a.stripe, "Stripe unit across directories");
  io->add_option("--block", a.block, "Bytes per store request (0: queue depth x request size)");
  io->add_option("--buffers", a.opts.buffers, "Store requests kept outstanding")
      ->check(CLI::Range(2, 64));
  io->add_flag("--keep-files", a.opts.keep_files, "Leave the backing files");
  io->add_flag("!--no-register", a.opts.register_buffers,
               "Do not register the buffers with io_uring");
  io->add_flag("!--no-huge-pages", a.opts.huge_pages, "Do not ask for huge pages for the buffers");
  io->add_flag("!--no-verify", a.opts.verify,
               "Without the store's block checksums (offload.verify_store: false)");
  io->add_flag("--json", a.json, "One JSON object on stdout");
  return io;
}

int bench_io(IoArgs& a) {
  a.opts.size = fuyou::parse_size(a.size, "--size");
  a.opts.request_size = fuyou::parse_size(a.request, "--request-size");
  a.opts.stripe_unit = fuyou::parse_size(a.stripe, "--stripe-unit");
  a.opts.block = fuyou::parse_size(a.block, "--block");
  nlohmann::json r = fuyou::run_io_bench(a.opts);
  if (a.json)
    std::printf("%s\n", r.dump().c_str());
  else
    fuyou::print_io_bench(r);
  return 0;
}

// `simulate` and `profile`: the plan simulator (docs/simulator.md).
CLI::App* add_simulate_command(CLI::App& app, fuyou::SimulateOptions& sim) {
  auto* simulate = app.add_subcommand(
      "simulate", "Predict an iteration of a config's model on a hardware profile");
  simulate->add_option("--config", sim.config, "YAML config (default: the embedded default)");
  simulate->add_option("--set", sim.sets, "Override a key: section.key=value");
  simulate->add_option("--hardware", sim.hardware, "Hardware profile (configs/hardware/*.yaml)")
      ->required();
  simulate->add_option("--batch", sim.batch, "Micro-batch (default: the config's)")
      ->check(CLI::PositiveNumber);
  simulate->add_option("--ssds", sim.ssds, "Number of SSDs (default: the profile's)")
      ->check(CLI::Range(1, 64));
  simulate->add_option("--activations", sim.acts,
                       "auto, keep, swap or recompute (default: the config's)");
  simulate->add_flag("--search-batch", sim.search_batch,
                     "Let the automatic placement choose the micro-batch too");
  simulate->add_option("--sweep", sim.sweep, "Table over micro-batch (batch) or SSD count (ssds)");
  simulate->add_flag("--json", sim.json, "One JSON object on stdout");
  return simulate;
}

struct ProfileArgs {
  fuyou::ProfileOptions opts;
  std::string out, size = "1GiB", backend = "cpu";
};

CLI::App* add_profile_command(CLI::App& app, ProfileArgs& a) {
  auto* profile = app.add_subcommand(
      "profile", "Measure this machine's hardware profile (CPU or CUDA backend)");
  profile->add_option("--dir", a.opts.dirs, "Store directory on the SSD (repeat per SSD)")
      ->required();
  profile
      ->add_option("--out", a.out, "Write the profile here (e.g. configs/hardware/this-cpu.yaml)")
      ->required();
  profile->add_option("--threads", a.opts.threads, "Threads (0: all)");
  profile->add_option("--io-size", a.size, "Bytes written then read for the SSD figures");
  profile->add_option("--backend", a.backend,
                      "cpu (default) or cuda: which backend's compute and copies");
  return profile;
}

// `profile`: measures, prints what it measured, writes the YAML with the commands and date.
int bench_profile(fuyou::ProfileOptions& o, const std::string& backend, const std::string& size,
                  const std::string& out) {
  o.io_size = fuyou::parse_size(size, "--io-size");
  if (backend != "cpu" && backend != "cuda")
    throw fuyou::ConfigError("--backend: expected cpu or cuda, got '" + backend + "'");
  const bool gpu = backend == "cuda";
  std::string log;
  fuyou::HardwareProfile p =
      gpu ? fuyou::measure_cuda_profile(o, &log) : fuyou::measure_cpu_profile(o, &log);
  std::time_t now = std::time(nullptr);
  char date[64];
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  std::string header =
      gpu ? fuyou::str(
                "# This machine's CUDA-backend profile, measured by `fuyou-bench profile --backend "
                "cuda` on ",
                date, ".\n# Every figure below was measured here:\n")
          : fuyou::str(
                "# This machine's CPU-backend profile, measured by `fuyou-bench profile` on ", date,
                ".\n# Every figure below was measured here (fp32: the CPU backend computes in "
                "fp32):\n");
  for (size_t b = 0, e; b < log.size(); b = e + 1) {
    e = log.find('\n', b);
    header += "#   " + log.substr(b, e - b) + "\n";
  }
  if (!gpu)
    header +=
        "# compute_share / optimizer_share: GEMMs and AdamW run together, as a fraction of each "
        "alone.\n";
  std::FILE* f = std::fopen(out.c_str(), "w");
  if (!f) throw fuyou::IoError(out + ": cannot write the profile");
  std::string text = fuyou::hardware_profile_to_yaml(p, header);
  std::fwrite(text.data(), 1, text.size(), f);
  std::fclose(f);
  std::fputs(log.c_str(), stdout);
  std::printf("wrote %s\n", out.c_str());
  return 0;
}

struct CheckpointArgs {
  fuyou::CheckpointBenchOptions opts;
  bool json = false;
};

CLI::App* add_checkpoint_command(CLI::App& app, ConfigArgs& c, CheckpointArgs& a) {
  auto* ckpt =
      app.add_subcommand("checkpoint", "Save and restore a config's training state, beside fio");
  add_config_options(ckpt, c);
  ckpt->add_option(
      "--dir", a.opts.dir,
      "Directory for the checkpoint and fio's file (default: ./fuyou-bench-checkpoint-PID)");
  ckpt->add_flag("!--no-fio", a.opts.fio, "Do not run fio beside");
  ckpt->add_flag("--json", a.json, "One JSON object on stdout");
  return ckpt;
}

int bench_checkpoint(const fuyou::Config& cfg, const CheckpointArgs& a) {
  nlohmann::json r = fuyou::run_checkpoint_bench(cfg, a.opts);
  if (a.json)
    std::printf("%s\n", r.dump().c_str());
  else
    fuyou::print_checkpoint_bench(r);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // First, before any thread exists (include/fuyou/stop.h): a signal ends a measurement at once.
  fuyou::StopSignals stop;
  CLI::App app{"fuyou-bench: measure the engine"};
  app.require_subcommand(1);
  ConfigArgs config;
  TrainArgs train_args;
  auto* train = add_train_command(app, config, train_args);
  AdamArgs adam_args;
  auto* adam = add_adam_command(app, adam_args);
  bool plan_json = false;
  auto* plan = add_plan_command(app, config, plan_json);
  GemmArgs gemm_args;
  auto* gemm = add_gemm_command(app, config, gemm_args);
  IoArgs io_args;
  auto* io = add_io_command(app, io_args);
  fuyou::SimulateOptions sim;
  auto* simulate = add_simulate_command(app, sim);
  ProfileArgs profile_args;
  auto* profile = add_profile_command(app, profile_args);
  CheckpointArgs ckpt_args;
  auto* ckpt = add_checkpoint_command(app, config, ckpt_args);
  CLI11_PARSE(app, argc, argv);

  fuyou::init_logging(false);
  try {
    if (*io) return bench_io(io_args);
    if (*simulate) return fuyou::run_simulate(sim);
    if (*profile)
      return bench_profile(profile_args.opts, profile_args.backend, profile_args.size,
                           profile_args.out);
    if (*adam) return bench_adam(adam_args);
    fuyou::Config cfg = load(config.path, config.sets);
    if (*train) return bench_train(cfg, train_args);
    if (*plan) return bench_plan(cfg, plan_json);
    if (*gemm && gemm_args.backend == "cuda")
      return bench_cuda_gemm(cfg, gemm_args.reps, gemm_args.json);
    if (*gemm)
      return bench_gemm(cfg, gemm_args.threads ? gemm_args.threads : cfg.runtime.threads,
                        gemm_args.json);
    if (*ckpt) return bench_checkpoint(cfg, ckpt_args);
  } catch (...) {
    return fuyou::tools::report_failure();
  }
  return 0;
}
