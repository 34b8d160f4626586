// Datasets through a tokenizer.json into token shards (and loss masks for prompt/completion
// pairs). Shards are streamed: the header is written with a zero count, tokens are appended
// as documents are encoded, and the count is patched in before the file is renamed into
// place, so memory holds one document at a time, not the dataset.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/read_file.h"
#include "fuyou/tokenizer.h"
#include "src/formats/jinja.h"

namespace fs = std::filesystem;

namespace fuyou {
namespace {

// A shard file (tokens, or a mask with width 1) written incrementally under PATH.tmp.
class ShardStream {
 public:
  ShardStream(std::string path, const char magic[8], uint32_t width, uint32_t vocab)
      : path_(std::move(path)), tmp_(path_ + ".tmp"), width_(width), vocab_(vocab) {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw IoError(str(tmp_, ": cannot create: ", std::strerror(errno)));
    std::memcpy(header_, magic, 8);
    put32(8, kShardVersion);
    put32(12, width_);
    put64(16, 0);
    put32(24, vocab_);
    put32(28, 0);
    write(header_, 32);
  }
  ~ShardStream() {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(tmp_.c_str());
    }
  }
  ShardStream(const ShardStream&) = delete;
  ShardStream& operator=(const ShardStream&) = delete;

  void append(const std::vector<int32_t>& tokens) {
    buf_.resize(tokens.size() * width_);
    for (size_t i = 0; i < tokens.size(); ++i) {
      uint32_t t = static_cast<uint32_t>(tokens[i]);
      FY_CHECK(tokens[i] >= 0 && t < vocab_, "token ", tokens[i], " outside vocab ", vocab_);
      std::memcpy(buf_.data() + i * width_, &t, width_);  // little-endian host
    }
    write(buf_.data(), buf_.size());
    count_ += tokens.size();
  }
  void append_mask(const std::vector<uint8_t>& mask) {
    write(mask.data(), mask.size());
    count_ += mask.size();
  }
  uint64_t count() const { return count_; }

  void finish() {
    put64(16, count_);
    if (::pwrite(fd_, header_, 32, 0) != 32 || ::fsync(fd_) != 0) fail("header update/fsync");
    if (::close(fd_) != 0) {
      fd_ = -1;
      ::unlink(tmp_.c_str());
      throw IoError(str(tmp_, ": close failed: ", std::strerror(errno)));
    }
    fd_ = -1;
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
      int err = errno;
      ::unlink(tmp_.c_str());
      throw IoError(str(path_, ": rename from ", tmp_, " failed: ", std::strerror(err)));
    }
  }

 private:
  void put32(int at, uint32_t v) { std::memcpy(header_ + at, &v, 4); }
  void put64(int at, uint64_t v) { std::memcpy(header_ + at, &v, 8); }
  [[noreturn]] void fail(const char* what) {
    throw IoError(str(tmp_, ": ", what, " failed at offset ", offset_, ": ", std::strerror(errno)));
  }
  void write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    size_t done = 0;
    while (done < n) {
      ssize_t w = ::write(fd_, p + done, n - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) fail("write");
      done += static_cast<size_t>(w);
      offset_ += static_cast<uint64_t>(w);
    }
  }

  std::string path_, tmp_;
  uint32_t width_, vocab_;
  int fd_ = -1;
  char header_[32];
  uint64_t count_ = 0, offset_ = 0;
  std::vector<char> buf_;
};

bool blank(const std::string& line) {
  return line.find_first_not_of(" \t\r\n") == std::string::npos;
}

std::string string_field(const nlohmann::ordered_json& rec, const std::string& field,
                         const std::string& where) {
  if (!rec.contains(field)) throw IoError(str(where, ": field '", field, "' is missing"));
  if (!rec[field].is_string())
    throw IoError(
        str(where, ": field '", field, "' must be a string, got ", rec[field].type_name()));
  return rec[field].get<std::string>();
}

}  // namespace

void encode_pair(const Tokenizer& tok, std::string_view prompt, std::string_view completion,
                 std::vector<int32_t>* ids, std::vector<uint8_t>* mask) {
  const std::vector<int32_t> alone = tok.encode(prompt);
  std::string text;
  text.reserve(prompt.size() + completion.size());
  text.append(prompt).append(completion);
  const size_t first = ids->size();
  tok.encode_append(text, ids);
  size_t shared = 0;
  while (shared < alone.size() && first + shared < ids->size() &&
         (*ids)[first + shared] == alone[shared])
    ++shared;
  mask->resize(first, 0);
  mask->resize(first + shared, 0);
  mask->resize(ids->size(), 1);
}

namespace {

// Templates parsed once per text (a dataset renders one template for every record).
const jinja::Template& parsed_template(const DatasetOptions& o) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<jinja::Template>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& t = cache[o.chat_template];
  if (!t)
    t = std::make_unique<jinja::Template>(
        o.chat_template,
        o.template_source.empty() ? "chat_template" : o.template_source + ": chat_template");
  return *t;
}

}  // namespace

