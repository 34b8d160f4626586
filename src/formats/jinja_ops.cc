// Operators, subscripts, slices and methods of template values (src/formats/jinja_builtins.h),
// with Python's semantics and jinja2's errors. Strings are indexed by code point as Python's
// are; case mapping is ASCII's.
#include <algorithm>
#include <cctype>
#include <climits>
#include <cmath>
#include <cstdio>

#include "fuyou/error.h"
#include "src/formats/jinja_builtins.h"

namespace fuyou::jinja {
namespace {

const char* kSpace = " \t\n\r\f\v";

bool ascii(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char ch) { return (ch & 0x80) == 0; });
}

std::string repeat(Ctx& c, const std::string& s, int64_t n) {
  if (n <= 0 || s.empty()) return "";
  if (static_cast<uint64_t>(n) > c.limits().max_value_bytes / s.size()) c.check_size(UINT64_MAX);
  c.charge(1, s.size() * n);
  std::string r;
  r.reserve(s.size() * n);
  for (int64_t k = 0; k < n; ++k) r += s;
  return r;
}

[[noreturn]] void operand_error(Ctx& c, const std::string& op, const Value& a, const Value& b) {
  if (a.kind == Value::kUndefined) c.fail(a.s());
  if (b.kind == Value::kUndefined) c.fail(b.s());
  c.fail(str("unsupported operand type(s) for ", op, ": '", kind_name(a), "' and '", kind_name(b),
             "'"));
}

Value arithmetic(Ctx& c, const std::string& op, const Value& a, const Value& b) {
  if (!a.numeric() || !b.numeric()) operand_error(c, op, a, b);
  const bool ints = a.kind != Value::kFloat && b.kind != Value::kFloat;
  const int64_t x = a.integral(), y = b.integral();
  const double fx = a.number(), fy = b.number();
  if (op == "/") {
    if (fy == 0) c.fail("division by zero");
    return Value::real(fx / fy);
  }
  if (op == "//" || op == "%") {
    if (fy == 0)
      c.fail(op == "%" ? "integer modulo by zero" : "integer division or modulo by zero");
    if (ints) {
      if (x == INT64_MIN && y == -1) c.fail("integer overflow");
      int64_t q = x / y;
      if ((x % y != 0) && ((x < 0) != (y < 0))) --q;  // Python floors
      return Value::integer(op == "//" ? q : x - q * y);
    }
    const double q = std::floor(fx / fy);
    if (op == "//") return Value::real(q);
    double r = std::fmod(fx, fy);
    if (r != 0 && ((r < 0) != (fy < 0))) r += fy;
    return Value::real(r);
  }
  if (op == "**") {
    if (ints && y >= 0) {
      int64_t r = 1, base = x;
      for (int64_t e = y; e > 0; e >>= 1) {
        c.charge();
        if ((e & 1) && __builtin_mul_overflow(r, base, &r)) c.fail("integer overflow in **");
        if (e > 1 && __builtin_mul_overflow(base, base, &base)) c.fail("integer overflow in **");
      }
      return Value::integer(r);
    }
    return Value::real(std::pow(fx, fy));
  }
  if (ints) {
    int64_t r;
    const bool over = op == "+"   ? __builtin_add_overflow(x, y, &r)
                      : op == "-" ? __builtin_sub_overflow(x, y, &r)
                                  : __builtin_mul_overflow(x, y, &r);
    if (over) c.fail(str("integer overflow in ", x, " ", op, " ", y));
    return Value::integer(r);
  }
  return Value::real(op == "+" ? fx + fy : op == "-" ? fx - fy : fx * fy);
}

bool contains(Ctx& c, const Value& hay, const Value& needle) {
  switch (hay.kind) {
    case Value::kString:
      if (needle.kind != Value::kString)
        c.fail(str("'in <string>' requires string as left operand, not ", kind_name(needle)));
      c.charge(1, hay.s().size());
      return hay.s().find(needle.s()) != std::string::npos;
    case Value::kList:
      c.charge(hay.list->size());
      return std::any_of(hay.list->begin(), hay.list->end(),
                         [&](const Value& x) { return equal(x, needle); });
    case Value::kDict:
      c.charge(hay.dict->items.size());
      return needle.kind == Value::kString && hay.dict->find(needle.s()) != nullptr;
    case Value::kUndefined:
      return false;  // jinja2's Undefined iterates as empty
    default:
      c.fail(str("argument of type '", kind_name(hay), "' is not iterable"));
  }
}

}  // namespace

