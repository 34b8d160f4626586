// CPU kernels the opt and llama families add: RMSNorm, rotary position embeddings, the
// repeated-head form of grouped-query attention, SwiGLU and ReLU. Each loops over the shared
// element math (kernels/common/element_math.h) so the CUDA backend computes the same thing.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/common/element_math.h"
#include "kernels/cpu/cpu_kernels.h"

namespace fuyou::cpu {

namespace {

void rmsnorm_row(float* o, float* rstd, const float* x, const float* w, float eps, int C) {
  math::StatAcc ss = 0;
  for (int c = 0; c < C; ++c) ss += static_cast<math::StatAcc>(x[c]) * x[c];
  float r = static_cast<float>(1.0 / std::sqrt(ss / C + eps));
  for (int c = 0; c < C; ++c) o[c] = math::rmsnorm_apply(x[c], r, w[c]);
  *rstd = r;
}

}  // namespace

void CpuKernels::rmsnorm_forward(float* out, float* rstd, const float* in, const float* w,
                                 float eps, int N, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const size_t row = static_cast<size_t>(n) * C;
    rmsnorm_row(out + row, rstd + n, in + row, w, eps, C);
  }
}

void CpuKernels::residual_rmsnorm_forward(float* res, float* out, float* rstd, const float* a,
                                          const float* b, const float* w, float eps, int N, int C,
                                          ElemType stored) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const size_t row = static_cast<size_t>(n) * C;
    residual_row(res + row, a + row, b + row, C, stored);
    rmsnorm_row(out + row, rstd + n, res + row, w, eps, C);
  }
}

void CpuKernels::rmsnorm_backward(float* din, float* dw, const float* dout, const float* in,
                                  const float* w, const float* rstd, int N, int C) {
  // dL/dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w and xhat = x * rstd; the
  // weight gradient is summed per thread, then reduced, so no two threads write one element.
  const int nt = threads_;
  std::vector<float> partial(static_cast<size_t>(nt) * C, 0.0f);
#pragma omp parallel num_threads(nt)
  {
    float* dw_acc = partial.data() + static_cast<size_t>(omp_get_thread_num()) * C;
#pragma omp for schedule(static)
    for (int n = 0; n < N; ++n) {
      const float* x = in + static_cast<size_t>(n) * C;
      const float* dy = dout + static_cast<size_t>(n) * C;
      float* dx = din + static_cast<size_t>(n) * C;
      float r = rstd[n];
      math::StatAcc gx = 0;
      for (int c = 0; c < C; ++c) gx += static_cast<math::StatAcc>(dy[c] * w[c]) * (x[c] * r);
      float gxm = static_cast<float>(gx / C);
      for (int c = 0; c < C; ++c) {
        float xhat = x[c] * r;
        dx[c] += (dy[c] * w[c] - xhat * gxm) * r;
        dw_acc[c] += dy[c] * xhat;
      }
    }
  }
#pragma omp parallel for schedule(static)
  for (int c = 0; c < C; ++c) {
    float s = 0;
    for (int t = 0; t < nt; ++t) s += partial[static_cast<size_t>(t) * C + c];
    dw[c] += s;
  }
}

// The q/k norm: span j of row n (QkNormSpans: Qwen3's heads, OLMo 2's projections) at
// n s.row() + s.offset(j); each is normalised as rmsnorm_row does.
void CpuKernels::qk_norm_forward(float* qkvc, float* saved, float* rstd, const float* qw,
                                 const float* kw, float eps, int N, const QkNormSpans& s) {
  const int spans = s.spans();
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    for (int j = 0; j < spans; ++j) {
      float* x = qkvc + static_cast<size_t>(n) * s.row() + s.offset(j);
      const int W = s.width(j);
      if (saved) std::copy(x, x + W, saved + static_cast<size_t>(n) * s.saved_row() + s.offset(j));
      rmsnorm_row(x, rstd + static_cast<size_t>(n) * spans + j, x, j < s.q_spans ? qw : kw, eps, W);
    }
  }
}

void CpuKernels::qk_norm_backward(float* dqkvc, float* dqw, float* dkw, const float* saved,
                                  const float* qw, const float* kw, const float* rstd, int N,
                                  const QkNormSpans& s) {
  // rmsnorm_backward's formula per span, the input gradient overwriting the output's; the
  // weight gradients (q's, then k's) summed per thread, then reduced.
  const int spans = s.spans(), nt = threads_;
  const size_t weights = static_cast<size_t>(s.q_width) + s.k_width;
  std::vector<float> partial(static_cast<size_t>(nt) * weights, 0.0f);
#pragma omp parallel num_threads(nt)
  {
    float* acc = partial.data() + static_cast<size_t>(omp_get_thread_num()) * weights;
#pragma omp for schedule(static)
    for (int n = 0; n < N; ++n) {
      for (int j = 0; j < spans; ++j) {
        const bool q = j < s.q_spans;
        const int W = s.width(j);
        const float* x = saved + static_cast<size_t>(n) * s.saved_row() + s.offset(j);
        float* d = dqkvc + static_cast<size_t>(n) * s.row() + s.offset(j);
        const float* w = q ? qw : kw;
        float* dw_acc = acc + (q ? 0 : s.q_width);
        const float r = rstd[static_cast<size_t>(n) * spans + j];
        math::StatAcc gx = 0;
        for (int c = 0; c < W; ++c) gx += static_cast<math::StatAcc>(d[c] * w[c]) * (x[c] * r);
        const float gxm = static_cast<float>(gx / W);
        for (int c = 0; c < W; ++c) {
          const float xhat = x[c] * r;
          dw_acc[c] += d[c] * xhat;
          d[c] = (d[c] * w[c] - xhat * gxm) * r;
        }
      }
    }
  }
  for (size_t c = 0; c < weights; ++c) {
    float sum = 0;
    for (int t = 0; t < nt; ++t) sum += partial[static_cast<size_t>(t) * weights + c];
    (c < static_cast<size_t>(s.q_width) ? dqw[c] : dkw[c - s.q_width]) += sum;
  }
}

