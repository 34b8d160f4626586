// Hugging Face tokenizer.json: BPE tokenizers, byte-level (GPT-2, Llama 3, Qwen2) and
// SentencePiece-style with byte fallback (Llama 2), encoding exactly as the tokenizers
// library does (Tokenizer.encode(text, add_special_tokens=False)); and building token
// shards from text and JSON Lines datasets with it.
//
// What is supported, and what is refused with "unsupported ...": docs/data.md, section
// "Tokenizers". Regex pre-tokenizers are not run through a regex engine: the patterns that
// real tokenizers use (GPT-2's, Llama 3's / cl100k's, Qwen2's) are recognised by their exact
// text and run by hand-written scanners with Unicode letter/number tables.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fuyou {

class Tokenizer {
 public:
  // Parses and validates tokenizer.json; throws ConfigError naming the file and the field.
  static Tokenizer from_file(const std::string& path);
  static Tokenizer from_json(const std::string& json_text, const std::string& source);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // Token ids of `text`. Added tokens (special tokens) written in the text are recognised;
  // no BOS/EOS are added (the post-processor is not applied).
  std::vector<int32_t> encode(std::string_view text) const;
  void encode_append(std::string_view text, std::vector<int32_t>* out) const;
  // A text's tokens, and where their encoding splits: after each added token the raw text
  // holds (rstrip ones aside), since the text before it encodes as it does whatever follows.
  struct Encoding {
    std::vector<int32_t> ids;
    std::vector<std::pair<size_t, size_t>>
        splits;  // (byte, tokens): text[0, byte) is ids[0, tokens)
  };
  Encoding encode_with_splits(std::string_view text) const;
  // How many leading tokens the encoding of text's first x bytes shares with `whole` (the
  // encoding of `text`): encode(text.substr(0, x)) compared with whole.ids, found by encoding
  // from the last split before x only, so the cost is that of the text since that split.
  size_t shared_prefix(std::string_view text, const Encoding& whole, size_t x) const;
  // Text of `ids` through the tokenizer's decoder, special tokens included.
  std::string decode(const std::vector<int32_t>& ids) const;

