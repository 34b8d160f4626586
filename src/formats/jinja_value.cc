// Values of the chat-template renderer (src/formats/jinja_value.h): making them within the
// limits, and Python's str(), repr(), json.dumps(), equality and order over them.
#include "src/formats/jinja_value.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "fuyou/error.h"

namespace fuyou::jinja {

const Value* Dict::find(const std::string& key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}
Value* Dict::find(const std::string& key) {
  for (auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

Value Value::undefined(std::string why) {
  Value x;
  x.str = std::make_shared<const std::string>(std::move(why));
  return x;
}
Value Value::none() {
  Value x;
  x.kind = kNone;
  return x;
}
Value Value::boolean(bool v) {
  Value x;
  x.kind = kBool;
  x.b = v;
  return x;
}
Value Value::integer(int64_t v) {
  Value x;
  x.kind = kInt;
  x.i = v;
  return x;
}
Value Value::real(double v) {
  Value x;
  x.kind = kFloat;
  x.f = v;
  return x;
}
Value Value::callable(std::shared_ptr<const Callable> c) {
  Value x;
  x.kind = kCallable;
  x.fn = std::move(c);
  return x;
}

void Ctx::fail(const std::string& why) const {
  throw Error(str(name_, ": line ", line, ": ", why));
}

std::string Ctx::str_limit(const char* what, uint64_t n, const char* unit, const char* key) {
  return str(what, n, unit, " (the limit ", key, ")");
}

Value Ctx::string(std::string s) const {
  check_size(s.size());
  Value x;
  x.kind = Value::kString;
  x.bytes = s.size();
  x.str = std::make_shared<const std::string>(std::move(s));
  return x;
}

// Depth, size and whether a namespace is inside, from the contents; the limits checked.
Value Ctx::container(Value x) const {
  uint64_t bytes = 0;
  uint32_t depth = 0;
  bool ns = false;
  auto add = [&](const Value& v) {
    bytes += v.bytes + kItemBytes;
    depth = std::max(depth, v.depth);
    ns = ns || v.holds_ns || v.kind == Value::kNamespace;
  };
  if (x.kind == Value::kList) {
    for (const Value& v : *x.list) add(v);
  } else {
    for (const auto& [k, v] : x.dict->items) {
      bytes += k.size();
      add(v);
    }
  }
  if (depth + 1 > static_cast<uint32_t>(limits_.max_depth))
    fail(str_limit("values nest more than ", limits_.max_depth, " deep", "max_depth"));
  check_size(bytes);
  x.bytes = bytes;
  x.depth = depth + 1;
  x.holds_ns = ns;
  return x;
}

Value Ctx::list(List l, bool tuple) const {
  Value x;
  x.kind = Value::kList;
  x.tuple = tuple;
  x.list = std::make_shared<const List>(std::move(l));
  return container(std::move(x));
}

Value Ctx::dict(Dict d) const {
  Value x;
  x.kind = Value::kDict;
  x.dict = std::make_shared<Dict>(std::move(d));
  return container(std::move(x));
}

Value Ctx::ns(Dict d) const {
  for (const auto& [k, v] : d.items)
    if (v.kind == Value::kNamespace || v.holds_ns)
      fail(str("a namespace cannot hold a namespace ('", k, "')"));
  Value x;
  x.kind = Value::kNamespace;
  x.dict = std::make_shared<Dict>(std::move(d));
  x = container(std::move(x));
  x.holds_ns = false;
  return x;
}

const char* kind_name(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined:
      return "Undefined";
    case Value::kNone:
      return "NoneType";
    case Value::kBool:
      return "bool";
    case Value::kInt:
      return "int";
    case Value::kFloat:
      return "float";
    case Value::kString:
      return "str";
    case Value::kList:
      return v.generator ? "generator" : v.tuple ? "tuple" : "list";
    case Value::kDict:
      return v.loop ? "LoopContext" : "dict";
    case Value::kNamespace:
      return "Namespace";
    case Value::kCallable:
      return v.fn->node ? "Macro" : "function";
  }
  return "?";
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined:
    case Value::kNone:
      return false;
    case Value::kBool:
      return v.b;
    case Value::kInt:
      return v.i != 0;
    case Value::kFloat:
      return v.f != 0;
    case Value::kString:
      return !v.s().empty();
    case Value::kList:
      return v.generator || !v.list->empty();
    case Value::kDict:
      return !v.dict->items.empty();
    case Value::kNamespace:
    case Value::kCallable:
      return true;
  }
  return false;
}

bool equal(const Value& a, const Value& b) {
  if (a.numeric() && b.numeric()) {
    if (a.kind != Value::kFloat && b.kind != Value::kFloat) return a.integral() == b.integral();
    return a.number() == b.number();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::kString:
      return a.s() == b.s();
    case Value::kList:
      if (a.list->size() != b.list->size() || a.tuple != b.tuple) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equal((*a.list)[k], (*b.list)[k])) return false;
      return true;
    case Value::kDict:
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, v] : a.dict->items) {
        const Value* o = b.dict->find(k);
        if (!o || !equal(v, *o)) return false;
      }
      return true;
    case Value::kNamespace:
      return a.dict == b.dict;
    case Value::kCallable:
      return a.fn == b.fn;
    default:
      return true;  // None == None; Undefined == Undefined, as jinja2's Undefined.__eq__
  }
}

