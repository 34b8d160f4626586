// fuyou-train: trains a model from a YAML config (or the embedded default), or continues a
// run from a checkpoint (--resume). SIGINT / SIGTERM stop it gracefully (include/fuyou/stop.h):
// exit status 130 / 143 after a checkpoint (before training begins, without one: there is
// nothing to keep); a second signal exits at once.
#include <unistd.h>

#include <CLI/CLI.hpp>

#include "fuyou/checkpoint.h"
#include "fuyou/config.h"
#include "fuyou/error.h"
#include "fuyou/log.h"
#include "fuyou/stop.h"
#include "fuyou/train.h"
#include "tools/tool_errors.h"

int main(int argc, char** argv) {
  // First, before any thread exists: every thread the process starts inherits the blocked
  // stop signals, and only StopSignals' own thread receives them.
  fuyou::StopSignals stop;
  CLI::App app{"fuyou-train: train a GPT on the CPU or GPU backend"};
  std::string config_path, run_dir, resume;
  std::vector<std::string> sets;
  bool print_config = false, verbose = false, resume_or_start = false, eval_only = false,
       dry = false;
  app.add_option("--config", config_path, "YAML config file (default: the embedded default)");
  app.add_option("--set", sets, "Override a key: section.key=value (repeatable)");
  app.add_option("--run-dir", run_dir,
                 "Directory for metrics, logs and weights (must be new or empty; with --resume: "
                 "a new run branching from the checkpoint)");
  app.add_option("--resume", resume,
                 "Continue from a checkpoint: RUN_DIR (its latest) or RUN_DIR/checkpoints/step-N; "
                 "the config is the checkpoint's unless --config is given");
  app.add_flag(
      "--resume-or-start", resume_or_start,
      "With --run-dir: resume from its latest checkpoint when it has one, else start a new run "
      "there (a job scheduler can rerun the same command)");
  app.add_flag(
      "--eval-only", eval_only,
      "Report the validation loss of the model the config starts from (model.checkpoint) or of "
      "the --resume checkpoint, and exit; writes nothing");
  app.add_flag(
      "--dry-run", dry,
      "Run the checks the run makes before it starts (run directory, permissions, free space, SSD "
      "paths, data files), say whether it fits this machine (device and host memory, disk space) "
      "and the simulator's time per step and epoch (with offload.hardware), and exit: 0 fits, 3 "
      "does not, 1 the run would be refused (with the run's message)");
  app.add_flag("--print-config", print_config, "Print the resolved config and exit");
  app.add_flag("-v,--verbose", verbose, "Debug logging");
  CLI11_PARSE(app, argc, argv);

  fuyou::init_logging(verbose);
  try {
    fuyou::TrainOptions opts;
    fuyou::Config cfg;
    if (resume_or_start) {
      if (run_dir.empty() || !resume.empty())
        throw fuyou::ConfigError("--resume-or-start takes --run-dir DIR (and no --resume)");
      if (!fuyou::list_checkpoints(run_dir).empty()) {
        resume = run_dir;
        spdlog::info("--resume-or-start: {} has a checkpoint; resuming", run_dir);
      } else {
        // A run killed before its first checkpoint is started over in its directory.
        opts.restart_killed = true;
        spdlog::info("--resume-or-start: {} has no checkpoint; starting a new run", run_dir);
      }
    }
    if (!resume.empty()) {
      opts.resume_source = fuyou::open_resume_checkpoint(resume);
      opts.resume = opts.resume_source->dir();
      cfg = fuyou::resume_config(*opts.resume_source, config_path, sets);
    } else {
      cfg = config_path.empty()
                ? fuyou::parse_config(fuyou::default_config_text(), "<default config>", sets)
                : fuyou::load_config_file(config_path, sets);
    }
    if (print_config) {
      std::fputs(fuyou::config_to_yaml(cfg).c_str(), stdout);
      return 0;
    }
    opts.run_dir = run_dir;
    if (dry) {
      // A configuration the run would refuse ends as the run would: its message, its status.
      const fuyou::DryRun d = fuyou::dry_run(cfg, opts);
      for (const auto& line : d.lines) std::puts(line.c_str());
      if (d.refused) std::rethrow_exception(d.refused);
      return d.fits ? 0 : 3;
    }
    opts.eval_only = eval_only;
    opts.progress_line = ::isatty(STDERR_FILENO);
    opts.stop = &stop;
    fuyou::TrainSummary s = fuyou::run_training(cfg, opts);
    if (s.stop_signal) return 128 + s.stop_signal;
  } catch (...) {
    return fuyou::tools::report_failure();
  }
  return 0;
}
