// fuyou-train: trains a model from a YAML config (or the embedded default).
#include <unistd.h>

#include <CLI/CLI.hpp>

#include "fuyou/config.h"
#include "fuyou/error.h"
#include "fuyou/log.h"
#include "fuyou/train.h"
#include "tools/tool_errors.h"

int main(int argc, char** argv) {
  CLI::App app{"fuyou-train: train a GPT on the CPU or GPU backend"};
  std::string config_path, run_dir;
  std::vector<std::string> sets;
  bool print_config = false, verbose = false;
  app.add_option("--config", config_path, "YAML config file (default: the embedded default)");
  app.add_option("--set", sets, "Override a key: section.key=value (repeatable)");
  app.add_option("--run-dir", run_dir, "Directory for metrics, logs and weights (must be new or empty)");
  app.add_flag("--print-config", print_config, "Print the resolved config and exit");
  app.add_flag("-v,--verbose", verbose, "Debug logging");
  CLI11_PARSE(app, argc, argv);

  fuyou::init_logging(verbose);
  try {
    fuyou::Config cfg = config_path.empty()
                            ? fuyou::parse_config(fuyou::default_config_text(), "<default config>", sets)
                            : fuyou::load_config_file(config_path, sets);
    if (print_config) {
      std::fputs(fuyou::config_to_yaml(cfg).c_str(), stdout);
      return 0;
    }
    fuyou::TrainOptions opts;
    opts.run_dir = run_dir;
    opts.progress_line = ::isatty(STDERR_FILENO);
    fuyou::run_training(cfg, opts);
  } catch (...) {
    return fuyou::tools::report_failure();
  }
  return 0;
}
