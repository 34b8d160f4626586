#!/usr/bin/python3
"""Loads a directory written by `fuyou-convert to-hf` with transformers and checks it.

    /usr/bin/python3 tests/reference/check_hf_export.py HF_DIR [LOGITS.safetensors]
    /usr/bin/python3 tests/reference/check_hf_export.py --selftest BUILD_DIR

With a logits file (tokens (B, T) I32, logits (B, T, V) F32, as make_hf_fixtures.py writes
them) the model's fp32 logits must match within 1e-4 relative (max |diff| / max |ref|).
Without one it only checks that the model (AutoModelForCausalLM: GPT2LMHeadModel,
OPTForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM) loads with no missing or unexpected
weights and runs. If tokenizer.json is present it must load with AutoTokenizer too.

--selftest converts the fixtures with BUILD_DIR/fuyou-convert (from-hf, to-hf in each dtype)
and checks every export; ctest runs it when transformers is importable (exit code 77 means
"skipped": transformers or torch is missing).
"""
import os
import shutil
import subprocess
import sys
import tempfile

try:
    import torch
    import transformers
    from safetensors.torch import load_file
except ImportError as e:  # pragma: no cover - the environment decides
    print("skipped: %s" % e)
    sys.exit(77)


def check(hf_dir, logits_file=None):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, output_loading_info=True, torch_dtype=torch.float32)
    # Buffers and tied heads are recreated on load, not read.
    missing = [k for k in info["missing_keys"]
               if not k.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"))
               and not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or info["unexpected_keys"] or info["mismatched_keys"]:
        raise SystemExit("%s: loading problems: %s" % (hf_dir, info))
    model.eval()
    if os.path.exists(os.path.join(hf_dir, "tokenizer.json")):
        transformers.AutoTokenizer.from_pretrained(hf_dir)
    if logits_file is None:
        with torch.no_grad():
            model(torch.zeros((1, model.config.max_position_embeddings), dtype=torch.int64))
        print("%s: loads and runs" % hf_dir)
        return
    ref = load_file(logits_file)
    with torch.no_grad():
        got = model(ref["tokens"].long()).logits.float()
    err = (got - ref["logits"]).abs().max().item() / ref["logits"].abs().max().item()
    print("%s: logits relative error %.3g" % (hf_dir, err))
    if not err < 1e-4:
        raise SystemExit("%s: logits differ from %s by %.3g relative" % (hf_dir, logits_file, err))


def selftest(build_dir):
    here = os.path.dirname(os.path.abspath(__file__))
    fixtures = os.path.join(here, "fixtures", "hf")
    tool = os.path.join(build_dir, "fuyou-convert")
    with tempfile.TemporaryDirectory() as tmp:
        for variant, dtype in [("gpt2_f32", "f32"), ("gpt2_bf16_sharded", "bf16"),
                               ("gpt2_f16_noprefix", "f16"), ("gpt2_bf16_sharded", "f32"),
                               ("opt_f32", "f32"), ("llama_gqa_f32", "f32"),
                               ("llama_bf16_sharded", "bf16"), ("qwen2_gqa_f32", "f32")]:
            ckpt = os.path.join(tmp, variant + "_" + dtype + "_engine")
            out = os.path.join(tmp, variant + "_" + dtype + "_hf")
            subprocess.run([tool, "from-hf", os.path.join(fixtures, variant), "--out", ckpt], check=True)
            subprocess.run([tool, "to-hf", ckpt, "--out", out, "--dtype", dtype,
                            "--max-shard-size", "100kB"], check=True)
            check(out, os.path.join(fixtures, "logits_%s.safetensors" % variant))


def selftest_resumed(build_dir):
    """Fine-tunes the gpt2_f32 fixture with fuyou-train (model.checkpoint), removes the base,
    resumes from a training checkpoint, and exports checkpoints and the run with to-hf: each
    export must load, and the resumed run's must equal the uninterrupted one's."""
    here = os.path.dirname(os.path.abspath(__file__))
    fixtures = os.path.join(here, "fixtures", "hf")
    convert = os.path.join(build_dir, "fuyou-convert")
    train = os.path.join(build_dir, "fuyou-train")
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        subprocess.run([convert, "from-hf", os.path.join(fixtures, "gpt2_f32"), "--out", base], check=True)
        with open(os.path.join(tmp, "text.txt"), "w") as f:
            f.write("the quick brown fox jumps over the lazy dog.\n" * 200)
        cfg = os.path.join(tmp, "ft.yaml")
        with open(cfg, "w") as f:
            f.write("model: {checkpoint: %s}\n" % base +
                    "data: {text: [%s], val_fraction: 0.1}\n" % os.path.join(tmp, "text.txt") +
                    "schedule: {steps: 4, warmup_steps: 1, micro_batch: 2, eval_every: 0, eval_batches: 1}\n"
                    "runtime: {backend: cpu, threads: 2}\ncheckpoint: {every_steps: 2}\n")
        full, resumed = os.path.join(tmp, "full"), os.path.join(tmp, "resumed")
        subprocess.run([train, "--config", cfg, "--run-dir", full], check=True)
        shutil.rmtree(base)  # the runs and their checkpoints must not need it any more
        subprocess.run([train, "--resume", os.path.join(full, "checkpoints", "step-2"), "--run-dir", resumed],
                       check=True)
        exports = []
        for src in [os.path.join(resumed, "checkpoints", "step-4"), os.path.join(full, "checkpoints", "step-4"),
                    resumed]:
            out = os.path.join(tmp, "hf%d" % len(exports))
            subprocess.run([convert, "to-hf", src, "--out", out], check=True)
            check(out)
            exports.append(load_file(os.path.join(out, "model.safetensors")))
        for name in exports[1]:
            if not torch.equal(exports[0][name], exports[1][name]):
                raise SystemExit("resumed export differs from the uninterrupted one in %s" % name)
        print("exports of a resumed checkpoint load and equal the uninterrupted run's")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--selftest":
        selftest(sys.argv[2])
        selftest_resumed(sys.argv[2])
    elif len(sys.argv) in (2, 3):
        check(*sys.argv[1:])
    else:
        raise SystemExit(__doc__)
