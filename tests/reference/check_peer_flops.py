#!/usr/bin/python3
"""The PyTorch peer (tools/torch_peer.py) counts the FLOPs fuyou-bench counts, and runs.

Usage: check_peer_flops.py FUYOU_BENCH

For a small GPT (and the GPT-2 124M and GPT-3 175B shapes, by formula only), the peer's
forward_flops_per_token times 3 equals fuyou-bench train's flops_per_token; the peer's own
training step on the CPU reports TFLOP/s that are that count times its tokens/s. Exit 0 when
they agree, 1 on a mismatch, 77 when torch is missing (skipped).
"""
import json
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "tools"))
try:
    import torch_peer  # noqa: E402  (imports torch)
except ImportError as e:
    print(f"skipped: {e}")
    sys.exit(77)


def bench_flops(bench, shape):
    sets = []
    for k, v in shape.items():
        sets += ["--set", f"model.{k}={v}"]
    out = subprocess.run([bench, "train", "--set", "runtime.backend=cpu", "--set", "runtime.threads=1",
                          "--set", "schedule.micro_batch=1", *sets, "--steps", "1", "--warmup", "0", "--json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads([l for l in out.splitlines() if l.startswith("{")][-1])["flops_per_token"]


def main():
    bench = sys.argv[1]
    failures = 0
    small = {"n_layer": 2, "n_head": 2, "d_model": 64, "d_ff": 256, "vocab_size": 300, "seq_len": 32}
    want = bench_flops(bench, small)
    got = 3 * torch_peer.forward_flops_per_token(2, 64, 256, 300, 32)
    print(f"small GPT: fuyou-bench {want:.6g} FLOPs per token, peer {got:.6g}")
    failures += want != got
    # The peer's step on the CPU reports the same count: tflops * 1e12 / tokens_per_s.
    out = subprocess.run([sys.executable, os.path.join(here, "..", "..", "tools", "torch_peer.py"), "train",
                          "--mode", "eager", "--device", "cpu", "--n-layer", "2", "--n-head", "2", "--d-model", "64",
                          "--d-ff", "256", "--vocab", "300", "--seq", "32", "--batch", "2", "--steps", "1",
                          "--warmup", "1"], check=True, capture_output=True, text=True).stdout
    peer = json.loads(out.splitlines()[-1])
    if "error" in peer:
        print("the peer's step failed:", peer["error"])
        return 1
    per_token = peer["tflops"] * 1e12 / peer["tokens_per_s"]
    print(f"peer step: {peer['tokens_per_s']:.0f} tokens/s, {per_token:.6g} FLOPs per token, loss {peer['loss']:.4f}")
    failures += abs(per_token - want) > 1e-9 * want
    # The model shapes the GPU kit compares (formula only; fuyou-bench's count for them is the
    # same function of the shape, checked above on the small one).
    for name, shape in (("gpt2-124m", (12, 768, 3072, 50257, 1024)), ("gpt3-175b", (96, 12288, 49152, 50257, 1024))):
        f = torch_peer.forward_flops_per_token(*shape)
        print(f"{name}: {3 * f:.6g} training FLOPs per token")
    print("FAILED" if failures else "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
