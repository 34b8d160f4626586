// The chat-template Jinja subset (src/formats/jinja.h): each feature on small templates whose
// output follows from Jinja's documented rules (with transformers' trim_blocks and
// lstrip_blocks), and the refusals. tests/reference/check_chat_templates.py compares whole
// templates against Debian's jinja2 through transformers.
#include <catch2/catch.hpp>

#include "fuyou/error.h"
#include "src/formats/jinja.h"

using namespace fuyou;
using Catch::Matchers::Contains;

namespace {

std::string render(const std::string& src, const nlohmann::json& vars = nlohmann::json::object()) {
  return jinja::Template(src, "t").render(vars);
}

const nlohmann::json kChat = {{"messages",
                               {{{"role", "system"}, {"content", "Be brief."}},
                                {{"role", "user"}, {"content", " Hi "}},
                                {{"role", "assistant"}, {"content", "Hello."}}}},
                              {"bos_token", "<s>"},
                              {"eos_token", "</s>"}};

}  // namespace

TEST_CASE("jinja: expressions, operators and literals", "[jinja]") {
  CHECK(render("{{ 'a' + \"b\" ~ 3 }}") == "ab3");
  CHECK(render("{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 * 3 - 1 }}") ==
        "3 -4 1 2 3.5 5");
  CHECK(render("{{ 1 < 2 and 2 <= 2 and not 3 > 4 }}") == "True");
  CHECK(render("{{ none }} {{ None }} {{ true }} {{ False }}") == "None None True False");
  CHECK(render("{{ 'x' if 1 == 2 else 'y' }}{{ 'z' if false }}") == "y");
  CHECK(render("{{ 'ell' in 'hello' }} {{ 2 not in [1, 2] }} {{ 'k' in m }}",
               {{"m", {{"k", 1}}}}) == "True False True");
  CHECK(render("{{ [1, 'a', none] }} {{ m }}", {{"m", {{"k", "v"}}}}) ==
        "[1, 'a', None] {'k': 'v'}");
  CHECK(render("{{ 'a\\nb\\t\\'' }}") == "a\nb\t'");
  CHECK(render("{{ (1 + 2) * 3 }} {{ 'ab' * 2 }}") == "9 abab");
  CHECK(render("{{ x or 'd' }}{{ '' or 'e' }}{{ 0 and 'f' }}") == "de0");
}

TEST_CASE("jinja: names, subscripts, slices, attributes and undefined", "[jinja]") {
  CHECK(render("{{ messages[0]['role'] }} {{ messages[-1].content }} {{ messages|length }}",
               kChat) == "system Hello. 3");
  CHECK(render("{% for m in messages[1:] %}{{ m.role }},{% endfor %}", kChat) == "user,assistant,");
  CHECK(render("{{ messages[:1][0].role }} {{ 'hello'[1:3] }} {{ 'hello'[-2:] }}", kChat) ==
        "system el lo");
  CHECK(render("[{{ nothing }}][{{ messages[7] }}][{{ messages[0].missing }}]", kChat) == "[][][]");
  CHECK(render("{{ nothing is defined }} {{ bos_token is defined }} {{ none is none }} {{ x is not "
               "string }}",
               kChat) == "False True True True");
  CHECK(render("{{ nothing | default('d') }} {{ bos_token | default('d') }}", kChat) == "d <s>");
}

TEST_CASE("jinja: filters and methods", "[jinja]") {
  CHECK(render("[{{ '  a b \\n' | trim }}] {{ 'Ab' | upper }} {{ 'Ab' | lower }} {{ 'hELLO' | "
               "capitalize }}") == "[a b] AB ab Hello");
  CHECK(render("{{ [1, 2, 3] | first }}{{ [1, 2, 3] | last }} {{ ['a', 'b'] | join('-') }} {{ 3 | "
               "string }}") == "13 a-b 3");
  CHECK(render("[{{ ' x '.strip() }}][{{ ' x '.lstrip() }}][{{ ' x '.rstrip() }}][{{ "
               "'xxay'.strip('xy') }}]") == "[x][x ][ x][a]");
  CHECK(render("{{ 'abc'.startswith('ab') }} {{ 'abc'.endswith('bc') }} {{ 'a-b-c'.replace('-', "
               "'+') }}") == "True True a+b+c");
  CHECK(render("{{ 'a b  c'.split() }} {{ 'a,b'.split(',') }} {{ 'hello world'.title() }}") ==
        "['a', 'b', 'c'] ['a', 'b'] Hello World");
  CHECK(render("{% for k, v in m.items() %}{{ k }}={{ v }};{% endfor %}{{ m.get('z', 0) }}{{ 'a' "
               "in m.keys() }}{{ 2 in m.values() }}",
               {{"m", {{"a", 1}, {"b", 2}}}}) == "a=1;b=2;0TrueTrue");
}

