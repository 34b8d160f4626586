#!/usr/bin/python3
"""Hugging Face fixtures for tests/test_hf.cc and tests/test_tokenizer.cc.

Run with Debian's python3 (python3-torch 1.13) plus `pip install --break-system-packages
transformers==4.40.2 tokenizers==0.19.1 safetensors`:

    /usr/bin/python3 tests/reference/make_hf_fixtures.py

Writes tests/reference/fixtures/hf/ (deterministic; a rerun gives the same tensors):

  gpt2_f32/            tiny random GPT2LMHeadModel, save_pretrained, one model.safetensors,
                       plus the byte-level tokenizer's files (copied through by conversion)
  gpt2_bf16_sharded/   the same weights in bf16, saved with a small max_shard_size: several
                       model-XXXXX-of-YYYYY.safetensors and model.safetensors.index.json
  gpt2_f16_noprefix/   the same weights in f16, saved from GPT2Model: names without
                       "transformer."
  logits_<variant>.safetensors   tokens (B, T) I32 and logits (B, T, V) F32 computed in fp32
                       from that variant's weights (bf16 and f16 widened exactly); for the
                       opt/llama/qwen2 variants also train_tokens (1, T+1) I32 and train_loss
                       (1) F32, HF's mean cross-entropy of predicting train_tokens[1:];
                       for opt_f32 also grad.<name>, that loss's gradient for every weight
  opt_f32/             tiny random OPTForCausalLM (pre-LN, ReLU, learned positions offset 2)
  llama_gqa_f32/       tiny random LlamaForCausalLM, 4 query / 2 key-value heads, untied head
  llama_bf16_sharded/  a Llama without GQA, tied head, rope_theta 500000, in bf16 shards
  qwen2_gqa_f32/       tiny random Qwen2ForCausalLM (q/k/v biases, GQA, tied head)

`--families` rebuilds only the opt/llama/qwen2 fixtures, leaving the rest as they are.
  tok_bytelevel.json   byte-level BPE (GPT-2 style), trained here, vocab 512
  tok_llama3.json      byte-level BPE with the Llama-3 split regex and ignore_merges
  tok_qwen2.json       the Llama-3 vocabulary with Qwen2's regex and an NFC normalizer
  tok_llama2.json      SentencePiece-style BPE with byte fallback: Prepend + Replace
                       normalizer, no pre-tokenizer (the "legacy" Llama 2 tokenizer.json)
  tok_llama2_metaspace.json  the same model with a Metaspace pre-tokenizer (prepend_scheme
                       "first", split false), as newer conversions write it
  tok_llama2_unk.json  the legacy one without byte fallback (fused <unk>)
  tok_bytelevel_prefix.json  tok_bytelevel with ByteLevel(add_prefix_space=True)
  tokenizer_refs.json  the test corpus (plus 150 random strings from a pool of tricky
                       characters) and, per tokenizer, the ids from
                       Tokenizer.encode(text, add_special_tokens=False) and the decoded text
"""
import json
import os
import random
import shutil
import sys

import torch
import tokenizers
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures", "hf")

GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
                r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
               r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# The corpus the tokenizers are checked on: ASCII, contractions in both cases, accents
# (composed and decomposed), CJK, Hangul, emoji with modifiers and ZWJ sequences, RTL
# scripts, whitespace runs of every kind, numbers in several scripts, code, special tokens
# inside text, and edge cases (empty, lone space, lone newline).
CORPUS = [
    "Hello world! It's a test; they're here, we've done it, I'm sure, you'll see, he'd go.",
    "CAPS: IT'S THEY'RE WE'VE I'M YOU'LL HE'D -- Mixed: It'S tHey'Re",
    "Café naïve façade résumé Ångström São Paulo Zürich Ølberg Łódź",
    "Decomposed: e\u0301 a\u0308 o\u0302 \u212b (angstrom sign) \u1112\u1161\u11ab (jamo)",
    "日本語のテキストです。中文测试，汉字。한국어 문장입니다.",
    "Emoji: 😀👍🏽 🎉🚀 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 keycap 1️⃣",
    "Whitespace:   three spaces,\ttab,\t\tdouble tab, trailing   ",
    "Lines\nwith\n\nnewlines\r\nand CRLF\r\n\r\n  indented\n\n\n   \n",
    "Numbers: 1 12 123 1234 12345 3.14159 1,000,000 2026-11-21 ٣٤٥ Ⅻ ½ ²",
    "Mixed: x=42; y = x**2 + 3*x - 7 # comment",
    "Code:\n    def f(a, b):\n        return a + b\n\n\tif (x) { y++; }\n",
    "'quoted' \"double\" ‘curly’ “quotes” — dashes – … ¿Qué? ¡Sí!",
    "<|endoftext|> special in the middle <|endoftext|>text<|endoftext|>",
    "Spaces: nbsp\u00a0here, em\u2003space, ideographic\u3000space, thin\u2009space",
    "Arabic: مرحبا بالعالم Hebrew: שלום עולם Greek: Καλημέρα κόσμε Cyrillic: Привет мир",
    "  leading spaces",
    " single leading space",
    "",
    " ",
    "\n",
    "a",
    "'s 's 'x '",
    "Added: a <mask> b   <mask>c [SEP]   d foo food xfoo foo. <mask>[SEP]the end  the endless",
    "Normalized added: bar xbar barx bar qu ux qu  ux ▁bar",
    "don'ſ it'ſ",
    "!!!??? ... ---- ____ ****",
    "URL: https://example.com/path?q=1&r=two#frag email@example.org",
    "tab\tthen  two\n\n\tnewline tab",
    "1234567890 12345678901234567890",
    "Ünïcödé wörds wïth ümläuts and ÇÃPS",
]

