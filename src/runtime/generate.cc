#include "fuyou/generate.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "fuyou/checkpoint.h"
#include "fuyou/config.h"
#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/family.h"
#include "fuyou/hf_checkpoint.h"
#include "fuyou/timing.h"
#include "fuyou/tokenizer.h"

namespace fs = std::filesystem;

namespace fuyou {
namespace {

using json = nlohmann::json;

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw IoError(str(p.string(), ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A JSON file that may be absent: null then. A file that is there must parse.
json read_json_or_null(const fs::path& p) {
  std::error_code ec;
  if (!fs::is_regular_file(p, ec)) return nullptr;
  json j = json::parse(read_text(p), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) throw ConfigError(str(p.string(), ": not a JSON object"));
  return j;
}

// eos_token_id and friends: an integer or a list of integers.
std::vector<int32_t> ids_of(const json& j, const char* key) {
  std::vector<int32_t> out;
  if (!j.is_object() || !j.contains(key)) return out;
  const json& v = j[key];
  auto add = [&](const json& x) {
    if (x.is_number_integer() && x.get<int64_t>() >= 0 && x.get<int64_t>() < (int64_t{1} << 31))
      out.push_back(static_cast<int32_t>(x.get<int64_t>()));
  };
  if (v.is_array())
    for (const auto& x : v) add(x);
  else
    add(v);
  return out;
}

// A special token of tokenizer_config.json: a string, or an object with "content".
std::string token_text(const json& tc, const char* key, const std::string& fallback) {
  if (!tc.is_object() || !tc.contains(key)) return fallback;
  const json& v = tc[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  return "";
}

// The special tokens of a TemplateProcessing post-processor's single-sequence template,
// before and after the sequence ($A). Found directly or inside a Sequence of processors.
bool template_specials(const json& pp, const Tokenizer& tok, std::vector<int32_t>* prefix,
                       std::vector<int32_t>* suffix) {
  if (!pp.is_object()) return false;
  const std::string type = pp.value("type", "");
  if (type == "Sequence" && pp.contains("processors") && pp["processors"].is_array()) {
    for (const auto& p : pp["processors"])
      if (template_specials(p, tok, prefix, suffix)) return true;
    return false;
  }
  auto id_of = [&](const std::string& t) {
    std::optional<int32_t> id = tok.token_to_id(t);
    if (!id)
      throw ConfigError(str(tok.source(), ": post_processor names token '", t,
                            "', which is not in the vocabulary"));
    return *id;
  };
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    // {"cls": ["<s>", 0], "sep": ["</s>", 2]}: cls before, sep after.
    for (const char* k : {"cls", "sep"})
      if (pp.contains(k) && pp[k].is_array() && pp[k].size() == 2 && pp[k][1].is_number_integer())
        (std::string(k) == "cls" ? prefix : suffix)->push_back(pp[k][1].get<int32_t>());
    return true;
  }
  if (type != "TemplateProcessing" || !pp.contains("single") || !pp["single"].is_array())
    return false;
  bool after = false;
  for (const auto& item : pp["single"]) {
    if (item.contains("Sequence")) {
      after = true;
    } else if (item.contains("SpecialToken") && item["SpecialToken"].contains("id")) {
      const std::string name = item["SpecialToken"]["id"].get<std::string>();
      std::vector<int32_t> ids;
      const json& st = pp.value("special_tokens", json::object());
      if (st.contains(name) && st[name].contains("ids") && st[name]["ids"].is_array())
        for (const auto& x : st[name]["ids"]) ids.push_back(x.get<int32_t>());
      else
        ids.push_back(id_of(name));
      (after ? suffix : prefix)->insert((after ? suffix : prefix)->end(), ids.begin(), ids.end());
    }
  }
  return true;
}

// transformers' clean_up_tokenization (PreTrainedTokenizerBase), in its order.
std::string clean_up_spaces(std::string s) {
  static const std::pair<const char*, const char*> rules[] = {
      {" .", "."},     {" ?", "?"},   {" !", "!"},   {" ,", ","},     {" ' ", "'"},
      {" n't", "n't"}, {" 'm", "'m"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
  for (const auto& [from, to] : rules) {
    const std::string f = from, t = to;
    std::string out;
    size_t i = 0;
    for (size_t k; (k = s.find(f, i)) != std::string::npos; i = k + f.size())
      out += s.substr(i, k - i) + t;
    s = out + s.substr(i);
  }
  return s;
}

bool is_engine_dir(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p / kEngineConfigFile, ec);
}

}  // namespace

ModelFiles find_model_files(const std::string& dir, const ModelConfig& model) {
  ModelFiles f;
  f.dir = carried_files_dir(dir);
  std::error_code ec;
  const fs::path d(f.dir);
  // An engine directory keeps its base's config.json as hf_config.json; a Hugging Face
  // directory has config.json itself.
  for (const char* name : {kKeptHfConfigFile, kHfConfigFile}) {
    if (std::string(name) == kHfConfigFile && is_engine_dir(d)) continue;
    if (fs::is_regular_file(d / name, ec)) {
      f.hf_config = read_text(d / name);
      break;
    }
  }
  if (is_engine_dir(fs::path(dir)))
    f.chat_template_kwargs =
        load_config_file((fs::path(dir) / kEngineConfigFile).string()).data.chat_template_kwargs;
  json cfg = f.hf_config.empty() ? json(nullptr) : json::parse(f.hf_config, nullptr, false);
  if (cfg.is_object() && cfg.contains("model_type") && cfg["model_type"].is_string())
    f.model_type = cfg["model_type"].get<std::string>();
  else
    f.model_type = hf_model_type(model);
  f.context = model.position_table();  // a learned table's rows, trained at seq_len or not
  // Rotary positions have no table: a fine-tune may train at a shorter seq_len than the
  // base's context, which generation may use whole.
  if (rotary(family_traits(model.family)) && cfg.is_object() &&
      cfg.contains("max_position_embeddings") && cfg["max_position_embeddings"].is_number_integer())
    f.context = std::max(f.context, cfg["max_position_embeddings"].get<int>());
  // Where the engine's computation equals transformers' only within a context (a sliding
  // window, dynamic NTK rotary embeddings), generation stays inside it as training does.
  if (model.sliding_window > 0) f.context = std::min(f.context, model.sliding_window);
  if (model.rope_type == "dynamic" || model.rope_type == "longrope")
    f.context = std::min(f.context, model.rope_original_context);
  return f;
}

GenerationModel load_generation_model(const std::string& path) {
  std::error_code ec;
  fs::path p(path);
  GenerationModel g;
  if (fs::is_directory(p, ec)) {
    if (is_engine_dir(p)) {
      // A run still training has no final weights yet: its newest checkpoint has them.
      if (!fs::exists(p / kSingleWeightsFile, ec) && !fs::exists(p / kWeightsIndexFile, ec) &&
          fs::is_directory(p / kCheckpointsDir, ec)) {
        p = resolve_checkpoint(path);
        g.kind = "the newest checkpoint of a run without final weights, " + p.string();
      } else {
        g.kind = fs::is_regular_file(p / kManifestFile, ec) ? "training checkpoint"
                                                            : "engine checkpoint";
      }
      LoadedCheckpoint c = load_engine_checkpoint(p.string());
      g.model = c.model;
      g.params = std::move(c.params);
    } else if (fs::is_regular_file(p / kHfConfigFile, ec)) {
      LoadedCheckpoint c = load_hf_checkpoint(p.string());
      g.model = c.model;
      g.params = std::move(c.params);
      g.kind = "Hugging Face directory";
    } else {
      throw ConfigError(
          str(path,
              ": neither config.yaml (a fuyou-train run directory or an engine checkpoint) nor "
              "config.json (a Hugging Face model directory)"));
    }
    g.files = find_model_files(p.string(), g.model);
    return g;
  }
  if (!fs::is_regular_file(p, ec))
    throw IoError(str(path, ": no such model directory or safetensors file"));
  LoadedCheckpoint c = load_engine_checkpoint(path);
  g.model = c.model;
  g.params = std::move(c.params);
  g.kind = "engine weights file";
  g.files = find_model_files(p.parent_path().string(), g.model);
  return g;
}

TextCodec TextCodec::for_model(const ModelFiles& files, const ModelConfig& model,
                               const std::string& tokenizer_json) {
  TextCodec c;
  c.set_chat_template_kwargs(files.chat_template_kwargs);
  const fs::path dir(files.dir);
  const std::string tok_path =
      tokenizer_json.empty() ? (dir / "tokenizer.json").string() : tokenizer_json;
  std::error_code ec;
  const json cfg =
      files.hf_config.empty() ? json(nullptr) : json::parse(files.hf_config, nullptr, false);
  const json gen = read_json_or_null(dir / kGenerationConfigFile);
  for (int32_t id :
       ids_of(gen.is_object() && gen.contains("eos_token_id") ? gen : cfg, "eos_token_id"))
    c.stop_.insert(id);
  if (!fs::is_regular_file(tok_path, ec)) {
    if (model.vocab_size != static_cast<int>(kByteVocab))
      throw ConfigError(str("no tokenizer.json in ", files.dir, " and the model's vocabulary (",
                            model.vocab_size, ") is not byte-level (", kByteVocab,
                            "): give the model's tokenizer with --tokenizer"));
    c.description_ = "byte-level (no tokenizer.json; vocabulary 256)";
    return c;
  }
  auto tok = std::make_shared<Tokenizer>(Tokenizer::from_file(tok_path));
  const json tc = read_json_or_null(fs::path(tok_path).parent_path() / "tokenizer_config.json");
  const json tj = json::parse(read_text(tok_path), nullptr, false);
  if (tj.is_object() && tj.contains("added_tokens") && tj["added_tokens"].is_array())
    for (const auto& a : tj["added_tokens"])
      if (a.is_object() && a.value("special", false) && a.contains("id") &&
          a["id"].is_number_integer())
        c.special_.insert(a["id"].get<int32_t>());
  const std::string cls = tc.is_object() ? tc.value("tokenizer_class", std::string()) : "";
  const bool llama_cls = cls.rfind("LlamaTokenizer", 0) == 0 ||
                         cls.rfind("CodeLlamaTokenizer", 0) == 0 ||
                         (cls.empty() && files.model_type == "llama");
  std::string how;
  if (llama_cls) {
    // LlamaTokenizerFast rebuilds its post-processor from these two flags.
    auto flag = [&](const char* key, bool fallback) {
      return tc.is_object() && tc.contains(key) && tc[key].is_boolean() ? tc[key].get<bool>()
                                                                        : fallback;
    };
    auto add = [&](bool on, const std::string& text, std::vector<int32_t>* to) {
      if (!on || text.empty()) return;
      if (std::optional<int32_t> id = tok->token_to_id(text)) to->push_back(*id);
    };
    add(flag("add_bos_token", true), token_text(tc, "bos_token", "<s>"), &c.prefix_);
    add(flag("add_eos_token", false), token_text(tc, "eos_token", "</s>"), &c.suffix_);
    how = "Llama's add_bos_token/add_eos_token";
  } else if (tj.is_object() && tj.contains("post_processor") &&
             template_specials(tj["post_processor"], *tok, &c.prefix_, &c.suffix_)) {
    how = "tokenizer.json's post-processor";
  }
  const fs::path tc_path = fs::path(tok_path).parent_path() / "tokenizer_config.json";
  std::error_code jinja_ec;
  if (tc.is_object() &&
      (tc.contains("chat_template") ||
       fs::is_regular_file(tc_path.parent_path() / kChatTemplateFile, jinja_ec))) {
    c.chat_.chat_field = "messages";
    use_chat_template(read_special_tokens(tc_path.string()), tc_path.string(), &c.chat_);
  }
  c.clean_up_ = tc.is_object() && tc.contains("clean_up_tokenization_spaces") &&
                        tc["clean_up_tokenization_spaces"].is_boolean()
                    ? tc["clean_up_tokenization_spaces"].get<bool>()
                    : !llama_cls;
  c.description_ = str(tok->describe(), "; prompt ", c.prefix_.size(), " special token(s) before, ",
                       c.suffix_.size(), " after", how.empty() ? "" : " (" + how + ")",
                       c.chat_.chat_template.empty() ? "" : "; chat template",
                       c.clean_up_ ? "; spaces cleaned up on decoding" : "");
  c.tok_ = std::move(tok);
  return c;
}

std::vector<int32_t> TextCodec::encode_prompt(const std::string& text) const {
  std::vector<int32_t> ids = prefix_;
  if (tok_)
    tok_->encode_append(text, &ids);
  else
    for (int32_t b : byte_encode(text)) ids.push_back(b);
  ids.insert(ids.end(), suffix_.begin(), suffix_.end());
  return ids;
}

std::vector<int32_t> TextCodec::encode_chat_prompt(const std::string& text) const {
  const json messages = json::array({json{{"role", "user"}, {"content", text}}});
  return encode_chat_messages(messages.dump(), "--chat");
}

std::vector<int32_t> TextCodec::encode_chat_messages(const std::string& messages_json,
                                                     const std::string& where) const {
  if (!tok_ || chat_.chat_template.empty())
    throw ConfigError(str(where, ": the model's tokenizer has no chat_template (",
                          tok_ ? "none in tokenizer_config.json beside tokenizer.json"
                               : "a byte-level model without tokenizer.json",
                          "); write the prompt in the model's chat format instead"));
  return fuyou::encode_chat_prompt(*tok_, chat_, messages_json, where);
}

std::string TextCodec::decode(const std::vector<int32_t>& ids) const {
  if (!tok_) return byte_decode(ids);
  std::vector<int32_t> kept;
  for (int32_t id : ids)
    if (!special_.count(id)) kept.push_back(id);
  std::string text = tok_->decode(kept);
  return clean_up_ ? clean_up_spaces(std::move(text)) : text;
}

std::string TextCodec::describe() const {
  std::string stop;
  for (int32_t id : stop_) stop += (stop.empty() ? "" : ", ") + std::to_string(id);
  return str(description_, "; stops at ",
             stop.empty() ? std::string("no token (no eos_token_id)") : "id " + stop);
}

GenerateResult generate_tokens(GptDecoder& decoder, const std::vector<int32_t>& prompt,
                               const std::set<int32_t>& stop_ids, const GenerateOptions& opts) {
  using clock = std::chrono::steady_clock;
  if (prompt.empty())
    throw Error("the prompt encodes to no tokens (an empty prompt and no BOS token)");
  if (static_cast<int>(prompt.size()) >= decoder.capacity())
    throw Error(str("the prompt has ", prompt.size(), " tokens, but the decoder holds ",
                    decoder.capacity(), " positions: nothing is left to generate"));
  GenerateResult r;
  r.prompt_ids = prompt;
  Rng rng(opts.seed);
  decoder.reset();
  auto t0 = clock::now();
  const std::vector<float>* logits = &decoder.step(prompt.data(), static_cast<int>(prompt.size()));
  r.prompt_s = seconds_since(t0);
  t0 = clock::now();
  while (static_cast<int>(r.ids.size()) < opts.max_new_tokens) {
    const int32_t id = sample_token(*logits, opts.sampling, rng);
    r.ids.push_back(id);
    if (opts.on_token) opts.on_token(id);
    if (opts.stop_at_eos && stop_ids.count(id)) {
      r.stopped = true;
      break;
    }
    if (static_cast<int>(r.ids.size()) == opts.max_new_tokens ||
        decoder.position() == decoder.capacity())
      break;
    logits = &decoder.step(&id, 1);
  }
  r.generate_s = seconds_since(t0);
  return r;
}

}  // namespace fuyou
