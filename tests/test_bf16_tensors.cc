// bf16 device tensors on the CPU backend (runtime.device_tensors: bf16): every kernel reads
// bf16, computes as the fp32 kernel does and rounds each stored result once; a model with
// bf16 tensors stays within bf16 rounding of the fp32 model; training keeps fp32 master
// weights and writes the device's bf16 weights in the update's own pass.
#include <omp.h>

#include <algorithm>
#include <array>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/backend_select.h"
#include "fuyou/config.h"
#include "fuyou/cuda.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/hardware.h"
#include "fuyou/model.h"
#include "fuyou/plan.h"
#include "fuyou/rng.h"
#include "fuyou/safetensors.h"
#include "fuyou/scheduler.h"
#include "fuyou/simulator.h"
#include "fuyou/threads.h"
#include "fuyou/train.h"
#include "kernels/common/element_math.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/stage.h"
#include "reference_fixture.h"
#include "storage_values.h"
#include "test_support.h"

using namespace fuyou;

namespace {

using test::kBf16U;  // bf16's unit roundoff, 2^-8 (reference_fixture.h)
using test::rnd16;
using test::unit_roundoff;
using test::wid16;

// The 16-bit type the kernel checks below store (each test case sets it).
ElemType g_type = ElemType::kBF16;

// One tensor in both storage types: 16-bit values (random) and the same values in fp32.
struct Pair {
  std::vector<uint16_t> h;
  std::vector<float> f;
  Pair(size_t n, Rng& rng, float scale = 1.0f) : h(n), f(n) {
    for (size_t i = 0; i < n; ++i) {
      h[i] = rnd16(g_type, scale * rng.normal());
      f[i] = wid16(g_type, h[i]);
    }
  }
};

// Runs `call` on an fp32 backend with the fp32 tensors and on a bf16 backend with the bf16
// ones (the same values), then checks that every bf16 tensor equals its fp32 result rounded
// once, bit for bit: a kernel that read an input as the wrong type, sized a view short, or
// treated an accumulator as an output (or the reverse) fails here.
void check_kernel(const char* what, std::vector<Pair*> tensors,
                  const std::function<void(Backend&, std::vector<void*>&)>& call,
                  MatmulPrecision gemm = MatmulPrecision::kFp32) {
  INFO("kernel " << what << ", GEMM inputs " << matmul_precision_name(gemm));
  auto b32 = make_cpu_backend(2, 0);
  auto b16 = make_cpu_backend(2, 0);
  b16->set_storage_type(g_type);
  b32->set_matmul_precision(gemm);
  b16->set_matmul_precision(gemm);
  std::vector<void*> p32, p16;
  for (Pair* t : tensors) {
    p32.push_back(t->f.data());
    p16.push_back(t->h.data());
  }
  call(*b32, p32);
  call(*b16, p16);
  size_t mismatches = 0;
  for (size_t k = 0; k < tensors.size(); ++k)
    for (size_t i = 0; i < tensors[k]->f.size(); ++i)
      mismatches += rnd16(g_type, tensors[k]->f[i]) != tensors[k]->h[i];
  CHECK(mismatches == 0);
  // The next kernel starts from the stored values on both sides.
  for (Pair* t : tensors)
    for (size_t i = 0; i < t->f.size(); ++i) t->f[i] = wid16(g_type, t->h[i]);
}

}  // namespace

