// Where a step's time goes (fuyou-bench train --breakdown): the spans between a backend's
// timing marks (Backend: step timing) summed per phase and per class of work
// (include/fuyou/op_class.h), against the step's wall-clock time; and the same spans as a
// Chrome trace.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fuyou/backend.h"

namespace fuyou {

struct StepBreakdown {
  double wall_s = 0;         // the step as the host timed it, start to device finished
  double timeline_s = 0;     // the device's timeline from the first mark to the last
  double unaccounted_s = 0;  // wall_s - timeline_s: before the first mark and after the last
  size_t marks = 0;
  // Seconds per phase ("forward"), per class ("gemm.qkv") and per phase and class
  // ("forward.gemm.qkv"); each sums to timeline_s.
  std::map<std::string, double> by_phase, by_class, by_phase_class;
  nlohmann::json to_json() const;
  std::string table() const;  // a text table, largest classes first
};

// The spans of `marks` (each from one mark to the next, charged to the first's tag); the last
// mark ends the timeline.
StepBreakdown summarize_marks(const std::vector<Backend::TimingMark>& marks, double wall_s);

// The marks' spans as Chrome trace events (chrome://tracing, Perfetto), one row per phase.
nlohmann::json marks_trace(const std::vector<Backend::TimingMark>& marks);

}  // namespace fuyou
