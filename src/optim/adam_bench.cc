#include "fuyou/adam_bench.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "fuyou/error.h"
#include "fuyou/io_bench.h"
#include "fuyou/log.h"
#include "fuyou/ooc_adamw.h"
#include "fuyou/rng.h"
#include "fuyou/timing.h"
#include "kernels/common/element_math.h"
#include "src/optim/mem_bandwidth.h"

namespace fuyou {
namespace {

using clock_type = std::chrono::steady_clock;

std::vector<uint16_t> random_grad16(size_t n) {
  std::vector<uint16_t> g(n);
#pragma omp parallel
  {
    Rng rng(9, omp_get_thread_num());
#pragma omp for schedule(static)
    for (size_t i = 0; i < n; ++i) g[i] = 0x3c00 ^ static_cast<uint16_t>(rng.next() & 0x83ff);
  }
  return g;
}

// Bytes the update reads and writes per parameter in memory (a split master reads its
// working halves too; int8 scales: 4 bytes per 256 per moment each way).
double update_bytes_per_param(const AdamBenchOptions& o) {
  const OptimFormat& f = o.format;
  const bool split = f.master == MasterFormat::kSplit;
  return !f.packed()
             ? static_cast<double>(adamw_bytes_per_param(o.grad_type, o.with_lowp, o.lowp_type))
             : elem_type_size(o.grad_type) + 2.0 * master_elem_bytes(f.master) +
                   4.0 * moment_elem_bytes(f.moments) +
                   (split         ? 4.0
                    : o.with_lowp ? 2.0
                                  : 0.0) +
                   (f.moments == MomentFormat::kInt8 ? 16.0 / kStateBlock : 0.0);
}

// Gradients: random bf16/f16 bit patterns of moderate magnitude, or fp32 from them.
class BenchGradients {
 public:
  BenchGradients(size_t n, ElemType type) : type_(type), g16_(random_grad16(n)) {
    if (type != ElemType::kF32) return;
    g32_.resize(n);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; ++i) g32_[i] = math::bf16_to_float(g16_[i]);
  }
  const void* data() const {
    return type_ == ElemType::kF32 ? static_cast<const void*>(g32_.data()) : g16_.data();
  }

 private:
  ElemType type_;
  std::vector<uint16_t> g16_;
  std::vector<float> g32_;
};

// The packed kernel over one group of n parameters, state in memory; the median update time.
double time_packed_update(const AdamBenchOptions& o, const void* grad) {
  const size_t n = o.params;
  const OptimFormat& f = o.format;
  const bool split = f.master == MasterFormat::kSplit;
  std::vector<float> master32(split ? 0 : n, 0.01f), ms(state_blocks(n), 0.0f),
      vs(state_blocks(n), 0.0f);
  std::vector<int16_t> lo(split ? n : 0, 0);
  std::vector<uint8_t> m(moment_elem_bytes(f.moments) * n, 0),
      v(moment_elem_bytes(f.moments) * n, 0);
  std::vector<uint16_t> hi(n, math::split_hi(0.01f));
  const DecayRange all{0, n, true};
  PackedAdamWArgs a;
  a.format = f;
  a.master = split ? static_cast<void*>(lo.data()) : master32.data();
  a.m = m.data();
  a.v = v.data();
  a.m_scale = ms.data();
  a.v_scale = vs.data();
  a.grad = grad;
  a.grad_type = o.grad_type;
  a.lowp = split || o.with_lowp ? hi.data() : nullptr;
  a.lowp_type = ElemType::kBF16;
  a.n = n;
  a.ranges = &all;
  a.nranges = 1;
  std::vector<double> times;
  for (int s = 0; s <= o.steps; ++s) {
    a.key = math::round_key(0, o.first_step + s);
    auto t0 = clock_type::now();
    adamw_update_packed(a, {1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, o.first_step + s}, o.simd);
    double dt = seconds_since(t0);
    if (s > 0) times.push_back(dt);
  }
  return median(times);
}

// fp32 AdamW over n parameters in memory; the median update time.
double time_fp32_update(const AdamBenchOptions& o, const void* grad) {
  const size_t n = o.params;
  std::vector<float> master(n), m(n), v(n);
  std::vector<uint16_t> lowp16(o.with_lowp ? n : 0);
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) {
    master[i] = 0.01f;
    m[i] = 0.0f;
    v[i] = 0.0f;
  }
  std::vector<float> lowp32(o.with_lowp && o.lowp_type == ElemType::kF32 ? n : 0);
  AdamWArgs a;
  a.master = master.data();
  a.m = m.data();
  a.v = v.data();
  a.grad = grad;
  a.grad_type = o.grad_type;
  a.lowp = !o.with_lowp                    ? nullptr
           : o.lowp_type == ElemType::kF32 ? static_cast<void*>(lowp32.data())
                                           : lowp16.data();
  a.lowp_type = o.lowp_type;
  a.n = n;
  std::vector<double> times;
  for (int s = 0; s <= o.steps; ++s) {
    auto t0 = clock_type::now();
    adamw_update(a, {1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, o.first_step + s}, o.simd);
    double dt = seconds_since(t0);
    if (s > 0) times.push_back(dt);  // the first pass warms up page tables and threads
  }
  return median(times);
}

