// The chat-template Jinja (src/formats/jinja.h) on small templates: each feature with the text
// jinja2 renders for it in transformers' environment (the expected strings were rendered by
// jinja2 3.1.6 through transformers' own _compile_jinja_template, strftime_now fixed at
// 2024-07-26), the refusals and errors jinja2 gives, and hostile templates that must end with an
// error naming the limit they pass. tests/reference/check_chat_templates.py compares whole
// templates against transformers.
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
  return jinja::Template(src, "t").render(vars);
}

const nlohmann::ordered_json kChat = {{"messages",
                                       {{{"role", "system"}, {"content", "Be brief."}},
                                        {{"role", "user"}, {"content", " Hi "}},
                                        {{"role", "assistant"}, {"content", "Hello."}}}},
                                      {"bos_token", "<s>"},
                                      {"eos_token", "</s>"}};

// A tool schema (keys in the order a user wrote them, which tojson keeps) and messages with
// non-ASCII text and numbers.
nlohmann::ordered_json kTools() {
  return nlohmann::ordered_json::parse(R"J({"tools": [{"type": "function", "function": {
      "name": "get_weather", "description": "Weather now", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
    "m": [{"role": "user", "content": "é ü", "n": 1}, {"role": "assistant", "content": "b",
      "n": 2.5}, {"role": "user", "content": "c", "n": null}]})J");
}

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