WORDS = ("the of and to in is that it for on with as was by at this be from or have an are "
         "not but they which one you all were her she there would their we him been has "
         "when who will more no if out so said what up its about into than them can only "
         "other new some could time these two may then do first any my now such like our "
         "over man me even most made after also did many before must through back years "
         "where much your way well down should because each just those people how too "
         "little state good very make world still own see men work long get here between "
         "both life being under never day same another know while last might us great old "
         "year off come since against go came right used take three").split()
EXTRA = ["café", "naïve", "résumé", "Zürich", "São", "日本", "中文", "测试", "한국어", "😀",
         "🎉", "123", "42", "3.14", "2026", "it's", "they're", "we've", "I'm", "you'll",
         "he'd", "Привет", "мир", "Καλημέρα", "مرحبا"]


# Characters the random strings are drawn from: each class the scanners tell apart, and the
# ones where they differ between patterns (apostrophes before letters, \r and \n inside
# whitespace runs, digits of several scripts, combining marks, characters outside the
# trained vocabularies).
RANDOM_POOL = (list("abcXYZ sStTdD'  \t\n\r\n0123.,!?-_") +
               ["é", "e\u0301", "ß", "ſ", "日", "本", "😀", "👍🏽", "\u00a0", "\u3000", "٣", "Ⅻ",
                "½", "\u200d", "'s", "'LL", " 're", "  ", "\n\n", "<|endoftext|>", "<s>"])


def random_strings(count, seed=99):
    rng = random.Random(seed)
    return ["".join(rng.choice(RANDOM_POOL) for _ in range(rng.randint(0, 24)))
            for _ in range(count)]


def training_text():
    rng = random.Random(1234)
    lines = []
    for _ in range(600):
        n = rng.randint(4, 14)
        ws = [rng.choice(WORDS) if rng.random() < 0.85 else rng.choice(EXTRA) for _ in range(n)]
        if rng.random() < 0.3:
            ws[0] = ws[0].capitalize()
        sep = rng.choice([" ", " ", " ", "  ", "\t"])
        lines.append(sep.join(ws) + rng.choice([".", ",", "!", "?", ";", ""]))
    return lines


def train_bytelevel(pre_tokenizer, vocab_size, ignore_merges=False, normalizer=None):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(training_text(), trainer)
    return tok