TEST_CASE("every CPU kernel on 16-bit tensors is the fp32 kernel rounded once", "[bf16]") {
  g_type = GENERATE(ElemType::kBF16, ElemType::kF16);
  INFO("device tensors " << elem_type_name(g_type));
  Rng rng(41);
  // T spans two attention row blocks (64 rows each); N * F passes the conversions' parallel
  // threshold.
  const int B = 2, T = 80, C = 32, H = 4, F = 256, V = 40, N = B * T;
  const size_t NC = static_cast<size_t>(N) * C;
  std::vector<float> mean(N), rstd(N), mean2(N), rstd2(N), losses(N), lse(N);
  std::vector<int32_t> targets(N);
  for (int n = 0; n < N; ++n)
    targets[n] = n % 7 == 3 ? kIgnoreTarget : static_cast<int32_t>(rng.below(V));
  {
    Pair out(NC, rng), in(NC, rng), w(C, rng), b(C, rng);
    check_kernel("layernorm_forward", {&out, &in, &w, &b}, [&](Backend& be, std::vector<void*>& p) {
      be.layernorm_forward(p[0], mean.data(), rstd.data(), p[1], p[2], p[3], N, C);
    });
    Pair din(NC, rng), dw(C, rng), db(C, rng), dout(NC, rng);
    check_kernel("layernorm_backward", {&din, &dw, &db, &dout, &in, &w},
                 [&](Backend& be, std::vector<void*>& p) {
                   be.layernorm_backward(p[0], p[1], p[2], p[3], p[4], p[5], mean.data(),
                                         rstd.data(), N, C);
                 });
    check_kernel("rmsnorm_forward", {&out, &in, &w}, [&](Backend& be, std::vector<void*>& p) {
      be.rmsnorm_forward(p[0], rstd2.data(), p[1], p[2], 1e-5f, N, C);
    });
    check_kernel("rmsnorm_backward", {&din, &dw, &dout, &in, &w},
                 [&](Backend& be, std::vector<void*>& p) {
                   be.rmsnorm_backward(p[0], p[1], p[2], p[3], p[4], rstd2.data(), N, C);
                 });
  }
  {
    Pair out(static_cast<size_t>(N) * F, rng), in(NC, rng),
        w(static_cast<size_t>(F) * C, rng, 0.2f), bias(F, rng);
    check_kernel("matmul_forward", {&out, &in, &w, &bias}, [&](Backend& be, std::vector<void*>& p) {
      be.matmul_forward(p[0], p[1], p[2], p[3], N, C, F);
    });
    Pair din(NC, rng), dw(static_cast<size_t>(F) * C, rng), dbias(F, rng);
    check_kernel("matmul_backward", {&din, &dw, &dbias, &out, &in, &w},
                 [&](Backend& be, std::vector<void*>& p) {
                   be.matmul_backward(p[0], p[1], p[2], p[3], p[4], p[5], N, C, F);
                 });
    // bf16 GEMM inputs too: with bf16 tensors oneDNN multiplies the stored operands directly
    // (on AVX-512 CPUs; elsewhere the fp32 GEMM on the same values), the same bits.
    if (!cpu::bf16_gemm_native())
      WARN("no oneDNN bf16 matmul on this CPU: only the fp32 fallback path runs here");
    for (bool fallback : {false, true}) {
      if (g_type != ElemType::kBF16) break;  // bf16 GEMM inputs on bf16 tensors only
      cpu::set_bf16_gemm_fallback(fallback);
      INFO("fp32 fallback forced " << fallback);
      check_kernel(
          "matmul_forward", {&out, &in, &w, &bias},
          [&](Backend& be, std::vector<void*>& p) {
            be.matmul_forward(p[0], p[1], p[2], p[3], N, C, F);
          },
          MatmulPrecision::kBf16);
      check_kernel(
          "matmul_backward", {&din, &dw, &dbias, &out, &in, &w},
          [&](Backend& be, std::vector<void*>& p) {
            be.matmul_backward(p[0], p[1], p[2], p[3], p[4], p[5], N, C, F);
          },
          MatmulPrecision::kBf16);
      check_kernel(
          "matmul_backward (no din, no bias)", {&dw, &out, &in, &w},
          [&](Backend& be, std::vector<void*>& p) {
            be.matmul_backward(nullptr, p[0], nullptr, p[1], p[2], p[3], N, C, F);
          },
          MatmulPrecision::kBf16);
    }
    cpu::set_bf16_gemm_fallback(false);
    Pair o2(static_cast<size_t>(N) * F, rng), o3(static_cast<size_t>(N) * F, rng);
    const size_t NF = static_cast<size_t>(N) * F;
    check_kernel("gelu_forward", {&o2, &out},
                 [&](Backend& be, std::vector<void*>& p) { be.gelu_forward(p[0], p[1], NF); });
    check_kernel("gelu_backward", {&o3, &out, &o2}, [&](Backend& be, std::vector<void*>& p) {
      be.gelu_backward(p[0], p[1], p[2], NF);
    });
    check_kernel("gelu_backward (aliased)", {&o3, &out}, [&](Backend& be, std::vector<void*>& p) {
      be.gelu_backward(p[0], p[1], p[0], NF);
    });
    check_kernel("relu_forward", {&o2, &out},
                 [&](Backend& be, std::vector<void*>& p) { be.relu_forward(p[0], p[1], NF); });
    check_kernel("relu_backward", {&o3, &out, &o2}, [&](Backend& be, std::vector<void*>& p) {
      be.relu_backward(p[0], p[1], p[2], NF);
    });
    check_kernel("add (aliased)", {&o2, &o3}, [&](Backend& be, std::vector<void*>& p) {
      be.add(p[0], p[0], p[1], static_cast<size_t>(N) * F);
    });
  }
  {
    // lse is fp32 either way, from the same values: both calls write the same numbers.
    Pair qkv(NC * 3, rng), out(NC, rng);
    std::vector<float> lse(static_cast<size_t>(B) * H * T), scratch(2 * T * T);
    check_kernel("attention_forward", {&out, &qkv}, [&](Backend& be, std::vector<void*>& p) {
      be.attention_forward(p[0], lse.data(), scratch.data(), p[1], B, T, C, H, nullptr);
    });
    Pair dqkv(NC * 3, rng), dout(NC, rng);
    check_kernel("attention_backward", {&dqkv, &dout, &qkv},
                 [&](Backend& be, std::vector<void*>& p) {
                   be.attention_backward(p[0], scratch.data(), p[1], nullptr, p[2], lse.data(), B,
                                         T, C, H, nullptr);
                 });
  }
  {
    Pair logits(static_cast<size_t>(N) * V, rng, 3.0f);
    check_kernel("crossentropy", {&logits}, [&](Backend& be, std::vector<void*>& p) {
      be.crossentropy_forward(losses.data(), lse.data(), p[0], targets.data(), N, V, V);
      be.crossentropy_backward(p[0], lse.data(), targets.data(), 1.0f / N, N, V, V);
    });
  }
  {
    // Grouped-query attention pieces and SwiGLU (llama): Hq = 4, Hkv = 2, D = 8.
    const int Hq = 4, Hkv = 2, D = 8;
    const size_t cw = static_cast<size_t>(Hq + 2 * Hkv) * D;
    Pair qkvc(N * cw, rng), qkv(static_cast<size_t>(N) * 3 * Hq * D, rng), dqkvc(N * cw, rng);
    check_kernel("rope_forward", {&qkvc}, [&](Backend& be, std::vector<void*>& p) {
      be.rope_forward(p[0], B, T, Hq, Hkv, D, default_rope_table(D, 10000.0f), nullptr);
    });
    check_kernel("repeat_kv_forward", {&qkv, &qkvc}, [&](Backend& be, std::vector<void*>& p) {
      be.repeat_kv_forward(p[0], p[1], N, Hq, Hkv, D);
    });
    check_kernel("repeat_kv_backward", {&dqkvc, &qkv}, [&](Backend& be, std::vector<void*>& p) {
      be.repeat_kv_backward(p[0], p[1], N, Hq, Hkv, D);
    });
    check_kernel("rope_backward", {&dqkvc}, [&](Backend& be, std::vector<void*>& p) {
      be.rope_backward(p[0], B, T, Hq, Hkv, D, default_rope_table(D, 10000.0f), nullptr);
    });
    Pair gu(static_cast<size_t>(N) * 2 * F, rng), out(static_cast<size_t>(N) * F, rng),
        dgu(static_cast<size_t>(N) * 2 * F, rng);
    check_kernel("swiglu_forward", {&out, &gu},
                 [&](Backend& be, std::vector<void*>& p) { be.swiglu_forward(p[0], p[1], N, F); });
    check_kernel("swiglu_backward", {&dgu, &gu, &out}, [&](Backend& be, std::vector<void*>& p) {
      be.swiglu_backward(p[0], p[1], p[2], N, F);
    });
  }
  {
    // The embedding: the forward is one fp32 sum rounded once; the backward sums each row's
    // contributions in fp32 and rounds once, so it is within one rounding of the exact sum
    // (the fp32 kernel adds row by row, a different order: no bitwise comparison).
    Pair wte(static_cast<size_t>(V) * C, rng), wpe(static_cast<size_t>(T) * C, rng), out(NC, rng);
    std::vector<int32_t> tokens(N);
    for (auto& t : tokens) t = static_cast<int32_t>(rng.below(5));  // many repeats
    check_kernel("embedding_forward", {&out, &wte, &wpe}, [&](Backend& be, std::vector<void*>& p) {
      be.embedding_forward(p[0], tokens.data(), p[1], p[2], B, T, C);
    });
    Pair dwte(static_cast<size_t>(V) * C, rng), dwpe(static_cast<size_t>(T) * C, rng),
        dout(NC, rng);
    std::vector<double> ref_te(dwte.f.begin(), dwte.f.end()), ref_pe(dwpe.f.begin(), dwpe.f.end());
    for (int n = 0; n < N; ++n)
      for (int c = 0; c < C; ++c) {
        ref_te[static_cast<size_t>(tokens[n]) * C + c] += dout.f[static_cast<size_t>(n) * C + c];
        ref_pe[static_cast<size_t>(n % T) * C + c] += dout.f[static_cast<size_t>(n) * C + c];
      }
    auto be = make_cpu_backend(2, 0);
    be->set_storage_type(g_type);
    be->embedding_backward(dwte.h.data(), dwpe.h.data(), dout.h.data(), tokens.data(), B, T, C);
    // Bound per element: one 16-bit rounding of the result, plus fp32 summation of up to N
    // terms (N 2^-24 of their magnitude, far below it here).
    auto within = [&](const std::vector<uint16_t>& got, const std::vector<double>& ref) {
      size_t bad = 0;
      for (size_t i = 0; i < ref.size(); ++i)
        bad += std::fabs(wid16(g_type, got[i]) - ref[i]) >
               unit_roundoff(g_type) * std::fabs(ref[i]) + 1e-6;
      return bad;
    };
    CHECK(within(dwte.h, ref_te) == 0);
    CHECK(within(dwpe.h, ref_pe) == 0);
  }
}