namespace {

// ShareGPT's speakers and the roles templates read.
const std::pair<const char*, const char*> kShareGptRoles[] = {
    {"human", "user"},    {"user", "user"}, {"gpt", "assistant"},   {"assistant", "assistant"},
    {"system", "system"}, {"tool", "tool"}, {"observation", "tool"}};

// A ShareGPT turn ({"from": "human", "value": ...}) as a message ({"role": "user", "content":
// ...}); its other fields stay, after these two.
nlohmann::ordered_json sharegpt_message(const nlohmann::ordered_json& turn, size_t k,
                                        const std::string& where) {
  if (!turn.is_object() || !turn.contains("from") || !turn["from"].is_string() ||
      !turn.contains("value") || !turn["value"].is_string())
    throw IoError(str(where, ": turn ", k,
                      " must be an object with string fields 'from' and 'value' (ShareGPT)"));
  const std::string from = turn["from"].get<std::string>();
  std::string known;
  for (const auto& [speaker, role] : kShareGptRoles) {
    if (from == speaker) {
      nlohmann::ordered_json m{{"role", role}, {"content", turn["value"]}};
      for (const auto& [key, v] : turn.items())
        if (key != "from" && key != "value") m[key] = v;
      return m;
    }
    known += str(known.empty() ? "" : ", ", speaker);
  }
  throw IoError(
      str(where, ": turn ", k, ": 'from' is '", from, "'; ShareGPT speakers are ", known));
}

// A message as transformers hands it to the template: fields that are null dropped (a
// template tests for a missing field, not a null one), and reasoning under each name templates
// read it by (`thinking` first, `reasoning_content` after the message's own fields).
nlohmann::ordered_json template_message(const nlohmann::ordered_json& m) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  const nlohmann::ordered_json* reasoning = nullptr;
  for (const char* key : {"reasoning_content", "thinking", "reasoning"})
    if (!reasoning && m.contains(key) && !m[key].is_null()) reasoning = &m[key];
  if (reasoning) out["thinking"] = *reasoning;
  for (const auto& [key, v] : m.items())
    if (!v.is_null()) out[key] = v;
  if (reasoning) out["reasoning_content"] = *reasoning;
  return out;
}

// The template's variables besides the messages: the special tokens, and over them the
// caller's keyword arguments (as apply_chat_template merges them), tools and documents.
nlohmann::ordered_json template_vars(const DatasetOptions& o, const std::string& tools_json,
                                     const std::string& where) {
  nlohmann::ordered_json vars = {{"bos_token", o.template_bos},
                                 {"eos_token", o.template_eos},
                                 {"pad_token", o.template_pad},
                                 {"unk_token", o.template_unk}};
  if (!o.chat_template_kwargs.empty()) {
    const auto kw = nlohmann::ordered_json::parse(o.chat_template_kwargs, nullptr, false);
    if (!kw.is_object())
      throw ConfigError(
          str("chat_template_kwargs: expected a JSON object, got '", o.chat_template_kwargs, "'"));
    for (const auto& [key, v] : kw.items()) {
      if (key == "messages" || key == "tools" || key == "documents" ||
          key == "add_generation_prompt")
        throw ConfigError(str("chat_template_kwargs: '", key,
                              "' is set by the tokenization itself (",
                              key == "tools" ? "a record's tools field" : "each record", ")"));
      vars[key] = v;
    }
  }
  // As transformers passes them: tools and documents are none when a record has neither.
  vars["tools"] = nullptr;
  vars["documents"] = nullptr;
  if (!tools_json.empty()) {
    nlohmann::ordered_json tools = nlohmann::ordered_json::parse(tools_json);
    if (!tools.is_null()) {
      if (!tools.is_array())
        throw IoError(str(where, ": field '", o.tools_field,
                          "' must be a list of function definitions (objects), got ",
                          tools.type_name()));
      for (size_t k = 0; k < tools.size(); ++k)
        if (!tools[k].is_object())
          throw IoError(str(where, ": field '", o.tools_field, "': tool ", k,
                            " must be an object (a function definition), got ",
                            tools[k].type_name()));
      vars["tools"] = std::move(tools);
    }
  }
  return vars;
}

// A conversation checked and ready to render through the chat template, whole or in part.
class ChatRender {
 public:
  ChatRender(const DatasetOptions& o, const std::string& messages_json, const std::string& where,
             const std::string& tools_json = {})
      : where_(where) {
    if (o.chat_template.empty())
      throw ConfigError(str(where,
                            ": conversations need the model's chat_template "
                            "(tokenizer_config.json beside tokenizer.json)"));
    tpl_ = &parsed_template(o);
    const nlohmann::ordered_json given = nlohmann::ordered_json::parse(messages_json);
    const int max_depth = jinja::Limits().max_depth;
    if (jinja::json_depth(given, max_depth) > max_depth)
      throw IoError(str(where, ": the messages nest more than ", max_depth,
                        " deep (the chat template's limit max_depth)"));
    if (!given.is_array() || given.empty())
      throw IoError(
          str(where, ": field '", o.chat_field, "' must be a non-empty list of messages"));
    const bool sharegpt = o.chat_format == "sharegpt";
    messages_ = nlohmann::ordered_json::array();
    for (size_t k = 0; k < given.size(); ++k) {
      messages_.push_back(
          template_message(sharegpt ? sharegpt_message(given[k], k, where) : given[k]));
      check_message(messages_.back(), k);
    }
    vars_ = template_vars(o, tools_json, where);
  }
  const nlohmann::ordered_json& messages() const { return messages_; }
  // The first n messages, with the generation prompt (the assistant's turn follows) or not.
  // `marked`, when given, receives the byte ranges the template's {% generation %} blocks wrote,
  // `turns` those each message's loop turns wrote (jinja::Template::render).
  std::string render(size_t n, bool generation, jinja::Template::Spans* marked = nullptr,
                     jinja::Template::Turns* turns = nullptr) {
    return render_window(0, n, generation, marked, turns);
  }
  // Messages [first, end) as if they were the whole conversation.
  std::string render_window(size_t first, size_t end, bool generation,
                            jinja::Template::Spans* marked = nullptr,
                            jinja::Template::Turns* turns = nullptr) {
    vars_["messages"] = nlohmann::ordered_json(messages_.begin() + static_cast<ptrdiff_t>(first),
                                               messages_.begin() + static_cast<ptrdiff_t>(end));
    vars_["add_generation_prompt"] = generation;
    try {
      return tpl_->render(vars_, &work_, marked, turns);
    } catch (const Error& e) {
      throw IoError(str(where_, ": ", e.what()));
    }
  }
  // Whether the template marks the assistant's text with {% generation %} blocks.
  bool marks_generation() const { return tpl_->has_generation(); }