TEST_CASE("jinja: filters, as jinja2 and transformers' tojson give them", "[jinja]") {
  CHECK(
      render(R"J({{ tools | tojson }})J", kTools()) ==
      R"J([{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])J");
  CHECK(render(R"J({{ tools[0] | tojson(indent=4) }})J", kTools()) ==
        R"J({
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {
                    "type": "string"
                }
            },
            "required": [
                "city"
            ]
        }
    }
})J");
  CHECK(render(R"J({{ m | tojson(indent=2) }}|{{ {'b': 1, 'a': [true, none, 'x"\n']} | tojson }})J",
               kTools()) ==
        R"J([
  {
    "role": "user",
    "content": "é ü",
    "n": 1
  },
  {
    "role": "assistant",
    "content": "b",
    "n": 2.5
  },
  {
    "role": "user",
    "content": "c",
    "n": null
  }
]|{"b": 1, "a": [true, null, "x\"\n"]})J");
  CHECK(render(R"J({{ {'b': {'d': 1, 'c': 2}, 'a': 0} | tojson(sort_keys=true) }})J") ==
        R"J({"a": 0, "b": {"c": 2, "d": 1}})J");
  CHECK(
      render(
          R"J({{ m | selectattr('role', 'equalto', 'user') | map(attribute='content') | join(',') }})J",
          kTools()) == R"J(é ü,c)J");
  CHECK(
      render(
          R"J({{ m | rejectattr('role', 'eq', 'user') | list | length }}{{ m | selectattr('n') | list | length }})J",
          kTools()) == R"J(12)J");
  CHECK(
      render(
          R"J({{ [1, 0, 2, none] | select | list }}{{ [1, 2, 3, 4] | reject('odd') | list }}{{ [1, 5, 7] | select('gt', 4) | list }})J") ==
      R"J([1, 2][2, 4][5, 7])J");
  CHECK(
      render(
          R"J({{ m | map(attribute='n') | list }}{{ m | map(attribute='x', default='d') | list }}{{ ['a', 'B'] | map('upper') | list }})J",
          kTools()) == R"J([1, 2.5, None]['d', 'd', 'd']['A', 'B'])J");
  CHECK(
      render(
          R"J({{ {'b': 1, 'A': 2, 'a': 3} | dictsort }}{{ {'b': 1, 'a': 2} | items | list }}{{ {'b': 2, 'a': 1} | dictsort(by='value', reverse=true) }})J") ==
      R"J([('A', 2), ('a', 3), ('b', 1)][('b', 1), ('a', 2)][('b', 2), ('a', 1)])J");
  CHECK(
      render(
          R"J({{ [3, 'b', 'B', 3, 'a'] | unique | list }}{{ [3, 1, 2] | sort }}{{ ['b', 'A', 'c'] | sort(reverse=true) }})J") ==
      R"J([3, 'b', 'a'][1, 2, 3]['c', 'b', 'A'])J");
  CHECK(
      render(
          R"J({{ 'a-b-a' | replace('a', 'x') }}{{ 'a-b-a' | replace('a', 'x', 1) }}{{ 'ab' | replace('', '.') }})J") ==
      R"J(x-b-xx-b-a.a.b.)J");
  CHECK(
      render(
          R"J([{{ '  x y \n' | trim }}][{{ 'xxhixx' | trim('x') }}]{{ 'hello wORLD' | title }}{{ 'hELLO' | capitalize }})J") ==
      R"J([x y][hi]Hello WorldHello)J");
  CHECK(
      render(
          R"J({{ '42' | int }}{{ '4.7' | int }}{{ 'x' | int }}{{ 'x' | int(7) }}{{ 3.9 | int }}{{ '2.5' | float }}{{ 'y' | float }}{{ 3 | float }})J") ==
      R"J(4240732.50.03.0)J");
  CHECK(
      render(
          R"J({{ -3 | abs }}{{ -2.5 | abs }}{{ 2.567 | round(2) }}{{ 2.5 | round }}{{ 3.5 | round }}{{ 2.1 | round(0, 'ceil') }}{{ 2.9 | round(method='floor') }})J") ==
      R"J(32.52.572.04.03.02.0)J");
  CHECK(render(R"J({{ '<a href="x">&\'</a>' | e }}{{ '<b>' | escape }}{{ '<c>' | safe }})J") ==
        R"J(&lt;a href=&#34;x&#34;&gt;&amp;&#39;&lt;/a&gt;&lt;b&gt;<c>)J");
  CHECK(
      render(
          R"J([{{ 'a\nb\n\nc' | indent }}][{{ 'a\nb' | indent(2, true) }}][{{ 'a\n\nb' | indent(1, blank=true) }}][{{ 'a\n' | indent(3) }}])J") ==
      R"J([a
    b

    c][  a
  b][a
 
 b][a
])J");
  CHECK(
      render(
          R"J({{ 'one two, three_four 5' | wordcount }}{{ [1, 2, 3, 4, 5] | batch(2) | list }}{{ [1, 2, 3] | batch(2, 0) | list }})J") ==
      R"J(4[[1, 2], [3, 4], [5]][[1, 2], [3, 0]])J");
  CHECK(
      render(
          R"J({{ [1, 2, 3, 4, 5] | slice(3) | list }}{{ [1, 2, 3, 4] | slice(3, 'f') | list }})J") ==
      R"J([[1, 2], [3, 4], [5]][[1, 2], [3, 'f'], [4, 'f']])J");
  CHECK(
      render(
          R"J({{ [1, 2, 3] | sum }}{{ m | sum(attribute='n', start=1) if false }}{{ [3, 1] | max }}{{ ['b', 'a'] | min }}{{ [1, 2] | reverse | list }}{{ 'abé' | reverse }})J",
          kTools()) == R"J(63a[2, 1]éba)J");
  CHECK(
      render(
          R"J({{ 'abc' | first }}{{ 'abc' | last }}{{ [] | first }}|{{ 'a' | center(5) }}|{{ 'ab' | center(5) }}|{{ 'é' | length }}{{ m | length }}{{ {'a': 1} | count }})J",
          kTools()) == R"J(ac|  a  |  ab |131)J");
  CHECK(
      render(
          R"J({{ nothing | default('d') }}{{ '' | default('e', true) }}{{ 0 | d('z') }}{{ nothing | length }}{{ nothing | list }}[{{ nothing | trim }}]{{ nothing | string }})J") ==
      R"J(de00[][])J");
  CHECK(
      render(
          R"J({{ '%s=%d' | format('x', 3) }}{{ 3 | string + 'a' }}{{ [1, 'a'] | join('|') }}{{ m | join(',', attribute='role') }})J",
          kTools()) == R"J(x=33a1|auser,assistant,user)J");
}