// The store's sequential bandwidth on the same directories, measured just before the
// out-of-core updates, over as many bytes as one update moves each way: its figures into r;
// returns the update rate it allows.
double ssd_bound_params_per_s(const AdamBenchOptions& o, nlohmann::json& r) {
  const size_t n = o.params;
  IoBenchOptions io;
  io.dirs = o.dirs;
  io.size =
      std::max<uint64_t>(optim_state_bytes(OptimFormat{}, n) / (1 << 20) * (1 << 20), 256ull << 20);
  nlohmann::json disk = run_io_bench(io);
  double rd = disk["read_MBps"].get<double>() * 1e6, wr = disk["write_MBps"].get<double>() * 1e6;
  r["ssd_read_MBps"] = rd / 1e6;
  r["ssd_write_MBps"] = wr / 1e6;
  // One disk serves both directions: the state's bytes read and written per parameter
  // (fp32: 12 each way).
  const double state_bpp = static_cast<double>(ooc_update_io_bytes(o.format, n)) / n;
  r["ooc_state_bytes_per_param_each_way"] = state_bpp;
  double ssd_bound = 1.0 / (state_bpp / rd + state_bpp / wr);
  r["ooc_ssd_bound_params_per_s"] = ssd_bound;
  return ssd_bound;
}

// Groups of o.group_params parameters (the last one shorter), each one "layer".
std::vector<OptimGroup> bench_groups(const AdamBenchOptions& o) {
  std::vector<OptimGroup> groups;
  for (size_t begin = 0; begin < o.params; begin += o.group_params) {
    OptimGroup g;
    g.name = "layer." + std::to_string(groups.size());
    g.numel = std::min<size_t>(o.group_params, o.params - begin);
    g.tensors.push_back({0, g.numel, true});
    groups.push_back(g);
  }
  return groups;
}

// Out-of-core updates, state on the store in o.dirs, every group submitted each step; their
// rate against `bound` into r.
void time_ooc_updates(const AdamBenchOptions& o, const void* grad, double bound,
                      nlohmann::json& r) {
  const size_t n = o.params;
  const bool split = o.format.master == MasterFormat::kSplit;
  StoreConfig sc;
  sc.dirs = o.dirs;
  sc.file_name = "fuyou-adam-bench.store";
  sc.overwrite = true;
  auto store = SsdStore::open(sc);
  std::vector<OptimGroup> groups = bench_groups(o);
  OocAdamWOptions oo;
  oo.format = o.format;
  OocAdamW opt(groups, std::vector<Tier>(groups.size(), Tier::kSsd), store.get(), oo);
  std::vector<float> init(o.group_params, 0.01f);
  for (size_t g = 0; g < groups.size(); ++g) opt.init_group(static_cast<int>(g), init.data());
  std::vector<uint16_t> lowp(o.with_lowp || split ? n : 0, math::split_hi(0.01f));
  std::vector<double> times;
  for (int s = 1; s <= o.steps; ++s) {
    auto t0 = clock_type::now();
    size_t begin = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
      OocAdamW::Update u;
      u.group = static_cast<int>(g);
      u.grad = static_cast<const char*>(grad) + begin * elem_type_size(o.grad_type);
      u.grad_type = o.grad_type;
      u.lowp = o.with_lowp || split ? lowp.data() + begin : nullptr;
      u.lowp_type = split || o.lowp_type == ElemType::kF32 ? ElemType::kBF16 : o.lowp_type;
      u.lr = 1e-4f;
      u.t = s;
      opt.submit(u);
      begin += groups[g].numel;
    }
    opt.wait_all();
    times.push_back(seconds_since(t0));
  }
  double t = median(times);
  double rate = n / t;
  r["ooc_s"] = t;
  r["ooc_params_per_s"] = rate;
  r["ooc_bound_params_per_s"] = bound;
  r["ooc_fraction_of_bound"] = rate / bound;
  r["ooc_ssd_bytes_per_update"] = (opt.ssd_bytes_read() + opt.ssd_bytes_written()) / o.steps;
}

}  // namespace