int compare(Ctx& c, const Value& a, const Value& b, const char* op) {
  if (a.numeric() && b.numeric()) {
    if (a.kind != Value::kFloat && b.kind != Value::kFloat)
      return a.integral() < b.integral() ? -1 : a.integral() > b.integral();
    return a.number() < b.number() ? -1 : a.number() > b.number();
  }
  if (a.kind == Value::kString && b.kind == Value::kString) {
    const int r = a.s().compare(b.s());  // UTF-8 orders as code points do
    return r < 0 ? -1 : r > 0;
  }
  if (a.kind == Value::kList && b.kind == Value::kList) {
    const size_t n = std::min(a.list->size(), b.list->size());
    for (size_t k = 0; k < n; ++k) {
      c.charge();
      if (!equal((*a.list)[k], (*b.list)[k])) return compare(c, (*a.list)[k], (*b.list)[k], op);
    }
    return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size();
  }
  c.fail(str("'", op, "' not supported between instances of '", kind_name(a), "' and '",
             kind_name(b), "'"));
}

// Python's repr() of a float: the shortest digits that read back as the same number, in
// exponent form below 1e-4 and from 1e16.
std::string float_repr(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  if (f == 0) return std::signbit(f) ? "-0.0" : "0.0";
  char buf[40];
  int prec = 1;
  for (; prec < 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*e", prec - 1, f);
    if (std::strtod(buf, nullptr) == f) break;
  }
  std::snprintf(buf, sizeof buf, "%.*e", prec - 1, f);
  // buf: [-]d.ddde[+-]XX
  std::string s = buf;
  const size_t e = s.find('e');
  const int exp = std::atoi(s.c_str() + e + 1);
  std::string digits;
  for (size_t k = 0; k < e; ++k)
    if (std::isdigit(static_cast<unsigned char>(s[k]))) digits += s[k];
  const std::string sign = f < 0 ? "-" : "";
  if (exp < -4 || exp >= 16) {
    std::string m = digits.substr(0, 1);
    if (digits.size() > 1) m += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    return sign + m + eb;
  }
  if (exp < 0) return sign + "0." + std::string(-exp - 1, '0') + digits;
  if (static_cast<int>(digits.size()) <= exp + 1)
    return sign + digits + std::string(exp + 1 - digits.size(), '0') + ".0";
  return sign + digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
}

