#!/usr/bin/python3
"""`fuyou-convert tokenize --chat-field` against transformers' apply_chat_template.

    /usr/bin/python3 tests/reference/check_chat_templates.py BUILD_DIR

For each chat template of tests/reference/chat_templates.py (Llama-2, Llama-3, Mistral,
ChatML / Qwen2, Gemma and Phi-3 styles, and ChatML laid out over indented lines) and each of two
tokenizers (the SentencePiece-style Llama-2 fixture and the byte-level one), conversations are
tokenized by the engine with the template in tokenizer_config.json: every record's ids must be
exactly those of tokenizer.apply_chat_template(messages, tokenize=True) (the reference venv's
transformers 5 and jinja2), and its loss mask must cover exactly the tokens each assistant turn adds
(chat_templates.assistant_spans). Templates using a feature the engine does not have must be
refused, naming it, with nothing written. Records that carry more go through the same check
(check_carried): tools and tool calls, reasoning and --chat-template-kwargs (Qwen3's
enable_thinking), ShareGPT turns (--chat-format sharegpt), and --bos-token/--eos-token with
conversations, which follow the template or are refused with the reason. Exit code 77 when
transformers or jinja2 is missing.

The released templates of tests/reference/fixtures/chat_templates (those whose licences let
them be shipped; see its README.md) go through the same check, and so do the *.jinja files of
the directory FUYOU_EXTRA_CHAT_TEMPLATES names, for templates that may be tested locally but not
committed (Llama's, Gemma's). A released template that does not render an assistant turn as an
extension of the conversation before it (Qwen3 drops earlier turns' reasoning) is checked on
single exchanges, which it does render so, and, where chat_templates.MARKERS wraps its assistant
messages in generation blocks, on multi-turn conversations, tool calls and reasoning by what
each message writes in the whole render (chat_templates.contributed_spans). Content as lists of
text parts goes through a template of Gemma 3's layout; an image part must be refused. A template with {% generation %} blocks (SmolLM3's,
and one of chat_templates.py) is masked by them: its masks must equal transformers'
return_assistant_tokens_mask. strftime_now is fixed at the engine's date, 26 Jul 2024. The
conversations checked are counted per template.
"""
import collections
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


def trailer_start(upto, full):
    """Where `upto` parts from `full`, when the rest of it is a prefix-free trailer that `full`
    ends with too (the text a template writes after the last turn only, Phi-3.5's EOS); None
    otherwise. The engine's rule (src/formats/tokenize_dataset.cc)."""
    k = 0
    while k < min(len(upto), len(full)) and upto[k] == full[k]:
        k += 1
    if k == len(upto) or (len(upto) - k <= len(full) - k and full.endswith(upto[k:])):
        return k
    return None


def extends(tok, template, convs, **kwargs):
    """Whether each assistant turn of every conversation renders as an extension of the
    conversation before it, up to one trailer every earlier turn shares, which the engine's
    loss mask needs."""
    for c in convs:
        m = c["messages"]
        kw = dict(kwargs, tools=c.get("tools"))
        render = lambda msgs, gen: tok.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                                           add_generation_prompt=gen, **kw)
        try:
            full, trailer = render(m, False), None
        except jinja2.exceptions.TemplateError:  # the template refuses such records
            return False
        for k, msg in enumerate(m):
            if msg["role"] != "assistant":
                continue
            upto, before = render(m[:k + 1], False), render(m[:k], True)
            cut = trailer_start(upto, full)
            if not upto.startswith(before) or cut is None or cut < len(before) or \
                    (cut == len(before) and cut != len(upto)):
                return False
            if k + 1 < len(m):
                if trailer is not None and upto[cut:] != trailer:
                    return False
                trailer = upto[cut:]
    return True


