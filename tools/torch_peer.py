#!/usr/bin/env python3
"""The PyTorch peer of `fuyou-bench train` on a GPU: the same GPT shapes, trained the way a
PyTorch user would on the same card, so that the engine's tokens/s is read as a ratio.

  python3 tools/torch_peer.py train [--config-like gpt2-124m shapes] --mode eager|compile|autotune|best
  python3 tools/torch_peer.py gemm  --d-model 768 --d-ff 3072 --vocab 50257 --tokens 8192

train: the model of tests/reference/gpt_ref.py (gpt2 family: pre-LN, GELU tanh, learned
positions, LM head tied to the embedding) as its best users configure it: the embedding and
head padded to a multiple of --pad-vocab rows (64: GPT-2's 50,257 become 50,304, as nanoGPT
and llm.c pad; the engine pads its rows the same way), the loss over the real vocabulary's
columns; fp32 parameters initialised as the engine does (weights normal with std 0.02, the
attention and MLP output projections 0.02 / sqrt(2 * n_layer), the padded rows zero, LayerNorm
weights 1, biases 0); the forward, the loss and the backward under bf16 autocast, attention
through scaled_dot_product_attention, AdamW with fused=True on the device, global-norm
clipping at 1.0, random tokens of the real vocabulary. `compile` wraps the model and its loss
in one torch.compile (Inductor, no network needed); `autotune` the same with mode
max-autotune-no-cudagraphs (minutes of compilation on a GPU); `best` runs eager then compile,
and autotune too with --autotune. One JSON line per mode: median step time over --steps after
--warmup, tokens/s, and TFLOP/s by fuyou-bench's formula (docs/performance.md "FLOP
accounting": 3x the forward, attention dense over T, the LM head at the real vocabulary),
what ran (torch version, device, mode) and which SDPA backend ran (the attention operators a
profiled step after the timed ones called: flash, efficient, cudnn or math).

gemm: bf16 x bf16 -> bf16 matrix products with fp32 accumulation (torch.matmul, which reaches
cuBLASLt with its own workspace) at the layer's shapes for --tokens rows: forward (X W^T),
input gradient (dY W) and weight gradient (dY^T X) of QKV, the attention projection, MLP up,
MLP down and the LM head. One JSON line per shape with TFLOP/s: the ceiling the engine's own
GEMMs are compared with.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference"))
from gpt_ref import GPT, GPTConfig, SelfAttention, sdpa_forward  # noqa: E402


def forward_flops_per_token(n_layer, d_model, d_ff, vocab, seq):
    """fuyou-bench's formula (src/model: forward_flops_per_token, gpt2 family)."""
    c, f, t = d_model, d_ff, seq
    per_layer = 2 * c * 3 * c + 2 * t * c + 2 * t * c + 2 * c * c + 2 * c * f + 2 * f * c
    return n_layer * per_layer + 2 * c * vocab


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def init_like_engine(model, n_layer, vocab):
    """The engine's initialisation (src/model/gpt.cc, init_gpt_group): 2-D weights normal with
    std 0.02, the residual projections 0.02 / sqrt(2 L), the padded embedding rows zero,
    LayerNorm weights 1, biases 0."""
    resid_std = 0.02 / math.sqrt(2 * n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=resid_std if name.endswith("c_proj.weight") else 0.02)
            elif name.endswith("weight"):  # ln_1, ln_2, ln_f
                torch.nn.init.ones_(p)
            else:
                torch.nn.init.zeros_(p)
        model.wte.weight[vocab:].zero_()


class PeerStep(torch.nn.Module):
    """The model and its loss as one module, so that torch.compile takes both in one graph."""

    def __init__(self, model, vocab):
        super().__init__()
        self.model = model
        self.vocab = vocab

    def forward(self, tokens):
        logits = self.model(tokens[:, :-1])[..., :self.vocab]  # the padded columns left out
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))


SDPA_OPS = (("cudnn", "cudnn_attention"), ("flash", "flash_attention"), ("efficient", "efficient_attention"),
            ("math", "attention_math"))


