// Automatic activation-swap management: chooses every layer's activation placement (keep,
// device, host, ssd, recompute; plan.h) and, when asked, the micro-batch, to minimise the
// simulated iteration time (per token, when the micro-batch varies) within the budgets.
// docs/simulator.md explains the search.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "fuyou/hardware.h"
#include "fuyou/plan.h"
#include "fuyou/simulator.h"

namespace fuyou {

// How many layers take each placement, indexed by ActPlacement.
using PlacementCounts = std::array<int, 5>;

// The canonical layout of a count vector over L layers: recomputed layers at 1, 3, 5, ...
// (each rebuilds its input from the stored layer below), then from layer 0 upwards the
// remaining layers on SSD, host, device, and kept last: the last layers are needed first
// in the backward, and the first layers' swaps have the whole forward to drain and the whole
// backward to come back. Throws Error when the counts do not sum to L or more than L/2
// layers are recomputed.
std::vector<ActPlacement> arrange_placements(const PlacementCounts& counts, int L);
PlacementCounts count_placements(const std::vector<ActPlacement>& acts);

struct SwapSearchOptions {
  bool search_micro_batch = false;
  int max_micro_batch = 256;  // upper end of the micro-batch search (powers of two)
};

struct SwapSearchResult {
  std::vector<ActPlacement> acts;
  int micro_batch = 1;
  Plan plan;
  SimResult sim;
  int plans_evaluated = 0;
  double search_s = 0;          // wall time of the search
  std::string summary() const;  // "keep 4, device 20, host 0, ssd 72, recompute 0"
};

// `req` gives the model, budgets, SSD availability and the starting micro-batch; its `acts`
// are ignored. The budgets are those of the device the profile describes, in the bytes the run
// stores (simulator.h). Throws Error, with make_plan's numbers, when no placement fits.
SwapSearchResult search_swap(const PlanRequest& req, const HardwareProfile& hw,
                             const SwapSearchOptions& opts = {});

// The rules of a device of `hw`'s kind (its `backend`: cpu or a GPU; shared_cpu).
PlanDevice plan_device(const HardwareProfile& hw);
// `req` for a device of `hw`'s kind (with_device(req, plan_device(hw))), but for
// device_sum_squares, which stays the request's: what the run's backend can do.
PlanRequest request_for_profile(PlanRequest req, const HardwareProfile& hw);

}  // namespace fuyou