namespace {

// Appends with the value limit checked, so that no printed form outgrows it.
struct Out {
  Ctx& c;
  std::string s;
  void add(const std::string& x) {
    c.check_size(s.size() + x.size());
    s += x;
  }
  void add(char x) {
    c.check_size(s.size() + 1);
    s += x;
  }
};

void repr_string(Out& o, const std::string& s) {
  const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string r(1, q);
  for (unsigned char ch : s) {
    if (ch == '\\' || ch == static_cast<unsigned char>(q)) {
      r += '\\';
      r += static_cast<char>(ch);
    } else if (ch == '\n') {
      r += "\\n";
    } else if (ch == '\r') {
      r += "\\r";
    } else if (ch == '\t') {
      r += "\\t";
    } else if (ch < 0x20 || ch == 0x7f) {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", ch);
      r += b;
    } else {
      r += static_cast<char>(ch);
    }
  }
  r += q;
  o.add(r);
}

void write(Out& o, const Value& v, bool as_repr);

void write_items(Out& o, const Value& v) {
  if (v.kind == Value::kList) {
    o.add(v.tuple ? '(' : '[');
    for (size_t k = 0; k < v.list->size(); ++k) {
      if (k) o.add(", ");
      o.c.charge();
      write(o, (*v.list)[k], true);
    }
    if (v.tuple && v.list->size() == 1) o.add(',');
    o.add(v.tuple ? ')' : ']');
    return;
  }
  o.add('{');
  bool first = true;
  for (const auto& [k, x] : v.dict->items) {
    if (!first) o.add(", ");
    first = false;
    o.c.charge();
    repr_string(o, k);
    o.add(": ");
    write(o, x, true);
  }
  o.add('}');
}

void write(Out& o, const Value& v, bool as_repr) {
  switch (v.kind) {
    case Value::kUndefined:
      return;
    case Value::kNone:
      return o.add("None");
    case Value::kBool:
      return o.add(v.b ? "True" : "False");
    case Value::kInt:
      return o.add(std::to_string(v.i));
    case Value::kFloat:
      return o.add(float_repr(v.f));
    case Value::kString:
      return as_repr ? repr_string(o, v.s()) : o.add(v.s());
    case Value::kList:
      if (v.generator) return o.add("<generator object>");
      return write_items(o, v);
    case Value::kDict:
      return write_items(o, v);
    case Value::kNamespace:
      o.add("<Namespace ");
      write_items(o, v);
      return o.add('>');
    case Value::kCallable:
      return o.add(str("<", kind_name(v), " '", v.fn->name, "'>"));
  }
}

void json_string(Out& o, const std::string& s) {
  std::string r = "\"";
  for (unsigned char ch : s) {
    switch (ch) {
      case '"':
        r += "\\\"";
        break;
      case '\\':
        r += "\\\\";
        break;
      case '\n':
        r += "\\n";
        break;
      case '\r':
        r += "\\r";
        break;
      case '\t':
        r += "\\t";
        break;
      case '\b':
        r += "\\b";
        break;
      case '\f':
        r += "\\f";
        break;
      default:
        if (ch < 0x20) {
          char b[8];
          std::snprintf(b, sizeof b, "\\u%04x", ch);
          r += b;
        } else {
          r += static_cast<char>(ch);
        }
    }
  }
  r += '"';
  o.add(r);
}

void json_write(Out& o, const Value& v, const std::string* indent, int level) {
  o.c.charge();
  auto newline = [&](int l) {
    if (!indent) return;
    o.add('\n');
    for (int k = 0; k < l; ++k) o.add(*indent);
  };
  switch (v.kind) {
    case Value::kNone:
      return o.add("null");
    case Value::kBool:
      return o.add(v.b ? "true" : "false");
    case Value::kInt:
      return o.add(std::to_string(v.i));
    case Value::kFloat:
      if (std::isnan(v.f)) return o.add("NaN");
      if (std::isinf(v.f)) return o.add(v.f > 0 ? "Infinity" : "-Infinity");
      return o.add(float_repr(v.f));
    case Value::kString:
      return json_string(o, v.s());
    case Value::kList: {
      if (v.generator) o.c.fail("Object of type generator is not JSON serializable");
      if (v.list->empty()) return o.add("[]");
      o.add('[');
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) o.add(indent ? "," : ", ");
        newline(level + 1);
        json_write(o, (*v.list)[k], indent, level + 1);
      }
      newline(level);
      return o.add(']');
    }
    case Value::kDict: {
      if (v.dict->items.empty()) return o.add("{}");
      o.add('{');
      bool first = true;
      for (const auto& [k, x] : v.dict->items) {
        if (!first) o.add(indent ? "," : ", ");
        first = false;
        newline(level + 1);
        json_string(o, k);
        o.add(": ");
        json_write(o, x, indent, level + 1);
      }
      newline(level);
      return o.add('}');
    }
    default:
      o.c.fail(str("Object of type ", kind_name(v), " is not JSON serializable"));
  }
}

}  // namespace

