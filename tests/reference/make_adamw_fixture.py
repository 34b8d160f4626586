"""Writes tests/reference/fixtures/adamw/adamw.safetensors: torch.optim.AdamW over several
steps, for the engine's optimizer kernel to match to 1e-6 relative.

Two parameter groups (weight decay 0.1 and 0.0), bias correction, a learning rate that
changes every step, gradients of varied magnitude. Stored: initial params, the gradient of
every step, the lr of every step, and after the last step the params and both moments.

Run with Debian's torch: /usr/bin/python3 tests/reference/make_adamw_fixture.py
"""
import json
import os
import struct

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures", "adamw", "adamw.safetensors")


def write_safetensors(path, tensors, metadata):
    header = {"__metadata__": metadata}
    blobs, offset = [], 0
    for name, t in tensors:
        t = t.contiguous()
        data = t.numpy().tobytes()
        dtype = {torch.float32: "F32", torch.int32: "I32"}[t.dtype]
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def main():
    g = torch.Generator().manual_seed(42)
    steps = 6
    n_decay, n_plain = 5000, 1003
    lrs = [1e-3 * (0.5 + 0.1 * s) for s in range(steps)]
    p_decay = torch.nn.Parameter(torch.randn(n_decay, generator=g) * 0.05)
    p_plain = torch.nn.Parameter(torch.randn(n_plain, generator=g) * 0.05)
    init = [p_decay.detach().clone(), p_plain.detach().clone()]
    opt = torch.optim.AdamW(
        [{"params": [p_decay], "weight_decay": 0.1}, {"params": [p_plain], "weight_decay": 0.0}],
        lr=lrs[0], betas=(0.9, 0.95), eps=1e-8, foreach=False)
    grads = []
    for s in range(steps):
        # Magnitudes from 1e-6 to 1e1 so both the eps term and large moments are exercised.
        scale = torch.pow(10.0, torch.empty(n_decay + n_plain).uniform_(-6, 1, generator=g))
        gr = torch.randn(n_decay + n_plain, generator=g) * scale
        grads.append(gr.clone())
        p_decay.grad = gr[:n_decay].clone()
        p_plain.grad = gr[n_decay:].clone()
        for group in opt.param_groups:
            group["lr"] = lrs[s]
        opt.step()
    tensors = [("init.decay", init[0]), ("init.plain", init[1]),
               ("grads", torch.stack(grads)), ("lrs", torch.tensor(lrs, dtype=torch.float32)),
               ("final.decay", p_decay.detach()), ("final.plain", p_plain.detach()),
               ("m.decay", opt.state[p_decay]["exp_avg"]), ("m.plain", opt.state[p_plain]["exp_avg"]),
               ("v.decay", opt.state[p_decay]["exp_avg_sq"]), ("v.plain", opt.state[p_plain]["exp_avg_sq"])]
    meta = {"beta1": "0.9", "beta2": "0.95", "eps": "1e-08", "weight_decay": "0.1",
            "steps": str(steps), "torch_version": torch.__version__}
    write_safetensors(OUT, tensors, meta)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
