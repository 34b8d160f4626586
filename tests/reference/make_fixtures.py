#!/usr/bin/python3
"""Write the PyTorch reference fixtures the C++ tests load.

Run:  /usr/bin/python3 tests/reference/make_fixtures.py
(Debian's python3-torch; the output is byte-identical on every rerun.)

Each fixture tests/reference/fixtures/<name>.safetensors holds, for one small
GPT-2 config (model in gpt_ref.py):
  __metadata__            config + optimizer settings + torch version (strings)
  param.<name>            initial weights (F32)
  tokens                  I32 (B, T+1): inputs tokens[:, :T], targets tokens[:, 1:]
  logits                  F32 (B, T, V) at the initial weights
  loss                    F32 [1], mean cross-entropy over all B*T positions
  grad.<name>             d loss / d param at the initial weights
  train.tokens            I32 (steps, grad_accum, B, T+1)
  train.losses            F32 (steps): mean of the micro-batch losses, before the update
  train.grad_norms        F32 (steps): global L2 grad norm before clipping (extra, for debugging)
  train.lrs               F32 (steps): lr used at each step (extra, for debugging)
  final.<name>            weights after `steps` AdamW steps
"""

import json
import math
import os
import struct
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_ref import GPT, GPTConfig, adamw_param_groups, init_weights, lr_at, param_names  # noqa: E402

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")

FIXTURES = [
    dict(name="tiny_a", seed=1234, n_layer=2, n_head=4, d_model=64, d_ff=256, vocab_size=97,
         seq_len=16, batch=2, grad_accum=1, clip=0.0, lr=1e-3),
    dict(name="tiny_b", seed=5678, n_layer=3, n_head=2, d_model=48, d_ff=128, vocab_size=61,
         seq_len=24, batch=3, grad_accum=2, clip=1.0, lr=3e-3),
    # Extra: tiny_b with its 10 pre-clip grad norms in 0.54..0.92, clip 1.0 never fires.
    # Same seed/tokens with clip 0.7 clips the early steps and not the later ones,
    # so both branches of global-norm clipping are exercised.
    dict(name="tiny_b_clip", seed=5678, n_layer=3, n_head=2, d_model=48, d_ff=128, vocab_size=61,
         seq_len=24, batch=3, grad_accum=2, clip=0.7, lr=3e-3),
]
STEPS = 10
WARMUP = 3
BETA1, BETA2 = 0.9, 0.95
EPS = 1e-8
WEIGHT_DECAY = 0.1


# --------------------------------------------------------------------------- safetensors
def clip_or_norm(model, clip):
    """The global gradient norm before clipping (as the engine reports it), clipping in place
    when clip > 0, as a float32 scalar."""
    if clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    else:
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    return norm.detach().to(torch.float32)


