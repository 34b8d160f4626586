#!/usr/bin/python3
"""Writes a synthetic Hugging Face GPT-2 checkpoint of GPT-2 large's shapes (774M parameters,
3.1 GB in fp32) for measuring fuyou-convert's memory use (docs/checkpoints.md):

    /usr/bin/python3 tests/reference/make_big_gpt2.py OUT_DIR [--n-layer 36] [--dtype f32|bf16]

The weights are random normals, written tensor by tensor in 64 MiB chunks so the generator
itself stays small; only numpy is needed. Delete the directory afterwards.
"""
import argparse
import json
import os
import struct

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n-layer", type=int, default=36)
    ap.add_argument("--n-embd", type=int, default=1280)
    ap.add_argument("--n-head", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--n-positions", type=int, default=1024)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    a = ap.parse_args()
    C, F, V, T = a.n_embd, 4 * a.n_embd, a.vocab, a.n_positions
    shapes = [("transformer.wte.weight", (V, C)), ("transformer.wpe.weight", (T, C))]
    for l in range(a.n_layer):
        p = "transformer.h.%d." % l
        shapes += [(p + "ln_1.weight", (C,)), (p + "ln_1.bias", (C,)),
                   (p + "attn.c_attn.weight", (C, 3 * C)), (p + "attn.c_attn.bias", (3 * C,)),
                   (p + "attn.c_proj.weight", (C, C)), (p + "attn.c_proj.bias", (C,)),
                   (p + "ln_2.weight", (C,)), (p + "ln_2.bias", (C,)),
                   (p + "mlp.c_fc.weight", (C, F)), (p + "mlp.c_fc.bias", (F,)),
                   (p + "mlp.c_proj.weight", (F, C)), (p + "mlp.c_proj.bias", (C,))]
    shapes += [("transformer.ln_f.weight", (C,)), ("transformer.ln_f.bias", (C,))]
    esize = 4 if a.dtype == "f32" else 2
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes:
        n = int(np.prod(shape)) * esize
        header[name] = {"dtype": "F32" if a.dtype == "f32" else "BF16", "shape": list(shape),
                        "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    os.makedirs(a.out, exist_ok=False)
    rng = np.random.default_rng(0)
    with open(os.path.join(a.out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for name, shape in shapes:
            left = int(np.prod(shape))
            while left:
                k = min(left, 16 << 20)
                x = (rng.standard_normal(k, dtype=np.float32) * 0.02).astype(np.float32)
                if a.dtype == "bf16":
                    x = (x.view(np.uint32) >> 16).astype(np.uint16)
                f.write(x.tobytes())
                left -= k
    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": a.n_layer,
           "n_head": a.n_head, "n_embd": C, "n_inner": None, "n_positions": T, "vocab_size": V,
           "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
           "torch_dtype": "float32" if a.dtype == "f32" else "bfloat16"}
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    print("wrote %s: %.2f GB of tensors" % (a.out, off / 1e9))


if __name__ == "__main__":
    main()
