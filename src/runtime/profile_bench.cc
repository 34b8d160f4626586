// `fuyou-bench profile`: a hardware profile measured with the code paths the engine runs.
// CPU backend: oneDNN GEMMs of a layer's shapes against the FMA peak, memcpy (its
// host<->device copy), and GEMMs beside AdamW for the sharing of the cores. CUDA backend: a
// layer's GEMMs through the backend (cuBLAS at the engine's GPU precision) by size, and
// copies both ways from page-locked host memory. Both: the SSD store (fuyou-bench io), the
// out-of-core AdamW on host-resident state, and the host memory bandwidth.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "fuyou/backend.h"
#include "fuyou/backend_select.h"
#include "fuyou/config.h"
#include "fuyou/cuda.h"
#include "fuyou/error.h"
#include "fuyou/io_bench.h"
#include "fuyou/model.h"
#include "fuyou/ooc_adamw.h"
#include "fuyou/rng.h"
#include "fuyou/sim_bench.h"
#include "fuyou/timing.h"
#include "kernels/common/element_math.h"
#include "kernels/cpu/fma_peak.h"
#include "kernels/cpu/gemm.h"
#include "src/optim/mem_bandwidth.h"

namespace fuyou {

namespace {

using clock_type = std::chrono::steady_clock;
// A layer's GEMMs at d_model C, N tokens, d_ff 4C: the four forward projections and the MLP
// up-projection's two backward GEMMs. Returns their FLOPs; `run` does them once.
struct LayerGemms {
  int N, C, F;
  std::vector<float> x, w, y;
  LayerGemms(int n, int c) : N(n), C(c), F(4 * c) {
    size_t big = static_cast<size_t>(std::max(N, F)) * std::max(C, F);
    x.assign(static_cast<size_t>(N) * F, 0.01f);
    w.assign(big, 0.02f);
    y.assign(static_cast<size_t>(std::max(N, F)) * std::max(F, N), 0.0f);
  }
  double flops() const {
    return 2.0 * N * (3.0 * C * C + C * C + 2.0 * C * F) + 2 * 2.0 * N * C * F;
  }
  void run() {
    using cpu::gemm_f32;
    gemm_f32(false, true, N, 3 * C, C, 1, x.data(), C, w.data(), C, 0, y.data(), 3 * C);  // qkv
    gemm_f32(false, true, N, C, C, 1, x.data(), C, w.data(), C, 0, y.data(), C);   // attn proj
    gemm_f32(false, true, N, F, C, 1, x.data(), C, w.data(), C, 0, y.data(), F);   // fc
    gemm_f32(false, true, N, C, F, 1, x.data(), F, w.data(), F, 0, y.data(), C);   // fc proj
    gemm_f32(false, false, N, C, F, 1, x.data(), F, w.data(), C, 0, y.data(), C);  // fc dX
    gemm_f32(true, false, F, C, N, 1, x.data(), F, w.data(), C, 0, y.data(), C);   // fc dW
  }
};

// The same layer through a Backend's matmul_forward / matmul_backward (the calls the model
// makes, at the backend's GEMM precision): the four forward projections and their backward
// (dX and dW each), with a finish_compute() so that a GPU's queued work is timed whole.
struct BackendLayerGemms {
  Backend& be;
  int N, C, F;
  float *x, *w, *y, *dx, *dw;
  BackendLayerGemms(Backend& backend, int n, int c) : be(backend), N(n), C(c), F(4 * c) {
    const size_t act = static_cast<size_t>(N) * F, wts = static_cast<size_t>(F) * C;
    x = alloc(act, "profile x");
    y = alloc(act, "profile y");
    dx = alloc(act, "profile dx");
    w = alloc(wts, "profile w");
    dw = alloc(wts, "profile dw");
    std::vector<float> fill(std::max(act, wts), 0.01f);
    be.copy_to_device(x, fill.data(), sizeof(float) * act);
    be.copy_to_device(w, fill.data(), sizeof(float) * wts);
  }
  ~BackendLayerGemms() {
    for (float* p : {x, y, dx, w, dw}) be.free(p);
  }
  BackendLayerGemms(const BackendLayerGemms&) = delete;
  BackendLayerGemms& operator=(const BackendLayerGemms&) = delete;
  float* alloc(size_t n, const char* what) {
    return static_cast<float*>(be.alloc(sizeof(float) * n, what));
  }
  double flops() const { return 3 * 2.0 * N * (3.0 * C * C + C * C + 2.0 * C * F); }
  void run() {
    const int shapes[4][2] = {
        {C, 3 * C}, {C, C}, {C, F}, {F, C}};  // (in, out): qkv, proj, fc, fc proj
    for (const auto& s : shapes) be.matmul_forward(y, x, w, nullptr, N, s[0], s[1]);
    for (const auto& s : shapes) be.matmul_backward(dx, dw, nullptr, y, x, w, N, s[0], s[1]);
    be.finish_compute();
  }
};

// Runs `f` repeatedly for about `seconds`; returns the calls per second of the fastest
// call (`fastest`) or of all calls together. The fastest call is the figure of a machine
// without other load: this machine's two cores are shared with other work, and a profile
// describes the hardware, not the moment.
template <typename Fn>
double rate_for(double seconds, Fn&& f, const std::atomic<bool>* stop = nullptr,
                bool fastest = true) {
  auto t0 = clock_type::now();
  int n = 0;
  double best = 1e30;
  while (seconds_since(t0) < seconds && !(stop && stop->load())) {
    auto t1 = clock_type::now();
    f();
    best = std::min(best, seconds_since(t1));
    ++n;
  }
  return fastest ? 1.0 / best : n / seconds_since(t0);
}

using Say = std::function<void(const std::string&)>;

// Host memory bandwidth, the SSD store over `dirs` (one drive each) and the optimizer alone:
// the figures of the host side, whichever backend computes.
void measure_host_side(const ProfileOptions& o, HardwareProfile& p, const Say& say) {
  MemBandwidth bw = measure_mem_bandwidth(256ull << 20);
  p.host_mem_Bps = bw.triad_GBps * 1e9;
  say(str("memory bandwidth (triad): ", bw.triad_GBps, " GB/s"));

  IoBenchOptions io;
  io.dirs = o.dirs;
  io.size = o.io_size;
  nlohmann::json r = run_io_bench(io);
  p.ssds = static_cast<int>(o.dirs.size());
  p.ssd_read_Bps = r["read_MBps"].get<double>() * 1e6 / p.ssds;
  p.ssd_write_Bps = r["write_MBps"].get<double>() * 1e6 / p.ssds;
  // The mixed pass's halves alone would have taken their share of the whole passes' times.
  const double bytes = r["bytes"].get<double>();
  p.ssd_mixed =
      mixed_capacity_from(r["read_s"].get<double>() * r["mixed_read_bytes"].get<double>() / bytes,
                          r["write_s"].get<double>() * r["mixed_write_bytes"].get<double>() / bytes,
                          r["mixed_s"].get<double>());
  say(str("SSD store over ", p.ssds, " directories: read ", r["read_MBps"].get<double>(),
          " MB/s, write ", r["write_MBps"].get<double>(), " MB/s; reads and writes at once: ",
          p.ssd_mixed, " x one direction's throughput (1: they take turns, 2: full duplex)"));
}

// The optimizer as the engine calls it: state in host memory, one 16M-parameter group in
// `format`, and either fp32 gradients in and fp32 weights out (`wide`) or bf16 gradients in and
// bf16 working weights out (16-bit device tensors; a split master needs them). `update()` runs
// one step.
struct OptimizerProbe {
  static constexpr size_t n = 16u << 20;
  explicit OptimizerProbe(OptimFormat format = {}, bool wide = true)
      : opt({{"g", n, {{0, n, true}}}}, {Tier::kHost}, nullptr, options(format)), wide(wide) {
    std::vector<float> init(n, 0.01f);
    opt.init_group(0, init.data());
    if (wide) {
      grad32.assign(n, 1e-3f);
      lowp32.resize(n);
    } else {
      grad16.assign(n, math::float_to_bf16(1e-3f));
      lowp16.assign(n, math::split_hi(0.01f));
    }
  }
  static OocAdamWOptions options(OptimFormat format) {
    OocAdamWOptions o;
    o.format = format;
    return o;
  }
  void update() {
    OocAdamW::Update u;
    u.grad = wide ? static_cast<const void*>(grad32.data()) : grad16.data();
    u.grad_type = wide ? ElemType::kF32 : ElemType::kBF16;
    u.lowp = wide ? static_cast<void*>(lowp32.data()) : lowp16.data();
    u.lowp_type = wide ? ElemType::kF32 : ElemType::kBF16;
    u.lr = 1e-4f;
    u.t = t++;
    opt.wait(opt.submit(u));
  }
  OocAdamW opt;
  bool wide;
  std::vector<float> grad32, lowp32;
  std::vector<uint16_t> grad16, lowp16;
  int64_t t = 1;
};

// optimizer_params_per_s from `probe` (fp32 state, fp32 gradients and weights), then each
// state format's rate with bf16 gradients and working weights (optimizer.formats).
// The CPU's name as the kernel reports it ("model name" in /proc/cpuinfo); "" where unknown.
std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      return colon == std::string::npos ? "" : line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "";
}

void measure_optimizer(HardwareProfile& p, OptimizerProbe& probe, const Say& say) {
  // Which CPU and instruction set the AdamW figures below come from: the packed formats' kernel
  // is compute-bound, its AVX2 path about half the AVX-512 path's speed (docs/performance.md).
  const std::string cpu = cpu_model_name();
  say(str("AdamW on ", cpu.empty() ? std::string("an unknown CPU") : cpu, ", ",
          omp_get_max_threads(), " threads, the ", simd_path_name(best_simd_path()), " path"));
  probe.update();
  p.optimizer_params_per_s = rate_for(2.0, [&] { probe.update(); }) * OptimizerProbe::n;
  say(str("AdamW (host state, fp32 in/out): ", p.optimizer_params_per_s / 1e6, " M params/s"));
  for (MomentFormat m : {MomentFormat::kF32, MomentFormat::kBF16, MomentFormat::kInt8})
    for (MasterFormat w : {MasterFormat::kF32, MasterFormat::kSplit}) {
      const OptimFormat f{m, w};
      OptimizerProbe q(f, false);
      q.update();
      const double rate = rate_for(1.0, [&] { q.update(); }) * OptimizerProbe::n;
      p.optimizer_format_params_per_s.push_back({optim_format_name(f), rate});
      say(str("AdamW (host state ", optim_format_name(f), ", bf16 in/out): ", rate / 1e6,
              " M params/s"));
    }
}

// A host buffer, page-locked where the backend allows, and a device buffer of the same size,
// for timing copies between them; released with the object.
struct CopyBuffers {
  CopyBuffers(Backend& be, size_t n) : backend(be), bytes(n), host(n, 1) {
    locked = backend.register_host(host.data(), bytes);
    dev = backend.alloc(bytes, "profile copy");
  }
  ~CopyBuffers() {
    backend.free(dev);
    if (locked) backend.unregister_host(host.data());
  }
  CopyBuffers(const CopyBuffers&) = delete;
  CopyBuffers& operator=(const CopyBuffers&) = delete;
  void to_device() { backend.copy_to_device(dev, host.data(), bytes); }
  void to_host() { backend.copy_to_host(host.data(), dev, bytes); }

