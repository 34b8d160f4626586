// The optimizer on the device (Backend: the optimizer on the device): the gradient's fp32
// sums over micro-batches, its sum of squares and AdamW, for an in-memory model whose whole
// optimizer state fits the GPU. Each computes what the host optimizer computes, in the same
// order, so a step gives the same bits whichever side runs it:
// - AdamW is math::adamw_element per element (kernels/common/element_math.h), the host's
//   scalar reference; its explicit fused multiply-adds are the only ones (nvcc does not fuse a
//   division with an add, and the products it could fuse are passed to fmaf unrounded on both
//   sides).
// - the sum of squares follows kernels/common/grad_math.h: one thread per (block, lane)
//   adds its lane's squares in element order, each product and sum rounded (__dmul_rn,
//   __dadd_rn: no contraction), then one thread per group adds its blocks in order, then one
//   thread the groups in order.
#include <cstring>

#include "fuyou/error.h"
#include "kernels/common/element_math.h"
#include "kernels/common/grad_math.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_util.cuh"

namespace fuyou::cuda {
namespace {

template <typename G>
__global__ void accumulate_fp32_k(float* sum, const G* g, size_t n, bool first) {
  FY_GRID_LOOP(i, n) sum[i] = first ? ld(g[i]) : __fadd_rn(sum[i], ld(g[i]));
}

// A group of the sum of squares: its elements [offset, offset + n) and the index of its
// first block among all groups' blocks.
struct SquareGroup {
  unsigned long long offset, n, first_block;
};

// Thread t: lane t % kSumLanes of block t / kSumLanes (numbered over all groups).
template <typename G>
__global__ void square_lanes_k(double* lanes, const G* x, const SquareGroup* groups, int ngroups,
                               unsigned long long blocks) {
  const unsigned long long t = blockIdx.x * 1ull * blockDim.x + threadIdx.x;
  if (t >= blocks * math::kSumLanes) return;
  const unsigned long long block = t / math::kSumLanes;
  const int lane = static_cast<int>(t % math::kSumLanes);
  int lo_g = 0, hi_g = ngroups - 1;  // the last group whose first block is <= block
  while (lo_g < hi_g) {
    const int mid = (lo_g + hi_g + 1) / 2;
    if (groups[mid].first_block <= block)
      lo_g = mid;
    else
      hi_g = mid - 1;
  }
  const SquareGroup g = groups[lo_g];
  const unsigned long long lo = g.offset + (block - g.first_block) * math::kSumBlock;
  const unsigned long long end = g.offset + g.n,
                           hi = lo + math::kSumBlock < end ? lo + math::kSumBlock : end;
  double s = 0.0;
  for (unsigned long long i = lo + lane; i < hi; i += math::kSumLanes) {
    const double v = static_cast<double>(ld(x[i]));
    s = __dadd_rn(s, __dmul_rn(v, v));
  }
  lanes[t] = s;
}

// Thread g: group g's sum, its blocks' lanes combined and the blocks added in order.
__global__ void square_groups_k(double* group_sums, const double* lanes, const SquareGroup* groups,
                                int ngroups) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= ngroups) return;
  const unsigned long long blocks = math::sum_blocks(groups[g].n);
  double s = 0.0;
  for (unsigned long long b = 0; b < blocks; ++b) {
    const double bs = math::combine_lanes(lanes + (groups[g].first_block + b) * math::kSumLanes);
    s = b == 0 ? bs : __dadd_rn(s, bs);
  }
  group_sums[g] = s;
}

// One thread: the groups added in order.
__global__ void square_total_k(double* out, const double* group_sums, int ngroups) {
  double s = 0.0;
  for (int g = 0; g < ngroups; ++g) s = __dadd_rn(s, group_sums[g]);
  *out = s;
}

// One block per piece; the piece's elements strided over the block's threads.
template <typename G, typename L, bool kLowp>
__global__ void adamw_k(DeviceAdamW a, const AdamWPiece* pieces) {
  const AdamWPiece piece = pieces[blockIdx.x];
  math::AdamWConsts k{a.grad_scale,   piece.decay ? a.decay_on : a.decay_off,
                      a.one_minus_b1, a.b2,
                      a.one_minus_b2, a.bc2_sqrt,
                      a.eps,          a.neg_step};
  const G* grad = static_cast<const G*>(a.grad);
  L* lowp = static_cast<L*>(a.lowp);
  for (unsigned i = threadIdx.x; i < piece.n; i += blockDim.x) {
    const size_t e = piece.begin + i;
    float w = a.master[e], m = a.m[e], v = a.v[e];
    math::adamw_element(w, m, v, ld(grad[e]), k);
    a.master[e] = w;
    a.m[e] = m;
    a.v[e] = v;
    if (kLowp) lowp[e] = st<L>(w);
  }
}

}  // namespace

