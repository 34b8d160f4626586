// The loss mask of a conversation found in one render of it: equal to the mask of the renders of
// each assistant turn's prefixes (written here, the definition it replaces) on the templates
// where both are defined, and linear in the conversation's length.

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/tokenizer.h"
#include "hf_support.h"
#include "src/formats/jinja.h"
#include "test_support.h"

using namespace fuyou;
using namespace fuyou::test;
using Catch::Matchers::Contains;

namespace {

// Layouts of real templates: ChatML (Qwen2.5), Llama 2, Llama 3 (trimmed content, header),
// Mistral v0.1 (no generation prompt), Phi-3.5 (EOS after the conversation only).
const char* const kTemplates[] = {
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "{% for m in messages %}{% if m.role == 'user' %}{{ bos_token + '[INST] ' + m.content + "
    "' [/INST]' }}{% else %}{{ ' ' + m.content + ' ' + eos_token }}{% endif %}{% endfor %}",
    "{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m.role + '<|im_end|>\\n\\n' + "
    "m.content | trim + '<|endoftext|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant<|im_end|>\\n\\n' }}{% endif %}",
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{{ '[INST] ' + m.content + "
    "' [/INST]' }}{% else %}{{ m.content + eos_token }}{% endif %}{% endfor %}",
    "{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}"
    "{{ eos_token }}{% endif %}",
};

// A tokenizer fixture with ChatML's turn tokens added, as real ChatML vocabularies have them.
Tokenizer with_turn_tokens(const std::string& fixture) {
  nlohmann::json j = nlohmann::json::parse(read_whole_file(hf_fixture(fixture)));
  int32_t next = 0;
  for (const auto& [t, id] : j["model"]["vocab"].items())
    next = std::max(next, id.get<int32_t>() + 1);
  for (const auto& a : j["added_tokens"]) next = std::max(next, a["id"].get<int32_t>() + 1);
  for (const char* t : {"<|im_start|>", "<|im_end|>", "<|end|>"})
    j["added_tokens"].push_back({{"id", next++},
                                 {"content", t},
                                 {"single_word", false},
                                 {"lstrip", false},
                                 {"rstrip", false},
                                 {"normalized", false},
                                 {"special", true}});
  return Tokenizer::from_json(j.dump(), fixture);
}

DatasetOptions options(const char* tpl) {
  DatasetOptions o;
  o.chat_field = "messages";
  o.chat_template = tpl;
  o.template_bos = "<s>";
  o.template_eos = "</s>";
  return o;
}

size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t k = 0;
  while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
  return k;
}

// The mask by prefixes: for assistant turn k, from where the tokens of the conversation before
// it with the generation prompt stop being those of the whole to where those of the
// conversation up to it do.
std::vector<uint8_t> mask_by_prefixes(const Tokenizer& tok, const DatasetOptions& o,
                                      const nlohmann::ordered_json& messages) {
  const jinja::Template tpl(o.chat_template, "t");
  auto render = [&](size_t n, bool prompt) {
    nlohmann::ordered_json vars = {{"bos_token", o.template_bos},
                                   {"eos_token", o.template_eos},
                                   {"add_generation_prompt", prompt}};
    vars["messages"] = nlohmann::ordered_json(messages.begin(), messages.begin() + n);
    return tpl.render(vars);
  };
  const std::vector<int32_t> all = tok.encode(render(messages.size(), false));
  std::vector<uint8_t> mask(all.size(), 0);
  for (size_t k = 0; k < messages.size(); ++k) {
    if (messages[k]["role"] != "assistant") continue;
    const size_t a = common_prefix(tok.encode(render(k, true)), all),
                 b = common_prefix(tok.encode(render(k + 1, false)), all);
    for (size_t i = a; i < b; ++i) mask[i] = 1;
  }
  return mask;
}

// Conversations whose turns meet at token boundaries that merge or not: spaces and newlines
// at the ends of a reply, an empty one, a system turn.
std::vector<nlohmann::ordered_json> conversations() {
  const char* replies[] = {"Hello", " Hello there ", "\nline one\nline two\n", "", "a  b", "42."};
  std::vector<nlohmann::ordered_json> out;
  for (size_t turns = 1; turns <= 3; ++turns)
    for (size_t first = 0; first < std::size(replies); ++first) {
      nlohmann::ordered_json c = nlohmann::ordered_json::array();
      if (first % 2) c.push_back({{"role", "system"}, {"content", "Be brief."}});
      for (size_t k = 0; k < turns; ++k) {
        c.push_back({{"role", "user"}, {"content", k % 2 ? "and then? " : "Hi"}});
        c.push_back(
            {{"role", "assistant"}, {"content", replies[(first + k) % std::size(replies)]}});
      }
      out.push_back(c);
    }
  return out;
}

}  // namespace

TEST_CASE("chat turns: one render masks each turn as the renders of its prefixes do", "[chat]") {
  const Tokenizer toks[] = {
      with_turn_tokens("tok_bytelevel.json"), with_turn_tokens("tok_llama2_metaspace.json"),
      with_turn_tokens("tok_llama3.json"), with_turn_tokens("tok_llama2.json")};
  int checked = 0;
  for (const Tokenizer& tok : toks)
    for (const char* tpl : kTemplates)
      for (const nlohmann::ordered_json& c : conversations()) {
        // Phi-3.5's EOS after the conversation is an added token, as a real EOS is.
        DatasetOptions o = options(tpl);
        if (tpl == kTemplates[4] && tok.token_to_id("<|endoftext|>"))
          o.template_eos = "<|endoftext|>";
        std::vector<int32_t> ids;
        std::vector<uint8_t> mask;
        encode_chat(tok, o, c.dump(), "chat.jsonl:1", &ids, &mask);
        INFO(tok.source() << ": " << tpl << ": " << c.dump());
        REQUIRE(mask.size() == ids.size());
        CHECK(mask == mask_by_prefixes(tok, o, c));
        ++checked;
      }
  CHECK(checked == 4 * 5 * 18);
}

TEST_CASE("chat turns: a turn is what its message writes in the whole render", "[chat]") {
  const Tokenizer tok = with_turn_tokens("tok_bytelevel.json");
  auto counted = [&](const char* tpl, const std::string& messages) {
    std::vector<int32_t> ids;
    std::vector<uint8_t> mask;
    encode_chat(tok, options(tpl), messages, "chat.jsonl:2", &ids, &mask);
    std::string s;
    for (size_t i = 0; i < ids.size(); ++i)
      if (mask[i]) s += tok.decode({ids[i]});
    return s;
  };
  // An earlier reply rendered otherwise in the whole (as Qwen3 drops its reasoning) counts as
  // what the whole holds of it.
  CHECK(counted("{% for m in messages %}{% if loop.last or m.role != 'assistant' %}"
                "{{ m.content }}{% else %}.{% endif %}{% endfor %}",
                R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},)"
                R"( {"role": "user", "content": "o"}])") == ".");
  // A template that writes its messages in no loop of their own: each turn's prefixes must
  // render as extensions of each other, and here they do not.
  CHECK_THROWS_WITH(
      counted("{% if messages|length > 2 %}{{ messages[2].content }}{% endif %}"
              "{{ messages[0].content }}{% if messages|length > 1 %}{{ messages[1].content }}"
              "{% endif %}",
              R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},)"
              R"( {"role": "user", "content": "o"}])"),
      Contains("chat.jsonl:2: the chat template does not render assistant message 1 as an "
               "extension"));
}

