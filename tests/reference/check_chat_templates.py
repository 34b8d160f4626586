#!/usr/bin/python3
"""`fuyou-convert tokenize --chat-field` against transformers' apply_chat_template.

    /usr/bin/python3 tests/reference/check_chat_templates.py BUILD_DIR

For each chat template of tests/reference/chat_templates.py (Llama-2, Llama-3, Mistral,
ChatML / Qwen2, Gemma and Phi-3 styles, and ChatML laid out over indented lines) and each of two
tokenizers (the SentencePiece-style Llama-2 fixture and the byte-level one), conversations are
tokenized by the engine with the template in tokenizer_config.json: every record's ids must be
exactly those of tokenizer.apply_chat_template(messages, tokenize=True) (transformers 4.40.2,
Debian's jinja2), and its loss mask must cover exactly the tokens each assistant turn adds
(chat_templates.assistant_spans). Templates using a feature the engine does not have must be
refused, naming it, with nothing written. Exit code 77 when transformers or jinja2 is missing.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

try:
    import jinja2  # noqa: F401  (apply_chat_template needs it)
    import transformers
except ImportError as e:  # pragma: no cover - the environment decides
    print("skipped: %s" % e)
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chat_templates  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
TOKENIZERS = {"llama2": ("tok_llama2.json", "<s>", "</s>"),
              "bytelevel": ("tok_bytelevel.json", "<|endoftext|>", "<|endoftext|>")}


def read(path):
    with open(path, "rb") as f:
        data = f.read()
    width = struct.unpack_from("<I", data, 12)[0]
    count = struct.unpack_from("<Q", data, 16)[0]
    return list(struct.unpack_from("<%d%s" % (count, {1: "B", 2: "H", 4: "I", 8: "Q"}[width]), data, 32))


def model_dir(tmp, tok_name, template):
    d = tempfile.mkdtemp(dir=tmp)
    file, bos, eos = TOKENIZERS[tok_name]
    shutil.copy(os.path.join(FIXTURES, file), os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": bos, "eos_token": eos, "chat_template": template,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return d


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    convert = os.path.join(sys.argv[1], "fuyou-convert")
    failures, checked = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for family, template in chat_templates.TEMPLATES.items():
            convs = chat_templates.conversations(12, family in chat_templates.WITH_SYSTEM)
            data = os.path.join(tmp, family + ".jsonl")
            with open(data, "w") as f:
                for c in convs:
                    f.write(json.dumps(c) + "\n")
            for tok_name in TOKENIZERS:
                d = model_dir(tmp, tok_name, template)
                tok = transformers.AutoTokenizer.from_pretrained(d)
                out = os.path.join(tmp, "%s-%s" % (family, tok_name))
                subprocess.run([convert, "tokenize", "--tokenizer", os.path.join(d, "tokenizer.json"), data,
                                "--out", out, "--chat-field", "messages", "--val-fraction", "0"],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                tokens, mask = read(os.path.join(out, "train.tok")), read(os.path.join(out, "train.mask"))
                starts = read(os.path.join(out, "train.rec")) + [len(tokens)]
                for i, c in enumerate(convs):
                    ids, spans = chat_templates.assistant_spans(tok, template, c["messages"])
                    want_mask = [0] * len(ids)
                    for a, b in spans:
                        want_mask[a:b] = [1] * (b - a)
                    got = tokens[starts[i]:starts[i + 1]]
                    got_mask = mask[starts[i]:starts[i + 1]]
                    where = "%s template, %s tokenizer, conversation %d" % (family, tok_name, i)
                    if got != ids:
                        failures.append("%s: ids differ from apply_chat_template's:\n  engine       %s\n  transformers %s"
                                        % (where, got, ids))
                    elif got_mask != want_mask:
                        failures.append("%s: loss mask %s, expected %s" % (where, got_mask, want_mask))
                    elif not any(want_mask):
                        failures.append("%s: no assistant token counted" % where)
                    checked += 1
        for template, name in chat_templates.UNSUPPORTED:
            d = model_dir(tmp, "bytelevel", template)
            out = os.path.join(tmp, "refused")
            r = subprocess.run([convert, "tokenize", "--tokenizer", os.path.join(d, "tokenizer.json"), data,
                                "--out", out, "--chat-field", "messages"], capture_output=True, text=True)
            if r.returncode == 0 or name not in r.stderr + r.stdout or os.path.exists(out):
                failures.append("template %r: expected a refusal naming %r with nothing written, got exit %d: %s"
                                % (template, name, r.returncode, (r.stderr + r.stdout).strip()[-300:]))
            else:
                print("refused: %s" % (r.stderr + r.stdout).strip().splitlines()[-1])
    if failures:
        raise SystemExit("\n".join(failures[:10]) + "\n%d failure(s)" % len(failures))
    print("%d conversations over %d templates and %d tokenizers: ids equal apply_chat_template's, masks cover the "
          "assistant turns" % (checked, len(chat_templates.TEMPLATES), len(TOKENIZERS)))


if __name__ == "__main__":
    main()