def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, torch.Tensor) in file order; F32 or I32 only."""
    header = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    blobs = []
    offset = 0
    for name, t in tensors:
        t = t.detach().contiguous().cpu()
        if t.dtype == torch.float32:
            dtype, npdt = "F32", "<f4"
        elif t.dtype == torch.int32:
            dtype, npdt = "I32", "<i4"
        else:
            raise TypeError(f"{name}: unsupported dtype {t.dtype}")
        data = t.numpy().astype(npdt, copy=False).tobytes()
        assert name not in header, name
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    hdr = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hdr += b" " * ((-len(hdr)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hdr)))
        f.write(hdr)
        for b in blobs:
            f.write(b)


# --------------------------------------------------------------------------- fixture
def fixture_setup(fx):
    """A fixture's model (fp32, initialised from its seed), its single batch and training
    tokens, drawn in that order from one generator: make_bf16_fixture.py starts from the same."""
    cfg = GPTConfig(n_layer=fx["n_layer"], n_head=fx["n_head"], d_model=fx["d_model"],
                    d_ff=fx["d_ff"], vocab_size=fx["vocab_size"], seq_len=fx["seq_len"])
    B, T, V, A = fx["batch"], fx["seq_len"], fx["vocab_size"], fx["grad_accum"]
    gen = torch.Generator().manual_seed(fx["seed"])
    model = GPT(cfg)
    init_weights(model, gen)
    tokens = torch.randint(0, V, (B, T + 1), generator=gen, dtype=torch.int64).to(torch.int32)
    train_tokens = torch.randint(0, V, (STEPS, A, B, T + 1), generator=gen,
                                 dtype=torch.int64).to(torch.int32)
    names = param_names(cfg.n_layer)
    params = dict(model.named_parameters())
    init_params = [(n, params[n].detach().clone()) for n in names]
    return cfg, model, tokens, train_tokens, names, params, init_params


def make_fixture(fx):
    B, T, V, A = fx["batch"], fx["seq_len"], fx["vocab_size"], fx["grad_accum"]
    max_lr = fx["lr"]
    min_lr = max_lr / 10
    clip = fx["clip"]
    cfg, model, tokens, train_tokens, names, params, init_params = fixture_setup(fx)

    # ---- single batch: logits, loss, grads at the initial weights
    model.zero_grad(set_to_none=True)
    logits, loss = model.loss(tokens)
    loss.backward()
    grads = [(n, params[n].grad.detach().clone()) for n in names]

    # ---- training run
    model.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(adamw_param_groups(model, WEIGHT_DECAY), lr=max_lr,
                            betas=(BETA1, BETA2), eps=EPS, weight_decay=WEIGHT_DECAY)
    losses, norms, lrs = [], [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        micro = []
        for k in range(A):
            _, loss_k = model.loss(train_tokens[step, k])
            (loss_k / A).backward()
            micro.append(loss_k.detach())
        losses.append(torch.stack(micro).mean())
        norms.append(clip_or_norm(model, clip))
        lr = lr_at(step, max_lr, min_lr, WARMUP, STEPS)
        lrs.append(lr)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
    final = [(n, params[n].detach().clone()) for n in names]

    tensors = [("param." + n, t) for n, t in init_params]
    tensors += [("tokens", tokens), ("logits", logits.detach()), ("loss", loss.detach().reshape(1))]
    tensors += [("grad." + n, t) for n, t in grads]
    tensors += [("train.tokens", train_tokens),
                ("train.losses", torch.stack(losses)),
                ("train.grad_norms", torch.stack(norms)),
                ("train.lrs", torch.tensor(lrs, dtype=torch.float32))]
    tensors += [("final." + n, t) for n, t in final]

    metadata = dict(
        n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model, d_ff=cfg.d_ff,
        vocab_size=V, seq_len=T, batch=B, grad_accum=A, clip=repr(clip),
        lr=repr(max_lr), min_lr=repr(min_lr), warmup=WARMUP, steps=STEPS,
        beta1=repr(BETA1), beta2=repr(BETA2), eps=repr(EPS), weight_decay=repr(WEIGHT_DECAY),
        seed=fx["seed"], torch_version=torch.__version__,
    )
    os.makedirs(OUT_DIR, exist_ok=True)
    path = os.path.join(OUT_DIR, fx["name"] + ".safetensors")
    write_safetensors(path, tensors, metadata)

    print(f"{fx['name']}: loss {loss.item():.7f} (ln V = {math.log(V):.7f})")
    print(f"{fx['name']}: train losses " + " ".join(f"{l.item():.6f}" for l in losses))
    print(f"{fx['name']}: grad norms   " + " ".join(f"{n.item():.6f}" for n in norms))
    print(f"{fx['name']}: wrote {path} ({os.path.getsize(path)} bytes)")


def deterministic_torch():
    """Single-threaded, deterministic PyTorch: reruns write byte-identical fixtures."""
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)          # fixed reduction order
    torch.use_deterministic_algorithms(True)


def main():
    deterministic_torch()
    for fx in FIXTURES:
        make_fixture(fx)


if __name__ == "__main__":
    main()