std::string to_string(Ctx& c, const Value& v) {
  if (v.kind == Value::kString) return v.s();
  Out o{c, {}};
  write(o, v, false);
  return std::move(o.s);
}

std::string repr(Ctx& c, const Value& v) {
  Out o{c, {}};
  write(o, v, true);
  return std::move(o.s);
}

std::string to_json(Ctx& c, const Value& v, const std::string* indent) {
  Out o{c, {}};
  json_write(o, v, indent, 0);
  return std::move(o.s);
}

template <class Json>
Value from_json(Ctx& c, const Json& j) {
  // The depth first, without recursion: the conversion below then recurses at most that far.
  std::vector<std::pair<const Json*, int>> stack = {{&j, 1}};
  while (!stack.empty()) {
    auto [x, d] = stack.back();
    stack.pop_back();
    c.charge();
    if (!x->is_structured()) continue;
    if (d > c.limits().max_depth)
      c.fail(str("the data nests more than ", c.limits().max_depth, " deep (the limit max_depth)"));
    for (const auto& y : *x) stack.emplace_back(&y, d + 1);
  }
  struct Conv {
    Ctx& c;
    Value operator()(const Json& x) const {
      if (x.is_null()) return Value::none();
      if (x.is_boolean()) return Value::boolean(x.template get<bool>());
      if (x.is_number_unsigned() && x.template get<uint64_t>() > uint64_t(INT64_MAX))
        return Value::real(static_cast<double>(x.template get<uint64_t>()));
      if (x.is_number_integer()) return Value::integer(x.template get<int64_t>());
      if (x.is_number()) return Value::real(x.template get<double>());
      if (x.is_string()) return c.string(x.template get<std::string>());
      if (x.is_array()) {
        List l;
        l.reserve(x.size());
        for (const auto& y : x) l.push_back((*this)(y));
        return c.list(std::move(l));
      }
      Dict d;
      for (auto it = x.begin(); it != x.end(); ++it)
        d.items.emplace_back(it.key(), (*this)(it.value()));
      return c.dict(std::move(d));
    }
  };
  return Conv{c}(j);
}
template Value from_json(Ctx& c, const nlohmann::json& j);
template Value from_json(Ctx& c, const nlohmann::ordered_json& j);

size_t code_points(const std::string& s) {
  size_t n = 0;
  for (unsigned char ch : s) n += (ch & 0xC0) != 0x80;
  return n;
}

std::vector<size_t> code_point_offsets(const std::string& s) {
  std::vector<size_t> at;
  for (size_t k = 0; k < s.size(); ++k)
    if ((static_cast<unsigned char>(s[k]) & 0xC0) != 0x80) at.push_back(k);
  at.push_back(s.size());
  return at;
}

}  // namespace fuyou::jinja
