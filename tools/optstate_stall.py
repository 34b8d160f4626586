#!/usr/bin/python3
"""Does quantised Adam state stall? Measured on consecutive training checkpoints.

    tools/optstate_stall.py CKPT_0 CKPT_1 [CKPT_2 ...]

CKPT_i are checkpoints of one run at consecutive steps (RUN/checkpoints/step-N, N+1, ...:
resume a run with --set checkpoint.every_steps=1 for a few steps). The known failure of
quantised moments: an update smaller than half the grid step at the stored value rounds back
to that value, so the stored moment stops following the gradients (m stays, v stays large
and shrinks the step). The engine rounds the moments stochastically (docs/precision.md), which
keeps each stored value's expectation equal to the exact update; this script measures how
often the stored value does not move at all, and what round-to-nearest would have done.

For fp32 moments (an fp32-state run's checkpoints) it recovers each step's gradient from the
exact moments (g = (m' - b1 m) / (1 - b1)) and asks, per element and step: would an int8
state (the engine's grid, v through its root; blocks of 256 over each tensor) or a bf16 state
rounded to nearest from the exact moments give back the same code (value)? Then it runs int8
moments along those gradients over all the checkpoints, once rounded to nearest and once
stochastically: the codes that never moved, and how far the moments end from the exact ones
(a stalled v stays too large: its sum ratio - 1). For int8 or bf16 moments (a compressed
run's checkpoints) it counts the elements whose stored value (int8: code, and code and scale)
did not change, per step and over all steps.
Prints one JSON object.
"""
import json
import os
import struct
import sys

import numpy as np

BLOCK = 256
QM, QV = 127.0, 255.0


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        meta = header.pop("__metadata__", {})
        out = {}
        for name, info in header.items():
            b, e = info["data_offsets"]
            f.seek(base + b)
            dt = {"F32": np.float32, "U8": np.uint8, "BF16": np.uint16}[info["dtype"]]
            out[name] = np.frombuffer(f.read(e - b), dtype=dt)
    return meta, out


def betas(ckpt):
    b1, b2 = 0.9, 0.95
    for line in open(os.path.join(ckpt, "config.yaml")):
        s = line.strip()
        if s.startswith("beta1:"):
            b1 = float(s.split(":")[1])
        if s.startswith("beta2:"):
            b2 = float(s.split(":")[1])
    return b1, b2