  Backend& backend;
  size_t bytes;
  std::vector<char> host;
  void* dev = nullptr;
  bool locked = false;
};

// optimizer.copy_share: the host AdamW's rate (the packed recipe, int8 moments and a split
// master with bf16 gradients) while page-locked copies stream both ways at once, as they do
// through most of an offloaded step, over its rate alone. Both are averages over whole
// windows: the slowdown is what is measured.
void measure_copy_share(Backend& backend, HardwareProfile& p, const Say& say) {
  OptimizerProbe q({MomentFormat::kInt8, MasterFormat::kSplit}, false);
  q.update();
  const double alone = rate_for(
      2.0, [&] { q.update(); }, nullptr, false);
  CopyBuffers up(backend, 256ull << 20), down(backend, 256ull << 20);
  backend.set_caller_ordered(true);  // as the executor's copy threads use it
  std::atomic<bool> stop{false};
  std::thread h2d([&] {
    while (!stop) up.to_device();
  });
  std::thread d2h([&] {
    while (!stop) down.to_host();
  });
  const double copying = rate_for(
      2.0, [&] { q.update(); }, nullptr, false);
  stop = true;
  h2d.join();
  d2h.join();
  backend.set_caller_ordered(false);
  p.copy_share = std::clamp(copying / alone, 1e-3, 1.0);
  say(str("AdamW (host state int8/split) while copies run both ways: ", copying * q.n / 1e6,
          " M params/s, ", p.copy_share, " of its rate alone (", alone * q.n / 1e6, ")"));
}

}  // namespace