TEST_CASE("a model with 16-bit device tensors stays within their rounding of the fp32 model",
          "[bf16]") {
  const ElemType t16 = GENERATE(ElemType::kBF16, ElemType::kF16);
  const double u = unit_roundoff(t16);
  for (const char* family : {"gpt2", "llama"}) {
    INFO("family " << family << ", device tensors " << elem_type_name(t16));
    ModelConfig mc;
    mc.family = family;
    mc.n_layer = 2;
    mc.n_head = 4;
    mc.d_model = 64;
    mc.d_ff = 128;
    mc.vocab_size = 96;
    mc.seq_len = 32;
    if (mc.family == "llama") mc.n_kv_head = 2;
    const int B = 2;
    std::vector<int32_t> tokens(B * mc.seq_len), targets(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = static_cast<int32_t>((i * 37 + 11) % mc.vocab_size);
      targets[i] = static_cast<int32_t>((i * 53 + 5) % mc.vocab_size);
    }
    std::vector<float> logits[2], grads[2];
    float loss[2];
    for (int mode = 0; mode < 2; ++mode) {
      auto be = make_cpu_backend(2, 0);
      const ElemType t = mode ? t16 : ElemType::kF32;
      be->set_storage_type(t);
      Transformer m(mc, *be, B);
      CHECK(m.elem_bytes() == elem_type_size(t));
      const size_t P = m.layout().total,
                   nl = static_cast<size_t>(m.tokens_per_batch()) * mc.vocab_size;
      std::vector<float> host(P);
      init_gpt_params(mc, m.layout(), host.data());
      if (mode) {  // both models compute from the same (16-bit-representable) weights
        std::vector<uint16_t> h(P);
        round_to(t16, h.data(), host.data(), P);
        widen_from(t16, host.data(), h.data(), P);
      }
      logits[mode].resize(nl);
      grads[mode].resize(P);
      if (mode) {
        std::vector<uint16_t> h(P), out(std::max(nl, P));
        round_to(t16, h.data(), host.data(), P);
        be->copy_to_device(m.params(), h.data(), 2 * P);
        loss[mode] = m.forward(tokens.data(), targets.data());
        m.copy_logits(out.data());
        widen_from(t16, logits[mode].data(), out.data(), nl);
        m.zero_grads();
        m.backward(1.0f / m.tokens_per_batch());
        be->copy_to_host(out.data(), m.grads(), 2 * P);
        widen_from(t16, grads[mode].data(), out.data(), P);
      } else {
        be->copy_to_device(m.params(), host.data(), 4 * P);
        loss[mode] = m.forward(tokens.data(), targets.data());
        m.copy_logits(logits[mode].data());
        m.zero_grads();
        m.backward(1.0f / m.tokens_per_batch());
        be->copy_to_host(grads[mode].data(), m.grads(), 4 * P);
      }
    }
    // Every stored intermediate is rounded once (relative error u); a path through this
    // 2-layer model stores about 12 of them forward and as many backward, and the errors
    // add: 24u bounds the relative error of logits and gradients, with margin.
    const double e_logits = test::rel_error(logits[1].data(), logits[0].data(), logits[0].size());
    const double e_grads = test::rel_error(grads[1].data(), grads[0].data(), grads[0].size());
    INFO("logits rel error " << e_logits / u << "u, grads rel error " << e_grads / u << "u, u "
                             << u);
    CHECK(e_logits <= 24 * u);
    CHECK(e_grads <= 24 * u);
    // The loss is fp32 over 16-bit logits: within the logits' error.
    CHECK(std::fabs(loss[1] - loss[0]) <= 24 * u * std::fabs(loss[0]));
    CHECK(e_logits > 0);  // the 16-bit path ran
  }
}

