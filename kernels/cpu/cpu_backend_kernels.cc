// The CPU backend's kernels on its stored tensors: CpuKernels' fp32 code through fp32 views
// (Stage), so that with bf16 storage every kernel reads bf16, computes in fp32 and rounds its
// results once. The embedding's are typed instead: their tables are (V, C) with V not among
// the arguments, and a view of the whole table would move it twice per call for B*T rows.
#include <omp.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "kernels/common/element_math.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/stage.h"

namespace fuyou::cpu {
namespace {

// The 16-bit element types' loads and stores.
struct Bf16 {
  static float load(uint16_t h) { return math::bf16_to_float(h); }
  static uint16_t store(float f) { return math::float_to_bf16(f); }
};
struct Fp16 {
  static float load(uint16_t h) { return math::fp16_to_float(h); }
  static uint16_t store(float f) { return math::float_to_fp16(f); }
};

// out row n = wte row tokens[n] (+ wpe row n % T), summed in fp32 and rounded once.
template <class E>
void embed_rows(uint16_t* out, const int32_t* tokens, const uint16_t* wte, const uint16_t* wpe,
                int B, int T, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < B * T; ++n) {
    const uint16_t* te = wte + static_cast<size_t>(tokens[n]) * C;
    const uint16_t* pe = wpe ? wpe + static_cast<size_t>(n % T) * C : nullptr;
    uint16_t* o = out + static_cast<size_t>(n) * C;
    for (int c = 0; c < C; ++c) o[c] = E::store(E::load(te[c]) + (pe ? E::load(pe[c]) : 0.0f));
  }
}

// 16-bit gradient tables: each row's gradient summed in fp32 over every position that adds
// to it (rows of one token, rows of one position), then added to the stored row with one
// rounding, as a GPU's 16-bit embedding backward does. Threads own column ranges.
template <class E>
void embed_rows_backward(uint16_t* dwte, uint16_t* dwpe, const uint16_t* dout,
                         const int32_t* tokens, int B, int T, int C) {
  const int N = B * T;
  std::vector<int> order(N);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return tokens[a] < tokens[b]; });
#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int c0 = static_cast<int>(static_cast<int64_t>(C) * id / nt);
    const int c1 = static_cast<int>(static_cast<int64_t>(C) * (id + 1) / nt);
    std::vector<float> acc(c1 - c0);
    auto flush = [&](uint16_t* row) {
      for (int c = c0; c < c1; ++c) row[c] = E::store(E::load(row[c]) + acc[c - c0]);
      std::fill(acc.begin(), acc.end(), 0.0f);
    };
    for (int i = 0; i < N; ++i) {
      const uint16_t* d = dout + static_cast<size_t>(order[i]) * C;
      for (int c = c0; c < c1; ++c) acc[c - c0] += E::load(d[c]);
      if (i + 1 == N || tokens[order[i + 1]] != tokens[order[i]])
        flush(dwte + static_cast<size_t>(tokens[order[i]]) * C);
    }
    for (int t = 0; dwpe && t < T; ++t) {
      for (int b = 0; b < B; ++b) {
        const uint16_t* d = dout + (static_cast<size_t>(b) * T + t) * C;
        for (int c = c0; c < c1; ++c) acc[c - c0] += E::load(d[c]);
      }
      flush(dwpe + static_cast<size_t>(t) * C);
    }
  }
}

}  // namespace

void CpuBackend::embedding_forward(void* out, const int32_t* tokens, const void* wte,
                                   const void* wpe, int B, int T, int C) {
  if (storage_ == ElemType::kF32)
    return k_.embedding_forward(static_cast<float*>(out), tokens, static_cast<const float*>(wte),
                                static_cast<const float*>(wpe), B, T, C);
  auto rows = storage_ == ElemType::kBF16 ? embed_rows<Bf16> : embed_rows<Fp16>;
  rows(static_cast<uint16_t*>(out), tokens, static_cast<const uint16_t*>(wte),
       static_cast<const uint16_t*>(wpe), B, T, C);
}

