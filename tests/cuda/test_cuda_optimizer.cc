// The optimizer on the CUDA device (kernels/cuda/optimizer.cu) against the CPU's: AdamW, the
// gradient's sum of squares and its fp32 sums are the same bits; and the in-memory step with
// optimizer.placement device gives the host placement's losses, weights and moments bit for
// bit.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cuda_test_support.h"
#include "fuyou/backend_select.h"
#include "fuyou/config.h"
#include "fuyou/cuda.h"
#include "fuyou/error.h"
#include "fuyou/optim.h"
#include "fuyou/train.h"

using namespace fuyou;
using test::DeviceVec;

namespace {

// Index of the first element whose bits differ, or n; the distance in ulps there.
struct Diff {
  size_t first;
  int64_t ulps;
};
Diff first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    int32_t x, y;
    std::memcpy(&x, &a[i], 4);
    std::memcpy(&y, &b[i], 4);
    if (x != y) return {i, std::llabs(int64_t(x) - int64_t(y))};
  }
  return {a.size(), 0};
}

// Random values stored as `t` (16-bit ones rounded), as raw bytes.
std::vector<char> stored(const std::vector<float>& v, ElemType t) {
  std::vector<char> out(v.size() * elem_type_size(t));
  round_to(t, out.data(), v.data(), v.size());
  return out;
}

}  // namespace

TEST_CASE(
    "cuda AdamW, sum of squares (one buffer and spans) and fp32 sums equal the CPU's bit for bit",
    "[cuda][optimizer]") {
  auto gpu = make_cuda_backend(0, 256ull << 20);
  auto cpu = make_cpu_backend(2, 0);
  // Tensors of awkward sizes, decay on and off, one longer than a piece.
  const std::vector<size_t> sizes = {1, 33, 1000, kDeviceAdamWPiece + 17, 4096, 7};
  std::vector<AdamWPiece> pieces;
  std::vector<std::pair<size_t, size_t>> groups;
  size_t n = 0;
  for (size_t k = 0; k < sizes.size(); ++k) {
    for (size_t b = 0; b < sizes[k]; b += kDeviceAdamWPiece)
      pieces.push_back({n + b,
                        static_cast<uint32_t>(std::min<size_t>(kDeviceAdamWPiece, sizes[k] - b)),
                        static_cast<uint32_t>(k % 2)});
    groups.push_back({n, sizes[k]});
    n += sizes[k] + 16;  // padding between tensors, not updated
  }
  groups.push_back({0, n});  // one group of several blocks
  groups.push_back({n / 2, 0});
  for (ElemType gt : {ElemType::kF32, ElemType::kBF16, ElemType::kF16}) {
    for (int lowp = 0; lowp < 3; ++lowp) {
      const ElemType lt = lowp == 2 ? ElemType::kF16 : ElemType::kBF16;
      INFO("gradient " << elem_type_name(gt) << ", working weights "
                       << (lowp ? elem_type_name(lt) : "none"));
      const std::vector<float> p0 = test::random_normal(n, 1),
                               m0 = test::random_normal(n, 2, 1e-2f);
      std::vector<float> v0 = test::random_normal(n, 3, 1e-2f);
      for (float& x : v0) x = x * x;
      const std::vector<char> g =
          stored(test::random_normal(n, 4, gt == ElemType::kF16 ? 3.0f : 1e3f), gt);
      std::vector<float> result[2][3];
      std::vector<uint16_t> weights[2];
      double squares[2], spans[2];
      std::vector<float> sums[2];
      for (int side = 0; side < 2; ++side) {
        Backend& be = side ? *gpu : *cpu;
        DeviceVec<float> p(be, p0), m(be, m0), v(be, v0), sum(be, p0);
        DeviceVec<char> grad(be, g);
        DeviceVec<uint16_t> w(be, n);
        DeviceVec<AdamWPiece> table(be, pieces);
        squares[side] = be.sum_squares(grad.get(), gt, groups);
        // The same groups as separate buffers (the in-memory plan's norm over its gradient
        // slots): each group copied into an allocation of its own.
        {
          std::vector<std::unique_ptr<DeviceVec<char>>> parts;
          std::vector<SquareSpan> ss;
          const size_t es = elem_type_size(gt);
          for (const auto& [offset, count] : groups) {
            std::vector<char> bytes(g.begin() + es * offset, g.begin() + es * (offset + count));
            bytes.resize(std::max<size_t>(bytes.size(), es));  // an empty group: one element
            parts.push_back(std::make_unique<DeviceVec<char>>(be, bytes));
            ss.push_back({parts.back()->get(), count});
          }
          spans[side] = be.sum_squares_spans(ss, gt);
        }
        be.accumulate_fp32(sum.get(), grad.get(), gt, n, false);
        DeviceAdamW a;
        a.master = p.get();
        a.m = m.get();
        a.v = v.get();
        a.grad = grad.get();
        a.grad_type = gt;
        a.lowp = lowp ? w.get() : nullptr;
        a.lowp_type = lt;
        a.pieces = table.get();
        a.count = pieces.size();
        set_adamw_constants(&a, AdamWStep{3e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 5}, 0.1f, 0.25f);
        be.adamw(a);
        result[side][0] = p.host();
        result[side][1] = m.host();
        result[side][2] = v.host();
        weights[side] = w.host();
        sums[side] = sum.host();
      }
      CHECK(std::memcmp(&squares[0], &squares[1], sizeof(double)) == 0);
      CHECK(std::memcmp(&spans[0], &squares[0], sizeof(double)) == 0);
      CHECK(std::memcmp(&spans[1], &squares[1], sizeof(double)) == 0);
      INFO("sum of squares: cpu " << squares[0] << ", cuda " << squares[1]);
      for (int k = 0; k < 3; ++k) {
        const Diff d = first_difference(result[0][k], result[1][k]);
        INFO("state " << k << " (master, m, v): first difference at " << d.first << " of " << n
                      << ", " << d.ulps << " ulps");
        CHECK(d.first == n);
      }
      CHECK(weights[0] == weights[1]);
      CHECK(first_difference(sums[0], sums[1]).first == n);
    }
  }
}