TEST_CASE("training with bf16 device tensors: fp32 master, bf16 weights written by the update",
          "[bf16]") {
  auto config = [](const char* tensors) {
    return parse_config(
        str("model: {n_layer: 2, n_head: 2, d_model: 32, d_ff: 96, vocab_size: 64, seq_len: 16}\n"
            "optimizer: {lr: 1.0e-2, min_lr: 1.0e-3, grad_clip: 1.0}\n"
            "schedule: {steps: 20, warmup_steps: 2, micro_batch: 4, grad_accum: 2}\n"
            "runtime: {backend: cpu, threads: 2, seed: 5, device_tensors: ",
            tensors, "}\n"),
        "<test>");
  };
  const int kSteps = 20;
  std::vector<std::vector<int32_t>> data(2 * kSteps);
  for (size_t s = 0; s < data.size(); ++s) {
    Rng rng(17, s);
    data[s].resize(4 * 17);
    int32_t t = static_cast<int32_t>(rng.below(64));
    for (auto& x : data[s]) x = t = (t + 1) % 64;  // learnable: each token predicts the next
  }
  std::vector<float> losses[2];
  for (int mode = 0; mode < 2; ++mode) {
    Config cfg = config(mode ? "bf16" : "fp32");
    auto be = make_cpu_backend(2, 0);
    apply_precision(*be, cfg.runtime);
    REQUIRE(be->storage_type() == (mode ? ElemType::kBF16 : ElemType::kF32));
    InMemoryStep r(cfg, *be);
    r.init_params();
    for (int s = 0; s < kSteps; ++s) {
      StepResult res = r.step(s, {data[2 * s].data(), data[2 * s + 1].data()});
      REQUIRE(std::isfinite(res.loss));
      losses[mode].push_back(res.loss);
      if (!mode) continue;
      // The device's weights are the fp32 master rounded to bf16, element for element.
      const size_t P = r.master().size();
      std::vector<uint16_t> dev(P), want(P);
      be->copy_to_host(dev.data(), r.model().params(), 2 * P);
      round_to(ElemType::kBF16, want.data(), r.master().data(), P);
      size_t first = P;
      for (size_t i = P; i-- > 0;)
        if (dev[i] != want[i]) first = i;
      INFO("step " << s << ": first differing element " << first << ": device "
                   << (first < P ? dev[first] : 0) << ", rounded master "
                   << (first < P ? want[first] : 0));
      CHECK(first == P);
    }
  }
  INFO("fp32 " << losses[0].front() << " -> " << losses[0].back() << ", bf16 " << losses[1].front()
               << " -> " << losses[1].back());
  CHECK(losses[1].back() < 0.5 * losses[1].front());  // it learns
  // The first step's loss comes from the same weights rounded once: within bf16 rounding.
  CHECK(std::fabs(losses[1][0] - losses[0][0]) <= 24 * kBf16U * losses[0][0]);
  // Later steps drift apart as rounding compounds through the updates; both converge alike.
  CHECK(std::fabs(losses[1].back() - losses[0].back()) <= 0.1 * losses[0].front());
}