HardwareProfile measure_cpu_profile(const ProfileOptions& o, std::string* log) {
  if (o.dirs.empty())
    throw ConfigError("fuyou-bench profile: --dir (a store directory on the SSD) is required");
  auto backend = make_cpu_backend(o.threads, 0);
  const int threads = backend->threads();
  Say say = [&](const std::string& s) {
    if (log) *log += s + "\n";
  };
  HardwareProfile p;
  p.name = "this-cpu";
  p.backend = "cpu";
  p.element_bytes = 4;
  p.shared_cpu = true;

  cpu::FmaPeak peak = cpu::measure_fma_peak(threads, 0.1);
  for (int i = 0; i < 9; ++i) {  // the best of ten short runs, for the reason given at rate_for
    cpu::FmaPeak q = cpu::measure_fma_peak(threads, 0.1);
    if (q.gflops_all > peak.gflops_all) peak = q;
  }
  p.peak_flops = peak.gflops_all * 1e9;
  say(str("fp32 FMA peak (", peak.isa, ", ", threads, " threads): ", peak.gflops_all, " GFLOP/s"));

  // GEMM efficiency: layers with d_model s, d_ff 4s and 2s tokens have size cbrt(2s*s*4s) = 2s.
  // Only the rates matter to the simulator (time = flops / (peak * efficiency)); should a
  // GEMM have caught a quieter moment than the FMA run, the peak is raised to it so every
  // efficiency stays <= 1 without changing any rate.
  std::vector<double> rates;
  for (int s : {64, 128, 256, 512, 1024}) {
    LayerGemms g(2 * s, s);
    g.run();
    rates.push_back(g.flops() * rate_for(s >= 512 ? 1.5 : 0.5, [&] { g.run(); }));
    say(str("layer GEMMs at d_model ", s, " (size ", 2 * s, "): ", rates.back() / 1e9, " GFLOP/s"));
  }
  p.peak_flops = std::max(p.peak_flops, *std::max_element(rates.begin(), rates.end()));
  for (size_t i = 0; i < rates.size(); ++i)
    p.gemm_efficiency.push_back({128.0 * (1 << i), rates[i] / p.peak_flops});

  // Host <-> device on the CPU backend is memcpy.
  {
    const size_t bytes = 256ull << 20;
    std::vector<char> a(bytes, 1), b(bytes, 2);
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
      auto t0 = clock_type::now();
      backend->copy_to_device(b.data(), a.data(), bytes);
      best = std::min(best, seconds_since(t0));
    }
    p.h2d_Bps = p.d2h_Bps = bytes / best;
    say(str("memcpy (host<->device on the CPU backend): ", p.h2d_Bps / 1e9, " GB/s"));
  }
  measure_host_side(o, p, say);
  OptimizerProbe probe;
  measure_optimizer(p, probe, say);

  // Both at once, as the executor runs them: GEMMs on one thread, updates on another.
  {
    LayerGemms g(512, 256);
    // Averages over whole windows here: the sharing is what is measured.
    double gemm_alone = rate_for(
        2.0, [&] { g.run(); }, nullptr, false);
    double upd_alone_avg = rate_for(
        2.0, [&] { probe.update(); }, nullptr, false);
    std::atomic<bool> stop{false};
    double upd_both = 0;
    std::thread th([&] {
      upd_both = rate_for(
          3.0, [&] { probe.update(); }, &stop, false);
    });
    double gemm_both = rate_for(
        3.0, [&] { g.run(); }, nullptr, false);
    stop = true;
    th.join();
    p.compute_share = std::min(1.0, gemm_both / gemm_alone);
    p.optimizer_share = std::min(1.0, upd_both / upd_alone_avg);
    say(str("GEMMs and AdamW together: compute at ", p.compute_share, ", optimizer at ",
            p.optimizer_share, " of their alone rates"));
  }
  return p;
}

