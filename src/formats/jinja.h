// The subset of Jinja that models' chat templates use (tokenizer_config.json's chat_template),
// rendered as transformers renders them: Jinja's defaults plus trim_blocks and lstrip_blocks.
//
// Supported: text, {{ expressions }}, {# comments #}, whitespace control ({%- -%} {{- -}}),
// the tags if / elif / else / endif, for x in ... (else) / endfor with loop.index0, index,
// first, last, length, revindex, revindex0, and set; expressions with string, integer and
// list literals, true / false / none (either case), names, .attribute and [subscript] and
// [a:b] slices, calls, the operators + - * / // % ~ == != < <= > >= and or not in, "not in",
// "x if c else y", the tests defined, undefined, none, string, number, mapping, sequence,
// true, false (with "is not"); the filters trim, length, count, upper, lower, capitalize, first,
// last, string, join, default; string methods strip, lstrip, rstrip, startswith, endswith,
// upper, lower, replace, split, title; mapping methods get, items, keys, values; and the
// function raise_exception. Anything else (another tag, filter, test, method or function) is
// refused when the template is parsed, by its name.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace fuyou::jinja {

struct Node;

class Template {
 public:
  // Parses; ConfigError "NAME: line L: ..." for a syntax error or an unsupported feature.
  Template(const std::string& source, const std::string& name);
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  // Renders with `vars` as the top-level names (JSON values: objects, arrays, strings,
  // numbers, booleans, null). Error for a runtime failure (a type that does not fit an
  // operator, or raise_exception: its message as given).
  std::string render(const nlohmann::json& vars) const;

 private:
  std::string name_;
  std::vector<std::unique_ptr<Node>> body_;
};

}  // namespace fuyou::jinja
