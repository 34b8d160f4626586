// Chat templates (tokenizer_config.json's chat_template): the input is the template, up to
// 1 MiB (tools/fuzz.sh). One that parses renders a fixed conversation with tools twice with the
// same text (or refuses with an Error both times), within limits smaller than the engine's so
// that each input, sanitized, ends within libFuzzer's 10 s and its memory limit.
#include <cstdint>
#include <string>

#include "fuyou/error.h"
#include "src/formats/jinja.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string src(reinterpret_cast<const char*>(data), size);
  static const nlohmann::ordered_json vars = {
      {"tools", nlohmann::ordered_json::parse(
                    R"([{"type": "function", "function": {"name": "f", "parameters": {"type":
                    "object", "properties": {"x": {"type": "string"}}}}}])")},
      {"messages",
       {{{"role", "system"}, {"content", "Be brief."}},
        {{"role", "user"}, {"content", " What is 2 + 2? "}},
        {{"role", "assistant"}, {"content", "4"}}}},
      {"bos_token", "<s>"},
      {"eos_token", "</s>"},
      {"add_generation_prompt", true}};
  try {
    fuyou::jinja::Options o;
    o.limits.max_work = 2'000'000;
    o.limits.max_value_bytes = o.limits.max_output_bytes = 8 << 20;
    fuyou::jinja::Template t(src, "fuzz", o);
    std::string a, b;
    bool a_ok = true, b_ok = true;
    try {
      a = t.render(vars);
    } catch (const fuyou::Error&) {
      a_ok = false;
    }
    try {
      b = t.render(vars);
    } catch (const fuyou::Error&) {
      b_ok = false;
    }
    FUZZ_REQUIRE(a_ok == b_ok && a == b);
  } catch (const fuyou::Error&) {
  }
  return 0;
}
