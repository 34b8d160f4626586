// jinja2's filters and tests, and the globals transformers gives chat templates
// (src/formats/jinja_builtins.h), with their arguments by position or by keyword as jinja2
// declares them, and tojson as transformers overrides it.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <ctime>

#include "fuyou/error.h"
#include "src/formats/jinja_builtins.h"

namespace fuyou::jinja {
namespace {

// A filter's or function's arguments: by position, or by the keyword jinja2 names them with.
class Params {
 public:
  Params(Ctx& c, const std::string& fn, const Args& args, const Kwargs& kwargs,
         std::vector<std::string> names)
      : c_(c), fn_(fn), args_(args), kwargs_(kwargs), names_(std::move(names)) {
    if (args_.size() > names_.size() && !names_.empty() && names_.back() != "*")
      c.fail(str(fn, "() takes at most ", names_.size(), " argument(s), ", args_.size(), " given"));
    for (const auto& [k, v] : kwargs_)
      if (std::find(names_.begin(), names_.end(), k) == names_.end())
        c.fail(str(fn, "() got an unexpected keyword argument '", k, "'"));
  }
  const Value* get(size_t pos) const {
    if (pos < args_.size() && (pos < names_.size() && names_[pos] != "*")) return &args_[pos];
    for (const auto& [k, v] : kwargs_)
      if (pos < names_.size() && k == names_[pos]) return &v;
    return nullptr;
  }
  bool flag(size_t pos, bool dflt) const {
    const Value* v = get(pos);
    return v ? truthy(*v) : dflt;
  }
  int64_t integer(size_t pos, int64_t dflt) const {
    const Value* v = get(pos);
    if (!v || v->kind == Value::kNone) return dflt;
    if (v->kind != Value::kInt && v->kind != Value::kBool)
      c_.fail(str(fn_, "(): '", names_[pos], "' must be an integer, not ", kind_name(*v)));
    return v->integral();
  }
  std::string string(size_t pos, const std::string& dflt) const {
    const Value* v = get(pos);
    if (!v || v->kind == Value::kNone) return dflt;
    return to_string(c_, *v);
  }

 private:
  Ctx& c_;
  const std::string& fn_;
  const Args& args_;
  const Kwargs& kwargs_;
  std::vector<std::string> names_;
};

// An attribute path as map and selectattr take it: "a.b", digits for list elements.
Value attribute_path(Ctx& c, Value v, const std::string& path) {
  size_t at = 0;
  while (at <= path.size()) {
    const size_t dot = path.find('.', at);
    const std::string part =
        path.substr(at, dot == std::string::npos ? std::string::npos : dot - at);
    if (v.kind == Value::kUndefined) return v;
    if (!part.empty() && std::all_of(part.begin(), part.end(), ::isdigit) && v.kind == Value::kList)
      v = subscript(c, v, Value::integer(std::stoll(part)));
    else
      v = subscript(c, v, c.string(part));
    if (dot == std::string::npos) break;
    at = dot + 1;
  }
  return v;
}

Value lowered(Ctx& c, const Value& v) {
  if (v.kind != Value::kString) return v;
  std::string s = v.s();
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return c.string(std::move(s));
}

List sorted(Ctx& c, List items, bool reverse, bool case_sensitive, const std::string& attr) {
  std::vector<std::pair<Value, Value>> keyed;
  for (Value& v : items) {
    Value k = attr.empty() ? v : attribute_path(c, v, attr);
    keyed.emplace_back(case_sensitive ? k : lowered(c, k), std::move(v));
  }
  c.charge(keyed.size() * 16);
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& a, const auto& b) {
    return reverse ? compare(c, b.first, a.first) < 0 : compare(c, a.first, b.first) < 0;
  });
  List out;
  for (auto& kv : keyed) out.push_back(std::move(kv.second));
  return out;
}

