#include "fuyou/breakdown.h"

#include <algorithm>
#include <cstdio>

#include "fuyou/op_class.h"

namespace fuyou {

StepBreakdown summarize_marks(const std::vector<Backend::TimingMark>& marks, double wall_s) {
  StepBreakdown b;
  b.wall_s = wall_s;
  b.marks = marks.size();
  for (size_t i = 0; i + 1 < marks.size(); ++i) {
    const double d = marks[i + 1].t - marks[i].t;
    const std::string phase = step_phase_name(tag_phase(marks[i].tag));
    const std::string cls = op_class_name(tag_class(marks[i].tag));
    b.by_phase[phase] += d;
    b.by_class[cls] += d;
    b.by_phase_class[phase + "." + cls] += d;
  }
  b.timeline_s = marks.empty() ? 0.0 : marks.back().t - marks.front().t;
  b.unaccounted_s = wall_s - b.timeline_s;
  return b;
}

nlohmann::json StepBreakdown::to_json() const {
  return {{"step_s", wall_s},
          {"timeline_s", timeline_s},
          {"unaccounted_s", unaccounted_s},
          {"unaccounted_share", wall_s > 0 ? unaccounted_s / wall_s : 0.0},
          {"marks", marks},
          {"by_phase", by_phase},
          {"by_class", by_class},
          {"by_phase_class", by_phase_class}};
}

std::string StepBreakdown::table() const {
  std::vector<std::pair<std::string, double>> rows(by_phase_class.begin(), by_phase_class.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second > b.second; });
  std::string out;
  char line[160];
  std::snprintf(
      line, sizeof line,
      "breakdown of one step: %.4f s; device timeline %.4f s; unaccounted %.4f s (%.1f%%)\n",
      wall_s, timeline_s, unaccounted_s, wall_s > 0 ? 100 * unaccounted_s / wall_s : 0.0);
  out += line;
  for (const auto& [name, s] : by_phase) {
    std::snprintf(line, sizeof line, "  %-34s %9.3f ms %5.1f%%\n", name.c_str(), 1e3 * s,
                  wall_s > 0 ? 100 * s / wall_s : 0.0);
    out += line;
  }
  for (const auto& [name, s] : rows) {
    std::snprintf(line, sizeof line, "    %-32s %9.3f ms %5.1f%%\n", name.c_str(), 1e3 * s,
                  wall_s > 0 ? 100 * s / wall_s : 0.0);
    out += line;
  }
  return out;
}

nlohmann::json marks_trace(const std::vector<Backend::TimingMark>& marks) {
  nlohmann::json events = nlohmann::json::array();
  for (int p = 0; p < static_cast<int>(StepPhase::kCount); ++p)
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", p},
                      {"args", {{"name", step_phase_name(static_cast<StepPhase>(p))}}}});
  for (size_t i = 0; i + 1 < marks.size(); ++i) {
    const int phase = static_cast<int>(tag_phase(marks[i].tag));
    events.push_back({{"name", op_class_name(tag_class(marks[i].tag))},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", phase},
                      {"ts", marks[i].t * 1e6},
                      {"dur", (marks[i + 1].t - marks[i].t) * 1e6}});
  }
  return {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
}

}  // namespace fuyou
