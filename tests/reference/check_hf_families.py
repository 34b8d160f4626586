#!/usr/bin/env python3
"""The llama-style families against the transformers users have (5.x), in both config forms.

    FUYOU_PYTHON tests/reference/check_hf_families.py BUILD_DIR [--perturb] [--only=CASE,...]

For each case (GPT-2 and OPT with a position table longer than the sequence, Llama 2,
Llama 3.0, Llama 3.1 with llama3 rotary scaling, linear, dynamic and yarn scaling, Qwen2.5, Qwen3 (its q/k norm and a head_dim apart from hidden_size / heads),
Mistral with and without a window, Mistral-Nemo's head_dim, longrope, SmolLM3's NoPE layers, Phi-3 with its fused
tensors, a window and Phi-3.5's longrope, OLMo 2's post-norm blocks and q/k norms over the projections), a tiny random model is built and
saved by transformers (`save_pretrained`: the 5.x config keys `rope_parameters` and `dtype`),
and again with the config.json a hub checkpoint of 2024-25 carries (4.x keys: `rope_theta`,
`rope_scaling`, `torch_dtype`). Each is converted with `fuyou-convert from-hf`; then

- the engine's validation loss at step 0 (fuyou-train on the converted checkpoint, fp32 CPU
  backend) equals transformers' loss on the same windows to 1e-5 relative;
- `fuyou-convert to-hf` of the conversion loads in transformers with max |logit diff| <= 1e-5
  against the original model, its config saying the same rotary settings;
- for six cases (GREEDY_CASES), with a 512-token byte-level tokenizer, fuyou-generate's greedy
  tokens on the Hugging Face directory (layers resident and streamed) equal transformers'
  generate() up to its first near tie.

A config the engine does not compute as transformers does must be refused: cases that need a
context the engine does not model (a window shorter than the sequence) are refused with the
key named. With --perturb, every key of five cases' config.json is changed (and removed) in
turn: either the conversion is refused, or the engine's loss equals transformers' on the
changed model (the "no silent wrong model" check).

Exit code 77 means skipped (torch or transformers 5 missing).
"""
import copy
import json
import os
import re

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
import struct
import subprocess
import sys
import tempfile

try:
    import torch
    import transformers
except ImportError as e:  # pragma: no cover - the environment decides
    print("skipped: %s" % e)
    sys.exit(77)

if int(transformers.__version__.split(".")[0]) < 5:
    print("skipped: transformers %s is older than 5 (tools/install-deps.sh installs the reference "
          "into a virtual environment)" % transformers.__version__)
    sys.exit(77)

T = 32          # the engine's sequence length for the checks
BATCH = 2       # validation windows: [0, T+1) and [T+1, 2T+2) (BatchSampler::fixed)
VOCAB = 96
TOLERANCE = 1e-5

BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, tie_word_embeddings=False)

# Token ids of classes whose defaults lie outside the tiny vocabulary (Phi-3: 32000).
NO_IDS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)

