// Helpers shared by the planner's tests (scheduler, simulator).
#pragma once

#include <catch2/catch.hpp>
#include <cstdint>

#include "fuyou/model.h"
#include "fuyou/plan.h"

namespace fuyou::test {

// The request with the host budget lowered, a layer's weights at a time, until its plan has
// `slots` weights-out slots (an unlimited budget gives one per SSD-weight layer, and every
// such layer is then retained in its slot between steps, so no weights are read back).
inline PlanRequest with_wout_slots(PlanRequest req, int slots) {
  const Plan roomy = make_plan(req);
  const uint64_t wb = elem_type_size(req.tensors) * make_gpt_layout(req.model).groups[1].numel;
  for (uint64_t cut = 0; cut < roomy.memory.host_bytes && cut <= 4 * req.model.n_layer * wb;
       cut += wb) {
    req.host_budget = roomy.memory.host_bytes - cut;
    if (make_plan(req).pools.host_wout_slots == slots) return req;
  }
  FAIL("no host budget gives " << slots << " weights-out slots");
  return req;
}

}  // namespace fuyou::test
