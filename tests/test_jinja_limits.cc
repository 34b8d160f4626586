// Hostile chat templates and chat records (src/formats/jinja.h's Limits): each must end within
// seconds, in bounded memory, with an error that names the limit it passed, never with a
// crash, a runaway allocation or a render that does not finish.
#include <catch2/catch.hpp>
#include <chrono>

#include "fuyou/error.h"
#include "fuyou/tokenizer.h"
#include "src/formats/jinja.h"
#include "tests/test_support.h"

using namespace fuyou;
using Catch::Matchers::Contains;

namespace {

std::string render(const std::string& src,
                   const nlohmann::ordered_json& vars = nlohmann::ordered_json::object()) {
  return jinja::Template(src, "hostile").render(vars);
}

std::string many(const std::string& piece, int n) {
  std::string s;
  s.reserve(piece.size() * n);
  for (int k = 0; k < n; ++k) s += piece;
  return s;
}

// Runs f, which must throw an Error naming `limit`, within `seconds`.
template <class F>
void refused(const std::string& limit, F f, double seconds = 10) {
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(f(), Contains(limit));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(s < seconds);
}

}  // namespace

TEST_CASE("jinja limits: deep expressions and tags are refused when the template is read",
          "[jinja][jinja-limits]") {
  for (const std::string& src : {
           "{{ 1" + many("+1", 10000) + " }}",     // a left-deep chain of operators
           "{{ a" + many(".b", 20000) + " }}",     // chained attributes
           "{{ a" + many("[0]", 20000) + " }}",    // chained subscripts
           "{{ f" + many("()", 20000) + " }}",     // chained calls
           "{{ x" + many("|trim", 20000) + " }}",  // chained filters
           "{{ x" + many(" is defined", 20000) + " }}",
           "{{ " + many("(", 100000) + "1" + many(")", 100000) + " }}",
           "{{ " + many("[", 100000) + many("]", 100000) + " }}",
           "{{ " + many("not ", 100000) + "1 }}",
           "{{ " + many("-", 100000) + "1 }}",
           "{{ 1" + many(" if 1 else 1", 20000) + " }}",
           many("{% if true %}", 20000) + many("{% endif %}", 20000),
           many("{% for x in y %}", 20000) + many("{% endfor %}", 20000),
       })
    refused("the limit max_depth", [&] { jinja::Template(src, "hostile"); });
  // What real templates nest stays well inside the limit.
  CHECK(render("{{ 1" + many("+1", 100) + " }}") == "101");
  CHECK(render(many("{% if true %}", 100) + "x" + many("{% endif %}", 100)) == "x");
}

TEST_CASE("jinja limits: strings, lists and the rendered text are bounded in bytes",
          "[jinja][jinja-limits]") {
  refused("the limit max_value_bytes", [] { render("{{ 'x' * 999999999999999999 }}"); });
  refused("the limit max_value_bytes", [] { render("{{ [1, 2] * 999999999999999999 }}"); });
  // Python makes an empty string of any repeat at once; so does the engine.
  CHECK(render("[{{ '' * 999999999999999999 }}]") == "[]");
  refused("the limit max_value_bytes",
          [] { render("{% set s = 'x' * 1000000 %}{{ s.replace('x', s) }}"); });
  refused("the limit max_value_bytes",
          [] { render("{% set s = 'x' * 1000000 %}{{ s | replace('x', s) }}"); });
  refused("the limit max_value_bytes",
          [] { render("{% set s = 'x' * 1000000 %}{{ s.replace('', s) }}"); });
  refused("the limit max_value_bytes",
          [] { render("{% set s = 'x' * 10000000 %}{{ [s, s, s, s, s, s, s] | join }}"); });
  refused("the limit max_value_bytes",
          [] { render("{% set s = 'x' * 1000000 %}{{ ([s] * 100) | join }}"); });
  // A list of many small items is counted by its bytes, not its length.
  refused("the limit max_value_bytes", [] { render("{{ (',' * 10000000).split(',') }}"); });
  refused("the limit max_value_bytes", [] { render("{{ ('a ' * 20000000).split() }}"); });
  // Looping over a string makes a value per character: bounded like a list of them.
  refused("the limit max_value_bytes", [] { render("{% for c in 'x' * 60000000 %}{% endfor %}"); });
  refused("the limit max_output_bytes",
          [] { render("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"); });
  refused("the limit max_output_bytes", [] {
    render(
        "{% set s = 'x' * 1000000 %}{% set t %}{% for i in range(100) %}{{ s }}{% endfor %}"
        "{% endset %}{{ t | length }}");
  });
  refused("the limit max_value_bytes",
          [] { render("{% set s = '\\n' * 40000000 %}{{ s | tojson }}"); });
}