 private:
  // A role, and text content, except an assistant's tool calls, which may come without. The
  // content is a string or a list of text parts ({"type": "text", "text": ...}), which reaches
  // the template as the list it is, as transformers passes it.
  void check_message(const nlohmann::ordered_json& m, size_t k) const {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw IoError(str(where_, ": message ", k, " must be an object with a string field 'role'"));
    const std::string who = str(where_, ": message ", k, " (", m["role"].get<std::string>(), ")");
    if (m.contains("content") && m["content"].is_array()) return check_parts(m["content"], who);
    if (m.contains("content") ? m["content"].is_string() : m.contains("tool_calls")) return;
    throw IoError(str(who, ": 'content' must be a string or a list of text parts",
                      m.contains("content") ? str(", got ", m["content"].type_name())
                                            : std::string(" (only tool calls may come without)")));
  }
  // Text parts only: an image or audio part would need the model's processor, which renders
  // and encodes what the tokenizer alone cannot.
  static void check_parts(const nlohmann::ordered_json& parts, const std::string& who) {
    for (size_t p = 0; p < parts.size(); ++p) {
      const auto& part = parts[p];
      if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
        throw IoError(str(who, ": content part ", p,
                          " must be an object with a string field 'type' (\"text\")"));
      const std::string type = part["type"].get<std::string>();
      if (type != "text")
        throw IoError(str(who, ": content part ", p, " is of type '", type,
                          "'; only text parts are supported (the tokenizer cannot encode an ", type,
                          " part)"));
      if (!part.contains("text") || !part["text"].is_string())
        throw IoError(str(who, ": content part ", p, " (text) must have a string field 'text'"));
    }
  }

  std::string where_;
  const jinja::Template* tpl_ = nullptr;
  nlohmann::ordered_json messages_, vars_;
  // The renders of one conversation share one work budget (where a template's turns are not
  // known, each assistant turn renders the conversation before it).
  jinja::Work work_{jinja::Limits().max_work};
};

// What the conversation up to an assistant turn (`upto`) renders beyond the whole conversation
// (`full`) once they part: empty when `upto` is a prefix of `full`, or the text a template
// writes after a conversation's last turn only (Phi-3.5's EOS) when `full` ends with it too.
// npos when neither: the turn is not rendered in the whole as it is alone.
size_t trailer_start(const std::string& upto, const std::string& full) {
  size_t k = 0;
  while (k < upto.size() && k < full.size() && upto[k] == full[k]) ++k;
  if (k == upto.size()) return k;
  const size_t rest = upto.size() - k;
  if (rest <= full.size() - k && full.compare(full.size() - rest, rest, upto, k, rest) == 0)
    return k;
  return std::string::npos;
}

// Byte ranges of a rendered conversation and the rule that maps them to tokens.
struct MaskedText {
  std::string text;
  std::vector<std::pair<size_t, size_t>> spans;  // [begin, end) bytes of text, in order
  // true: every token from the one holding a span's first byte to the one holding its last
  // (transformers' return_assistant_tokens_mask); false: the tokens from where those of the text
  // before the span stop being the whole's to where those of the text up to its end do.
  bool holding = false;
};

// The text's ids appended to *ids and its mask to *mask. Each span's ends are found by encoding
// from the last added token before them (Tokenizer::shared_prefix), so the cost is linear in
// the text when the template writes an added token in each turn.
void encode_masked(const Tokenizer& tok, const MaskedText& t, std::vector<int32_t>* ids,
                   std::vector<uint8_t>* mask) {
  const Tokenizer::Encoding whole = tok.encode_with_splits(t.text);
  const std::vector<int32_t>& all = whole.ids;
  std::vector<uint8_t> m(all.size(), 0);
  for (const auto& [b, e] : t.spans) {
    if (all.empty() || e <= b) continue;
    const size_t first = tok.shared_prefix(t.text, whole, b);
    const size_t end = t.holding
                           ? std::min(tok.shared_prefix(t.text, whole, e - 1), all.size() - 1) + 1
                           : tok.shared_prefix(t.text, whole, e);
    for (size_t i = first; i < end; ++i) m[i] = 1;
  }
  ids->insert(ids->end(), all.begin(), all.end());
  mask->resize(ids->size() - all.size(), 0);
  mask->insert(mask->end(), m.begin(), m.end());
}