TEST_CASE("jinja: tests", "[jinja]") {
  CHECK(
      render(
          R"J({{ [] is iterable }}{{ 'a' is iterable }}{{ 1 is iterable }}{{ {} is mapping }}{{ [] is mapping }}{{ 'a' is sequence }}{{ 1 is sequence }})J") ==
      R"J(TrueTrueFalseTrueFalseTrueFalse)J");
  CHECK(
      render(
          R"J({{ 'a' is string }}{{ 1 is number }}{{ 1.5 is number }}{{ true is boolean }}{{ 1 is boolean }}{{ 1 is integer }}{{ true is integer }}{{ 1.0 is float }}{{ 1 is float }})J") ==
      R"J(TrueTrueTrueTrueFalseTrueFalseTrueFalse)J");
  CHECK(
      render(
          R"J({{ 6 is divisibleby 3 }}{{ 7 is divisibleby(3) }}{{ 1 is in [1, 2] }}{{ 'a' is in 'cat' }}{{ 2 is eq 2 }}{{ 2 is ne 2 }}{{ 3 is gt 2 }}{{ 3 is lt 2 }}{{ 3 is ge 3 }}{{ 3 is le 2 }})J") ==
      R"J(TrueFalseTrueTrueTrueFalseTrueFalseTrueFalse)J");
  CHECK(
      render(
          R"J({{ 3 is odd }}{{ 3 is even }}{{ none is none }}{{ x is not none }}{{ x is not defined }}{{ 'ab' is lower }}{{ 'Ab' is upper }}{{ raise_exception is callable }}{{ none is sameas none }}{{ true is true }}{{ 0 is false }})J") ==
      R"J(TrueFalseTrueTrueTrueTrueFalseTrueTrueTrueFalse)J");
  CHECK(render(R"J({{ 'tojson' is filter }}{{ 'nope' is filter }}{{ 'odd' is test }})J") ==
        R"J(TrueFalseTrue)J");
}

TEST_CASE("jinja: string and mapping methods", "[jinja]") {
  CHECK(
      render(
          R"J({{ ' a '.strip() }}|{{ 'xax'.strip('x') }}|{{ ' a '.lstrip() }}|{{ ' a '.rstrip() }}|{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith('bc') }}{{ 'abc'.startswith(('x', 'a')) }})J") ==
      R"J(a|a|a | a|TrueTrueTrue)J");
  CHECK(
      render(
          R"J({{ 'a b  c'.split() }}{{ 'a,b,,c'.split(',') }}{{ 'a,b,c'.split(',', 1) }}{{ ' a b '.split(none, 1) }}{{ 'aXb'.upper() }}{{ 'aXb'.lower() }}{{ 'a-b-a'.replace('a', 'c') }}{{ 'a-b-a'.replace('a', 'c', 1) }})J") ==
      R"J(['a', 'b', 'c']['a', 'b', '', 'c']['a', 'b,c']['a', 'b ']AXBaxbc-b-cc-b-a)J");
  CHECK(
      render(
          R"J({{ '{} and {}'.format(1, 'b') }}|{{ '{1}{0}'.format('a', 'b') }}|{{ '{x}-{{}}'.format(x=3) }}|{{ 'hello world'.title() }}{{ 'abc'.find('c') }}{{ 'aaa'.count('a') }}{{ '-'.join(['a', 'b']) }})J") ==
      R"J(1 and b|ba|3-{}|Hello World23a-b)J");
  CHECK(
      render(
          R"J({% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{{ d.keys() | list }}{{ d.values() | list }}{{ d.get('a') }}{{ d.get('z') }}{{ d.get('z', 0) }}{{ 'a' in d }})J",
          nlohmann::ordered_json::parse(R"J({"d": {"b": 1, "a": 2}})J")) ==
      R"J(b=1;a=2;['b', 'a'][1, 2]2None0True)J");
}