TEST_CASE("jinja: if, for with loop variables and scoping, set", "[jinja]") {
  CHECK(
      render(
          "{% for m in messages %}{{ loop.index0 }}{{ loop.index }}{{ loop.first }}{{ loop.last }}"
          "{{ loop.length }}{{ loop.revindex }}|{% endfor %}",
          kChat) == "01TrueFalse33|12FalseFalse32|23FalseTrue31|");
  CHECK(render("{% for x in [] %}a{% else %}empty{% endfor %}") == "empty");
  CHECK(render("{% if 0 %}a{% elif '' %}b{% elif [0] %}c{% else %}d{% endif %}") == "c");
  // A set inside a loop does not leak out of it; one in an if does.
  CHECK(render(
            "{% set x = 1 %}{% for i in [1, 2] %}{% set x = i * 10 %}{{ x }}{% endfor %}{{ x }}") ==
        "10201");
  CHECK(render("{% if true %}{% set y = 'in' %}{% endif %}{{ y }}") == "in");
  CHECK(render("{% for i in [1, 2] %}{% for j in 'ab' %}{{ i }}{{ j }}{{ loop.index }}{% endfor "
               "%}{% endfor %}") == "1a11b22a12b2");
}

TEST_CASE("jinja: whitespace as transformers renders it (trim_blocks, lstrip_blocks, - markers)",
          "[jinja]") {
  // trim_blocks: the newline after a block tag goes; lstrip_blocks: the indentation before it.
  CHECK(render("{% if true %}\n  a\n{% endif %}\nb") == "  a\nb");
  CHECK(render("x\n    {% if true %}\ny\n    {% endif %}\nz") == "x\ny\nz");
  // Expression tags keep their surroundings; "-" strips all whitespace on its side.
  CHECK(render("a\n  {{ 'b' }}\nc") == "a\n  b\nc");
  CHECK(render("a\n  {{- 'b' -}}  \n c") == "abc");
  CHECK(render("a {%- if true -%}   b   {%- endif %} c") == "ab c");
  // "+" keeps what trim/lstrip would remove; a comment is a block for both rules.
  CHECK(render("a\n  {%+ if true %}b{% endif +%}\nc") == "a\n  b\nc");
  CHECK(render("a\n  {# note #}\nb") == "a\nb");
  // A single trailing newline of the template is dropped.
  CHECK(render("a\n") == "a");
  CHECK(render("a\n\n") == "a\n");
}

TEST_CASE("jinja: errors name the template, the line and the feature", "[jinja]") {
  CHECK_THROWS_WITH(render("a\n{% macro f() %}{% endmacro %}"),
                    Contains("t: line 2: unsupported tag 'macro'"));
  CHECK_THROWS_WITH(render("{{ x | tojson }}"), Contains("unsupported filter 'tojson'"));
  CHECK_THROWS_WITH(render("{{ x is odd }}"), Contains("unsupported test 'odd'"));
  CHECK_THROWS_WITH(render("{{ x.format(1) }}"), Contains("unsupported method 'format'"));
  CHECK_THROWS_WITH(render("{{ range(3) }}"), Contains("unsupported function 'range'"));
  CHECK_THROWS_WITH(render("{{ {'a': 1} }}"), Contains("mapping literals"));
  CHECK_THROWS_WITH(render("{% if true %}a"), Contains("missing 'endif'"));
  CHECK_THROWS_WITH(render("{% endfor %}"), Contains("'endfor' without its opening tag"));
  CHECK_THROWS_WITH(render("{{ 'a' "), Contains("'{{' is not closed"));
  CHECK_THROWS_WITH(render("{{ 'a }}"), Contains("string literal is not closed"));
  CHECK_THROWS_WITH(render("{% for x in [1] if x %}{% endfor %}"), Contains("filtering 'if'"));
  CHECK_THROWS_WITH(render("{{ 'a' - 1 }}"),
                    Contains("line 1: unsupported operand types for -: string and integer"));
  CHECK_THROWS_WITH(render("{{ raise_exception('roles must alternate') }}"),
                    Contains("the template raised: roles must alternate"));
}

TEST_CASE("jinja: integer limits are refused, not undefined behaviour", "[jinja]") {
  CHECK_THROWS_WITH(render("{{ 99999999999999999999 }}"),
                    Contains("integer literal 99999999999999999999 is too large"));
  CHECK_THROWS_WITH(render("{{ 999999999999999999 * 999999999999999999 }}"),
                    Contains("integer overflow"));
  CHECK_THROWS_WITH(render("{{ 'ab' * 99999999999 }}"), Contains("bytes repeated"));
  CHECK(render("{{ 999999999999999999 + 1 }}") == "1000000000000000000");
}
