#!/usr/bin/python3
"""Times torch.optim.AdamW (foreach=True) over N fp32 parameters on the CPU: the reference
`fuyou-bench adam` is compared with (same thread count, fp32 gradients, no low-precision
copy). Prints one JSON line: params_per_s (median of --steps updates after one warm-up).

  /usr/bin/python3 tests/reference/bench_adam_torch.py --params 100000000 --threads 2
"""
import argparse
import json
import statistics
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=16, help="split into this many tensors (layers)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    per = a.params // a.tensors
    params = [torch.nn.Parameter(torch.full((per,), 0.01)) for _ in range(a.tensors)]
    for p in params:
        p.grad = torch.randn(per) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    times = []
    for s in range(a.steps + 1):
        t0 = time.perf_counter()
        opt.step()
        dt = time.perf_counter() - t0
        if s > 0:
            times.append(dt)
    t = statistics.median(times)
    print(json.dumps({"params": per * a.tensors, "threads": a.threads, "step_s": t,
                      "params_per_s": per * a.tensors / t, "torch_version": torch.__version__}))


if __name__ == "__main__":
    main()
