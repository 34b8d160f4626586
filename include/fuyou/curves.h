// Curves of training runs: the train and validation loss, learning rate, gradient norm and
// tokens/s of metrics.jsonl against step, drawn as one SVG (plain text, no dependency). A run
// directory's curves.svg is rewritten at each evaluation (and at the end); fuyou-plot draws
// several runs in one picture.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fuyou {

struct RunCurves {
  using Series = std::vector<std::pair<int64_t, double>>;  // (step, value), in file order
  std::string name;                                        // the legend's
  Series loss, val_loss, lr, grad_norm, tokens_per_s;
};

// metrics.jsonl's "train" lines (loss, lr, grad_norm, tokens_per_s) and "val" lines (val_loss).
// A line that is not JSON (a run killed while writing it) and values that are not finite
// numbers are skipped; IoError when the file cannot be read.
RunCurves read_run_curves(const std::string& metrics_path, const std::string& name);

// One panel per quantity (loss with validation dashed, learning rate, gradient norm,
// tokens/s), one colour per run, steps shared along x.
std::string curves_svg(const std::vector<RunCurves>& runs);

// curves_svg written to `path` atomically (PATH.tmp, then renamed).
void write_curves_svg(const std::string& path, const std::vector<RunCurves>& runs);

}  // namespace fuyou