TEST_CASE("jinja: namespace, range, loop variables, set blocks, macros, call, break and continue",
          "[jinja]") {
  CHECK(
      render(
          R"J({% set ns = namespace(count=0, found=false) %}{% for x in [1, 2, 3] %}{% set ns.count = ns.count + x %}{% if x == 2 %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.count }}{{ ns.found }}{{ ns }})J") ==
      R"J(6True<Namespace {'count': 6, 'found': True}>)J");
  CHECK(
      render(
          R"J({% set ns = namespace() %}{% set ns.a = 1 %}{{ ns.a }}{% set ns2 = namespace({'b': 2}, c=3) %}{{ ns2.b }}{{ ns2.c }}{{ dict(x=1, y='z') }})J") ==
      R"J(123{'x': 1, 'y': 'z'})J");
  CHECK(
      render(
          R"J({% for i in range(3) %}{{ i }}{% endfor %}{{ range(2, 8, 2) | list }}{{ range(3, 0, -1) | list }}{{ range(0) | list }})J") ==
      R"J(012[2, 4, 6][3, 2, 1][])J");
  CHECK(
      render(
          R"J({% for m in messages %}{{ loop.index0 }}{{ loop.index }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.revindex }}{{ loop.revindex0 }}|{% endfor %})J",
          kChat) == R"J(01TrueFalse332|12FalseFalse321|23FalseTrue310|)J");
  CHECK(
      render(
          R"J({% for x in 'abc' %}[{{ loop.previtem }}|{{ loop.nextitem }}|{{ loop.cycle('odd', 'even') }}]{% endfor %})J") ==
      R"J([|b|odd][a|c|even][b||odd])J");
  CHECK(
      render(
          R"J({% set x %}a{{ 1 + 1 }}b{% endset %}{{ x }}{{ x | length }}{% for i in [1] %}{% set y %}in{% endset %}{{ y }}{% endfor %}{{ y is defined }})J") ==
      R"J(a2b3inFalse)J");
  CHECK(
      render(
          R"J({% macro greet(name, greeting='Hi') %}{{ greeting }}, {{ name }}!{% endmacro %}{{ greet('A') }}{{ greet('B', 'Yo') }}{{ greet(greeting='Hey', name='C') }}{{ greet }})J") ==
      R"J(Hi, A!Yo, B!Hey, C!<Macro 'greet'>)J");
  CHECK(
      render(
          R"J({% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}bold {{ 1 + 2 }}{% endcall %}{% macro each(xs) %}{% for x in xs %}{{ caller(x) }}{% endfor %}{% endmacro %}{% call(item) each([1, 2]) %}[{{ item }}]{% endcall %})J") ==
      R"J(<b>bold 3</b>[1][2])J");
  CHECK(
      render(
          R"J({% macro f(x) %}{{ x }}{{ top }}{% endmacro %}{% set top = 'T' %}{{ f(1) }}{% for i in [2] %}{% set inner = 'I' %}{% macro g() %}{{ inner }}{{ i }}{% endmacro %}{{ g() }}{% endfor %})J") ==
      R"J(1TI2)J");
  CHECK(
      render(
          R"J({% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% endif %}{{ i }}{% endfor %}|{% for i in range(3) %}{% for j in range(3) %}{% if j == 1 %}{% break %}{% endif %}{{ i }}{{ j }}{% endfor %}{% endfor %})J") ==
      R"J(0134|001020)J");
  CHECK(
      render(
          R"J({% for i in range(6) if i is even %}{{ i }}{{ loop.index }}/{{ loop.length }} {% endfor %}{% for k, v in d.items() if k != 'b' %}{{ k }}{{ v }}{% endfor %}{% for x in [] %}no{% else %}empty{% endfor %})J",
          nlohmann::ordered_json::parse(R"J({"d": {"a": 1, "b": 2, "c": 3}})J")) ==
      R"J(01/3 22/3 43/3 a1c3empty)J");
  CHECK(
      render(
          R"J({% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = (1, 'x') %}{{ t }}{{ (1,) }}{{ () }}{% for (k, v) in [[1, 2]] %}{{ k + v }}{% endfor %})J") ==
      R"J(12(1, 'x')(1,)()3)J");
  CHECK(
      render(
          R"J({% generation %}kept {{ 1 }}{% endgeneration %}{{ strftime_now('%d %b %Y') }} {{ strftime_now('%Y-%m-%d %A') }})J") ==
      R"J(kept 126 Jul 2024 2024-07-26 Friday)J");
}

