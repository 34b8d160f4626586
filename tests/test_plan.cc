// The plan's lists: one row per op kind (its name, queue and traffic), and the planned ops'
// queues and bytes read from those rows and their uses.
#include <algorithm>
#include <catch2/catch.hpp>
#include <set>
#include <string>

#include "fuyou/error.h"
#include "fuyou/model.h"
#include "fuyou/plan.h"
#include "fuyou/simulator.h"
#include "fuyou/sizes.h"
#include "fuyou/storage.h"
#include "fuyou/train.h"

using namespace fuyou;

namespace {

// The traffic an op on queue `r` may have: a transfer queue's own, and only there.
bool traffic_fits_queue(Traffic t, Resource r) {
  switch (r) {
    case Resource::kCompute:
      return t == Traffic::kNone;
    case Resource::kH2D:
      return t == Traffic::kH2D;
    case Resource::kD2H:
      return t == Traffic::kD2H;
    case Resource::kSsdRead:
      return t == Traffic::kSsdRead;
    case Resource::kSsdWrite:
      return t == Traffic::kSsdWrite;
    case Resource::kOptimizer:
      return t == Traffic::kNone || t == Traffic::kHostRead || t == Traffic::kHostSum ||
             t == Traffic::kState;
  }
  return false;
}

}  // namespace

TEST_CASE("every op kind has a row: a name, a queue and that queue's traffic", "[plan]") {
  std::set<std::string> names;
  for (int i = 0; i < kNumOpKinds; ++i) {
    const OpKindInfo k = op_kind_info(static_cast<OpKind>(i));
    INFO("op kind " << i);
    REQUIRE(k.name != nullptr);
    CHECK(std::string(k.name) != "");
    CHECK(names.insert(k.name).second);
    REQUIRE(static_cast<int>(k.resource) >= 0);
    REQUIRE(static_cast<int>(k.resource) < kNumResources);
    INFO(k.name << " on " << resource_name(k.resource));
    // A kind on a transfer queue is charged that queue's bytes: never nothing.
    CHECK(traffic_fits_queue(k.traffic, k.resource));
    // What the executor copies: a load's or read's destination, a save's or write's source.
    if (k.traffic == Traffic::kH2D || k.traffic == Traffic::kSsdRead) CHECK(k.role == Role::kDest);
    if (k.traffic == Traffic::kD2H || k.traffic == Traffic::kSsdWrite)
      CHECK(k.role == Role::kSource);
    if (k.traffic == Traffic::kState) CHECK(k.role == Role::kState);
  }
  // kNumOpKinds reaches the last kind: the value after it has no row.
  CHECK(op_kind_info(static_cast<OpKind>(kNumOpKinds)).name == nullptr);
}

TEST_CASE("planned ops run on their kind's queue and move their uses' bytes", "[plan]") {
  PlanRequest req;
  req.model = ModelConfig{};
  req.model.n_layer = 4;
  req.model.d_ff = 4 * req.model.d_model;
  req.model.vocab_size =
      2000;  // an embedding large enough for parts, not a multiple of 1024 elements
  req.micro_batch = 2;
  req.have_ssd = true;
  req.acts = {ActPlacement::kKeep, ActPlacement::kRecompute, ActPlacement::kSsd,
              ActPlacement::kHost};
  req.weights_on_ssd = true;
  req.optim_on_ssd = GENERATE(false, true);
  req.exact = GENERATE(false, true);
  req.grad_accum = GENERATE(1, 2);
  req.tensors = GENERATE(ElemType::kF32, ElemType::kBF16);
  req.accum_fp32 = true;
  req.grads_on_ssd = GENERATE(false, true);
  req.embed_parts = 3;
  OptimizerConfig oc;
  oc.master = GENERATE("fp32", "split");
  req.optim_format = optim_format(oc);
  const Plan train = make_plan(req);
  INFO("optim on SSD " << req.optim_on_ssd << ", exact " << req.exact << ", grad_accum "
                       << req.grad_accum << ", tensors " << elem_type_name(req.tensors)
                       << ", grads on SSD " << req.grads_on_ssd << ", master " << oc.master
                       << ", embed parts " << train.embed_parts);
  const uint64_t embed_bytes =
      elem_type_size(req.tensors) * make_gpt_layout(req.model).groups.front().numel;
  const Plan forward = make_forward_plan(train);
  for (const Plan* p : {&train, &forward}) {
    uint64_t embed_saved = 0, embed_refreshed = 0;
    for (const PlanOp& op : p->ops) {
      const OpKindInfo k = op_kind_info(op.kind);
      INFO("op " << op.id << " " << k.name);
      CHECK(op.resource == k.resource);
      const OpTraffic t = op_traffic(*p, op);
      switch (k.traffic) {
        case Traffic::kH2D:
          CHECK(t.h2d == op.use(k.role).bytes);
          break;
        case Traffic::kD2H:
          CHECK(t.d2h == op.use(k.role).bytes);
          break;
        case Traffic::kSsdRead:
          CHECK(t.ssd_read == round_up(op.use(k.role).bytes, kIoAlign));
          break;
        case Traffic::kSsdWrite:
          CHECK(t.ssd_write == round_up(op.use(k.role).bytes, kIoAlign));
          break;
        case Traffic::kHostRead:
          // A sum of squares reads its group's gradient: the parameters in the held type.
          CHECK(op_bytes(op) == op.params * (p->accum_fp32 ? 4 : elem_type_size(p->tensors)));
          break;
        case Traffic::kNone:
        case Traffic::kHostSum:
        case Traffic::kState:
          CHECK(op_bytes(op) == 0);
          break;
      }
      if (k.traffic == Traffic::kH2D || k.traffic == Traffic::kD2H ||
          k.traffic == Traffic::kSsdRead || k.traffic == Traffic::kSsdWrite)
        CHECK(op_bytes(op) > 0);
      if (op.kind == OpKind::kSaveGrads && op.group == 0 && op.part >= 0)
        embed_saved += op_bytes(op);
      if (op.kind == OpKind::kLoadResident && op.group == 0 && op.part >= 0)
        embed_refreshed += op_bytes(op);
    }
    // The embedding's save and refresh parts, in whole 1024-element blocks, cover it once
    // (per micro-batch whose gradient is saved).
    if (!p->forward_only) {
      const uint64_t saves = p->accum_fp32 ? static_cast<uint64_t>(p->grad_accum) : 1;
      CHECK(embed_saved == saves * embed_bytes);
      CHECK(embed_refreshed == embed_bytes);
    }
  }
}

