// Cross-iteration dependencies: which ops of iteration t each op of iteration t+1 waits for.
//
// Every op touches named buffers: a device weight, checkpoint or gradient slot, a host
// staging slot, a layer's host weights, an SSD extent, the resident embedding. Within one
// iteration the planner orders the users of each buffer by explicit dependencies. Across
// two iterations of the same plan, an op of t+1 must in addition wait for the ops of t that
// touched any of its buffers; since every resource runs its ops in order, the last such op
// on each other resource is enough. Read-after-read pairs are ordered too (conservative:
// they are few, and all on the same side of an update).
#include <algorithm>
#include <array>
#include <map>

#include "fuyou/error.h"
#include "fuyou/plan.h"

namespace fuyou {
namespace {

enum class Buf {
  kDevWeightSlot, kHostReadSlot, kHostWeights, kHostWoutSlot, kSsdWeights,
  kDevAct,  // index: BufRef kind * 2^20 + index
  kHostCkptSlot, kHostCkpt, kSsdCkpt,
  kDevGradSlot, kDevEmbedGrad, kDevFinalGrad,
  kHostGrad,  // index: BufRef kind * 2^20 + index
  kSsdGrads,
  kDevEmbed, kDevFinal, kHostEmbed, kHostFinal,
};

using Key = std::pair<Buf, int>;

Key act_key(const BufRef& b) { return {Buf::kDevAct, (static_cast<int>(b.kind) << 20) + b.index}; }
Key host_grad_key(const BufRef& b) { return {Buf::kHostGrad, (static_cast<int>(b.kind) << 20) + b.index}; }

// The buffers op `o` reads or writes (both count: see the file comment).
std::vector<Key> touched(const PlanOp& o, int L) {
  std::vector<Key> k;
  auto host_weights_of_group = [&](int g) -> Key {
    if (g == 0) return {Buf::kHostEmbed, 0};
    if (g == L + 1) return {Buf::kHostFinal, 0};
    return {Buf::kHostWeights, g - 1};
  };
  switch (o.kind) {
    case OpKind::kReadWeights:
      k = {{Buf::kHostReadSlot, o.slot}, {Buf::kSsdWeights, o.layer}};
      break;
    case OpKind::kLoadWeights:
      k = {{Buf::kDevWeightSlot, o.slot}};
      k.push_back(o.slot2 >= 0 ? Key{Buf::kHostReadSlot, o.slot2} : Key{Buf::kHostWeights, o.layer});
      break;
    case OpKind::kEmbedForward:
      k = {act_key(o.out), {Buf::kDevEmbed, 0}};
      // The first micro-batch's embedding forward also zeroes the step's embedding and
      // final-group gradients (scheduler.cc), which the previous step's saves read.
      if (o.micro == 0) k.insert(k.end(), {{Buf::kDevEmbedGrad, 0}, {Buf::kDevFinalGrad, 0}});
      break;
    case OpKind::kForward:
    case OpKind::kRecomputeInput:
    case OpKind::kRecompute:
      k = {{Buf::kDevWeightSlot, o.slot}, act_key(o.in), act_key(o.out)};
      break;
    case OpKind::kSaveCheckpoint:
      k = {act_key(o.in), o.slot >= 0 ? Key{Buf::kHostCkptSlot, o.slot} : Key{Buf::kHostCkpt, o.layer}};
      break;
    case OpKind::kWriteCheckpoint:
    case OpKind::kReadCheckpoint:
      k = {{Buf::kHostCkptSlot, o.slot}, {Buf::kSsdCkpt, o.layer}};
      break;
    case OpKind::kLoadCheckpoint:
      k = {act_key(o.out), o.slot >= 0 ? Key{Buf::kHostCkptSlot, o.slot} : Key{Buf::kHostCkpt, o.layer}};
      break;
    case OpKind::kHead:
      k = {act_key(o.in), {Buf::kDevEmbed, 0}, {Buf::kDevFinal, 0}, {Buf::kDevEmbedGrad, 0}, {Buf::kDevFinalGrad, 0}};
      break;
    case OpKind::kHeadLoss:
      k = {act_key(o.in), {Buf::kDevEmbed, 0}, {Buf::kDevFinal, 0}};
      break;
    case OpKind::kBackward:
      k = {{Buf::kDevWeightSlot, o.slot}, act_key(o.in), {Buf::kDevGradSlot, o.slot2}};
      break;
    case OpKind::kEmbedBackward:
      k = {{Buf::kDevEmbed, 0}, {Buf::kDevEmbedGrad, 0}};
      break;
    case OpKind::kSaveGrads:
      k = {host_grad_key(o.out)};
      if (o.layer == 0) k.push_back({Buf::kDevEmbedGrad, 0});
      else if (o.layer == L + 1) k.push_back({Buf::kDevFinalGrad, 0});
      else k.push_back({Buf::kDevGradSlot, o.slot});
      break;
    case OpKind::kWriteGrads:
      k = {host_grad_key(o.in), {Buf::kSsdGrads, o.layer}};
      break;
    case OpKind::kReadGrads:
      k = {host_grad_key(o.out), {Buf::kSsdGrads, o.layer}};
      break;
    case OpKind::kLoadGrads:
      k = {host_grad_key(o.in), {Buf::kDevGradSlot, o.slot}};
      break;
    case OpKind::kGradSumSq:
      k = {host_grad_key(o.in)};
      break;
    case OpKind::kGradNorm:
      break;  // per-iteration scalars only
    case OpKind::kUpdate:
      k = {host_grad_key(o.in), o.slot2 >= 0 ? Key{Buf::kHostWoutSlot, o.slot2} : host_weights_of_group(o.layer)};
      break;
    case OpKind::kWriteWeights:
      k = {{Buf::kHostWoutSlot, o.slot}, {Buf::kSsdWeights, o.layer - 1}};
      break;
    case OpKind::kLoadResident:
      if (o.layer == 0) k = {{Buf::kHostEmbed, 0}, {Buf::kDevEmbed, 0}};
      else k = {{Buf::kHostFinal, 0}, {Buf::kDevFinal, 0}};
      break;
  }
  // BufRef kNone (an op without that buffer) names nothing.
  k.erase(std::remove_if(k.begin(), k.end(),
                         [](const Key& x) {
                           return (x.first == Buf::kDevAct || x.first == Buf::kHostGrad) && (x.second >> 20) == BufRef::kNone;
                         }),
          k.end());
  return k;
}

}  // namespace

std::vector<std::vector<int>> previous_iteration_deps(const Plan& plan) {
  const int L = plan.model.n_layer;
  // For each buffer, the last op on each resource that touched it in the iteration.
  std::map<Key, std::array<int, kNumResources>> last;
  for (const PlanOp& o : plan.ops) {
    FY_CHECK(o.id == static_cast<int>(&o - plan.ops.data()), "plan op ", o.id, " out of place");
    for (const Key& k : touched(o, L)) {
      auto [it, inserted] = last.try_emplace(k);
      if (inserted) it->second.fill(-1);
      it->second[static_cast<int>(o.resource)] = o.id;
    }
  }
  std::vector<std::vector<int>> deps(plan.ops.size());
  for (const PlanOp& o : plan.ops) {
    std::vector<int>& d = deps[o.id];
    for (const Key& k : touched(o, L))
      for (int r = 0; r < kNumResources; ++r) {
        int prev = last.at(k)[r];
        if (prev >= 0 && r != static_cast<int>(o.resource)) d.push_back(prev);
      }
    std::sort(d.begin(), d.end());
    d.erase(std::unique(d.begin(), d.end()), d.end());
  }
  return deps;
}

}  // namespace fuyou
