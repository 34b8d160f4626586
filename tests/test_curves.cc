// The curves of runs (include/fuyou/curves.h): what metrics.jsonl holds, drawn as SVG.

#include <catch2/catch.hpp>
#include <string>

#include "fuyou/curves.h"
#include "fuyou/error.h"
#include "test_support.h"

using namespace fuyou;
using namespace fuyou::test;
using Catch::Matchers::Contains;

namespace {

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("curves: metrics.jsonl's series, and an SVG with one line per run and quantity",
          "[curves]") {
  TempDir tmp("curves");
  // A run killed while writing its last line, and a loss that is not finite, leave no point.
  write_all(
      tmp.path + "/metrics.jsonl",
      "{\"step\": 0, \"val_loss\": 5.5, \"type\": \"val\"}\n"
      "{\"step\": 1, \"loss\": 5.0, \"lr\": 0.001, \"grad_norm\": 2.0, \"tokens_per_s\": 900, "
      "\"type\": \"train\"}\n"
      "{\"step\": 2, \"loss\": NaN, \"lr\": 0.002, \"type\": \"train\"}\n"
      "{\"step\": 3, \"loss\": 4.0, \"lr\": 0.002, \"grad_norm\": 1.5, \"tokens_per_s\": 950, "
      "\"type\": \"train\"}\n"
      "{\"step\": 3, \"val_loss\": 4.5, \"type\": \"val\"}\n"
      "{\"step\": 4, \"loss\": 3.");
  const RunCurves c = read_run_curves(tmp.path + "/metrics.jsonl", "a<b");
  CHECK(c.loss == RunCurves::Series{{1, 5.0}, {3, 4.0}});
  CHECK(c.val_loss == RunCurves::Series{{0, 5.5}, {3, 4.5}});
  CHECK(c.lr.size() == 2);  // the NaN line is not JSON: skipped whole
  CHECK(c.grad_norm.size() == 2);
  CHECK(c.tokens_per_s.size() == 2);
  RunCurves other = c;
  other.name = "second";
  other.grad_norm.clear();
  const std::string svg = curves_svg({c, other});
  CHECK(svg.rfind("<svg ", 0) == 0);
  CHECK(svg.find("</svg>") != std::string::npos);
  CHECK(count(svg, "<polyline") == 5 + 4);     // loss, val_loss, lr, grad_norm, tokens/s; less one
  CHECK(count(svg, "stroke-dasharray") == 2);  // validation, per run
  CHECK(svg.find("a&lt;b") != std::string::npos);
  CHECK(svg.find("a<b") == std::string::npos);
  // Nothing logged yet still draws (frames, and says so).
  CHECK_THAT(curves_svg({RunCurves{}}), Contains("(none logged)"));
  CHECK_THROWS_WITH(read_run_curves(tmp.path + "/absent.jsonl", "x"), Contains("cannot open"));
}