# name: (config class, config arguments, the engine's verdict: None accepted, else the key
# its refusal names, or that key's start: rope_parameters in the 5.x form is rope_scaling in 4.x)
CASES = {
    "llama2": ("LlamaConfig", dict(BASE, num_key_value_heads=4), None),
    "llama3": ("LlamaConfig", dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), None),
    "llama3.1": ("LlamaConfig", dict(BASE, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), None),
    "llama-linear": ("LlamaConfig", dict(BASE, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}), None),
    "llama-dynamic": ("LlamaConfig", dict(BASE, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), None),
    "llama-yarn": ("LlamaConfig", dict(BASE, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0}), None),
    "llama-yarn-mscale": ("LlamaConfig", dict(BASE, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 16, "truncate": False}), None),
    "qwen2.5": ("Qwen2Config", dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                    tie_word_embeddings=True), None),
    "qwen3": ("Qwen3Config", dict(BASE, head_dim=16, tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), None),
    "qwen3-yarn": ("Qwen3Config", dict(BASE, head_dim=12, num_key_value_heads=4, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 16}), None),
    # Mistral-Nemo's shape: head_dim apart from hidden_size / heads
    "mistral-nemo": ("MistralConfig", dict(BASE, sliding_window=None, head_dim=12,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), None),
    "mistral-v0.3": ("MistralConfig", dict(BASE, sliding_window=None, head_dim=8,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), None),
    "mistral-window-64": ("MistralConfig", dict(BASE, sliding_window=64, head_dim=8), None),
    # a window shorter than the model's context: the engine trains at seq_len <= window
    "mistral-window-16": ("MistralConfig", dict(BASE, sliding_window=16, head_dim=8), "seq_len"),
    # longrope beyond its original context: transformers switches to the long factors by the
    # batch's length, which the engine does not model; it trains within the original context
    "llama-longrope-16": ("LlamaConfig", dict(BASE, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
        "long_factor": [2.0] * 4, "original_max_position_embeddings": 16}), "seq_len"),
    "llama-longrope": ("LlamaConfig", dict(BASE, max_position_embeddings=128, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.25, 1.5, 3.0],
        "long_factor": [2.0, 3.0, 5.0, 8.0], "original_max_position_embeddings": 32}), None),
    # Phi-3: fused qkv_proj and gate_up_proj; Phi-3-mini-4k's window (2047 of 4096) in small;
    # Phi-3.5-mini's longrope, its original context a top-level key of the class
    "phi3-mini": ("Phi3Config", dict(BASE, **NO_IDS, sliding_window=None), None),
    "phi3-window": ("Phi3Config", dict(BASE, **NO_IDS, sliding_window=47), None),
    # SmolLM3: every 4th layer without rotary embeddings (the class's default), or as listed;
    # its class defaults rope_theta to 2e6 and ties the head
    "smollm3": ("SmolLM3Config", dict(BASE, **NO_IDS, num_hidden_layers=4, tie_word_embeddings=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": 2000000.0}), None),
    "smollm3-listed": ("SmolLM3Config", dict(BASE, **NO_IDS, no_rope_layers=[0, 1]), None),
    "phi3.5-longrope": ("Phi3Config", dict(BASE, **NO_IDS, max_position_embeddings=128,
                                           original_max_position_embeddings=32, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.7, 2.5],
        "long_factor": [1.5, 2.0, 4.0, 9.0]}), None),
    # OLMo 2: the norms after the attention and the MLP, q/k norms over the whole projections
    # (grouped-query as OLMo-2-32B, and multi-head as the 7B and 13B)
    "olmo2": ("Olmo2Config", dict(BASE, **NO_IDS, rope_parameters={"rope_type": "default",
                                                                  "rope_theta": 500000.0}), None),
    "olmo2-mha": ("Olmo2Config", dict(BASE, **NO_IDS, num_key_value_heads=4), None),
}

# Learned position tables (gpt2, opt) longer than the engine's T: a fine-tune trains at a
# shorter seq_len and keeps the whole table (exported with all its rows); one shorter than T
# is refused at training, naming model.seq_len.
LEARNED = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4)
LEARNED_CASES = {
    "gpt2-positions-64": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                             n_positions=64, **NO_IDS), None),
    "opt-positions-64": ("OPTConfig", dict(LEARNED, hidden_size=32, word_embed_proj_dim=32,
                                           ffn_dim=64, max_position_embeddings=64), None),
    "gpt2-positions-16": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                             n_positions=16, **NO_IDS), "seq_len"),
}


def legacy_form(cfg):
    """The config.json of a hub checkpoint written by transformers 4.x: rope_theta and
    rope_scaling at the top, torch_dtype."""
    out = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "dtype")}
    if "rope_parameters" in cfg:  # learned position tables (gpt2, opt) have none
        rp = dict(cfg["rope_parameters"] or {})
        out["rope_theta"] = rp.pop("rope_theta", 10000.0)
        out["rope_scaling"] = None if rp.get("rope_type", "default") == "default" else rp
    if "dtype" in cfg:
        out["torch_dtype"] = cfg["dtype"]
    out["transformers_version"] = "4.46.0"
    return out