TEST_CASE("the CPU backend's kernel scratch with bf16 tensors stays within what the budgets count",
          "[bf16]") {
  // A training step and a validation pass run every kernel on this thread (in memory);
  // the fp32 views they took must fit the bound the host budget and the planner count.
  for (const char* family : {"gpt2", "llama"}) {
    INFO("family " << family);
    Config cfg = parse_config(
        str("model: {family: ", family,
            ", n_layer: 2, n_head: 4, d_model: 64, d_ff: 160, "
            "vocab_size: 300, seq_len: 32",
            std::string(family) == "llama" ? ", n_kv_head: 2" : "",
            "}\nschedule: {micro_batch: 3}\n"
            "runtime: {backend: cpu, threads: 2, device_tensors: bf16, precision: bf16}\n"),
        "<test>");
    auto be = make_cpu_backend(2, 0);
    apply_precision(*be, cfg.runtime);
    InMemoryStep r(cfg, *be);
    r.init_params();
    cpu::release_stage_scratch();  // earlier tests' calls on this thread do not count
    std::vector<int32_t> batch(3 * 33);
    for (size_t i = 0; i < batch.size(); ++i) batch[i] = static_cast<int32_t>((i * 7 + 3) % 300);
    r.step(0, {batch.data()});
    r.eval_loss(batch.data());
    const size_t used = cpu::stage_scratch_bytes(), bound = cpu_kernel_scratch_bytes(cfg.model, 3);
    INFO("scratch " << used << " bytes, bound " << bound);
    CHECK(used > 0);
    CHECK(used <= bound);
    CHECK(in_memory_host_bytes(cfg.model, 3, true, 2) ==
          in_memory_host_bytes(cfg.model, 3, true, 4) - in_memory_device_bytes(cfg.model, 3, 4) +
              in_memory_device_bytes(cfg.model, 3, 2) + bound);
    // The planner counts it where the device is host memory, and only there.
    PlanRequest req = plan_request(cfg);
    req.have_ssd = false;
    req.device_in_host = true;
    const Plan cpu_plan = make_plan(req);
    req.device_in_host = false;
    const Plan gpu_plan = make_plan(req);
    auto scratch_in = [](const Plan& p) {
      return std::count_if(p.buffers.begin(), p.buffers.end(), [](const PlanBuffer& b) {
        return b.kind == BufferKind::kKernelScratch;
      });
    };
    CHECK(scratch_in(cpu_plan) == 1);
    CHECK(scratch_in(gpu_plan) == 0);
  }
}

// The CUDA backend's 16-bit choices (runtime.attention cudnn, runtime.gemm_bias epilogue):
// validated against the tensors and the backend, refused by name by a backend without them,
// and written back by config_to_yaml.
TEST_CASE("the CUDA backend's 16-bit choices are validated, and refused by name elsewhere",
          "[bf16]") {
  using Catch::Matchers::Contains;
  struct Choice {
    const char* key;
    std::string RuntimeConfig::*field;
    const char *default_value, *cuda_value, *bad, *one_of, *refusal;
    std::vector<const char*> everywhere;  // values every backend takes
  };
  const Choice choices[] = {
      {"attention",
       &RuntimeConfig::attention,
       "auto",
       "cudnn",
       "flash",
       "auto, kernels, cudnn",
       "runtime.attention is cudnn",
       {"auto", "kernels"}},
      {"gemm_bias",
       &RuntimeConfig::gemm_bias,
       "kernel",
       "epilogue",
       "fused",
       "kernel, epilogue",
       "runtime.gemm_bias is epilogue",
       {"kernel"}},
  };
  for (const Choice& c : choices) {
    INFO("runtime." << c.key);
    const std::string key = str("runtime.", c.key);
    auto runtime = [&](const std::string& value, const std::string& rest) {
      return parse_config(str("runtime: {", c.key, ": ", value, rest, "}\n"), "<t>");
    };
    CHECK(parse_config("", "<t>").runtime.*c.field == c.default_value);
    CHECK_THROWS_WITH(runtime(c.bad, ""),
                      Contains(key) && Contains(str("'", c.bad, "' is not one of ", c.one_of)));
    // 16-bit tensors and the CUDA backend only.
    CHECK_THROWS_WITH(runtime(c.cuda_value, ""),
                      Contains(key) && Contains("16-bit tensors") && Contains("fp32"));
    CHECK_THROWS_WITH(runtime(c.cuda_value, ", device_tensors: bf16, backend: cpu"),
                      Contains(key) && Contains("CUDA backend") && Contains("'cpu'"));
    const Config ok = runtime(c.cuda_value, ", device_tensors: bf16, backend: auto");
    CHECK(ok.runtime.*c.field == c.cuda_value);
    // backend auto on a machine without a GPU is the CPU: it refuses the request rather than
    // run without what was asked for under its name.
    if (cuda_usable_devices(nullptr) == 0)
      CHECK_THROWS_WITH(make_backend(ok, nullptr), Contains(c.refusal) && Contains("cpu"));
    for (const char* v : c.everywhere)
      for (const char* b : {"cpu", "cpu-streams"}) {
        INFO(v << " on " << b);
        auto be = make_backend(runtime(v, str(", device_tensors: bf16, backend: ", b)), nullptr);
        CHECK(be->storage_type() == ElemType::kBF16);
      }
    // The key survives a written config.
    CHECK(parse_config(config_to_yaml(ok), "<t>").runtime.*c.field == c.cuda_value);
  }
}

