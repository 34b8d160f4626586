#include "fuyou/curves.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "fuyou/error.h"
#include "fuyou/safetensors.h"

namespace fuyou {
namespace {

// The picture: panels stacked, each kPanelH tall with its plot area inset by the margins.
constexpr double kWidth = 960, kPanelH = 210, kLeft = 80, kRight = 20, kTop = 30, kBottom = 30;
constexpr size_t kMaxPoints = 2000;  // per series: a long run is thinned to this many
const char* const kColours[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd",
                                "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

// A range [lo, hi] with room, never empty.
struct Range {
  double lo = INFINITY, hi = -INFINITY;
  void add(double v) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  bool empty() const { return !(lo <= hi); }
  void settle() {
    if (empty()) lo = 0, hi = 1;
    if (hi - lo < 1e-12 * std::max(1.0, std::fabs(hi))) {
      const double pad = std::max(std::fabs(hi) * 0.05, 1e-12);
      lo -= pad, hi += pad;
    }
  }
};

struct Panel {
  const char* title;
  RunCurves::Series RunCurves::*series;
  RunCurves::Series RunCurves::*dashed;  // drawn dashed beside it, or null
};
const Panel kPanels[] = {{"loss (validation dashed)", &RunCurves::loss, &RunCurves::val_loss},
                         {"learning rate", &RunCurves::lr, nullptr},
                         {"gradient norm", &RunCurves::grad_norm, nullptr},
                         {"tokens/s", &RunCurves::tokens_per_s, nullptr}};

// One panel at vertical offset `y0`: frame, ticks, and every run's series in its colour.
void draw_panel(std::string* svg, const Panel& p, double y0, const Range& steps,
                const std::vector<RunCurves>& runs) {
  Range v;
  for (const RunCurves& r : runs)
    for (auto s : {p.series, p.dashed})
      if (s)
        for (const auto& [step, x] : r.*s) v.add(x);
  const bool none = v.empty();
  v.settle();
  const double w = kWidth - kLeft - kRight, h = kPanelH - kTop - kBottom, top = y0 + kTop;
  auto px = [&](double step) { return kLeft + (step - steps.lo) / (steps.hi - steps.lo) * w; };
  auto py = [&](double x) { return top + h - (x - v.lo) / (v.hi - v.lo) * h; };
  *svg += str("<text x=\"", kLeft, "\" y=\"", top - 8, "\" font-weight=\"bold\">", p.title,
              none ? " (none logged)" : "", "</text>\n");
  *svg += str("<rect x=\"", kLeft, "\" y=\"", top, "\" width=\"", w, "\" height=\"", h,
              "\" fill=\"none\" stroke=\"#888\"/>\n");
  for (int i = 0; i <= 4; ++i) {
    const double yv = v.lo + (v.hi - v.lo) * i / 4, xv = steps.lo + (steps.hi - steps.lo) * i / 4;
    *svg += str("<line x1=\"", kLeft, "\" x2=\"", kLeft + w, "\" y1=\"", py(yv), "\" y2=\"", py(yv),
                "\" stroke=\"#eee\"/>\n");
    *svg += str("<text x=\"", kLeft - 6, "\" y=\"", py(yv) + 4, "\" text-anchor=\"end\">", num(yv),
                "</text>\n");
    *svg += str("<text x=\"", px(xv), "\" y=\"", top + h + 16, "\" text-anchor=\"middle\">",
                num(steps.hi - steps.lo >= 20 ? std::round(xv) : xv), "</text>\n");
  }
  for (size_t r = 0; r < runs.size(); ++r) {
    const char* colour = kColours[r % std::size(kColours)];
    for (auto s : {p.series, p.dashed}) {
      if (!s || (runs[r].*s).empty()) continue;
      const RunCurves::Series& pts = runs[r].*s;
      const size_t every = (pts.size() + kMaxPoints - 1) / kMaxPoints;
      std::string points;
      for (size_t i = 0; i < pts.size(); ++i)
        if (i % every == 0 || i + 1 == pts.size())
          points +=
              str(num(px(static_cast<double>(pts[i].first))), ",", num(py(pts[i].second)), " ");
      *svg += str("<polyline fill=\"none\" stroke=\"", colour, "\" stroke-width=\"1.5\"",
                  s == p.dashed ? " stroke-dasharray=\"6,3\"" : "", " points=\"", points, "\"/>\n");
    }
  }
}

}  // namespace

RunCurves read_run_curves(const std::string& metrics_path, const std::string& name) {
  std::ifstream in(metrics_path);
  if (!in) throw IoError(str(metrics_path, ": cannot open"));
  RunCurves c;
  c.name = name;
  auto take = [](const nlohmann::json& j, const char* key, int64_t step, RunCurves::Series* to) {
    if (j.contains(key) && j[key].is_number() && std::isfinite(j[key].get<double>()))
      to->emplace_back(step, j[key].get<double>());
  };
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) continue;
    const int64_t step = j["step"].get<int64_t>();
    take(j, "loss", step, &c.loss);
    take(j, "val_loss", step, &c.val_loss);
    take(j, "lr", step, &c.lr);
    take(j, "grad_norm", step, &c.grad_norm);
    take(j, "tokens_per_s", step, &c.tokens_per_s);
  }
  return c;
}

std::string curves_svg(const std::vector<RunCurves>& runs) {
  Range steps;
  for (const RunCurves& r : runs)
    for (const Panel& p : kPanels)
      for (auto s : {p.series, p.dashed})
        if (s)
          for (const auto& pt : r.*s) steps.add(static_cast<double>(pt.first));
  steps.settle();
  const double legend = 24.0 * static_cast<double>(runs.size()) + 10;
  const double height = kPanelH * static_cast<double>(std::size(kPanels)) + legend;
  std::string svg = str("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"", kWidth,
                        "\" height=\"", height, "\" font-family=\"sans-serif\" font-size=\"12\">\n",
                        "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n");
  for (size_t r = 0; r < runs.size(); ++r) {
    const double y = 20 + 24.0 * static_cast<double>(r);
    svg += str("<line x1=\"", kLeft, "\" x2=\"", kLeft + 30, "\" y1=\"", y - 4, "\" y2=\"", y - 4,
               "\" stroke=\"", kColours[r % std::size(kColours)], "\" stroke-width=\"3\"/>\n");
    svg +=
        str("<text x=\"", kLeft + 40, "\" y=\"", y, "\">", xml_escape(runs[r].name), "</text>\n");
  }
  for (size_t k = 0; k < std::size(kPanels); ++k)
    draw_panel(&svg, kPanels[k], legend + kPanelH * static_cast<double>(k), steps, runs);
  svg += str("<text x=\"", kWidth / 2, "\" y=\"", height - 4,
             "\" text-anchor=\"middle\">step</text>\n");
  return svg + "</svg>\n";
}

void write_curves_svg(const std::string& path, const std::vector<RunCurves>& runs) {
  const std::string svg = curves_svg(runs);
  write_file_atomic(path, svg.data(), svg.size());
}

}  // namespace fuyou