def write_shard(path, tokens):
    with open(path, "wb") as f:
        f.write(b"FYTOKENS" + struct.pack("<IIQII", 1, 2, len(tokens), VOCAB, 0))
        f.write(struct.pack("<%dH" % len(tokens), *tokens))


def windows(tokens):
    return torch.tensor([tokens[b * (T + 1):(b + 1) * (T + 1)] for b in range(BATCH)])


def hf_loss(model_dir, batch):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits.double()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    return float(loss), logits


def run(cmd, expect_ok=True):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if expect_ok and p.returncode != 0:
        raise SystemExit("command failed (%d): %s\n%s" % (p.returncode, " ".join(cmd), p.stderr[-3000:]))
    return p


class Checker:
    def __init__(self, build, tmp):
        self.convert = os.path.join(build, "fuyou-convert")
        self.train = os.path.join(build, "fuyou-train")
        self.tmp = tmp
        g = torch.Generator().manual_seed(7)
        self.tokens = torch.randint(0, VOCAB, (BATCH * (T + 1),), generator=g).tolist()
        self.shard = os.path.join(tmp, "val.tok")
        write_shard(self.shard, self.tokens)
        self.batch = windows(self.tokens)
        self.count = 0

    def make(self, name, cls, args):
        torch.manual_seed(0)
        config = getattr(transformers, cls)(**args)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # weights large enough that the losses are not all ln V
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.2)
        d = os.path.join(self.tmp, name)
        model.save_pretrained(d)
        return d

    def engine_loss(self, ck):
        """The validation loss at step 0 of a run from checkpoint `ck` (fuyou-train)."""
        self.count += 1
        run_dir = os.path.join(self.tmp, "run-%d" % self.count)
        cfg = os.path.join(self.tmp, "run-%d.yaml" % self.count)
        with open(cfg, "w") as f:
            f.write("model: {checkpoint: %s, seq_len: %d}\n" % (ck, T) +
                    "data: {train_shards: [%s], val_shards: [%s]}\n" % (self.shard, self.shard) +
                    "optimizer: {lr: 1.0e-4, min_lr: 1.0e-5}\n"
                    "schedule: {steps: 1, warmup_steps: 0, micro_batch: %d, eval_every: 0, eval_batches: 1}\n" % BATCH +
                    "runtime: {backend: cpu, threads: 2, seed: 3}\ncheckpoint: {every_minutes: 0}\n")
        p = run([self.train, "--config", cfg, "--run-dir", run_dir], expect_ok=False)
        if p.returncode != 0:
            return None, p.stderr
        with open(os.path.join(run_dir, "summary.json")) as f:
            return json.load(f)["first_val_loss"], ""

    def from_hf(self, hf, out):
        return run([self.convert, "from-hf", hf, "--out", out], expect_ok=False)

    def check_case(self, name, hf, verdict):
        """Converts `hf`; returns a list of failures."""
        ck = hf + "-fuyou"
        p = self.from_hf(hf, ck)
        if verdict is not None:
            if p.returncode == 0:
                loss, err = self.engine_loss(ck)
                if loss is None and ("'%s'" % verdict in err or "model.%s" % verdict in err):
                    print("%s: refused at training (%s)" % (name, err.strip().splitlines()[-1][:160]))
                    return []
                return ["%s: accepted, but the engine does not compute it as transformers (%s refused)" %
                        (name, verdict)]
            if "'%s" % verdict not in p.stderr:
                return ["%s: refused without naming %s: %s" % (name, verdict, p.stderr.strip()[-300:])]
            print("%s: refused (%s)" % (name, p.stderr.strip().splitlines()[-1][:160]))
            return []
        if p.returncode != 0:
            return ["%s: from-hf refused a supported model: %s" % (name, p.stderr.strip()[-400:])]
        failures = []
        ref, ref_logits = hf_loss(hf, self.batch)
        loss, err = self.engine_loss(ck)
        if loss is None:
            return ["%s: fuyou-train failed: %s" % (name, err.strip()[-400:])]
        rel = abs(loss - ref) / ref
        print("%s: loss %.8f (engine) vs %.8f (transformers %s), relative %.2g" %
              (name, loss, ref, transformers.__version__, rel))
        if not rel <= TOLERANCE:
            failures.append("%s: engine loss differs from transformers' by %.3g relative" % (name, rel))
        # Round trip: HF -> engine -> HF.
        back = hf + "-back"
        run([self.convert, "to-hf", ck, "--out", back])
        _, logits = hf_loss(back, self.batch)
        diff = float((logits - ref_logits).abs().max())
        print("%s: round trip max |logit diff| %.3g" % (name, diff))
        if not diff <= TOLERANCE:
            failures.append("%s: round trip changed the logits by %.3g" % (name, diff))
        with open(os.path.join(back, "config.json")) as f:
            exported = json.load(f)
        src = transformers.AutoConfig.from_pretrained(hf)
        got = transformers.AutoConfig.from_pretrained(back)
        if got.model_type != src.model_type:
            failures.append("%s: exported as model_type %s" % (name, got.model_type))
        if exported.get("dtype") != exported.get("torch_dtype"):
            failures.append("%s: the export's dtype %s and torch_dtype %s disagree" %
                            (name, exported.get("dtype"), exported.get("torch_dtype")))
        return failures

    def check_run_export(self, name, hf):
        """The last run (trained at T, shorter than the table) exports its whole position table:
        transformers loads it with the source's rows."""
        run_dir = os.path.join(self.tmp, "run-%d" % self.count)
        back = hf + "-run-back"
        p = run([self.convert, "to-hf", run_dir, "--out", back], expect_ok=False)
        if p.returncode != 0:
            return ["%s: to-hf of a run at seq_len %d failed: %s" % (name, T, p.stderr.strip()[-300:])]
        src = transformers.AutoModelForCausalLM.from_pretrained(hf)
        got = transformers.AutoModelForCausalLM.from_pretrained(back)
        table = lambda m: [
            t for n, t in m.named_parameters() if "wpe" in n or "embed_positions" in n][0]
        a, b = table(src), table(got)
        print("%s: a run at seq_len %d exports the position table %s (source %s)" %
              (name, T, tuple(b.shape), tuple(a.shape)))
        if a.shape != b.shape:
            return ["%s: the run's export has position table %s, the source %s" %
                    (name, tuple(b.shape), tuple(a.shape))]
        return []

    def check_defaults(self, name, hf, ref_cfg):
        """A config.json without a key takes the config class's default, as transformers reads
        it: the converted engine config holds transformers' value (a change of epsilon moves
        these tiny models' loss less than the tolerance, so the loss alone would not see it)."""
        failures = []
        for key, engine_key in (("rms_norm_eps", "norm_eps"),):
            if key not in ref_cfg:
                continue
            d = "%s-no-%s" % (hf, key)
            os.makedirs(d, exist_ok=True)
            for f in os.listdir(hf):
                if f != "config.json" and not os.path.exists(os.path.join(d, f)):
                    os.symlink(os.path.join(hf, f), os.path.join(d, f))
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump({k: v for k, v in ref_cfg.items() if k != key}, f)
            ck = d + "-fuyou"
            run(["rm", "-rf", ck])
            p = self.from_hf(d, ck)
            if p.returncode != 0:
                failures.append("%s: refused without %s: %s" % (name, key, p.stderr.strip()[-200:]))
                continue
            want = float(getattr(transformers.AutoConfig.from_pretrained(d), key))
            with open(os.path.join(ck, "config.yaml")) as f:
                m = re.search(r"^\s*%s:\s*(\S+)" % engine_key, f.read(), re.M)
            got = float(m.group(1)) if m else None
            pack = lambda x: struct.pack("<f", x)
            print("%s: without %s: engine %s %s, transformers %s" % (name, key, engine_key, got, want))
            if got is None or pack(got) != pack(want):
                failures.append("%s: without %s the engine's %s is %s, transformers' default %s" %
                                (name, key, engine_key, got, want))
        return failures

    def perturb(self, name, hf, ref_cfg):
        """Every key of config.json changed and removed in turn: refused, or computed as
        transformers computes the changed model."""
        failures, accepted, refused = [], 0, 0
        for key, value in variants(ref_cfg):
            d = hf + "-p"
            os.makedirs(d, exist_ok=True)
            for f in os.listdir(hf):
                if f != "config.json":
                    src = os.path.join(hf, f)
                    dst = os.path.join(d, f)
                    if not os.path.exists(dst):
                        os.symlink(src, dst)
            cfg = copy.deepcopy(ref_cfg)
            if value is REMOVE:
                del cfg[key]
            else:
                cfg[key] = value
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(cfg, f)
            ck = d + "-fuyou"
            run(["rm", "-rf", ck])
            if self.from_hf(d, ck).returncode != 0:
                refused += 1
                continue
            try:
                ref, _ = hf_loss(d, self.batch)
            except Exception as e:  # transformers itself cannot load it: the engine must not either
                if key in TOKEN_ID_KEYS:
                    # A token id outside a tiny vocabulary (the class's default, 32000) stops
                    # transformers' embedding from being built; the id names no computation.
                    print("%s: %s=%s: transformers refuses (%s); a token id, not modelled" %
                          (name, key, show(value), str(e)[:80]))
                    continue
                failures.append("%s: %s=%s: transformers refuses (%s) but the engine accepted it" %
                                (name, key, show(value), str(e)[:120]))
                continue
            loss, err = self.engine_loss(ck)
            if loss is None:
                refused += 1
                continue
            accepted += 1
            rel = abs(loss - ref) / ref
            if not rel <= TOLERANCE:
                failures.append("%s: %s=%s accepted, but the engine's loss %.6f differs from "
                                "transformers' %.6f" % (name, key, show(value), loss, ref))
        print("%s: %d changed configs refused, %d accepted and computed as transformers does" %
              (name, refused, accepted))
        return failures