TEST_CASE("cuDNN's attention graphs: every descriptor finalizes, no device needed",
          "[bf16][cudnn]") {
  using Catch::Matchers::Contains;
  // The graphs of kernels/cuda/cudnn_attention.cc, built here as far as cuDNN goes without a
  // GPU: every tensor and operation descriptor set and finalized (a wrong attribute type,
  // count or value is refused at this stage; the operation graph and plan need a device, and
  // the GPU kit's cuda-cudnn step runs them).
  const std::string probe = cudnn_attention_graph_check(ElemType::kBF16, 2, 256, 256, 4);
  if (!cuda_built()) {
    CHECK_THAT(probe, Contains("no CUDA backend"));
    return;
  }
  if (probe.find("library path") != std::string::npos ||
      probe.find("no cuDNN headers") != std::string::npos) {
    WARN("cuDNN is not on this machine: " << probe);  // the kernels run every attention here
    CHECK_THAT(probe, Contains("cuDNN"));
    return;
  }
  for (ElemType t : {ElemType::kBF16, ElemType::kF16})
    for (auto [B, T, C, H] : {std::array{2, 256, 256, 4}, std::array{1, 200, 512, 4},
                              std::array{16, 1024, 12288, 96}}) {
      INFO(elem_type_name(t) << " B " << B << " T " << T << " C " << C << " H " << H);
      CHECK(cudnn_attention_graph_check(t, B, T, C, H).empty());
    }
}

TEST_CASE("runtime.device_tensors is validated, reaches the backend and the plan", "[bf16]") {
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(parse_config("runtime: {device_tensors: fp8}\n", "<t>"),
                    Contains("device_tensors") && Contains("fp8"));
  // fp16 tensors come with fp16's loss scaling.
  CHECK_THROWS_WITH(parse_config("runtime: {device_tensors: fp16, precision: bf16}\n", "<t>"),
                    Contains("device_tensors") && Contains("precision: fp16"));
  CHECK(parse_config("runtime: {device_tensors: fp16, precision: fp16}\n", "<t>")
            .runtime.device_tensors == "fp16");
  // fp16 GEMMs on bf16 tensors are no mode (the backends would differ on them).
  CHECK_THROWS_WITH(parse_config("runtime: {device_tensors: bf16, precision: fp16}\n", "<t>"),
                    Contains("precision") && Contains("fp16 GEMMs on bf16 tensors"));
  // A model's head chunk is checked like any key: negative is no chunk size.
  CHECK_THROWS_WITH(parse_config("model: {head_chunk_tokens: -1}\n", "<t>"),
                    Contains("model.head_chunk_tokens") && Contains("-1"));
  // What micro-batches sum in: named, and in fp32 only where there is something to sum in
  // 16 bits (several micro-batches, 16-bit tensors) and it is not turned off.
  CHECK_THROWS_WITH(
      parse_config("schedule: {grad_accum_type: bf16}\n", "<t>"),
      Contains("schedule.grad_accum_type") && Contains("'bf16' is not one of auto, fp32, tensors"));
  CHECK(sums_grads_in_fp32(
      parse_config("schedule: {grad_accum: 2}\nruntime: {device_tensors: bf16}\n", "<t>")));
  CHECK(
      sums_grads_in_fp32(parse_config("schedule: {grad_accum: 2, grad_accum_type: fp32}\n"
                                      "runtime: {device_tensors: fp16, precision: fp16}\n",
                                      "<t>")));
  CHECK_FALSE(sums_grads_in_fp32(
      parse_config("schedule: {grad_accum: 1}\nruntime: {device_tensors: bf16}\n", "<t>")));
  CHECK_FALSE(sums_grads_in_fp32(parse_config("schedule: {grad_accum: 2}\n", "<t>")));
  CHECK_FALSE(sums_grads_in_fp32(parse_config(
      "schedule: {grad_accum: 2, grad_accum_type: tensors}\nruntime: {device_tensors: bf16}\n",
      "<t>")));
  auto be = make_cpu_backend(1, 0);
  void* p = be->alloc(64, "x");
  CHECK_THROWS_WITH(be->set_storage_type(ElemType::kBF16),
                    Contains("before anything is allocated"));
  be->free(p);
  // In memory, the device bytes halve with the tensors (statistics stay fp32).
  ModelConfig mc;
  const uint64_t f32 = in_memory_device_bytes(mc, 2, 4), bf16 = in_memory_device_bytes(mc, 2, 2);
  CHECK(bf16 < f32);
  CHECK(bf16 > f32 / 2);
  Config cfg = parse_config(
      "model: {n_layer: 2, n_head: 2, d_model: 32, d_ff: 96, vocab_size: 64, seq_len: 16}\n"
      "offload: {activations: swap}\n"
      "runtime: {backend: cpu, device_tensors: bf16}\n",
      "<t>");
  auto b2 = make_cpu_backend(1, 0);
  apply_precision(*b2, cfg.runtime);
  CHECK(b2->storage_type() == ElemType::kBF16);
  const PlanRequest req = plan_request(cfg);
  CHECK(req.tensors == ElemType::kBF16);
  // Every host<->device transfer of the plan is half the fp32 plan's: weights, gradients and
  // checkpoints move as bf16 (the optimizer's fp32 state moves between host and SSD only).
  PlanRequest r32 = req;
  r32.tensors = ElemType::kF32;
  const Plan p16 = make_plan(req), p32 = make_plan(r32);
  REQUIRE(p16.ops.size() == p32.ops.size());
  OpTraffic t16, t32;
  for (size_t i = 0; i < p16.ops.size(); ++i) {
    const OpTraffic a = op_traffic(p16, p16.ops[i]), b = op_traffic(p32, p32.ops[i]);
    t16.h2d += a.h2d, t16.d2h += a.d2h, t32.h2d += b.h2d, t32.d2h += b.d2h;
  }
  CHECK(t32.h2d > 0);
  CHECK(t16.h2d * 2 == t32.h2d);
  CHECK(t16.d2h * 2 == t32.d2h);
  // An executor refuses a plan whose tensors are not the backend's.
  auto b3 = make_cpu_backend(1, 0);
  CHECK_THROWS_WITH(PlanExecutor(cfg, *b3, make_plan(req), nullptr),
                    Contains("bf16") && Contains("f32"));
}

