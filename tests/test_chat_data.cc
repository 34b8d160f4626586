// Conversations as data: the special tokens a chat template writes (--bos-token/--eos-token
// say what it writes, never add a second one); what a record gives the template (tools, tool
// calls, reasoning, keyword arguments, ShareGPT turns); the loss mask of a template that ends
// a conversation with EOS. tests/reference/check_chat_templates.py compares the same with
// transformers.

#include <algorithm>
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/tokenizer.h"
#include "hf_support.h"
#include "test_support.h"

using namespace fuyou;
using namespace fuyou::test;
using Catch::Matchers::Contains;

namespace {

// Llama 2's layout: BOS before every user turn, EOS after every assistant turn.
const char* const kLlama2Style =
    "{% for m in messages %}{% if m.role == 'user' %}{{ bos_token + '[INST] ' + m.content + "
    "' [/INST]' }}{% else %}{{ ' ' + m.content + ' ' + eos_token }}{% endif %}{% endfor %}";
// ChatML: no BOS, and the end-of-turn token is not EOS.
const char* const kChatml =
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

DatasetOptions chat_options(const char* tpl) {
  DatasetOptions o;
  o.chat_field = "messages";
  o.chat_template = tpl;
  o.template_source = "tokenizer_config.json";
  o.template_bos = "<s>";
  o.template_eos = "</s>";
  o.val_fraction = 0;
  return o;
}

struct ChatData {
  TempDir tmp{"chat-data"};
  std::string input = tmp.path + "/chat.jsonl";
  int runs = 0;
  ChatData() {
    write_all(input,
              "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": "
              "\"assistant\", \"content\": \"Hello\"}]}\n");
  }
  // The record's ids.
  std::vector<int32_t> tokenize(const Tokenizer& tok, const DatasetOptions& o) {
    DatasetResult r = build_tokenized_dataset(tok, {input}, str(tmp.path, "/out", runs++), o);
    return read_token_shard(r.train_path).tokens;
  }
};

}  // namespace

TEST_CASE("chat: --bos-token/--eos-token say what the template writes, never a second one",
          "[chat]") {
  const Tokenizer tok = Tokenizer::from_file(hf_fixture("tok_llama2.json"));
  const int32_t bos = *tok.token_to_id("<s>"), eos = *tok.token_to_id("</s>");
  ChatData d;
  // A BOS or EOS added around a conversation would double the template's: refused.
  for (int which = 0; which < 2; ++which) {
    DatasetOptions o = chat_options(kLlama2Style);
    (which ? o.eos_token : o.bos_token) = which ? "</s>" : "<s>";
    CHECK_THROWS_WITH(d.tokenize(tok, o), Contains("beside the one the chat template writes"));
  }
  // Given ones that the template writes follow it: one <s> first, one </s> last.
  DatasetOptions o = chat_options(kLlama2Style);
  o.chat_bos = "<s>";
  o.chat_eos = "</s>";
  const std::vector<int32_t> ids = d.tokenize(tok, o);
  REQUIRE(ids.size() > 3);
  CHECK(ids[0] == bos);
  CHECK(ids[1] != bos);
  CHECK(ids.back() == eos);
  CHECK(ids[ids.size() - 2] != eos);
  CHECK(ids == d.tokenize(tok, chat_options(kLlama2Style)));
  // 'none' where the template writes one, or a token it does not write: refused, with what
  // the template does and the record.
  o.chat_bos = "";
  o.chat_eos.reset();
  CHECK_THROWS_WITH(d.tokenize(tok, o),
                    Contains("chat.jsonl:1: --bos-token none: the chat template begins this "
                             "conversation with '<s>' itself") &&
                        Contains("leave --bos-token out"));
  DatasetOptions c = chat_options(kChatml);
  c.chat_eos = "</s>";
  CHECK_THROWS_WITH(d.tokenize(tok, c),
                    Contains("chat.jsonl:1: --eos-token '</s>': the chat template does not end "
                             "this conversation with it"));
  c.chat_eos = "";
  c.chat_bos = "";
  CHECK(d.tokenize(tok, c).front() != bos);  // ChatML writes neither: 'none' follows it
  c.chat_bos = "<S>";
  CHECK_THROWS_WITH(d.tokenize(tok, c), Contains("--bos-token '<S>' is not a token of"));
}

namespace {

// The messages and tools as the template sees them, each on a line.
const char* const kShowsData =
    "{% if tools %}{{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m | tojson }}\n"
    "{% endfor %}{% if add_generation_prompt and enable_thinking is defined and enable_thinking "
    "is false %}NO THINKING{% endif %}";

std::string rendered(const Tokenizer& tok, const DatasetOptions& o, const std::string& messages,
                     const std::string& tools = {}) {
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  encode_chat(tok, o, messages, "chat.jsonl:1", &ids, &mask, tools);
  return tok.decode(ids);
}

}  // namespace