# Greedy generation: fuyou-generate on the Hugging Face directory itself against transformers'
# generate(), for these cases, with a real byte-level tokenizer (512 tokens) in place of the
# tiny vocabulary. Compared up to transformers' first near tie between its two best logits
# (the fp32 arithmetic differs in the last bits; past a tie either token is right).
GREEDY_CASES = ("llama3.1", "qwen3", "mistral-window-64", "smollm3", "phi3.5-longrope", "olmo2")
GREEDY_PROMPT = "the people of the world"
GREEDY_TOKENS = 12
MIN_MARGIN = 1e-3


def check_greedy(c, name, cls, args):
    import tokenizers  # noqa: F401 (transformers' fast tokenizer needs it)
    tok_file = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf", "tok_bytelevel.json")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=tok_file, eos_token="<|endoftext|>")
    args = dict(args, vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=None)
    d = c.make(name + "-greedy", cls, args)
    tok.save_pretrained(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = tok(GREEDY_PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
    ref = out.sequences[0, len(ids):].tolist()
    gaps = [(s[0].topk(2).values[0] - s[0].topk(2).values[1]).item() for s in out.scores]
    tie = next((i for i, g in enumerate(gaps) if g < MIN_MARGIN), len(ref))
    failures = []
    for flags in ([], ["--stream-layers", "always"]):
        p = run([os.path.join(os.path.dirname(c.train), "fuyou-generate"), "--model", d, "--prompt", GREEDY_PROMPT,
                 "--max-new-tokens", str(GREEDY_TOKENS), "--backend", "cpu", "--ignore-eos", "--json"] + flags,
                expect_ok=False)
        if p.returncode != 0:
            failures.append("%s: fuyou-generate failed: %s" % (name, p.stderr.strip()[-300:]))
            continue
        got = json.loads(p.stdout)
        if got["prompt_ids"] != ids:
            failures.append("%s: prompt ids %s, transformers' tokenizer %s" % (name, got["prompt_ids"], ids))
        elif got["ids"][:tie] != ref[:tie]:
            failures.append("%s %s: greedy %s, transformers %s" % (name, " ".join(flags), got["ids"], ref))
        else:
            print("%s %s: greedy %s equal to transformers' on %d of %d new tokens (%s)" %
                  (name, " ".join(flags), ref, tie, len(ref), "whole" if tie == len(ref) else "then a near tie"))
    if tie < 4:
        failures.append("%s: a near tie at new token %d leaves too little compared: choose another prompt" %
                        (name, tie))
    return failures


REMOVE = object()
TOKEN_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id")


def show(v):
    return "(removed)" if v is REMOVE else json.dumps(v)


def changed(v):
    if isinstance(v, bool):
        return [not v]
    if isinstance(v, int):
        return [v * 2, v + 1]
    if isinstance(v, float):
        return [v * 2 + 0.5]
    if isinstance(v, str):
        return [v + "x"]
    if v is None:
        return [8]
    if isinstance(v, list):
        return [v[:1], []]
    return [{}]


def variants(cfg):
    for key in sorted(cfg):
        value = cfg[key]
        if isinstance(value, dict):
            for inner in sorted(value):
                for c in changed(value[inner]):
                    yield key, dict(value, **{inner: c})
                yield key, {k: x for k, x in value.items() if k != inner}
            yield key, dict(value, extra_key=1.0)
        else:
            for c in changed(value):
                yield key, c
        yield key, REMOVE
    yield "an_unknown_key", 1


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    build, perturb = os.path.abspath(sys.argv[1]), "--perturb" in sys.argv[2:]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        c = Checker(build, tmp)
        only = [a.split("=", 1)[1].split(",") for a in sys.argv[2:] if a.startswith("--only=")]
        for name, (cls, args, verdict) in list(CASES.items()) + list(LEARNED_CASES.items()):
            if only and name not in only[0]:
                continue
            hf = c.make(name, cls, args)
            with open(os.path.join(hf, "config.json")) as f:
                cfg5 = json.load(f)
            if "dtype" not in cfg5 or ("rope_parameters" not in cfg5 and name in CASES):
                failures.append("%s: transformers %s wrote no rope_parameters/dtype: the 5.x form is "
                                "not what this test assumes" % (name, transformers.__version__))
            failures += c.check_case(name + " (5.x config)", hf, verdict)
            if verdict is None and name in CASES:
                failures += c.check_defaults(name, hf, cfg5)
            legacy = hf + "-4x"
            os.makedirs(legacy)
            for f in os.listdir(hf):
                if f != "config.json":
                    os.symlink(os.path.join(hf, f), os.path.join(legacy, f))
            with open(os.path.join(legacy, "config.json"), "w") as f:
                json.dump(legacy_form(cfg5), f, indent=2)
            failures += c.check_case(name + " (4.x config)", legacy, verdict)
            if name in LEARNED_CASES and verdict is None:
                failures += c.check_run_export(name, legacy)
            if name in GREEDY_CASES:
                failures += check_greedy(c, name, cls, args)
            if perturb and name in ("llama3.1", "qwen3", "mistral-window-64", "phi3.5-longrope",
                                    "olmo2"):
                failures += c.perturb(name, hf, cfg5)
    for f in failures:
        print("FAIL " + f)
    print("%d failures" % len(failures))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