TEST_CASE("the buffer table is the plan's memory: its sums, its slots, its placement", "[plan]") {
  PlanRequest req;
  req.model = ModelConfig{};
  req.model.n_layer = 6;
  req.model.d_ff = 4 * req.model.d_model;
  req.micro_batch = 2;
  req.have_ssd = true;
  req.acts = {ActPlacement::kKeep, ActPlacement::kRecompute, ActPlacement::kSsd,
              ActPlacement::kHost, ActPlacement::kRecompute, ActPlacement::kDevice};
  req.exact = GENERATE(false, true);
  req.grad_accum = GENERATE(1, 2);
  req.tensors = GENERATE(ElemType::kF32, ElemType::kBF16);
  req.accum_fp32 = true;
  req.device_in_host = GENERATE(true, false);
  OptimizerConfig oc;
  oc.state = GENERATE("fp32", "int8");
  req.optim_format = optim_format(oc);
  // Unlimited, then host budgets two and four layers' weights and state short, which move
  // state to SSD (and add its staging).
  const uint64_t roomy = make_plan(req).memory.host_bytes;
  const uint64_t numel = make_gpt_layout(req.model).groups[1].numel;
  const uint64_t layer =
      elem_type_size(req.tensors) * numel + optim_state_bytes(req.optim_format, numel);
  const int short_by = GENERATE(0, 2, 4);
  req.host_budget = short_by ? roomy - short_by * layer : 0;
  const Plan p = make_plan(req);
  INFO("exact " << req.exact << ", grad_accum " << req.grad_accum << ", tensors "
                << elem_type_name(req.tensors) << ", device in host " << req.device_in_host
                << ", state " << oc.state << ", host budget " << req.host_budget << " (" << short_by
                << " layers short)");

  uint64_t tier[3] = {};
  for (const PlanBuffer& b : p.buffers) tier[static_cast<int>(b.tier)] += b.bytes;
  CHECK(p.memory.device_bytes == tier[static_cast<int>(Tier::kDevice)]);
  CHECK(p.memory.host_bytes == tier[static_cast<int>(Tier::kHost)]);
  CHECK(p.memory.ssd_bytes == tier[static_cast<int>(Tier::kSsd)]);
  if (req.host_budget) CHECK(p.memory.host_bytes <= req.host_budget);
  uint64_t parts = 0;
  for (const auto& [line, bytes] : p.memory.host_parts) parts += bytes;
  CHECK(parts == p.memory.host_bytes);

  auto count = [&](BufferKind k) {
    return static_cast<int>(std::count_if(p.buffers.begin(), p.buffers.end(),
                                          [&](const PlanBuffer& b) { return b.kind == k; }));
  };
  auto has = [&](BufferKind k, int index) {
    return std::any_of(p.buffers.begin(), p.buffers.end(),
                       [&](const PlanBuffer& b) { return b.kind == k && b.index == index; });
  };
  // A short budget moved state to SSD.
  if (short_by)
    CHECK(count(BufferKind::kSsdWeights) + count(BufferKind::kSsdOptim) +
              count(BufferKind::kSsdGrads) >
          0);
  // The pools are the table's slots, and the table names each slot once.
  CHECK(count(BufferKind::kWeightSlot) == p.pools.device_weight_slots);
  CHECK(count(BufferKind::kCkptSlot) == p.pools.device_ckpt_slots);
  CHECK(count(BufferKind::kGradSlot) == p.pools.device_grad_slots);
  CHECK(count(BufferKind::kReadSlot) == p.pools.host_weight_slots);
  CHECK(count(BufferKind::kWoutSlot) == p.pools.host_wout_slots);
  CHECK(count(BufferKind::kCkptStage) == p.pools.host_ckpt_slots);
  CHECK(count(BufferKind::kHostGradSlot) == p.pools.host_grad_slots);
  CHECK(count(BufferKind::kGradStage) == p.pools.host_grad_stage_slots);
  std::set<std::string> names;
  for (const PlanBuffer& b : p.buffers) CHECK(names.insert(b.name()).second);
  // Every placement decision is a row in the tier it names.
  const int L = p.model.n_layer;
  for (int l = 0; l < L; ++l) {
    INFO("layer " << l);
    CHECK(has(BufferKind::kHostWeights, l) == (p.layers[l].weights == Tier::kHost));
    CHECK(has(BufferKind::kSsdWeights, l) == (p.layers[l].weights == Tier::kSsd));
    CHECK(has(BufferKind::kHostCkpt, l) == (p.layers[l].act == ActPlacement::kHost));
    CHECK(has(BufferKind::kSsdCkpt, l) == (p.layers[l].act == ActPlacement::kSsd));
    CHECK(has(BufferKind::kGradHold, l) == (p.holds_grads() && p.layers[l].grads == Tier::kHost));
    CHECK(has(BufferKind::kSsdGrads, l) == (p.holds_grads() && p.layers[l].grads == Tier::kSsd));
  }
  for (int g = 0; g <= L + 1; ++g) {
    INFO("group " << g);
    CHECK(has(BufferKind::kHostOptim, g) == (p.optim_tier(g) == Tier::kHost));
    CHECK(has(BufferKind::kSsdOptim, g) == (p.optim_tier(g) == Tier::kSsd));
  }
  CHECK(has(BufferKind::kDeviceArena, 0) == req.device_in_host);
  if (req.device_in_host)
    CHECK(p.buffers[p.buffer(BufferKind::kDeviceArena)].bytes == p.memory.device_bytes);
  // Listed by tier (device, host, SSD), the host's and the SSD's by kind.
  for (size_t i = 1; i < p.buffers.size(); ++i) {
    const PlanBuffer &a = p.buffers[i - 1], &b = p.buffers[i];
    CHECK(a.tier <= b.tier);
    if (a.tier == b.tier && a.tier != Tier::kDevice) CHECK(a.kind <= b.kind);
  }
}