HardwareProfile measure_cuda_profile(const ProfileOptions& o, std::string* log) {
  if (o.dirs.empty())
    throw ConfigError("fuyou-bench profile: --dir (a store directory on the SSD) is required");
  auto backend = make_cuda_backend(0, 0);
  // What large models train with on this GPU: bf16 GEMMs on bf16 device tensors, so the layer
  // GEMMs below read and write the storage type training uses.
  RuntimeConfig rt;
  rt.device_tensors = "bf16";
  apply_precision(*backend, rt);
  Say say = [&](const std::string& s) {
    if (log) *log += s + "\n";
  };
  HardwareProfile p;
  p.name = "this-gpu";
  p.backend = "cuda";
  p.element_bytes = 2;
  p.shared_cpu = false;
  say(str("device: ", backend->name()));
  p.device_memory = backend->memory().capacity;

  // GEMM efficiency by layer size (cbrt(tokens * d_model * d_ff) = 2s for d_model s, 2s
  // tokens), relative to the fastest rate measured: only the rates matter to the simulator.
  std::vector<double> rates;
  for (int s : {256, 512, 1024, 2048, 4096, 8192}) {
    BackendLayerGemms g(*backend, 2 * s, s);
    g.run();
    rates.push_back(g.flops() * rate_for(1.0, [&] { g.run(); }));
    say(str("layer GEMMs at d_model ", s, " (size ", 2 * s, ", ",
            matmul_precision_name(backend->matmul_precision()), " inputs): ", rates.back() / 1e12,
            " TFLOP/s"));
  }
  p.peak_flops = *std::max_element(rates.begin(), rates.end());
  for (size_t i = 0; i < rates.size(); ++i)
    p.gemm_efficiency.push_back({512.0 * (1 << i), rates[i] / p.peak_flops});

  // PCIe both ways from page-locked host memory, as the executor's buffers are.
  {
    const size_t bytes = 512ull << 20;
    CopyBuffers b(*backend, bytes);
    auto best_rate = [&](auto&& copy) {
      double best = 1e30;
      for (int r = 0; r < 5; ++r) {
        auto t0 = clock_type::now();
        copy();
        best = std::min(best, seconds_since(t0));
      }
      return bytes / best;
    };
    p.h2d_Bps = best_rate([&] { b.to_device(); });
    p.d2h_Bps = best_rate([&] { b.to_host(); });
    say(str("host->device ", p.h2d_Bps / 1e9, " GB/s, device->host ", p.d2h_Bps / 1e9, " GB/s (",
            b.locked ? "page-locked" : "pageable: cudaHostRegister refused", ", 512 MiB copies)"));
  }
  measure_host_side(o, p, say);
  OptimizerProbe probe;
  measure_optimizer(p, probe, say);
  measure_copy_share(*backend, p, say);
  return p;
}

