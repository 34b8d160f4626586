// The fp16 dynamic loss-scaling state machine (include/fuyou/loss_scale.h). Powers of two
// throughout, so every comparison is exact.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>

#include "fuyou/error.h"
#include "fuyou/loss_scale.h"

using namespace fuyou;

TEST_CASE("loss scale backs off on overflow, skips the step, grows after clean steps",
          "[loss_scale]") {
  LossScaleConfig c;
  c.initial = 1024;
  c.growth_interval = 3;
  c.min_scale = 256;
  c.max_scale = 4096;
  DynamicLossScaler s(c);
  CHECK(s.scale() == 1024);
  CHECK(s.unscale() == 1.0 / 1024);
  CHECK(s.update(1.0));
  CHECK(s.update(2.0));
  CHECK(s.scale() == 1024);  // two clean steps: not yet
  CHECK(s.update(3.0));
  CHECK(s.scale() == 2048);  // the third grows it
  CHECK(s.clean_steps_in_a_row() == 0);
  CHECK(s.update(1.0));
  CHECK_FALSE(s.update(std::numeric_limits<double>::infinity()));  // skip, back off
  CHECK(s.scale() == 1024);
  CHECK(s.clean_steps_in_a_row() == 0);  // the interval restarts after an overflow
  CHECK_FALSE(s.update(std::nan("")));
  CHECK(s.scale() == 512);
  CHECK(s.skipped_steps() == 2);
  for (int i = 0; i < 9; ++i) CHECK(s.update(1.0));
  CHECK(s.scale() == 4096);  // 512 -> 1024 -> 2048 -> 4096
  for (int i = 0; i < 3; ++i) CHECK(s.update(1.0));
  CHECK(s.scale() == 4096);  // capped at max_scale
  for (int i = 0; i < 4; ++i) CHECK_FALSE(s.update(INFINITY));
  CHECK(s.scale() == 256);                     // 4096 / 2^4, at min_scale
  CHECK_THROWS_AS(s.update(INFINITY), Error);  // overflow at the floor: diverged, loudly
}
