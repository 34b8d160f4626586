// Low-precision GEMM inputs on the CPU. bf16: the fp32 operands are rounded to bf16 into scratch
// buffers, then a oneDNN matmul primitive (bf16 in, fp32 accumulate and out) multiplies them.
// oneDNN 2.6 has bf16 matmuls only on AVX-512 CPUs; elsewhere (AVX2) the operands are rounded to
// bf16 values held in fp32 and the fp32 GEMM multiplies them: a product of two bf16 values has at
// most 16 significant bits, exact in fp32, so the result is the same product up to the
// accumulation order, at fp32 speed (bf16_gemm_native() tells which path runs). oneDNN 2.6
// ignores the fp32 "fpmath bf16" attribute on this CPU (measured: bit-identical to fp32), so
// the rounding is explicit; it costs one read of each operand, small next to the product on
// the transformer's shapes. Primitives are created once per shape and cached, so after the
// first step nothing is created or allocated. The model's projections come through
// matmul_forward_bf16 / matmul_backward_bf16, which spend fewer passes over memory than
// generic GEMM calls would: the bias is the primitive's bias argument (no copy of it into
// the output first), and the backward rounds the output gradient once for both of its GEMMs
// in the same pass that sums it into the bias gradient.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <dnnl.hpp>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "fuyou/error.h"
#include "kernels/common/element_math.h"
#include "kernels/cpu/clones.h"
#include "kernels/cpu/gemm.h"

