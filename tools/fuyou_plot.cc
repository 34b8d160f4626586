// fuyou-plot: the curves of one or more runs in one SVG, to compare them.
//   fuyou-plot RUN_DIR_OR_METRICS_JSONL... --out runs.svg
// Each run is a colour, named by its directory; the panels are those of a run's own
// curves.svg (include/fuyou/curves.h).
#include <CLI/CLI.hpp>
#include <filesystem>

#include "fuyou/curves.h"
#include "fuyou/error.h"
#include "fuyou/log.h"
#include "tools/tool_errors.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  CLI::App app{"fuyou-plot: the loss, learning rate, grad norm and tokens/s of runs in one SVG"};
  std::vector<std::string> runs;
  std::string out;
  app.add_option("runs", runs, "Run directories or their metrics.jsonl files")->required();
  app.add_option("--out", out, "SVG file to write")->required();
  CLI11_PARSE(app, argc, argv);
  fuyou::init_logging(false);
  try {
    std::vector<fuyou::RunCurves> curves;
    for (const std::string& r : runs) {
      std::error_code ec;
      const fs::path p = fs::path(r).lexically_normal();
      const bool dir = fs::is_directory(p, ec);
      const fs::path metrics = dir ? p / "metrics.jsonl" : p;
      const fs::path named = dir ? p : p.parent_path();
      std::string name = named.filename().string();
      if (name.empty() || name == ".") name = fs::absolute(named, ec).filename().string();
      curves.push_back(fuyou::read_run_curves(metrics.string(), name.empty() ? r : name));
    }
    fuyou::write_curves_svg(out, curves);
    spdlog::info("{} run(s) -> {}", curves.size(), out);
  } catch (...) {
    return fuyou::tools::report_failure();
  }
  return 0;
}
