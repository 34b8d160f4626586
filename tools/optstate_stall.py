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
exact moments (g = (m' - b1 m) / (1 - b1)) and asks, per element: starting from m (and v)
rounded to nearest on the int8 grid (block scale = the block's largest magnitude, blocks of
256 elements over each tensor) or to bf16, would the nearest-rounded update give back the same
stored value (and code)? That is the fraction of elements that a round-to-nearest int8 (bf16)
state would freeze at this step; and it runs a round-to-nearest int8 state along those
gradients over all the checkpoints, counting the codes that never move. For int8 or bf16 moments (a compressed run's checkpoints) it counts
the elements whose stored value (code and scale) did not change, per step and over all steps.
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


def int8_nearest(x, Q):
    """x (float64, one tensor) rounded to nearest on the int8 grid: value s q|q| / Q^2 (m:
    signed, Q 127; v: q >= 0, Q 255), s the block's largest magnitude."""
    xb, n = blocks(x)
    s = np.abs(xb).max(axis=1, keepdims=True)
    with np.errstate(all="ignore"):
        y = np.where(s > 0, np.abs(xb) / s * Q * Q, 0.0)
    y = np.minimum(y, Q * Q)
    q0 = np.floor(np.sqrt(y))
    q = np.where(y - q0 * q0 > 0.5 * (2 * q0 + 1), q0 + 1, q0)
    val = np.sign(xb) * s * q * q / (Q * Q)
    return val.reshape(-1)[:n], (np.sign(xb) * q).reshape(-1)[:n]


def fp32_counterfactual(states, b1, b2):
    """Per transition: fractions of elements whose nearest-rounded int8 / bf16 m and v would
    not move."""
    res = []
    for (m0, v0), (m1, v1) in zip(states, states[1:]):
        counts = {"elements": 0, "int8_m": 0, "int8_v": 0, "int8_m_code": 0, "int8_v_code": 0, "bf16_m": 0,
                  "bf16_v": 0, "exact_m": 0, "exact_v": 0}
        for name in m0:
            a, b = m0[name].astype(np.float64), m1[name].astype(np.float64)
            va, vb = v0[name].astype(np.float64), v1[name].astype(np.float64)
            g = (b - b1 * a) / (1 - b1)
            counts["elements"] += len(a)
            counts["exact_m"] += int(np.count_nonzero(a == b))
            counts["exact_v"] += int(np.count_nonzero(va == vb))
            qm, cm = int8_nearest(a, QM)
            qm1, cm1 = int8_nearest(b1 * qm + (1 - b1) * g, QM)
            counts["int8_m"] += int(np.count_nonzero(qm1 == qm))
            counts["int8_m_code"] += int(np.count_nonzero(cm1 == cm))
            qv, cv = int8_nearest(va, QV)
            qv1, cv1 = int8_nearest(b2 * qv + (1 - b2) * g * g, QV)
            counts["int8_v"] += int(np.count_nonzero(qv1 == qv))
            counts["int8_v_code"] += int(np.count_nonzero(cv1 == cv))
            hm, hv = bf16_nearest(a), bf16_nearest(va)
            counts["bf16_m"] += int(np.count_nonzero(bf16_nearest(b1 * hm + (1 - b1) * g) == hm))
            counts["bf16_v"] += int(np.count_nonzero(bf16_nearest(b2 * hv + (1 - b2) * g * g) == hv))
        e = counts.pop("elements")
        res.append({k: v / e for k, v in counts.items()})
    return res


def fp32_nearest_run(states, b1, b2):
    """A round-to-nearest int8 state run along the fp32 run's gradients from the first
    checkpoint: fractions of elements whose m / v code never changed over all the steps."""
    still = {"int8_m_code": 0, "int8_v_code": 0}
    elements = 0
    for name in states[0][0]:
        qm, cm = int8_nearest(states[0][0][name].astype(np.float64), QM)
        qv, cv = int8_nearest(states[0][1][name].astype(np.float64), QV)
        same_m = np.ones(len(qm), bool)
        same_v = np.ones(len(qv), bool)
        for (m0, _), (m1, _) in zip(states, states[1:]):
            a, b = m0[name].astype(np.float64), m1[name].astype(np.float64)
            g = (b - b1 * a) / (1 - b1)
            qm, cm1 = int8_nearest(b1 * qm + (1 - b1) * g, QM)
            qv, cv1 = int8_nearest(b2 * qv + (1 - b2) * g * g, QV)
            same_m &= cm1 == cm
            same_v &= cv1 == cv
            cm, cv = cm1, cv1
        still["int8_m_code"] += int(same_m.sum())
        still["int8_v_code"] += int(same_v.sum())
        elements += len(same_m)
    return dict({k: v / elements for k, v in still.items()}, elements=elements)


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
        out["unchanged_over_all_steps_if_nearest"] = fp32_nearest_run(states, b1, b2)
    else:
        per, still = stored_unchanged(states, fmt)
        out["per_step_stored_unchanged"] = per
        out["mean_stored_unchanged"] = {k: float(np.mean([p[k] for p in per])) for k in per[0]}
        out["unchanged_over_all_steps"] = still
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
