// The chat-template subset of Jinja (src/formats/jinja.h): a lexer that splits the template
// into text and tags with Jinja's whitespace rules (trim_blocks, lstrip_blocks and the "-"
// markers, as transformers configures its environment), a recursive-descent parser with
// Jinja's operator precedence, and a tree-walking renderer over JSON-like values.
#include "src/formats/jinja.h"

#include <algorithm>
#include <cctype>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <functional>

#include "fuyou/error.h"

namespace fuyou::jinja {
namespace {

// ---- values -----------------------------------------------------------------------------

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // in insertion order

struct Value {
  enum Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict } kind = kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;

  static Value none() { return with(kNone); }
  static Value boolean(bool v) {
    Value x = with(kBool);
    x.b = v;
    return x;
  }
  static Value integer(int64_t v) {
    Value x = with(kInt);
    x.i = v;
    return x;
  }
  static Value real(double v) {
    Value x = with(kFloat);
    x.f = v;
    return x;
  }
  static Value string(std::string v) {
    Value x = with(kString);
    x.s = std::move(v);
    return x;
  }
  static Value make_list(List v) {
    Value x = with(kList);
    x.list = std::make_shared<List>(std::move(v));
    return x;
  }
  static Value make_dict(Dict v) {
    Value x = with(kDict);
    x.dict = std::make_shared<Dict>(std::move(v));
    return x;
  }
  static Value with(Kind k) {
    Value x;
    x.kind = k;
    return x;
  }

  bool numeric() const { return kind == kInt || kind == kFloat || kind == kBool; }
  double number() const { return kind == kFloat ? f : kind == kBool ? b : static_cast<double>(i); }
  const Value* find(const std::string& key) const {
    if (kind != kDict) return nullptr;
    for (const auto& [k, v] : *dict)
      if (k == key) return &v;
    return nullptr;
  }
};

const char* kind_name(const Value& v) {
  static const char* names[] = {"undefined", "none",   "boolean", "integer",
                                "float",     "string", "list",    "mapping"};
  return names[v.kind];
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
      return !v.s.empty();
    case Value::kList:
      return !v.list->empty();
    case Value::kDict:
      return !v.dict->empty();
  }
  return false;
}

std::string to_string(const Value& v);

std::string repr(const Value& v) {
  if (v.kind == Value::kString) return "'" + v.s + "'";
  return to_string(v);
}

// What {{ v }} prints: Python's str() of the value (None, True, [1, 'a'], {'k': 'v'}).
std::string to_string(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined:
      return "";
    case Value::kNone:
      return "None";
    case Value::kBool:
      return v.b ? "True" : "False";
    case Value::kInt:
      return std::to_string(v.i);
    case Value::kFloat: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.17g", v.f);
      std::string s = buf;
      if (s.find_first_of(".e") == std::string::npos) s += ".0";
      return s;
    }
    case Value::kString:
      return v.s;
    case Value::kList: {
      std::string s = "[";
      for (size_t k = 0; k < v.list->size(); ++k) s += (k ? ", " : "") + repr((*v.list)[k]);
      return s + "]";
    }
    case Value::kDict: {
      std::string s = "{";
      for (size_t k = 0; k < v.dict->size(); ++k)
        s += (k ? ", '" : "'") + (*v.dict)[k].first + "': " + repr((*v.dict)[k].second);
      return s + "}";
    }
  }
  return "";
}

bool equal(const Value& a, const Value& b) {
  if (a.numeric() && b.numeric()) return a.number() == b.number();
  if (a.kind != b.kind)
    return (a.kind == Value::kNone || a.kind == Value::kUndefined) &&
           (b.kind == Value::kNone || b.kind == Value::kUndefined) && a.kind == b.kind;
  switch (a.kind) {
    case Value::kString:
      return a.s == b.s;
    case Value::kList:
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equal((*a.list)[k], (*b.list)[k])) return false;
      return true;
    case Value::kDict:
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [k, v] : *a.dict) {
        const Value* o = b.find(k);
        if (!o || !equal(v, *o)) return false;
      }
      return true;
    default:
      return true;  // none == none, undefined == undefined
  }
}

Value from_json(const nlohmann::json& j) {
  if (j.is_null()) return Value::none();
  if (j.is_boolean()) return Value::boolean(j.get<bool>());
  if (j.is_number_integer()) return Value::integer(j.get<int64_t>());
  if (j.is_number()) return Value::real(j.get<double>());
  if (j.is_string()) return Value::string(j.get<std::string>());
  if (j.is_array()) {
    List l;
    for (const auto& x : j) l.push_back(from_json(x));
    return Value::make_list(std::move(l));
  }
  Dict d;
  for (auto it = j.begin(); it != j.end(); ++it) d.emplace_back(it.key(), from_json(it.value()));
  return Value::make_dict(std::move(d));
}

// ---- expressions -------------------------------------------------------------------------

struct Expr;
using ExprP = std::unique_ptr<Expr>;

struct Expr {
  enum Kind {
    kLiteral,
    kName,
    kAttr,
    kIndex,
    kSlice,
    kCall,
    kFilter,
    kTest,
    kNot,
    kNeg,
    kBinary,
    kCond,
    kList
  } kind;
  Value value;       // kLiteral
  std::string name;  // kName, kAttr, kFilter, kTest, kBinary (operator), kCall of a name/method
  std::vector<ExprP> args;  // operands; kCall: args[0] is the callee, the rest its arguments
  bool negated = false;     // kTest: "is not"
  int line = 0;
};

struct Tok {
  enum Kind { kName, kString, kInt, kFloat, kOp, kEnd } kind;
  std::string text;
};

