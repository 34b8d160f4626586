"""Reference GPT-2 model in PyTorch, shared by make_fixtures.py and bench_torch.py.

Architecture (what the Fuyou engine must reproduce):
  x = wte[tokens] + wpe[0:T]
  n_layer pre-LN blocks:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))
    attn: qkv = x @ c_attn.weight^T + c_attn.bias   (c_attn.weight is (3C, C))
          columns [0,C) = q, [C,2C) = k, [2C,3C) = v; head h owns columns
          h*hd .. (h+1)*hd-1 of each, hd = C / n_head.
          y_h = softmax(causal(q_h k_h^T / sqrt(hd))) v_h, heads concatenated
          in head order, then c_proj (C,C) + bias.
    mlp:  c_fc (F,C) + bias -> GELU (tanh approximation) -> c_proj (C,F) + bias
  LayerNorm: eps 1e-5, weight and bias.
  ln_f, logits = x @ wte^T (LM head tied to the token embedding),
  loss = mean cross-entropy of logits[:, t] against tokens[:, t+1].
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    n_layer: int
    n_head: int
    d_model: int
    d_ff: int
    vocab_size: int
    seq_len: int


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):
        B, T, C = x.shape
        nh = self.n_head
        hd = C // nh
        qkv = self.c_attn(x)                        # (B, T, 3C)
        q, k, v = qkv.split(C, dim=2)               # each (B, T, C)
        q = q.view(B, T, nh, hd).transpose(1, 2)    # (B, nh, T, hd)
        k = k.view(B, T, nh, hd).transpose(1, 2)
        v = v.view(B, T, nh, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))   # (B, nh, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v                                 # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


def sdpa_forward(self, x):
    """SelfAttention.forward with the attention in one fused call (torch >= 2.0): what the
    benchmarks install in place of the explicit softmax above."""
    B, T, C = x.shape
    q, k, v = self.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.c_proj = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        # Registration order fixes the parameter order (see param_names()).
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=1e-5)
        self.attn = SelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=1e-5)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=1e-5)

    def forward(self, idx):
        """idx: (B, T) int64 -> logits (B, T, V)."""
        B, T = idx.shape
        assert T <= self.cfg.seq_len
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)[None, :, :]
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return x @ self.wte.weight.t()

    def loss(self, tokens):
        """tokens: (B, T+1) integer tensor. Returns (logits, mean loss)."""
        tokens = tokens.long()
        inp, tgt = tokens[:, :-1], tokens[:, 1:]
        logits = self(inp)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        return logits, loss


def param_names(n_layer):
    """The canonical parameter order used in the fixtures."""
    names = ["wte.weight", "wpe.weight"]
    for l in range(n_layer):
        p = f"h.{l}."
        names += [
            p + "ln_1.weight", p + "ln_1.bias",
            p + "attn.c_attn.weight", p + "attn.c_attn.bias",
            p + "attn.c_proj.weight", p + "attn.c_proj.bias",
            p + "ln_2.weight", p + "ln_2.bias",
            p + "mlp.c_fc.weight", p + "mlp.c_fc.bias",
            p + "mlp.c_proj.weight", p + "mlp.c_proj.bias",
        ]
    names += ["ln_f.weight", "ln_f.bias"]
    return names


@torch.no_grad()
def init_weights(model: GPT, gen: torch.Generator):
    """Deterministic init, in canonical parameter order.

    Linear/embedding weights and all non-LayerNorm biases: N(0, 0.02).
    LayerNorm weights: 1 + N(0, 0.1); LayerNorm biases: N(0, 0.02).
    """
    params = dict(model.named_parameters())
    names = param_names(model.cfg.n_layer)
    assert list(params.keys()) == names, (list(params.keys()), names)
    for name in names:
        p = params[name]
        is_ln = name.split(".")[-2] in ("ln_1", "ln_2", "ln_f")
        if is_ln and name.endswith(".weight"):
            p.normal_(0.0, 0.1, generator=gen)
            p.add_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def adamw_param_groups(model: GPT, weight_decay: float):
    """Decay for ndim >= 2 (matrices, both embeddings), none for biases / LayerNorm."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def lr_at(step, max_lr, min_lr, warmup, steps):
    """Linear warmup for `warmup` steps, then cosine decay to min_lr at `steps`."""
    if step < warmup:
        return max_lr * (step + 1) / warmup
    progress = (step - warmup) / (steps - warmup)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