TEST_CASE("chat turns: a conversation's cost is linear in its length", "[chat]") {
  const Tokenizer tok = with_turn_tokens("tok_bytelevel.json");
  const DatasetOptions o = options(kTemplates[0]);
  auto conversation = [](int turns) {
    std::string c = "[";
    for (int k = 0; k < turns; ++k)
      c += std::string(k ? "," : "") +
           "{\"role\": \"user\", \"content\": \"What is two plus two?\"},"
           "{\"role\": \"assistant\", \"content\": \"Two plus two is four.\"}";
    return c + "]";
  };
  // The best of three runs each, so that a busy machine slows the ratio less.
  auto seconds = [&](const std::string& c) {
    double best = 1e30;
    for (int run = 0; run < 3; ++run) {
      std::vector<int32_t> ids;
      std::vector<uint8_t> mask;
      const auto t0 = std::chrono::steady_clock::now();
      encode_chat(tok, o, c, "chat.jsonl:1", &ids, &mask);
      best = std::min(best,
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      REQUIRE(std::count(mask.begin(), mask.end(), 1) > 0);
    }
    return best;
  };
  // Ten times the turns: a linear cost takes ten times as long, a quadratic one a hundred.
  // The bound, 30, leaves a factor of three for the machine's noise and still fails the square.
  const double short_s = seconds(conversation(300)), long_s = seconds(conversation(3000));
  INFO("300 turns: " << short_s << " s, 3000 turns: " << long_s << " s");
  CHECK(long_s < 30 * short_s);
}
