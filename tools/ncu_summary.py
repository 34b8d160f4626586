#!/usr/bin/env python3
"""Sums an Nsight Compute run's kernel times by kernel, to tell where a step's GPU time goes.

  ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw --print-units base \
      --log-file K.csv PROGRAM ...
  python3 tools/ncu_summary.py K.csv [--steps N] [--top 40] [--wall-s S]

Prints one JSON object: per kernel (name cut at its template arguments) the launches, the total
GPU time and its share; the total kernel time divided by --steps (the steps the program ran,
warm-up included), and, given --wall-s (the program's measured step time without the
profiler), the share of the step in which no kernel ran (copies, host work, launch gaps).
"""

import argparse
import csv
import json
import sys

SCALE = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3,
         "second": 1.0, "s": 1.0}


def short(name):
    depth, out = 0, []
    for ch in name:
        if ch == "<":
            if depth == 0:
                out.append("<>")
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    s = "".join(out)
    return s.split("(")[0].strip() or name[:80]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--steps", type=float, default=1.0)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--wall-s", type=float, default=0.0)
    a = ap.parse_args()
    lines = [l for l in open(a.csv, errors="replace") if l.startswith('"')]
    if not lines:
        sys.exit(f"{a.csv}: no CSV rows (did ncu profile any kernel?)")
    rows = list(csv.reader(lines))
    head = rows[0]
    try:
        ki, ti = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
    except ValueError:
        sys.exit(f"{a.csv}: header lacks 'Kernel Name' or 'gpu__time_duration.sum': {head[:12]}")
    scale = 1e-9
    body = rows[1:]
    if body and body[0][ti] in SCALE:  # a units row
        scale = SCALE[body[0][ti]]
        body = body[1:]
    per = {}
    total = 0.0
    for r in body:
        try:
            t = float(r[ti].replace(",", "")) * scale
        except (ValueError, IndexError):
            continue
        k = short(r[ki])
        c, s = per.get(k, (0, 0.0))
        per[k] = (c + 1, s + t)
        total += t
    top = sorted(per.items(), key=lambda kv: -kv[1][1])[: a.top]
    out = {
        "kernels": sum(c for c, _ in per.values()),
        "kernel_s_per_step": total / a.steps,
        "by_kernel": [{"kernel": k, "launches_per_step": c / a.steps, "s_per_step": s / a.steps,
                       "share": s / total if total else 0.0} for k, (c, s) in top],
    }
    if a.wall_s > 0:
        out["wall_s_per_step"] = a.wall_s
        out["no_kernel_share"] = max(0.0, 1.0 - out["kernel_s_per_step"] / a.wall_s)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