Value binary_op(Ctx& c, const std::string& op, const Value& a, const Value& b) {
  c.charge();
  if (op == "==") return Value::boolean(equal(a, b));
  if (op == "!=") return Value::boolean(!equal(a, b));
  if (op == "~") {
    std::string s = to_string(c, a);
    const std::string t = to_string(c, b);
    c.check_size(s.size() + t.size());
    c.charge(1, s.size() + t.size());
    return c.string(s + t);
  }
  if (op == "in" || op == "not in") return Value::boolean(contains(c, b, a) == (op == "in"));
  if (op == "<" || op == ">" || op == "<=" || op == ">=") {
    const int r = compare(c, a, b, op.c_str());
    return Value::boolean(op == "<" ? r < 0 : op == ">" ? r > 0 : op == "<=" ? r <= 0 : r >= 0);
  }
  if (op == "+" && a.kind == Value::kString && b.kind == Value::kString) {
    c.check_size(a.s().size() + b.s().size());
    c.charge(1, a.s().size() + b.s().size());
    return c.string(a.s() + b.s());
  }
  if (op == "+" && a.kind == Value::kList && b.kind == Value::kList && !a.generator &&
      !b.generator) {
    c.check_size(a.bytes + b.bytes);
    c.charge(a.list->size() + b.list->size());
    List l = *a.list;
    l.insert(l.end(), b.list->begin(), b.list->end());
    return c.list(std::move(l), a.tuple && b.tuple);
  }
  if (op == "*" && (a.kind == Value::kString || a.kind == Value::kList) &&
      (b.kind == Value::kInt || b.kind == Value::kBool))
    return binary_op(c, op, b, a);
  if (op == "*" && (a.kind == Value::kInt || a.kind == Value::kBool)) {
    if (b.kind == Value::kString) return c.string(repeat(c, b.s(), a.integral()));
    if (b.kind == Value::kList) {
      const int64_t n = std::max<int64_t>(a.integral(), 0);
      if (b.list->empty() || n == 0) return c.list({}, b.tuple);
      if (static_cast<uint64_t>(n) >
          c.limits().max_value_bytes / (b.bytes + kItemBytes * b.list->size()))
        c.check_size(UINT64_MAX);
      c.charge(n * b.list->size());
      List l;
      for (int64_t k = 0; k < n; ++k) l.insert(l.end(), b.list->begin(), b.list->end());
      return c.list(std::move(l), b.tuple);
    }
  }
  if (op == "%" && a.kind == Value::kString) return c.string(percent_format(c, a.s(), b));
  return arithmetic(c, op, a, b);
}

Value negate(Ctx& c, const Value& v) {
  if (v.kind == Value::kInt || v.kind == Value::kBool) {
    if (v.integral() == INT64_MIN) c.fail("integer overflow");
    return Value::integer(-v.integral());
  }
  if (v.kind == Value::kFloat) return Value::real(-v.f);
  if (v.kind == Value::kUndefined) c.fail(v.s());
  c.fail(str("bad operand type for unary -: '", kind_name(v), "'"));
}

Value attribute(Ctx& c, const Value& v, const std::string& name) {
  c.charge();
  if (v.kind == Value::kUndefined) c.fail(v.s());
  if (const Value* f = v.find(name)) return *f;
  if (v.kind == Value::kList && !name.empty() && std::isdigit(static_cast<unsigned char>(name[0])))
    return subscript(c, v, Value::integer(std::atoll(name.c_str())));
  return Value::undefined(str("'", kind_name(v), " object' has no attribute '", name, "'"));
}