TEST_CASE("a refused host budget names the table's total", "[plan]") {
  // Without SSD every placement is in host memory whatever the budget: the refusal's total is
  // the unlimited plan's table.
  PlanRequest req;
  req.model = ModelConfig{};
  req.model.n_layer = 4;
  req.model.d_ff = 4 * req.model.d_model;
  req.micro_batch = 2;
  req.acts = {ActPlacement::kKeep, ActPlacement::kHost, ActPlacement::kRecompute,
              ActPlacement::kHost};
  req.exact = GENERATE(false, true);
  const Plan p = make_plan(req);
  req.host_budget = p.memory.host_bytes - 1;
  CHECK_THROWS_WITH(make_plan(req), Catch::Matchers::Contains(str("the plan needs ",
                                                                  format_size(p.memory.host_bytes),
                                                                  " but offload.host_memory is ")));
  req.host_budget = p.memory.host_bytes;
  CHECK(make_plan(req).memory.host_bytes == p.memory.host_bytes);
}

TEST_CASE("a one-layer model's optimizer state is counted at each group's size", "[plan]") {
  // With SSD the embedding's, layer 0's and the next group's state take host memory first;
  // with one layer the next group is the final one, smaller than a layer.
  PlanRequest req;
  req.model = ModelConfig{};
  req.model.n_layer = 1;
  req.model.d_ff = 4 * req.model.d_model;
  req.have_ssd = true;
  const Plan p = make_plan(req);
  const ParamLayout layout = make_gpt_layout(req.model);
  for (int g = 0; g < 3; ++g) {
    INFO("group " << g);
    REQUIRE(p.optim_tier(g) == Tier::kHost);
    CHECK(p.buffers[p.buffer(BufferKind::kHostOptim, g)].bytes ==
          optim_state_bytes(p.optim_format, layout.groups[g].numel));
  }
}