nlohmann::json run_cpu_gemm_bench(const Config& cfg, int threads) {
  auto backend = make_cpu_backend(threads, 0);
  threads = backend->threads();
  auto peak = cpu::measure_fma_peak(threads);
  const int N = cfg.schedule.micro_batch * cfg.model.seq_len;
  const int C = cfg.model.d_model, F = cfg.model.d_ff, V = cfg.model.vocab_size;
  struct Shape {
    const char* name;
    bool ta, tb;
    int M, Nn, K;
  };
  std::vector<Shape> shapes = {
      {"qkv fwd", false, true, N, 3 * C, C}, {"fc fwd", false, true, N, F, C},
      {"fcproj fwd", false, true, N, C, F},  {"fc dX", false, false, N, C, F},
      {"fc dW", true, false, F, C, N},       {"lm_head fwd", false, true, N, V, C},
  };
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& s : shapes) {
    size_t a_elems = static_cast<size_t>(s.M) * s.K, b_elems = static_cast<size_t>(s.K) * s.Nn;
    std::vector<float> A(a_elems, 0.01f), Bm(b_elems, 0.02f), Cm(static_cast<size_t>(s.M) * s.Nn);
    int lda = s.ta ? s.M : s.K, ldb = s.tb ? s.K : s.Nn;
    std::vector<double> t;
    for (int r = 0; r < 6; ++r) {
      auto t0 = clock_type::now();
      cpu::gemm_f32(s.ta, s.tb, s.M, s.Nn, s.K, 1.0f, A.data(), lda, Bm.data(), ldb, 0.0f,
                    Cm.data(), s.Nn);
      if (r > 0) t.push_back(seconds_since(t0));
    }
    double gflops = 2.0 * s.M * s.Nn * s.K / median(t) / 1e9;
    rows.push_back({{"shape", s.name},
                    {"M", s.M},
                    {"N", s.Nn},
                    {"K", s.K},
                    {"gflops", gflops},
                    {"fraction_of_peak", gflops / peak.gflops_all}});
  }
  nlohmann::json j{{"library", cpu::gemm_library_name()},
                   {"threads", threads},
                   {"fma_isa", peak.isa},
                   {"fma_peak_gflops_1thread", peak.gflops_per_thread},
                   {"fma_peak_gflops", peak.gflops_all},
                   {"shapes", rows}};
  return j;
}

