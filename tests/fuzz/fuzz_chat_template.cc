// Chat templates (tokenizer_config.json's chat_template): the input is the template. One that
// parses renders a fixed conversation twice with the same text (or refuses with an Error both
// times).
#include <cstdint>
#include <string>

#include "fuyou/error.h"
#include "src/formats/jinja.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string src(reinterpret_cast<const char*>(data), size);
  static const nlohmann::json vars = {{"messages",
                                       {{{"role", "system"}, {"content", "Be brief."}},
                                        {{"role", "user"}, {"content", " What is 2 + 2? "}},
                                        {{"role", "assistant"}, {"content", "4"}}}},
                                      {"bos_token", "<s>"},
                                      {"eos_token", "</s>"},
                                      {"add_generation_prompt", true}};
  try {
    fuyou::jinja::Template t(src, "fuzz");
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