  // The token's string in the vocabulary (model alphabet, e.g. "Ġthe"); empty if unknown.
  std::string id_to_token(int32_t id) const;
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // One past the largest id (model vocabulary and added tokens).
  uint32_t vocab_size() const;
  // "BPE, 512 tokens, byte-level, pre-tokenizer ByteLevel" and so on, for logs.
  std::string describe() const;
  const std::string& source() const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---- datasets -------------------------------------------------------------------------

// Loss masks for prompt/completion data: a file beside each token shard (train.mask next to
// train.tok) with the shard's 32-byte header layout but magic "FYLSMASK", 1 byte per token,
// "vocab size" 2, holding 1 where the token is a completion token (its prediction counts in
// the loss) and 0 for prompt tokens. docs/data.md, "Loss masks".
constexpr char kMaskMagic[8] = {'F', 'Y', 'L', 'S', 'M', 'A', 'S', 'K'};

struct LossMask {
  std::string path;
  std::vector<uint8_t> mask;  // 0 or 1 per token
};
// Reads and validates (magic, version, width 1, count against file size, values 0/1).
LossMask read_loss_mask(const std::string& path);
// The same for a mask's bytes in memory; `path` names it in errors.
LossMask parse_loss_mask(std::string_view bytes, const std::string& path);

// The model's chat template and the tokens it may name (bos_token, eos_token, pad_token,
// unk_token), from tokenizer_config.json.
struct SpecialTokens;

struct DatasetOptions {
  // Inputs are JSON Lines when a field is given, else plain-text files (one document each).
  std::string jsonl_field;   // each line's text is this string field
  std::string prompt_field;  // with completion_field: prompt/completion pairs, loss mask
  std::string completion_field;
  // Conversations: each line's field is a list of {"role", "content"} messages, rendered with
  // chat_template (Jinja, src/formats/jinja.h) and encoded; the loss mask covers what the
  // assistant turns add (docs/data.md, "Chat data").
  std::string chat_field;
  std::string chat_template;
  std::string template_source;  // names the template in errors (tokenizer_config.json)
  std::string template_bos, template_eos, template_pad, template_unk;  // the template's tokens
  // Conversations: the BOS / EOS the caller says the template writes at the start / end of a
  // conversation ("": none), checked on every record and never added, since the template writes
  // a conversation's special tokens itself; unset: not checked. bos_token and eos_token are
  // refused with chat_field (a second BOS/EOS beside the template's).
  std::optional<std::string> chat_bos, chat_eos;
  // Conversations: how a record's messages are written: "openai" ({"role", "content"}, as
  // the template reads them) or "sharegpt" ({"from", "value"}, mapped to roles: human -> user,
  // gpt -> assistant, system, tool / observation -> tool).
  std::string chat_format = "openai";
  // Conversations: the record's field of function definitions, passed to the template as
  // `tools` (absent or null: none, as transformers passes them).
  std::string tools_field = "tools";
  // Conversations: more variables for the template, a JSON object (transformers'
  // apply_chat_template keyword arguments, e.g. {"enable_thinking": false}); they override
  // the special tokens of the same names. Empty: none.
  std::string chat_template_kwargs;
  double val_fraction = 0.05;  // last share of each file (text) or of its records (JSONL)
  // Optional added tokens around every document / record, by their text (e.g. "<s>",
  // "<|endoftext|>"): BOS before (mask 0), EOS after (mask 1: ending is learned). Empty: none
  // (fuyou-convert fills them from tokenizer_config.json, special_tokens()).
  std::string bos_token;
  std::string eos_token;
};

// The tokens a model's tokenizer_config.json names (bos_token, eos_token, pad_token, unk_token as
// strings or {"content": ...} objects, add_bos_token, chat_template); absent fields stay
// empty/false.
struct SpecialTokens {
  std::string bos, eos, pad, unk;
  bool add_bos = false;  // transformers puts bos before every encoded text
  std::string chat_template;
};
// Reads `path` (tokenizer_config.json); ConfigError naming the file and field when malformed.
SpecialTokens read_special_tokens(const std::string& path);
// The file transformers 5 saves a tokenizer's chat template in, beside tokenizer_config.json
// (whose chat_template, when present, comes first).
inline constexpr const char* kChatTemplateFile = "chat_template.jinja";
// Conversations through `st`'s chat_template and the tokens it may name; `source` (the
// tokenizer_config.json it came from) names the template in errors.
void use_chat_template(const SpecialTokens& st, const std::string& source, DatasetOptions* o);

// A prompt/completion pair as transformers encodes the concatenated text: ids of
// tok.encode(prompt + completion) appended to *ids, and to *mask 0 for the tokens the prompt's
// own encoding shares (its longest common prefix with the pair's) and 1 for the rest, so the
// first token that covers completion text starts the counted part (docs/data.md, "Token
// boundaries").
void encode_pair(const Tokenizer& tok, std::string_view prompt, std::string_view completion,
                 std::vector<int32_t>* ids, std::vector<uint8_t>* mask);

// A conversation (`messages`: a JSON array of {"role": ..., "content": ...} objects) through a
// chat template as transformers' apply_chat_template(tokenize=True) encodes it: the rendered
// text's ids appended to *ids. *mask gets 1 for the tokens each assistant message contributes
// to the render of the whole conversation (what the template's loop turn over it writes, past
// the header the generation prompt writes before it; the last one also what a template writes
// after the last turn only, Phi-3.5's EOS), 0 elsewhere; a template with {% generation %}
// blocks is masked by them. Messages reach the template as apply_chat_template passes them
// (null fields dropped, reasoning aliased, content a string or a list of text parts),
// `opts.chat_format` maps ShareGPT turns. The cost is linear in the conversation's length where
// the template writes an added token in each turn. Error naming `where` for a malformed
// conversation, a part that is not text, or, for a template that writes its messages in no loop
// of their own, a turn that does not render as an extension of the turns before it.
// `tools_json` is the record's function definitions (a JSON array, or empty: none).
void encode_chat(const Tokenizer& tok, const DatasetOptions& opts, const std::string& messages_json,
                 const std::string& where, std::vector<int32_t>* ids, std::vector<uint8_t>* mask,
                 const std::string& tools_json = {});

// The conversation with the generation prompt (what the model's turn follows), encoded as
// apply_chat_template(messages, add_generation_prompt=True, tokenize=True) encodes it.
std::vector<int32_t> encode_chat_prompt(const Tokenizer& tok, const DatasetOptions& opts,
                                        const std::string& messages_json, const std::string& where);

struct DatasetResult {
  std::string train_path, val_path;                  // train.tok, val.tok
  std::string train_mask_path, val_mask_path;        // train.mask, val.mask (prompt/completion)
  std::string train_records_path, val_records_path;  // train.rec, val.rec (JSON Lines records)
  uint64_t train_tokens = 0, val_tokens = 0;
  uint64_t documents = 0;  // files or records
  size_t files = 0;
  size_t skipped = 0;  // binary files and symlinks
  uint32_t vocab_size = 0;
};

// Tokenizes inputs (files, or directories walked recursively in sorted order) into
// out_dir/{train,val}.tok (and .mask). out_dir must not exist or be empty. Shards are
// streamed to disk; JSONL errors name the file, the line and the field.
DatasetResult build_tokenized_dataset(const Tokenizer& tok, const std::vector<std::string>& inputs,
                                      const std::string& out_dir, const DatasetOptions& opts);

}  // namespace fuyou