TEST_CASE("jinja: generation blocks mark what they write, as transformers records it", "[jinja]") {
  const std::string src =
      "{%- for m in messages %}{{ '<' + m.role + '>' }}"
      "{%- if m.role == 'assistant' %}{% generation %}{{ m.content | trim }}.{% endgeneration %}"
      "{%- else %}{{ m.content }}{% endif %}{{ '\\n' }}{% endfor %}"
      "{%- generation %}{% endgeneration %}";
  const jinja::Template t(src, "t");
  CHECK(t.has_generation());
  CHECK_FALSE(jinja::Template("{{ 1 }}{# generation #}", "t").has_generation());
  jinja::Template::Spans spans = {{7, 7}};  // a render clears what the list held
  const std::string text = t.render(kChat, nullptr, &spans);
  CHECK(text == "<system>Be brief.\n<user> Hi \n<assistant>Hello..\n");
  // Empty blocks mark nothing; each block's range holds exactly what it wrote.
  REQUIRE(spans.size() == 1);
  CHECK(text.substr(spans[0].first, spans[0].second - spans[0].first) == "Hello..");
  CHECK(t.render(kChat) == text);  // rendered the same when nothing is recorded
  // Inside a macro or a set block the block's place in the text is not known: refused when
  // recording, rendered as written otherwise.
  const std::string in_macro =
      "{% macro turn(c) %}{% generation %}{{ c }}{% endgeneration %}{% endmacro %}{{ turn('x') }}";
  CHECK(jinja::Template(in_macro, "t").render(kChat) == "x");
  CHECK_THROWS_WITH(jinja::Template(in_macro, "t").render(kChat, nullptr, &spans),
                    Contains("inside a macro, call or set block"));
  CHECK_THROWS_WITH(
      jinja::Template("{% set s %}{% generation %}y{% endgeneration %}{% endset %}{{ s }}", "t")
          .render(kChat, nullptr, &spans),
      Contains("inside a macro, call or set block"));
}

TEST_CASE("jinja: slices, formatting, numbers and literals as Python prints them", "[jinja]") {
  CHECK(
      render(
          R"J({{ [1, 2, 3, 4][::-1] }}{{ [1, 2, 3, 4][1::2] }}{{ 'hello'[::-2] }}{{ [1, 2, 3][-2:] }}{{ [1, 2, 3][:-1] }}{{ 'héllo'[1] }}{{ 'héllo'[1:3] }}{{ [1, 2][5:] }})J") ==
      R"J([4, 3, 2, 1][2, 4]olh[2, 3][1, 2]éél[])J");
  CHECK(
      render(
          R"J({{ 'x' if true }}{{ 'y' if false }}|{{ 'a' if false else 'b' if false else 'c' }}{{ 1 ~ 2 ~ none }}{{ 'a' ~ [1] }})J") ==
      R"J(x|c12Nonea[1])J");
  CHECK(
      render(
          R"J({{ '%s-%d-%05.2f-%r-%x-%%' % ('a', 3, 2.5, 'q', 255) }}|{{ '%s' % 5 }}|{{ '%-4s|%4s' % ('a', 'b') }}|{{ '%i%%' % 50 }}|{{ '%.3e' % 12345.678 }})J") ==
      R"J(a-3-02.50-'q'-ff-%|5|a   |   b|50%|1.235e+04)J");
  CHECK(
      render(
          R"J({{ 2 ** 10 }}{{ 2 ** -1 }}{{ 7 // 2 }}{{ -7 // 2 }}{{ 7 % 3 }}{{ -7 % 3 }}{{ 7.5 % 2 }}{{ -7.5 // 2 }}{{ 7 / 2 }}{{ 1 / 4 }}{{ 10 / 5 }})J") ==
      R"J(10240.53-4121.5-4.03.50.252.0)J");
  CHECK(
      render(
          R"J({{ 0.1 + 0.2 }} {{ 1e16 }} {{ 1.5e-5 }} {{ 2.0 }} {{ 123456789.123 }} {{ 1e100 }} {{ 3.0 * 2 }} {{ 1/3 }})J") ==
      R"J(0.30000000000000004 1e+16 1.5e-05 2.0 123456789.123 1e+100 6.0 0.3333333333333333)J");
  CHECK(
      render(
          R"J({{ {'a': 1, 'b': [1, 'x']} }}{{ {'a': 1}['a'] }}{{ {'k': 'v'}.k }}{{ [1, 2] + [3] }}{{ [0] * 3 }}{{ 'ab' * 2 }}{{ 3 * 'c' }}{{ '' * 999999999999999999 }})J") ==
      R"J({'a': 1, 'b': [1, 'x']}1v[1, 2, 3][0, 0, 0]ababccc)J");
  CHECK(
      render(
          R"J({{ "it's" }} {{ ['it\'s', "a\nb", 'q"'] }} {{ (1, 'a') }} {{ [none, true, 1.5] }})J") ==
      R"J(it's ["it's", 'a\nb', 'q"'] (1, 'a') [None, True, 1.5])J");
  CHECK(
      render(
          R"J({{ 1 == 1.0 }}{{ true == 1 }}{{ 'a' < 'b' }}{{ [1, 2] < [1, 3] }}{{ none == none }}{{ x == y }}{{ 1 != 'a' }}{{ not none }}{{ -(-3) }}{{ - 2 ** 2 }})J") ==
      R"J(TrueTrueTrueTrueTrueTrueTrueTrue34)J");
  CHECK(
      render(
          R"J({{ messages | length > 2 and messages[0].role == 'system' }}{{ messages[1]['content'] | trim }}{{ messages[-1].content[:-1] }}{{ messages[7] }}{{ messages[0].missing }})J",
          kChat) == R"J(TrueHiHello)J");
}

