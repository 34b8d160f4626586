// Cross-iteration dependencies: which ops of iteration t each op of iteration t+1 waits for.
//
// Every op names the buffers of the plan's table it reads and writes (PlanOp::uses). Within
// one iteration the planner orders the users of each buffer by explicit dependencies. Across
// two iterations of the same plan, an op of t+1 must in addition wait for the ops of t that
// used any of its buffers (read after write, write after read or write); on a resource that
// runs its ops in order, the last such op is enough. The SSD and host-to-device queues may
// reorder (reorders()), so there every such op counts. Hazards are per buffer: the byte
// ranges of two uses of one buffer do not separate them.
#include <algorithm>
#include <array>

#include "fuyou/error.h"
#include "fuyou/plan.h"

namespace fuyou {

std::vector<std::vector<int>> previous_iteration_deps(const Plan& plan) {
  // For each buffer, the ops on each resource that wrote it, and that touched it at all, in
  // plan order.
  struct Users {
    std::array<std::vector<int>, kNumResources> write, any;
  };
  std::vector<Users> users(plan.buffers.size());
  for (const PlanOp& o : plan.ops) {
    FY_CHECK(o.id == static_cast<int>(&o - plan.ops.data()), "plan op ", o.id, " out of place");
    for (const BufferUse& u : o.uses) {
      Users& us = users.at(u.buffer);
      if (u.writes()) us.write[static_cast<int>(o.resource)].push_back(o.id);
      us.any[static_cast<int>(o.resource)].push_back(o.id);
    }
  }
  // A read waits for the previous step's writes of the buffer (read after write); a write
  // also for its reads (write after read).
  std::vector<std::vector<int>> deps(plan.ops.size());
  for (const PlanOp& o : plan.ops) {
    std::vector<int>& d = deps[o.id];
    for (const BufferUse& u : o.uses) {
      const Users& us = users[u.buffer];
      for (int r = 0; r < kNumResources; ++r) {
        const std::vector<int>& prev = u.writes() ? us.any[r] : us.write[r];
        if (prev.empty() || r == static_cast<int>(o.resource)) continue;
        if (reorders(static_cast<Resource>(r)))
          d.insert(d.end(), prev.begin(), prev.end());
        else
          d.push_back(prev.back());
      }
    }
    std::sort(d.begin(), d.end());
    d.erase(std::unique(d.begin(), d.end()), d.end());
  }
  return deps;
}

std::vector<OpBuffers> op_buffers(const Plan& plan) {
  std::vector<OpBuffers> out(plan.ops.size());
  for (const PlanOp& o : plan.ops) {
    OpBuffers& b = out[o.id];
    for (const BufferUse& u : o.uses) b.push_back({u.buffer, u.writes()});
    std::sort(b.begin(), b.end());
    // One entry per buffer, written if any use writes it.
    size_t n = 0;
    for (size_t i = 0; i < b.size(); ++i) {
      if (n && b[n - 1].first == b[i].first)
        b[n - 1].second = b[n - 1].second || b[i].second;
      else
        b[n++] = b[i];
    }
    b.resize(n);
  }
  return out;
}

bool buffers_conflict(const OpBuffers& a, const OpBuffers& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i].first < b[j].first)
      ++i;
    else if (b[j].first < a[i].first)
      ++j;
    else if (a[i].second || b[j].second)
      return true;
    else
      ++i, ++j;
  }
  return false;
}

}  // namespace fuyou
