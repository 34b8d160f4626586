#!/usr/bin/python3
"""A fuyou-train LoRA run end to end against PEFT training the same steps on the same data.

    check_lora_train_peft.py BUILD_DIR

For a tiny fp32 Llama-style model (grouped-query attention, untied head) and a GPT-2, made with
transformers 5 and converted with fuyou-convert from-hf: PEFT wraps the base (LoraConfig with
the case's r, lora_alpha, target_modules, lora_dropout 0), its lora_B are set to random nonzero
values and the adapter is saved; fuyou-train runs a LoRA config continuing from it (lora.init)
on a token shard written here, with validation and checkpoints. PyTorch trains the same adapters
with torch.optim.AdamW on the same windows: the training sampler's and the validation's windows
are computed here from docs/data.md's definition (splitmix64 of runtime.seed and the draw
number; evenly spaced fixed windows), not read from the engine. Checked:
  - the loss of every step (metrics.jsonl) and every validation loss, max |engine - torch| /
    max |torch| below TOLERANCE;
  - `fuyou-convert to-hf RUN` writes a PEFT directory that PeftModel.from_pretrained loads onto
    a fresh base unedited; its adapters equal PyTorch's trained ones (elements of near-zero
    gradient to AdamW's bound on their movement, as check_lora_peft.py) and its logits PyTorch's;
  - resume bit for bit: a run of K steps, stopped (its process ended at schedule.steps K, a
    checkpoint written), resumed with --resume and schedule.steps N, logs the same losses and
    validation losses as the run of N steps straight, and ends with the same adapter bytes; so
    does a new run directory branching from the straight run's step-K checkpoint;
  - a resume on a different base (--set model.checkpoint=another base of the same shape) is
    refused with the base checksums; to-hf --dtype bf16 of a LoRA run and fuyou-bench train of
    a LoRA config are refused.
Exit status 1 on any mismatch, 77 (skipped) without torch, transformers 5 or peft.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import torch
    import transformers
    import peft
    from safetensors.torch import load_file
    import check_lora_peft as ref
except ImportError as e:  # pragma: no cover - the environment decides
    print("skipped: %s" % e)
    sys.exit(77)

if int(transformers.__version__.split(".")[0]) < 5:
    print("skipped: transformers %s is older than 5" % transformers.__version__)
    sys.exit(77)

T = ref.T
VOCAB = ref.VOCAB
MICRO = 2
ACCUM = 2
STEPS = 8        # N
STOP_AT = 3      # K: the stopped run's steps, and the checkpoint the branch resumes from
EVAL_EVERY = 4
EVAL_BATCHES = 2
SEED = 5
TRAIN_TOKENS = 400
VAL_TOKENS = 120
OPT = ref.OPT
TOLERANCE = ref.TOLERANCE  # fp32, 1e-5 relative: see check_lora_peft.py

# name: (model, r, lora_alpha, target_modules)
CASES = {
    "llama-all-linear": (ref.LLAMA, 4, 8, "all-linear"),
    "gpt2-c_attn-c_fc": (ref.GPT2, 2, 4, ["c_attn", "c_fc"]),
}

M64 = (1 << 64) - 1


class Rng:
    """include/fuyou/rng.h: splitmix64 from (seed, stream)."""

    def __init__(self, seed, stream):
        self.state = ((seed * 0x9E3779B97F4A7C15) & M64) ^ (((stream + 1) * 0xD1B54A32D192ED03) & M64)

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & M64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)

    def below(self, n):
        return int(float(self.next() >> 11) * 2.0 ** -53 * float(n))


def train_windows(tokens, step):
    """The B x (T+1) rows of each micro-batch of `step` (docs/data.md: draw d of the run is
    window start Rng(seed, d).below(len - T); no loss mask, so no redraws)."""
    span = len(tokens) - T
    rows = []
    for k in range(ACCUM):
        for b in range(MICRO):
            d = (step * ACCUM + k) * MICRO + b
            s = Rng(SEED, d).below(span)
            rows.append(tokens[s:s + T + 1])
    return torch.tensor(rows, dtype=torch.long)


def val_windows(tokens):
    """Evaluation batch i, row b: window w = i B + b of eval_batches x B evenly spaced ones."""
    span = len(tokens) - T
    windows = EVAL_BATCHES * MICRO
    rows = []
    for w in range(windows):
        s = w * (span - 1) // (windows - 1) if windows > 1 else 0
        rows.append(tokens[s:s + T + 1])
    return torch.tensor(rows, dtype=torch.long)


def write_shard(path, tokens):
    """docs/data.md's token shard: FYTOKENS, version 1, 2 bytes a token, count, vocab."""
    with open(path, "wb") as f:
        f.write(b"FYTOKENS" + struct.pack("<IIQII", 1, 2, len(tokens), VOCAB, 0))
        f.write(struct.pack("<%dH" % len(tokens), *tokens))


