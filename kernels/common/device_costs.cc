// The cost model of a hardware profile: GEMM efficiency by size, the striped SSD bandwidth,
// the optimizer's rate by state format, and the emulated machine's figures.
#include "fuyou/device_costs.h"

#include <algorithm>
#include <cmath>

#include "fuyou/error.h"
#include "src/storage/stripe_layout.h"

namespace fuyou {

double HardwareProfile::efficiency_at(double size) const {
  if (gemm_efficiency.empty()) return 1.0;
  const auto& e = gemm_efficiency;
  if (size <= e.front().first) return e.front().second;
  if (size >= e.back().first) return e.back().second;
  for (size_t i = 1; i < e.size(); ++i) {
    if (size <= e[i].first) {
      double x0 = std::log2(e[i - 1].first), x1 = std::log2(e[i].first), x = std::log2(size);
      double f = (x - x0) / (x1 - x0);
      return e[i - 1].second + f * (e[i].second - e[i - 1].second);
    }
  }
  return e.back().second;
}

double HardwareProfile::compute_seconds(double flops, double size) const {
  return flops > 0 ? flops / (peak_flops * efficiency_at(size)) : 0.0;
}

HardwareProfile emulated_machine(const HardwareProfile& gpu, double scale,
                                 const HardwareProfile& host) {
  HardwareProfile m = gpu;
  m.name = str(gpu.name, " emulated on ", host.name, " (scale ", scale, ")");
  m.source = str(gpu.source, " + ", host.source);
  m.peak_flops = gpu.peak_flops * scale;
  m.h2d_Bps = gpu.h2d_Bps * scale;
  m.d2h_Bps = gpu.d2h_Bps * scale;
  m.ssd_read_Bps = host.ssd_read_Bps;
  m.ssd_write_Bps = host.ssd_write_Bps;
  m.ssd_mixed = host.ssd_mixed;
  m.ssds = host.ssds;
  m.stripe_unit = host.stripe_unit;
  m.optimizer_params_per_s = host.optimizer_params_per_s;
  m.optimizer_format_params_per_s = host.optimizer_format_params_per_s;
  m.host_mem_Bps = host.host_mem_Bps;
  m.copy_share = host.copy_share;  // the copies' bytes move through this machine's memory
  m.host_memory = host.host_memory;
  // The emulated device computes nothing on the CPU: the optimizer has the cores alone.
  m.shared_cpu = false;
  return m;
}

double mixed_capacity_from(double read_s, double write_s, double mixed_s) {
  const double shorter = std::min(read_s, write_s), longer = std::max(read_s, write_s);
  const double both = mixed_s - (longer - shorter);  // the time both ran
  if (both <= shorter) return 2.0;
  return std::clamp(2.0 * shorter / both, 1.0, 2.0);
}

double emulation_scale_for(const HardwareProfile& gpu, const HardwareProfile& host) {
  return host.ssd_read_Bps * host.ssds / (gpu.ssd_read_Bps * gpu.ssds);
}

namespace {

// The drive holding the most bytes of a request that starts on a stripe boundary bounds its
// time: that is drive 0, which StripeLayout sizes exactly as the store does.
double striped_rate(uint64_t bytes, int ssds, uint64_t unit, double per_drive) {
  if (bytes == 0 || ssds <= 1) return per_drive;
  StripeLayout sl{ssds, unit};
  uint64_t most = sl.file_size_for(0, bytes);
  return per_drive * static_cast<double>(bytes) / static_cast<double>(most);
}

}  // namespace

double HardwareProfile::ssd_read_rate(uint64_t bytes) const {
  return striped_rate(bytes, ssds, stripe_unit, ssd_read_Bps);
}
double HardwareProfile::optimizer_rate(const std::string& key) const {
  for (const auto& [k, rate] : optimizer_format_params_per_s)
    if (k == key) return rate;
  return optimizer_params_per_s;
}

double HardwareProfile::ssd_write_rate(uint64_t bytes) const {
  return striped_rate(bytes, ssds, stripe_unit, ssd_write_Bps);
}

}  // namespace fuyou