// select / reject / selectattr / rejectattr: args are (test, test arguments...).
Value select(Ctx& c, const std::string& f, const Value& v, const Args& args) {
  const bool by_attr = f == "selectattr" || f == "rejectattr";
  const bool keep = f == "select" || f == "selectattr";
  size_t k = 0;
  std::string attr;
  if (by_attr) {
    if (args.empty() || args[0].kind != Value::kString)
      c.fail(str(f, "() needs an attribute name"));
    attr = args[k++].s();
  }
  std::string test;
  if (k < args.size()) {
    if (args[k].kind != Value::kString) c.fail(str(f, "(): the test must be named by a string"));
    test = args[k++].s();
    if (!known_test(test)) c.fail(str("No test named '", test, "'."));
  }
  const Args test_args(args.begin() + static_cast<ptrdiff_t>(k), args.end());
  List out;
  for (const Value& x : iterate(c, v)) {
    const Value item = by_attr ? attribute_path(c, x, attr) : x;
    const bool pass = test.empty() ? truthy(item) : apply_test(c, test, item, test_args);
    if (pass == keep) out.push_back(x);
  }
  return c.generator(std::move(out));
}

Value map(Ctx& c, const Value& v, const Args& args, const Kwargs& kwargs) {
  List out;
  const List items = iterate(c, v);
  const Value* attr = nullptr;
  const Value* dflt = nullptr;
  for (const auto& [k, x] : kwargs) {
    if (k == "attribute") attr = &x;
    if (k == "default") dflt = &x;
  }
  if (attr) {
    const std::string path = to_string(c, *attr);
    for (const Value& x : items) {
      Value r = attribute_path(c, x, path);
      out.push_back(r.kind == Value::kUndefined && dflt ? *dflt : r);
    }
    return c.generator(std::move(out));
  }
  if (args.empty() || args[0].kind != Value::kString)
    c.fail("map() needs a filter name or attribute=");
  const std::string f = args[0].s();
  if (!known_filter(f)) c.fail(str("No filter named '", f, "'."));
  const Args rest(args.begin() + 1, args.end());
  for (const Value& x : items) out.push_back(apply_filter(c, f, x, rest, kwargs));
  return c.generator(std::move(out));
}

// jinja2's do_indent: lines after the first get the padding (blank ones only with `blank`),
// the first too with `first`.
std::string indent(Ctx& c, const std::string& s, const std::string& pad, bool first, bool blank) {
  std::vector<std::string> lines;
  size_t at = 0;
  const std::string t = s + "\n";
  for (size_t nl = t.find('\n'); nl != std::string::npos; nl = t.find('\n', at)) {
    lines.push_back(t.substr(at, nl - at));
    at = nl + 1;
  }
  c.check_size(s.size() + lines.size() * pad.size());
  c.charge(lines.size(), s.size() + lines.size() * pad.size());
  std::string r = first ? pad + lines[0] : lines[0];
  for (size_t k = 1; k < lines.size(); ++k) {
    r += '\n';
    if (blank || !lines[k].empty()) r += pad;
    r += lines[k];
  }
  return r;
}

std::string escape_html(const std::string& s) {
  std::string r;
  for (char ch : s) {
    switch (ch) {
      case '&':
        r += "&amp;";
        break;
      case '<':
        r += "&lt;";
        break;
      case '>':
        r += "&gt;";
        break;
      case '"':
        r += "&#34;";
        break;
      case '\'':
        r += "&#39;";
        break;
      default:
        r += ch;
    }
  }
  return r;
}

// Python's int(): from a number, a bool, or a string of digits (or of a float).
Value to_int(Ctx& c, const Value& v, const Value& dflt) {
  if (v.kind == Value::kInt || v.kind == Value::kBool) return Value::integer(v.integral());
  if (v.kind == Value::kFloat) {
    if (!std::isfinite(v.f) || std::fabs(v.f) >= 9.2e18) return dflt;
    return Value::integer(static_cast<int64_t>(v.f));
  }
  if (v.kind != Value::kString) return dflt;
  const std::string s = v.s();
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(s.c_str(), &end, 10);
  if (errno == 0 && end != s.c_str() && *end == '\0') return Value::integer(n);
  const double f = std::strtod(s.c_str(), &end);
  if (end != s.c_str() && *end == '\0' && std::isfinite(f) && std::fabs(f) < 9.2e18)
    return Value::integer(static_cast<int64_t>(f));
  (void)c;
  return dflt;
}