TEST_CASE("GPT-3 175B plans within one 24 GB GPU with bf16 tensors, not with fp32", "[bf16]") {
  using Catch::Matchers::Contains;
  // The planning path fuyou-train takes for configs/gpt3-175b.yaml on a GPU (device memory
  // not in the host budget) with the RTX 4090 profile's budgets: the 22 GiB a process's arena
  // can take of the card's 24 GB, 128 GiB host, SSDs for the rest.
  const HardwareProfile hw =
      load_hardware_profile(test::source_path("configs/hardware/rtx4090.yaml"));
  for (int seq : {2048, 1024}) {
    INFO("sequence " << seq);
    Config cfg =
        load_config_file(test::source_path("configs/gpt3-175b.yaml"), {str("model.seq_len=", seq)});
    PlanRequest req = plan_request(cfg);
    req.device_in_host = false;
    req.device_budget = hw.device_memory;
    req.host_budget = hw.host_memory;
    req.have_ssd = true;
    req.tensors = ElemType::kF32;
    CHECK_THROWS_WITH(make_plan(req), Contains("device memory"));
    req.tensors = ElemType::kBF16;
    const Plan p = make_plan(req);
    CHECK(p.memory.device_bytes <= hw.device_memory);
    CHECK(p.memory.host_bytes <= hw.host_memory);
  }
  // The largest micro-batches that fit (docs/simulator.md): 14 at sequence 1024 (with the
  // configs' chunked LM head and the MLP's gradient written over its activation), 7 at 2048.
  // The published system's 16 at 1024 needs 23.09 GiB: more than a real card leaves.
  {
    Config cfg = load_config_file(test::source_path("configs/gpt3-175b.yaml"),
                                  {"model.seq_len=1024", "schedule.micro_batch=16"});
    PlanRequest req = plan_request(cfg);
    req.device_in_host = false;
    req.device_budget = hw.device_memory;
    req.host_budget = hw.host_memory;
    req.have_ssd = true;
    CHECK_THROWS_WITH(make_plan(req), Contains("device memory"));
  }
  for (auto [seq, batch] : {std::pair<int, int>{1024, 14}, {2048, 7}}) {
    INFO("sequence " << seq << ", micro-batch " << batch);
    Config cfg =
        load_config_file(test::source_path("configs/gpt3-175b.yaml"),
                         {str("model.seq_len=", seq), str("schedule.micro_batch=", batch)});
    REQUIRE(cfg.model.head_chunk_tokens == 1024);
    PlanRequest req = plan_request(cfg);
    req.device_in_host = false;
    req.device_budget = hw.device_memory;
    req.host_budget = hw.host_memory;
    req.have_ssd = true;
    const Plan p = make_plan(req);
    CHECK(p.memory.device_bytes <= hw.device_memory);
    CHECK(p.memory.host_bytes <= hw.host_memory);
    // Without the chunked head it does not fit: the chunking is what makes room, and the
    // refusal says what it would take with chunks.
    req.model.head_chunk_tokens = 0;
    CHECK_THROWS_WITH(make_plan(req),
                      Contains("device memory") && Contains("model.head_chunk_tokens: 1024"));
  }
}

TEST_CASE("PyTorch's bf16 recipe: logits, loss, gradients and 10 steps with bf16 tensors",
          "[bf16][reference]") {
  for (const char* name : {"tiny_a", "tiny_b"}) {
    SafetensorsReader f(
        test::source_path(str("tests/reference/fixtures/bf16/", name, ".safetensors")));
    INFO("fixture " << name);
    test::check_bf16_recipe(f, "cpu", [] { return make_cpu_backend(2, 0); });
  }
}

TEST_CASE(
    "the gradient's sum of squares: the same bits on any thread count, near exact, non-finite kept",
    "[bf16]") {
  // Blocks of 2^16 summed in parallel, eight lanes each: a length that ends mid-block and
  // mid-lane, in every gradient type.
  const size_t n = 3 * (size_t(1) << 16) + 12345;
  Rng rng(77);
  std::vector<float> f(n);
  for (float& x : f) x = static_cast<float>(rng.normal()) * (rng.below(100) == 0 ? 300.0f : 1.0f);
  std::vector<uint16_t> b(n), h(n);
  round_to(ElemType::kBF16, b.data(), f.data(), n);
  round_to(ElemType::kF16, h.data(), f.data(), n);
  for (auto [t, data] : {std::pair<ElemType, const void*>{ElemType::kF32, f.data()},
                         {ElemType::kBF16, b.data()},
                         {ElemType::kF16, h.data()}}) {
    INFO(elem_type_name(t));
    std::vector<float> w(n);
    widen_from(t, w.data(), data, n);
    long double exact = 0;  // sequential in 64-bit mantissas: ~2^11 times double's precision
    for (float x : w) exact += static_cast<long double>(x) * x;
    const int team = omp_get_max_threads();
    set_thread_team(1);
    const double one = group_sum_squares(data, t, n);
    set_thread_team(3);  // more threads than blocks' multiple: uneven shares
    const double three = group_sum_squares(data, t, n);
    set_thread_team(team);
    CHECK(std::memcmp(&one, &three, sizeof one) == 0);
    // Each product is exact in double; n additions of positive terms err by at most n u64.
    CHECK(std::fabs(one - static_cast<double>(exact)) <=
          n * std::ldexp(1.0, -53) * static_cast<double>(exact));
    // The first block alone, and an empty group.
    CHECK(group_sum_squares(data, t, 0) == 0.0);
    CHECK(group_sum_squares(data, t, 1) == static_cast<double>(w[0]) * w[0]);
  }
  // A NaN or an infinity anywhere reaches the sum (the non-finite check of fp16's loss scaling).
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> g = f;
    g[n - 7] = bad;
    CHECK(!std::isfinite(group_sum_squares(g.data(), ElemType::kF32, n)));
  }
}

