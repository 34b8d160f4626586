// Values of the chat-template renderer (src/formats/jinja.h): Python's types as jinja2 sees
// them (None, bool, int, float, str, list, tuple, dict, jinja2's Undefined and namespace, and
// callables: macros and the globals), and Ctx, which every operation on them is charged to.
//
// A value is immutable once made, except a namespace's attributes; a namespace never holds a
// namespace, so values form no cycles. Each container records how deep it nests and how many
// bytes its contents take (shared contents counted at each reference), both bounded when it is
// made, so that no value a template builds is deeper than Limits::max_depth (its destructor,
// repr and comparison recurse at most that far) or larger than Limits::max_value_bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "nlohmann/json.hpp"
#include "src/formats/jinja.h"

namespace fuyou::jinja {

struct Value;
struct Node;
using List = std::vector<Value>;

struct Dict {
  std::vector<std::pair<std::string, Value>> items;  // in insertion order
  const Value* find(const std::string& key) const;
  Value* find(const std::string& key);
};

struct Frame;  // a render scope (jinja_render.cc)

// A macro, a {% call %} block's caller, or a global function (builtin).
struct Callable {
  std::string name;
  const Node* node = nullptr;                         // kMacro or kCallBlock; null: builtin
  std::shared_ptr<const std::vector<Frame>> closure;  // the scopes it was defined in
};

struct Value {
  enum Kind : uint8_t {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kNamespace,
    kCallable
  };
  Kind kind = kUndefined;
  bool b = false;
  bool tuple = false;  // kList made as a tuple: printed (a, b)
  // kList standing for the generator a jinja2 filter returns (select, map, unique, ...): always
  // true, as a generator is, even when empty; it has no length and no subscripts.
  bool generator = false;
  bool loop = false;      // kDict that is a for loop's `loop` (it has cycle())
  bool holds_ns = false;  // a namespace is inside
  uint32_t depth = 0;     // containers nested inside, this one included
  int64_t i = 0;
  double f = 0;
  uint64_t bytes = 0;                      // contents, counted at each reference
  std::shared_ptr<const std::string> str;  // kString; kUndefined: why (for its errors)
  std::shared_ptr<const List> list;        // kList
  std::shared_ptr<Dict> dict;              // kDict (never changed once made), kNamespace
  std::shared_ptr<const Callable> fn;      // kCallable

  static Value undefined(std::string why);
  static Value none();
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value real(double v);
  static Value callable(std::shared_ptr<const Callable> c);

  const std::string& s() const { return *str; }
  bool numeric() const { return kind == kInt || kind == kFloat || kind == kBool; }
  double number() const { return kind == kFloat ? f : kind == kBool ? b : static_cast<double>(i); }
  int64_t integral() const { return kind == kBool ? b : i; }  // kInt or kBool
  bool is_container() const { return kind == kList || kind == kDict || kind == kNamespace; }
  const Value* find(const std::string& key) const {
    return kind == kDict || kind == kNamespace ? dict->find(key) : nullptr;
  }
};

// The limits, the work counter and the place errors name; passed to every operation that
// makes a value or does work proportional to its input.
class Ctx {
 public:
  Ctx(const std::string& name, const Options& options, Work* work)
      : name_(name), options_(options), limits_(options.limits), work_(work) {}
  const Limits& limits() const { return limits_; }
  const Options& options() const { return options_; }
  const std::string& name() const { return name_; }
  int line = 0;

  [[noreturn]] void fail(const std::string& why) const;
  // One operation, and one per 64 bytes an operation reads or writes.
  void charge(uint64_t ops = 1, uint64_t bytes = 0) {
    if (!work_->charge(ops + bytes / 64))
      fail(str_limit("more than ", work_->limit(), " operations", "max_work"));
  }
  Value string(std::string s) const;
  Value list(List l, bool tuple = false) const;
  Value generator(List l) const {
    Value v = list(std::move(l));
    v.generator = true;
    return v;
  }
  Value dict(Dict d) const;
  Value ns(Dict d) const;
  // Throws when a string being built passes the value limit.
  void check_size(uint64_t bytes) const {
    if (bytes > limits_.max_value_bytes)
      fail(
          str_limit("a value of more than ", limits_.max_value_bytes, " bytes", "max_value_bytes"));
  }

 private:
  static std::string str_limit(const char* what, uint64_t n, const char* unit, const char* key);
  Value container(Value v) const;

  const std::string& name_;
  const Options& options_;
  const Limits& limits_;
  Work* work_;
};

// What one value takes in memory besides its contents' bytes (the Value, a string's shared
// allocation): counted for each item of a container, so that a list of many small items is
// bounded by what it really takes.
constexpr uint64_t kItemBytes = 160;

const char* kind_name(const Value& v);  // Python's type name: 'str', 'int', 'list', ...
bool truthy(const Value& v);
bool equal(const Value& a, const Value& b);
// -1, 0, 1, as Python orders numbers and strings (lists elementwise); fails for other pairs.
int compare(Ctx& c, const Value& a, const Value& b, const char* op = "<");

std::string to_string(Ctx& c, const Value& v);  // Python's str(): what {{ v }} prints
std::string repr(Ctx& c, const Value& v);       // Python's repr()
// json.dumps(v, ensure_ascii=False, indent=indent) as transformers' tojson; indent < 0: none.
std::string to_json(Ctx& c, const Value& v, const std::string* indent);
std::string float_repr(double f);

// A JSON document as values (either key order: nlohmann::json sorts, ordered_json keeps the
// document's); fails beyond Limits::max_depth, before anything recursive reads it.
template <class Json>
Value from_json(Ctx& c, const Json& j);

// UTF-8 strings indexed by code point, as Python's str is.
size_t code_points(const std::string& s);
// The byte offset of code point k (k <= code_points(s)), for a string that is not plain ASCII.
std::vector<size_t> code_point_offsets(const std::string& s);

}  // namespace fuyou::jinja