void CpuBackend::embedding_backward(void* dwte, void* dwpe, const void* dout, const int32_t* tokens,
                                    int B, int T, int C) {
  if (storage_ == ElemType::kF32)
    return k_.embedding_backward(static_cast<float*>(dwte), static_cast<float*>(dwpe),
                                 static_cast<const float*>(dout), tokens, B, T, C);
  auto rows = storage_ == ElemType::kBF16 ? embed_rows_backward<Bf16> : embed_rows_backward<Fp16>;
  rows(static_cast<uint16_t*>(dwte), static_cast<uint16_t*>(dwpe),
       static_cast<const uint16_t*>(dout), tokens, B, T, C);
}

void CpuBackend::layernorm_forward(void* out, float* mean, float* rstd, const void* in,
                                   const void* w, const void* b, int N, int C) {
  const size_t NC = static_cast<size_t>(N) * C;
  Stage s(storage_);
  k_.layernorm_forward(s.out(out, NC), mean, rstd, s.in(in, NC), s.in(w, C), s.in(b, C), N, C);
}

// a and b are widened before res (which may alias either) is written back.
void CpuBackend::residual_layernorm_forward(void* res, void* out, float* mean, float* rstd,
                                            const void* a, const void* b, const void* w,
                                            const void* bias, int N, int C) {
  const size_t NC = static_cast<size_t>(N) * C;
  Stage s(storage_);
  k_.residual_layernorm_forward(s.out(res, NC), s.out(out, NC), mean, rstd, s.in(a, NC),
                                s.in(b, NC), s.in(w, C), s.in(bias, C), N, C, storage_);
}

void CpuBackend::layernorm_backward(void* din, void* dw, void* db, const void* dout, const void* in,
                                    const void* w, const float* mean, const float* rstd, int N,
                                    int C) {
  const size_t NC = static_cast<size_t>(N) * C;
  Stage s(storage_);
  k_.layernorm_backward(s.acc(din, NC), s.acc(dw, C), s.acc(db, C), s.in(dout, NC), s.in(in, NC),
                        s.in(w, C), mean, rstd, N, C);
}

// bf16 tensors with bf16 GEMM inputs: oneDNN multiplies the stored operands as they are
// (widening them for the fp32 kernel, which rounds them back, would give the same bits at
// three more passes over each).
bool CpuBackend::bf16_operands() const {
  return storage_ == ElemType::kBF16 && k_.matmul_precision() == MatmulPrecision::kBf16 &&
         bf16_gemm_native();
}

void CpuBackend::matmul_forward(void* out, const void* in, const void* w, const void* bias, int N,
                                int IC, int OC) {
  Stage s(storage_);
  if (bf16_operands())
    return matmul_forward_bf16_stored(s.out(out, static_cast<size_t>(N) * OC),
                                      static_cast<const uint16_t*>(in),
                                      static_cast<const uint16_t*>(w), s.in(bias, OC), N, IC, OC);
  k_.matmul_forward(s.out(out, static_cast<size_t>(N) * OC), s.in(in, static_cast<size_t>(N) * IC),
                    s.in(w, static_cast<size_t>(OC) * IC), s.in(bias, OC), N, IC, OC);
}

void CpuBackend::matmul_backward(void* din, void* dw, void* dbias, const void* dout, const void* in,
                                 const void* w, int N, int IC, int OC) {
  const size_t NI = static_cast<size_t>(N) * IC, NO = static_cast<size_t>(N) * OC;
  const size_t W = static_cast<size_t>(OC) * IC;
  Stage s(storage_);
  if (bf16_operands())
    return matmul_backward_bf16_stored(
        s.out(din, NI), s.acc(dw, W), s.acc(dbias, OC), static_cast<const uint16_t*>(dout),
        static_cast<const uint16_t*>(in), static_cast<const uint16_t*>(w), N, IC, OC);
  k_.matmul_backward(s.out(din, NI), s.acc(dw, W), s.acc(dbias, OC), s.in(dout, NO), s.in(in, NI),
                     s.in(w, W), N, IC, OC);
}

