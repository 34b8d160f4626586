#!/usr/bin/env python3
"""Writes the fuzzers' seed corpora, tests/fuzz/corpus/NAME/, from the repository's configs and
test fixtures plus a few small hand-made files. Run from anywhere; it replaces the
directories' generated files. Seeds are kept small (a few KiB): libFuzzer mutates small
inputs faster, and the trimmed tokenizers still reach every tokenizer feature."""
import json
import pathlib
import shutil
import struct
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests/fuzz/corpus"
HF = ROOT / "tests/reference/fixtures/hf"


def out_dir(name):
    d = CORPUS / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d


def safetensors(tensors, metadata=None, pad=True):
    """tensors: [(name, dtype, shape, bytes)] laid out in order."""
    header, data, off = {}, b"", 0
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        data += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def write_safetensors():
    d = out_dir("safetensors")
    f32 = struct.pack("<4f", 1.0, -2.0, 3.5, 0.0)
    (d / "empty").write_bytes(safetensors([]))
    (d / "one_f32").write_bytes(safetensors([("w", "F32", [2, 2], f32)]))
    (d / "mixed").write_bytes(safetensors(
        [("a", "F16", [2], b"\x00\x3c\x00\xc0"), ("b", "BF16", [1, 2], b"\x80\x3f\x00\x40"),
         ("c", "I32", [1], b"\x07\x00\x00\x00"), ("d", "U8", [3], b"\x01\x02\x03"),
         ("e", "I64", [0], b""), ("f", "U16", [1], b"\xff\xff")],
        metadata={"format": "pt", "step": "7"}))
    (d / "unpadded").write_bytes(safetensors([("x", "F32", [1], f32[:4])], pad=False))


def write_st_index():
    d = out_dir("st_index")
    shutil.copy(HF / "gpt2_bf16_sharded/model.safetensors.index.json", d / "gpt2_sharded.json")
    (d / "small.json").write_text(json.dumps(
        {"metadata": {"total_size": 24}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                        "b": "model-00002-of-00002.safetensors"}}))
    (d / "no_metadata.json").write_text('{"weight_map": {"w": "w.safetensors"}}')


def write_config():
    d = out_dir("config")
    for p in ["default.yaml", "gpt-3b-offload.yaml", "gpt2-124m.yaml", "llama3-70b.yaml"]:
        shutil.copy(ROOT / "configs" / p, d / p)
    (d / "flow.yaml").write_text(
        "model: {family: llama, n_layer: 2, n_head: 4, n_kv_head: 2, d_model: 64, d_ff: 96,\n"
        "        vocab_size: 300, seq_len: 32, tie_embeddings: false, qkv_bias: true}\n"
        "data: {train_shards: [a.tok, b.tok], val_shards: v.tok, val_fraction: 0.1}\n"
        "optimizer: {lr: 3e-4, min_lr: 0, grad_clip: 0, initial_loss_scale: 1024}\n"
        "schedule: {steps: 10, warmup_steps: 2, micro_batch: 2, grad_accum: 3, eval_every: 0,\n"
        "           eval_batches: 1, log_every: 5}\n"
        "offload: {device_memory: 1GiB, host_memory: 1.5GB, ssd_paths: [/tmp], activations: swap,\n"
        "          weights: ssd, optimizer_state: auto, deferred_updates: 1}\n"
        "runtime: {backend: cpu, threads: 2, precision: bf16, seed: 18446744073709551615}\n")
    (d / "anchors.yaml").write_text("model: &m\n  n_layer: 2\nruntime:\n  seed: 1\n")


def write_token_shard():
    d = out_dir("token_shard")

    def shard(tokens, vocab):
        width = 2 if vocab <= 65536 else 4
        body = b"".join(struct.pack("<H" if width == 2 else "<I", t) for t in tokens)
        return b"FYTOKENS" + struct.pack("<IIQII", 1, width, len(tokens), vocab, 0) + body

    def mask(values):
        return b"FYLSMASK" + struct.pack("<IIQII", 1, 1, len(values), 2, 0) + bytes(values)

    (d / "shard2").write_bytes(b"\x00" + shard([0, 255, 17, 3], 256))
    (d / "shard4").write_bytes(b"\x00" + shard([70000, 1], 100000))
    (d / "empty").write_bytes(b"\x00" + shard([], 256))
    (d / "mask").write_bytes(b"\x01" + mask([0, 0, 1, 1, 0]))


def write_record_index():
    d = out_dir("record_index")

    def index(tokens, starts):
        return struct.pack("<I", tokens) + b"FYRECIDX" + struct.pack("<IIQII", 1, 8, len(starts), 0, 0) + \
            b"".join(struct.pack("<Q", s) for s in starts)

    (d / "three").write_bytes(index(12, [0, 5, 9]))
    (d / "one").write_bytes(index(1, [0]))
    (d / "empty").write_bytes(index(0, []))