def tokenize(convert, tmp, tok_name, template, records, args=(), field="messages"):
    """The engine's shards of `records` (tokens, mask, record starts), or its error text."""
    data = os.path.join(tmp, "data-%d.jsonl" % len(os.listdir(tmp)))
    with open(data, "w") as f:
        for c in records:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    d = model_dir(tmp, tok_name, template)
    out = os.path.join(tmp, "out-%d" % len(os.listdir(tmp)))
    r = subprocess.run([convert, "tokenize", "--tokenizer", os.path.join(d, "tokenizer.json"), data, "--out", out,
                        "--chat-field", field, "--val-fraction", "0"] + list(args),
                       check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        return r.stderr.strip()[-400:]
    tokens, mask = read(os.path.join(out, "train.tok")), read(os.path.join(out, "train.mask"))
    return tokens, mask, read(os.path.join(out, "train.rec")) + [len(tokens)]


TALLY = collections.Counter()  # conversations checked, by template


def compare(failures, name, tok, template, convs, got, marked=None, **kwargs):
    """Each record's ids against apply_chat_template's and its mask against the assistant
    turns' (with `marked`, the template with its assistant messages in generation blocks: what
    they contribute to the whole, chat_templates.contributed_spans); the number of conversations
    checked."""
    if isinstance(got, str):
        failures.append("%s: fuyou-convert failed: %s" % (name, got))
        return 0
    tokens, mask, starts = got
    for i, c in enumerate(convs):
        if marked:
            ids, spans = chat_templates.contributed_spans(tok, template, marked, c["messages"], tools=c.get("tools"),
                                                          **kwargs)
            want_mask = [0] * len(ids)
            for a, b in spans:
                want_mask[a:b] = [1] * (b - a)
        elif chat_templates.marks_generation(template):
            out = tok.apply_chat_template(c["messages"], chat_template=template, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True, tools=c.get("tools"), **kwargs)
            ids, want_mask = list(out["input_ids"]), list(out["assistant_masks"])
        else:
            ids, spans = chat_templates.assistant_spans(tok, template, c["messages"], tools=c.get("tools"),
                                                        **kwargs)
            want_mask = [0] * len(ids)
            for a, b in spans:
                want_mask[a:b] = [1] * (b - a)
        got_ids, got_mask = tokens[starts[i]:starts[i + 1]], mask[starts[i]:starts[i + 1]]
        where = "%s, conversation %d" % (name, i)
        if got_ids != ids:
            failures.append("%s: ids differ from apply_chat_template's:\n  engine       %s\n  transformers %s"
                            % (where, got_ids, ids))
        elif got_mask != want_mask:
            failures.append("%s: loss mask %s, expected %s" % (where, got_mask, want_mask))
        elif not any(want_mask):
            failures.append("%s: no assistant token counted" % where)
    TALLY[name.split(" template")[0]] += len(convs)
    return len(convs)


def check_carried(convert, tmp, probe, released, failures):
    """What records carry besides plain turns: tools and tool calls (every template whose
    renders the mask rule accepts them with), reasoning and template keyword arguments
    (Qwen3's enable_thinking), ShareGPT turns, and --bos-token/--eos-token with conversations
    (following the template, or refused with the reason). The conversations checked."""
    checked = 0
    tool_sets = [("tool calls", chat_templates.tool_conversations(6)),
                 ("tool calls with a null content", chat_templates.tool_conversations(6, None)),
                 ("tool calls without a system message", chat_templates.tool_conversations(6, system=False)),
                 ("tool calls with a null content, without a system message",
                  chat_templates.tool_conversations(6, None, system=False)),
                 ("tool calls with reasoning", chat_templates.tool_conversations(6, reasoning=True))]
    for family, template in released:
        for how, convs in tool_sets:
            if family == "qwen3":  # checked below, on what each turn contributes to the whole
                continue
            if not chat_templates.marks_generation(template) and not extends(probe, template, convs):
                print("%s: %s not checked (the template raises on them, or a turn is not an extension of "
                      "the conversation before it)" % (family, how))
                continue
            tok = transformers.AutoTokenizer.from_pretrained(model_dir(tmp, "bytelevel", template))
            checked += compare(failures, "%s template, %s" % (family, how), tok, template, convs,
                               tokenize(convert, tmp, "bytelevel", template, convs))
            print("%s: checked with %s" % (family, how))
    templates = dict(released)
    qwen3 = templates["qwen3"]
    tok = transformers.AutoTokenizer.from_pretrained(model_dir(tmp, "bytelevel", qwen3))
    # Qwen3 renders an earlier turn otherwise in the whole (its reasoning dropped, a tool call
    # without the empty think block it has when last): multi-turn conversations, tool calls with
    # and without reasoning, are masked by what each assistant message writes in the whole.
    marked = chat_templates.qwen3_marked(qwen3)
    for how, convs, kwargs in [("multi-turn reasoning", chat_templates.reasoning_conversations(12), {}),
                               ("multi-turn, enable_thinking false", chat_templates.conversations(12, True),
                                {"enable_thinking": False})] + [(h, c, {}) for h, c in tool_sets]:
        try:
            for c in convs:
                tok.apply_chat_template(c["messages"], chat_template=qwen3, tools=c.get("tools"), tokenize=False,
                                        **kwargs)
        except (jinja2.exceptions.TemplateError, TypeError):
            print("qwen3: %s not checked (the template raises on them)" % how)
            continue
        args = ["--chat-template-kwargs", json.dumps(kwargs)] if kwargs else []
        checked += compare(failures, "qwen3 template, %s" % how, tok, qwen3, convs,
                           tokenize(convert, tmp, "bytelevel", qwen3, convs, args), marked=marked, **kwargs)
        print("qwen3: checked with %s" % how)
    # Content as a list of text parts, iterated by a template of Gemma 3's layout, and by the
    # same template as strings; an image part is refused, naming the record and the part.
    for tok_name in TOKENIZERS:
        tok = transformers.AutoTokenizer.from_pretrained(model_dir(tmp, tok_name, chat_templates.GEMMA3_PARTS))
        for how, convs in [("text parts", chat_templates.with_text_parts(chat_templates.conversations(12, False))),
                           ("string content", chat_templates.conversations(12, False))]:
            checked += compare(failures, "gemma3-parts template, %s, %s tokenizer" % (how, tok_name), tok,
                               chat_templates.GEMMA3_PARTS, convs,
                               tokenize(convert, tmp, tok_name, chat_templates.GEMMA3_PARTS, convs))
    image = chat_templates.with_text_parts(chat_templates.single_exchanges(2, False))
    image[1]["messages"][0]["content"].insert(0, {"type": "image", "url": "cat.png"})
    got = tokenize(convert, tmp, "bytelevel", chat_templates.GEMMA3_PARTS, image)
    reason = ":2: message 0 (user): content part 0 is of type 'image'"
    if not isinstance(got, str) or reason not in got:
        failures.append("an image part: expected a refusal naming %r, got %s" % (reason, got))
    else:
        print("refused: %s" % got.splitlines()[-1])
    tok = transformers.AutoTokenizer.from_pretrained(model_dir(tmp, "bytelevel", qwen3))
    # Reasoning under each of its names; without thinking, the generation prompt's empty think
    # block is prompt, not reply.
    for how, convs, kwargs in [("reasoning", chat_templates.reasoning_exchanges(9), {}),
                               ("enable_thinking false", chat_templates.single_exchanges(9, True),
                                {"enable_thinking": False})]:
        args = ["--chat-template-kwargs", json.dumps(kwargs)] if kwargs else []
        checked += compare(failures, "qwen3 template, %s" % how, tok, qwen3, convs,
                           tokenize(convert, tmp, "bytelevel", qwen3, convs, args), **kwargs)
    # SmolLM3's reasoning mode, off by keyword argument or by /no_think in the system message.
    smollm3 = templates.get("smollm3-3b")
    if smollm3:
        tok = transformers.AutoTokenizer.from_pretrained(model_dir(tmp, "bytelevel", smollm3))
        no_think = [{"messages": [{"role": "system", "content": "Answer briefly. /no_think"}] +
                     [m for m in c["messages"] if m["role"] != "system"]}
                    for c in chat_templates.conversations(12, False)]
        for how, convs, kwargs in [("enable_thinking false", chat_templates.conversations(12, True),
                                    {"enable_thinking": False}),
                                   ("/no_think in the system message", no_think, {})]:
            args = ["--chat-template-kwargs", json.dumps(kwargs)] if kwargs else []
            checked += compare(failures, "smollm3-3b template, %s" % how, tok, smollm3, convs,
                               tokenize(convert, tmp, "bytelevel", smollm3, convs, args), **kwargs)
    # A template of ours that marks the reply with {% generation %} and, as Qwen3 does, drops
    # earlier turns' reasoning, so that no turn renders as an extension of the conversation
    # before it: the mask follows its blocks, on both tokenizers.
    marked = chat_templates.TEMPLATES_MARKED["chatml_think_generation"]
    convs = chat_templates.reasoning_conversations(12)
    for tok_name in TOKENIZERS:
        tok = transformers.AutoTokenizer.from_pretrained(model_dir(tmp, tok_name, marked))
        checked += compare(failures, "chatml_think_generation template, %s tokenizer" % tok_name, tok, marked,
                           convs, tokenize(convert, tmp, tok_name, marked, convs))
    for family in ["llama2", "chatml"]:
        template = chat_templates.TEMPLATES[family]
        convs = chat_templates.conversations(12, True)
        tok = transformers.AutoTokenizer.from_pretrained(model_dir(tmp, "llama2", template))
        checked += compare(failures, "%s template, ShareGPT records" % family, tok, template, convs,
                           tokenize(convert, tmp, "llama2", template, [chat_templates.sharegpt(c) for c in convs],
                                    ["--chat-format", "sharegpt"], field="conversations"))
    # Llama 2's template writes <s> and </s> itself: given, they follow it (never doubled).
    llama2 = chat_templates.TEMPLATES["llama2"]
    convs = chat_templates.conversations(12, True)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir(tmp, "llama2", llama2))
    checked += compare(failures, "llama2 template, --bos-token '<s>' --eos-token '</s>'", tok, llama2, convs,
                       tokenize(convert, tmp, "llama2", llama2, convs, ["--bos-token", "<s>", "--eos-token", "</s>"]))
    for template, args, reason in [
            (chat_templates.TEMPLATES["chatml"], ["--eos-token", "</s>"],
             "--eos-token '</s>': the chat template does not end this conversation with it"),
            (llama2, ["--bos-token", "none"], "--bos-token none: the chat template begins this conversation "
             "with '<s>' itself")]:
        got = tokenize(convert, tmp, "llama2", template, convs[:1], args)
        if not isinstance(got, str) or reason not in got:
            failures.append("%s: expected a refusal naming %r, got %s" % (" ".join(args), reason, got))
        else:
            print("refused: %s" % got.splitlines()[-1])
    return checked


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
        unmaskable, marked_todo = [], []
        released = list(released_templates())
        for family, template in released:
            # With a system message and without (a template may refuse one, or place it in the
            # last user turn only): multi-turn conversations where the template renders each
            # assistant turn as an extension of the conversation before it, else single exchanges.
            # A template with {% generation %} blocks is masked by them and needs neither.
            checked_on = []
            for system, how in [(True, ""), (False, " without a system message")]:
                for what, convs in [("conversations", chat_templates.conversations(12, system)),
                                    ("single exchanges", chat_templates.single_exchanges(12, system))]:
                    if chat_templates.marks_generation(template) or extends(probe, template, convs):
                        todo.append((family, template, convs))
                        checked_on.append(what + how)
                        break
            if family in chat_templates.MARKERS:
                # Multi-turn, masked by what each assistant message writes in the whole render.
                marked_todo.append((family, template, chat_templates.MARKERS[family](template)))
                checked_on.append("multi-turn conversations, by what each turn writes in the whole")
            if checked_on:
                print("%s: checked on %s" % (family, ", ".join(checked_on)))
            else:
                unmaskable.append((family, template))
        for family, template, convs in todo:
            for tok_name in TOKENIZERS:
                tok = transformers.AutoTokenizer.from_pretrained(model_dir(tmp, tok_name, template))
                checked += compare(failures, "%s template, %s tokenizer" % (family, tok_name), tok, template,
                                   convs, tokenize(convert, tmp, tok_name, template, convs))
        for family, template, marked in marked_todo:
            for tok_name in TOKENIZERS:
                tok = transformers.AutoTokenizer.from_pretrained(model_dir(tmp, tok_name, template))
                for system in [True, False]:
                    convs = chat_templates.conversations(12, system)
                    checked += compare(failures, "%s template, multi-turn, %s tokenizer" % (family, tok_name), tok,
                                       template, convs, tokenize(convert, tmp, tok_name, template, convs),
                                       marked=marked)
        checked += check_carried(convert, tmp, probe, released, failures)
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
    for family in sorted(TALLY):
        print("%s: %d conversations equal" % (family, TALLY[family]))
    print("%d conversations over %d templates and %d tokenizers (and records with tools, reasoning, keyword "
          "arguments, ShareGPT turns, given BOS/EOS): ids equal apply_chat_template's, masks cover the "
          "assistant turns" % (checked, len(TALLY), len(TOKENIZERS)))


if __name__ == "__main__":
    main()
