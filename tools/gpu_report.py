#!/usr/bin/env python3
"""Writes report.json and summary.md of a tools/gpu-validate.sh run from its steps table and
the JSON the benchmarks printed. Standard library only: the GPU machine has no network."""
import argparse
import json
import os
import re
import time

# Dense peak throughput of the cards the kit meets, from NVIDIA's data sheets (the H100 SXM
# column; the H200 has the same Hopper compute). bf16: tensor cores without sparsity; fp32:
# the CUDA cores (the engine's fp32 GEMMs use CUBLAS_COMPUTE_32F, no TF32).
SPEC_PEAK_TFLOPS = {
    "H100 80GB HBM3": {"bf16": 989.4, "fp32": 66.9, "source": "NVIDIA H100 data sheet, SXM"},
    "H200": {"bf16": 989.4, "fp32": 66.9, "source": "NVIDIA H200 data sheet, SXM"},
}


def read_json(path):
    """A bench's JSON: the file's last line that is a JSON object (log lines may precede it)."""
    try:
        with open(path) as f:
            lines = [l for l in f if l.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def read_json_lines(path):
    try:
        with open(path) as f:
            return [json.loads(l) for l in f if l.startswith("{")]
    except (OSError, ValueError):
        return []


def read_steps(path):
    steps = []
    for line in open(path):
        name, status, rc, secs, cmd, note = (line.rstrip("\n").split("\t") + [""] * 6)[:6]
        steps.append({"name": name, "status": status, "exit": rc, "seconds": float(secs or 0), "command": cmd,
                      "note": note})
    return steps


def device_info(work):
    try:
        lines = open(os.path.join(work, "logs", "device.log")).read().splitlines()
    except OSError:
        return None
    if len(lines) < 2:
        return None
    keys = [k.strip() for k in lines[0].split(",")]
    vals = [v.strip() for v in lines[1].split(",")]
    return dict(zip(keys, vals))


def spec_peak(device):
    name = (device or {}).get("name", "")
    for key, peak in SPEC_PEAK_TFLOPS.items():
        if key in name:
            return peak
    return None


def profile_figures(path):
    """The measured lines of a profile written by `fuyou-bench profile --backend cuda`."""
    try:
        text = open(path).read()
    except OSError:
        return None
    gemms = [{"d_model": int(m.group(1)), "size": int(m.group(2)), "inputs": m.group(3), "tflops": float(m.group(4))}
             for m in re.finditer(r"layer GEMMs at d_model (\d+) \(size (\d+), (\w+) inputs\): ([\d.e+-]+) TFLOP/s", text)]
    out = {"gemms": gemms}
    m = re.search(r"host->device ([\d.e+-]+) GB/s, device->host ([\d.e+-]+) GB/s", text)
    if m:
        out["h2d_GBps"], out["d2h_GBps"] = float(m.group(1)), float(m.group(2))
    m = re.search(r"read ([\d.e+-]+) MB/s, write ([\d.e+-]+) MB/s", text)
    if m:
        out["ssd_read_MBps"], out["ssd_write_MBps"] = float(m.group(1)), float(m.group(2))
    m = re.search(r"AdamW \(host state, fp32 in/out\): ([\d.e+-]+) M params/s", text)
    if m:
        out["adamw_Mparams_per_s"] = float(m.group(1))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", required=True)
    ap.add_argument("--plumbing", type=int, default=0)
    ap.add_argument("--root", required=True)
    ap.add_argument("--kit", required=True)
    a = ap.parse_args()

    steps = read_steps(a.steps)
    device = device_info(a.work)
    peak = spec_peak(device)
    try:
        manifest = open(os.path.join(a.kit, "MANIFEST")).read().splitlines()
    except OSError:
        manifest = []
    report = {
        "what": ("PLUMBING CHECK ON A MACHINE WITHOUT A GPU: nothing was validated on a GPU" if a.plumbing
                 else "GPU validation of the fuyou engine (tools/gpu-validate.sh)"),
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "phase": "plumbing" if a.plumbing else a.phase,
        "kit": manifest,
        "device": device,
        "steps": steps,
        "passed": all(s["status"] == "pass" for s in steps) and bool(steps),
    }
    figures = {}
    # bench-bf16-tensors: bf16 GEMMs on bf16 device tensors (the large-model recipe).
    for name, prec in (("fp32", "fp32"), ("bf16", "bf16"), ("bf16-tensors", "bf16")):
        b = read_json(os.path.join(a.work, f"bench-{name}.json"))
        if b:
            f = {k: b.get(k) for k in ("backend", "device_tensors", "tokens_per_s", "tflops", "step_s",
                                       "tokens_per_step", "device_peak_bytes")}
            if peak and b.get("tflops"):
                f["spec_peak_tflops"] = peak[prec]
                f["fraction_of_spec_peak"] = b["tflops"] / peak[prec]
            figures[f"gpt2-124m-{name}"] = f
    # The PyTorch peer on the same shapes, and the engine over its best mode (the two engine
    # runs around it, bench-bf16-tensors and bench-bf16-tensors-2, averaged).
    peer = [p for p in read_json_lines(os.path.join(a.work, "torch-peer-gpt2.jsonl")) if p.get("step_s")]
    engine = [b for b in (read_json(os.path.join(a.work, f)) for f in ("bench-bf16-tensors.json",
                                                                        "bench-bf16-tensors-2.json")) if b]
    if peer:
        best = min(peer, key=lambda p: p["step_s"])
        f = {"modes": {p["mode"]: {"step_s": p["step_s"], "tokens_per_s": p["tokens_per_s"], "tflops": p["tflops"],
                                   "sdpa_backend": p.get("sdpa_backend"), "padded_vocab": p.get("shape", {}).get(
                                       "padded_vocab")}
                       for p in peer},
             "best_mode": best["mode"], "torch": best.get("torch")}
        if engine:
            e = sum(b["step_s"] for b in engine) / len(engine)
            f["engine_step_s"] = e
            f["engine_over_best"] = best["step_s"] / e
        figures["gpt2-124m-pytorch-peer"] = f
    for name, file in (("gpt2-124m-bf16-tensors-device-adamw-step", "bench-bf16-tensors-device-step.json"),
                       ("gpt2-124m-bf16-tensors-bias-epilogue", "bench-bf16-tensors-bias-epilogue.json"),
                       ("gpt2-124m-bf16-tensors-host-adamw", "bench-bf16-tensors-host.json"),
                       ("gpt2-124m-bf16-tensors-host-adamw-step", "bench-bf16-tensors-host-step.json"),
                       ("gpt3-2.7b-device-24g", "bench-2.7b-24g.json"),
                       ("gpt3-2.7b-device-24g-int8-split", "bench-2.7b-24g-int8.json"),
                       ("gpt3-6.7b-device-24g-int8-split", "bench-6.7b-24g-int8.json"),
                       ("gpt3-6.7b-device-24g-int8-split-cuda-wait-block", "bench-6.7b-24g-int8-block.json"),
                       ("llama3-8b-4-layers-seq4096", "bench-llama-4k.json"),
                       ("llama3-8b-4-layers-seq8192", "bench-llama-8k.json")):
        b = read_json(os.path.join(a.work, file))
        if b:
            figures[name] = {k: b.get(k) for k in ("step_s", "step_s_all", "tokens_per_s", "tflops", "busy_s",
                                                  "iteration_over_busiest", "iteration_over_predicted",
                                                  "device_peak_bytes", "breakdown", "engine", "adamw") if k in b}
    # The engine's layer GEMMs over plain cuBLASLt GEMMs of the same shapes (fuyou-bench gemm).
    for name, file in (("gemm-vs-cublaslt-gpt2", "gemm-lt-gpt2.json"), ("gemm-vs-cublaslt-175b", "gemm-lt-175b.json")):
        g = read_json(os.path.join(a.work, file))
        if g:
            figures[name] = {k: g.get(k) for k in ("layer_engine_tflops", "layer_cublaslt_tflops",
                                                  "layer_engine_over_cublaslt", "layer_with_bias_kernel_tflops",
                                                  "layer_with_bias_epilogue_tflops", "shapes")}
    prof = profile_figures(os.path.join(a.out, "this-gpu.yaml"))
    if prof:
        if peak:
            for g in prof["gemms"]:
                g["fraction_of_spec_peak"] = g["tflops"] / peak.get(g["inputs"], peak["bf16"])
            prof["spec_peak"] = peak
        figures["profile"] = prof
    l175 = read_json(os.path.join(a.work, "bench-175b-layers.json"))
    if l175:
        figures["gpt3-175b-2-layers-mb16"] = {
            k: l175.get(k) for k in ("backend", "device_tensors", "step_s", "tokens_per_s", "tflops",
                                     "device_peak_bytes", "peak_rss_bytes", "offloaded", "engine", "adamw")}
    s175 = read_json(os.path.join(a.work, "bench-175b-sched.json"))
    if s175:
        figures["gpt3-175b-2-layers-mb16-scheduled"] = {
            k: s175.get(k) for k in ("backend", "step_s", "iteration_s", "busy_s", "iteration_over_busiest",
                                     "tflops", "h2d_bytes_per_step", "d2h_bytes_per_step", "device_peak_bytes",
                                     "peak_rss_bytes")}
    off16 = read_json(os.path.join(a.work, "bench-offload-bf16.json"))
    if off16:
        figures["offload-gpt3-1.3b-bf16-tensors"] = {
            k: off16.get(k) for k in ("step_s", "iteration_s", "busy_s", "iteration_over_busiest", "tflops",
                                      "tokens_per_s", "h2d_bytes_per_step", "d2h_bytes_per_step",
                                      "ssd_read_bytes_per_step", "ssd_write_bytes_per_step", "device_peak_bytes")}
    off = read_json(os.path.join(a.work, "bench-offload.json"))
    sim = read_json(os.path.join(a.work, "simulate.json"))
    if off:
        o = {k: off.get(k) for k in ("step_s", "iteration_s", "busy_s", "iteration_over_busiest", "tflops",
                                     "tokens_per_s", "h2d_bytes_per_step", "d2h_bytes_per_step",
                                     "ssd_read_bytes_per_step", "ssd_write_bytes_per_step",
                                     "peak_rss_bytes", "device_peak_bytes")}
        if sim:
            o["simulated_period_s"] = sim.get("period_s")
            o["simulated_iteration_s"] = sim.get("iteration_s")
            o["simulated_busy_s"] = sim.get("busy_s")
            if sim.get("period_s") and off.get("step_s"):
                o["measured_over_simulated"] = off["step_s"] / sim["period_s"]
        figures["offload-gpt3-1.3b"] = o
    report["figures"] = figures

    with open(os.path.join(a.out, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    md = [f"# {report['what']}", "", f"{report['date_utc']}, phase {report['phase']}", ""]
    if device:
        md += ["Device: " + ", ".join(f"{k} {v}" for k, v in device.items()), ""]
    md += ["Kit: " + "; ".join(manifest), "", "| step | status | exit | seconds | note |", "|---|---|---|---|---|"]
    md += [f"| {s['name']} | {s['status']} | {s['exit']} | {s['seconds']:.1f} | {s.get('note', '')} |" for s in steps]
    for name, f in figures.items():
        md += ["", f"## {name}", "", "```", json.dumps(f, indent=1), "```"]
    md += ["", "All steps passed." if report["passed"] else "NOT all steps passed: see log.txt."]
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