def write_chat_template():
    d = out_dir("chat_template")
    sys.path.insert(0, str(ROOT / "tests" / "reference"))
    import chat_templates
    for name, text in chat_templates.TEMPLATES.items():
        (d / f"{name}.jinja").write_text(text)
    for k, (text, _) in enumerate(chat_templates.UNSUPPORTED):
        (d / f"unsupported{k}.jinja").write_text(text)
    # What the fuzzer found: an integer literal beyond int64, integer overflow.
    (d / "crash-integer-literal.jinja").write_text("{{ 99999999999999999999 }}{{ 9223372036854775807 + 1 }}")
    # Released templates, and the constructs of the hostile cases, small.
    released = ROOT / "tests" / "reference" / "fixtures" / "chat_templates"
    for f in sorted(released.glob("*.jinja")):
        (d / f"released-{f.name}").write_text(f.read_text())
    hostile = {
        "deep-plus": "{{ 1" + "+1" * 300 + " }}",
        "deep-attr": "{{ a" + ".b" * 300 + " }}",
        "deep-tags": "{% if true %}" * 300 + "{% endif %}" * 300,
        "repeat": "{{ 'x' * 999999999999999999 }}{{ '' * 999999999999999999 }}",
        "replace-join": "{% set s = 'x' * 1000 %}{{ s.replace('x', s) | length }}{{ ([s] * 100) | join | length }}",
        "split-for": "{% for c in (',' * 1000).split(',') %}{% for d in 'abc' %}{{ loop.cycle(1, 2) }}{% endfor %}{% endfor %}",
        "nested-loops": "{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}",
        "namespace-deep": "{% set ns = namespace(x=[]) %}{% for i in range(300) %}{% set ns.x = [ns.x] %}{% endfor %}",
        "macro-caller": "{% macro m(a, b=2) %}{{ a }}{{ caller() }}{% endmacro %}{% call m(1) %}c{% endcall %}{% macro r() %}{{ r() }}{% endmacro %}{{ r() }}",
        "filters": "{{ tools | tojson(indent=2) }}{{ messages | selectattr('role', 'eq', 'user') | map(attribute='content') | list }}{{ messages | rejectattr('role') | list | length }}{{ {'b': 1} | dictsort }}{{ '%s %d' % ('a', 1) }}{{ '{} {x}'.format(1, x=2) }}{{ strftime_now('%d %b %Y') }}{{ [1, 2, 3][::-1] }}",
    }
    for name, text in hostile.items():
        (d / f"hostile-{name}.jinja").write_text(text)


def trim_tokenizer(path, keep):
    """The fixture with the vocabulary cut to its `keep` lowest ids, the merges that stay
    inside it, and the added tokens renumbered after it."""
    j = json.loads(path.read_text())
    vocab = {t: i for t, i in j["model"]["vocab"].items() if i < keep}
    j["model"]["vocab"] = vocab
    merges = []
    for m in j["model"]["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    j["model"]["merges"] = merges
    added = []
    for k, t in enumerate(j.get("added_tokens") or []):
        t = dict(t)
        t["id"] = t["id"] if t["id"] < keep else keep + k
        added.append(t)
    j["added_tokens"] = added
    return json.dumps(j, ensure_ascii=False, separators=(",", ":"))


def write_tokenizer():
    d = out_dir("tokenizer")
    # Byte-level tokenizers need their 256 byte tokens; SentencePiece-style ones fall back
    # to <0xXX> tokens and keep working with fewer.
    for name, keep in [("tok_bytelevel", 300), ("tok_llama3", 300), ("tok_qwen2", 300),
                       ("tok_llama2", 120), ("tok_llama2_metaspace", 120), ("tok_llama2_unk", 120),
                       ("tok_bytelevel_prefix", 300)]:
        (d / f"{name}.json").write_text(trim_tokenizer(HF / f"{name}.json", keep))
    (d / "minimal.json").write_text(
        '{"model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2},"merges":["a b"]},'
        '"added_tokens":[{"id":3,"content":"<s>","special":true}]}')


def write_hf_config():
    d = out_dir("hf_config")
    for v in ["gpt2_f32", "opt_f32", "llama_gqa_f32", "qwen2_gqa_f32"]:
        shutil.copy(HF / v / "config.json", d / f"{v}.json")


def write_hardware():
    d = out_dir("hardware")
    for p in (ROOT / "configs/hardware").glob("*.yaml"):
        shutil.copy(p, d / p.name)


if __name__ == "__main__":
    write_safetensors()
    write_st_index()
    write_config()
    write_token_shard()
    write_record_index()
    write_chat_template()
    write_tokenizer()
    write_hf_config()
    write_hardware()
    for d in sorted(CORPUS.iterdir()):
        files = list(d.iterdir())
        print(f"{d.name}: {len(files)} seeds, {sum(f.stat().st_size for f in files)} bytes")
