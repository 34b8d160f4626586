// Hardware profiles as files: the figures the plan simulator turns operations into durations
// with (configs/hardware/*.yaml), read, checked and written. GPU servers' figures come from
// vendor spec sheets (cited in the files); this machine's CPU profile is written by
// `fuyou-bench profile` from measurements. docs/simulator.md describes every key; the
// profile itself and its cost model are fuyou/device_costs.h.
#pragma once

#include <string>

#include "fuyou/device_costs.h"

namespace fuyou {

struct ModelConfig;

// The size of a layer's work, which a profile's GEMM efficiency is looked up by:
// cbrt(tokens * d_model * d_ff) of a micro-batch.
double gemm_work_size(const ModelConfig& m, int micro_batch);

HardwareProfile parse_hardware_profile(const std::string& yaml_text, const std::string& source);
HardwareProfile load_hardware_profile(const std::string& path);
// The profile as YAML (every key), with `header` (comment lines, each starting "# ") first.
std::string hardware_profile_to_yaml(const HardwareProfile& p, const std::string& header);

}  // namespace fuyou
