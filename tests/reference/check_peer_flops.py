#!/usr/bin/python3
"""The PyTorch peer (tools/torch_peer.py) counts the FLOPs fuyou-bench counts, is configured as
its best users configure it, and runs.

Usage: check_peer_flops.py FUYOU_BENCH

For a small GPT (and the GPT-2 124M and GPT-3 175B shapes, by formula only), the peer's
forward_flops_per_token times 3 equals fuyou-bench train's flops_per_token; the peer's own
training step on the CPU (eager) reports TFLOP/s that are that count times its tokens/s, its
padded vocabulary (300 -> 320 rows) and the SDPA backend that ran. The peer's initialisation is
the engine's: LayerNorm weights 1, biases 0, padded rows 0, the residual projections' std
0.02 / sqrt(2 L). Exit 0 when they agree, 1 on a mismatch, 77 when torch is missing (skipped).
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


def check_init():
    """init_like_engine on a small padded model: the engine's rules, each checked."""
    import math
    import torch
    from gpt_ref import GPT, GPTConfig
    torch.manual_seed(0)
    n_layer, vocab, padded = 4, 300, 320
    model = GPT(GPTConfig(n_layer=n_layer, n_head=2, d_model=128, d_ff=512, vocab_size=padded, seq_len=64))
    torch_peer.init_like_engine(model, n_layer, vocab)
    bad = []
    for name, p in model.named_parameters():
        if p.dim() < 2:
            want = 1.0 if name.endswith("weight") else 0.0
            if not torch.all(p == want):
                bad.append(f"{name} is not all {want}")
            continue
        rows = p[:vocab] if name == "wte.weight" else p
        std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
        # The sample std of n normals is within 5 standard errors (std / sqrt(2 n)) of std.
        if abs(rows.std().item() - std) > 5 * std / math.sqrt(2 * rows.numel()):
            bad.append(f"{name}: std {rows.std().item():.5f}, want {std:.5f}")
    if not torch.all(model.wte.weight[vocab:] == 0):
        bad.append("the padded embedding rows are not zero")
    print("peer initialisation:", "; ".join(bad) if bad else "as the engine's")
    return len(bad)


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
    print(f"peer shape {peer['shape']}, SDPA backend {peer['sdpa_backend']} ({peer['sdpa_ops']})")
    failures += peer["shape"]["padded_vocab"] != 320 or peer["shape"]["vocab"] != 300
    failures += not peer["sdpa_backend"]
    failures += check_init()
    # The model shapes the GPU kit compares (formula only; fuyou-bench's count for them is the
    # same function of the shape, checked above on the small one).
    for name, shape in (("gpt2-124m", (12, 768, 3072, 50257, 1024)), ("gpt3-175b", (96, 12288, 49152, 50257, 1024))):
        f = torch_peer.forward_flops_per_token(*shape)
        print(f"{name}: {3 * f:.6g} training FLOPs per token")
    print("FAILED" if failures else "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