def train_llama2_style():
    """SentencePiece-style BPE: merges trained on Metaspace words, then the vocabulary laid out
    as Llama 2's is (<unk> <s> </s>, the 256 <0xXX> byte tokens, then the merged pieces) and
    the pipeline switched to the legacy Llama 2 one."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=450, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator(training_text(), trainer)
    trained = json.loads(tok.to_str())
    # Keep the 70 most frequent characters (ties by code point) and drop every piece and merge
    # that contains another one, so rarer characters (CJK, emoji, Greek...) take the byte
    # fallback. The trainer's own limit_alphabet breaks count ties in hash order, which would
    # make the fixture differ from run to run.
    counts = {}
    for line in training_text():
        for ch in line.replace(" ", "▁"):
            counts[ch] = counts.get(ch, 0) + 1
    alphabet = set(sorted(counts, key=lambda c: (-counts[c], c))[:70]) | {"▁"}
    keep = lambda piece: all(c in alphabet for c in piece)
    old_vocab = trained["model"]["vocab"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for piece, _ in sorted(old_vocab.items(), key=lambda kv: kv[1]):
        if piece not in vocab and keep(piece):
            vocab[piece] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in trained["model"]["merges"]]
    merges = [m for m in merges if keep(m[0] + m[1])]
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                       byte_fallback=True)
    legacy = Tokenizer(model)
    legacy.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                              normalizers.Replace(" ", "▁")])
    legacy.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                        decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    legacy.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                               for t in ["<unk>", "<s>", "</s>"]])
    meta = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                                byte_fallback=True))
    meta.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                  split=False)
    meta.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    meta.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                             for t in ["<unk>", "<s>", "</s>"]])
    return legacy, meta


def make_tokenizers():
    toks = {}
    toks["bytelevel"] = train_bytelevel(pre_tokenizers.ByteLevel(add_prefix_space=False), 512)
    split3 = pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False)
    toks["llama3"] = train_bytelevel(
        pre_tokenizers.Sequence([split3, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                  use_regex=False)]),
        400, ignore_merges=True)
    # Qwen2: the same kind of vocabulary, its own regex (one digit per piece) and NFC.
    qwen = json.loads(toks["llama3"].to_str())
    qwen["normalizer"] = {"type": "NFC"}
    qwen["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = QWEN2_REGEX
    qwen["model"]["ignore_merges"] = False
    toks["qwen2"] = Tokenizer.from_str(json.dumps(qwen))
    toks["llama2"], toks["llama2_metaspace"] = train_llama2_style()
    # Without byte fallback: unknown characters become <unk>, runs of them one <unk>.
    unk = json.loads(toks["llama2"].to_str())
    unk["model"]["byte_fallback"] = False
    toks["llama2_unk"] = Tokenizer.from_str(json.dumps(unk))
    toks["llama2_unk"].add_tokens([tokenizers.AddedToken("bar", normalized=True),
                                   tokenizers.AddedToken("qu ux", normalized=True)])
    # GPT-2 style with a prefix space, to cover ByteLevel(add_prefix_space=True).
    prefixed = json.loads(toks["bytelevel"].to_str())
    prefixed["pre_tokenizer"]["add_prefix_space"] = True
    toks["bytelevel_prefix"] = Tokenizer.from_str(json.dumps(prefixed))
    # Added tokens with the matching options: lstrip, rstrip, single_word, normalized.
    toks["bytelevel_prefix"].add_special_tokens([
        tokenizers.AddedToken("<mask>", lstrip=True, special=True, normalized=False),
        tokenizers.AddedToken("[SEP]", rstrip=True, special=True, normalized=False)])
    toks["bytelevel_prefix"].add_tokens([tokenizers.AddedToken("foo", single_word=True),
                                         tokenizers.AddedToken("the end", normalized=True)])
    return toks


def make_models(vocab_size, bytelevel_tokenizer_path):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab_size,
                                  n_positions=32, activation_function="gelu_new",
                                  layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        # Random LayerNorm weights and biases too, so a mix-up of any two tensors shows.
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    B, T = 2, 32
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab_size, (B, T), generator=g, dtype=torch.int64)

    def logits_of(m):
        with torch.no_grad():
            return m.float()(tokens).logits.float().contiguous()

    d = os.path.join(OUT, "gpt2_f32")
    model.save_pretrained(d, safe_serialization=True)
    for name in ["tokenizer.json"]:
        shutil.copy(bytelevel_tokenizer_path, os.path.join(d, name))
    save_file({"tokens": tokens.to(torch.int32), "logits": logits_of(model)},
              os.path.join(OUT, "logits_gpt2_f32.safetensors"))

    bf = transformers.GPT2LMHeadModel(cfg).eval()
    bf.load_state_dict(model.state_dict())
    bf = bf.to(torch.bfloat16)
    bf.save_pretrained(os.path.join(OUT, "gpt2_bf16_sharded"), safe_serialization=True,
                       max_shard_size="60KB")
    save_file({"tokens": tokens.to(torch.int32), "logits": logits_of(bf)},
              os.path.join(OUT, "logits_gpt2_bf16_sharded.safetensors"))

    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.load_state_dict(model.state_dict())
    hf = hf.to(torch.float16)
    hf.transformer.save_pretrained(os.path.join(OUT, "gpt2_f16_noprefix"), safe_serialization=True)
    save_file({"tokens": tokens.to(torch.int32), "logits": logits_of(hf)},
              os.path.join(OUT, "logits_gpt2_f16_noprefix.safetensors"))


def make_family_models(vocab_size=128):
    """Tiny opt / llama / qwen2 models: small enough (d_model 32, 2 layers, vocab 128) that
    all of them together stay a few hundred KiB."""
    B, T = 2, 16
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, vocab_size, (B, T), generator=g, dtype=torch.int64)
    train = torch.randint(0, vocab_size, (1, T + 1), generator=g, dtype=torch.int64)

    def perturb(model):
        with torch.no_grad():
            # Random norm weights and biases too, so a mix-up of any two tensors shows.
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        return model.eval()

    def save(name, model, cfg_cls, model_cls, grads=False, **save_args):
        d = os.path.join(OUT, name)
        model.save_pretrained(d, safe_serialization=True, **save_args)
        # Reference in fp32 from the saved (possibly bf16) weights, widened exactly.
        ref = model_cls.from_pretrained(d, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            logits = ref(tokens).logits.float().contiguous()
        out = ref(train[:, :T]).logits.float()
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, vocab_size),
                                                 train[:, 1:].reshape(-1))
        tensors = {"tokens": tokens.to(torch.int32), "logits": logits,
                   "train_tokens": train.to(torch.int32),
                   "train_loss": loss.detach().float().reshape(1).contiguous()}
        if grads:
            # d train_loss / d every weight, under "grad." + the checkpoint's tensor name.
            loss.backward()
            for n, p in ref.named_parameters():
                if p.grad is not None:
                    tensors["grad." + n] = p.grad.float().contiguous()
        save_file(tensors, os.path.join(OUT, "logits_%s.safetensors" % name))

    torch.manual_seed(1)
    opt_cfg = transformers.OPTConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                                     ffn_dim=48, num_attention_heads=4, max_position_embeddings=T,
                                     word_embed_proj_dim=32, do_layer_norm_before=True,
                                     activation_function="relu", pad_token_id=1,
                                     bos_token_id=2, eos_token_id=2)
    save("opt_f32", perturb(transformers.OPTForCausalLM(opt_cfg)), transformers.OPTConfig,
         transformers.OPTForCausalLM, grads=True)

    torch.manual_seed(2)
    llama_cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32,
                                         intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=T, rms_norm_eps=1e-5,
                                         rope_theta=10000.0, tie_word_embeddings=False,
                                         bos_token_id=1, eos_token_id=2)
    save("llama_gqa_f32", perturb(transformers.LlamaForCausalLM(llama_cfg)),
         transformers.LlamaConfig, transformers.LlamaForCausalLM)

    torch.manual_seed(3)
    tied_cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32,
                                        intermediate_size=40, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=T, rms_norm_eps=1e-6,
                                        rope_theta=500000.0, tie_word_embeddings=True,
                                        bos_token_id=1, eos_token_id=2)
    tied = perturb(transformers.LlamaForCausalLM(tied_cfg)).to(torch.bfloat16)
    save("llama_bf16_sharded", tied, transformers.LlamaConfig, transformers.LlamaForCausalLM,
         max_shard_size="20KB")

    torch.manual_seed(4)
    qwen_cfg = transformers.Qwen2Config(vocab_size=vocab_size, hidden_size=32,
                                        intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=T, rms_norm_eps=1e-6,
                                        rope_theta=10000.0, tie_word_embeddings=True,
                                        use_sliding_window=False)
    save("qwen2_gqa_f32", perturb(transformers.Qwen2ForCausalLM(qwen_cfg)),
         transformers.Qwen2Config, transformers.Qwen2ForCausalLM)


def main():
    torch.set_num_threads(1)
    if sys.argv[1:] == ["--families"]:
        for name in ["opt_f32", "llama_gqa_f32", "llama_bf16_sharded", "qwen2_gqa_f32"]:
            shutil.rmtree(os.path.join(OUT, name), ignore_errors=True)
        make_family_models()
        return
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    toks = make_tokenizers()
    refs = {"tokenizers_version": tokenizers.__version__, "corpus": CORPUS,
            "document": "\n".join(training_text()[:80]), "random": random_strings(150),
            "tokenizers": {}}
    for name, tok in toks.items():
        path = os.path.join(OUT, "tok_%s.json" % name)
        tok.save(path)
        texts = CORPUS + [refs["document"]] + refs["random"]
        ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
        decoded = [tok.decode(i, skip_special_tokens=False) for i in ids]
        refs["tokenizers"][name] = {"file": "tok_%s.json" % name, "ids": ids, "decoded": decoded}
    with open(os.path.join(OUT, "tokenizer_refs.json"), "w", encoding="utf-8") as f:
        json.dump(refs, f, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
        f.write("\n")
    make_models(toks["bytelevel"].get_vocab_size(), os.path.join(OUT, "tok_bytelevel.json"))
    make_family_models()
    total = 0
    for root, _, files in os.walk(OUT):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    print("wrote %s: %.1f KiB" % (OUT, total / 1024))


if __name__ == "__main__":
    main()