Value subscript(Ctx& c, const Value& v, const Value& key) {
  c.charge();
  if (v.kind == Value::kUndefined) c.fail(v.s());
  if (v.kind == Value::kDict || v.kind == Value::kNamespace) {
    const Value* f = key.kind == Value::kString ? v.find(key.s()) : nullptr;
    if (f) return *f;
    return Value::undefined(str("'", kind_name(v), " object' has no attribute ", repr(c, key)));
  }
  if (v.generator)  // jinja2's sandbox gives undefined for what Python cannot subscript
    return Value::undefined(str("'generator object' has no attribute ", repr(c, key)));
  if ((v.kind == Value::kList || v.kind == Value::kString) &&
      (key.kind == Value::kInt || key.kind == Value::kBool)) {
    const bool plain = v.kind == Value::kList || ascii(v.s());
    std::vector<size_t> at;
    if (!plain) at = code_point_offsets(v.s());
    const int64_t n = static_cast<int64_t>(v.kind == Value::kList ? v.list->size()
                                           : plain                ? v.s().size()
                                                                  : at.size() - 1);
    const int64_t k = key.integral() < 0 ? key.integral() + n : key.integral();
    if (k < 0 || k >= n)
      return Value::undefined(str(kind_name(v), " object has no element ", key.integral()));
    if (v.kind == Value::kList) return (*v.list)[k];
    if (plain) return c.string(v.s().substr(k, 1));
    return c.string(v.s().substr(at[k], at[k + 1] - at[k]));
  }
  if (key.kind == Value::kString) return attribute(c, v, key.s());
  return Value::undefined(str("'", kind_name(v), " object' has no attribute ", repr(c, key)));
}

Value slice(Ctx& c, const Value& v, const Value* lo, const Value* hi, const Value* step) {
  if (v.kind == Value::kUndefined) c.fail(v.s());
  if ((v.kind != Value::kList && v.kind != Value::kString) || v.generator)
    c.fail(str("'", kind_name(v), "' object is not subscriptable"));
  const bool plain = v.kind == Value::kList || ascii(v.s());
  std::vector<size_t> at;
  if (!plain) at = code_point_offsets(v.s());
  const int64_t n = static_cast<int64_t>(v.kind == Value::kList ? v.list->size()
                                         : plain                ? v.s().size()
                                                                : at.size() - 1);
  auto bound = [&](const Value* b, const char* what) -> const Value* {
    if (!b || b->kind == Value::kNone) return nullptr;
    if (b->kind != Value::kInt && b->kind != Value::kBool)
      c.fail(str("slice ", what, " must be an integer or None"));
    return b;
  };
  lo = bound(lo, "start");
  hi = bound(hi, "stop");
  step = bound(step, "step");
  const int64_t st = step ? step->integral() : 1;
  if (st == 0) c.fail("slice step cannot be zero");
  // PySlice_AdjustIndices.
  auto adjust = [&](const Value* b, int64_t dflt) {
    if (!b) return dflt;
    int64_t k = b->integral();
    if (k < 0) {
      k += n;
      if (k < 0) k = st < 0 ? -1 : 0;
    } else if (k >= n) {
      k = st < 0 ? n - 1 : n;
    }
    return k;
  };
  const int64_t start = adjust(lo, st < 0 ? n - 1 : 0), stop = adjust(hi, st < 0 ? -1 : n);
  List items;
  std::string s;
  for (int64_t k = start; st > 0 ? k < stop : k > stop; k += st) {
    c.charge();
    if (v.kind == Value::kList)
      items.push_back((*v.list)[k]);
    else if (plain)
      s += v.s()[k];
    else
      s.append(v.s(), at[k], at[k + 1] - at[k]);
  }
  if (v.kind == Value::kList) return c.list(std::move(items), v.tuple);
  return c.string(std::move(s));
}

List iterate(Ctx& c, const Value& v) {
  List out;
  switch (v.kind) {
    case Value::kUndefined:
      return out;
    case Value::kList:
      c.charge(v.list->size());
      return *v.list;
    case Value::kDict:
      c.charge(v.dict->items.size());
      for (const auto& kv : v.dict->items) out.push_back(c.string(kv.first));
      return out;
    case Value::kString: {
      // Each character is a value of its own: bounded like a list of them.
      c.check_size(v.s().size() * kItemBytes);
      c.charge(1, v.s().size() * 64);
      const std::vector<size_t> at = code_point_offsets(v.s());
      for (size_t k = 0; k + 1 < at.size(); ++k)
        out.push_back(c.string(v.s().substr(at[k], at[k + 1] - at[k])));
      return out;
    }
    default:
      c.fail(str("'", kind_name(v), "' object is not iterable"));
  }
}

