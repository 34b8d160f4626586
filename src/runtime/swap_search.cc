// The activation-placement search. Layers of one model are identical, so a placement is
// described by how many layers take each of the five options (arrange_placements lays the
// counts out); the search is a steepest-descent walk over those counts, each candidate
// built by make_plan (which checks the budgets) and timed by the simulator.
//
// Start: make_plan's memory rule (keep while the device budget allows, demote the last
// layers to device checkpoints, then host, then SSD). That rule already follows "most
// recompute FLOPs saved per byte stored first": a checkpoint (N x C floats) saves a whole
// recomputed layer forward, a kept layer's internals (about 7C + 2F floats per token) save
// the same forward for several times the bytes, so checkpoints are placed before internals
// are kept. Moves: shift 1, 2, 4, ... layers from one option to another. Ties (within 0.1%)
// go to the candidate with less recomputation, then fewer bytes stored on the device, so
// the ratio rule also decides between equally fast placements.
#include "fuyou/swap_search.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <tuple>
#include <utility>

#include "fuyou/error.h"
#include "fuyou/timing.h"

namespace fuyou {

std::vector<ActPlacement> arrange_placements(const PlacementCounts& c, int L) {
  int sum = 0;
  for (int k : c) {
    if (k < 0) throw Error("arrange_placements: negative count");
    sum += k;
  }
  if (sum != L) throw Error(str("arrange_placements: counts sum to ", sum, ", not ", L, " layers"));
  const int rec = c[static_cast<int>(ActPlacement::kRecompute)];
  if (rec > L / 2)
    throw Error(str("arrange_placements: ", rec, " recomputed layers of ", L, " (at most L/2)"));
  std::vector<ActPlacement> acts(L, ActPlacement::kKeep);
  std::vector<char> taken(L, 0);
  for (int i = 0; i < rec; ++i) {
    acts[2 * i + 1] = ActPlacement::kRecompute;
    taken[2 * i + 1] = 1;
  }
  int l = 0;
  for (ActPlacement a :
       {ActPlacement::kSsd, ActPlacement::kHost, ActPlacement::kDevice, ActPlacement::kKeep}) {
    for (int k = 0; k < c[static_cast<int>(a)]; ++k) {
      while (taken[l]) ++l;
      acts[l] = a;
      taken[l] = 1;
    }
  }
  return acts;
}

PlacementCounts count_placements(const std::vector<ActPlacement>& acts) {
  PlacementCounts c{};
  for (ActPlacement a : acts) ++c[static_cast<int>(a)];
  return c;
}

std::string SwapSearchResult::summary() const {
  PlacementCounts c = count_placements(acts);
  std::string s;
  for (int a = 0; a < 5; ++a)
    s += str(a ? ", " : "", act_placement_name(static_cast<ActPlacement>(a)), " ", c[a]);
  if (plan.deferred_updates)
    s += str("; ", plan.deferred_updates, " deferred update", plan.deferred_updates > 1 ? "s" : "");
  return s;
}

PlanDevice plan_device(const HardwareProfile& hw) {
  PlanDevice d;
  d.own_compute = !hw.shared_cpu;
  // The CPU backend's device arena is host memory; a GPU's is not.
  d.device_in_host = hw.backend == "cpu";
  d.sum_squares = hw.backend != "cpu";
  return d;
}

PlanRequest request_for_profile(PlanRequest req, const HardwareProfile& hw) {
  // The device's memory and whether it shares the CPU are the profile's; whether the sums of
  // squares run on the device stays the request's, the backend's to say (the emulated GPU has
  // no kernels to run them).
  const bool sums = req.device_sum_squares;
  req = with_device(std::move(req), plan_device(hw));
  req.device_sum_squares = sums;
  return req;
}

namespace {

struct Candidate {
  bool ok = false;
  double cost = 0;  // simulated seconds per token
  double recompute = 0;
  uint64_t device = 0;
  Plan plan;
  SimResult sim;
};

bool better(const Candidate& a, const Candidate& b) {
  if (!a.ok) return false;
  if (!b.ok) return true;
  if (a.cost < b.cost * 0.999) return true;
  if (b.cost < a.cost * 0.999) return false;
  if (a.recompute != b.recompute) return a.recompute < b.recompute;
  return a.device < b.device;
}

class Search {
 public:
  Search(const PlanRequest& req, const HardwareProfile& hw)
      : base_(request_for_profile(req, hw)), hw_(hw) {}

  // `deferred`: PlanRequest::deferred_updates of the candidate (-1: the request's own).
  Candidate evaluate(int B, const PlacementCounts& c, int deferred = -1) {
    auto key = std::make_tuple(B, c, deferred);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    Candidate cand;
    const int L = base_.model.n_layer;
    bool valid = c[static_cast<int>(ActPlacement::kRecompute)] <= L / 2 &&
                 (base_.have_ssd || c[static_cast<int>(ActPlacement::kSsd)] == 0);
    if (valid) {
      PlanRequest r = base_;
      r.micro_batch = B;
      r.acts = arrange_placements(c, L);
      if (deferred >= 0) r.deferred_updates = deferred;
      try {
        cand.plan = make_plan(r);
        cand.sim = simulate(cand.plan, hw_);
        cand.ok = true;
        cand.cost = cand.sim.period_s / (static_cast<double>(B) * base_.model.seq_len);
        cand.recompute = cand.sim.recompute_flops;
        cand.device = cand.sim.device_bytes;
        ++evaluated_;
      } catch (const Error&) {
        cand.ok = false;  // does not fit the budgets
      }
    }
    cache_.emplace(key, cand);
    return cand;
  }