namespace {

// Rotates the q and k heads of every row by +angle (sign 1) or -angle (sign -1).
// Row n is at position positions[n] (packed records), else pos0 + n % T.
void rope_apply(float* qkvc, int B, int T, int Hq, int Hkv, int D, const RopeTable& rope,
                float sign, const int32_t* positions, int pos0 = 0) {
  const int half = D / 2;
  const size_t row = static_cast<size_t>(Hq + 2 * Hkv) * D;
  const int N = B * T;
#pragma omp parallel
  {
    std::vector<float> cs(static_cast<size_t>(D));  // cos[0..half) | sin[0..half)
#pragma omp for schedule(static)
    for (int n = 0; n < N; ++n) {
      const int pos = positions ? positions[n] : pos0 + n % T;
      for (int i = 0; i < half; ++i) {
        float a = math::rope_angle(pos, rope.inv_freq[i]);
        cs[i] = cosf(a) * rope.scale;
        cs[half + i] = sign * (sinf(a) * rope.scale);
      }
      float* r = qkvc + n * row;
      // q heads then k heads are contiguous: Hq + Hkv heads of D values.
      for (int h = 0; h < Hq + Hkv; ++h) {
        float* x = r + static_cast<size_t>(h) * D;
        for (int i = 0; i < half; ++i) math::rope_rotate(x[i], x[half + i], cs[i], cs[half + i]);
      }
    }
  }
}

}  // namespace

void CpuKernels::rope_forward(float* qkvc, int B, int T, int Hq, int Hkv, int D,
                              const RopeTable& rope, const int32_t* pos) {
  rope_apply(qkvc, B, T, Hq, Hkv, D, rope, 1.0f, pos);
}

void CpuKernels::rope_forward_at(float* qkvc, int N, int pos0, int Hq, int Hkv, int D,
                                 const RopeTable& rope) {
  rope_apply(qkvc, 1, N, Hq, Hkv, D, rope, 1.0f, nullptr, pos0);
}

void CpuKernels::rope_backward(float* dqkvc, int B, int T, int Hq, int Hkv, int D,
                               const RopeTable& rope, const int32_t* pos) {
  rope_apply(dqkvc, B, T, Hq, Hkv, D, rope, -1.0f, pos);
}

void CpuKernels::repeat_kv_forward(float* qkv, const float* qkvc, int N, int Hq, int Hkv, int D) {
  const size_t C = static_cast<size_t>(Hq) * D, KV = static_cast<size_t>(Hkv) * D;
  const int G = Hq / Hkv;
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const float* src = qkvc + n * (C + 2 * KV);
    float* dst = qkv + n * 3 * C;
    std::copy(src, src + C, dst);
    for (int part = 1; part <= 2; ++part)  // k, then v
      for (int h = 0; h < Hq; ++h) {
        const float* s = src + C + (part - 1) * KV + static_cast<size_t>(h / G) * D;
        std::copy(s, s + D, dst + part * C + static_cast<size_t>(h) * D);
      }
  }
}

void CpuKernels::repeat_kv_backward(float* dqkvc, const float* dqkv, int N, int Hq, int Hkv,
                                    int D) {
  const size_t C = static_cast<size_t>(Hq) * D, KV = static_cast<size_t>(Hkv) * D;
  const int G = Hq / Hkv;
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const float* src = dqkv + n * 3 * C;
    float* dst = dqkvc + n * (C + 2 * KV);
    std::copy(src, src + C, dst);
    for (int part = 1; part <= 2; ++part)
      for (int j = 0; j < Hkv; ++j) {
        float* d = dst + C + (part - 1) * KV + static_cast<size_t>(j) * D;
        for (int k = 0; k < D; ++k) {
          float s = 0;
          for (int g = 0; g < G; ++g) s += src[part * C + static_cast<size_t>(j * G + g) * D + k];
          d[k] = s;
        }
      }
  }
}

void CpuKernels::swiglu_forward(float* out, const float* gu, int N, int F) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const float* g = gu + static_cast<size_t>(n) * 2 * F;
    const float* u = g + F;
    float* o = out + static_cast<size_t>(n) * F;
    for (int f = 0; f < F; ++f) o[f] = math::silu(g[f]) * u[f];
  }
}

void CpuKernels::swiglu_backward(float* dgu, const float* gu, const float* dout, int N, int F) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const float* g = gu + static_cast<size_t>(n) * 2 * F;
    const float* u = g + F;
    const float* dy = dout + static_cast<size_t>(n) * F;
    float* dg = dgu + static_cast<size_t>(n) * 2 * F;
    float* du = dg + F;
    for (int f = 0; f < F; ++f) {
      dg[f] = dy[f] * u[f] * math::silu_grad(g[f]);
      du[f] = dy[f] * math::silu(g[f]);
    }
  }
}

void CpuKernels::relu_forward(float* out, const float* in, size_t n) {
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) out[i] = math::relu(in[i]);
}

void CpuKernels::relu_backward(float* din, const float* in, const float* dout, size_t n) {
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) din[i] = dout[i] * math::relu_grad(in[i]);
}

}  // namespace fuyou::cpu