nlohmann::json run_adam_bench(const AdamBenchOptions& o) {
  nlohmann::json r;
  const size_t n = o.params;
  const OptimFormat& f = o.format;
  const double bpp = update_bytes_per_param(o);
  r["params"] = n;
  r["first_step"] = o.first_step;
  r["threads"] = omp_get_max_threads();
  const SimdPath best = best_simd_path();
  if (!simd_path_supported(o.simd))
    throw ConfigError(str("--simd ", simd_path_name(o.simd), ": this CPU's widest path is ",
                          simd_path_name(best)));
  r["simd"] = simd_path_name(o.simd == SimdPath::kAuto ? best : o.simd);
  r["grad_type"] = elem_type_name(o.grad_type);
  r["lowp_type"] = o.with_lowp ? elem_type_name(o.lowp_type) : "none";
  r["bytes_per_param"] = bpp;
  r["state"] = moment_format_name(f.moments);
  r["master"] = master_format_name(f.master);

  MemBandwidth bw = measure_mem_bandwidth(512ull << 20);
  r["mem_bw_GBps"] = bw.triad_GBps;
  r["mem_copy_GBps"] = bw.copy_GBps;
  const double mem_bound = bw.triad_GBps * 1e9 / bpp;

  const BenchGradients grad(n, o.grad_type);
  const double t =
      f.packed() ? time_packed_update(o, grad.data()) : time_fp32_update(o, grad.data());
  r["inmem_s"] = t;
  r["inmem_params_per_s"] = n / t;
  r["inmem_roofline_params_per_s"] = mem_bound;
  r["inmem_fraction_of_roofline"] = (n / t) / mem_bound;

  if (!o.dirs.empty()) {
    const double ssd_bound = ssd_bound_params_per_s(o, r);
    time_ooc_updates(o, grad.data(), std::min(ssd_bound, mem_bound), r);
  }
  r["peak_rss_bytes"] = peak_rss_bytes();
  return r;
}

void print_adam_bench(const nlohmann::json& r) {
  std::printf(
      "AdamW over %.0fM parameters, %d threads, %s, grad %s, weights out %s, state %s, master %s, "
      "%.2f bytes/param\n",
      r["params"].get<double>() / 1e6, r["threads"].get<int>(),
      r["simd"].get<std::string>().c_str(), r["grad_type"].get<std::string>().c_str(),
      r["lowp_type"].get<std::string>().c_str(), r["state"].get<std::string>().c_str(),
      r["master"].get<std::string>().c_str(), r["bytes_per_param"].get<double>());
  std::printf("  memory bandwidth (triad)   %8.1f GB/s\n", r["mem_bw_GBps"].get<double>());
  std::printf("  in memory                  %8.1f M params/s  (%.0f%% of the %.1f M/s roofline)\n",
              r["inmem_params_per_s"].get<double>() / 1e6,
              100 * r["inmem_fraction_of_roofline"].get<double>(),
              r["inmem_roofline_params_per_s"].get<double>() / 1e6);
  if (r.contains("ooc_params_per_s")) {
    std::printf("  SSD read / write           %8.0f / %.0f MB/s\n",
                r["ssd_read_MBps"].get<double>(), r["ssd_write_MBps"].get<double>());
    std::printf("  out of core                %8.1f M params/s  (%.0f%% of the %.1f M/s bound)\n",
                r["ooc_params_per_s"].get<double>() / 1e6,
                100 * r["ooc_fraction_of_bound"].get<double>(),
                r["ooc_bound_params_per_s"].get<double>() / 1e6);
  }
}

}  // namespace fuyou
