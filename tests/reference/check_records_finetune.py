#!/usr/bin/python3
"""Fine-tunes tiny Hugging Face models on prompt/completion records and on conversations as a
user would, and checks the engine against transformers on the same records.

    /usr/bin/python3 tests/reference/check_records_finetune.py BUILD_DIR

For a Llama-2-style model (SentencePiece-style BPE with byte fallback, tests/reference/fixtures/
hf/tok_llama2.json, BOS from tokenizer_config.json) and a GPT-2-style one (byte-level BPE,
tok_bytelevel.json), each made here with transformers and random weights:

1. `fuyou-convert tokenize --prompt-field --completion-field` writes the records. The ids of
   every validation record must be what transformers gives: [bos] + tokenizer(prompt +
   completion, add_special_tokens=False) + [eos], with the loss mask 0 over the prompt's own
   encoding's common prefix with it and 1 after (docs/data.md, "Token boundaries").
2. `fuyou-convert from-hf`, then `fuyou-train` with schedule.epochs: its validation loss at
   step 0 must equal the per-record completion loss transformers computes on the validation
   records with the original weights (each record run alone; the losses of the counted
   tokens of all records summed and divided by their number), and after training the same
   with the weights `fuyou-convert to-hf` exports. Tolerance: 1e-4 relative, the bound of the
   project's other transformers comparisons (check_hf_export.py): two fp32 computations of
   the same model in different orders.
3. The same for conversations (`--chat-field messages`, the model's chat template from
   tokenizer_config.json: Llama-2 style for the Llama model, ChatML for the GPT-2 one): ids
   equal apply_chat_template's, the loss counts the tokens each assistant turn adds
   (chat_templates.assistant_spans), and the validation losses equal transformers'.
4. The fine-tune learns: the validation loss falls below 0.7 of its start (the validation
   records ask about countries the training records do not name, so what is learned is the
   answers' form: the space, the full stop, the EOS).

Exit code 77 ("skipped" for ctest) when torch or transformers is missing.
"""
import json
import os
import shutil
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import chat_templates  # noqa: E402
FIXTURES = os.path.join(HERE, "fixtures", "hf")
TOLERANCE = 1e-4

COUNTRIES = [("Poland", "Warsaw"), ("France", "Paris"), ("Germany", "Berlin"), ("Spain", "Madrid"),
             ("Italy", "Rome"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Greece", "Athens"),
             ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Ireland", "Dublin"), ("Finland", "Helsinki"),
             ("Hungary", "Budapest"), ("Egypt", "Cairo"), ("Japan", "Tokyo"), ("Peru", "Lima"),
             ("Chile", "Santiago"), ("Kenya", "Nairobi"), ("Canada", "Ottawa"), ("Cuba", "Havana")]


def records():
    """Question/answer pairs in three prompt styles: ending in '?', in ': ' (a trailing space,
    so the boundary falls inside a word's leading space) and in a newline."""
    out = []
    for i, (country, capital) in enumerate(COUNTRIES):
        out.append({"prompt": "Q: What is the capital of %s?\nA:" % country, "completion": " " + capital + "."})
        out.append({"prompt": "The capital of %s is " % country, "completion": capital})
        out.append({"prompt": "Name the country whose capital is %s.\n" % capital, "completion": country})
    return out


def write_model(kind, out):
    """A tiny random model of `kind` with its tokenizer files and chat template, saved as a
    user's download is."""
    torch.manual_seed(0)
    os.makedirs(out)
    if kind == "llama":
        shutil.copy(os.path.join(FIXTURES, "tok_llama2.json"), os.path.join(out, "tokenizer.json"))
        config = transformers.LlamaConfig(vocab_size=676, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                          rms_norm_eps=1e-5, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
        # The tokenizer.json's own pipeline (as check_chat_templates.py loads it): transformers 5's
        # LlamaTokenizerFast rebuilds the pre-tokenizer so that no '▁' follows a special token
        # ('<s>[INST]' -> [1, 94, ...] where tokenizer.json gives [1, 320, 94, ...]), which the
        # engine does not follow yet (docs/data.md, "Known differences").
        tok_config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                      "add_eos_token": False, "tokenizer_class": "PreTrainedTokenizerFast",
                      "chat_template": chat_templates.LLAMA2}
    else:
        shutil.copy(os.path.join(FIXTURES, "tok_bytelevel.json"), os.path.join(out, "tokenizer.json"))
        config = transformers.GPT2Config(vocab_size=512, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
        tok_config = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                      "tokenizer_class": "GPT2TokenizerFast", "chat_template": chat_templates.CHATML}
    with torch.no_grad():  # weights large enough that the losses are not all ln V
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tok_config, f)