TEST_CASE("jinja: filters that return generators in jinja2 behave as generators", "[jinja]") {
  // A generator is true even when empty, has no length, and subscripts to undefined.
  CHECK(render("{{ 'yes' if [1] | select('none') else 'no' }}{{ 'yes' if [] | map('upper') else "
               "'no' }}{{ [1] | select('none') | list }}[{{ ([1] | select)[0] }}]") ==
        "yesyes[][]");
  CHECK_THROWS_WITH(render("{{ [1] | select | length }}"),
                    Contains("object of type 'generator' has no len()"));
  CHECK(render("{{ 3 | round }}{{ -3 | round(1) }}{{ 3 | round(1, 'floor') }}") == "3-33.0");
  CHECK(render("{{ '[1, 2]' is upper }}{{ '[1, 2]' is lower }}{{ 'A1' is upper }}") ==
        "FalseFalseTrue");
  CHECK(render("{{ 1 in nothing }}{{ 'a' not in nothing }}") == "FalseTrue");
  CHECK_THROWS_WITH(render("{{ 1 > 'a' }}"),
                    Contains("'>' not supported between instances of 'int' and 'str'"));
}

TEST_CASE("jinja: runtime errors are jinja2's", "[jinja]") {
  CHECK_THROWS_WITH(render(R"J({{ nothing.attr }})J"), Contains(R"J('nothing' is undefined)J"));
  CHECK_THROWS_WITH(render(R"J({{ x.a.b }})J", nlohmann::ordered_json::parse(R"J({"x": {}})J")),
                    Contains(R"J('dict object' has no attribute 'a')J"));
  CHECK_THROWS_WITH(render(R"J({{ x[5].b }})J", nlohmann::ordered_json::parse(R"J({"x": []})J")),
                    Contains(R"J(list object has no element 5)J"));
  CHECK_THROWS_WITH(render(R"J({{ foo() }})J"), Contains(R"J('foo' is undefined)J"));
  CHECK_THROWS_WITH(render(R"J({{ 'a'.foo() }})J"),
                    Contains(R"J('str object' has no attribute 'foo')J"));
  CHECK_THROWS_WITH(render(R"J({{ undefined_x + 1 }})J"),
                    Contains(R"J('undefined_x' is undefined)J"));
  CHECK_THROWS_WITH(render(R"J({{ 'a' - 1 }})J"),
                    Contains(R"J(unsupported operand type(s) for -: 'str' and 'int')J"));
  CHECK_THROWS_WITH(render(R"J({{ 1 / 0 }})J"), Contains(R"J(division by zero)J"));
  CHECK_THROWS_WITH(render(R"J({{ [].append(1) }})J"),
                    Contains(R"J(access to attribute 'append' of 'list' object is unsafe.)J"));
  CHECK_THROWS_WITH(render(R"J({{ {'a': 1}.update({}) }})J"),
                    Contains(R"J(access to attribute 'update' of 'dict' object is unsafe.)J"));
  CHECK_THROWS_WITH(render(R"J({{ none | length }})J"),
                    Contains(R"J(object of type 'NoneType' has no len())J"));
  CHECK_THROWS_WITH(
      render(R"J({{ range(200000) | length }})J"),
      Contains(R"J(Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).)J"));
  CHECK_THROWS_WITH(
      render(R"J({% set ns = namespace(_x=1) %})J"),
      Contains(
          R"J(Chat templates cannot store underscore-prefixed attributes on a namespace, but got '_x'. Please rename the attribute.)J"));
  CHECK_THROWS_WITH(render(R"J({{ raise_exception('roles must alternate') }})J"),
                    Contains(R"J(roles must alternate)J"));
  CHECK_THROWS_WITH(render(R"J({{ x | tojson }})J"),
                    Contains(R"J(Object of type Undefined is not JSON serializable)J"));
  CHECK_THROWS_WITH(render(R"J({{ 1 < 'a' }})J"),
                    Contains(R"J('<' not supported between instances of 'int' and 'str')J"));
  CHECK_THROWS_WITH(render(R"J({% macro m(a) %}{% endmacro %}{{ m(1, 2) }})J"),
                    Contains(R"J(macro 'm' takes not more than 1 argument(s))J"));
  CHECK_THROWS_WITH(render(R"J({{ 5() }})J"), Contains(R"J('int' object is not callable)J"));
}