Value length(Ctx& c, const Value& v) {
  switch (v.kind) {
    case Value::kString:
      return Value::integer(static_cast<int64_t>(code_points(v.s())));
    case Value::kList:
      if (v.generator) c.fail("object of type 'generator' has no len()");
      return Value::integer(static_cast<int64_t>(v.list->size()));
    case Value::kDict:
    case Value::kNamespace:
      return Value::integer(static_cast<int64_t>(v.dict->items.size()));
    case Value::kUndefined:
      return Value::integer(0);
    default:
      c.fail(str("object of type '", kind_name(v), "' has no len()"));
  }
}

Value tojson(Ctx& c, const Value& v, const Args& args, const Kwargs& kwargs) {
  Params p(c, "tojson", args, kwargs, {"ensure_ascii", "indent", "separators", "sort_keys"});
  if (p.flag(0, false)) c.fail("tojson(ensure_ascii=True) is not supported");
  if (p.get(2) && p.get(2)->kind != Value::kNone) c.fail("tojson(separators=...) is not supported");
  const Value* ind = p.get(1);
  std::string pad;
  bool has_indent = false;
  if (ind && ind->kind != Value::kNone) {
    has_indent = true;
    if (ind->kind == Value::kString) {
      pad = ind->s();
    } else {
      const int64_t n = p.integer(1, 0);
      if (n > 1024) c.fail("tojson(indent=) of more than 1024 spaces");
      pad.assign(static_cast<size_t>(std::max<int64_t>(n, 0)), ' ');
    }
  }
  Value x = v;
  if (p.flag(3, false)) {
    // sort_keys: every mapping's keys in order, made iteratively over the value's depth.
    struct Sorter {
      Ctx& c;
      Value operator()(const Value& y) const {
        if (y.kind == Value::kList) {
          List l;
          for (const Value& e : *y.list) l.push_back((*this)(e));
          return c.list(std::move(l), y.tuple);
        }
        if (y.kind != Value::kDict) return y;
        Dict d;
        for (const auto& [k, e] : y.dict->items) d.items.emplace_back(k, (*this)(e));
        std::sort(d.items.begin(), d.items.end(),
                  [](const auto& a, const auto& b) { return a.first < b.first; });
        return c.dict(std::move(d));
      }
    };
    x = Sorter{c}(v);
  }
  return c.string(to_json(c, x, has_indent ? &pad : nullptr));
}

Value round_filter(Ctx& c, const Value& v, const Params& p) {
  if (!v.numeric()) c.fail(str("round() needs a number, not ", kind_name(v)));
  const int64_t digits = p.integer(0, 0);
  const std::string method = p.string(1, "common");
  if (method == "common" && v.kind != Value::kFloat && digits >= 0)
    return Value::integer(v.integral());  // Python's round of an int is the int
  const double scale = std::pow(10.0, static_cast<double>(std::clamp<int64_t>(digits, -300, 300)));
  const double x = v.number() * scale;
  double r;
  if (method == "common")
    r = std::nearbyint(x);  // Python's round: half to even
  else if (method == "ceil")
    r = std::ceil(x);
  else if (method == "floor")
    r = std::floor(x);
  else
    c.fail("method must be common, ceil or floor");
  return Value::real(r / scale);
}

}  // namespace