// What the generation prompt writes after messages [first, k) rendered as a conversation: the
// text past the end of the last turn its loop over them wrote.
std::string opening_after(ChatRender& chat, size_t first, size_t k) {
  jinja::Template::Turns turns;
  const std::string text = chat.render_window(first, k, true, nullptr, &turns);
  size_t end = 0;
  for (const auto& t : turns) end = std::max(end, t.end);
  return text.substr(end);
}

// The header of assistant message k: what the generation prompt writes after the conversation
// before it (`<|im_start|>assistant\n`; `<｜tool▁outputs▁end｜>` after DeepSeek-R1's tool
// answers). Rendered from the last user message before it, so that the cost is the exchange's,
// not the conversation's; from the first message where a template refuses such a start (one
// that asks for a system message first).
std::string header_of(ChatRender& chat, size_t k) {
  const nlohmann::ordered_json& messages = chat.messages();
  size_t first = k;
  while (first > 0 && messages[first - 1]["role"] != "user") --first;
  first = first > 0 ? first - 1 : 0;
  if (first > 0) {
    try {
      return opening_after(chat, first, k);
    } catch (const IoError&) {
      // Rendered below from the first message, where the template raises, if it does, as the
      // whole conversation's render would not.
    }
  }
  return opening_after(chat, 0, k);
}

// What each assistant message contributes to the render of the whole conversation: the text its
// loop turns wrote, less its header (the longest part of header_of that the turn's text begins
// with), and, for the turn written last when it ends the conversation, what the template writes
// after it (Phi-3.5's EOS). One render of the whole and one of each exchange, so the cost is
// linear in the conversation's length. False when the template's turns are not known (it writes
// no message in a loop over them, or writes them in a macro or set block).
bool assistant_turns(ChatRender& chat, MaskedText* out) {
  const nlohmann::ordered_json& messages = chat.messages();
  const size_t n = messages.size();
  jinja::Template::Turns turns;
  out->text = chat.render(n, false, nullptr, &turns);
  if (turns.empty()) return false;
  std::vector<bool> opened(n, false);
  for (size_t i = 0; i < turns.size(); ++i) {
    const jinja::Template::Turn& t = turns[i];
    if (messages[t.message]["role"] != "assistant") continue;
    size_t begin = t.begin;
    if (!opened[t.message]) {
      opened[t.message] = true;
      const std::string header = header_of(chat, t.message);
      while (begin < t.end && begin - t.begin < header.size() &&
             out->text[begin] == header[begin - t.begin])
        ++begin;
    }
    const bool ends = t.message + 1 == n && i + 1 == turns.size();
    out->spans.emplace_back(begin, ends ? out->text.size() : t.end);
  }
  return true;
}

// The assistant turns of a template whose turns are not known, by rendering the conversation
// before each (with the generation prompt) and up to it: each must render as an extension of
// the one before, else the record is refused. Costs the square of the conversation's length.
MaskedText assistant_turns_by_prefixes(ChatRender& chat, const std::string& where) {
  const nlohmann::ordered_json& messages = chat.messages();
  MaskedText out;
  out.text = chat.render(messages.size(), false);
  const std::string& full = out.text;
  std::optional<std::string> trailer;  // what every turn rendered last adds beyond the whole
  for (size_t k = 0; k < messages.size(); ++k) {
    if (messages[k]["role"] != "assistant") continue;
    const std::string before = chat.render(k, true), upto = chat.render(k + 1, false);
    const size_t cut = trailer_start(upto, full);
    const bool same_trailer =
        cut != std::string::npos && (!trailer || k + 1 == messages.size() ||
                                     upto.compare(cut, std::string::npos, *trailer) == 0);
    // The turn must share its text with the whole past its header, or be told apart by nothing.
    const bool shared = cut != std::string::npos &&
                        (cut > before.size() || (cut == before.size() && cut == upto.size()));
    if (upto.compare(0, before.size(), before) != 0 || !shared || !same_trailer)
      throw IoError(str(where, ": the chat template does not render assistant message ", k,
                        " as an extension of the conversation before it, so its tokens cannot be "
                        "told apart"));
    if (k + 1 < messages.size()) trailer = upto.substr(cut);
    out.spans.emplace_back(before.size(), cut);
  }
  return out;
}

}  // namespace

void encode_chat(const Tokenizer& tok, const DatasetOptions& o, const std::string& messages_json,
                 const std::string& where, std::vector<int32_t>* ids, std::vector<uint8_t>* mask,
                 const std::string& tools_json) {
  ChatRender chat(o, messages_json, where, tools_json);
  MaskedText t;
  if (chat.marks_generation()) {
    t.text = chat.render(chat.messages().size(), false, &t.spans);
    t.holding = true;
  } else if (!assistant_turns(chat, &t)) {
    t = assistant_turns_by_prefixes(chat, where);
  }
  encode_masked(tok, t, ids, mask);
}

