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

The released templates of tests/reference/fixtures/chat_templates (those whose licences let
them be shipped; see its README.md) go through the same check, and so do the *.jinja files of
the directory FUYOU_EXTRA_CHAT_TEMPLATES names, for templates that may be tested locally but not
committed (Llama's, Gemma's). A released template that does not render an assistant turn as an
extension of the conversation before it (Qwen3 drops earlier turns' reasoning, Phi-3.5 ends with
EOS) is checked on single exchanges, which it does render so. strftime_now is fixed at the
engine's date, 26 Jul 2024.
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


REAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "chat_templates")


def released_templates():
    dirs = [REAL] + [d for d in [os.environ.get("FUYOU_EXTRA_CHAT_TEMPLATES")] if d]
    for d in dirs:
        for name in sorted(os.listdir(d)):
            if name.endswith(".jinja"):
                with open(os.path.join(d, name)) as f:
                    yield name[:-len(".jinja")], f.read()


def fixed_date():
    """transformers' strftime_now reads the clock; the engine renders a fixed date."""
    import datetime
    try:
        from transformers.utils import chat_template_utils as ctu
        ctu._compile_jinja_template
    except (ImportError, AttributeError):  # older transformers: no template here reads the date
        return
    compile_ = ctu._compile_jinja_template

    def compiled(template):
        t = compile_(template)
        t.globals["strftime_now"] = lambda fmt: datetime.datetime(2024, 7, 26).strftime(fmt)
        return t
    ctu._compile_jinja_template = compiled


def extends(tok, template, convs):
    """Whether each assistant turn of every conversation renders as an extension of the
    conversation before it, which the engine's loss mask needs."""
    for c in convs:
        m = c["messages"]
        full = tok.apply_chat_template(m, chat_template=template, tokenize=False)
        for k, msg in enumerate(m):
            if msg["role"] != "assistant":
                continue
            upto = tok.apply_chat_template(m[:k + 1], chat_template=template, tokenize=False)
            before = tok.apply_chat_template(m[:k], chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
            if not upto.startswith(before) or not full.startswith(upto):
                return False
    return True


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    convert = os.path.join(sys.argv[1], "fuyou-convert")
    failures, checked = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        fixed_date()
        probe = transformers.AutoTokenizer.from_pretrained(model_dir(tmp, "bytelevel", ""))
        todo = [(f, t, chat_templates.conversations(12, f in chat_templates.WITH_SYSTEM))
                for f, t in chat_templates.TEMPLATES.items()]
        unmaskable = []
        for family, template in released_templates():
            system = "gemma" not in family
            for how, convs in [("conversations", chat_templates.conversations(12, system)),
                               ("single exchanges", chat_templates.single_exchanges(12, system)),
                               ("single exchanges without a system message",
                                chat_templates.single_exchanges(12, False))]:
                if extends(probe, template, convs):
                    todo.append((family, template, convs))
                    print("%s: checked on %s" % (family, how))
                    break
            else:
                unmaskable.append((family, template))
        for family, template, convs in todo:
            data = os.path.join(tmp, family + ".jsonl")
            with open(data, "w") as f:
                for c in convs:
                    f.write(json.dumps(c) + "\n")
            for tok_name in TOKENIZERS:
                d = model_dir(tmp, tok_name, template)
                tok = transformers.AutoTokenizer.from_pretrained(d)
                out = os.path.join(tmp, "%s-%s" % (family, tok_name))
                r = subprocess.run([convert, "tokenize", "--tokenizer", os.path.join(d, "tokenizer.json"),
                                    data, "--out", out, "--chat-field", "messages", "--val-fraction", "0"],
                               check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                if r.returncode != 0:
                    failures.append("%s template, %s tokenizer: fuyou-convert failed: %s"
                                    % (family, tok_name, r.stderr.strip()[-400:]))
                    continue
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
        # A template whose generation prompt is not where the reply starts cannot be masked by
        # the engine's rule: the record must be refused, saying so.
        unsupported = chat_templates.UNSUPPORTED + [
            (t, "as an extension of the conversation before it") for _, t in unmaskable]
        data = os.path.join(tmp, "one.jsonl")
        with open(data, "w") as f:
            f.write(json.dumps(chat_templates.single_exchanges(1, False)[0]) + "\n")
        for template, name in unsupported:
            d = model_dir(tmp, "bytelevel", template)
            out = os.path.join(tmp, "refused")
            r = subprocess.run([convert, "tokenize", "--tokenizer", os.path.join(d, "tokenizer.json"), data,
                                "--out", out, "--chat-field", "messages"], capture_output=True, text=True)
            # A record's refusal may leave the output directory it made, empty.
            written = os.path.exists(out) and os.listdir(out)
            shutil.rmtree(out, ignore_errors=True)
            if r.returncode == 0 or name not in r.stderr + r.stdout or written:
                failures.append("template %r: expected a refusal naming %r with nothing written, got exit %d: %s"
                                % (template, name, r.returncode, (r.stderr + r.stdout).strip()[-300:]))
            else:
                print("refused: %s" % (r.stderr + r.stdout).strip().splitlines()[-1])
    if failures:
        raise SystemExit("\n".join(failures[:10]) + "\n%d failure(s)" % len(failures))
    print("%d conversations over %d templates and %d tokenizers: ids equal apply_chat_template's, masks cover the "
          "assistant turns" % (checked, len(todo), len(TOKENIZERS)))


if __name__ == "__main__":
    main()