namespace fuyou::cpu {
namespace {

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

// Dense bf16 copy of the first `cols` columns of rows [r0, r1) of src (row stride ld), and
// when sums is given, sums[c - c0] += src[r][c] for columns [c0, c1) of those rows, summed
// row by row in order (the order of the fp32 bias-gradient loop it replaces).
FY_CLONES void round_cols_sum(uint16_t* dst, float* sums, const float* src, int r0, int r1, int c0,
                              int c1, int cols, int ld) {
  for (int r = r0; r < r1; ++r) {
    const float* s = src + static_cast<size_t>(r) * ld;
    uint16_t* d = dst + static_cast<size_t>(r) * cols;
#pragma omp simd
    for (int c = c0; c < c1; ++c) {
      d[c] = math::float_to_bf16(s[c]);
      if (sums) sums[c - c0] += s[c];
    }
  }
}

// Each thread of a parallel region calls body(c0, c1, sums) for its own column range [c0, c1)
// of `cols` (multiples of 32: 32 bf16 columns are one 64-byte line, so threads never write the
// same line), with `sums` a zeroed scratch of c1 - c0 floats (none without `with_sums`).
template <class Body>
void for_column_ranges(int cols, bool with_sums, Body body) {
#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int blocks = (cols + 31) / 32;
    const int c0 = std::min(cols, 32 * static_cast<int>(static_cast<int64_t>(blocks) * id / nt));
    const int c1 =
        std::min(cols, 32 * static_cast<int>(static_cast<int64_t>(blocks) * (id + 1) / nt));
    if (c1 > c0) {
      static thread_local std::vector<float> sums;  // grows once, then is reused
      sums.assign(with_sums ? c1 - c0 : 0, 0.0f);
      body(c0, c1, with_sums ? sums.data() : nullptr);
    }
  }
}

// dst(rows, cols) dense bf16 <- src (row stride ld); with dbias, also dbias[c] += the column
// sums of src. Threads own column ranges and stream the rows in order, so each column's sum
// is the sequential one and one read of src serves both.
void round_with_column_sums(uint16_t* dst, float* dbias, const float* src, int rows, int cols,
                            int ld) {
  for_column_ranges(cols, dbias != nullptr, [&](int c0, int c1, float* sums) {
    round_cols_sum(dst, sums, src, 0, rows, c0, c1, cols, ld);
    if (dbias)
      for (int c = c0; c < c1; ++c) dbias[c] += sums[c - c0];
  });
}

// dbias[c] += the column sums of bf16 src(rows, cols), each summed row by row in fp32 (the
// order of round_with_column_sums on the same values). Threads own column ranges.
void bf16_column_sums(float* dbias, const uint16_t* src, int rows, int cols) {
  for_column_ranges(cols, true, [&](int c0, int c1, float* sums) {
    for (int r = 0; r < rows; ++r) {
      const uint16_t* s = src + static_cast<size_t>(r) * cols;
      for (int col = c0; col < c1; ++col) sums[col - c0] += math::bf16_to_float(s[col]);
    }
    for (int col = c0; col < c1; ++col) dbias[col] += sums[col - c0];
  });
}

// operand type, transposes, shape, lda, ldb, ldc, accumulate into C, bias
using Key = std::tuple<int, bool, bool, int, int, int, int, int, int, bool, bool>;

struct Cache {
  std::mutex mu;
  int native = -1;  // bf16 matmul primitives available: -1 not yet known
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{eng};  // one for every call: calls are serialised by `mu`
  std::map<Key, dnnl::matmul> prims;
  std::vector<uint16_t> a, b, d;  // rounded operands; grow to the largest shape, then stay
  std::vector<float> fa, fb;  // fp16- or bf16-rounded operands held as fp32 (gemm_fp16, fallback)
};

Cache& cache() {
  static Cache c;
  return c;
}

template <class T>
T* scratch(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// dst(rows, cols) dense fp32 <- src (row stride ld) rounded to bf16 or fp16 values (fp16:
// nearest even, overflow to inf as on a GPU).
FY_CLONES void round_rows_f32(float* dst, const float* src, int rows, int cols, int ld, bool bf16) {
#pragma omp parallel for schedule(static)
  for (int r = 0; r < rows; ++r) {
    const float* s = src + static_cast<size_t>(r) * ld;
    float* d = dst + static_cast<size_t>(r) * cols;
    if (bf16) {
#pragma omp simd
      for (int c = 0; c < cols; ++c) d[c] = math::bf16_to_float(math::float_to_bf16(s[c]));
    } else {
      for (int c = 0; c < cols; ++c) d[c] = math::fp16_to_float(math::float_to_fp16(s[c]));
    }
  }
}

bool forced_fallback = false;  // set_bf16_gemm_fallback (tests)

// C(M,N) = op(A) op(B) (+ bias row) (+ C when accumulate), A and B of type `type` with row
// strides lda, ldb as stored (op(A) = A^T means A is (K, M) in memory); the transposes are
// strides, so they cost nothing. Caller holds c.mu.
void run_matmul(Cache& c, dnnl::memory::data_type type, bool trans_a, bool trans_b, int M, int N,
                int K, const void* A, int lda, const void* B, int ldb, const float* bias,
                bool accumulate, float* C, int ldc) {
  using dt = dnnl::memory::data_type;
  using dims = dnnl::memory::dims;
  dims a_strides = trans_a ? dims{1, lda} : dims{lda, 1};
  dims b_strides = trans_b ? dims{1, ldb} : dims{ldb, 1};
  dnnl::memory::desc a_md({M, K}, type, a_strides);
  dnnl::memory::desc b_md({K, N}, type, b_strides);
  dnnl::memory::desc c_md({M, N}, dt::f32, dims{ldc, 1});
  dnnl::memory::desc bias_md({1, N}, dt::f32, dims{N, 1});
  Key key{static_cast<int>(type), trans_a, trans_b, M, N, K, lda, ldb, ldc, accumulate,
          bias != nullptr};
  auto it = c.prims.find(key);
  if (it == c.prims.end()) {
    dnnl::primitive_attr attr;
    if (accumulate) {
      dnnl::post_ops po;
      po.append_sum(1.0f);
      attr.set_post_ops(po);
    }
    auto d =
        bias ? dnnl::matmul::desc(a_md, b_md, bias_md, c_md) : dnnl::matmul::desc(a_md, b_md, c_md);
    dnnl::matmul::primitive_desc pd(d, attr, c.eng);
    it = c.prims.emplace(key, dnnl::matmul(pd)).first;
  }
  dnnl::memory am(a_md, c.eng, const_cast<void*>(A)), bm(b_md, c.eng, const_cast<void*>(B)),
      cm(c_md, c.eng, C);
  std::unordered_map<int, dnnl::memory> args{
      {DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
  if (bias) args.emplace(DNNL_ARG_BIAS, dnnl::memory(bias_md, c.eng, const_cast<float*>(bias)));
  it->second.execute(c.stream, args);
  c.stream.wait();
}

// The same on dense bf16 copies (row strides their widths).
void run_bf16(Cache& c, bool trans_a, bool trans_b, int M, int N, int K, const uint16_t* A,
              const uint16_t* B, const float* bias, bool accumulate, float* C, int ldc) {
  run_matmul(c, dnnl::memory::data_type::bf16, trans_a, trans_b, M, N, K, A, trans_a ? M : K, B,
             trans_b ? K : N, bias, accumulate, C, ldc);
}

// Whether oneDNN creates bf16 matmul primitives on this CPU; asked once. Caller holds c.mu.
bool native_bf16(Cache& c) {
  if (c.native < 0) {
    using dt = dnnl::memory::data_type;
    dnnl::memory::desc a({16, 16}, dt::bf16, dnnl::memory::dims{16, 1}),
        cd({16, 16}, dt::f32, dnnl::memory::dims{16, 1});
    try {
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, a, cd), c.eng);
      c.native = 1;
    } catch (const dnnl::error&) {
      c.native = 0;
    }
  }
  return c.native == 1 && !forced_fallback;
}

// The fallback's operands: op(X) of a GEMM rounded to bf16 values in fp32 scratch, dense
// as stored (rows x cols with row stride ld), so the caller keeps its transposes.
float* rounded_f32(std::vector<float>& v, const float* src, int rows, int cols, int ld,
                   bool bf16 = true) {
  float* d = scratch(v, static_cast<size_t>(rows) * cols);
  round_rows_f32(d, src, rows, cols, ld, bf16);
  return d;
}

}  // namespace

bool bf16_gemm_native() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return native_bf16(c);
}