def expected(tok, rec, bos, eos):
    """ids and mask as transformers encodes the concatenated text (the convention checked)."""
    full = tok(rec["prompt"] + rec["completion"], add_special_tokens=False)["input_ids"]
    alone = tok(rec["prompt"], add_special_tokens=False)["input_ids"]
    shared = 0
    while shared < min(len(full), len(alone)) and full[shared] == alone[shared]:
        shared += 1
    ids = ([bos] if bos is not None else []) + full + [eos]
    mask = [0] * ((1 if bos is not None else 0) + shared) + [1] * (len(full) - shared) + [1]
    return ids, mask


def read_shard(path, magic, width):
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != magic:
        raise SystemExit("%s: bad magic" % path)
    count = struct.unpack_from("<Q", data, 16)[0]
    fmt = {1: "B", 2: "H", 4: "I", 8: "Q"}[struct.unpack_from("<I", data, 12)[0]]
    if struct.calcsize(fmt) != width and width:
        raise SystemExit("%s: width %d" % (path, struct.calcsize(fmt)))
    return list(struct.unpack_from("<%d%s" % (count, fmt), data, 32))


def hf_record_loss(model, recs):
    """Sum of the counted tokens' losses over every record, each run alone, and their number."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in recs:
            x = torch.tensor([ids])
            logits = model(x).logits[0, :-1].double()
            labels = torch.tensor([t if m else -100 for t, m in zip(ids[1:], mask[1:])])
            total += torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
            count += int((labels != -100).sum())
    return total / count, count


def run(build_dir, kind, tmp):
    tools = {name: os.path.join(build_dir, name) for name in ("fuyou-convert", "fuyou-train")}
    hf = os.path.join(tmp, kind + "-hf")
    write_model(kind, hf)
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    bos = tok.bos_token_id if kind == "llama" else None
    eos = tok.eos_token_id
    data_file = os.path.join(tmp, "qa.jsonl")
    recs = records()
    with open(data_file, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    data = os.path.join(tmp, kind + "-data")
    subprocess.run([tools["fuyou-convert"], "tokenize", "--tokenizer", os.path.join(hf, "tokenizer.json"), data_file,
                    "--out", data, "--prompt-field", "prompt", "--completion-field", "completion",
                    "--val-fraction", "0.2"], check=True)
    # 1. The validation records' ids and masks, as transformers encodes them.
    first_val = len(recs) - int(len(recs) * 0.2)
    want = [expected(tok, r, bos, eos) for r in recs[first_val:]]
    tokens = read_shard(os.path.join(data, "val.tok"), b"FYTOKENS", 0)
    mask = read_shard(os.path.join(data, "val.mask"), b"FYLSMASK", 1)
    starts = read_shard(os.path.join(data, "val.rec"), b"FYRECIDX", 8) + [len(tokens)]
    got = [(tokens[a:b], mask[a:b]) for a, b in zip(starts, starts[1:])]
    if got != want:
        bad = next(i for i in range(len(want)) if i >= len(got) or got[i] != want[i])
        raise SystemExit("%s: validation record %d: engine %s, transformers %s" %
                         (kind, bad, got[bad] if bad < len(got) else None, want[bad]))
    print("%s: %d validation records tokenized as transformers does" % (kind, len(want)))

    # 2. Fine-tune from the converted weights; the validation losses against transformers.
    failures = fine_tune(tools, hf, kind, "qa", data, want, tmp)
    # 3. Conversations through the model's chat template.
    convs = chat_templates.conversations(40, True)
    chat_file = os.path.join(tmp, "chat.jsonl")
    with open(chat_file, "w") as f:
        for c in convs:
            f.write(json.dumps(c) + "\n")
    chat_data = os.path.join(tmp, kind + "-chat-data")
    subprocess.run([tools["fuyou-convert"], "tokenize", "--tokenizer", os.path.join(hf, "tokenizer.json"), chat_file,
                    "--out", chat_data, "--chat-field", "messages", "--val-fraction", "0.2"], check=True)
    first_val = len(convs) - int(len(convs) * 0.2)
    template = tok.chat_template
    chat_want = []
    for c in convs[first_val:]:
        ids, spans = chat_templates.assistant_spans(tok, template, c["messages"])
        mask = [0] * len(ids)
        for a, b in spans:
            mask[a:b] = [1] * (b - a)
        chat_want.append((ids, mask))
    tokens = read_shard(os.path.join(chat_data, "val.tok"), b"FYTOKENS", 0)
    mask = read_shard(os.path.join(chat_data, "val.mask"), b"FYLSMASK", 1)
    starts = read_shard(os.path.join(chat_data, "val.rec"), b"FYRECIDX", 8) + [len(tokens)]
    got = [(tokens[a:b], mask[a:b]) for a, b in zip(starts, starts[1:])]
    if got != chat_want:
        bad = next(i for i in range(len(chat_want)) if i >= len(got) or got[i] != chat_want[i])
        failures.append("%s: chat validation record %d differs from apply_chat_template's:\n"
                        "  engine       %s\n  transformers %s" %
                        (kind, bad, got[bad] if bad < len(got) else None, chat_want[bad]))
    else:
        print("%s: %d validation conversations tokenized as apply_chat_template does" % (kind, len(chat_want)))
        failures += fine_tune(tools, hf, kind, "chat", chat_data, chat_want, tmp)
    return failures


def fine_tune(tools, hf, kind, what, data, want, tmp):
    """fuyou-train from the converted weights on `data`; its validation losses against
    transformers' per-record loss on the validation records `want` (ids, mask)."""
    base = os.path.join(tmp, kind + "-base")
    if not os.path.exists(base):
        subprocess.run([tools["fuyou-convert"], "from-hf", hf, "--out", base], check=True)
    cfg = os.path.join(tmp, kind + "-" + what + ".yaml")
    with open(cfg, "w") as f:
        f.write("model: {checkpoint: %s}\n" % base +
                "data: {train_shards: [%s], val_shards: [%s]}\n" % (os.path.join(data, "train.tok"),
                                                                     os.path.join(data, "val.tok")) +
                "optimizer: {lr: 3.0e-3, min_lr: 3.0e-4, weight_decay: 0.0}\n"
                "schedule: {epochs: 10, warmup_steps: 2, micro_batch: 2, eval_every: 0, eval_batches: 8}\n"
                "runtime: {backend: cpu, threads: 2, seed: 3}\ncheckpoint: {every_minutes: 0}\n")
    run_dir = os.path.join(tmp, kind + "-" + what + "-run")
    subprocess.run([tools["fuyou-train"], "--config", cfg, "--run-dir", run_dir], check=True)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    before, counted = hf_record_loss(transformers.AutoModelForCausalLM.from_pretrained(hf).eval(), want)
    exported = os.path.join(tmp, kind + "-" + what + "-exported")
    subprocess.run([tools["fuyou-convert"], "to-hf", run_dir, "--out", exported], check=True)
    after, _ = hf_record_loss(transformers.AutoModelForCausalLM.from_pretrained(exported).eval(), want)
    failures = []
    for name, engine, ref in [("step 0", summary["first_val_loss"], before), ("trained", summary["final_val_loss"], after)]:
        err = abs(engine - ref) / ref
        print("%s %s: %s validation loss %.6f (engine) vs %.6f (transformers, %d counted tokens of %d records): "
              "relative difference %.2g" % (kind, what, name, engine, ref, counted, len(want), err))
        if not err <= TOLERANCE:
            failures.append("%s %s: %s validation loss differs from transformers' by %.3g relative" %
                            (kind, what, name, err))
    # 4. It learned.
    if not after < 0.7 * before:
        failures.append("%s %s: validation loss %.4f -> %.4f did not fall below 0.7 of its start" %
                        (kind, what, before, after))
    return failures


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("llama", "gpt2"):
            failures += run(sys.argv[1], kind, tmp)
    if failures:
        raise SystemExit("\n".join(failures))
    print("prompt/completion and chat fine-tunes match transformers")


if __name__ == "__main__":
    main()