TEST_CASE("jinja: what jinja2 refuses to compile is refused when the template is read", "[jinja]") {
  CHECK_THROWS_WITH(render("a\n{{ x | frobnicate }}"),
                    Contains("t: line 2: no filter named 'frobnicate'"));
  CHECK_THROWS_WITH(render("{{ x is frobnicated }}"), Contains("no test named 'frobnicated'"));
  CHECK_THROWS_WITH(render("{% include 'x' %}"), Contains("unsupported tag 'include'"));
  CHECK_THROWS_WITH(render("{% for x in y recursive %}{% endfor %}"), Contains("recursive loops"));
  CHECK_THROWS_WITH(render("{% if true %}a"), Contains("missing 'endif'"));
  CHECK_THROWS_WITH(render("{% endfor %}"), Contains("'endfor' without its opening tag"));
  CHECK_THROWS_WITH(render("{% break %}"), Contains("'break' outside a loop"));
  CHECK_THROWS_WITH(render("{{ 'a' "), Contains("'{{' is not closed"));
  CHECK_THROWS_WITH(render("{% set x = 'a %}"), Contains("'{%' is not closed"));
  // A tag's end inside a string literal does not end the tag, as in jinja2's lexer.
  CHECK(render("{{ '}}' }}{{- \"%}\" }}") == "}}%}");
  // An unknown function or method is an error only where the render reaches it, as in jinja2.
  CHECK(render("{% if false %}{{ x.frobnicate() }}{{ nope() }}{% endif %}ok") == "ok");
}

TEST_CASE("jinja: integer limits are refused, not undefined behaviour", "[jinja]") {
  CHECK_THROWS_WITH(render("{{ 99999999999999999999 }}"),
                    Contains("integer literal 99999999999999999999 is too large"));
  CHECK_THROWS_WITH(render("{{ 999999999999999999 * 999999999999999999 }}"),
                    Contains("integer overflow"));
  CHECK_THROWS_WITH(render("{{ 2 ** 64 }}"), Contains("integer overflow"));
  CHECK(render("{{ 999999999999999999 + 1 }}") == "1000000000000000000");
}