// Splits a tag's inside into tokens.
std::vector<Tok> lex_expr(const std::string& s,
                          const std::function<void(const std::string&)>& fail) {
  std::vector<Tok> out;
  size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++i;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      out.push_back({Tok::kName, s.substr(i, j - i)});
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
      bool real =
          j + 1 < s.size() && s[j] == '.' && std::isdigit(static_cast<unsigned char>(s[j + 1]));
      if (real) {
        ++j;
        while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
      }
      out.push_back({real ? Tok::kFloat : Tok::kInt, s.substr(i, j - i)});
      i = j;
    } else if (c == '\'' || c == '"') {
      std::string v;
      size_t j = i + 1;
      for (; j < s.size() && s[j] != c; ++j) {
        if (s[j] != '\\' || j + 1 >= s.size()) {
          v += s[j];
          continue;
        }
        const char e = s[++j];
        switch (e) {
          case 'n':
            v += '\n';
            break;
          case 't':
            v += '\t';
            break;
          case 'r':
            v += '\r';
            break;
          case '\\':
            v += '\\';
            break;
          case '\'':
            v += '\'';
            break;
          case '"':
            v += '"';
            break;
          default:
            v += '\\';
            v += e;  // Python keeps an unknown escape as written
        }
      }
      if (j >= s.size()) fail("a string literal is not closed");
      out.push_back({Tok::kString, v});
      i = j + 1;
    } else {
      static const char* two[] = {"==", "!=", "<=", ">=", "//", "**"};
      std::string op(1, c);
      for (const char* t : two)
        if (s.compare(i, 2, t) == 0) op = t;
      if (std::string("+-*/%~<>()[]{},.:|=!").find(c) == std::string::npos)
        fail(str("unexpected character '", std::string(1, c), "'"));
      if (op == "**") fail("the operator ** is not supported");
      if (op == "!") fail("unexpected character '!'");
      out.push_back({Tok::kOp, op});
      i += op.size();
    }
  }
  out.push_back({Tok::kEnd, ""});
  return out;
}

const std::vector<std::string> kFilters = {"trim",   "length",     "count",  "upper",
                                           "lower",  "capitalize", "first",  "last",
                                           "string", "join",       "default"};
const std::vector<std::string> kTests = {"defined", "undefined", "none", "string", "number",
                                         "mapping", "sequence",  "true", "false"};
const std::vector<std::string> kMethods = {"strip", "lstrip", "rstrip",  "startswith", "endswith",
                                           "upper", "lower",  "replace", "split",      "title",
                                           "get",   "items",  "keys",    "values"};
const std::vector<std::string> kFunctions = {"raise_exception"};

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

