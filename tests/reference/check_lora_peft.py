#!/usr/bin/python3
"""The engine's LoRA step against PEFT on tiny fp32 models made with transformers 5.

    check_lora_peft.py BUILD_DIR LORA_TOOL

For each case (Llama-style with grouped-query attention and an untied head, GPT-2), the base is
built with transformers and converted with BUILD_DIR/fuyou-convert from-hf; PEFT wraps it
(get_peft_model, LoraConfig with the case's r, lora_alpha, target_modules, use_rslora and
lora_dropout 0), its lora_B weights are set to random nonzero values (PEFT starts them at zero,
which would leave every lora_A gradient zero) and the adapter is saved with save_pretrained.
LORA_TOOL (tests/lora_tool.cc) continues from that directory (lora.init) and runs STEPS AdamW
steps on one batch; PyTorch runs the same steps with torch.optim.AdamW (same lr, betas, eps,
weight decay, no schedule). Checked, each as max |engine - torch| / max |torch|:
  - the loss of every step and the gradient of every adapter tensor at the first step,
  - every adapter tensor after the last step (elements whose gradient is near zero, which
    fp32 cannot order, to AdamW's bound on their movement instead: see DECIDED),
  - the adapter directory the tool writes loads with PeftModel.from_pretrained (a fresh base,
    no edits), and its logits equal the engine's and the trained PyTorch model's.
Exit status 1 on any mismatch, 77 (skipped) without torch, transformers 5 or peft.
"""
import json
import os
import subprocess
import sys
import tempfile

try:
    import torch
    import torch.nn.functional as F
    import transformers
    import peft
    from safetensors.torch import load_file, save_file
except ImportError as e:  # pragma: no cover - the environment decides
    print("skipped: %s" % e)
    sys.exit(77)

if int(transformers.__version__.split(".")[0]) < 5:
    print("skipped: transformers %s is older than 5" % transformers.__version__)
    sys.exit(77)

T = 16        # sequence length
BATCH = 2     # micro-batch
VOCAB = 96
STEPS = 10
OPT = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
# fp32 throughout; the engine and PyTorch sum in different orders (GEMM blocking, attention
# kernels), so results agree to a few hundred ulps of the largest value: 1e-5 relative is
# about 80 x fp32's epsilon (1.19e-7).
TOLERANCE = 1e-5

LLAMA = ("LlamaConfig", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64, rms_norm_eps=1e-5,
                             tie_word_embeddings=False))
GPT2 = ("GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=T,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

# name: (model, r, lora_alpha, target_modules, use_rslora)
CASES = {
    "llama-all-linear": (LLAMA, 4, 8, "all-linear", False),
    "llama-q-v-rslora": (LLAMA, 2, 6, ["q_proj", "v_proj"], True),
    "llama-k-up-down": (LLAMA, 3, 5, ["k_proj", "up_proj", "down_proj"], False),
    "gpt2-c_attn-c_proj-c_fc": (GPT2, 4, 16, ["c_attn", "c_proj", "c_fc"], False),
    "gpt2-c_attn": (GPT2, 2, 4, ["c_attn"], False),
}


def rel(a, b):
    a, b = a.double(), b.double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def make_base(tmp, name, model_spec):
    cls, args = model_spec
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**args))
    with torch.no_grad():  # weights large enough that the losses are not all ln V
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    d = os.path.join(tmp, name + "-base")
    model.save_pretrained(d)
    return d


def load_base(d):
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model.eval()  # no dropout anywhere; autograd still runs
    return model


def lora_params(model):
    """The adapter tensors by the names save_pretrained gives them."""
    out = {}
    for n, p in model.named_parameters():
        if "lora_" in n:
            out[n.replace(".default", "")] = p
    return out


def loss_of(model, inputs, targets):
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


# The case whose config is also changed into ones the engine must refuse, each with its message.
REFUSALS_CASE = "llama-q-v-rslora"


