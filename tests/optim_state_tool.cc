// The packed AdamW for the Python reference (tests/reference/optim_state_ref.py): reads a
// group's initial fp32 master, its gradients per step and its tensor ranges from DIR, runs
// adamw_update_packed for the given format, SIMD path and steps, and writes the resulting
// state into DIR as raw little-endian arrays:
//   optim_state_tool DIR MOMENTS MASTER PATH STEPS GROUP FIRST LR BETA1 BETA2 EPS WD GRAD_SCALE
// DIR holds n.txt (element count), master.f32 (n floats), grad.T.f32 (n floats per step T),
// ranges.txt (lines "begin end decay") and optionally m.in / m_scale.in / v.in / v_scale.in
// (initial moments in the format). Writes hi.u16, master.out (fp32 or int16 remainders),
// m.out, v.out and, for int8, m_scale.out and v_scale.out. Exit status 1 with a message on
// any error.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "fuyou/optim.h"
#include "kernels/common/element_math.h"

using namespace fuyou;

namespace {

template <class T>
std::vector<T> read_raw(const std::string& path, size_t n, bool optional = false) {
  std::vector<T> v(n);
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    if (optional) return {};
    throw std::runtime_error(path + ": cannot open");
  }
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(T)));
  if (static_cast<size_t>(f.gcount()) != n * sizeof(T))
    throw std::runtime_error(path + ": short file");
  return v;
}

template <class T>
void write_raw(const std::string& path, const std::vector<T>& v) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()),
          static_cast<std::streamsize>(v.size() * sizeof(T)));
  if (!f) throw std::runtime_error(path + ": cannot write");
}

MomentFormat moments_of(const std::string& s) {
  if (s == "fp32") return MomentFormat::kF32;
  if (s == "bf16") return MomentFormat::kBF16;
  if (s == "int8") return MomentFormat::kInt8;
  throw std::runtime_error("moments '" + s + "'");
}

SimdPath path_of(const std::string& s) { return simd_path_from_name(s, "path"); }

int run(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--paths") {
    std::cout << "scalar";
    if (static_cast<int>(best_simd_path()) >= static_cast<int>(SimdPath::kAvx2))
      std::cout << " avx2";
    if (best_simd_path() == SimdPath::kAvx512) std::cout << " avx512";
    std::cout << "\n";
    return 0;
  }
  if (argc != 14)
    throw std::runtime_error(
        "usage: DIR MOMENTS MASTER PATH STEPS GROUP FIRST LR BETA1 BETA2 EPS WD GRAD_SCALE");
  const std::string dir = argv[1];
  OptimFormat f;
  f.moments = moments_of(argv[2]);
  f.master = std::string(argv[3]) == "split" ? MasterFormat::kSplit : MasterFormat::kF32;
  const SimdPath path = path_of(argv[4]);
  const int steps = std::atoi(argv[5]);
  const uint32_t group = static_cast<uint32_t>(std::atoi(argv[6]));
  const uint64_t first = std::strtoull(argv[7], nullptr, 10);
  const float lr = std::strtof(argv[8], nullptr), b1 = std::strtof(argv[9], nullptr);
  const float b2 = std::strtof(argv[10], nullptr), eps = std::strtof(argv[11], nullptr);
  const float wd = std::strtof(argv[12], nullptr), gscale = std::strtof(argv[13], nullptr);
  size_t n = 0;
  std::ifstream(dir + "/n.txt") >> n;
  if (!n) throw std::runtime_error(dir + "/n.txt: no element count");
  std::vector<DecayRange> ranges;
  {
    std::ifstream rf(dir + "/ranges.txt");
    size_t b, e;
    int d;
    while (rf >> b >> e >> d) ranges.push_back({b, e, d != 0});
  }
  const std::vector<float> init = read_raw<float>(dir + "/master.f32", n);
  std::vector<uint16_t> hi(n);
  std::vector<int16_t> lo(n);
  std::vector<float> master = init;
  for (size_t i = 0; i < n; ++i) {
    hi[i] = math::split_hi(init[i]);
    lo[i] = math::split_lo(init[i]);
  }
  const size_t eb = moment_elem_bytes(f.moments), nb = state_blocks(n);
  std::vector<uint8_t> m = read_raw<uint8_t>(dir + "/m.in", eb * n, true),
                       v = read_raw<uint8_t>(dir + "/v.in", eb * n, true);
  if (m.empty()) m.assign(eb * n, 0);
  if (v.empty()) v.assign(eb * n, 0);
  std::vector<float> ms = read_raw<float>(dir + "/m_scale.in", nb, true),
                     vs = read_raw<float>(dir + "/v_scale.in", nb, true);
  if (ms.empty()) ms.assign(nb, 0.0f);
  if (vs.empty()) vs.assign(nb, 0.0f);
  for (int t = 1; t <= steps; ++t) {
    const std::vector<float> g = read_raw<float>(dir + "/grad." + std::to_string(t) + ".f32", n);
    PackedAdamWArgs a;
    a.format = f;
    a.master = f.master == MasterFormat::kSplit ? static_cast<void*>(lo.data()) : master.data();
    a.m = m.data();
    a.v = v.data();
    a.m_scale = ms.data();
    a.v_scale = vs.data();
    a.grad = g.data();
    a.grad_type = ElemType::kF32;
    a.lowp = hi.data();
    a.lowp_type = ElemType::kBF16;
    a.n = n;
    a.first = first;
    a.grad_scale = gscale;
    a.key = math::round_key(group, t);
    a.ranges = ranges.data();
    a.nranges = ranges.size();
    adamw_update_packed(a, AdamWStep{lr, b1, b2, eps, wd, t}, path);
  }
  write_raw(dir + "/hi.u16", hi);
  if (f.master == MasterFormat::kSplit)
    write_raw(dir + "/master.out", lo);
  else
    write_raw(dir + "/master.out", master);
  write_raw(dir + "/m.out", m);
  write_raw(dir + "/v.out", v);
  write_raw(dir + "/m_scale.out", ms);
  write_raw(dir + "/v_scale.out", vs);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "optim_state_tool: %s\n", e.what());
    return 1;
  }
}
