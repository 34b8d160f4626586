#!/usr/bin/python3
"""Fine-tuning parity of the optimizer's state formats (optimizer.state, optimizer.master).

    tools/optstate_parity.py --bin BUILD_DIR --work DIR [--steps 2000] [--seeds 1,2,3]
                             [--modes fp32,bf16,int8,int8-split] [--pretrain-steps 400]
                             [--svg docs/optim_state_parity.svg] [--report-only]

A 22M-parameter GPT-2-style model (7 layers, d_model 512, context 64 bytes, byte-level
tokens, bf16 device tensors and GEMMs) is pretrained once on Debian's fortunes (fp32 state), then fine-tuned on
another text (Python's reference manual topics, pydoc_data/topics.py) for --steps steps in
each state format and seed (the seed draws the data order). Every run is a plain fuyou-train
run directory under --work; a run with summary.json is not run again, so the script resumes
where it stopped. It prints each run's final validation loss, each format's mean against
fp32's, whether any run diverged (a non-finite loss, or a final validation loss above its
first), and writes the validation curves (mean over the seeds done) as an SVG.
Exit status 1 when a format's mean final validation loss is more than 1% above fp32's or a run
diverged.
"""
import argparse
import json
import math
import os
import subprocess
import sys

MODES = {
    "fp32": ("fp32", "fp32"),
    "bf16": ("bf16", "fp32"),
    "int8": ("int8", "fp32"),
    "int8-split": ("int8", "split"),
    "bf16-split": ("bf16", "split"),
}

MODEL = ("model: {family: gpt2, n_layer: 7, n_head: 8, d_model: 512, d_ff: 2048, vocab_size: 256, "
         "seq_len: 64, init_std: 0.02}\n")
RUNTIME = "runtime: {device_tensors: bf16, precision: bf16, seed: 1}\n"
PRETRAIN_TEXT = "/usr/share/games/fortunes"
FINETUNE_TEXT = "/usr/lib/python3.11/pydoc_data/topics.py"


def run(cmd, log):
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}); see {log}")


def train(args, run_dir, config_text, sets):
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        return
    os.makedirs(args.work, exist_ok=True)
    cfg = run_dir + ".yaml"
    with open(cfg, "w") as f:
        f.write(config_text)
    cmd = [os.path.join(args.bin, "fuyou-train"), "--config", cfg]
    for s in sets:
        cmd += ["--set", s]
    if os.path.exists(os.path.join(run_dir, "checkpoints", "latest")):
        cmd = [os.path.join(args.bin, "fuyou-train"), "--resume", run_dir]
    else:
        subprocess.run(["rm", "-rf", run_dir])
        cmd += ["--run-dir", run_dir]
    run(cmd, os.path.join(args.work, "log.txt"))


def val_curve(run_dir):
    pts = []
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return pts
    for line in open(path):
        j = json.loads(line)
        if j.get("type") == "val":
            pts.append((j["step"], j["val_loss"]))
    return pts