def check_refusals(tmp, tool, batch_file, config_text, r):
    problems = []
    train = os.path.join(os.path.dirname(os.path.dirname(tool)), "fuyou-train")
    cases = [
        ("bf16 tensors", config_text(runtime="{backend: cpu, device_tensors: bf16, precision: bf16}"),
         "LoRA does not run with runtime.device_tensors bf16"),
        ("a base on SSD", config_text(extra="offload: {activations: swap}\n"),
         "LoRA does not run with offload.activations swap"),
        ("another rank than the adapter's", config_text(rank=r + 1),
         "r is %d but lora.rank is %d" % (r, r + 1)),
        ("other targets than the adapter's", config_text(targets="[q_proj]"),
         "they adapt different modules"),
    ]
    for what, text, message in cases:
        path = os.path.join(tmp, "refused.yaml")
        with open(path, "w") as f:
            f.write(text)
        p = subprocess.run([tool, path, batch_file, "1", os.path.join(tmp, "refused.safetensors")],
                           capture_output=True, text=True)
        if p.returncode == 0 or message not in p.stderr:
            problems.append("%s: not refused with '%s' (exit %d): %s"
                            % (what, message, p.returncode, p.stderr.strip()[-400:]))
    path = os.path.join(tmp, "refused.yaml")
    with open(path, "w") as f:
        f.write(config_text())
    bench = os.path.join(os.path.dirname(train), "fuyou-bench")
    if os.path.exists(bench):  # nor does the planner: a plan would be a full fine-tune's
        p = subprocess.run([bench, "plan", "--config", path], capture_output=True, text=True)
        if p.returncode == 0 or "the planner and the simulator do not know LoRA yet" not in p.stderr:
            problems.append("fuyou-bench plan with a lora section: exit %d: %s"
                            % (p.returncode, p.stderr.strip()[-400:]))
    print("refusals: %d configs refused with their messages" % (len(cases) + 1 - len(problems)))
    return problems