bool member(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// Recursive descent over one tag's tokens with Jinja's precedence: conditional, or, and, not,
// comparisons (and in / not in), + -, ~, * / // %, unary -, then primaries with their
// postfixes (.attr, [index], [a:b], calls, | filters, is tests).
class ExprParser {
 public:
  ExprParser(std::vector<Tok> toks, std::function<void(const std::string&)> fail, int line)
      : t_(std::move(toks)), fail_(std::move(fail)), line_(line) {}

  ExprP expression() { return conditional(); }
  // A for tag's iterable: no conditional expression, so that "if" after it is the loop filter.
  ExprP iterable() { return or_expr(); }
  bool at(const std::string& op) const { return t_[p_].kind == Tok::kOp && t_[p_].text == op; }
  bool at_name(const std::string& n) const { return t_[p_].kind == Tok::kName && t_[p_].text == n; }
  bool done() const { return t_[p_].kind == Tok::kEnd; }
  void expect(const std::string& op) {
    if (!at(op)) error(str("expected '", op, "', found '", t_[p_].text, "'"));
    ++p_;
  }
  std::string name() {
    if (t_[p_].kind != Tok::kName) error(str("expected a name, found '", t_[p_].text, "'"));
    return t_[p_++].text;
  }
  void expect_name(const std::string& n) {
    if (!at_name(n)) error(str("expected '", n, "', found '", t_[p_].text, "'"));
    ++p_;
  }
  // fail_ throws (the parser's error naming the template and line).
  [[noreturn]] void error(const std::string& why) const {
    fail_(why);
    throw ConfigError(why);
  }
  void end() {
    if (!done()) error(str("unexpected '", t_[p_].text, "'"));
  }

 private:
  ExprP make(Expr::Kind k, std::string name = "") {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->name = std::move(name);
    e->line = line_;
    return e;
  }
  ExprP binary(const std::string& op, ExprP a, ExprP b) {
    ExprP e = make(Expr::kBinary, op);
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return e;
  }
  ExprP conditional() {
    ExprP a = or_expr();
    if (!at_name("if")) return a;
    ++p_;
    ExprP cond = or_expr();
    ExprP other;
    if (at_name("else")) {
      ++p_;
      other = conditional();
    } else {
      other = make(Expr::kLiteral);  // undefined
    }
    ExprP e = make(Expr::kCond);
    e->args.push_back(std::move(cond));
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(other));
    return e;
  }
  ExprP or_expr() {
    ExprP a = and_expr();
    while (at_name("or")) {
      ++p_;
      a = binary("or", std::move(a), and_expr());
    }
    return a;
  }
  ExprP and_expr() {
    ExprP a = not_expr();
    while (at_name("and")) {
      ++p_;
      a = binary("and", std::move(a), not_expr());
    }
    return a;
  }
  ExprP not_expr() {
    if (!at_name("not")) return compare();
    ++p_;
    Nest nest(this);
    ExprP e = make(Expr::kNot);
    e->args.push_back(not_expr());
    return e;
  }
  ExprP compare() {
    ExprP a = add();
    for (;;) {
      std::string op;
      for (const char* o : {"==", "!=", "<", "<=", ">", ">="})
        if (at(o)) op = o;
      if (!op.empty()) {
        ++p_;
      } else if (at_name("in")) {
        ++p_;
        op = "in";
      } else if (at_name("not") && t_[p_ + 1].kind == Tok::kName && t_[p_ + 1].text == "in") {
        p_ += 2;
        op = "not in";
      } else {
        return a;
      }
      a = binary(op, std::move(a), add());
    }
  }
  ExprP add() {
    ExprP a = concat();
    while (at("+") || at("-")) {
      std::string op = t_[p_++].text;
      a = binary(op, std::move(a), concat());
    }
    return a;
  }
  ExprP concat() {
    ExprP a = mul();
    while (at("~")) {
      ++p_;
      a = binary("~", std::move(a), mul());
    }
    return a;
  }
  ExprP mul() {
    ExprP a = unary();
    while (at("*") || at("/") || at("//") || at("%")) {
      std::string op = t_[p_++].text;
      a = binary(op, std::move(a), unary());
    }
    return a;
  }
  ExprP unary() {
    if (at("-")) {
      ++p_;
      Nest nest(this);
      ExprP e = make(Expr::kNeg);
      e->args.push_back(unary());
      return e;
    }
    if (at("+")) ++p_;
    return postfix(primary());
  }
  ExprP primary() {
    const Tok& t = t_[p_];
    if (t.kind == Tok::kString) {
      ++p_;
      ExprP e = make(Expr::kLiteral);
      e->value = Value::string(t.text);
      // Adjacent string literals join, as in Python.
      while (t_[p_].kind == Tok::kString) e->value.s += t_[p_++].text;
      return e;
    }
    if (t.kind == Tok::kInt || t.kind == Tok::kFloat) {
      ++p_;
      ExprP e = make(Expr::kLiteral);
      if (t.kind == Tok::kInt && t.text.size() > 18)
        error(str("integer literal ", t.text, " is too large"));
      e->value = t.kind == Tok::kInt ? Value::integer(std::stoll(t.text))
                                     : Value::real(std::strtod(t.text.c_str(), nullptr));
      return e;
    }
    if (t.kind == Tok::kName) {
      ++p_;
      ExprP e = make(Expr::kLiteral);
      if (t.text == "true" || t.text == "True")
        e->value = Value::boolean(true);
      else if (t.text == "false" || t.text == "False")
        e->value = Value::boolean(false);
      else if (t.text == "none" || t.text == "None")
        e->value = Value::none();
      else
        e = make(Expr::kName, t.text);
      return e;
    }
    if (at("(")) {
      ++p_;
      Nest nest(this);
      ExprP e = expression();
      expect(")");
      return e;
    }
    if (at("[")) {
      ++p_;
      Nest nest(this);
      ExprP e = make(Expr::kList);
      while (!at("]")) {
        e->args.push_back(expression());
        if (!at("]")) expect(",");
      }
      ++p_;
      return e;
    }
    if (at("{")) error("mapping literals ({...}) are not supported");
    error(str("unexpected '", t.text, "'"));
  }
  std::vector<ExprP> call_args() {
    std::vector<ExprP> args;
    expect("(");
    while (!at(")")) {
      if (t_[p_].kind == Tok::kName && t_[p_ + 1].kind == Tok::kOp && t_[p_ + 1].text == "=")
        error(str("keyword arguments (", t_[p_].text, "=...) are not supported"));
      args.push_back(expression());
      if (!at(")")) expect(",");
    }
    ++p_;
    return args;
  }
  ExprP postfix(ExprP e) {
    for (;;) {
      if (at(".")) {
        ++p_;
        ExprP a = make(Expr::kAttr, name());
        a->args.push_back(std::move(e));
        e = std::move(a);
      } else if (at("[")) {
        ++p_;
        ExprP lo, hi;
        if (!at(":")) lo = expression();
        if (at(":")) {
          ++p_;
          if (!at("]")) hi = expression();
          if (at(":")) error("slices with a step are not supported");
          ExprP s = make(Expr::kSlice);
          s->args.push_back(std::move(e));
          s->args.push_back(lo ? std::move(lo) : nullptr);
          s->args.push_back(hi ? std::move(hi) : nullptr);
          e = std::move(s);
        } else {
          ExprP s = make(Expr::kIndex);
          s->args.push_back(std::move(e));
          s->args.push_back(std::move(lo));
          e = std::move(s);
        }
        expect("]");
      } else if (at("(")) {
        // A call of a function by name or of a method (callee an attribute).
        const bool method = e->kind == Expr::kAttr;
        const std::string fn = e->kind == Expr::kName || method ? e->name : "";
        if (method ? !member(kMethods, fn) : !member(kFunctions, fn))
          error(str("unsupported ", method ? "method" : "function", " '",
                    fn.empty() ? "(expression)" : fn,
                    "' (supported: ", joined(method ? kMethods : kFunctions), ")"));
        ExprP c = make(Expr::kCall, fn);
        c->args.push_back(std::move(e));
        for (auto& a : call_args()) c->args.push_back(std::move(a));
        e = std::move(c);
      } else if (at("|")) {
        ++p_;
        const std::string f = name();
        if (!member(kFilters, f))
          error(str("unsupported filter '", f, "' (supported: ", joined(kFilters), ")"));
        ExprP c = make(Expr::kFilter, f);
        c->args.push_back(std::move(e));
        if (at("("))
          for (auto& a : call_args()) c->args.push_back(std::move(a));
        e = std::move(c);
      } else if (at_name("is")) {
        ++p_;
        bool negated = false;
        if (at_name("not")) {
          ++p_;
          negated = true;
        }
        const std::string test =
            at_name("none") || at_name("true") || at_name("false") ? t_[p_++].text : name();
        if (!member(kTests, test))
          error(str("unsupported test '", test, "' (supported: ", joined(kTests), ")"));
        ExprP c = make(Expr::kTest, test);
        c->negated = negated;
        c->args.push_back(std::move(e));
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  // Nesting of brackets (and of "not" and unary minus), bounded so that a hostile template
  // cannot recurse until the stack runs out.
  struct Nest {
    ExprParser* p;
    explicit Nest(ExprParser* parser) : p(parser) {
      if (++p->depth_ > kMaxNesting)
        p->error(str("expressions nest more than ", kMaxNesting, " deep"));
    }
    ~Nest() { --p->depth_; }
  };
  static constexpr int kMaxNesting = 100;

  std::vector<Tok> t_;
  size_t p_ = 0;
  std::function<void(const std::string&)> fail_;
  int line_;
  int depth_ = 0;
};

}  // namespace

// ---- statements --------------------------------------------------------------------------

struct Node {
  enum Kind { kText, kOutput, kIf, kFor, kSet } kind;
  std::string text;  // kText
  ExprP expr;        // kOutput, kFor (iterable), kSet
  std::vector<std::pair<ExprP, std::vector<std::unique_ptr<Node>>>> branches;  // kIf (null: else)
  std::vector<std::string> targets;                    // kFor: loop variables; kSet: name
  std::vector<std::unique_ptr<Node>> body, otherwise;  // kFor
  int line = 0;
};

namespace {

// One piece of the template: text, or a tag's inside with its kind.
struct Piece {
  enum Kind { kText, kExpr, kStmt } kind;
  std::string text;
  int line;
};

// Jinja's lexer rules as transformers configures them: "-" strips all whitespace beside the
// tag, lstrip_blocks strips spaces and tabs from the start of a line up to a block tag or a
// comment ("+" keeps them), trim_blocks drops the first newline after one ("+" keeps it), and
// a single trailing newline of the template is dropped (keep_trailing_newline false).
std::vector<Piece> split_template(std::string src, const std::string& name) {
  if (!src.empty() && src.back() == '\n') src.pop_back();
  std::vector<Piece> out;
  size_t i = 0;
  int line = 1;
  bool trim_next_newline = false, strip_next_ws = false;
  auto add_text = [&](std::string text) {
    if (strip_next_ws) {
      size_t k = text.find_first_not_of(" \t\r\n");
      text = k == std::string::npos ? "" : text.substr(k);
    } else if (trim_next_newline && !text.empty() && text[0] == '\n') {
      text.erase(0, 1);
    }
    strip_next_ws = trim_next_newline = false;
    out.push_back({Piece::kText, std::move(text), line});
  };
  while (i < src.size()) {
    size_t open = src.find('{', i);
    while (open != std::string::npos && open + 1 < src.size() &&
           std::string("{%#").find(src[open + 1]) == std::string::npos)
      open = src.find('{', open + 1);
    if (open == std::string::npos || open + 1 >= src.size()) {
      add_text(src.substr(i));
      break;
    }
    const char kind = src[open + 1];
    std::string text = src.substr(i, open - i);
    const bool minus = open + 2 < src.size() && src[open + 2] == '-';
    const bool plus = open + 2 < src.size() && src[open + 2] == '+';
    if (minus) {
      size_t k = text.find_last_not_of(" \t\r\n");
      text = k == std::string::npos ? "" : text.substr(0, k + 1);
    } else if (kind != '{' && !plus) {
      // lstrip_blocks: the spaces and tabs between the start of the line and the tag go.
      size_t j = open;
      while (j > i && (src[j - 1] == ' ' || src[j - 1] == '\t')) --j;
      if (j == 0 || src[j - 1] == '\n') text.erase(j - i);
    }
    add_text(text);
    for (char c : src.substr(i, open - i)) line += c == '\n';
    const std::string close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    const size_t body = open + 2 + (minus || plus ? 1 : 0);
    const size_t end = src.find(close, body);
    if (end == std::string::npos)
      throw ConfigError(str(name, ": line ", line, ": '", src.substr(open, 2),
                            "' is not closed by '", close, "'"));
    size_t inner_end = end;
    bool close_minus = false, close_plus = false;
    if (inner_end > body && src[inner_end - 1] == '-')
      close_minus = true, --inner_end;
    else if (inner_end > body && src[inner_end - 1] == '+')
      close_plus = true, --inner_end;
    const std::string inner = src.substr(body, inner_end - body);
    if (kind != '#') out.push_back({kind == '{' ? Piece::kExpr : Piece::kStmt, inner, line});
    for (char c : src.substr(open, end + 2 - open)) line += c == '\n';
    i = end + 2;
    strip_next_ws = close_minus;
    trim_next_newline = kind != '{' && !close_plus;
  }
  return out;
}

class Parser {
 public:
  Parser(std::vector<Piece> pieces, std::string name)
      : pieces_(std::move(pieces)), name_(std::move(name)) {}

  std::vector<std::unique_ptr<Node>> parse() {
    auto body = block({});
    if (pos_ < pieces_.size()) fail(str("unexpected '", first_word(pieces_[pos_].text), "'"));
    return body;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    const int line = pos_ < pieces_.size() ? pieces_[pos_].line
                     : pieces_.empty()     ? 1
                                           : pieces_.back().line;
    throw ConfigError(str(name_, ": line ", line, ": ", why));
  }
  static std::string first_word(const std::string& s) {
    size_t b = s.find_first_not_of(" \t\r\n");
    if (b == std::string::npos) return "";
    size_t e = b;
    while (e < s.size() && (std::isalnum(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
    return s.substr(b, std::max<size_t>(e - b, 1));
  }
  ExprParser expr_parser(const std::string& text, int line) {
    return ExprParser(
        lex_expr(text, [&](const std::string& w) { fail(w); }),
        [this](const std::string& w) { fail(w); }, line);
  }

  // Nodes up to one of the `stops` tags (left unconsumed) or the end.
  std::vector<std::unique_ptr<Node>> block(const std::vector<std::string>& stops) {
    // Tags nest as deep as a template is written; the bound keeps a hostile one from
    // recursing until the stack runs out.
    if (++depth_ > 100) fail("tags nest more than 100 deep");
    struct Leave {
      int& d;
      ~Leave() { --d; }
    } leave{depth_};
    std::vector<std::unique_ptr<Node>> out;
    while (pos_ < pieces_.size()) {
      const Piece& p = pieces_[pos_];
      if (p.kind == Piece::kText) {
        if (!p.text.empty()) out.push_back(text_node(p.text));
        ++pos_;
        continue;
      }
      if (p.kind == Piece::kExpr) {
        auto n = std::make_unique<Node>();
        n->kind = Node::kOutput;
        n->line = p.line;
        ExprParser ep = expr_parser(p.text, p.line);
        n->expr = ep.expression();
        ep.end();
        out.push_back(std::move(n));
        ++pos_;
        continue;
      }
      const std::string word = first_word(p.text);
      if (member(stops, word)) return out;
      if (word == "if")
        out.push_back(if_node());
      else if (word == "for")
        out.push_back(for_node());
      else if (word == "set")
        out.push_back(set_node());
      else if (word == "endif" || word == "endfor" || word == "elif" || word == "else")
        fail(str("'", word, "' without its opening tag"));
      else
        fail(str("unsupported tag '", word,
                 "' (supported: if, elif, else, endif, for, endfor, set)"));
    }
    if (!stops.empty()) fail(str("missing '", stops.back(), "'"));
    return out;
  }
  static std::unique_ptr<Node> text_node(const std::string& t) {
    auto n = std::make_unique<Node>();
    n->kind = Node::kText;
    n->text = t;
    return n;
  }
  // The tag's words after its keyword.
  std::string rest(const Piece& p, const std::string& word) {
    size_t k = p.text.find(word);
    return p.text.substr(k + word.size());
  }
  std::unique_ptr<Node> if_node() {
    auto n = std::make_unique<Node>();
    n->kind = Node::kIf;
    n->line = pieces_[pos_].line;
    std::string word = "if";
    for (;;) {
      const Piece& p = pieces_[pos_++];
      ExprP cond;
      if (word != "else") {
        ExprParser ep = expr_parser(rest(p, word), p.line);
        cond = ep.expression();
        ep.end();
      }
      auto body = block({"elif", "else", "endif"});
      n->branches.emplace_back(std::move(cond), std::move(body));
      if (pos_ >= pieces_.size()) fail("missing 'endif'");
      word = first_word(pieces_[pos_].text);
      if (word == "endif") {
        ++pos_;
        return n;
      }
      if (n->branches.back().first == nullptr) fail(str("'", word, "' after 'else'"));
    }
  }
  std::unique_ptr<Node> for_node() {
    const Piece& p = pieces_[pos_++];
    auto n = std::make_unique<Node>();
    n->kind = Node::kFor;
    n->line = p.line;
    ExprParser ep = expr_parser(rest(p, "for"), p.line);
    n->targets.push_back(ep.name());
    while (ep.at(",")) {
      ep.expect(",");
      n->targets.push_back(ep.name());
    }
    ep.expect_name("in");
    n->expr = ep.iterable();
    if (ep.at_name("if")) fail("a filtering 'if' in a for tag is not supported");
    if (ep.at_name("recursive")) fail("recursive loops are not supported");
    ep.end();
    n->body = block({"else", "endfor"});
    if (pos_ < pieces_.size() && first_word(pieces_[pos_].text) == "else") {
      ++pos_;
      n->otherwise = block({"endfor"});
    }
    if (pos_ >= pieces_.size()) fail("missing 'endfor'");
    ++pos_;
    return n;
  }
  std::unique_ptr<Node> set_node() {
    const Piece& p = pieces_[pos_++];
    auto n = std::make_unique<Node>();
    n->kind = Node::kSet;
    n->line = p.line;
    ExprParser ep = expr_parser(rest(p, "set"), p.line);
    n->targets.push_back(ep.name());
    if (ep.at(".")) fail("assignments to attributes (namespace objects) are not supported");
    if (!ep.at("=")) fail("block assignments ({% set x %}...{% endset %}) are not supported");
    ep.expect("=");
    n->expr = ep.expression();
    ep.end();
    return n;
  }

  std::vector<Piece> pieces_;
  std::string name_;
  size_t pos_ = 0;
  int depth_ = 0;
};

// ---- rendering ---------------------------------------------------------------------------

// A rendered conversation is kilobytes; the bound stops a template that multiplies strings or
// loops over its own output from taking the machine's memory.
constexpr uint64_t kMaxText = uint64_t(1) << 26;

class Renderer {
 public:
  Renderer(const std::string& name, const nlohmann::json& vars) : name_(name) {
    scopes_.emplace_back();
    if (vars.is_object())
      for (auto it = vars.begin(); it != vars.end(); ++it)
        scopes_.back()[it.key()] = from_json(it.value());
  }
  void run(const std::vector<std::unique_ptr<Node>>& nodes) {
    for (const auto& n : nodes) {
      exec(*n);
      if (out.size() > kMaxText)
        fail(n->line, str("the rendered text is longer than ", kMaxText, " bytes"));
    }
  }
  std::string out;

 private:
  [[noreturn]] void fail(int line, const std::string& why) const {
    throw Error(str(name_, ": line ", line, ": ", why));
  }

  Value lookup(const std::string& n) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto f = it->find(n);
      if (f != it->end()) return f->second;
    }
    return Value();
  }

  void exec(const Node& n) {
    switch (n.kind) {
      case Node::kText:
        out += n.text;
        return;
      case Node::kOutput:
        out += to_string(eval(*n.expr));
        return;
      case Node::kSet:
        scopes_.back()[n.targets[0]] = eval(*n.expr);
        return;
      case Node::kIf:
        for (const auto& [cond, body] : n.branches)
          if (!cond || truthy(eval(*cond))) return run(body);
        return;
      case Node::kFor:
        return exec_for(n);
    }
  }

  void exec_for(const Node& n) {
    Value seq = eval(*n.expr);
    List items;
    if (seq.kind == Value::kList)
      items = *seq.list;
    else if (seq.kind == Value::kDict)
      for (const auto& kv : *seq.dict) items.push_back(Value::string(kv.first));
    else if (seq.kind == Value::kString)
      for (char c : seq.s) items.push_back(Value::string(std::string(1, c)));
    else if (seq.kind != Value::kUndefined && seq.kind != Value::kNone)
      fail(n.line, str("cannot loop over a ", kind_name(seq)));
    if (items.empty()) return run(n.otherwise);
    const int64_t len = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < len; ++k) {
      // Each iteration is a scope of its own: a set inside the loop does not leak out.
      scopes_.emplace_back();
      auto& s = scopes_.back();
      s["loop"] = Value::make_dict({{"index0", Value::integer(k)},
                                    {"index", Value::integer(k + 1)},
                                    {"revindex", Value::integer(len - k)},
                                    {"revindex0", Value::integer(len - k - 1)},
                                    {"first", Value::boolean(k == 0)},
                                    {"last", Value::boolean(k == len - 1)},
                                    {"length", Value::integer(len)}});
      const Value& item = items[k];
      if (n.targets.size() == 1) {
        s[n.targets[0]] = item;
      } else {
        if (item.kind != Value::kList || item.list->size() != n.targets.size())
          fail(n.line, str("cannot unpack a ", kind_name(item), " into ", n.targets.size(),
                           " loop variables"));
        for (size_t t = 0; t < n.targets.size(); ++t) s[n.targets[t]] = (*item.list)[t];
      }
      run(n.body);
      scopes_.pop_back();
    }
  }

  Value eval(const Expr& e) {
    switch (e.kind) {
      case Expr::kLiteral:
        return e.value;
      case Expr::kName:
        return lookup(e.name);
      case Expr::kList: {
        List l;
        for (const auto& a : e.args) l.push_back(eval(*a));
        return Value::make_list(std::move(l));
      }
      case Expr::kAttr: {
        Value v = eval(*e.args[0]);
        const Value* f = v.find(e.name);
        return f ? *f : Value();
      }
      case Expr::kIndex:
        return index(e, eval(*e.args[0]), eval(*e.args[1]));
      case Expr::kSlice:
        return slice(e, eval(*e.args[0]));
      case Expr::kNot:
        return Value::boolean(!truthy(eval(*e.args[0])));
      case Expr::kNeg: {
        Value v = eval(*e.args[0]);
        if (v.kind == Value::kInt) {
          if (v.i == INT64_MIN) fail(e.line, "integer overflow");
          return Value::integer(-v.i);
        }
        if (v.kind == Value::kFloat) return Value::real(-v.f);
        fail(e.line, str("cannot negate a ", kind_name(v)));
      }
      case Expr::kCond:
        return truthy(eval(*e.args[0])) ? eval(*e.args[1]) : eval(*e.args[2]);
      case Expr::kBinary:
        return binary(e);
      case Expr::kTest:
        return Value::boolean(test(e, eval(*e.args[0])) != e.negated);
      case Expr::kFilter:
        return filter(e);
      case Expr::kCall:
        return call(e);
    }
    return Value();
  }

  Value index(const Expr& e, const Value& v, const Value& k) {
    if (v.kind == Value::kDict) {
      if (k.kind != Value::kString) return Value();
      const Value* f = v.find(k.s);
      return f ? *f : Value();
    }
    if ((v.kind == Value::kList || v.kind == Value::kString) && k.kind == Value::kInt) {
      const int64_t n = v.kind == Value::kList ? static_cast<int64_t>(v.list->size())
                                               : static_cast<int64_t>(v.s.size());
      const int64_t at = k.i < 0 ? k.i + n : k.i;
      if (at < 0 || at >= n) return Value();  // undefined, as Jinja's sandbox gives
      return v.kind == Value::kList ? (*v.list)[at] : Value::string(v.s.substr(at, 1));
    }
    if (v.kind == Value::kUndefined)
      fail(e.line, str("cannot index an undefined value with ", repr(k)));
    return Value();
  }

  Value slice(const Expr& e, const Value& v) {
    if (v.kind != Value::kList && v.kind != Value::kString)
      fail(e.line, str("cannot slice a ", kind_name(v)));
    const int64_t n = v.kind == Value::kList ? static_cast<int64_t>(v.list->size())
                                             : static_cast<int64_t>(v.s.size());
    auto bound = [&](const ExprP& x, int64_t dflt) {
      if (!x) return dflt;
      Value b = eval(*x);
      if (b.kind != Value::kInt) fail(e.line, "slice bounds must be integers");
      int64_t k = b.i < 0 ? b.i + n : b.i;
      return std::clamp<int64_t>(k, 0, n);
    };
    const int64_t lo = bound(e.args[1], 0), hi = std::max(lo, bound(e.args[2], n));
    if (v.kind == Value::kString) return Value::string(v.s.substr(lo, hi - lo));
    return Value::make_list(List(v.list->begin() + lo, v.list->begin() + hi));
  }

  Value binary(const Expr& e) {
    const std::string& op = e.name;
    if (op == "and") {
      Value a = eval(*e.args[0]);
      return truthy(a) ? eval(*e.args[1]) : a;
    }
    if (op == "or") {
      Value a = eval(*e.args[0]);
      return truthy(a) ? a : eval(*e.args[1]);
    }
    Value a = eval(*e.args[0]), b = eval(*e.args[1]);
    const auto size = [](const Value& v) {
      return v.kind == Value::kList ? v.list->size() : v.s.size();
    };
    if ((op == "+" || op == "~") && size(a) + size(b) > kMaxText)
      fail(e.line, str("a value longer than ", kMaxText, " bytes or items"));
    if (op == "==") return Value::boolean(equal(a, b));
    if (op == "!=") return Value::boolean(!equal(a, b));
    if (op == "~") return Value::string(to_string(a) + to_string(b));
    if (op == "in" || op == "not in") {
      bool found = false;
      if (b.kind == Value::kString && a.kind == Value::kString)
        found = b.s.find(a.s) != std::string::npos;
      else if (b.kind == Value::kList)
        found = std::any_of(b.list->begin(), b.list->end(),
                            [&](const Value& x) { return equal(x, a); });
      else if (b.kind == Value::kDict)
        found = a.kind == Value::kString && b.find(a.s) != nullptr;
      else
        fail(e.line,
             str("'in' needs a string, list or mapping on its right, not a ", kind_name(b)));
      return Value::boolean(found == (op == "in"));
    }
    if (op == "+" && a.kind == Value::kString && b.kind == Value::kString)
      return Value::string(a.s + b.s);
    if (op == "+" && a.kind == Value::kList && b.kind == Value::kList) {
      List l = *a.list;
      l.insert(l.end(), b.list->begin(), b.list->end());
      return Value::make_list(std::move(l));
    }
    if (op == "*" && a.kind == Value::kString && b.kind == Value::kInt) {
      if (b.i > 0 &&
          a.s.size() * static_cast<uint64_t>(std::min<int64_t>(b.i, kMaxText)) > kMaxText)
        fail(e.line, str("a string of ", a.s.size(), " bytes repeated ", b.i,
                         " times is more than ", kMaxText, " bytes"));
      std::string s;
      for (int64_t k = 0; k < b.i; ++k) s += a.s;
      return Value::string(s);
    }
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      int c;
      if (a.numeric() && b.numeric())
        c = a.number() < b.number() ? -1 : a.number() > b.number();
      else if (a.kind == Value::kString && b.kind == Value::kString)
        c = a.s.compare(b.s);
      else
        fail(e.line, str("cannot compare a ", kind_name(a), " with a ", kind_name(b)));
      return Value::boolean(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
    }
    if (!a.numeric() || !b.numeric())
      fail(e.line,
           str("unsupported operand types for ", op, ": ", kind_name(a), " and ", kind_name(b)));
    const bool ints = a.kind != Value::kFloat && b.kind != Value::kFloat;
    const int64_t x = a.kind == Value::kBool ? a.b : a.i, y = b.kind == Value::kBool ? b.b : b.i;
    if (op == "/") {
      if (b.number() == 0) fail(e.line, "division by zero");
      return Value::real(a.number() / b.number());
    }
    if (op == "//" || op == "%") {
      if (b.number() == 0) fail(e.line, "division by zero");
      if (ints) {
        if (x == INT64_MIN && y == -1) fail(e.line, "integer overflow");
        int64_t q = x / y;
        if ((x % y != 0) && ((x < 0) != (y < 0))) --q;  // Python floors
        return Value::integer(op == "//" ? q : x - q * y);
      }
      const double q = std::floor(a.number() / b.number());
      return Value::real(op == "//" ? q : a.number() - q * b.number());
    }
    if (ints) {
      int64_t r;
      const bool over = op == "+"   ? __builtin_add_overflow(x, y, &r)
                        : op == "-" ? __builtin_sub_overflow(x, y, &r)
                                    : __builtin_mul_overflow(x, y, &r);
      if (over) fail(e.line, str("integer overflow in ", x, " ", op, " ", y));
      return Value::integer(r);
    }
    return Value::real(op == "+"   ? a.number() + b.number()
                       : op == "-" ? a.number() - b.number()
                                   : a.number() * b.number());
  }

  bool test(const Expr& e, const Value& v) {
    const std::string& t = e.name;
    if (t == "defined") return v.kind != Value::kUndefined;
    if (t == "undefined") return v.kind == Value::kUndefined;
    if (t == "none") return v.kind == Value::kNone;
    if (t == "string") return v.kind == Value::kString;
    if (t == "number") return v.kind == Value::kInt || v.kind == Value::kFloat;
    if (t == "mapping") return v.kind == Value::kDict;
    if (t == "sequence")
      return v.kind == Value::kList || v.kind == Value::kString || v.kind == Value::kDict;
    if (t == "true") return v.kind == Value::kBool && v.b;
    return v.kind == Value::kBool && !v.b;  // false
  }

  static std::string strip(const std::string& s, bool left, bool right,
                           const std::string& chars = " \t\n\r\f\v") {
    size_t b = left ? s.find_first_not_of(chars) : 0;
    if (b == std::string::npos) return "";
    size_t e = right ? s.find_last_not_of(chars) + 1 : s.size();
    return s.substr(b, e - b);
  }
  static std::string cased(std::string s,
                           int how) {  // 1 upper, -1 lower (ASCII, as used in templates)
    for (char& c : s)
      c = static_cast<char>(how > 0 ? std::toupper(static_cast<unsigned char>(c))
                                    : std::tolower(static_cast<unsigned char>(c)));
    return s;
  }

  Value filter(const Expr& e) {
    Value v = eval(*e.args[0]);
    const std::string& f = e.name;
    auto need_string = [&] {
      if (v.kind != Value::kString)
        fail(e.line, str("filter ", f, " needs a string, not a ", kind_name(v)));
    };
    if (f == "trim") return need_string(), Value::string(strip(v.s, true, true));
    if (f == "upper") return need_string(), Value::string(cased(v.s, 1));
    if (f == "lower") return need_string(), Value::string(cased(v.s, -1));
    if (f == "capitalize") {
      need_string();
      std::string s = cased(v.s, -1);
      if (!s.empty()) s[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(s[0])));
      return Value::string(s);
    }
    if (f == "string") return Value::string(to_string(v));
    if (f == "default")
      return v.kind == Value::kUndefined
                 ? (e.args.size() > 1 ? eval(*e.args[1]) : Value::string(""))
                 : v;
    if (f == "length" || f == "count") {
      if (v.kind == Value::kString) return Value::integer(static_cast<int64_t>(v.s.size()));
      if (v.kind == Value::kList) return Value::integer(static_cast<int64_t>(v.list->size()));
      if (v.kind == Value::kDict) return Value::integer(static_cast<int64_t>(v.dict->size()));
      fail(e.line, str("filter ", f, " needs a string, list or mapping, not a ", kind_name(v)));
    }
    if (f == "first" || f == "last") {
      if (v.kind != Value::kList)
        fail(e.line, str("filter ", f, " needs a list, not a ", kind_name(v)));
      if (v.list->empty()) return Value();
      return f == "first" ? v.list->front() : v.list->back();
    }
    // join
    if (v.kind != Value::kList) fail(e.line, str("filter join needs a list, not a ", kind_name(v)));
    const std::string sep = e.args.size() > 1 ? to_string(eval(*e.args[1])) : "";
    std::string s;
    for (size_t k = 0; k < v.list->size(); ++k) s += (k ? sep : "") + to_string((*v.list)[k]);
    return Value::string(s);
  }

  Value call(const Expr& e) {
    std::vector<Value> args;
    for (size_t k = 1; k < e.args.size(); ++k) args.push_back(eval(*e.args[k]));
    const Expr& callee = *e.args[0];
    if (callee.kind == Expr::kName) {  // raise_exception, the one function
      throw Error(
          str(name_, ": the template raised: ", args.empty() ? std::string() : to_string(args[0])));
    }
    Value self = eval(*callee.args[0]);
    const std::string& m = e.name;
    auto arg_string = [&](size_t k) {
      if (k >= args.size() || args[k].kind != Value::kString)
        fail(e.line, str(m, "() needs a string argument"));
      return args[k].s;
    };
    if (self.kind == Value::kString) {
      const std::string& s = self.s;
      if (m == "strip" || m == "lstrip" || m == "rstrip") {
        const std::string chars =
            args.empty() || args[0].kind == Value::kNone ? " \t\n\r\f\v" : arg_string(0);
        return Value::string(strip(s, m != "rstrip", m != "lstrip", chars));
      }
      if (m == "startswith") {
        const std::string p = arg_string(0);
        return Value::boolean(s.compare(0, p.size(), p) == 0);
      }
      if (m == "endswith") {
        const std::string p = arg_string(0);
        return Value::boolean(s.size() >= p.size() &&
                              s.compare(s.size() - p.size(), p.size(), p) == 0);
      }
      if (m == "upper") return Value::string(cased(s, 1));
      if (m == "lower") return Value::string(cased(s, -1));
      if (m == "title") {
        std::string t = s;
        bool start = true;
        for (char& c : t) {
          const bool alpha = std::isalpha(static_cast<unsigned char>(c)) != 0;
          c = static_cast<char>(start && alpha ? std::toupper(static_cast<unsigned char>(c))
                                               : std::tolower(static_cast<unsigned char>(c)));
          start = !alpha;
        }
        return Value::string(t);
      }
      if (m == "replace") {
        const std::string from = arg_string(0), to = arg_string(1);
        if (from.empty()) fail(e.line, "replace() of an empty string is not supported");
        std::string r;
        size_t at = 0;
        for (size_t k = s.find(from); k != std::string::npos; k = s.find(from, at)) {
          r += s.substr(at, k - at) + to;
          at = k + from.size();
        }
        return Value::string(r + s.substr(at));
      }
      if (m == "split") {
        List parts;
        if (args.empty() || args[0].kind == Value::kNone) {
          size_t k = 0;
          while ((k = s.find_first_not_of(" \t\n\r\f\v", k)) != std::string::npos) {
            size_t end = s.find_first_of(" \t\n\r\f\v", k);
            parts.push_back(
                Value::string(s.substr(k, end == std::string::npos ? std::string::npos : end - k)));
            k = end;
          }
        } else {
          const std::string sep = arg_string(0);
          if (sep.empty()) fail(e.line, "split() with an empty separator");
          size_t at = 0;
          for (size_t k = s.find(sep); k != std::string::npos; k = s.find(sep, at)) {
            parts.push_back(Value::string(s.substr(at, k - at)));
            at = k + sep.size();
          }
          parts.push_back(Value::string(s.substr(at)));
        }
        return Value::make_list(std::move(parts));
      }
    }
    if (self.kind == Value::kDict) {
      if (m == "get") {
        const Value* f = self.find(arg_string(0));
        return f ? *f : args.size() > 1 ? args[1] : Value::none();
      }
      List l;
      for (const auto& [k, v] : *self.dict) {
        if (m == "keys")
          l.push_back(Value::string(k));
        else if (m == "values")
          l.push_back(v);
        else if (m == "items")
          l.push_back(Value::make_list({Value::string(k), v}));
      }
      if (m == "keys" || m == "values" || m == "items") return Value::make_list(std::move(l));
    }
    fail(e.line, str("a ", kind_name(self), " has no method ", m, "()"));
  }

  std::string name_;
  std::vector<std::map<std::string, Value>> scopes_;
};

}  // namespace

Template::Template(const std::string& source, const std::string& name)
    : name_(name), body_(Parser(split_template(source, name), name).parse()) {}
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

std::string Template::render(const nlohmann::json& vars) const {
  Renderer r(name_, vars);
  r.run(body_);
  return r.out;
}

}  // namespace fuyou::jinja