namespace {

std::string strip(const std::string& s, bool left, bool right, const std::string& chars) {
  size_t b = left ? s.find_first_not_of(chars) : 0;
  if (b == std::string::npos) return "";
  size_t e = right ? s.find_last_not_of(chars) + 1 : s.size();
  return s.substr(b, e - b);
}

std::string cased(std::string s, int how) {  // 1 upper, -1 lower
  for (char& ch : s)
    ch = static_cast<char>(how > 0 ? std::toupper(static_cast<unsigned char>(ch))
                                   : std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

std::string replace(Ctx& c, const std::string& s, const std::string& from, const std::string& to,
                    int64_t count) {
  std::string r;
  size_t at = 0;
  int64_t done = 0;
  auto add = [&](const std::string& x, size_t pos, size_t len) {
    c.check_size(r.size() + len);
    c.charge(1, len);
    r.append(x, pos, len);
  };
  if (from.empty()) {  // Python puts `to` between every character and at both ends
    const std::vector<size_t> cp = code_point_offsets(s);
    for (size_t k = 0; k + 1 < cp.size() && (count < 0 || done < count); ++k, ++done) {
      add(to, 0, to.size());
      add(s, cp[k], cp[k + 1] - cp[k]);
      at = cp[k + 1];
    }
    if (count < 0 || done < count) add(to, 0, to.size());
    add(s, at, s.size() - at);
    return r;
  }
  for (size_t k = s.find(from); k != std::string::npos && (count < 0 || done < count);
       k = s.find(from, at), ++done) {
    add(s, at, k - at);
    add(to, 0, to.size());
    at = k + from.size();
  }
  add(s, at, s.size() - at);
  return r;
}

}  // namespace

std::string str_replace(Ctx& c, const std::string& s, const std::string& from,
                        const std::string& to, int64_t count) {
  return replace(c, s, from, to, count);
}

Value split(Ctx& c, const std::string& s, const Value* sep, int64_t maxsplit) {
  List parts;
  uint64_t bytes = 0;
  auto add = [&](std::string p) {
    bytes += p.size() + kItemBytes;
    c.check_size(bytes);
    c.charge(1, p.size());
    parts.push_back(c.string(std::move(p)));
  };
  if (!sep || sep->kind == Value::kNone) {
    size_t k = 0;
    while ((k = s.find_first_not_of(kSpace, k)) != std::string::npos) {
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
        add(s.substr(k));  // the rest as it is, as Python leaves it
        break;
      }
      size_t end = s.find_first_of(kSpace, k);
      add(s.substr(k, end == std::string::npos ? std::string::npos : end - k));
      k = end;
    }
  } else {
    if (sep->kind != Value::kString) c.fail(str("must be str or None, not ", kind_name(*sep)));
    if (sep->s().empty()) c.fail("empty separator");
    size_t at = 0;
    for (size_t k = s.find(sep->s());
         k != std::string::npos && (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit);
         k = s.find(sep->s(), at)) {
      add(s.substr(at, k - at));
      at = k + sep->s().size();
    }
    add(s.substr(at));
  }
  return c.list(std::move(parts));
}

namespace {

// "{}", "{0}", "{name}" and "{{" "}}"; a format spec after ":" is refused by name.
std::string brace_format(Ctx& c, const std::string& f, const Args& args, const Kwargs& kwargs) {
  std::string r;
  size_t next = 0;
  for (size_t k = 0; k < f.size(); ++k) {
    c.charge();
    const char ch = f[k];
    if ((ch == '{' || ch == '}') && k + 1 < f.size() && f[k + 1] == ch) {
      r += ch;
      ++k;
      continue;
    }
    if (ch == '}') c.fail("Single '}' encountered in format string");
    if (ch != '{') {
      r += ch;
      continue;
    }
    const size_t end = f.find('}', k);
    if (end == std::string::npos) c.fail("Single '{' encountered in format string");
    const std::string field = f.substr(k + 1, end - k - 1);
    if (field.find_first_of(":!.[") != std::string::npos)
      c.fail(str("format field '{", field, "}' is not supported (only {}, {N} and {name})"));
    const Value* v = nullptr;
    if (field.empty()) {
      if (next >= args.size()) c.fail("Replacement index out of range for positional args tuple");
      v = &args[next++];
    } else if (std::isdigit(static_cast<unsigned char>(field[0]))) {
      const size_t n = std::stoul(field);
      if (n >= args.size()) c.fail("Replacement index out of range for positional args tuple");
      v = &args[n];
    } else {
      for (const auto& [name, x] : kwargs)
        if (name == field) v = &x;
      if (!v) c.fail(str("KeyError: '", field, "'"));
    }
    r += to_string(c, *v);
    c.check_size(r.size());
    k = end;
  }
  return r;
}

Value string_method(Ctx& c, const std::string& s, const std::string& m, const Args& args,
                    const Kwargs& kwargs, bool* found) {
  *found = true;
  c.charge(1, s.size());
  auto arg_string = [&](size_t k, const char* dflt) -> std::string {
    if (k >= args.size() || args[k].kind == Value::kNone) {
      if (dflt) return dflt;
      c.fail(str(m, "() takes at least ", k + 1, " argument(s)"));
    }
    if (args[k].kind != Value::kString)
      c.fail(str(m, "() argument ", k + 1, " must be str, not ", kind_name(args[k])));
    return args[k].s();
  };
  auto arg_int = [&](size_t k, int64_t dflt) -> int64_t {
    if (k >= args.size()) return dflt;
    if (args[k].kind != Value::kInt) c.fail(str(m, "() argument must be an integer"));
    return args[k].i;
  };
  if (m == "strip" || m == "lstrip" || m == "rstrip")
    return c.string(strip(s, m != "rstrip", m != "lstrip", arg_string(0, kSpace)));
  if (m == "startswith" || m == "endswith") {
    std::vector<std::string> options;
    if (!args.empty() && args[0].kind == Value::kList) {
      for (const Value& x : *args[0].list) {
        if (x.kind != Value::kString) c.fail(str(m, "() tuple items must be str"));
        options.push_back(x.s());
      }
    } else {
      options.push_back(arg_string(0, nullptr));
    }
    for (const std::string& p : options) {
      const bool hit = m == "startswith" ? s.compare(0, p.size(), p) == 0
                                         : s.size() >= p.size() &&
                                               s.compare(s.size() - p.size(), p.size(), p) == 0;
      if (hit) return Value::boolean(true);
    }
    return Value::boolean(false);
  }
  if (m == "upper") return c.string(cased(s, 1));
  if (m == "lower") return c.string(cased(s, -1));
  if (m == "capitalize") {
    std::string t = cased(s, -1);
    if (!t.empty()) t[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(t[0])));
    return c.string(t);
  }
  if (m == "title") {
    std::string t = s;
    bool start = true;
    for (char& ch : t) {
      const bool alpha = std::isalpha(static_cast<unsigned char>(ch)) != 0;
      ch = static_cast<char>(start && alpha ? std::toupper(static_cast<unsigned char>(ch))
                                            : std::tolower(static_cast<unsigned char>(ch)));
      start = !alpha;
    }
    return c.string(t);
  }
  if (m == "replace")
    return c.string(replace(c, s, arg_string(0, nullptr), arg_string(1, nullptr), arg_int(2, -1)));
  if (m == "split") return split(c, s, args.empty() ? nullptr : &args[0], arg_int(1, -1));
  if (m == "find" || m == "count") {
    const std::string sub = arg_string(0, nullptr);
    if (m == "find") {
      const size_t k = s.find(sub);
      return Value::integer(
          k == std::string::npos ? -1 : static_cast<int64_t>(code_points(s.substr(0, k))));
    }
    if (sub.empty()) return Value::integer(static_cast<int64_t>(code_points(s)) + 1);
    int64_t n = 0;
    for (size_t k = s.find(sub); k != std::string::npos; k = s.find(sub, k + sub.size())) ++n;
    return Value::integer(n);
  }
  if (m == "join") {
    if (args.size() != 1) c.fail("join() takes exactly one argument");
    const List items = iterate(c, args[0]);
    std::string r;
    for (size_t k = 0; k < items.size(); ++k) {
      if (items[k].kind != Value::kString)
        c.fail(
            str("sequence item ", k, ": expected str instance, ", kind_name(items[k]), " found"));
      if (k) r += s;
      r += items[k].s();
      c.check_size(r.size());
      c.charge(1, items[k].s().size());
    }
    return c.string(std::move(r));
  }
  if (m == "format") return c.string(brace_format(c, s, args, kwargs));
  if (m == "isdigit" || m == "isalpha" || m == "isspace" || m == "isalnum") {
    return Value::boolean(!s.empty() && std::all_of(s.begin(), s.end(), [&](char ch) {
      const int u = static_cast<unsigned char>(ch);
      return m == "isdigit"   ? std::isdigit(u) != 0
             : m == "isalpha" ? std::isalpha(u) != 0
             : m == "isspace" ? std::isspace(u) != 0
                              : std::isalnum(u) != 0;
    }));
  }
  *found = false;
  return Value();
}

}  // namespace