def check_case(tmp, convert, tool, name, case):
    model_spec, r, alpha, targets, rslora = case
    problems = []
    base_dir = make_base(tmp, name, model_spec)
    engine_base = os.path.join(tmp, name + "-engine")
    subprocess.run([convert, "from-hf", base_dir, "--out", engine_base], check=True,
                   stdout=subprocess.DEVNULL)

    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                          use_rslora=rslora, task_type="CAUSAL_LM")
    model = peft.get_peft_model(load_base(base_dir), cfg)
    model.eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for n, p in lora_params(model).items():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    adapter_dir = os.path.join(tmp, name + "-adapter")
    model.save_pretrained(adapter_dir)

    tokens = torch.randint(0, VOCAB, (BATCH, T + 1), generator=g, dtype=torch.int32)
    batch_file = os.path.join(tmp, name + "-batch.safetensors")
    save_file({"tokens": tokens}, batch_file)
    inputs, labels = tokens[:, :T].long(), tokens[:, 1:].long()

    targets_yaml = targets if isinstance(targets, str) else "[" + ", ".join(targets) + "]"
    def config_text(runtime="{backend: cpu, threads: 2}", rank=r, targets=targets_yaml, extra=""):
        return ("model: {checkpoint: %s, seq_len: %d, head_chunk_tokens: 0}\n" % (engine_base, T) +
                "optimizer: {lr: %g, min_lr: %g, beta1: %g, beta2: %g, eps: %g, weight_decay: %g, "
                "grad_clip: 0}\n" % (OPT["lr"], OPT["lr"], OPT["betas"][0], OPT["betas"][1],
                                     OPT["eps"], OPT["weight_decay"]) +
                "schedule: {steps: %d, warmup_steps: 0, lr_decay: constant, micro_batch: %d}\n"
                % (STEPS, BATCH) + "runtime: %s\n" % runtime + extra +
                "lora: {rank: %d, alpha: %g, targets: %s, init: %s, use_rslora: %s}\n"
                % (rank, alpha, targets, adapter_dir, "true" if rslora else "false"))
    config = os.path.join(tmp, name + ".yaml")
    with open(config, "w") as f:
        f.write(config_text())
    if name == REFUSALS_CASE:
        problems += check_refusals(tmp, tool, batch_file, config_text, r)
    out_file = os.path.join(tmp, name + "-engine.safetensors")
    export_dir = os.path.join(tmp, name + "-export")
    p = subprocess.run([tool, config, batch_file, str(STEPS), out_file, export_dir],
                       capture_output=True, text=True)
    if p.returncode != 0:
        return ["%s: the engine failed: %s" % (name, p.stderr.strip()[-800:])]
    got = load_file(out_file)

    params = lora_params(model)
    for prm in model.parameters():
        prm.requires_grad_(False)
    for prm in params.values():
        prm.requires_grad_(True)
    opt = torch.optim.AdamW(list(params.values()), **OPT)
    worst = {"loss": 0.0, "grad": 0.0, "final": 0.0, "logits": 0.0}
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model, inputs, labels)
        loss.backward()
        e = rel(got["loss"][step:step + 1], loss.detach().reshape(1))
        worst["loss"] = max(worst["loss"], e)
        if not e < TOLERANCE:
            problems.append("%s: step %d loss %.8g, PEFT %.8g (%.3g relative)"
                            % (name, step, got["loss"][step].item(), loss.item(), e))
        if step == 0:
            g0 = {n: prm.grad.clone() for n, prm in params.items()}
            if set("grad." + n for n in params) != set(k for k in got if k.startswith("grad.")):
                problems.append("%s: the engine's adapter tensors %s are not PEFT's %s" % (
                    name, sorted(k[5:] for k in got if k.startswith("grad.")), sorted(params)))
                return problems
            for n, prm in params.items():
                e = rel(got["grad." + n], prm.grad)
                worst["grad"] = max(worst["grad"], e)
                if not e < TOLERANCE:
                    problems.append("%s: gradient of %s differs by %.3g relative" % (name, n, e))
                if prm.grad.abs().max().item() == 0:
                    problems.append("%s: PEFT's gradient of %s is zero: the check proves nothing"
                                    % (name, n))
        opt.step()
    # AdamW moves an element by about lr a step whatever its gradient's size, so an element
    # whose gradient is within the gradients' fp32 differences of zero (both sides agree to
    # TOLERANCE x the tensor's largest gradient) moves by an amount fp32 cannot decide. Elements
    # whose first gradient is at least DECIDED x the largest are held to TOLERANCE (their
    # updates differ by about lr x TOLERANCE / DECIDED a step); the others only to AdamW's own
    # bound on ten steps' movement, 4 lr a step (|m_hat| / sqrt(v_hat) < 4 for these betas
    # over ten steps).
    DECIDED = 1e-2
    undecided = 0
    for n, prm in params.items():
        ref, mine = prm.detach().double(), got["final." + n].double()
        g = g0[n].abs()
        decided = g >= DECIDED * g.max()
        undecided += int((~decided).sum())
        diff = (mine - ref).abs()
        e = (diff[decided].max().item() if decided.any() else 0.0) / ref.abs().max().item()
        worst["final"] = max(worst["final"], e)
        if not e < TOLERANCE:
            problems.append("%s: %s after %d steps differs by %.3g relative" % (name, n, STEPS, e))
        bound = 4 * OPT["lr"] * STEPS
        if (~decided).any() and not diff[~decided].max().item() < bound:
            problems.append("%s: %s after %d steps differs by %.3g in an element of near-zero "
                            "gradient, more than AdamW moves it (%.3g)"
                            % (name, n, STEPS, diff[~decided].max().item(), bound))

    # The engine's export: PEFT loads it onto a fresh base with no edits.
    loaded = peft.PeftModel.from_pretrained(load_base(base_dir), export_dir)
    loaded.eval()
    missing = [n for n in lora_params(loaded) if n not in params]
    if missing:
        problems.append("%s: the export's adapters %s are not PEFT's" % (name, missing))
    with torch.no_grad():
        ref = model(input_ids=inputs).logits
        peft_logits = loaded(input_ids=inputs).logits
    for what, a, b in [("engine vs PEFT", got["logits"], ref),
                       ("export vs PEFT", peft_logits, ref)]:
        e = rel(a, b)
        worst["logits"] = max(worst["logits"], e)
        if not e < TOLERANCE:
            problems.append("%s: logits %s differ by %.3g relative" % (name, what, e))
    with open(os.path.join(export_dir, "adapter_config.json")) as f:
        exported = json.load(f)
    if exported["r"] != r or exported["lora_alpha"] != alpha:
        problems.append("%s: adapter_config.json has r %s, lora_alpha %s" % (
            name, exported["r"], exported["lora_alpha"]))
    print("%s: %d adapter tensors; worst relative differences: loss %.2g, gradients %.2g, "
          "adapters after %d steps %.2g (%d elements of near-zero gradient held to AdamW's bound), "
          "logits %.2g" % (name, len(params), worst["loss"], worst["grad"], STEPS, worst["final"],
                           undecided, worst["logits"]))
    return problems


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    convert = os.path.join(sys.argv[1], "fuyou-convert")
    tool = sys.argv[2]
    torch.manual_seed(0)
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in CASES.items():
            problems += check_case(tmp, convert, tool, name, case)
    for p in problems:
        print("MISMATCH " + p)
    if problems:
        sys.exit(1)
    print("LoRA matches PEFT in every case")


if __name__ == "__main__":
    main()