void set_bf16_gemm_fallback(bool on) {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  forced_fallback = on;
}

void gemm_bf16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
               int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  if (M == 0 || N == 0) return;
  FY_CHECK(alpha == 1.0f && (beta == 0.0f || beta == 1.0f),
           "gemm_bf16 supports alpha 1, beta 0|1; got ", alpha, ", ", beta);
  Cache& c = cache();
  // One caller at a time: the scratch is shared. The model calls GEMMs from one thread;
  // the parallelism is inside.
  std::lock_guard<std::mutex> lock(c.mu);
  if (!native_bf16(c)) {
    const float* a = trans_a ? rounded_f32(c.fa, A, K, M, lda) : rounded_f32(c.fa, A, M, K, lda);
    const float* b = trans_b ? rounded_f32(c.fb, B, N, K, ldb) : rounded_f32(c.fb, B, K, N, ldb);
    gemm_f32(trans_a, trans_b, M, N, K, 1.0f, a, trans_a ? M : K, b, trans_b ? K : N, beta, C, ldc);
    return;
  }
  uint16_t* a = scratch(c.a, static_cast<size_t>(M) * K);
  uint16_t* b = scratch(c.b, static_cast<size_t>(K) * N);
  // Round the operands as stored: op(A) = A^T means A is (K, M) in memory.
  if (trans_a)
    round_rows(a, A, K, M, lda);
  else
    round_rows(a, A, M, K, lda);
  if (trans_b)
    round_rows(b, B, N, K, ldb);
  else
    round_rows(b, B, K, N, ldb);
  run_bf16(c, trans_a, trans_b, M, N, K, a, b, nullptr, beta != 0.0f, C, ldc);
}