namespace {

// One GEMM of a layer as the engine calls it (out(N, out) = in(N, in) W(out, in)^T and its
// backward) and as the same products in cuBLASLt's column-major terms.
struct LayerGemm {
  const char* part;
  int in, out;
};

// Seconds per call of `f`: batches of `reps` calls queued between two marks on the device's
// timeline (Backend::timing_mark; CUDA: events on the compute stream), the median of five
// batches after a warm-up batch, as cublaslt_gemm_time times its side.
template <typename Fn>
double engine_seconds(Backend& be, int reps, Fn&& f) {
  std::vector<double> t;
  for (int batch = 0; batch < 6; ++batch) {
    be.timing_start();
    be.timing_mark(0);
    for (int i = 0; i < reps; ++i) f();
    be.timing_mark(0);
    const std::vector<Backend::TimingMark> marks = be.timing_stop();
    FY_CHECK(marks.size() == 2, "gemm bench: expected two timing marks");
    if (batch > 0) t.push_back((marks[1].t - marks[0].t) / reps);
  }
  return median(t);
}

}  // namespace

void fill_random_bf16(Backend& be, void* dst, size_t elems, uint64_t seed) {
  constexpr size_t kChunk = size_t(1) << 22;  // 4 Mi values, 8 MiB a copy
  constexpr size_t kBlock = size_t(1) << 16;  // one generator stream per 64 Ki values
  std::vector<uint16_t> host(std::min(elems, kChunk));
  for (size_t done = 0; done < elems;) {
    const size_t n = std::min(kChunk, elems - done);
    // Streams by block index: the values do not depend on the thread count (a 175B-shaped
    // bench fills billions of them).
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < (n + kBlock - 1) / kBlock; ++b) {
      Rng rng(seed, (done + b * kBlock) / kBlock);
      for (size_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i)
        host[i] = math::float_to_bf16(static_cast<float>(2 * rng.uniform() - 1));
    }
    be.copy_to_device(static_cast<uint16_t*>(dst) + done, host.data(), 2 * n);
    done += n;
  }
}