// The CPU's attention keeps its block scratch per thread; the backend's scratch is unused.
void CpuBackend::attention_forward(void* out, float* lse, float*, const void* qkv, int B, int T,
                                   int C, int H, const int32_t* pos) {
  const size_t BT = static_cast<size_t>(B) * T;
  Stage s(storage_);
  k_.attention_forward(s.out(out, BT * C), lse, s.in(qkv, BT * 3 * C), B, T, C, H, pos);
}

void CpuBackend::attention_backward(void* dqkv, float*, const void* dout, const void*,
                                    const void* qkv, const float* lse, int B, int T, int C, int H,
                                    const int32_t* pos) {
  const size_t BT = static_cast<size_t>(B) * T;
  Stage s(storage_);
  k_.attention_backward(s.out(dqkv, BT * 3 * C), s.in(dout, BT * C), s.in(qkv, BT * 3 * C), lse, B,
                        T, C, H, pos);
}

void CpuBackend::gelu_forward(void* out, const void* in, size_t n) {
  Stage s(storage_);
  k_.gelu_forward(s.out(out, n), s.in(in, n), n);
}

void CpuBackend::gelu_backward(void* din, const void* in, const void* dout, size_t n) {
  Stage s(storage_);
  k_.gelu_backward(s.out(din, n), s.in(in, n), s.in(dout, n), n);
}

void CpuBackend::add(void* out, const void* a, const void* b, size_t n) {
  Stage s(storage_);
  k_.add(s.out(out, n), s.in(a, n), s.in(b, n), n);
}

void CpuBackend::crossentropy_forward(float* losses, float* lse, const void* logits,
                                      const int32_t* targets, int N, int V, int ld) {
  Stage s(storage_);
  k_.crossentropy_forward(losses, lse, s.in(logits, static_cast<size_t>(N) * ld), targets, N, V,
                          ld);
}

void CpuBackend::crossentropy_backward(void* logits_to_dlogits, const float* lse,
                                       const int32_t* targets, float scale, int N, int V, int ld) {
  Stage s(storage_);
  k_.crossentropy_backward(s.acc(logits_to_dlogits, static_cast<size_t>(N) * ld), lse, targets,
                           scale, N, V, ld);
}

void CpuBackend::crossentropy_forward_backward(float* losses, float* lse, void* logits_to_dlogits,
                                               const int32_t* targets, float scale, int N, int V,
                                               int ld) {
  Stage s(storage_);
  k_.crossentropy_forward_backward(
      losses, lse, s.acc(logits_to_dlogits, static_cast<size_t>(N) * ld), targets, scale, N, V, ld);
}

void CpuBackend::rmsnorm_forward(void* out, float* rstd, const void* in, const void* w, float eps,
                                 int N, int C) {
  const size_t NC = static_cast<size_t>(N) * C;
  Stage s(storage_);
  k_.rmsnorm_forward(s.out(out, NC), rstd, s.in(in, NC), s.in(w, C), eps, N, C);
}

void CpuBackend::residual_rmsnorm_forward(void* res, void* out, float* rstd, const void* a,
                                          const void* b, const void* w, float eps, int N, int C) {
  const size_t NC = static_cast<size_t>(N) * C;
  Stage s(storage_);
  k_.residual_rmsnorm_forward(s.out(res, NC), s.out(out, NC), rstd, s.in(a, NC), s.in(b, NC),
                              s.in(w, C), eps, N, C, storage_);
}

void CpuBackend::rmsnorm_backward(void* din, void* dw, const void* dout, const void* in,
                                  const void* w, const float* rstd, int N, int C) {
  const size_t NC = static_cast<size_t>(N) * C;
  Stage s(storage_);
  k_.rmsnorm_backward(s.acc(din, NC), s.acc(dw, C), s.in(dout, NC), s.in(in, NC), s.in(w, C), rstd,
                      N, C);
}