Value call_method(Ctx& c, const Value& self, const std::string& m, const Args& args,
                  const Kwargs& kwargs) {
  c.charge();
  if (self.kind == Value::kUndefined) c.fail(self.s());
  if (self.kind == Value::kString) {
    bool found = false;
    Value r = string_method(c, self.s(), m, args, kwargs, &found);
    if (found) return r;
  }
  if (self.kind == Value::kDict) {
    if (self.loop && m == "cycle") {
      if (args.empty()) c.fail("no items for cycling given");
      return args[self.find("index0")->i % static_cast<int64_t>(args.size())];
    }
    if (m == "get") {
      if (args.empty()) c.fail("get expected at least 1 argument, got 0");
      const Value* f = args[0].kind == Value::kString ? self.find(args[0].s()) : nullptr;
      return f ? *f : args.size() > 1 ? args[1] : Value::none();
    }
    if (m == "keys" || m == "values" || m == "items") {
      c.charge(self.dict->items.size());
      List l;
      for (const auto& [k, v] : self.dict->items) {
        if (m == "keys")
          l.push_back(c.string(k));
        else if (m == "values")
          l.push_back(v);
        else
          l.push_back(c.list({c.string(k), v}, true));
      }
      return c.list(std::move(l));
    }
  }
  static const std::vector<std::string> mutators = {"append", "extend",     "insert", "pop",
                                                    "remove", "clear",      "sort",   "reverse",
                                                    "update", "setdefault", "popitem"};
  if ((self.kind == Value::kList || self.kind == Value::kDict) &&
      std::find(mutators.begin(), mutators.end(), m) != mutators.end())
    c.fail(str("access to attribute '", m, "' of '", kind_name(self), "' object is unsafe."));
  c.fail(str("'", kind_name(self), " object' has no attribute '", m, "'"));
}

