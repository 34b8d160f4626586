#!/usr/bin/python3
"""Time GPT-2-shaped training steps in PyTorch on the CPU (the baseline Fuyou is compared with).

One step = forward + backward + torch.optim.AdamW(foreach=True).step() on random tokens,
model from gpt_ref.py (float32; --bf16-autocast runs the forward under CPU autocast). Prints ONE JSON line with the median step time over
--steps timed steps after --warmup-steps untimed ones.

Examples:
  /usr/bin/python3 tests/reference/bench_torch.py --threads 2 --steps 3 --warmup-steps 1   # GPT-2 124M
  /usr/bin/python3 tests/reference/bench_torch.py --n-layer 6 --n-head 6 --d-model 384 \\
      --d-ff 1536 --vocab 256 --seq 256 --batch 8 --threads 2

Environment (measured on Debian 12 python3-torch 1.13.1, float32 GEMMs go to OpenBLAS 0.3.21
pthread through libblas.so.3; the CPU is AMD EPYC Zen 4, AVX-512):
    OMP_WAIT_POLICY=PASSIVE   (set by this script unless already set, or --no-env-defaults)
  Why: torch's element-wise / softmax / LayerNorm kernels run on libgomp threads while the GEMMs
  run on OpenBLAS's own pthreads. With 2 cores, libgomp's default spin-wait after each parallel
  region (GOMP_SPINCOUNT 300000) keeps both cores busy while OpenBLAS wants them, and vice
  versa. Passive waiting (or GOMP_SPINCOUNT=1000, which measured the same) gives ~1.45x on the
  small config (n_layer 6, d_model 384, seq 256, batch 8: ~940 -> ~1400 tokens/s).
  Measured and NOT helpful: OPENBLAS_CORETYPE=SkylakeX/Zen/Haswell (0.3.21 already detects this
  Zen 4 as "Cooperlake", the AVX-512 kernels; sgemm reaches ~175-195 GFLOP/s on 2 cores either way,
  Haswell/Zen no better), ATEN_CPU_CAPABILITY=avx512 (no gain / slightly slower),
  OMP_PROC_BIND=close OMP_PLACES=cores (pins the gomp threads onto the cores OpenBLAS also uses:
  slower with PASSIVE), OPENBLAS_THREAD_TIMEOUT=4 (slightly slower), and BLIS
  (LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/blis-openmp: sgemm ~55-100 GFLOP/s, half of OpenBLAS).

torch >= 2.0 (measured with PyPI's torch 2.15.0, MKL 2024.2 + oneDNN 3.13, on a Zen 3 with AVX2):
--sdpa (fused causal attention) is its fastest form at seq 1024; PASSIVE waiting helps some runs
and hurts others there, so run both and take the better; --compile (Inductor's C++ code) was no
faster at either shape. The wheel is the CUDA build; installed without a GPU into a venv with
  pip install --no-deps torch==2.15.0   plus numpy sympy networkx jinja2 fsspec filelock
  typing-extensions, and, only so that `import torch` finds the CUDA libraries it links,
  nvidia-cusparselt-cu13==0.8.1 nvidia-nvshmem-cu13==3.7.2 nvidia-cufile nvidia-nccl-cu13==2.30.7
  nvidia-cudnn-cu13==9.26.0.51 (all --no-deps) on LD_LIBRARY_PATH with /usr/local/cuda/lib64.
"""

import os
import sys

# Must happen before torch (and so libgomp / OpenBLAS) is loaded.
ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
if "--no-env-defaults" not in sys.argv:
    for _k, _v in ENV_DEFAULTS.items():
        os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_ref import GPT, GPTConfig, SelfAttention, adamw_param_groups, init_weights, sdpa_forward  # noqa: E402


def blas_summary():
    """The BLAS/MKL/oneDNN facts from torch.__config__.show(), plus the BLAS library actually mapped."""
    cfg = torch.__config__.show()
    parts = []
    for line in cfg.splitlines():
        line = line.strip(" -")
        if re.search(r"MKL|oneDNN|MKL-DNN|OpenBLAS|BLIS|CPU capability", line) and "Build settings" not in line:
            parts.append(line)
    m = re.search(r"BLAS_INFO=([^,]+)", cfg)
    if m:
        parts.append("BLAS_INFO=" + m.group(1))
    libs = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if re.search(r"lib(open)?blas|blis|mkl_", os.path.basename(path)) and path not in libs:
                    libs.append(path)
    except OSError:
        pass
    if libs:
        parts.append("loaded: " + " ".join(libs))
    return "; ".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--d-ff", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16-autocast", action="store_true",
                    help="run forward and loss under torch.autocast('cpu', bfloat16): PyTorch's own "
                         "mixed precision, the comparison for the engine's runtime.precision bf16")
    ap.add_argument("--sdpa", action="store_true",
                    help="attention through F.scaled_dot_product_attention(is_causal=True) "
                         "(torch >= 2.0): PyTorch's fused attention, which like the engine skips "
                         "the masked half, instead of gpt_ref.py's explicit softmax")
    ap.add_argument("--compile", action="store_true",
                    help="run the forward and loss through torch.compile (torch >= 2.0; the "
                         "warm-up steps include the compilation)")
    ap.add_argument("--no-env-defaults", action="store_true",
                    help="do not set " + ", ".join(f"{k}={v}" for k, v in ENV_DEFAULTS.items()))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    if (args.sdpa or args.compile) and int(torch.__version__.split(".")[0]) < 2:
        sys.exit(f"bench_torch.py: --sdpa and --compile need torch >= 2.0; this is {torch.__version__}")
    if args.sdpa:
        SelfAttention.forward = sdpa_forward
    cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model,
                    d_ff=args.d_ff, vocab_size=args.vocab, seq_len=args.seq)
    gen = torch.Generator().manual_seed(args.seed)
    model = GPT(cfg)
    init_weights(model, gen)
    model.train()
    opt = torch.optim.AdamW(adamw_param_groups(model, 0.1), lr=3e-4, betas=(0.9, 0.95),
                            eps=1e-8, foreach=True)

    model_loss = torch.compile(model.loss) if args.compile else model.loss
    times = []
    for i in range(args.warmup_steps + args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if args.bf16_autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model_loss(tokens)
        else:
            _, loss = model_loss(tokens)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if i >= args.warmup_steps:
            times.append(dt)
        print(f"step {i} {'(warmup) ' if i < args.warmup_steps else ''}{dt:.3f}s loss {loss.item():.4f}",
              file=sys.stderr)

    med = statistics.median(times)
    n_params = sum(p.numel() for p in model.parameters())
    print(json.dumps({
        "tokens_per_s": args.batch * args.seq / med,
        "step_s_median": med,
        "threads": args.threads,
        "precision": "bf16 autocast" if args.bf16_autocast else "fp32",
        "sdpa": args.sdpa,
        "compile": args.compile,
        "torch_version": torch.__version__,
        "blas": blas_summary(),
        "env": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS",
                                          "OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                          "GOMP_SPINCOUNT", "OMP_PROC_BIND", "OMP_PLACES",
                                          "ATEN_CPU_CAPABILITY", "LD_LIBRARY_PATH") if k in os.environ},
        "config": {"n_layer": args.n_layer, "n_head": args.n_head, "d_model": args.d_model,
                   "d_ff": args.d_ff, "vocab": args.vocab, "seq": args.seq, "batch": args.batch,
                   "params": n_params},
        "steps": args.steps, "warmup_steps": args.warmup_steps,
    }))


if __name__ == "__main__":
    main()
