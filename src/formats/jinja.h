// The Jinja that models' chat templates use (tokenizer_config.json's chat_template), rendered as
// transformers renders them: jinja2's ImmutableSandboxedEnvironment with trim_blocks and
// lstrip_blocks, the loopcontrols extension ({% break %}, {% continue %}), transformers'
// {% generation %} tag, and the globals raise_exception, strftime_now, namespace, dict and range;
// tojson is transformers' (ensure_ascii=False, keys in their order, indent).
//
// Templates are untrusted input, so every render is bounded by construction (Limits): one depth
// counter bounds the nesting of tags and expressions when parsing, of evaluation and macro calls
// when rendering, and of values (JSON input included); strings, lists and mappings are bounded in
// bytes, the rendered text too, and every operation is charged to a work budget. Each limit,
// when exceeded, ends the render with an Error naming the template, the line and the limit.
//
// docs/data.md lists the tags, filters, tests, methods and globals. A filter or test that jinja2
// does not know is refused when the template is parsed, as jinja2 refuses it; an unknown
// function or method is an error when (and only if) the render reaches it, as in jinja2.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "nlohmann/json.hpp"

namespace fuyou::jinja {

struct Limits {
  // Nesting of tags and expressions (parse), evaluation and macro calls (render), and of
  // values: jinja2 stops near Python's recursion limit of 1000 frames, a few per level.
  int max_depth = 256;
  uint64_t max_output_bytes = uint64_t(64) << 20;  // the rendered text
  uint64_t max_value_bytes = uint64_t(64) << 20;   // one string, list or mapping, contents counted
  uint64_t max_work = 20'000'000;  // operations: an evaluation, 64 bytes read or written, ...
};

struct Options {
  Limits limits;
  // The date strftime_now renders (transformers uses the clock; a fixed date keeps tokenization
  // reproducible): 2024-07-26 00:00:00, a Friday.
  int year = 2024, month = 7, day = 26, hour = 0, minute = 0, second = 0;
};

// Operations charged to renders, shared by the renders that one record needs so that their sum
// is bounded too (a conversation's assistant turns each render the conversation before them).
class Work {
 public:
  explicit Work(uint64_t limit) : limit_(limit) {}
  uint64_t used() const { return used_; }
  uint64_t limit() const { return limit_; }
  // False once the limit is passed.
  bool charge(uint64_t n) {
    used_ += n;
    return used_ <= limit_;
  }

 private:
  uint64_t used_ = 0, limit_;
};

struct Node;

class Template {
 public:
  // Parses; ConfigError "NAME: line L: ..." for a syntax error, an unknown filter or test, or
  // nesting beyond the limit.
  Template(const std::string& source, const std::string& name, Options options = {});
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  // Renders with `vars` as the top-level names (JSON values). Error "NAME: line L: ..." for a
  // runtime failure: what jinja2 raises (a type that does not fit an operator, an undefined
  // function, raise_exception's message as given) or a limit. `work`, when given, is charged
  // instead of a budget of this render's own.
  std::string render(const nlohmann::json& vars, Work* work = nullptr) const;
  // The same, with the mappings' keys in the document's order (tojson and items() keep it).
  std::string render(const nlohmann::ordered_json& vars, Work* work = nullptr) const;
  // The byte ranges [begin, end) of the rendered text that {% generation %} blocks wrote, in
  // the order they were written: the assistant's text, as transformers'
  // return_assistant_tokens_mask marks it. A block inside a macro, call or set block is an
  // Error here (transformers' positions there are not those of the text).
  using Spans = std::vector<std::pair<size_t, size_t>>;
  std::string render(const nlohmann::ordered_json& vars, Work* work, Spans* generation) const;
  // The same, and the byte ranges of the rendered text that each message of the top-level list
  // `messages` wrote: what a for loop's body wrote in the turns whose item was that message
  // (the outermost such loop; empty ranges left out), in the order they were written. `turns`
  // is left empty when such a loop runs inside a macro, call or set block, where positions in
  // the text are not known.
  struct Turn {
    size_t message, begin, end;
  };
  using Turns = std::vector<Turn>;
  std::string render(const nlohmann::ordered_json& vars, Work* work, Spans* generation,
                     Turns* turns) const;
  // Whether the template has a {% generation %} block.
  bool has_generation() const { return has_generation_; }

  const Options& options() const { return options_; }

 private:
  std::string name_;
  Options options_;
  std::unique_ptr<Node> root_;
  bool has_generation_ = false;
};

// How deep a JSON document nests (a scalar 0, [] 1), found without recursion; stops counting
// past `stop_at`. A caller checks a record with it before anything recursive (a copy, dump(),
// a render) reads it.
template <class Json>
int json_depth(const Json& j, int stop_at) {
  std::vector<std::pair<const Json*, int>> stack = {{&j, 1}};
  int deepest = 0;
  while (!stack.empty()) {
    auto [x, d] = stack.back();
    stack.pop_back();
    if (!x->is_structured()) continue;
    deepest = std::max(deepest, d);
    if (deepest > stop_at) return deepest;
    for (const auto& y : *x) stack.emplace_back(&y, d + 1);
  }
  return deepest;
}

}  // namespace fuyou::jinja