Value apply_filter(Ctx& c, const std::string& f, const Value& v, const Args& args,
                   const Kwargs& kwargs) {
  c.charge();
  auto text = [&]() -> std::string { return v.kind == Value::kString ? v.s() : to_string(c, v); };
  if (f == "tojson") return tojson(c, v, args, kwargs);
  if (f == "safe") return v;
  if (f == "string") return c.string(to_string(c, v));
  if (f == "e" || f == "escape") return c.string(escape_html(text()));
  if (f == "default" || f == "d") {
    Params p(c, f, args, kwargs, {"default_value", "boolean"});
    const bool use = v.kind == Value::kUndefined || (p.flag(1, false) && !truthy(v));
    if (!use) return v;
    return p.get(0) ? *p.get(0) : c.string("");
  }
  if (f == "length" || f == "count") return length(c, v);
  if (f == "list") return c.list(iterate(c, v));
  if (f == "items") {
    if (v.kind == Value::kUndefined) return c.generator({});
    if (v.kind != Value::kDict)
      c.fail(str("can only get item pairs from a mapping, not ", kind_name(v)));
    return c.generator(*call_method(c, v, "items", {}, {}).list);
  }
  if (f == "first" || f == "last") {
    const List items = iterate(c, v);
    if (items.empty()) return Value::undefined(str("No ", f, " item, sequence was empty."));
    return f == "first" ? items.front() : items.back();
  }
  if (f == "reverse") {
    if (v.kind == Value::kString) {
      const std::vector<size_t> at = code_point_offsets(v.s());
      std::string r;
      for (size_t k = at.size() - 1; k > 0; --k) r.append(v.s(), at[k - 1], at[k] - at[k - 1]);
      return c.string(std::move(r));
    }
    List items = iterate(c, v);
    std::reverse(items.begin(), items.end());
    return c.generator(std::move(items));
  }
  if (f == "join") {
    Params p(c, f, args, kwargs, {"d", "attribute"});
    const std::string sep = p.string(0, "");
    const std::string attr = p.string(1, "");
    std::string r;
    bool first = true;
    for (const Value& x : iterate(c, v)) {
      if (!first) r += sep;
      first = false;
      r += to_string(c, attr.empty() ? x : attribute_path(c, x, attr));
      c.check_size(r.size());
      c.charge(1, r.size() / 16);
    }
    return c.string(std::move(r));
  }
  if (f == "trim") {
    Params p(c, f, args, kwargs, {"chars"});
    return call_method(c, c.string(text()), "strip", p.get(0) ? Args{*p.get(0)} : Args{}, {});
  }
  if (f == "upper" || f == "lower" || f == "capitalize" || f == "title")
    return call_method(c, c.string(text()), f, {}, {});
  if (f == "replace") {
    Params p(c, f, args, kwargs, {"old", "new", "count"});
    if (!p.get(0) || !p.get(1)) c.fail("replace() needs the old and the new string");
    return c.string(
        str_replace(c, text(), to_string(c, *p.get(0)), to_string(c, *p.get(1)), p.integer(2, -1)));
  }
  if (f == "format") return c.string(percent_format(c, text(), c.list(args, true)));
  if (f == "indent") {
    Params p(c, f, args, kwargs, {"width", "first", "blank"});
    std::string pad;
    if (p.get(0) && p.get(0)->kind == Value::kString) {
      pad = p.get(0)->s();
    } else {
      const int64_t n = p.integer(0, 4);
      if (n > 1024) c.fail("indent() of more than 1024 spaces");
      pad.assign(static_cast<size_t>(std::max<int64_t>(n, 0)), ' ');
    }
    return c.string(indent(c, text(), pad, p.flag(1, false), p.flag(2, false)));
  }
  if (f == "center") {
    Params p(c, f, args, kwargs, {"width"});
    const std::string s = text();
    const int64_t w = std::min<int64_t>(p.integer(0, 80), 1 << 20);
    const int64_t n = static_cast<int64_t>(code_points(s));
    if (w <= n) return c.string(s);
    const int64_t left = (w - n) / 2 + ((w - n) & w & 1);
    return c.string(std::string(left, ' ') + s + std::string(w - n - left, ' '));
  }
  if (f == "wordcount") {
    const std::string s = text();
    int64_t n = 0;
    bool in = false;
    for (unsigned char ch : s) {
      const bool word = std::isalnum(ch) || ch == '_' || ch >= 0x80;
      n += word && !in;
      in = word;
    }
    return Value::integer(n);
  }
  if (f == "int") {
    Params p(c, f, args, kwargs, {"default", "base"});
    return to_int(c, v, p.get(0) ? *p.get(0) : Value::integer(0));
  }
  if (f == "float") {
    Params p(c, f, args, kwargs, {"default"});
    if (v.numeric()) return Value::real(v.number());
    if (v.kind == Value::kString) {
      char* end = nullptr;
      const double x = std::strtod(v.s().c_str(), &end);
      if (end != v.s().c_str() && *end == '\0') return Value::real(x);
    }
    return p.get(0) ? *p.get(0) : Value::real(0);
  }
  if (f == "abs") {
    if (v.kind == Value::kFloat) return Value::real(std::fabs(v.f));
    if (!v.numeric()) c.fail(str("bad operand type for abs(): '", kind_name(v), "'"));
    return v.integral() < 0 ? negate(c, v) : Value::integer(v.integral());
  }
  if (f == "round") return round_filter(c, v, Params(c, f, args, kwargs, {"precision", "method"}));
  if (f == "sum") {
    Params p(c, f, args, kwargs, {"attribute", "start"});
    Value total = p.get(1) ? *p.get(1) : Value::integer(0);
    const std::string attr = p.string(0, "");
    for (const Value& x : iterate(c, v))
      total = binary_op(c, "+", total, attr.empty() ? x : attribute_path(c, x, attr));
    return total;
  }
  if (f == "max" || f == "min" || f == "sort" || f == "unique" || f == "dictsort") {
    if (f == "dictsort") {
      Params p(c, f, args, kwargs, {"case_sensitive", "by", "reverse"});
      if (v.kind != Value::kDict) c.fail(str("dictsort needs a mapping, not ", kind_name(v)));
      const bool by_value = p.string(1, "key") == "value";
      List pairs = call_method(c, v, "items", {}, {}).list
                       ? *call_method(c, v, "items", {}, {}).list
                       : List{};
      return c.list(
          sorted(c, std::move(pairs), p.flag(2, false), p.flag(0, false), by_value ? "1" : "0"));
    }
    const bool sort = f == "sort";
    Params p(c, f, args, kwargs,
             sort ? std::vector<std::string>{"reverse", "case_sensitive", "attribute"}
                  : std::vector<std::string>{"case_sensitive", "attribute"});
    const bool cs = p.flag(sort ? 1 : 0, false);
    const std::string attr = p.string(sort ? 2 : 1, "");
    List items = iterate(c, v);
    if (f == "unique") {
      List out, keys;
      for (const Value& x : items) {
        Value k = attr.empty() ? x : attribute_path(c, x, attr);
        if (!cs) k = lowered(c, k);
        c.charge(keys.size());
        if (std::none_of(keys.begin(), keys.end(), [&](const Value& y) { return equal(y, k); })) {
          keys.push_back(k);
          out.push_back(x);
        }
      }
      return c.generator(std::move(out));
    }
    items = sorted(c, std::move(items), sort && p.flag(0, false), cs, attr);
    if (sort) return c.list(std::move(items));
    if (items.empty()) return Value::undefined(str("No aggregated item, sequence was empty."));
    return f == "min" ? items.front() : items.back();
  }
  if (f == "batch" || f == "slice") {
    Params p(c, f, args, kwargs, {f == "batch" ? "linecount" : "slices", "fill_with"});
    const int64_t n = p.integer(0, 0);
    if (n <= 0) c.fail(str(f, "() needs a positive count"));
    const Value* fill = p.get(1);
    const List items = iterate(c, v);
    List out;
    if (f == "batch") {
      for (size_t k = 0; k < items.size(); k += static_cast<size_t>(n)) {
        List row(items.begin() + static_cast<ptrdiff_t>(k),
                 items.begin() + static_cast<ptrdiff_t>(std::min(items.size(), k + n)));
        while (fill && static_cast<int64_t>(row.size()) < n) row.push_back(*fill);
        out.push_back(c.list(std::move(row)));
      }
    } else {  // jinja2's do_slice: n columns, the first len % n of them one longer
      const size_t len = items.size(), per = len / n, extra = len % n;
      size_t offset = 0;
      for (int64_t k = 0; k < n; ++k) {
        c.charge();
        const size_t start = offset + k * per;
        if (static_cast<size_t>(k) < extra) ++offset;
        const size_t end = offset + (k + 1) * per;
        List row(items.begin() + static_cast<ptrdiff_t>(start),
                 items.begin() + static_cast<ptrdiff_t>(end));
        if (fill && static_cast<size_t>(k) >= extra) row.push_back(*fill);
        out.push_back(c.list(std::move(row)));
      }
    }
    return c.generator(std::move(out));
  }
  if (f == "select" || f == "reject" || f == "selectattr" || f == "rejectattr") {
    if (!kwargs.empty()) c.fail(str(f, "() takes no keyword arguments"));
    return select(c, f, v, args);
  }
  if (f == "map") return map(c, v, args, kwargs);
  if (f == "attr") {
    if (args.size() != 1 || args[0].kind != Value::kString) c.fail("attr() needs a name");
    return attribute(c, v, args[0].s());
  }
  c.fail(str("No filter named '", f, "'."));
}