// A template of our own with the constructs of Llama 3.1/3.2's (a tools branch with
// tojson(indent=4), reject, strftime_now) and Gemma 3's ('is iterable' over content parts),
// whose released templates may not be shipped; the expected text is jinja2's.
TEST_CASE("jinja: the constructs of Llama 3.x's and Gemma 3's templates", "[jinja]") {
  const std::string src = R"J({{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "01 Jan 2000" %}
    {%- endif %}
{%- endif %}
{%- set builtin_tools = ['code_interpreter', 'brave_search', 'wolfram_alpha'] %}
{{- "<|system|>Today Date: " + date_string + "\n" }}
{%- if tools is not none %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{%- for message in messages %}
    {{- '<|' + message['role'] + '|>' }}
    {%- if message['content'] is string %}
        {{- message['content'] | trim }}
    {%- elif message['content'] is iterable %}
        {%- for item in message['content'] %}
            {%- if item['type'] == 'image' %}
                {{- '<start_of_image>' }}
            {%- elif item['type'] == 'text' %}
                {{- item['text'] | trim }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>' }}
{%- endif %}
)J";
  nlohmann::ordered_json vars = nlohmann::ordered_json::parse(
      R"J({"bos_token": "<s>", "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is this? "}]}, {"role": "assistant", "content": " A cat. "}], "add_generation_prompt": true})J");
  vars["tools"] = kTools()["tools"];
  vars["tools"][0]["function"]["parameters"]["properties"]["city"]["description"] =
      "Kraków or Zürich";
  CHECK(render(src, vars) == R"J(<s><|system|>Today Date: 26 Jul 2024
Tools: brave_search, wolfram_alpha
{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {
                    "type": "string",
                    "description": "Kraków or Zürich"
                }
            },
            "required": [
                "city"
            ]
        }
    }
}

<|user|><start_of_image>What is this?<|end|>
<|assistant|>A cat.<|end|>
<|assistant|>)J");
  vars["tools"] = nullptr;
  vars["add_generation_prompt"] = false;
  CHECK(render(src, vars) == R"J(<s><|system|>Today Date: 26 Jul 2024
<|user|><start_of_image>What is this?<|end|>
<|assistant|>A cat.<|end|>
)J");
}

TEST_CASE("jinja: the text each message's loop turn writes, through slices and filters",
          "[jinja]") {
  const nlohmann::ordered_json vars = {{"messages",
                                        {{{"role", "system"}, {"content", "s"}},
                                         {{"role", "user"}, {"content", "u"}},
                                         {{"role", "assistant"}, {"content", "a"}}}}};
  auto turns = [&](const std::string& src, std::string* text = nullptr) {
    jinja::Template::Turns t;
    const std::string out = jinja::Template(src, "t").render(vars, nullptr, nullptr, &t);
    if (text) *text = out;
    std::string s;
    for (const auto& x : t) s += str(x.message, ":", out.substr(x.begin, x.end - x.begin), " ");
    return s;
  };
  // A slice and a filter keep the messages' mappings; a turn that writes nothing is left out;
  // a loop over the messages inside one counts for the outer one.
  CHECK(turns("[{% for m in messages[1:] %}<{{ m.content }}>{% endfor %}]") == "1:<u> 2:<a> ");
  CHECK(turns("{% for m in messages | selectattr('role', 'ne', 'user') %}{{ m.role[0] }}"
              "{% if m.role == 'system' %}{% endif %}{% endfor %}") == "0:s 2:a ");
  CHECK(turns("{% for m in messages %}{% if m.role != 'user' %}{{ m.content }}"
              "{% for n in messages %}.{% endfor %}{% endif %}{% endfor %}") == "0:s... 2:a... ");
  // A mapping equal to a message is not that message.
  CHECK(turns("{% for m in [{'role': 'user', 'content': 'u'}] %}{{ m.content }}{% endfor %}")
            .empty());
  // In a macro or a set block the text's positions are not known: no turns at all.
  std::string text;
  CHECK(turns("{% macro f() %}{% for m in messages %}{{ m.content }}{% endfor %}{% endmacro %}"
              "{% for m in messages %}{{ m.role[0] }}{% endfor %}{{ f() }}",
              &text)
            .empty());
  CHECK(text == "suasua");
}
