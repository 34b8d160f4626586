// Cross-iteration dependencies: which ops of iteration t each op of iteration t+1 waits for.
//
// Every op touches named buffers: a device weight, checkpoint or gradient slot, a host
// staging slot, a layer's host weights, an SSD extent, the resident embedding. Within one
// iteration the planner orders the users of each buffer by explicit dependencies. Across
// two iterations of the same plan, an op of t+1 must in addition wait for the ops of t that
// touched any of its buffers (read after write, write after read or write); on a resource
// that runs its ops in order, the last such op is enough. The SSD and host-to-device queues
// may reorder (reorders()), so there every such op counts.
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
  kDevEmbedRows,  // the rows the embedding's first update part refreshes (Plan::embed_rows_first)
};

using Key = std::pair<Buf, int>;

Key act_key(const BufRef& b) { return {Buf::kDevAct, (static_cast<int>(b.kind) << 20) + b.index}; }
Key host_grad_key(const BufRef& b) { return {Buf::kHostGrad, (static_cast<int>(b.kind) << 20) + b.index}; }

struct Use {
  Key key;
  bool write;
};

// The buffers op `o` reads (false) or writes (true). With `rows_first` the first
// micro-batch's embedding forward reads only the rows refreshed first (part -1).
std::vector<Use> touched(const PlanOp& o, int L, bool rows_first) {
  std::vector<Use> k;
  auto host_weights_of_group = [&](int g) -> Key {
    if (g == 0) return {Buf::kHostEmbed, 0};
    if (g == L + 1) return {Buf::kHostFinal, 0};
    return {Buf::kHostWeights, g - 1};
  };
  const bool R = false, W = true;
  switch (o.kind) {
    case OpKind::kReadWeights:
      k = {{{Buf::kHostReadSlot, o.slot}, W}, {{Buf::kSsdWeights, o.layer}, R}};
      break;
    case OpKind::kLoadWeights:
      k = {{{Buf::kDevWeightSlot, o.slot}, W}};
      if (o.in.kind == BufRef::kWeightsOut) k.push_back({{Buf::kHostWoutSlot, o.in.index}, R});
      else if (o.slot2 >= 0) k.push_back({{Buf::kHostReadSlot, o.slot2}, R});
      else k.push_back({{Buf::kHostWeights, o.layer}, R});
      break;
    case OpKind::kEmbedForward:
      k = {{act_key(o.out), W}, {{rows_first && o.micro == 0 ? Buf::kDevEmbedRows : Buf::kDevEmbed, 0}, R}};
      break;
    case OpKind::kForward:
    case OpKind::kRecomputeInput:
    case OpKind::kRecompute:
      k = {{{Buf::kDevWeightSlot, o.slot}, R}, {act_key(o.in), R}, {act_key(o.out), W}};
      break;
    case OpKind::kSaveCheckpoint:
      k = {{act_key(o.in), R}, {o.slot >= 0 ? Key{Buf::kHostCkptSlot, o.slot} : Key{Buf::kHostCkpt, o.layer}, W}};
      break;
    case OpKind::kWriteCheckpoint:
      k = {{{Buf::kHostCkptSlot, o.slot}, R}, {{Buf::kSsdCkpt, o.layer}, W}};
      break;
    case OpKind::kReadCheckpoint:
      k = {{{Buf::kHostCkptSlot, o.slot}, W}, {{Buf::kSsdCkpt, o.layer}, R}};
      break;
    case OpKind::kLoadCheckpoint:
      k = {{act_key(o.out), W}, {o.slot >= 0 ? Key{Buf::kHostCkptSlot, o.slot} : Key{Buf::kHostCkpt, o.layer}, R}};
      break;
    case OpKind::kHead:  // the first micro-batch's also zeroes the step's gradients (scheduler.cc)
      k = {{act_key(o.in), R},
           {{Buf::kDevEmbed, 0}, R},
           {{Buf::kDevFinal, 0}, R},
           {{Buf::kDevEmbedGrad, 0}, W},
           {{Buf::kDevFinalGrad, 0}, W}};
      break;
    case OpKind::kHeadLoss:
      k = {{act_key(o.in), R}, {{Buf::kDevEmbed, 0}, R}, {{Buf::kDevFinal, 0}, R}};
      break;
    case OpKind::kBackward:
      k = {{{Buf::kDevWeightSlot, o.slot}, R}, {act_key(o.in), R}, {{Buf::kDevGradSlot, o.slot2}, W}};
      break;
    case OpKind::kEmbedBackward:
      k = {{{Buf::kDevEmbed, 0}, R}, {{Buf::kDevEmbedGrad, 0}, W}};
      break;
    case OpKind::kSaveGrads:
      k = {{host_grad_key(o.out), W}};
      if (o.layer == 0) k.push_back({{Buf::kDevEmbedGrad, 0}, R});
      else if (o.layer == L + 1) k.push_back({{Buf::kDevFinalGrad, 0}, R});
      else k.push_back({{Buf::kDevGradSlot, o.slot}, R});
      break;
    case OpKind::kWriteGrads:
      k = {{host_grad_key(o.in), R}, {{Buf::kSsdGrads, o.layer}, W}};
      break;
    case OpKind::kReadGrads:
      k = {{host_grad_key(o.out), W}, {{Buf::kSsdGrads, o.layer}, R}};
      break;
    case OpKind::kLoadGrads:
      k = {{host_grad_key(o.in), R}, {{Buf::kDevGradSlot, o.slot}, W}};
      break;
    case OpKind::kGradSumSq:
      k = {{host_grad_key(o.in), R}};
      break;
    case OpKind::kGradNorm:
      break;  // per-iteration scalars only
    case OpKind::kUpdate:
      k = {{host_grad_key(o.in), R},
           {o.slot2 >= 0 ? Key{Buf::kHostWoutSlot, o.slot2} : host_weights_of_group(o.layer), W}};
      break;
    case OpKind::kWriteWeights:
      k = {{{Buf::kHostWoutSlot, o.slot}, R}, {{Buf::kSsdWeights, o.layer - 1}, W}};
      break;
    case OpKind::kLoadResident:
      if (o.layer == 0) k = {{{Buf::kHostEmbed, 0}, R}, {{Buf::kDevEmbed, 0}, W}};
      else k = {{{Buf::kHostFinal, 0}, R}, {{Buf::kDevFinal, 0}, W}};
      if (o.layer == 0 && o.part < 0) k.push_back({{Buf::kDevEmbedRows, 0}, W});
      break;
  }
  // BufRef kNone (an op without that buffer) names nothing.
  k.erase(std::remove_if(k.begin(), k.end(),
                         [](const Use& x) {
                           return (x.key.first == Buf::kDevAct || x.key.first == Buf::kHostGrad) &&
                                  (x.key.second >> 20) == BufRef::kNone;
                         }),
          k.end());
  return k;
}

}  // namespace