TEST_CASE("gradient accumulation with bf16 tensors: fp32 sums on the host, not K bf16 roundings",
          "[bf16]") {
  // One step of K micro-batches. Summed in fp32 on the host (grad_accum_type auto), its
  // gradient is exactly the fp32 sum, in order, of the K micro-batches' own bf16 gradients;
  // summed in the device's bf16 (grad_accum_type: tensors), every micro-batch after the first
  // adds a rounding at the running sum's magnitude.
  const int K = 32;
  auto config = [&](int micro_batches, const char* tensors, const char* type) {
    return parse_config(
        str("model: {n_layer: 2, n_head: 2, d_model: 32, d_ff: 96, vocab_size: 64, seq_len: 16}\n"
            "optimizer: {lr: 1.0e-2, min_lr: 1.0e-3, grad_clip: 1.0}\n"
            "schedule: {steps: 2, warmup_steps: 0, micro_batch: 1, grad_accum: ",
            micro_batches, ", grad_accum_type: ", type,
            "}\nruntime: {backend: cpu, threads: 2, seed: 5, device_tensors: ", tensors, "}\n"),
        "<test>");
  };
  std::vector<std::vector<int32_t>> data(K, std::vector<int32_t>(17));
  for (int k = 0; k < K; ++k) {
    Rng rng(23, k);
    for (auto& t : data[k]) t = static_cast<int32_t>(rng.below(64));
  }
  auto gradient = [&](const char* tensors, const char* type, int first, int n) {
    Config cfg = config(n, tensors, type);
    auto be = make_cpu_backend(2, 0);
    apply_precision(*be, cfg.runtime);
    InMemoryStep r(cfg, *be);
    r.init_params();
    std::vector<const int32_t*> mbs;
    for (int k = first; k < first + n; ++k) mbs.push_back(data[k].data());
    r.step(0, mbs);
    return r.step_gradient();
  };
  auto rel_error = [](const std::vector<float>& a, const std::vector<float>& ref) {
    double d = 0, n = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      d += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
      n += double(ref[i]) * ref[i];
    }
    return std::sqrt(d / n);
  };
  // Each micro-batch alone: its gradient is that of the mean over its own targets, K times
  // the share it has in the K-micro-batch step (the scale differs by 2^5, which commutes with
  // every rounding), so the step's fp32 sum is these added in order, divided by K.
  std::vector<float> sum;
  for (int k = 0; k < K; ++k) {
    const std::vector<float> g = gradient("bf16", "auto", k, 1);
    if (k == 0) sum.assign(g.size(), 0.0f);
    for (size_t i = 0; i < g.size(); ++i) sum[i] = k == 0 ? g[i] / K : sum[i] + g[i] / K;
  }
  const std::vector<float> g32 = gradient("bf16", "auto", 0, K),
                           g16 = gradient("bf16", "tensors", 0, K);
  REQUIRE(g32.size() == sum.size());
  size_t differ = 0;
  for (size_t i = 0; i < sum.size(); ++i) differ += std::memcmp(&g32[i], &sum[i], 4) != 0;
  CHECK(differ == 0);
  // Against the fp32 model's gradient: the fp32 sum is as close as one micro-batch's bf16
  // gradient is; the bf16 sum adds its roundings.
  const std::vector<float> ref = gradient("fp32", "auto", 0, K);
  const double e32 = rel_error(g32, ref), e16 = rel_error(g16, ref);
  const double e1 = rel_error(gradient("bf16", "auto", 0, 1), gradient("fp32", "auto", 0, 1));
  const double acc16 = rel_error(g16, sum);
  INFO("relative error of the step's gradient against the fp32 model's, "
       << K << " micro-batches: fp32 sums " << e32 / kBf16U << "u, bf16 sums " << e16 / kBf16U
       << "u (one micro-batch: " << e1 / kBf16U
       << "u); the bf16 sums against the exact fp32 sum: " << acc16 / kBf16U << "u");
  CHECK(e32 > 0);
  CHECK(e32 <= 24 * kBf16U);  // the model's bound for one bf16 gradient (test above)
  CHECK(e32 <= 1.5 * e1);     // no worse for summing 32
  CHECK(e16 > 1.3 * e32);
  // Measured: fp32 sums 1.41u, bf16 sums 2.32u, one micro-batch 1.33u; the bf16 sums 1.90u
  // from the exact sum.
  CHECK(acc16 > 0.5 * kBf16U);  // the roundings that summing in bf16 adds
}