def svg(curves, path, steps):
    """curves: {mode: [(step, loss)]}: one polyline per mode, axes with ticks."""
    W, H, L, R, T, B = 720, 420, 70, 150, 20, 50
    allp = [p for c in curves.values() for p in c]
    if not allp:
        return
    ymin = min(p[1] for p in allp)
    ymax = max(p[1] for p in allp)
    pad = (ymax - ymin) * 0.05 or 0.01
    ymin, ymax = ymin - pad, ymax + pad
    sx = lambda s: L + (W - L - R) * s / max(steps, 1)  # noqa: E731
    sy = lambda v: T + (H - T - B) * (ymax - v) / (ymax - ymin)  # noqa: E731
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect x="0" y="0" width="{W}" height="{H}" fill="white"/>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>']
    for i in range(6):
        v = ymin + (ymax - ymin) * i / 5
        out.append(f'<text x="{L - 6}" y="{sy(v) + 4:.1f}" text-anchor="end">{v:.3f}</text>')
        out.append(f'<line x1="{L}" y1="{sy(v):.1f}" x2="{W - R}" y2="{sy(v):.1f}" stroke="#ddd"/>')
    for i in range(5):
        s = steps * i / 4
        out.append(f'<text x="{sx(s):.1f}" y="{H - B + 18}" text-anchor="middle">{int(s)}</text>')
    out.append(f'<text x="{(L + W - R) / 2}" y="{H - 10}" text-anchor="middle">fine-tuning step</text>')
    out.append(f'<text x="16" y="{(T + H - B) / 2}" transform="rotate(-90 16 {(T + H - B) / 2})" '
               'text-anchor="middle">validation loss (nats per byte)</text>')
    for i, (mode, pts) in enumerate(curves.items()):
        c = colors[i % len(colors)]
        poly = " ".join(f"{sx(s):.1f},{sy(v):.1f}" for s, v in pts)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{poly}"/>')
        out.append(f'<text x="{W - R + 10}" y="{T + 16 * (i + 1)}" fill="{c}">{mode}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--pretrain-steps", type=int, default=400)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--modes", default="fp32,bf16,int8,int8-split")
    ap.add_argument("--svg", default="")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    modes = args.modes.split(",")
    base = os.path.join(args.work, "pretrain")
    if not args.report_only:
        train(args, base, MODEL + RUNTIME +
              f"data: {{text: [{PRETRAIN_TEXT}], val_fraction: 0.05, tokenizer: byte}}\n"
              "optimizer: {lr: 1.0e-3, min_lr: 1.0e-4, weight_decay: 0.1, grad_clip: 1.0}\n"
              f"schedule: {{steps: {args.pretrain_steps}, warmup_steps: 40, micro_batch: 4, eval_every: 100, "
              "eval_batches: 16, log_every: 50}\n"
              "checkpoint: {every_steps: 100}\n", [])
        # Seeds outermost: every format gets its first seed before any gets a second.
        for seed in seeds:
            for mode in modes:
                state, master = MODES[mode]
                train(args, os.path.join(args.work, f"ft-{mode}-s{seed}"),
                      RUNTIME + f"model: {{checkpoint: {base}}}\n"
                      f"data: {{text: [{FINETUNE_TEXT}], val_fraction: 0.05, tokenizer: byte}}\n"
                      "optimizer: {lr: 3.0e-4, min_lr: 3.0e-5, weight_decay: 0.0, grad_clip: 1.0}\n"
                      f"schedule: {{steps: {args.steps}, warmup_steps: 60, micro_batch: 1, eval_every: 200, "
                      "eval_batches: 32, log_every: 100}\n"
                      "checkpoint: {every_steps: 500}\n",
                      [f"runtime.seed={seed}", f"optimizer.state={state}", f"optimizer.master={master}"])
    # Report.
    finals, curves, diverged = {}, {}, []
    for mode in modes:
        runs = []
        for seed in seeds:
            d = os.path.join(args.work, f"ft-{mode}-s{seed}")
            c = val_curve(d)
            if not os.path.exists(os.path.join(d, "summary.json")) or not c or c[-1][0] != args.steps:
                continue
            if any(not math.isfinite(v) for _, v in c) or c[-1][1] > c[0][1]:
                diverged.append(f"{mode} seed {seed}")
            runs.append((seed, c))
        if not runs:
            continue
        finals[mode] = {seed: c[-1][1] for seed, c in runs}
        steps_ = [s for s, _ in runs[0][1]]
        curves[mode] = [(s, sum(dict(c)[s] for _, c in runs) / len(runs)) for s in steps_]
    ok = True
    ref = finals.get("fp32", {})
    print(f"{'format':12} {'seeds':>5} {'final val loss (mean)':>22} {'vs fp32':>9}   per seed")
    for mode, f in finals.items():
        mean = sum(f.values()) / len(f)
        common = [s for s in f if s in ref]
        rel = (sum(f[s] for s in common) / sum(ref[s] for s in common) - 1) if common else float("nan")
        per = ", ".join(f"s{s} {v:.4f}" for s, v in sorted(f.items()))
        print(f"{mode:12} {len(f):5d} {mean:22.4f} {rel * 100:+8.2f}%   {per}")
        if mode != "fp32" and not (rel <= 0.01):
            ok = False
    missing = [f"{m} s{s}" for m in modes for s in seeds if s not in finals.get(m, {})]
    if missing:
        print("not run (or not finished):", ", ".join(missing))
    if diverged:
        print("diverged:", ", ".join(diverged))
        ok = False
    if args.svg and curves:
        svg(curves, args.svg, args.steps)
        print("curves:", args.svg)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