TEST_CASE("jinja limits: values and data nest within max_depth", "[jinja][jinja-limits]") {
  // A namespace that wraps a list in a list every turn.
  refused("the limit max_depth", [] {
    render(
        "{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}"
        "{% endfor %}{{ ns.x }}");
  });
  refused("a namespace cannot hold a namespace",
          [] { render("{% set ns = namespace(a=1) %}{% set ns.me = ns %}"); });
  refused("a namespace cannot hold a namespace",
          [] { render("{% set ns = namespace(a=1) %}{% set ns.me = [ns] %}"); });
  // A 30,000-deep field among the template's data.
  const std::string deep = many("[", 30000) + many("]", 30000);
  refused("the limit max_depth", [&] {
    render("{{ messages | length }}",
           {{"messages", nlohmann::ordered_json::parse("[{\"x\": " + deep + "}]")}});
  });
  // A macro that calls itself.
  refused("the limit max_depth", [] { render("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"); });
}

TEST_CASE("jinja limits: every render has a work budget", "[jinja][jinja-limits]") {
  refused("the limit max_work", [] {
    render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}");
  });
  refused("the limit max_work", [] {
    render(
        "{% set s = 'x' * 10000000 %}{% for i in range(100000) %}{% if 'y' in s %}{% endif %}"
        "{% endfor %}");
  });
  refused("the limit max_work", [] {
    render(
        "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{% set t = s ~ s %}"
        "{% endfor %}");
  });
  // A smaller budget is the caller's to set, and shared by the renders it is passed to.
  jinja::Options o;
  o.limits.max_work = 1000;
  jinja::Template t("{% for i in range(10) %}{{ i }}{% endfor %}", "small", o);
  jinja::Work work(o.limits.max_work);
  CHECK_NOTHROW(t.render(nlohmann::ordered_json::object(), &work));
  CHECK_THROWS_WITH(
      [&] {
        for (int k = 0; k < 100; ++k) t.render(nlohmann::ordered_json::object(), &work);
      }(),
      Contains("more than 1000 operations (the limit max_work)"));
}

TEST_CASE("chat records: a deep field or a long conversation ends with an error naming the limit",
          "[jinja][jinja-limits]") {
  const Tokenizer tok =
      Tokenizer::from_file(test::source_path("tests/reference/fixtures/hf/tok_bytelevel.json"));
  DatasetOptions o;
  o.chat_field = "messages";
  o.chat_template =
      "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
      "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  const std::string deep = many("[", 30000) + "1" + many("]", 30000);
  refused("the chat template's limit max_depth", [&] {
    encode_chat(tok, o, "[{\"role\": \"user\", \"content\": \"a\", \"x\": " + deep + "}]",
                "chat.jsonl:1", &ids, &mask);
  });
  // A template that renders its turns outside a loop of their own is masked by rendering each
  // turn's prefixes: 2,000 assistant turns pass the budget that the renders of one record share.
  DatasetOptions by_prefixes = o;
  by_prefixes.chat_template =
      "{% macro turn(m) %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
      "{% endmacro %}{% set ns = namespace(text='') %}{% for m in messages %}"
      "{% set ns.text = ns.text + turn(m) %}{% endfor %}{{ ns.text }}"
      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
  std::string turns = "[";
  for (int k = 0; k < 2000; ++k)
    turns += std::string(k ? "," : "") +
             "{\"role\": \"user\", \"content\": \"What is two plus two?\"},"
             "{\"role\": \"assistant\", \"content\": \"Two plus two is four.\"}";
  turns += "]";
  refused("the limit max_work",
          [&] { encode_chat(tok, by_prefixes, turns, "chat.jsonl:2", &ids, &mask); });
  // A conversation of ordinary length renders.
  ids.clear();
  mask.clear();
  encode_chat(tok, o,
              "[{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", "
              "\"content\": \"Hello\"}]",
              "chat.jsonl:3", &ids, &mask);
  CHECK(!ids.empty());
}