nlohmann::json run_cuda_gemm_bench(const Config& cfg, int reps) {
  const ModelConfig& m = cfg.model;
  const int N = cfg.schedule.micro_batch * m.seq_len, C = m.d_model;
  const int KV = m.kv_heads() * m.head_size(), F = m.d_ff, A = m.attn_width();
  const int fc_out = fc_outputs(family_traits(m.family), F);
  const int V = padded_vocab(m);
  const std::vector<LayerGemm> gemms = {{"qkv", C, A + 2 * KV},
                                        {"proj", A, C},
                                        {"fc", C, fc_out},
                                        {"fcproj", F, C},
                                        {"lm_head", C, V}};
  size_t act = 0, wts = 0;
  for (const auto& g : gemms) {
    act = std::max(act, static_cast<size_t>(N) * std::max(g.in, g.out));
    wts = std::max(wts, static_cast<size_t>(g.in) * g.out);
  }
  // The engine's arena holds only the eight buffers below (and alignment): the plain cuBLASLt
  // GEMMs read and write the same buffers and allocate only their workspace from what the
  // device has left.
  const uint64_t arena = 2 * (4 * act + 2 * wts) + (64ull << 20);
  auto be = make_cuda_backend(0, arena);
  be->set_storage_type(ElemType::kBF16);
  be->set_matmul_precision(MatmulPrecision::kBf16);
  size_t widest = 0;
  for (const auto& g : gemms) widest = std::max(widest, static_cast<size_t>(g.out));
  struct Buffers {
    Backend& be;
    void *x, *y, *dx, *dy, *w, *dw, *bias, *dbias;
    ~Buffers() {
      for (void* p : {x, y, dx, dy, w, dw, bias, dbias}) be.free(p);
    }
  } b{*be,
      be->alloc(2 * act, "gemm bench x"),
      be->alloc(2 * act, "gemm bench y"),
      be->alloc(2 * act, "gemm bench dx"),
      be->alloc(2 * act, "gemm bench dy"),
      be->alloc(2 * wts, "gemm bench w"),
      be->alloc(2 * wts, "gemm bench dw"),
      be->alloc(2 * widest, "gemm bench bias"),
      be->alloc(2 * widest, "gemm bench bias gradient")};
  // Random operands everywhere, the same bytes for both sides: the arena's blocks start zeroed,
  // and zeros multiply faster than data.
  uint64_t seed = 1;
  for (auto [p, n] : {std::pair{b.x, act},
                      {b.y, act},
                      {b.dx, act},
                      {b.dy, act},
                      {b.w, wts},
                      {b.dw, wts},
                      {b.bias, widest},
                      {b.dbias, widest}})
    fill_random_bf16(*be, p, n, seed++);
  be->synchronize();
  // The layer GEMMs with a bias, as GPT-2's projections have: the forward with the bias by the
  // broadcast kernel (runtime.gemm_bias kernel) and by cuBLASLt's epilogue (epilogue), the
  // backward with the bias gradient. "" or why the epilogue could not be asked for.
  std::string no_epilogue;
  try {
    be->set_bias_epilogue(true);
    be->set_bias_epilogue(false);
  } catch (const Error& e) {
    no_epilogue = e.what();
  }
  nlohmann::json rows = nlohmann::json::array();
  double layer_flops = 0, layer_engine_s = 0, layer_lt_s = 0;
  double biased_kernel_s = 0, biased_epilogue_s = 0;
  for (const auto& g : gemms) {
    const double flops = 2.0 * N * g.in * g.out;
    // Forward: out^T (out x N) = W (col-major in x out, transposed) x^T (col-major in x N).
    // The engine's buffers are row-major: y (N, out) is y^T (out x N) column-major, W (out, in)
    // is (in x out), x (N, in) is (in x N).
    const LtGemmTiming fwd =
        cublaslt_gemm_time({true, false, g.out, N, g.in}, {b.w, b.x, b.y}, reps);
    // Backward: dX^T (in x N) = W (in x out) dY^T (out x N); dW^T (in x out) = x^T (in x N) dY.
    const LtGemmTiming dxt =
        cublaslt_gemm_time({false, false, g.in, N, g.out}, {b.w, b.dy, b.dx}, reps);
    const LtGemmTiming dwt =
        cublaslt_gemm_time({false, true, g.in, g.out, N}, {b.x, b.dy, b.dw}, reps);
    const double e_fwd = engine_seconds(
        *be, reps, [&] { be->matmul_forward(b.y, b.x, b.w, nullptr, N, g.in, g.out); });
    const double e_bwd = engine_seconds(*be, reps, [&] {
      be->matmul_backward(b.dx, b.dw, nullptr, b.dy, b.x, b.w, N, g.in, g.out);
    });
    const double lt_bwd = dxt.median_s + dwt.median_s;
    nlohmann::json biased;
    if (std::string(g.part) != "lm_head") {
      const double k_fwd = engine_seconds(
          *be, reps, [&] { be->matmul_forward(b.y, b.x, b.w, b.bias, N, g.in, g.out); });
      const double k_bwd = engine_seconds(*be, reps, [&] {
        be->matmul_backward(b.dx, b.dw, b.dbias, b.dy, b.x, b.w, N, g.in, g.out);
      });
      biased = {{"forward_kernel_tflops", flops / k_fwd / 1e12},
                {"backward_tflops", 2 * flops / k_bwd / 1e12}};
      biased_kernel_s += k_fwd + k_bwd;
      if (no_epilogue.empty()) {
        be->set_bias_epilogue(true);
        const double e = engine_seconds(
            *be, reps, [&] { be->matmul_forward(b.y, b.x, b.w, b.bias, N, g.in, g.out); });
        be->set_bias_epilogue(false);
        biased["forward_epilogue_tflops"] = flops / e / 1e12;
        biased["forward_epilogue_over_kernel"] = k_fwd / e;
        biased_epilogue_s += e + k_bwd;
      }
    }
    rows.push_back({{"part", g.part},
                    {"in", g.in},
                    {"out", g.out},
                    {"tokens", N},
                    {"forward",
                     {{"cublaslt_tflops", flops / fwd.median_s / 1e12},
                      {"engine_tflops", flops / e_fwd / 1e12},
                      {"engine_over_cublaslt", fwd.median_s / e_fwd}}},
                    {"backward",
                     {{"cublaslt_tflops", 2 * flops / lt_bwd / 1e12},
                      {"engine_tflops", 2 * flops / e_bwd / 1e12},
                      {"engine_over_cublaslt", lt_bwd / e_bwd}}},
                    {"with_bias", biased}});
    if (std::string(g.part) != "lm_head") {
      layer_flops += 3 * flops;
      layer_engine_s += e_fwd + e_bwd;
      layer_lt_s += fwd.median_s + lt_bwd;
    }
  }
  return {{"backend", be->name()},
          {"shapes", rows},
          {"reps", reps},
          {"layer_engine_tflops", layer_flops / layer_engine_s / 1e12},
          {"layer_cublaslt_tflops", layer_flops / layer_lt_s / 1e12},
          {"layer_engine_over_cublaslt", layer_lt_s / layer_engine_s},
          {"layer_with_bias_kernel_tflops", layer_flops / biased_kernel_s / 1e12},
          {"layer_with_bias_epilogue_tflops",
           no_epilogue.empty() ? nlohmann::json(layer_flops / biased_epilogue_s / 1e12)
                               : nlohmann::json(no_epilogue)}};
}

}  // namespace fuyou
