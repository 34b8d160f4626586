// Low-precision GEMM inputs on the CPU. bf16: the fp32 operands are rounded to bf16 into scratch buffers, then a
// oneDNN matmul primitive (bf16 in, fp32 accumulate and out) multiplies them. oneDNN 2.6
// ignores the fp32 "fpmath bf16" attribute on this CPU (measured: bit-identical to fp32), so
// the rounding is explicit; it costs one read of each operand, small next to the product on
// the transformer's shapes. Primitives are created once per shape and cached, so after the
// first step nothing is created or allocated.
#include <dnnl.hpp>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "fuyou/error.h"
#include "kernels/common/element_math.h"
#include "kernels/cpu/gemm.h"

namespace fuyou::cpu {
namespace {

#define FY_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

// dst(rows, cols) dense <- src(rows, cols) with row stride ld, rounded to bf16.
FY_CLONES void round_rows(uint16_t* dst, const float* src, int rows, int cols, int ld) {
#pragma omp parallel for schedule(static)
  for (int r = 0; r < rows; ++r) {
    const float* s = src + static_cast<size_t>(r) * ld;
    uint16_t* d = dst + static_cast<size_t>(r) * cols;
#pragma omp simd
    for (int c = 0; c < cols; ++c) d[c] = math::float_to_bf16(s[c]);
  }
}

using Key = std::tuple<bool, bool, int, int, int, int, bool>;

struct Cache {
  std::mutex mu;
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{eng};  // one for every call: calls are serialised by `mu`
  std::map<Key, dnnl::matmul> prims;
  std::vector<uint16_t> a, b;  // rounded operands; grow to the largest shape, then stay
  std::vector<float> fa, fb;   // fp16-rounded operands held as fp32 (gemm_fp16)
};

Cache& cache() {
  static Cache c;
  return c;
}

}  // namespace

void gemm_bf16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
               int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  if (M == 0 || N == 0) return;
  FY_CHECK(alpha == 1.0f && (beta == 0.0f || beta == 1.0f), "gemm_bf16 supports alpha 1, beta 0|1; got ",
           alpha, ", ", beta);
  using dt = dnnl::memory::data_type;
  using dims = dnnl::memory::dims;
  Cache& c = cache();
  // One caller at a time: the scratch is shared. The model calls GEMMs from one thread;
  // the parallelism is inside.
  std::lock_guard<std::mutex> lock(c.mu);
  const size_t na = static_cast<size_t>(M) * K, nb = static_cast<size_t>(K) * N;
  if (c.a.size() < na) c.a.resize(na);
  if (c.b.size() < nb) c.b.resize(nb);
  // Round the operands as stored: op(A) = A^T means A is (K, M) in memory.
  if (trans_a) round_rows(c.a.data(), A, K, M, lda); else round_rows(c.a.data(), A, M, K, lda);
  if (trans_b) round_rows(c.b.data(), B, N, K, ldb); else round_rows(c.b.data(), B, K, N, ldb);
  // The dense bf16 copies are described with strides, so the transposes cost nothing.
  dims a_strides = trans_a ? dims{1, M} : dims{K, 1};
  dims b_strides = trans_b ? dims{1, K} : dims{N, 1};
  dnnl::memory::desc a_md({M, K}, dt::bf16, a_strides);
  dnnl::memory::desc b_md({K, N}, dt::bf16, b_strides);
  dnnl::memory::desc c_md({M, N}, dt::f32, dims{ldc, 1});
  Key key{trans_a, trans_b, M, N, K, ldc, beta != 0.0f};
  auto it = c.prims.find(key);
  if (it == c.prims.end()) {
    dnnl::primitive_attr attr;
    if (beta != 0.0f) {
      dnnl::post_ops po;
      po.append_sum(1.0f);
      attr.set_post_ops(po);
    }
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), attr, c.eng);
    it = c.prims.emplace(key, dnnl::matmul(pd)).first;
  }
  dnnl::memory am(a_md, c.eng, c.a.data()), bm(b_md, c.eng, c.b.data()),
      cm(c_md, c.eng, C);
  it->second.execute(c.stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  c.stream.wait();
}

// fp16: this CPU has no fast fp16 arithmetic, so the operands are rounded to fp16 (nearest
// even, overflow to inf as on a GPU) and multiplied by the fp32 GEMM. A product of two fp16
// values has at most 22 significant bits, exact in fp32, so this computes what an fp16-input,
// fp32-accumulate GEMM computes, at fp32 speed: the CPU backend runs fp16 training (loss
// scaling included) to test it, not to be fast.
FY_CLONES static void round_rows_fp16(float* dst, const float* src, int rows, int cols, int ld) {
#pragma omp parallel for schedule(static)
  for (int r = 0; r < rows; ++r) {
    const float* s = src + static_cast<size_t>(r) * ld;
    float* d = dst + static_cast<size_t>(r) * cols;
    for (int c = 0; c < cols; ++c) d[c] = math::fp16_to_float(math::float_to_fp16(s[c]));
  }
}

void gemm_fp16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
               int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  if (M == 0 || N == 0) return;
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  const size_t na = static_cast<size_t>(M) * K, nb = static_cast<size_t>(K) * N;
  if (c.fa.size() < na) c.fa.resize(na);
  if (c.fb.size() < nb) c.fb.resize(nb);
  const int ra = trans_a ? K : M, ca = trans_a ? M : K, rb = trans_b ? N : K, cb = trans_b ? K : N;
  round_rows_fp16(c.fa.data(), A, ra, ca, lda);
  round_rows_fp16(c.fb.data(), B, rb, cb, ldb);
  gemm_f32(trans_a, trans_b, M, N, K, alpha, c.fa.data(), ca, c.fb.data(), cb, beta, C, ldc);
}

}  // namespace fuyou::cpu