bool apply_test(Ctx& c, const std::string& t, const Value& v, const Args& args) {
  c.charge();
  auto arg = [&]() -> const Value& {
    if (args.empty()) c.fail(str("test ", t, " needs an argument"));
    return args[0];
  };
  if (t == "defined") return v.kind != Value::kUndefined;
  if (t == "undefined") return v.kind == Value::kUndefined;
  if (t == "none") return v.kind == Value::kNone;
  if (t == "boolean") return v.kind == Value::kBool;
  if (t == "true") return v.kind == Value::kBool && v.b;
  if (t == "false") return v.kind == Value::kBool && !v.b;
  if (t == "integer") return v.kind == Value::kInt;
  if (t == "float") return v.kind == Value::kFloat;
  if (t == "number") return v.numeric();
  if (t == "string") return v.kind == Value::kString;
  if (t == "mapping") return v.kind == Value::kDict;
  if (t == "iterable")
    return v.kind == Value::kList || v.kind == Value::kString || v.kind == Value::kDict ||
           v.kind == Value::kUndefined;
  if (t == "sequence")
    return v.kind == Value::kList || v.kind == Value::kString || v.kind == Value::kDict;
  if (t == "callable") return v.kind == Value::kCallable;
  if (t == "escaped") return false;
  if (t == "lower" || t == "upper") {
    if (v.kind != Value::kString) return false;
    // Python's islower / isupper: some cased character, none of the other case.
    bool cased = false, other = false;
    for (unsigned char ch : v.s()) {
      cased = cased || (t == "lower" ? std::islower(ch) : std::isupper(ch));
      other = other || (t == "lower" ? std::isupper(ch) : std::islower(ch));
    }
    return cased && !other;
  }
  if (t == "odd" || t == "even" || t == "divisibleby") {
    if (v.kind != Value::kInt && v.kind != Value::kBool)
      c.fail(str("test ", t, " needs an integer, not ", kind_name(v)));
    const int64_t d = t == "divisibleby" ? arg().integral() : 2;
    if (d == 0) c.fail("integer division or modulo by zero");
    const bool divisible = v.integral() % d == 0;
    return t == "odd" ? !divisible : divisible;
  }
  if (t == "eq" || t == "equalto" || t == "==") return equal(v, arg());
  if (t == "ne" || t == "!=") return !equal(v, arg());
  if (t == "sameas")
    return v.kind == arg().kind &&
           (v.is_container() ? v.dict == arg().dict && v.list == arg().list : equal(v, arg()));
  if (t == "gt" || t == "greaterthan" || t == ">") return compare(c, v, arg(), ">") > 0;
  if (t == "ge" || t == ">=") return compare(c, v, arg(), ">=") >= 0;
  if (t == "lt" || t == "lessthan" || t == "<") return compare(c, v, arg(), "<") < 0;
  if (t == "le" || t == "<=") return compare(c, v, arg(), "<=") <= 0;
  if (t == "in") return truthy(binary_op(c, "in", v, arg()));
  if (t == "filter") return v.kind == Value::kString && known_filter(v.s());
  if (t == "test") return v.kind == Value::kString && known_test(v.s());
  c.fail(str("No test named '", t, "'."));
}