def metrics(run_dir):
    train, val = {}, {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            if j["type"] == "train":
                train[j["step"]] = j["loss"]
            elif j["type"] == "val":
                val[j["step"]] = j["val_loss"]
    return train, val


def run(cmd, what, problems, expect_ok=True):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if expect_ok and p.returncode != 0:
        problems.append("%s failed (exit %d): %s" % (what, p.returncode, p.stderr.strip()[-1200:]))
    return p


def check_case(tmp, build, name, case):
    model_spec, r, alpha, targets = case
    problems = []
    train_bin = os.path.join(build, "fuyou-train")
    convert = os.path.join(build, "fuyou-convert")
    base_dir = ref.make_base(tmp, name, model_spec)
    engine_base = os.path.join(tmp, name + "-engine")
    subprocess.run([convert, "from-hf", base_dir, "--out", engine_base], check=True,
                   stdout=subprocess.DEVNULL)

    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                          task_type="CAUSAL_LM")
    model = peft.get_peft_model(ref.load_base(base_dir), cfg)
    model.eval()
    g = torch.Generator().manual_seed(23)
    with torch.no_grad():
        for n, p in ref.lora_params(model).items():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    adapter_dir = os.path.join(tmp, name + "-adapter")
    model.save_pretrained(adapter_dir)

    train_tokens = torch.randint(0, VOCAB, (TRAIN_TOKENS,), generator=g).tolist()
    val_tokens = torch.randint(0, VOCAB, (VAL_TOKENS,), generator=g).tolist()
    train_shard = os.path.join(tmp, name + "-train.tok")
    val_shard = os.path.join(tmp, name + "-val.tok")
    write_shard(train_shard, train_tokens)
    write_shard(val_shard, val_tokens)

    targets_yaml = targets if isinstance(targets, str) else "[" + ", ".join(targets) + "]"
    config = os.path.join(tmp, name + ".yaml")
    with open(config, "w") as f:
        f.write("model: {checkpoint: %s, seq_len: %d}\n" % (engine_base, T) +
                "data: {train_shards: [%s], val_shards: [%s]}\n" % (train_shard, val_shard) +
                "optimizer: {lr: %g, min_lr: %g, beta1: %g, beta2: %g, eps: %g, "
                "weight_decay: %g, grad_clip: 0}\n" % (OPT["lr"], OPT["lr"], OPT["betas"][0],
                                                       OPT["betas"][1], OPT["eps"],
                                                       OPT["weight_decay"]) +
                "schedule: {steps: %d, warmup_steps: 0, lr_decay: constant, micro_batch: %d, "
                "grad_accum: %d, log_every: 1, eval_every: %d, eval_batches: %d}\n"
                % (STEPS, MICRO, ACCUM, EVAL_EVERY, EVAL_BATCHES) +
                "checkpoint: {every_steps: %d, keep: 10}\n" % STOP_AT +
                "runtime: {backend: cpu, threads: 2, seed: %d}\n" % SEED +
                "lora: {rank: %d, alpha: %g, targets: %s, init: %s}\n"
                % (r, alpha, targets_yaml, adapter_dir))

    straight = os.path.join(tmp, name + "-run")
    p = run([train_bin, "--config", config, "--dry-run", "--run-dir", straight], "--dry-run",
            problems)
    if p.returncode == 0 and "engine: LoRA" not in p.stdout + p.stderr:
        problems.append("%s: --dry-run does not name the LoRA engine: %s" % (name, p.stdout))
    run([train_bin, "--config", config, "--run-dir", straight], "the straight run", problems)
    if problems:
        return problems
    losses, vals = metrics(straight)

    # PyTorch: the same adapters, the same windows, the same AdamW.
    params = ref.lora_params(model)
    for prm in model.parameters():
        prm.requires_grad_(False)
    for prm in params.values():
        prm.requires_grad_(True)
    opt = torch.optim.AdamW(list(params.values()), **OPT)
    vbatch = val_windows(val_tokens)

    def val_loss():
        with torch.no_grad():  # mean over every window's targets (all count, equal sizes)
            return ref.loss_of(model, vbatch[:, :T], vbatch[:, 1:]).item()

    worst = {"loss": 0.0, "val": 0.0, "final": 0.0, "logits": 0.0}
    torch_val = {0: val_loss()}
    g0 = None
    for step in range(STEPS):
        batch = train_windows(train_tokens, step)
        opt.zero_grad()
        loss = ref.loss_of(model, batch[:, :T], batch[:, 1:])
        loss.backward()
        if g0 is None:
            g0 = {n: prm.grad.clone() for n, prm in params.items()}
        opt.step()
        e = abs(losses.get(step + 1, float("nan")) - loss.item()) / abs(loss.item())
        worst["loss"] = max(worst["loss"], e)
        if not e < TOLERANCE:
            problems.append("%s: step %d loss %s, PEFT %.8g" % (name, step + 1,
                                                               losses.get(step + 1), loss.item()))
        if (step + 1) % EVAL_EVERY == 0:
            torch_val[step + 1] = val_loss()
    for step, v in torch_val.items():
        e = abs(vals.get(step, float("nan")) - v) / abs(v)
        worst["val"] = max(worst["val"], e)
        if not e < TOLERANCE:
            problems.append("%s: validation loss at step %d %s, PEFT %.8g"
                            % (name, step, vals.get(step), v))

    # The export, loaded by PEFT unedited.
    export = os.path.join(tmp, name + "-export")
    run([convert, "to-hf", straight, "--out", export], "to-hf of the LoRA run", problems)
    if problems:
        return problems
    loaded = peft.PeftModel.from_pretrained(ref.load_base(base_dir), export)
    loaded.eval()
    got = ref.lora_params(loaded)
    if sorted(got) != sorted(params):
        return problems + ["%s: the export's adapters %s are not PEFT's %s"
                           % (name, sorted(got), sorted(params))]
    undecided = 0
    for n, prm in params.items():
        want, mine = prm.detach().double(), got[n].detach().double()
        decided = g0[n].abs() >= 1e-2 * g0[n].abs().max()
        undecided += int((~decided).sum())
        diff = (mine - want).abs()
        e = (diff[decided].max().item() if decided.any() else 0.0) / want.abs().max().item()
        worst["final"] = max(worst["final"], e)
        if not e < TOLERANCE:
            problems.append("%s: exported %s differs from PEFT's by %.3g relative" % (name, n, e))
        bound = 4 * OPT["lr"] * STEPS
        if (~decided).any() and not diff[~decided].max().item() < bound:
            problems.append("%s: exported %s differs by %.3g in an element of near-zero "
                            "gradient, more than AdamW moves it (%.3g)"
                            % (name, n, diff[~decided].max().item(), bound))
    with torch.no_grad():
        e = ref.rel(loaded(input_ids=vbatch[:, :T]).logits, model(input_ids=vbatch[:, :T]).logits)
    worst["logits"] = e
    if not e < TOLERANCE:
        problems.append("%s: logits of the export differ from PEFT's by %.3g relative" % (name, e))

    # Resume bit for bit: stopped at K and resumed in its own directory, and branched from the
    # straight run's step-K checkpoint into a new one.
    stopped = os.path.join(tmp, name + "-stopped")
    run([train_bin, "--config", config, "--run-dir", stopped, "--set",
         "schedule.steps=%d" % STOP_AT], "the run of %d steps" % STOP_AT, problems)
    run([train_bin, "--resume", stopped, "--set", "schedule.steps=%d" % STEPS],
        "the resumed run", problems)
    branch = os.path.join(tmp, name + "-branch")
    run([train_bin, "--resume", os.path.join(straight, "checkpoints", "step-%d" % STOP_AT),
         "--run-dir", branch], "the branch from step %d" % STOP_AT, problems)
    if problems:
        return problems
    final = load_file(os.path.join(straight, "model.safetensors"))
    for what, d in (("stopped and resumed", stopped), ("branched", branch)):
        l2, v2 = metrics(d)
        for step in range(1, STEPS + 1):
            if l2.get(step) != losses[step]:
                problems.append("%s: %s run: step %d loss %r, straight %r"
                                % (name, what, step, l2.get(step), losses[step]))
        for step in vals:
            if step > STOP_AT and v2.get(step) != vals[step]:
                problems.append("%s: %s run: validation loss at step %d %r, straight %r"
                                % (name, what, step, v2.get(step), vals[step]))
        other = load_file(os.path.join(d, "model.safetensors"))
        if sorted(other) != sorted(final):
            problems.append("%s: %s run's adapters %s, straight %s" % (name, what, sorted(other),
                                                                      sorted(final)))
        for n in final:
            if n in other and not torch.equal(other[n], final[n]):
                problems.append("%s: %s run's %s differs from the straight run's by %.3g"
                                % (name, what, n, (other[n] - final[n]).abs().max().item()))

    # Refusals: another base; an export in another dtype.
    other_base = os.path.join(tmp, name + "-other-engine")
    other_hf = ref.make_base(tmp, name + "-other", model_spec)
    other = ref.load_base(other_hf)
    with torch.no_grad():  # the same shape, other weights
        for prm in other.parameters():
            prm.add_(0.01)
    other.save_pretrained(other_hf)
    subprocess.run([convert, "from-hf", other_hf, "--out", other_base], check=True,
                   stdout=subprocess.DEVNULL)
    p = run([train_bin, "--resume", straight, "--run-dir", os.path.join(tmp, name + "-wrong"),
             "--set", "model.checkpoint=%s" % other_base, "--set", "schedule.steps=%d" % (STEPS + 1)],
            "", problems, expect_ok=False)
    if p.returncode == 0 or "holds adapters trained over a base of checksum" not in p.stderr:
        problems.append("%s: a resume on another base was not refused with the checksums "
                        "(exit %d): %s" % (name, p.returncode, p.stderr.strip()[-600:]))
    p = run([convert, "to-hf", straight, "--out", os.path.join(tmp, name + "-bf16"), "--dtype",
             "bf16"], "", problems, expect_ok=False)
    if p.returncode == 0 or "exports its adapters as PEFT saves them, in fp32" not in p.stderr:
        problems.append("%s: to-hf --dtype bf16 of a LoRA run was not refused (exit %d): %s"
                        % (name, p.returncode, p.stderr.strip()[-600:]))

    bench = os.path.join(build, "fuyou-bench")
    p = run([bench, "train", "--config", config], "", problems, expect_ok=False)
    if p.returncode == 0 or "fuyou-bench train does not time LoRA yet" not in p.stderr:
        problems.append("%s: fuyou-bench train of a LoRA config was not refused (exit %d): %s"
                        % (name, p.returncode, p.stderr.strip()[-600:]))

    print("%s: %d steps of %d x %d rows; worst relative differences to PEFT: losses %.2g, "
          "validation losses %.2g, exported adapters %.2g (%d elements of near-zero gradient "
          "held to AdamW's bound), export logits %.2g; stopped at %d and resumed, and branched "
          "from step-%d: losses and adapters bit for bit equal to the straight run"
          % (name, STEPS, ACCUM, MICRO, worst["loss"], worst["val"], worst["final"], undecided,
             worst["logits"], STOP_AT, STOP_AT))
    return problems


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    torch.manual_seed(0)
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in CASES.items():
            problems += check_case(tmp, sys.argv[1], name, case)
    for p in problems:
        print("MISMATCH " + p)
    if problems:
        sys.exit(1)
    print("fuyou-train LoRA runs match PEFT, export to PEFT and resume bit for bit")


if __name__ == "__main__":
    main()