  // make_plan's own memory rule at micro-batch B: the search's start. Not ok if nothing fits.
  Candidate start(int B, PlacementCounts* counts) {
    PlanRequest r = base_;
    r.micro_batch = B;
    r.acts.clear();
    r.default_act = ActPlacement::kKeep;
    try {
      Plan p = make_plan(r);
      std::vector<ActPlacement> acts;
      for (const auto& d : p.layers) acts.push_back(d.act);
      *counts = count_placements(acts);
      return evaluate(B, *counts);
    } catch (const Error&) {
      return Candidate{};
    }
  }

  // Moves counts of layers between placements while a move simulates better. `better` lets
  // costs within 0.1% tie and breaks ties by recomputation and device bytes, which is not
  // transitive: a walk of tied moves that may raise the cost came back to where it had been (a
  // cycle that ran for hours on GPT-3 175B at micro-batch 1). So no move may raise the cost:
  // the cost never rises along the walk, and where it stays, each round lowers recomputation
  // or device bytes, so the walk cannot return to a placement it has left, nor wander a
  // plateau of near-equal placements.
  Candidate descend(int B, PlacementCounts c, Candidate best) {
    for (;;) {
      Candidate round = best;
      PlacementCounts round_c = c;
      auto consider = [&](const PlacementCounts& n) {
        Candidate cand = evaluate(B, n);
        if (cand.ok && cand.cost <= best.cost && better(cand, round)) round = cand, round_c = n;
      };
      for (int from = 0; from < 5; ++from) {
        for (int to = 0; to < 5; ++to) {
          if (from == to) continue;
          for (int step = 1; step <= c[from]; step *= 2) {
            PlacementCounts n = c;
            n[from] -= step;
            n[to] += step;
            consider(n);
          }
          // Everything at once, which powers of two may skip.
          if (c[from] > 0 && (c[from] & (c[from] - 1))) {
            PlacementCounts n = c;
            n[to] += n[from];
            n[from] = 0;
            consider(n);
          }
        }
      }
      if (round_c == c) return best;
      c = round_c;
      best = round;
    }
  }

  int evaluated() const { return evaluated_; }
  const PlanRequest& base() const { return base_; }

 private:
  PlanRequest base_;
  const HardwareProfile& hw_;
  std::map<std::tuple<int, PlacementCounts, int>, Candidate> cache_;
  int evaluated_ = 0;
};

}  // namespace

SwapSearchResult search_swap(const PlanRequest& req, const HardwareProfile& hw,
                             const SwapSearchOptions& opts) {
  auto t0 = std::chrono::steady_clock::now();
  Search search(req, hw);
  std::vector<int> batches;
  if (opts.search_micro_batch) {
    for (int b = 1; b <= opts.max_micro_batch; b *= 2) batches.push_back(b);
  } else {
    batches.push_back(req.micro_batch);
  }
  Candidate best;
  int largest_fit = 0, first_misfit = 0;  // powers of two
  for (int B : batches) {
    PlacementCounts c{};
    Candidate s = search.start(B, &c);
    if (!s.ok) {
      // Nothing fits at this micro-batch; larger ones fit even less.
      if (opts.search_micro_batch && best.ok) {
        first_misfit = B;
        break;
      }
      continue;
    }
    largest_fit = B;
    Candidate b = search.descend(B, c, s);
    if (better(b, best)) best = b;
  }
  // Between the largest power of two that fits and the first that does not: the largest
  // micro-batch that fits (bisected on make_plan's own placement), searched as the others,
  // since a larger micro-batch often costs less per token (weights move once per step).
  if (largest_fit && first_misfit) {
    int lo = largest_fit, hi = first_misfit;
    while (hi - lo > 1) {
      const int mid = lo + (hi - lo) / 2;
      PlacementCounts c{};
      (search.start(mid, &c).ok ? lo : hi) = mid;
    }
    if (lo > largest_fit) {
      PlacementCounts c{};
      Candidate s = search.start(lo, &c);
      Candidate b = search.descend(lo, c, s);
      if (better(b, best)) best = b;
    }
  }
  if (!best.ok) {
    // make_plan's own error names the numbers that do not fit.
    PlanRequest r = search.base();
    r.acts.clear();
    make_plan(r);
    throw Error("automatic activation placement: no placement fits the budgets");
  }
  // With offload.deferred_updates auto: the number of deferred top-layer updates
  // (Plan::deferred_updates) that simulates fastest for the chosen placement, among 0, 1, 2,
  // 4, 8, ... (each holds one more layer's gradient in host memory), doubling while it gains.
  if (req.deferred_updates < 0 && !best.plan.holds_grads()) {
    const int L = best.plan.model.n_layer, B = best.plan.micro_batch;
    std::vector<ActPlacement> acts;
    for (const auto& l : best.plan.layers) acts.push_back(l.act);
    const PlacementCounts c = count_placements(acts);
    for (int d = 0; d < L; d = d ? 2 * d : 1) {
      if (d == best.plan.deferred_updates) continue;
      Candidate cand = search.evaluate(B, c, d);
      if (!cand.ok) break;  // its gradient slots do not fit the host budget, nor will more
      if (better(cand, best))
        best = std::move(cand);
      else if (d > 2 && d > best.plan.deferred_updates)
        break;  // past the best count: no more gains
    }
  }
  SwapSearchResult out;
  for (const auto& d : best.plan.layers) out.acts.push_back(d.act);
  out.micro_batch = best.plan.micro_batch;
  out.plan = std::move(best.plan);
  out.sim = std::move(best.sim);
  out.plans_evaluated = search.evaluated();
  out.search_s = seconds_since(t0);
  return out;
}

}  // namespace fuyou
