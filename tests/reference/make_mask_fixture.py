#!/usr/bin/python3
"""Write the PyTorch reference for loss masks (prompt/completion training).

Run:  /usr/bin/python3 tests/reference/make_mask_fixture.py
(Debian's python3-torch; the output is byte-identical on every rerun.)

It starts from the existing tiny_b fixture (its initial weights, its batch and its training
batches, read from fixtures/tiny_b.safetensors, so nothing is duplicated) and adds loss masks:
a target whose mask is 0 is set to -1 and PyTorch's cross_entropy(ignore_index=-1) leaves it
out of the mean and of the gradient. Over a step of grad_accum micro-batches the loss is the
mean over the counted targets of the concatenated micro-batches (what the engine computes).

fixtures/mask/tiny_b_mask.safetensors holds:
  __metadata__        the tiny_b metadata, plus source = tiny_b.safetensors
  mask                I32 (B, T): 1 where tokens[:, t+1] counts as a target (row 1 all 0)
  loss                F32 [1], mean cross-entropy over the counted targets
  grad.<name>         d loss / d param at tiny_b's initial weights
  train.mask          I32 (steps, grad_accum, B, T) for tiny_b's train.tokens; rows have a
                      random "prompt" prefix masked out, some rows are all masked, and one
                      micro-batch (step 3, k 1) is entirely masked
  train.losses        F32 (steps): loss of each step before its update
  train.grad_norms    F32 (steps): global L2 grad norm before clipping
"""

import json
import os
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpt_ref import GPT, GPTConfig, adamw_param_groups, lr_at, param_names  # noqa: E402
from make_fixtures import BETA1, BETA2, EPS, WEIGHT_DECAY, clip_or_norm, write_safetensors  # noqa: E402

SOURCE = os.path.join(HERE, "fixtures", "tiny_b.safetensors")
OUT = os.path.join(HERE, "fixtures", "mask", "tiny_b_mask.safetensors")
MASK_SEED = 2468


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__")
    out = {}
    for name, h in header.items():
        dt = {"F32": "<f4", "I32": "<i4"}[h["dtype"]]
        b, e = h["data_offsets"]
        out[name] = torch.from_numpy(np.frombuffer(data[b:e], dtype=dt).reshape(h["shape"]).copy())
    return meta, out


def prompt_masks(gen, shape, T):
    """Per row a random prompt length p in [0, T]: targets t < p are masked (p = T: all)."""
    p = torch.randint(0, T + 1, shape, generator=gen)
    return (torch.arange(T)[None, :] >= p.reshape(-1, 1)).reshape(*shape, T).to(torch.int32)


def masked_loss(model, tokens, mask):
    """tokens (..., B, T+1), mask (..., B, T): logits and the mean over counted targets."""
    tokens = tokens.long().reshape(-1, tokens.shape[-1])
    inp, tgt = tokens[:, :-1], tokens[:, 1:].clone()
    tgt[mask.reshape(tgt.shape) == 0] = -1
    logits = model(inp)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-1)
    return logits, loss


def main():
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    meta, src = read_safetensors(SOURCE)
    cfg = GPTConfig(n_layer=int(meta["n_layer"]), n_head=int(meta["n_head"]),
                    d_model=int(meta["d_model"]), d_ff=int(meta["d_ff"]),
                    vocab_size=int(meta["vocab_size"]), seq_len=int(meta["seq_len"]))
    B, T, A = int(meta["batch"]), cfg.seq_len, int(meta["grad_accum"])
    steps, warmup = int(meta["steps"]), int(meta["warmup"])
    max_lr, min_lr, clip = float(meta["lr"]), float(meta["min_lr"]), float(meta["clip"])
    names = param_names(cfg.n_layer)

    model = GPT(cfg)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in names:
            params[n].copy_(src["param." + n])

    gen = torch.Generator().manual_seed(MASK_SEED)
    tokens, train_tokens = src["tokens"], src["train.tokens"]
    mask = prompt_masks(gen, (B,), T)
    mask[1] = 0  # a row with nothing counted
    train_mask = prompt_masks(gen, (steps, A, B), T)
    train_mask[3, 1] = 0  # a micro-batch with nothing counted

    model.zero_grad(set_to_none=True)
    _, loss = masked_loss(model, tokens, mask)
    loss.backward()
    grads = [(n, params[n].grad.detach().clone()) for n in names]

    model.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(adamw_param_groups(model, WEIGHT_DECAY), lr=max_lr,
                            betas=(BETA1, BETA2), eps=EPS, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        # All micro-batches of the step in one cross_entropy: the mean over the step's counted
        # targets, the normaliser the engine uses.
        _, step_loss = masked_loss(model, train_tokens[step], train_mask[step])
        step_loss.backward()
        losses.append(step_loss.detach())
        norms.append(clip_or_norm(model, clip))
        lr = lr_at(step, max_lr, min_lr, warmup, steps)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()

    tensors = [("mask", mask), ("loss", loss.detach().reshape(1))]
    tensors += [("grad." + n, t) for n, t in grads]
    tensors += [("train.mask", train_mask), ("train.losses", torch.stack(losses)),
                ("train.grad_norms", torch.stack(norms))]
    meta = dict(meta, source=os.path.basename(SOURCE), mask_seed=MASK_SEED)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    write_safetensors(OUT, tensors, meta)
    print(f"loss {loss.item():.7f} over {int(mask.sum())} of {B * T} targets")
    print("train losses " + " ".join(f"{l.item():.6f}" for l in losses))
    print("counted per step " + " ".join(str(int(m.sum())) for m in train_mask))
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