TEST_CASE("cuda in-memory step: the optimizer on the device gives the host's bits",
          "[cuda][optimizer]") {
  for (const char* tensors : {"fp32", "bf16"})
    for (int accum : {1, 2}) {
      INFO(tensors << " tensors, " << accum << " micro-batches");
      std::vector<float> out[2][4];  // losses, master, m, v
      for (int dev = 0; dev < 2; ++dev) {
        Config cfg = parse_config(
            str("model: {n_layer: 2, n_head: 2, d_model: 64, d_ff: 160, vocab_size: 97, seq_len: "
                "32}\noptimizer: {lr: 1.0e-2, min_lr: 1.0e-3, grad_clip: 0.5, placement: ",
                dev ? "device" : "host",
                "}\nschedule: {steps: 20, warmup_steps: 2, micro_batch: 3, grad_accum: ", accum,
                "}\nruntime: {backend: cuda, seed: 5, device_tensors: ", tensors, "}\n"),
            "<test>");
        auto be = make_cuda_backend(0, 512ull << 20);
        apply_precision(*be, cfg.runtime);
        InMemoryStep r(cfg, *be);
        REQUIRE(r.optimizer_on_device() == (dev == 1));
        r.init_params();
        for (int s = 0; s < 4; ++s) {
          std::vector<std::vector<int32_t>> mb;
          std::vector<const int32_t*> ptrs;
          for (int k = 0; k < accum; ++k)
            mb.push_back(test::random_tokens(3 * 33, 97, 100 + s * accum + k));
          for (auto& x : mb) ptrs.push_back(x.data());
          out[dev][0].push_back(r.step(s, ptrs).loss);
        }
        out[dev][1] = r.master();
        const ParamLayout& layout = r.model().layout();
        for (int k = 2; k < 4; ++k) {
          out[dev][k].assign(layout.total, 0.0f);
          for (size_t g = 0; g < layout.groups.size(); ++g)
            r.read_state(static_cast<int>(g), k == 2 ? StateKind::kAdamM : StateKind::kAdamV,
                         [&](size_t b, const float* d, size_t c) {
                           std::copy(d, d + c, out[dev][k].begin() + layout.groups[g].offset + b);
                         });
        }
      }
      for (int k = 0; k < 4; ++k) {
        const Diff d = first_difference(out[0][k], out[1][k]);
        INFO("losses, master, m, v [" << k << "]: first difference at " << d.first << " of "
                                      << out[0][k].size() << ", " << d.ulps << " ulps");
        CHECK(d.first == out[0][k].size());
      }
    }
}
