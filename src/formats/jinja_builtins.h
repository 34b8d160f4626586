// What chat templates do with values (src/formats/jinja.h), as jinja2 and Python do it:
// operators, attributes and subscripts, string and mapping methods (jinja_ops.cc), and the
// filters, tests and global functions (jinja_filters.cc). Each charges its work to the Ctx and
// makes its results through it, so that they stay within the limits.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "src/formats/jinja_value.h"

namespace fuyou::jinja {

using Args = std::vector<Value>;
using Kwargs = std::vector<std::pair<std::string, Value>>;

// a OP b for + - * / // % ** ~ == != < <= > >= in, "not in" ("and"/"or" short-circuit in the
// renderer).
Value binary_op(Ctx& c, const std::string& op, const Value& a, const Value& b);
Value negate(Ctx& c, const Value& v);

// a.name (an item of a mapping, or undefined) and a[key] (an element, an item, or undefined).
Value attribute(Ctx& c, const Value& v, const std::string& name);
Value subscript(Ctx& c, const Value& v, const Value& key);
// v[lo:hi:step], Python's rules; null bounds are left out.
Value slice(Ctx& c, const Value& v, const Value* lo, const Value* hi, const Value* step);

// self.name(args): the str, dict and loop methods templates call; anything else fails as
// jinja2 does (an undefined attribute, or the sandbox's refusal to change a list or dict).
Value call_method(Ctx& c, const Value& self, const std::string& name, const Args& args,
                  const Kwargs& kwargs);
// str.replace and str.split, for the methods and the filters.
std::string str_replace(Ctx& c, const std::string& s, const std::string& from,
                        const std::string& to, int64_t count);
Value split(Ctx& c, const std::string& s, const Value* sep, int64_t maxsplit);
// "fmt % args" (printf-style) and "fmt".format(args), as Python formats.
std::string percent_format(Ctx& c, const std::string& fmt, const Value& args);

// Whether jinja2 (with transformers' environment) defines a filter or test of this name.
bool known_filter(const std::string& name);
bool known_test(const std::string& name);

Value apply_filter(Ctx& c, const std::string& name, const Value& v, const Args& args,
                   const Kwargs& kwargs);
bool apply_test(Ctx& c, const std::string& name, const Value& v, const Args& args);

// The globals: raise_exception, strftime_now, range, namespace, dict.
bool is_global(const std::string& name);
Value call_global(Ctx& c, const std::string& name, const Args& args, const Kwargs& kwargs);

// Elements of a value a for loop or a filter iterates: a list's, a mapping's keys, a string's
// characters (code points); none for undefined; fails for other kinds.
List iterate(Ctx& c, const Value& v);

}  // namespace fuyou::jinja
