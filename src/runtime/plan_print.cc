// Plan inspection: names of resources and placements, a human table and a JSON dump.
#include <map>

#include "fuyou/error.h"
#include "fuyou/plan.h"
#include "fuyou/sizes.h"

namespace fuyou {

const char* resource_name(Resource r) {
  switch (r) {
    case Resource::kCompute:
      return "compute";
    case Resource::kH2D:
      return "h2d";
    case Resource::kD2H:
      return "d2h";
    case Resource::kSsdRead:
      return "ssd_read";
    case Resource::kSsdWrite:
      return "ssd_write";
    case Resource::kOptimizer:
      return "optimizer";
  }
  return "?";
}

const char* act_placement_name(ActPlacement a) {
  switch (a) {
    case ActPlacement::kKeep:
      return "keep";
    case ActPlacement::kDevice:
      return "device";
    case ActPlacement::kHost:
      return "host";
    case ActPlacement::kSsd:
      return "ssd";
    case ActPlacement::kRecompute:
      return "recompute";
  }
  return "?";
}

namespace {

const char* access_name(Access a) {
  switch (a) {
    case Access::kRead:
      return "r";
    case Access::kWrite:
      return "w";
    case Access::kAccumulate:
      return "+=";
  }
  return "?";
}

const char* role_name(Role r) {
  switch (r) {
    case Role::kSource:
      return "src";
    case Role::kDest:
      return "dst";
    case Role::kWeights:
      return "weights";
    case Role::kInput:
      return "in";
    case Role::kOutput:
      return "out";
    case Role::kGrads:
      return "grads";
    case Role::kResidual:
      return "residual";
    case Role::kWork:
      return "work";
    case Role::kState:
      return "state";
  }
  return "?";
}

// "w dst host.read_slot.1[0, 12.00 MiB)": access, role, buffer and, where it is not the
// whole buffer, the byte range.
std::string use_text(const Plan& plan, const BufferUse& u) {
  const PlanBuffer& b = plan.buffers[u.buffer];
  std::string range = u.offset == 0 && u.bytes == b.bytes
                          ? std::string()
                          : str("[", u.offset, "+", format_size(u.bytes), ")");
  return str(access_name(u.access), " ", role_name(u.role), " ", b.name(), range);
}

}  // namespace

std::string Plan::listing() const {
  std::string out = "buffers:\n";
  for (size_t i = 0; i < buffers.size(); ++i)
    out += str("  ", i, "  ", buffers[i].name(), "  ", format_size(buffers[i].bytes), "\n");
  out += "ops (id resource kind [layer] [group] [micro] [part] <- deps: uses):\n";
  for (const PlanOp& op : ops) {
    out += str("  ", op.id, " ", resource_name(op.resource), " ", op_kind_name(op.kind));
    if (op.layer >= 0) out += str(" layer ", op.layer);
    if (op.group >= 0) out += str(" group ", op.group);
    if (grad_accum > 1) out += str(" mb ", op.micro);
    if (op.parts > 1) out += str(" part ", op.part, "/", op.parts);
    out += " <-";
    for (int d : op.deps) out += str(" ", d);
    out += ":";
    for (size_t k = 0; k < op.uses.size(); ++k)
      out += str(k ? ", " : " ", use_text(*this, op.uses[k]));
    out += "\n";
  }
  return out;
}

std::string Plan::table() const {
  std::string out =
      str(forward_only ? "forward-only (validation) plan: " : "plan: ", model.n_layer,
          " layers, micro_batch ", micro_batch,
          tensors != ElemType::kF32 ? str(", ", elem_type_name(tensors), " device tensors")
                                    : std::string(),
          grad_accum > 1
              ? str(", grad_accum ", grad_accum, " (gradients accumulate across micro-batches",
                    accum_fp32 ? " in fp32 on the host)" : ")")
              : std::string(),
          exact ? ", exact mode (updates wait for the global gradient norm)" : "", "\n");
  // The gradients column appears when layer gradients are held (exact mode, grad_accum > 1).
  out += holds_grads() ? "layer  activations  weights  optimizer  gradients\n"
                       : "layer  activations  weights  optimizer\n";
  // A column's text padded to its heading's width and the two spaces after it.
  auto cell = [](const std::string& text, size_t width) {
    return text.size() < width ? text + std::string(width - text.size(), ' ') : text + " ";
  };
  for (size_t l = 0; l < layers.size(); ++l)
    out += str(l < 10    ? "    "
               : l < 100 ? "   "
                         : "  ",
               l, "  ", cell(act_placement_name(layers[l].act), 13),
               cell(str(tier_name(layers[l].weights), layers[l].retained >= 0 ? "+" : ""), 9),
               holds_grads() ? str(cell(tier_name(layers[l].optim), 11), tier_name(layers[l].grads))
                             : std::string(tier_name(layers[l].optim)),
               "\n");
  bool any_retained = false;
  for (const auto& d : layers) any_retained |= d.retained >= 0;
  if (any_retained)
    out += "(ssd+: new weights also stay in a host slot for the next step's forward)\n";
  out += str("embedding/final optimizer state: ", tier_name(embed_optim), "/",
             tier_name(final_optim), "\n");
  out += str("pools: device weight slots ", pools.device_weight_slots,
             resident_weights ? " (one per layer: the weights stay on the device)" : "",
             ", device checkpoint slots ", pools.device_ckpt_slots, ", device gradient slots ",
             pools.device_grad_slots, ", host weight staging ", pools.host_weight_slots, "+",
             pools.host_wout_slots, ", host checkpoint staging ", pools.host_ckpt_slots,
             ", host gradient slots ", pools.host_grad_slots,
             pools.host_grad_stage_slots
                 ? str(deferred_updates ? ", deferred gradient slots " : ", held gradient staging ",
                       pools.host_grad_stage_slots)
                 : std::string(),
             "\n");
  if (deferred_updates)
    out += str(deferred_updates == 1 ? str("update of layer ", layers.size() - 1)
                                     : str("updates of layers ", layers.size() - deferred_updates,
                                           "..", layers.size() - 1),
               " deferred: last in the step, beside the next forward\n");
  auto tier = [&](const char* name, uint64_t total,
                  const std::vector<std::pair<std::string, uint64_t>>& parts) {
    out += str("peak ", name, " memory ", format_size(total), "\n");
    for (const auto& [n, b] : parts) out += str("  ", n, ": ", format_size(b), "\n");
  };
  tier("device", memory.device_bytes, memory.device_parts);
  tier("host", memory.host_bytes, memory.host_parts);
  tier("SSD", memory.ssd_bytes, memory.ssd_parts);
  std::map<Resource, int> counts;
  for (const PlanOp& op : ops) ++counts[op.resource];
  out += str(ops.size(), " operations:");
  for (auto& [r, n] : counts) out += str(" ", resource_name(r), " ", n);
  out += "\n";
  return out;
}

nlohmann::json Plan::to_json() const {
  nlohmann::json j;
  j["n_layer"] = model.n_layer;
  j["micro_batch"] = micro_batch;
  j["device_tensors"] = elem_type_name(tensors);
  j["exact"] = exact;
  j["grad_accum"] = grad_accum;
  j["accum_fp32"] = accum_fp32;
  j["forward_only"] = forward_only;
  j["deferred_updates"] = deferred_updates;
  j["resident_weights"] = resident_weights;
  j["device_sum_squares"] = device_sum_squares;
  for (const auto& d : layers) {
    nlohmann::json l{{"activations", act_placement_name(d.act)},
                     {"weights", tier_name(d.weights)},
                     {"optimizer", tier_name(d.optim)}};
    if (holds_grads()) l["gradients"] = tier_name(d.grads);
    if (d.retained >= 0) l["retained_in_weights_out_slot"] = d.retained;
    j["layers"].push_back(l);
  }
  j["pools"] = {{"device_weight_slots", pools.device_weight_slots},
                {"device_ckpt_slots", pools.device_ckpt_slots},
                {"device_grad_slots", pools.device_grad_slots},
                {"host_weight_slots", pools.host_weight_slots},
                {"host_wout_slots", pools.host_wout_slots},
                {"host_ckpt_slots", pools.host_ckpt_slots},
                {"host_grad_slots", pools.host_grad_slots},
                {"host_grad_stage_slots", pools.host_grad_stage_slots}};
  j["memory"] = {{"device_bytes", memory.device_bytes},
                 {"host_bytes", memory.host_bytes},
                 {"ssd_bytes", memory.ssd_bytes}};
  for (const PlanBuffer& b : buffers)
    j["buffers"].push_back({{"name", b.name()},
                            {"tier", fuyou::tier_name(b.tier)},
                            {"bytes", b.bytes},
                            {"part", b.part}});
  for (const PlanOp& op : ops) {
    nlohmann::json o{{"id", op.id},
                     {"kind", op_kind_name(op.kind)},
                     {"resource", resource_name(op.resource)},
                     {"deps", op.deps}};
    if (op.layer >= 0) o["layer"] = op.layer;
    if (op.group >= 0) o["group"] = op.group;
    if (grad_accum > 1) o["micro"] = op.micro;
    if (op.parts > 1) o["part"] = {op.part, op.parts};
    for (const BufferUse& u : op.uses)
      o["uses"].push_back({{"buffer", u.buffer},
                           {"access", access_name(u.access)},
                           {"role", role_name(u.role)},
                           {"offset", u.offset},
                           {"bytes", u.bytes}});
    if (const uint64_t bytes = op_bytes(op)) o["bytes"] = bytes;
    if (op.flops) o["flops"] = op.flops;
    if (op.recompute_flops) o["recompute_flops"] = op.recompute_flops;
    if (op.params) o["params"] = op.params;
    j["ops"].push_back(o);
  }
  return j;
}

}  // namespace fuyou