std::vector<std::vector<int>> previous_iteration_deps(const Plan& plan) {
  const int L = plan.model.n_layer;
  // For each buffer, the ops on each resource that wrote it, and that touched it at all, in
  // plan order.
  struct Users {
    std::array<std::vector<int>, kNumResources> write, any;
  };
  std::map<Key, Users> users;
  for (const PlanOp& o : plan.ops) {
    FY_CHECK(o.id == static_cast<int>(&o - plan.ops.data()), "plan op ", o.id, " out of place");
    for (const Use& u : touched(o, L, plan.embed_rows_first)) {
      Users& us = users[u.key];
      if (u.write) us.write[static_cast<int>(o.resource)].push_back(o.id);
      us.any[static_cast<int>(o.resource)].push_back(o.id);
    }
  }
  // A read waits for the previous step's writes of the buffer (read after write); a write
  // also for its reads (write after read).
  std::vector<std::vector<int>> deps(plan.ops.size());
  for (const PlanOp& o : plan.ops) {
    std::vector<int>& d = deps[o.id];
    for (const Use& u : touched(o, L, plan.embed_rows_first)) {
      const Users& us = users.at(u.key);
      for (int r = 0; r < kNumResources; ++r) {
        const std::vector<int>& prev = u.write ? us.any[r] : us.write[r];
        if (prev.empty() || r == static_cast<int>(o.resource)) continue;
        if (reorders(static_cast<Resource>(r))) d.insert(d.end(), prev.begin(), prev.end());
        else d.push_back(prev.back());
      }
    }
    std::sort(d.begin(), d.end());
    d.erase(std::unique(d.begin(), d.end()), d.end());
  }
  return deps;
}

std::vector<OpBuffers> op_buffers(const Plan& plan) {
  const int L = plan.model.n_layer;
  std::vector<OpBuffers> out(plan.ops.size());
  for (const PlanOp& o : plan.ops) {
    OpBuffers& b = out[o.id];
    for (const Use& u : touched(o, L, plan.embed_rows_first))
      b.push_back({(static_cast<int64_t>(u.key.first) << 32) | static_cast<uint32_t>(u.key.second), u.write});
    std::sort(b.begin(), b.end());
    // One entry per buffer, written if any use writes it.
    size_t n = 0;
    for (size_t i = 0; i < b.size(); ++i) {
      if (n && b[n - 1].first == b[i].first) b[n - 1].second = b[n - 1].second || b[i].second;
      else b[n++] = b[i];
    }
    b.resize(n);
  }
  return out;
}

bool buffers_conflict(const OpBuffers& a, const OpBuffers& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i].first < b[j].first) ++i;
    else if (b[j].first < a[i].first) ++j;
    else if (a[i].second || b[j].second) return true;
    else ++i, ++j;
  }
  return false;
}

}  // namespace fuyou
