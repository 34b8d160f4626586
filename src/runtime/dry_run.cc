// fuyou-train --dry-run: whether a config's run fits this machine (device memory, host
// memory, the run directory's disk, the SSD store's disks) and how long the simulator says an
// epoch and the run take, without training or writing anything.
#include <sys/statvfs.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include "fuyou/backend_select.h"
#include "fuyou/checkpoint.h"
#include "fuyou/data.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/hardware.h"
#include "fuyou/log.h"
#include "fuyou/lora.h"
#include "fuyou/model.h"
#include "fuyou/simulator.h"
#include "fuyou/sizes.h"
#include "fuyou/train.h"
#include "src/runtime/run_checks.h"

namespace fs = std::filesystem;

namespace fuyou {
namespace {

uint64_t mem_available() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  uint64_t kib = 0;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

// Free bytes of the filesystem `path` is on (or would be: its nearest existing ancestor),
// and that filesystem's id.
uint64_t free_bytes_at(const fs::path& path, uint64_t* fsid) {
  const fs::path p = existing_ancestor(path);
  struct statvfs sv {};
  if (::statvfs(p.c_str(), &sv) != 0) return 0;
  if (fsid) *fsid = sv.f_fsid;
  return static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
}

// Training tokens of the config's data without reading it: shard headers,
// or the text files' bytes less the validation share.
uint64_t train_tokens(const DataConfig& d) {
  uint64_t n = 0;
  for (const auto& p : d.train_shards) n += read_token_shard_header(p).count;
  std::error_code ec;
  for (const auto& t : d.text) {
    if (fs::is_regular_file(t, ec)) n += fs::file_size(t, ec);
    if (fs::is_directory(t, ec))
      for (auto it = fs::recursive_directory_iterator(t, ec);
           !ec && it != fs::recursive_directory_iterator(); it.increment(ec))
        if (it->is_regular_file(ec)) n += it->file_size(ec);
  }
  if (!d.text.empty()) n = static_cast<uint64_t>(static_cast<double>(n) * (1 - d.val_fraction));
  return n;
}

std::string duration(double s) {
  if (!std::isfinite(s)) return "?";
  if (s >= 86400)
    return str(std::round(s / 3600), " h (", std::round(s / 86400 * 10) / 10, " days)");
  if (s >= 3600) return str(std::round(s / 360) / 10, " h");
  if (s >= 60) return str(std::round(s / 6) / 10, " min");
  return str(std::round(s * 10) / 10, " s");
}

struct Line {
  std::string what;
  uint64_t need = 0, have = 0;
  std::string note;
  std::string refused;  // the run's own refusal, which decides the verdict where it is set
};

// The report: memory, disks, time. Adds its findings to r->lines; clears r->fits when one
// does not fit; sets r->refused and *refusal where the run would refuse what it finds (the SSD
// store's space) and nothing was refused before.
void report_fit(const Config& cfg, const std::string& run_dir, DryRun* out, std::string* refusal) {
  DryRun& r = *out;
  std::string why;
  std::unique_ptr<Backend> be = make_backend(cfg, &why);
  const ModelConfig& m = cfg.model;
  const ParamLayout layout = make_gpt_layout(m);
  const double params = static_cast<double>(layout.num_params());
  r.lines.push_back(str("model: ", m.family, ", ", m.n_layer, " layers, d_model ", m.d_model, ", ",
                        params >= 1e9 ? str(std::round(params / 1e7) / 100, "B")
                                      : str(std::round(params / 1e4) / 100, "M"),
                        " parameters; micro-batch ", cfg.schedule.micro_batch, " x ", m.seq_len,
                        " tokens, grad_accum ", cfg.schedule.grad_accum));
  r.lines.push_back(why);
  const bool device_in_host = be->device_is_host_memory();
  const uint64_t device_cap = device_in_host ? 0 : be->memory().capacity;
  std::vector<Line> checks;
  Plan plan;
  bool have_plan = false;
  EngineChoice choice = choose_engine(cfg, *be, 0);
  if (choice.kind == EngineKind::kInMemoryPlan) {
    plan = std::move(*choice.plan);
    r.lines.push_back(plan.device_optimizer
                          ? "engine: in memory as a plan of the scheduler (weights, gradients, "
                            "activations and AdamW's state on the device, each group updated there "
                            "after its backward)"
                          : "engine: in memory as a plan of the scheduler (weights, gradients and "
                            "activations on the device, AdamW on the host beside the backward and "
                            "the next forward)");
    have_plan = true;
    if (!device_in_host)
      checks.push_back({"device memory", plan.memory.device_bytes, device_cap, ""});
    checks.push_back({"host memory", plan.memory.host_bytes, mem_available(), "MemAvailable"});
  } else if (choice.kind == EngineKind::kLora) {
    const LoraLayout lora = make_lora_layout(m, cfg.lora);
    r.lines.push_back(str("engine: LoRA (", choice.why, "): rank ", lora.rank, ", scale ",
                          lora.scale, ", ", lora.adapters.size(), " adapted linears, ",
                          lora.params.num_params(),
                          " adapter parameters; AdamW over them on the "
                          "host"));
    // The LoRA step's memory is not modelled: the in-memory step's estimate is a bound (it
    // counts a gradient and moments of the base that a frozen base does not have).
    r.lines.push_back(str(
        "memory: not predicted for LoRA (the planner does not know it yet); at most the in-memory "
        "step's ",
        format_size(
            in_memory_host_bytes(m, cfg.schedule.micro_batch, device_in_host, be->storage_bytes())),
        " of host memory, ", format_size(mem_available()), " available"));
  } else if (choice.kind == EngineKind::kInMemoryStep) {
    r.lines.push_back(str("engine: in memory, the in-memory step (", choice.why, ")"));
    const uint64_t dev = in_memory_device_bytes(m, cfg.schedule.micro_batch, be->storage_bytes());
    if (!device_in_host) checks.push_back({"device memory", dev, device_cap, ""});
    checks.push_back(
        {"host memory",
         in_memory_host_bytes(m, cfg.schedule.micro_batch, device_in_host, be->storage_bytes(),
                              sums_grads_in_fp32(cfg), optim_format(cfg.optimizer)),
         mem_available(), "MemAvailable"});
  } else {
    r.lines.push_back(str("engine: offloaded (the scheduler's plan): ", choice.why));
    try {
      plan = train_plan(cfg, *be);
      have_plan = true;
      if (!device_in_host)
        checks.push_back({"device memory", plan.memory.device_bytes, device_cap, ""});
      checks.push_back({"host memory", plan.memory.host_bytes, mem_available(), "MemAvailable"});
      if (plan.memory.ssd_bytes) {
        std::set<uint64_t> seen;
        uint64_t free = 0;
        for (const auto& p : cfg.offload.ssd_paths) {
          uint64_t id = 0;
          const uint64_t f = free_bytes_at(p, &id);
          if (seen.insert(id).second) free += f;
        }
        Line ssd{"SSD store (offload.ssd_paths)", plan.memory.ssd_bytes, free, "", ""};
        // The verdict is the run's, per filesystem: the stripes divide the state between the
        // paths, so one small filesystem refuses the run whatever the others hold.
        try {
          check_plan_ssd_space(cfg, plan);
        } catch (const Error& e) {
          if (!r.refused) {
            r.refused = std::current_exception();
            *refusal = e.what();
          }
          ssd.refused = e.what();
        }
        checks.push_back(ssd);
      }
    } catch (const Error& e) {
      r.fits = false;
      r.lines.push_back(str("plan: DOES NOT FIT: ", e.what()));
    }
  }
  const int keep = cfg.checkpoint.keep + (cfg.checkpoint.keep_best ? 1 : 0);
  const uint64_t ckpt = checkpoint_bytes(cfg);
  checks.push_back({str("run directory ", run_dir.empty() ? std::string("runs/") : run_dir),
                    weights_file_bytes(cfg) + (keep + 1) * ckpt,
                    free_bytes_at(run_dir.empty() ? fs::path("runs") : fs::path(run_dir), nullptr),
                    str("final weights + ", keep + 1, " checkpoints")});
  for (const Line& c : checks) {
    const bool ok = c.refused.empty() && (c.have == 0 || c.need <= c.have);
    if (!ok) r.fits = false;
    r.lines.push_back(str(c.what, ": needs ", format_size(c.need),
                          c.note.empty() || c.note == "MemAvailable" ? "" : " (" + c.note + ")",
                          ", has ", c.have ? format_size(c.have) : std::string("?"),
                          c.note == "MemAvailable" ? " available" : "",
                          ok ? ": fits" : ": DOES NOT FIT",
                          c.refused.empty() ? "" : " (" + c.refused + ")"));
  }
  // Time: the simulator's steady-state step of the plan on offload.hardware.
  if (choice.kind == EngineKind::kLora) {
    r.lines.push_back(
        "time: no prediction for LoRA: the simulator does not know the LoRA step yet "
        "(docs/lora.md)");
  } else if (cfg.offload.hardware.empty()) {
    r.lines.push_back(
        "time: no prediction without a hardware profile: set offload.hardware (this machine's: "
        "fuyou-bench profile --dir DIR --out FILE)");
  } else {
    const HardwareProfile hw = run_hardware_profile(cfg);
    if (!have_plan) plan = train_plan(cfg, *be);
    const SimResult sim = simulate(plan, hw);
    r.step_s = sim.period_s;
    const double tokens_per_step =
        static_cast<double>(cfg.schedule.micro_batch) * m.seq_len * cfg.schedule.grad_accum;
    const uint64_t tokens = train_tokens(cfg.data);
    r.epoch_s = tokens ? tokens / tokens_per_step * sim.period_s : 0;
    r.lines.push_back(
        str("time: a step ", std::round(sim.period_s * 1000) / 1000, " s on ", hw.name,
            " (simulated, ", cfg.offload.hardware,
            cfg.offload.ssd_paths.empty() ? std::string()
                                          : str(", ", hw.ssds, " SSD", hw.ssds > 1 ? "s" : "",
                                                ": the filesystems of offload.ssd_paths"),
            "); ", cfg.schedule.steps, " steps ", duration(sim.period_s * cfg.schedule.steps),
            tokens ? str("; an epoch (", tokens, " training tokens) ", duration(r.epoch_s))
                   : std::string("; no training data to size an epoch")));
  }
}

}  // namespace

DryRun dry_run(const Config& cfg, const std::string& run_dir) {
  TrainOptions opts;
  opts.run_dir = run_dir;
  return dry_run(cfg, opts);
}

DryRun dry_run(const Config& cfg, const TrainOptions& opts) {
  DryRun r;
  // First what the run checks before it starts, by the run's own code: a refusal is the run's.
  const std::string run_dir = resolved_run_dir(opts);
  std::string refusal;
  try {
    check_before_run(cfg, opts, run_dir);
  } catch (const Error& e) {
    r.fits = false;
    r.refused = std::current_exception();
    refusal = e.what();
  }
  try {
    report_fit(cfg, run_dir, &r, &refusal);
  } catch (const Error& e) {
    if (!r.refused) throw;
    r.lines.push_back(str("(the rest of the report: ", e.what(), ")"));
  }
  if (r.refused) {
    r.lines.push_back(str("refused: ", refusal));
    r.lines.push_back("verdict: the run would be refused (above)");
  } else {
    r.lines.push_back(r.fits ? "verdict: fits this machine" : "verdict: DOES NOT FIT this machine");
  }
  return r;
}

}  // namespace fuyou