TEST_CASE(
    "chat: tools, tool calls, reasoning and keyword arguments reach the template as "
    "transformers passes them",
    "[chat]") {
  const Tokenizer tok = Tokenizer::from_file(hf_fixture("tok_bytelevel.json"));
  DatasetOptions o = chat_options(kShowsData);
  // Null fields are dropped; reasoning under any of its names is also `thinking` (first) and
  // `reasoning_content` (last); a tool call may come without content.
  const std::string messages =
      R"([{"role": "user", "content": "Weather?", "name": null},)"
      R"({"role": "assistant", "content": null, "reasoning": "look it up",)"
      R"( "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": {"city": "Kraków"}}}]},)"
      R"({"role": "tool", "content": "sunny"}])";
  const std::string tools = R"([{"type": "function", "function": {"name": "get"}}])";
  CHECK(rendered(tok, o, messages, tools) ==
        "[{\"type\": \"function\", \"function\": {\"name\": \"get\"}}]\n"
        "{\"role\": \"user\", \"content\": \"Weather?\"}\n"
        "{\"thinking\": \"look it up\", \"role\": \"assistant\", \"reasoning\": \"look it up\", "
        "\"tool_calls\": [{\"type\": \"function\", \"function\": {\"name\": \"get\", "
        "\"arguments\": {\"city\": \"Kraków\"}}}], \"reasoning_content\": \"look it up\"}\n"
        "{\"role\": \"tool\", \"content\": \"sunny\"}\n");
  o.chat_template_kwargs = R"({"enable_thinking": false})";
  const std::vector<int32_t> prompt = encode_chat_prompt(tok, o, messages, "chat.jsonl:1");
  CHECK(tok.decode(prompt).find("NO THINKING") != std::string::npos);
  // What the tokenization sets itself, malformed tools and messages: refused, by name.
  o.chat_template_kwargs = R"({"messages": []})";
  CHECK_THROWS_WITH(rendered(tok, o, messages),
                    Contains("chat_template_kwargs: 'messages' is set by the tokenization"));
  o.chat_template_kwargs = "[1]";
  CHECK_THROWS_WITH(rendered(tok, o, messages),
                    Contains("chat_template_kwargs: expected a JSON object"));
  o.chat_template_kwargs.clear();
  CHECK_THROWS_WITH(rendered(tok, o, messages, R"("get")"),
                    Contains("chat.jsonl:1: field 'tools' must be a list of function definitions"));
  CHECK_THROWS_WITH(
      rendered(tok, o, R"([{"role": "user"}])"),
      Contains(
          "message 0 (user): 'content' must be a string or a list of text parts (only tool calls"));
}

TEST_CASE("chat: ShareGPT turns are the messages they name", "[chat]") {
  const Tokenizer tok = Tokenizer::from_file(hf_fixture("tok_bytelevel.json"));
  DatasetOptions o = chat_options(kChatml);
  const std::string openai =
      rendered(tok, o,
               R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},)"
               R"( {"role": "assistant", "content": "Hello"}, {"role": "tool", "content": "42"}])");
  o.chat_format = "sharegpt";
  CHECK(
      rendered(tok, o,
               R"([{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},)"
               R"( {"from": "gpt", "value": "Hello"}, {"from": "observation", "value": "42"}])") ==
      openai);
  CHECK_THROWS_WITH(
      rendered(tok, o, R"([{"from": "bot", "value": "Hi"}])"),
      Contains("turn 0: 'from' is 'bot'; ShareGPT speakers are human, user, gpt, assistant"));
  CHECK_THROWS_WITH(rendered(tok, o, R"([{"role": "user", "content": "Hi"}])"),
                    Contains("turn 0 must be an object with string fields 'from' and 'value'"));
}

TEST_CASE("chat: a template that ends the conversation with EOS masks each turn by its own end",
          "[chat]") {
  // Phi-3.5's layout: EOS after the conversation, not after each assistant turn.
  const char* const phi =
      "{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' }}"
      "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}"
      "{{ eos_token }}{% endif %}";
  const Tokenizer tok = Tokenizer::from_file(hf_fixture("tok_bytelevel.json"));
  DatasetOptions o = chat_options(phi);
  o.template_eos = "<|endoftext|>";
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  encode_chat(tok, o,
              R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},)"
              R"( {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ciao"}])",
              "chat.jsonl:1", &ids, &mask);
  // Counted: each reply with its <|end|>\n, and the EOS after the last one.
  std::string counted;
  for (size_t i = 0; i < ids.size(); ++i)
    if (mask[i]) counted += tok.decode({ids[i]});
  CHECK(counted == "Hello<|end|>\nCiao<|end|>\n<|endoftext|>");
}

TEST_CASE("chat: content as a list of text parts reaches the template as the list it is",
          "[chat]") {
  // Gemma 3's layout: a string content written as it is, a list's text parts one by one.
  const char* const parts =
      "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.content is string %}"
      "{{ m.content }}{% else %}{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}"
      "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
  const Tokenizer tok = Tokenizer::from_file(hf_fixture("tok_bytelevel.json"));
  const DatasetOptions o = chat_options(parts);
  std::vector<int32_t> ids, split_ids;
  std::vector<uint8_t> mask, split_mask;
  encode_chat(
      tok, o,
      R"([{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello you"}])",
      "chat.jsonl:1", &ids, &mask);
  encode_chat(
      tok, o,
      R"([{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},)"
      R"( {"role": "assistant", "content": [{"type": "text", "text": "Hello"},)"
      R"( {"type": "text", "text": " you"}]}])",
      "chat.jsonl:1", &split_ids, &split_mask);
  CHECK(split_ids == ids);
  CHECK(split_mask == mask);
  CHECK(std::count(mask.begin(), mask.end(), 1) > 0);
  // A part that is not text, named with its record and type; a malformed one.
  ChatData d;
  write_all(d.input,
            "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", "
            "\"content\": \"Hello\"}]}\n"
            "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": "
            "\"Look\"}, {\"type\": \"image\", \"url\": \"cat.png\"}]}]}\n");
  CHECK_THROWS_WITH(d.tokenize(tok, o),
                    Contains("chat.jsonl:2: message 0 (user): content part 1 is of type 'image'; "
                             "only text parts are supported"));
  CHECK_THROWS_WITH(rendered(tok, o, R"([{"role": "user", "content": [{"type": "text"}]}])"),
                    Contains("message 0 (user): content part 0 (text) must have a string field"));
  CHECK_THROWS_WITH(rendered(tok, o, R"([{"role": "user", "content": ["Hi"]}])"),
                    Contains("content part 0 must be an object with a string field 'type'"));
}