def sdpa_backends(step):
    """The SDPA implementations one call of `step` ran: the aten attention operators a profiler
    sees (eager and Inductor both reach them through the dispatcher)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        sync()
    names = sorted({e.key for e in prof.key_averages() if "attention" in e.key and e.key.startswith("aten::")})
    ran = [label for label, op in SDPA_OPS if any(op in n for n in names)]
    return ran, names


def train_mode(args, mode):
    dev = torch.device(args.device)
    vocab = args.vocab
    padded = (vocab + args.pad_vocab - 1) // args.pad_vocab * args.pad_vocab
    cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model, d_ff=args.d_ff,
                    vocab_size=padded, seq_len=args.seq)
    has_sdpa = hasattr(F, "scaled_dot_product_attention")  # torch >= 2.0
    if has_sdpa:
        SelfAttention.forward = sdpa_forward
    torch.manual_seed(1234)
    model = GPT(cfg).to(dev)
    init_like_engine(model, args.n_layer, vocab)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    extra = {"fused": True} if dev.type == "cuda" else {}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, **extra)
    run = PeerStep(model, vocab)
    compile_mode = {"eager": None, "compile": "default", "autotune": "max-autotune-no-cudagraphs"}[mode]
    if compile_mode:
        run = torch.compile(run, mode=compile_mode)
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), device=dev)
    amp = torch.autocast(device_type=dev.type, dtype=torch.bfloat16)

    def step():
        with amp:
            loss = run(tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t_compile = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync()
    warm_s = time.perf_counter() - t_compile
    times = []
    loss = None
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    sdpa_ran, sdpa_ops = sdpa_backends(step) if has_sdpa else ([], [])
    tok = args.batch * args.seq
    flops = 3 * forward_flops_per_token(args.n_layer, args.d_model, args.d_ff, vocab, args.seq)
    out = {
        "peer": "pytorch", "mode": mode, "compiled": compile_mode is not None, "compile_mode": compile_mode,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "shape": {"n_layer": args.n_layer, "n_head": args.n_head, "d_model": args.d_model, "d_ff": args.d_ff,
                  "vocab": vocab, "padded_vocab": padded, "seq": args.seq, "micro_batch": args.batch},
        "recipe": "fp32 params initialised as the engine, bf16 autocast, the loss in the model's module (one graph when compiled), clip 1.0, "
                  "AdamW " + ("fused on the device" if extra else "foreach"),
        "attention": "scaled_dot_product_attention" if has_sdpa else "explicit softmax (torch < 2.0)",
        "sdpa_backend": sdpa_ran, "sdpa_ops": sdpa_ops,
        "step_s": step_s, "step_s_all": times, "warmup_s": warm_s,
        "tokens_per_s": tok / step_s, "tflops": flops * tok / step_s / 1e12,
        "loss": float(loss.item()),
        "peak_mem_gb": torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None,
    }
    print(json.dumps(out), flush=True)


def gemm(args):
    dev = torch.device(args.device)
    c, f, v, n = args.d_model, args.d_ff, args.vocab, args.tokens
    # (name, rows, inner, cols) of Y(rows, cols) = A(rows, inner) B(inner, cols)
    shapes = []
    for name, k_in, k_out in (("qkv", c, 3 * c), ("attn_proj", c, c), ("mlp_up", c, f), ("mlp_down", f, c),
                              ("head", c, v)):
        shapes += [(name + ".fwd", n, k_in, k_out), (name + ".dx", n, k_out, k_in), (name + ".dw", k_out, n, k_in)]
    if dev.type == "cuda":  # fp32 accumulation throughout, as the engine's GEMMs
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    for name, m, k, nn_ in shapes:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, nn_, device=dev, dtype=torch.bfloat16)
        for _ in range(3):
            torch.matmul(a, b)
        sync()
        reps = max(3, min(200, int(2e12 / (2 * m * k * nn_))))
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        sync()
        s = (time.perf_counter() - t0) / reps
        print(json.dumps({"peer": "pytorch-matmul", "gemm": name, "m": m, "k": k, "n": nn_, "dtype": "bf16",
                          "seconds": s, "tflops": 2 * m * k * nn_ / s / 1e12}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["train", "gemm"])
    ap.add_argument("--mode", choices=["eager", "compile", "autotune", "best"], default="best")
    ap.add_argument("--autotune", action="store_true", help="best: also max-autotune-no-cudagraphs")
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--d-ff", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--pad-vocab", type=int, default=64, help="train: embedding rows padded to a multiple")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.what == "gemm":
        gemm(args)
        return
    if args.pad_vocab < 1:
        ap.error("--pad-vocab must be at least 1")
    modes = ["eager", "compile"] + (["autotune"] if args.autotune else []) if args.mode == "best" else [args.mode]
    for m in modes:
        try:
            train_mode(args, m)
        except Exception as e:  # compile may fail on a machine without a compiler: say so, go on
            print(json.dumps({"peer": "pytorch", "mode": m, "error": f"{type(e).__name__}: {e}"[:500]}), flush=True)
            if len(modes) == 1:
                sys.exit(1)


if __name__ == "__main__":
    main()