std::string percent_format(Ctx& c, const std::string& f, const Value& arg) {
  Args args;
  if (arg.kind == Value::kList && arg.tuple)
    args = *arg.list;
  else
    args.push_back(arg);
  size_t next = 0;
  std::string r;
  for (size_t k = 0; k < f.size(); ++k) {
    c.charge();
    if (f[k] != '%') {
      r += f[k];
      continue;
    }
    size_t j = k + 1;
    std::string spec = "%";
    while (j < f.size() && std::string("-+ #0").find(f[j]) != std::string::npos) spec += f[j++];
    while (j < f.size() && std::isdigit(static_cast<unsigned char>(f[j]))) spec += f[j++];
    if (j < f.size() && f[j] == '.') {
      spec += f[j++];
      while (j < f.size() && std::isdigit(static_cast<unsigned char>(f[j]))) spec += f[j++];
    }
    if (j >= f.size()) c.fail("incomplete format");
    const char conv = f[j];
    k = j;
    if (conv == '%') {
      r += '%';
      continue;
    }
    if (spec.size() > 12) c.fail("a % format's width or precision is too long");
    if (next >= args.size()) c.fail("not enough arguments for format string");
    const Value& v = args[next++];
    char buf[512];
    if (conv == 's' || conv == 'r') {
      const std::string s = conv == 's' ? to_string(c, v) : repr(c, v);
      std::snprintf(buf, sizeof buf, (spec + "s").c_str(), "");
      // Width applies to the whole string; snprintf with the text itself could truncate.
      const size_t width = std::strlen(buf);
      std::string padded = s;
      if (padded.size() < width)
        padded = spec.find('-') != std::string::npos
                     ? padded + std::string(width - padded.size(), ' ')
                     : std::string(width - padded.size(), ' ') + padded;
      r += padded;
    } else if (std::string("dixXo").find(conv) != std::string::npos) {
      if (!v.numeric())
        c.fail(str("%", conv, " format: a real number is required, not ", kind_name(v)));
      const long long n = v.kind == Value::kFloat ? static_cast<long long>(v.f) : v.integral();
      std::snprintf(buf, sizeof buf, (spec + "ll" + (conv == 'i' ? 'd' : conv)).c_str(), n);
      r += buf;
    } else if (std::string("feEgG").find(conv) != std::string::npos) {
      if (!v.numeric()) c.fail(str("must be real number, not ", kind_name(v)));
      std::snprintf(buf, sizeof buf, (spec + conv).c_str(), v.number());
      r += buf;
    } else {
      c.fail(str("unsupported format character '", std::string(1, conv), "'"));
    }
    c.check_size(r.size());
  }
  if (next < args.size()) c.fail("not all arguments converted during string formatting");
  return r;
}

}  // namespace fuyou::jinja