bool is_global(const std::string& n) {
  return n == "raise_exception" || n == "strftime_now" || n == "range" || n == "namespace" ||
         n == "dict";
}

Value call_global(Ctx& c, const std::string& n, const Args& args, const Kwargs& kwargs) {
  c.charge();
  if (n == "raise_exception")
    c.fail(str("the template raised: ", args.empty() ? std::string() : to_string(c, args[0])));
  if (n == "strftime_now") {
    if (args.size() != 1 || args[0].kind != Value::kString)
      c.fail("strftime_now() needs one format string");
    const Options& o = c.options();
    std::tm tm{};
    tm.tm_year = o.year - 1900;
    tm.tm_mon = o.month - 1;
    tm.tm_mday = o.day;
    tm.tm_hour = o.hour;
    tm.tm_min = o.minute;
    tm.tm_sec = o.second;
    tm.tm_isdst = 0;
    std::tm norm = tm;
    timegm(&norm);  // fills the weekday and the day of the year
    const std::string& fmt = args[0].s();
    c.check_size(fmt.size() * 16 + 64);
    std::string buf(fmt.size() * 16 + 64, '\0');
    const size_t len = fmt.empty() ? 0 : std::strftime(buf.data(), buf.size(), fmt.c_str(), &norm);
    buf.resize(len);
    return c.string(std::move(buf));
  }
  if (n == "range") {
    for (const Value& a : args)
      if (a.kind != Value::kInt && a.kind != Value::kBool)
        c.fail(str("'", kind_name(a), "' object cannot be interpreted as an integer"));
    if (args.empty() || args.size() > 3)
      c.fail(str("range expected 1 to 3 arguments, got ", args.size()));
    const int64_t start = args.size() > 1 ? args[0].integral() : 0;
    const int64_t stop = args.size() > 1 ? args[1].integral() : args[0].integral();
    const int64_t step = args.size() > 2 ? args[2].integral() : 1;
    if (step == 0) c.fail("range() arg 3 must not be zero");
    // jinja2's sandbox refuses ranges over MAX_RANGE items.
    const long double count = step > 0 ? (static_cast<long double>(stop) - start) / step
                                       : (static_cast<long double>(start) - stop) / -step;
    if (count > 100000)
      c.fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    List l;
    for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
      c.charge();
      l.push_back(Value::integer(k));
    }
    return c.list(std::move(l));
  }
  // namespace and dict: keyword arguments, or one mapping.
  Dict d;
  if (args.size() > 1) c.fail(str(n, "() takes at most one positional argument"));
  if (!args.empty()) {
    if (args[0].kind != Value::kDict && args[0].kind != Value::kNamespace)
      c.fail(str(n, "(): the positional argument must be a mapping"));
    d.items = args[0].dict->items;
  }
  for (const auto& [k, v] : kwargs) {
    if (n == "namespace" && !k.empty() && k[0] == '_')
      c.fail(
          str("Chat templates cannot store underscore-prefixed attributes on a namespace, but "
              "got '",
              k, "'. Please rename the attribute."));
    if (Value* f = d.find(k))
      *f = v;
    else
      d.items.emplace_back(k, v);
  }
  return n == "namespace" ? c.ns(std::move(d)) : c.dict(std::move(d));
}

}  // namespace fuyou::jinja