std::vector<int32_t> encode_chat_prompt(const Tokenizer& tok, const DatasetOptions& o,
                                        const std::string& messages_json,
                                        const std::string& where) {
  ChatRender chat(o, messages_json, where);
  return tok.encode(chat.render(chat.messages().size(), true));
}

void use_chat_template(const SpecialTokens& st, const std::string& source, DatasetOptions* o) {
  o->chat_template = st.chat_template;
  o->template_source = source;
  o->template_bos = st.bos;
  o->template_eos = st.eos;
  o->template_pad = st.pad;
  o->template_unk = st.unk;
}

SpecialTokens read_special_tokens(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(str(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(str(path, ": not valid JSON: ", e.what()));
  }
  if (!j.is_object()) throw ConfigError(str(path, ": expected a JSON object"));
  auto token = [&](const char* key) -> std::string {
    if (!j.contains(key) || j[key].is_null()) return "";
    const auto& v = j[key];
    if (v.is_string()) return v.get<std::string>();
    if (v.is_object() && v.contains("content") && v["content"].is_string())
      return v["content"].get<std::string>();
    throw ConfigError(
        str(path, ": ", key, ": expected a string or an object with a \"content\" string"));
  };
  SpecialTokens t;
  t.bos = token("bos_token");
  t.eos = token("eos_token");
  t.pad = token("pad_token");
  t.unk = token("unk_token");
  if (j.contains("add_bos_token") && !j["add_bos_token"].is_null()) {
    if (!j["add_bos_token"].is_boolean())
      throw ConfigError(str(path, ": add_bos_token: expected true or false"));
    t.add_bos = j["add_bos_token"].get<bool>();
  }
  if (j.contains("chat_template") && !j["chat_template"].is_null()) {
    if (!j["chat_template"].is_string())
      throw ConfigError(
          str(path,
              ": chat_template: only a single template string is supported (named templates "
              "are not)"));
    t.chat_template = j["chat_template"].get<std::string>();
  }
  // transformers 5 saves the template beside tokenizer_config.json, as chat_template.jinja.
  const std::string jinja =
      (std::filesystem::path(path).parent_path() / kChatTemplateFile).string();
  if (t.chat_template.empty() && std::filesystem::is_regular_file(jinja)) {
    constexpr uint64_t kMaxTemplateBytes = 16ull << 20;
    try {
      t.chat_template = read_file_bounded(jinja, kMaxTemplateBytes, "chat template");
    } catch (const IoError& e) {
      throw ConfigError(e.what());
    }
  }
  return t;
}

namespace {

// Checks a mask's 32-byte header against a file of `file_size` bytes; returns the count.
uint64_t check_mask_header(const char* h, uint64_t file_size, const std::string& path) {
  if (std::memcmp(h, kMaskMagic, 8) != 0)
    throw IoError(str(path, ": not a loss mask (bad magic at offset 0)"));
  uint32_t version, width;
  uint64_t count;
  std::memcpy(&version, h + 8, 4);
  std::memcpy(&width, h + 12, 4);
  std::memcpy(&count, h + 16, 8);
  if (version != kShardVersion)
    throw IoError(str(path, ": mask version ", version, " at offset 8 is not supported"));
  if (width != 1) throw IoError(str(path, ": bytes per entry ", width, " at offset 12 must be 1"));
  if (count != file_size - 32)
    throw IoError(str(path, ": header says ", count, " entries but the file has ", file_size - 32,
                      " data bytes"));
  return count;
}

void check_mask_values(const LossMask& m) {
  for (uint64_t i = 0; i < m.mask.size(); ++i)
    if (m.mask[i] > 1)
      throw IoError(
          str(m.path, ": value ", int(m.mask[i]), " at offset ", 32 + i, " is not 0 or 1"));
}

}  // namespace

LossMask read_loss_mask(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(str(path, ": cannot open loss mask"));
  char h[32];
  if (!in.read(h, 32)) throw IoError(str(path, ": shorter than the 32-byte mask header"));
  in.seekg(0, std::ios::end);
  const uint64_t count = check_mask_header(h, static_cast<uint64_t>(in.tellg()), path);
  LossMask m;
  m.path = path;
  m.mask.resize(count);
  in.seekg(32);
  if (!in.read(reinterpret_cast<char*>(m.mask.data()), static_cast<std::streamsize>(count)))
    throw IoError(str(path, ": read failed"));
  check_mask_values(m);
  return m;
}

LossMask parse_loss_mask(std::string_view bytes, const std::string& path) {
  if (bytes.size() < 32) throw IoError(str(path, ": shorter than the 32-byte mask header"));
  const uint64_t count = check_mask_header(bytes.data(), bytes.size(), path);
  LossMask m;
  m.path = path;
  m.mask.assign(bytes.begin() + 32, bytes.begin() + 32 + static_cast<ptrdiff_t>(count));
  check_mask_values(m);
  return m;
}

namespace {

// A .jsonl input without a field option would be tokenized as raw JSON text: refused, with the
// options and the fields of its first record.
[[noreturn]] void refuse_jsonl_as_text(const fs::path& f) {
  std::ifstream in(f);
  std::string line, fields;
  while (std::getline(in, line) && line.find_first_not_of(" \t\r") == std::string::npos) {
  }
  nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_object())
    for (const auto& [k, v] : j.items())
      if (v.is_string()) fields += (fields.empty() ? "" : ", ") + k;
  throw ConfigError(str(
      f.string(),
      ": JSON Lines need a field option, else every line is tokenized as raw JSON "
      "text: --jsonl-field F (one text field per record) or --prompt-field P --completion-field C "
      "(prompt/completion pairs with a loss mask)",
      fields.empty() ? std::string() : str("; the first record's string fields: ", fields)));
}

// What the field options make of the inputs.
struct DatasetKind {
  explicit DatasetKind(const DatasetOptions& o)
      : chat(!o.chat_field.empty()),
        pairs(!o.prompt_field.empty() || !o.completion_field.empty()),
        jsonl(pairs || chat || !o.jsonl_field.empty()),
        masked(pairs || chat) {}
  bool chat;    // conversations through the chat template, loss on the assistant turns
  bool pairs;   // prompt/completion records, loss on the completion
  bool jsonl;   // JSON Lines, one document per record
  bool masked;  // with loss masks
};

// The options refused before anything is read or written.
void check_dataset_options(const DatasetOptions& opts) {
  const DatasetKind kind(opts);
  if (kind.pairs && (opts.prompt_field.empty() || opts.completion_field.empty()))
    throw ConfigError("--prompt-field and --completion-field go together");
  if (int(kind.pairs) + int(kind.chat) + int(!opts.jsonl_field.empty()) > 1)
    throw ConfigError(
        "give one of --jsonl-field, --prompt-field/--completion-field and --chat-field");
  if (kind.chat && opts.chat_template.empty())
    throw ConfigError(
        "--chat-field: the model has no chat_template (tokenizer_config.json beside "
        "tokenizer.json)");
  if (kind.chat) {
    parsed_template(opts);  // an unsupported template is refused before anything is written
    template_vars(opts, {}, {});
    if (opts.chat_format != "openai" && opts.chat_format != "sharegpt")
      throw ConfigError(str("--chat-format '", opts.chat_format, "': expected openai or sharegpt"));
  }
  if (kind.chat && (!opts.bos_token.empty() || !opts.eos_token.empty()))
    throw ConfigError(
        str("a BOS or EOS around conversations (", opts.bos_token.empty() ? "eos" : "bos",
            "_token) would stand beside the one the chat template writes: a conversation's special "
            "tokens are the template's (--bos-token/--eos-token with --chat-field say what it "
            "writes, checked on every record)"));
  if (!(opts.val_fraction >= 0 && opts.val_fraction < 1))
    throw ConfigError(str("--val-fraction ", opts.val_fraction, " must be in [0, 1)"));
}

// The id of a --bos-token / --eos-token; none for an empty one.
std::optional<int32_t> special_token_id(const Tokenizer& tok, const std::string& text,
                                        const char* option) {
  if (text.empty()) return std::nullopt;
  auto id = tok.token_to_id(text);
  if (!id) throw ConfigError(str(option, " '", text, "' is not a token of ", tok.source()));
  return id;
}

// What --bos-token / --eos-token say a chat template writes at the start / end of every
// conversation, checked on each record's ids: a conversation's special tokens are those the
// template writes (apply_chat_template adds none), so a given token that differs is refused
// with what the template does instead, and nothing is added.
class ChatSpecialsCheck {
 public:
  ChatSpecialsCheck(const Tokenizer& tok, const DatasetOptions& o)
      : tok_(tok),
        bos_(expect(o.chat_bos, o.template_bos, "--bos-token")),
        eos_(expect(o.chat_eos, o.template_eos, "--eos-token")) {}
  // ids[first...] is one rendered conversation.
  void check(const std::vector<int32_t>& ids, size_t first, const std::string& where) const {
    if (first >= ids.size()) return;
    if (bos_.on && bos_.id && (ids[first] == *bos_.id) != !bos_.text.empty())
      refuse(where, bos_, "begin", tok_.id_to_token(ids[first]));
    if (eos_.on && eos_.id && ends_with(ids, first, *eos_.id) != !eos_.text.empty())
      refuse(where, eos_, "end", tok_.id_to_token(ids.back()));
  }

 private:
  struct Expect {
    bool on = false;
    std::string text;            // the token expected, or "" for none
    std::string option;          // --bos-token
    std::string template_token;  // tokenizer_config.json's, for "none"
    std::optional<int32_t> id;   // of text, or of template_token for "none"
  };
  Expect expect(const std::optional<std::string>& given, const std::string& template_token,
                const char* option) const {
    Expect e;
    if (!given) return e;
    e.on = true;
    e.text = *given;
    e.option = option;
    e.template_token = template_token;
    const std::string& t = given->empty() ? template_token : *given;
    if (!t.empty()) e.id = tok_.token_to_id(t);
    if (!given->empty() && !e.id)
      throw ConfigError(str(option, " '", *given, "' is not a token of ", tok_.source()));
    return e;
  }
  // Whether the conversation's last `id` is followed by whitespace only (ChatML's
  // "<|im_end|>\n").
  bool ends_with(const std::vector<int32_t>& ids, size_t first, int32_t id) const {
    size_t k = ids.size();
    while (k > first && ids[k - 1] != id) --k;
    if (k == first) return false;
    const std::string rest = tok_.decode(std::vector<int32_t>(ids.begin() + k, ids.end()));
    return rest.find_first_not_of(" \t\r\n") == std::string::npos;
  }
  [[noreturn]] void refuse(const std::string& where, const Expect& e, const char* at,
                           const std::string& found) const {
    const std::string why =
        e.text.empty() ? str(e.option, " none: the chat template ", at,
                             "s this conversation with '", e.template_token,
                             "' itself (tokenizer_config.json's ", e.option.substr(2, 3), "_token)")
                       : str(e.option, " '", e.text, "': the chat template does not ", at,
                             " this conversation with it (it ", at, "s with '", found, "')");
    throw ConfigError(str(where, ": ", why,
                          "; a conversation's special tokens are the ones its template writes, "
                          "and no other is added: leave ",
                          e.option, " out"));
  }

  const Tokenizer& tok_;
  Expect bos_, eos_;
};

// out_dir, created where it does not exist; an existing one must be an empty directory.
void make_output_dir(const std::string& out_dir) {
  std::error_code ec;
  if (fs::exists(out_dir, ec) && !(fs::is_directory(out_dir, ec) && fs::is_empty(out_dir, ec)))
    throw IoError(str(out_dir, ": exists and is not an empty directory; refusing to overwrite"));
  fs::create_directories(out_dir, ec);
  if (ec) throw IoError(str(out_dir, ": cannot create: ", ec.message()));
}

// The JSON object on one line of a JSON Lines file.
// Keys in the line's order (a chat template's tojson prints them so).
nlohmann::ordered_json parse_record(const std::string& line, const std::string& where) {
  nlohmann::ordered_json rec;
  try {
    rec = nlohmann::ordered_json::parse(line);
  } catch (const nlohmann::json::exception& e) {
    throw IoError(str(where, ": not valid JSON: ", e.what()));
  }
  if (!rec.is_object()) throw IoError(str(where, ": each line must be a JSON object"));
  return rec;
}

// r with out_dir's shard paths (and mask paths for masked inputs) in it.
DatasetResult with_shard_paths(DatasetResult r, const std::string& out_dir, bool masked) {
  r.train_path = (fs::path(out_dir) / "train.tok").string();
  r.val_path = (fs::path(out_dir) / "val.tok").string();
  if (masked) {
    r.train_mask_path = (fs::path(out_dir) / "train.mask").string();
    r.val_mask_path = (fs::path(out_dir) / "val.mask").string();
  }
  return r;
}

uint32_t token_width(uint32_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

// A dataset's shards being written into out_dir, one document at a time: train.tok and
// val.tok, train.mask and val.mask for masked inputs, and for JSON Lines the record indexes.
class DatasetWriter {
 public:
  // `r` holds what was found before: the vocabulary size and the inputs skipped.
  DatasetWriter(const Tokenizer& tok, const DatasetOptions& opts, const std::string& out_dir,
                std::optional<int32_t> bos, std::optional<int32_t> eos, DatasetResult r);
  // A text file is one document; the last val_fraction of its tokens is held out.
  void add_text_file(const fs::path& f);
  // A JSON Lines file: one document per record; its last val_fraction of records is held out.
  void add_jsonl_file(const fs::path& f);
  // The shards renamed into place and the record indexes written; refused without documents.
  DatasetResult finish();

 private:
  // One record's tokens into ids_ (and its mask into mask_).
  void encode_record(const nlohmann::ordered_json& rec, const std::string& where);

  const Tokenizer& tok_;
  const DatasetOptions& opts_;
  const DatasetKind kind_;
  const std::string out_dir_;
  const std::optional<int32_t> bos_, eos_;
  const ChatSpecialsCheck chat_specials_;
  DatasetResult r_;
  ShardStream train_, val_;
  std::unique_ptr<ShardStream> train_mask_, val_mask_;
  // JSON Lines records stay whole for training: each one's first token goes to the record index.
  std::vector<uint64_t> train_starts_, val_starts_;
  std::vector<int32_t> ids_;  // the document being added
  std::vector<uint8_t> mask_;
};

DatasetWriter::DatasetWriter(const Tokenizer& tok, const DatasetOptions& opts,
                             const std::string& out_dir, std::optional<int32_t> bos,
                             std::optional<int32_t> eos, DatasetResult r)
    : tok_(tok),
      opts_(opts),
      kind_(opts),
      out_dir_(out_dir),
      bos_(bos),
      eos_(eos),
      chat_specials_(tok, opts),
      r_(with_shard_paths(std::move(r), out_dir, kind_.masked)),
      train_(r_.train_path, kShardMagic, token_width(r_.vocab_size), r_.vocab_size),
      val_(r_.val_path, kShardMagic, token_width(r_.vocab_size), r_.vocab_size) {
  if (kind_.masked) {
    train_mask_ = std::make_unique<ShardStream>(r_.train_mask_path, kMaskMagic, 1, 2);
    val_mask_ = std::make_unique<ShardStream>(r_.val_mask_path, kMaskMagic, 1, 2);
  }
}

void DatasetWriter::add_text_file(const fs::path& f) {
  std::string text = read_whole_file(f.string());
  if (text.empty() || text.find('\0') != std::string::npos) {
    ++r_.skipped;
    return;
  }
  ++r_.files;
  ++r_.documents;
  ids_.clear();
  if (bos_) ids_.push_back(*bos_);
  tok_.encode_append(text, &ids_);
  if (eos_) ids_.push_back(*eos_);
  // The last val_fraction of each document's tokens is held out, as `text` does for bytes.
  size_t cut =
      ids_.size() - static_cast<size_t>(static_cast<double>(ids_.size()) * opts_.val_fraction);
  train_.append(std::vector<int32_t>(ids_.begin(), ids_.begin() + cut));
  val_.append(std::vector<int32_t>(ids_.begin() + cut, ids_.end()));
}

void DatasetWriter::add_jsonl_file(const fs::path& f) {
  // Count the records first so the last val_fraction of them can go to val.
  std::ifstream in(f, std::ios::binary);
  if (!in) throw IoError(str(f.string(), ": cannot open"));
  size_t records = 0;
  std::string line;
  while (std::getline(in, line))
    if (!blank(line)) ++records;
  const size_t first_val =
      records - static_cast<size_t>(static_cast<double>(records) * opts_.val_fraction);
  in.clear();
  in.seekg(0);
  ++r_.files;
  size_t record = 0, line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (blank(line)) continue;
    const std::string where = str(f.string(), ":", line_no);
    encode_record(parse_record(line, where), where);
    const bool to_val = record++ >= first_val;
    if (ids_.empty()) {  // nothing to train on: no record
      ++r_.skipped;
      continue;
    }
    (to_val ? val_starts_ : train_starts_).push_back((to_val ? val_ : train_).count());
    (to_val ? val_ : train_).append(ids_);
    if (kind_.masked) (to_val ? *val_mask_ : *train_mask_).append_mask(mask_);
    ++r_.documents;
  }
}

void DatasetWriter::encode_record(const nlohmann::ordered_json& rec, const std::string& where) {
  ids_.clear();
  mask_.clear();
  if (bos_) ids_.push_back(*bos_);
  if (kind_.pairs) {
    encode_pair(tok_, string_field(rec, opts_.prompt_field, where),
                string_field(rec, opts_.completion_field, where), &ids_, &mask_);
    if (eos_) ids_.push_back(*eos_);
    mask_.resize(ids_.size(), 1);
  } else if (kind_.chat) {
    if (!rec.contains(opts_.chat_field))
      throw IoError(str(where, ": field '", opts_.chat_field, "' is missing"));
    // Checked without recursion before dump() and the template's values recurse over it.
    const int max_depth = jinja::Limits().max_depth;
    if (jinja::json_depth(rec[opts_.chat_field], max_depth) > max_depth)
      throw IoError(str(where, ": field '", opts_.chat_field, "' nests more than ", max_depth,
                        " deep (the chat template's limit max_depth)"));
    const bool tools = rec.contains(opts_.tools_field);
    if (tools && jinja::json_depth(rec[opts_.tools_field], max_depth) > max_depth)
      throw IoError(str(where, ": field '", opts_.tools_field, "' nests more than ", max_depth,
                        " deep (the chat template's limit max_depth)"));
    encode_chat(tok_, opts_, rec[opts_.chat_field].dump(), where, &ids_, &mask_,
                tools ? rec[opts_.tools_field].dump() : std::string());
    chat_specials_.check(ids_, 0, where);
  } else {
    tok_.encode_append(string_field(rec, opts_.jsonl_field, where), &ids_);
    if (eos_) ids_.push_back(*eos_);
  }
}

DatasetResult DatasetWriter::finish() {
  if (r_.documents == 0)
    throw IoError(kind_.jsonl ? "no JSON Lines records found in the given inputs"
                              : "no text files found in the given inputs");
  r_.train_tokens = train_.count();
  r_.val_tokens = val_.count();
  train_.finish();
  val_.finish();
  if (kind_.masked) {
    train_mask_->finish();
    val_mask_->finish();
  }
  if (kind_.jsonl) {
    r_.train_records_path = (fs::path(out_dir_) / "train.rec").string();
    r_.val_records_path = (fs::path(out_dir_) / "val.rec").string();
    write_record_index(r_.train_records_path, train_starts_);
    write_record_index(r_.val_records_path, val_starts_);
  }
  return r_;
}

}  // namespace

DatasetResult build_tokenized_dataset(const Tokenizer& tok, const std::vector<std::string>& inputs,
                                      const std::string& out_dir, const DatasetOptions& opts) {
  check_dataset_options(opts);
  const auto bos = special_token_id(tok, opts.bos_token, "--bos-token");
  const auto eos = special_token_id(tok, opts.eos_token, "--eos-token");
  const bool jsonl = DatasetKind(opts).jsonl;
  DatasetResult r;
  r.vocab_size = tok.vocab_size();
  std::vector<fs::path> files = list_input_files(inputs, &r.skipped);
  if (!jsonl)
    for (const auto& f : files)
      if (f.extension() == ".jsonl") refuse_jsonl_as_text(f);
  make_output_dir(out_dir);
  DatasetWriter writer(tok, opts, out_dir, bos, eos, std::move(r));
  for (const auto& f : files) {
    if (jsonl)
      writer.add_jsonl_file(f);
    else
      writer.add_text_file(f);
  }
  return writer.finish();
}

}  // namespace fuyou
