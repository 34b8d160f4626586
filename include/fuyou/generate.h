// Generation from a model as a user has it: a fuyou-train run directory, a training or engine
// checkpoint, or a Hugging Face model directory, with the files that say how its text becomes
// tokens (tokenizer.json, tokenizer_config.json, config.json's token ids). fuyou-generate and
// fuyou-train's samples run through here; the decoder itself is include/fuyou/decoder.h.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/config.h"
#include "fuyou/decoder.h"
#include "fuyou/tokenizer.h"

namespace fuyou {

// Where a model's files are and what they say.
struct ModelFiles {
  std::string dir;  // where tokenizer.json, config.json / hf_config.json were looked for
  std::string
      hf_config;  // the base model's config.json text (config.json or hf_config.json); empty: none
  std::string model_type;  // its model_type ("" without one)
  // config.yaml's data.chat_template_kwargs where the model is a run directory or an engine
  // checkpoint (a JSON object's text, "" for none): the template variables its chat data was
  // rendered with, so that --chat renders prompts as training did.
  std::string chat_template_kwargs;
  // Positions the model was made for: the base's max_position_embeddings (llama) or the
  // position table (gpt2, opt); the engine's seq_len when nothing says more.
  int context = 0;
};
ModelFiles find_model_files(const std::string& dir, const ModelConfig& model);

// A model to generate from: its weights (make_gpt_layout order, fp32) and its files.
struct GenerationModel {
  ModelConfig model;
  std::vector<float> params;
  ModelFiles files;
  std::string kind;  // "hugging face directory", "engine checkpoint", ...
};
// A directory with config.yaml (run directory, training or engine checkpoint; its master
// weights), a Hugging Face directory (config.json and safetensors), or a model.safetensors
// written by the engine. Throws naming the path and what was looked for.
GenerationModel load_generation_model(const std::string& path);

// Text <-> token ids as transformers' AutoTokenizer does it for the model: prompt.encode adds
// the special tokens the tokenizer adds (add_special_tokens=True: LlamaTokenizerFast's BOS
// from tokenizer_config.json's add_bos_token / add_eos_token, else tokenizer.json's
// TemplateProcessing post-processor); decode skips special tokens and cleans up spaces when
// tokenizer_config.json says so (clean_up_tokenization_spaces; transformers' default: true,
// false for Llama's tokenizer). Without tokenizer.json, a 256-token model is byte-level.
class TextCodec {
 public:
  static TextCodec for_model(const ModelFiles& files, const ModelConfig& model,
                             const std::string& tokenizer_json = "");
  std::vector<int32_t> encode_prompt(const std::string& text) const;
  // `text` as one user message through tokenizer_config.json's chat_template, with the
  // generation prompt: apply_chat_template([{"role": "user", "content": text}],
  // add_generation_prompt=True) (the template places any BOS itself). ConfigError when the
  // model has no chat template.
  std::vector<int32_t> encode_chat_prompt(const std::string& text) const;
  // A conversation (a JSON list of messages: a system message, earlier turns) through the chat
  // template with the generation prompt, as apply_chat_template(messages,
  // add_generation_prompt=True) encodes it. `where` names it in errors.
  std::vector<int32_t> encode_chat_messages(const std::string& messages_json,
                                            const std::string& where) const;
  // More template variables for every render (a JSON object, transformers' **kwargs to
  // apply_chat_template: {"enable_thinking": false}); checked when a prompt is rendered.
  void set_chat_template_kwargs(const std::string& json_object) {
    chat_.chat_template_kwargs = json_object;
  }
  std::string decode(const std::vector<int32_t>& ids) const;
  // The tokens that end generation: config.json's and generation_config.json's eos_token_id.
  const std::set<int32_t>& stop_ids() const { return stop_; }
  std::string describe() const;

 private:
  std::shared_ptr<const Tokenizer> tok_;  // null: byte-level
  std::vector<int32_t> prefix_, suffix_;
  std::set<int32_t> special_, stop_;
  DatasetOptions chat_;  // chat_template (empty: none) and the tokens it may name
  bool clean_up_ = false;
  std::string description_;
};

struct GenerateOptions {
  int max_new_tokens = 128;
  SamplingOptions sampling;
  uint64_t seed = 1234;
  bool stop_at_eos = true;
  // Called with each new token id as it is chosen (streaming output); may be empty.
  std::function<void(int32_t)> on_token;
};

struct GenerateResult {
  std::vector<int32_t> prompt_ids, ids;  // ids: the new tokens (the stop token included)
  bool stopped = false;                  // ended at a stop token
  double prompt_s = 0, generate_s = 0;   // the prompt's step, and the new tokens'
};

// Runs the prompt and then max_new_tokens steps (fewer at a stop token) on `decoder`, from an
// empty cache.
GenerateResult generate_tokens(GptDecoder& decoder, const std::vector<int32_t>& prompt,
                               const std::set<int32_t>& stop_ids, const GenerateOptions& opts);

}  // namespace fuyou