void CudaBackend::accumulate_fp32(float* sum, const void* g, ElemType type, size_t n, bool first) {
  if (!n) return;
  with_storage(type, [&](auto tag) {
    using G = typename decltype(tag)::type;
    FY_LAUNCH(accumulate_fp32_k<G>, elt_blocks(n), kEltThreads, sum, static_cast<const G*>(g), n,
              first);
  });
}

double CudaBackend::sum_squares(const void* x, ElemType type,
                                const std::vector<std::pair<size_t, size_t>>& groups) {
  if (groups.empty()) return 0.0;
  std::lock_guard<std::mutex> lock(squares_mu_);
  bind();
  // The groups' table and the lanes' buffer, made once per list of groups (squares_tables_).
  auto found = squares_tables_.find(groups);
  if (found == squares_tables_.end()) {
    if (squares_tables_.size() >= kMaxSquaresTables) {
      for (auto& [g, t] : squares_tables_) FY_CUDA(cudaFree(t.buf));  // waits for their kernels
      squares_tables_.clear();
    }
    std::vector<SquareGroup> table;
    unsigned long long blocks = 0;
    for (const auto& [offset, n] : groups) {
      table.push_back({offset, n, blocks});
      blocks += math::sum_blocks(n);
    }
    const size_t bytes = sizeof(SquareGroup) * table.size() +
                         sizeof(double) * (blocks * math::kSumLanes + table.size() + 1);
    SquaresTable t;
    t.blocks = blocks;
    FY_CUDA(cudaMalloc(reinterpret_cast<void**>(&t.buf), bytes));
    FY_CUDA(cudaMemcpy(t.buf, table.data(), sizeof(SquareGroup) * table.size(),
                       cudaMemcpyHostToDevice));
    found = squares_tables_.emplace(groups, t).first;
  }
  char* const squares_buf = found->second.buf;
  const unsigned long long square_blocks = found->second.blocks;
  const int ngroups = static_cast<int>(groups.size());
  const SquareGroup* table = reinterpret_cast<const SquareGroup*>(squares_buf);
  double* lanes = reinterpret_cast<double*>(squares_buf + sizeof(SquareGroup) * groups.size());
  double* group_sums = lanes + square_blocks * math::kSumLanes;
  double* total = group_sums + ngroups;
  const unsigned long long threads = square_blocks * math::kSumLanes;
  if (threads) {
    const unsigned grid = static_cast<unsigned>((threads + kEltThreads - 1) / kEltThreads);
    with_storage(type, [&](auto tag) {
      using G = typename decltype(tag)::type;
      FY_LAUNCH(square_lanes_k<G>, grid, kEltThreads, lanes, static_cast<const G*>(x), table,
                ngroups, square_blocks);
    });
  }
  FY_LAUNCH(square_groups_k, (ngroups + kEltThreads - 1) / kEltThreads, kEltThreads, group_sums,
            lanes, table, ngroups);
  FY_LAUNCH(square_total_k, 1, 1, total, group_sums, ngroups);
  double out = 0;
  FY_CUDA(cudaMemcpyAsync(&out, total, sizeof out, cudaMemcpyDeviceToHost, compute_));
  FY_CUDA(cudaStreamSynchronize(compute_));
  return out;
}

// Every span lies in the arena (one allocation): the spans are groups of it, one launch and
// one return to the host for all. A span outside it (memory of another owner) goes span by
// span.
double CudaBackend::sum_squares_spans(const std::vector<SquareSpan>& spans, ElemType type) {
  const size_t es = elem_type_size(type);
  const size_t capacity = arena_.capacity();
  std::vector<std::pair<size_t, size_t>> groups;
  for (const SquareSpan& sp : spans) {
    const char* p = static_cast<const char*>(sp.data);
    if (p < base_ || p + es * sp.n > base_ + capacity || (p - base_) % es != 0)
      return Backend::sum_squares_spans(spans, type);
    groups.push_back({static_cast<size_t>(p - base_) / es, sp.n});
  }
  return sum_squares(base_, type, groups);
}

void CudaBackend::adamw(const DeviceAdamW& a) {
  if (!a.count) return;
  FY_CHECK(a.count < (1ull << 31), "AdamW on the device: ", a.count, " pieces exceed one grid");
  with_storage(a.grad_type, [&](auto gtag) {
    using G = typename decltype(gtag)::type;
    if (!a.lowp) {
      FY_LAUNCH((adamw_k<G, float, false>), static_cast<unsigned>(a.count), kEltThreads, a,
                a.pieces);
      return;
    }
    with_storage(a.lowp_type, [&](auto ltag) {
      using L = typename decltype(ltag)::type;
      FY_LAUNCH((adamw_k<G, L, true>), static_cast<unsigned>(a.count), kEltThreads, a, a.pieces);
    });
  });
}

}  // namespace fuyou::cuda