def bf16_values(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def bf16_nearest(x):
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return (r.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def blocks(x):
    pad = (-len(x)) % BLOCK
    return np.concatenate([x, np.zeros(pad)]).reshape(-1, BLOCK), len(x)


def int8_round(x, Q, u=None):
    """x (float64, one tensor) on the int8 grid: value s q|q| / Q^2 (Q 127 signed for m; Q 255
    for v's root), s the block's largest magnitude; rounded to nearest (u None) or
    stochastically with variates u, as the engine does. Returns (values, signed codes)."""
    xb, n = blocks(x)
    s = np.abs(xb).max(axis=1, keepdims=True)
    with np.errstate(all="ignore"):
        y = np.where(s > 0, np.abs(xb) / s * Q * Q, 0.0)
    y = np.minimum(y, Q * Q)
    q0 = np.floor(np.sqrt(y))
    uu = 0.5 if u is None else blocks(u)[0]
    q = np.minimum(np.where(uu * (2 * q0 + 1) < y - q0 * q0, q0 + 1, q0), Q)
    val = np.sign(xb) * s * q * q / (Q * Q)
    return val.reshape(-1)[:n], (np.sign(xb) * q).reshape(-1)[:n]


class Int8Moments:
    """One tensor's m and v in the engine's int8 form (v through its root), updated from
    gradients with either rounding."""

    def __init__(self, m, v, rng):
        self.rng = rng
        self.m, self.cm = self.enc(m, QM)
        w, self.cv = self.enc(np.sqrt(v), QV)
        self.v = w * w

    def enc(self, x, Q):
        return int8_round(x, Q, None if self.rng is None else self.rng.random(len(x)))

    def step(self, g, b1, b2):
        m, cm = self.enc(b1 * self.m + (1 - b1) * g, QM)
        w, cv = self.enc(np.sqrt(b2 * self.v + (1 - b2) * g * g), QV)
        moved = (cm != self.cm, cv != self.cv)
        self.m, self.cm, self.v, self.cv = m, cm, w * w, cv
        return moved


def fp32_counterfactual(states, b1, b2):
    """Per transition, from the exact moments: fractions of elements whose round-to-nearest
    int8 / bf16 m and v (from the exact ones) would not move (int8: the code; the value moves
    with the block's scale too)."""
    res = []
    for (m0, v0), (m1, _) in zip(states, states[1:]):
        c = {"int8_m_code": 0, "int8_v_code": 0, "bf16_m": 0, "bf16_v": 0}
        e = 0
        for name in m0:
            a, b, va = m0[name].astype(np.float64), m1[name].astype(np.float64), v0[name].astype(np.float64)
            g = (b - b1 * a) / (1 - b1)
            st = Int8Moments(a, va, None)
            moved_m, moved_v = st.step(g, b1, b2)
            c["int8_m_code"] += int(np.count_nonzero(~moved_m))
            c["int8_v_code"] += int(np.count_nonzero(~moved_v))
            hm, hv = bf16_nearest(a), bf16_nearest(va)
            c["bf16_m"] += int(np.count_nonzero(bf16_nearest(b1 * hm + (1 - b1) * g) == hm))
            c["bf16_v"] += int(np.count_nonzero(bf16_nearest(b2 * hv + (1 - b2) * g * g) == hv))
            e += len(a)
        res.append({k: v / e for k, v in c.items()})
    return res


def fp32_simulated_runs(states, b1, b2):
    """int8 moments run along the fp32 run's gradients from the first checkpoint, with
    round-to-nearest and with stochastic rounding: the codes that never moved, and how far the
    int8 moments end from the exact ones (v: sum ratio - 1, the bias a stalled v leaves; m:
    relative L1 error)."""
    out = {}
    for mode, rng in (("nearest", None), ("stochastic", np.random.default_rng(1))):
        still_m = still_v = e = 0
        vs = ve = md = me = 0.0
        for name in states[0][0]:
            st = Int8Moments(states[0][0][name].astype(np.float64), states[0][1][name].astype(np.float64), rng)
            sm = np.ones(len(st.m), bool)
            sv = np.ones(len(st.m), bool)
            for (m0, _), (m1, _) in zip(states, states[1:]):
                a, b = m0[name].astype(np.float64), m1[name].astype(np.float64)
                moved_m, moved_v = st.step((b - b1 * a) / (1 - b1), b1, b2)
                sm &= ~moved_m
                sv &= ~moved_v
            exact_m, exact_v = states[-1][0][name].astype(np.float64), states[-1][1][name].astype(np.float64)
            still_m += int(sm.sum())
            still_v += int(sv.sum())
            e += len(sm)
            vs += st.v.sum()
            ve += exact_v.sum()
            md += np.abs(st.m - exact_m).sum()
            me += np.abs(exact_m).sum()
        out[mode] = {"m_code_never_moved": still_m / e, "v_code_never_moved": still_v / e,
                     "v_sum_ratio_minus_1": vs / ve - 1, "m_rel_l1_error": md / me}
    return out


def stored_unchanged(states, fmt):
    """Per transition and over all: fractions of elements whose stored m / v did not change."""
    res, still, elems = [], {}, 0
    for (m0, v0), (m1, v1) in zip(states, states[1:]):
        same = {}
        for kind, s0, s1 in (("m", m0, m1), ("v", v0, v1)):
            codes, values = [], []
            for name in sorted(k for k in s0 if not k.endswith(".scale")):
                eq = s0[name] == s1[name]
                codes.append(eq)
                if fmt == "int8":
                    eq = eq & np.repeat(s0[name + ".scale"] == s1[name + ".scale"], BLOCK)[: len(eq)]
                values.append(eq)
            same[kind] = np.concatenate(values)
            if fmt == "int8":
                same[kind + "_code"] = np.concatenate(codes)
        elems = len(same["m"])
        for k, x in same.items():
            still[k] = x if k not in still else still[k] & x
        res.append({k: float(x.mean()) for k, x in same.items()})
    return res, dict({k: float(x.mean()) for k, x in still.items()}, elements=elems)


def main():
    ckpts = sys.argv[1:]
    if len(ckpts) < 2:
        raise SystemExit(__doc__)
    b1, b2 = betas(ckpts[0])
    states, fmt, steps = [], None, []
    for c in ckpts:
        meta, t = read_safetensors(os.path.join(c, "optimizer.safetensors"))
        fmt = meta.get("moments", "fp32")
        steps.append(int(meta.get("step", -1)))
        m = {k[len("adam_m."):]: x for k, x in t.items() if k.startswith("adam_m.")}
        v = {k[len("adam_v."):]: x for k, x in t.items() if k.startswith("adam_v.")}
        states.append((m, v))
    out = {"checkpoints": ckpts, "steps": steps, "moments": fmt, "beta1": b1, "beta2": b2}
    if fmt == "fp32":
        per = fp32_counterfactual(states, b1, b2)
        out["per_step_unchanged_if_nearest"] = per
        out["mean_unchanged_if_nearest"] = {k: float(np.mean([p[k] for p in per])) for k in per[0]}
        out["int8_runs_along_these_gradients"] = fp32_simulated_runs(states, b1, b2)
    else:
        per, still = stored_unchanged(states, fmt)
        out["per_step_stored_unchanged"] = per
        out["mean_stored_unchanged"] = {k: float(np.mean([p[k] for p in per])) for k in per[0]}
        out["unchanged_over_all_steps"] = still
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
