#!/usr/bin/python3
"""Write PyTorch fixtures for bf16 device tensors (runtime.device_tensors: bf16).

Run:  /usr/bin/python3 tests/reference/make_bf16_fixture.py
(Debian's python3-torch; byte-identical on every rerun.)

The recipe is PyTorch's own bf16 module path: the model's parameters cast to bf16 (round to
nearest even, as the engine rounds its fp32 master for the device), every activation a bf16
tensor, CPU bf16 kernels accumulating in fp32 inside (matmul, layer_norm, softmax), the loss
computed in fp32 from the bf16 logits, gradients in bf16; the training run keeps fp32 master
weights and AdamW state and casts them to bf16 for each step's forward, as the engine does.
PyTorch rounds at some points the engine does not (the attention scores before the softmax,
for one), so the comparison is within bf16 rounding, not bit for bit; the test states its
bound.

For each config of make_fixtures.py (the same seeds, initial weights and tokens), the file
tests/reference/fixtures/bf16/<name>.safetensors holds:
  param.<name>          initial weights (F32, as in the fp32 fixture)
  tokens                I32 (B, T+1)
  logits                F32 (B, T, V): the bf16 logits, widened
  loss                  F32 [1]
  grad.<name>           F32: the bf16 gradients of the mean loss, widened
  train.tokens          I32 (steps, grad_accum, B, T+1)
  train.losses          F32 (steps): mean of the micro-batch losses, before the update
  final.<name>          F32 master weights after `steps` AdamW steps
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_ref import GPT, adamw_param_groups, lr_at  # noqa: E402
from make_fixtures import (BETA1, BETA2, EPS, FIXTURES, STEPS, WARMUP, WEIGHT_DECAY,  # noqa: E402
                           deterministic_torch, fixture_setup, write_safetensors)

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "bf16")


def bf16_loss(model, tokens):
    """The bf16 model's logits (bf16) and its fp32 mean cross-entropy."""
    tokens = tokens.long()
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return logits, loss


def make_fixture(fx):
    B, T, V, A = fx["batch"], fx["seq_len"], fx["vocab_size"], fx["grad_accum"]
    max_lr, clip = fx["lr"], fx["clip"]
    min_lr = max_lr / 10
    # The fp32 fixture's model as the fp32 master weights, and its tokens.
    cfg, master, tokens, train_tokens, names, mp, init_params = fixture_setup(fx)

    work = GPT(cfg).to(torch.bfloat16)     # the device's bf16 working weights
    wp = dict(work.named_parameters())

    def cast_master():
        with torch.no_grad():
            for n in names:
                wp[n].copy_(mp[n].to(torch.bfloat16))

    # ---- single batch at the initial weights
    cast_master()
    work.zero_grad(set_to_none=True)
    logits, loss = bf16_loss(work, tokens)
    loss.backward()
    grads = [(n, wp[n].grad.detach().float().clone()) for n in names]

    # ---- training: bf16 forward/backward, fp32 master and AdamW
    opt = torch.optim.AdamW(adamw_param_groups(master, WEIGHT_DECAY), lr=max_lr,
                            betas=(BETA1, BETA2), eps=EPS, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        cast_master()
        work.zero_grad(set_to_none=True)
        micro = []
        for k in range(A):
            _, loss_k = bf16_loss(work, train_tokens[step, k])
            (loss_k / A).backward()
            micro.append(loss_k.detach())
        losses.append(torch.stack(micro).mean())
        for n in names:
            mp[n].grad = wp[n].grad.float()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        lr = lr_at(step, max_lr, min_lr, WARMUP, STEPS)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
    final = [(n, mp[n].detach().clone()) for n in names]

    tensors = [("param." + n, t) for n, t in init_params]
    tensors += [("tokens", tokens), ("logits", logits.detach().float()),
                ("loss", loss.detach().reshape(1))]
    tensors += [("grad." + n, t) for n, t in grads]
    tensors += [("train.tokens", train_tokens), ("train.losses", torch.stack(losses))]
    tensors += [("final." + n, t) for n, t in final]
    metadata = dict(
        n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model, d_ff=cfg.d_ff,
        vocab_size=V, seq_len=T, batch=B, grad_accum=A, clip=repr(clip),
        lr=repr(max_lr), min_lr=repr(min_lr), warmup=WARMUP, steps=STEPS,
        beta1=repr(BETA1), beta2=repr(BETA2), eps=repr(EPS), weight_decay=repr(WEIGHT_DECAY),
        seed=fx["seed"], torch_version=torch.__version__,
        recipe="bf16 parameters and activations (torch CPU bf16 ops), fp32 loss, fp32 master and AdamW",
    )
    os.makedirs(OUT_DIR, exist_ok=True)
    path = os.path.join(OUT_DIR, fx["name"] + ".safetensors")
    write_safetensors(path, tensors, metadata)
    print(f"{fx['name']} bf16: loss {loss.item():.7f}; train losses "
          + " ".join(f"{l.item():.6f}" for l in losses))
    print(f"{fx['name']} bf16: wrote {path} ({os.path.getsize(path)} bytes)")


def main():
    deterministic_torch()
    for fx in FIXTURES:
        if fx["name"] != "tiny_b_clip":  # tiny_b with another clip: nothing new for bf16
            make_fixture(fx)


if __name__ == "__main__":
    main()