void CpuBackend::rope_forward(void* qkvc, int B, int T, int Hq, int Hkv, int D,
                              const RopeTable& rope, const int32_t* pos) {
  Stage s(storage_);
  k_.rope_forward(s.acc(qkvc, static_cast<size_t>(B) * T * (Hq + 2 * Hkv) * D), B, T, Hq, Hkv, D,
                  rope, pos);
}

void CpuBackend::rope_backward(void* dqkvc, int B, int T, int Hq, int Hkv, int D,
                               const RopeTable& rope, const int32_t* pos) {
  Stage s(storage_);
  k_.rope_backward(s.acc(dqkvc, static_cast<size_t>(B) * T * (Hq + 2 * Hkv) * D), B, T, Hq, Hkv, D,
                   rope, pos);
}

void CpuBackend::qk_norm_forward(void* qkvc, void* saved, float* rstd, const void* qw,
                                 const void* kw, float eps, int N, const QkNormSpans& sp) {
  Stage s(storage_);
  const size_t rows = static_cast<size_t>(N);
  k_.qk_norm_forward(s.acc(qkvc, rows * sp.row()), s.out(saved, rows * sp.saved_row()), rstd,
                     s.in(qw, sp.q_width), s.in(kw, sp.k_width), eps, N, sp);
}

void CpuBackend::qk_norm_backward(void* dqkvc, void* dqw, void* dkw, const void* saved,
                                  const void* qw, const void* kw, const float* rstd, int N,
                                  const QkNormSpans& sp) {
  Stage s(storage_);
  const size_t rows = static_cast<size_t>(N);
  k_.qk_norm_backward(s.acc(dqkvc, rows * sp.row()), s.acc(dqw, sp.q_width), s.acc(dkw, sp.k_width),
                      s.in(saved, rows * sp.saved_row()), s.in(qw, sp.q_width),
                      s.in(kw, sp.k_width), rstd, N, sp);
}

void CpuBackend::repeat_kv_forward(void* qkv, const void* qkvc, int N, int Hq, int Hkv, int D) {
  Stage s(storage_);
  k_.repeat_kv_forward(s.out(qkv, static_cast<size_t>(N) * 3 * Hq * D),
                       s.in(qkvc, static_cast<size_t>(N) * (Hq + 2 * Hkv) * D), N, Hq, Hkv, D);
}

void CpuBackend::repeat_kv_backward(void* dqkvc, const void* dqkv, int N, int Hq, int Hkv, int D) {
  Stage s(storage_);
  k_.repeat_kv_backward(s.out(dqkvc, static_cast<size_t>(N) * (Hq + 2 * Hkv) * D),
                        s.in(dqkv, static_cast<size_t>(N) * 3 * Hq * D), N, Hq, Hkv, D);
}

void CpuBackend::swiglu_forward(void* out, const void* gu, int N, int F) {
  const size_t NF = static_cast<size_t>(N) * F;
  Stage s(storage_);
  k_.swiglu_forward(s.out(out, NF), s.in(gu, 2 * NF), N, F);
}

void CpuBackend::swiglu_backward(void* dgu, const void* gu, const void* dout, int N, int F) {
  const size_t NF = static_cast<size_t>(N) * F;
  Stage s(storage_);
  k_.swiglu_backward(s.out(dgu, 2 * NF), s.in(gu, 2 * NF), s.in(dout, NF), N, F);
}

void CpuBackend::relu_forward(void* out, const void* in, size_t n) {
  Stage s(storage_);
  k_.relu_forward(s.out(out, n), s.in(in, n), n);
}

void CpuBackend::relu_backward(void* din, const void* in, const void* dout, size_t n) {
  Stage s(storage_);
  k_.relu_backward(s.out(din, n), s.in(in, n), s.in(dout, n), n);
}

}  // namespace fuyou::cpu