namespace {

// The projections on bf16 operands (dense, row strides their widths). Caller holds c.mu and
// has checked native_bf16.
void forward_stored(Cache& c, float* out, const uint16_t* in, const uint16_t* w, const float* bias,
                    int N, int IC, int OC) {
  run_bf16(c, false, true, N, OC, IC, in, w, bias, false, out, OC);
}

void backward_stored(Cache& c, float* din, float* dw, const uint16_t* dout, const uint16_t* in,
                     const uint16_t* w, int N, int IC, int OC) {
  if (dw)  // dw first: din may alias in
    run_bf16(c, true, false, OC, IC, N, dout, in, nullptr, true, dw, IC);
  if (din) run_bf16(c, false, false, N, IC, OC, dout, w, nullptr, false, din, IC);
}

// The cache, locked, for a projection that needs oneDNN's bf16 matmul.
std::unique_lock<std::mutex> lock_native(Cache& c, const char* what) {
  std::unique_lock<std::mutex> lock(c.mu);
  FY_CHECK(native_bf16(c), what, " needs oneDNN's bf16 matmul; callers check bf16_gemm_native()");
  return lock;
}

}  // namespace

void matmul_forward_bf16(float* out, const float* in, const float* w, const float* bias, int N,
                         int IC, int OC) {
  if (N == 0 || OC == 0) return;
  Cache& c = cache();
  auto lock = lock_native(c, "matmul_forward_bf16");
  uint16_t* a = scratch(c.a, static_cast<size_t>(N) * IC);
  uint16_t* b = scratch(c.b, static_cast<size_t>(OC) * IC);
  round_rows(a, in, N, IC, IC);
  round_rows(b, w, OC, IC, IC);
  forward_stored(c, out, a, b, bias, N, IC, OC);
}

void matmul_backward_bf16(float* din, float* dw, float* dbias, const float* dout, const float* in,
                          const float* w, int N, int IC, int OC) {
  if (N == 0 || OC == 0) return;
  Cache& c = cache();
  auto lock = lock_native(c, "matmul_backward_bf16");
  uint16_t* d = scratch(c.d, static_cast<size_t>(N) * OC);
  round_with_column_sums(d, dbias, dout, N, OC, OC);
  uint16_t* b = din ? scratch(c.b, static_cast<size_t>(OC) * IC) : nullptr;
  if (din) round_rows(b, w, OC, IC, IC);
  uint16_t* a = scratch(c.a, static_cast<size_t>(N) * IC);
  round_rows(a, in, N, IC, IC);
  backward_stored(c, din, dw, d, a, b, N, IC, OC);
}

void matmul_forward_bf16_stored(float* out, const uint16_t* in, const uint16_t* w,
                                const float* bias, int N, int IC, int OC) {
  if (N == 0 || OC == 0) return;
  Cache& c = cache();
  auto lock = lock_native(c, "matmul_forward_bf16_stored");
  forward_stored(c, out, in, w, bias, N, IC, OC);
}

void matmul_backward_bf16_stored(float* din, float* dw, float* dbias, const uint16_t* dout,
                                 const uint16_t* in, const uint16_t* w, int N, int IC, int OC) {
  if (N == 0 || OC == 0) return;
  Cache& c = cache();
  auto lock = lock_native(c, "matmul_backward_bf16_stored");
  if (dbias) bf16_column_sums(dbias, dout, N, OC);
  backward_stored(c, din, dw, dout, in, w, N, IC, OC);
}

// fp16: this CPU has no fast fp16 arithmetic, so the operands are rounded to fp16 (nearest
// even, overflow to inf as on a GPU) and multiplied by the fp32 GEMM. A product of two fp16
// values has at most 22 significant bits, exact in fp32, so this computes what an fp16-input,
// fp32-accumulate GEMM computes, at fp32 speed: the CPU backend runs fp16 training (loss
// scaling included) to test it, not to be fast.
void gemm_fp16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
               int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  if (M == 0 || N == 0) return;
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  const int ra = trans_a ? K : M, ca = trans_a ? M : K, rb = trans_b ? N : K, cb = trans_b ? K : N;
  const float* a = rounded_f32(c.fa, A, ra, ca, lda, false);
  const float* b = rounded_f32(c.fb, B, rb, cb, ldb, false);
  gemm_f32(trans_a, trans_b, M, N, K, alpha, a, ca, b, cb, beta, C, ldc);
}

}  // namespace fuyou::cpu
