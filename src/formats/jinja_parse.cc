// Lexer and parser of chat templates (src/formats/jinja_syntax.h): the template is split into
// text and tags with jinja2's whitespace rules as transformers configures them, each tag's
// inside into tokens, and the tokens parsed by recursive descent with jinja2's precedence.
// Every recursive construct passes through Parser::nest or makes a node through Parser::node,
// which count the depth of tags and expression trees together against Limits::max_depth.
#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "fuyou/error.h"
#include "src/formats/jinja_builtins.h"
#include "src/formats/jinja_syntax.h"

namespace fuyou::jinja {
namespace {

// ---- splitting into text and tags --------------------------------------------------------

struct Piece {
  enum Kind { kText, kExpr, kStmt } kind;
  std::string text;
  int line;
};

int count_lines(const std::string& s, size_t from, size_t to) {
  return static_cast<int>(std::count(s.begin() + from, s.begin() + to, '\n'));
}

// Where a tag opened at `body` closes with `close` ("}}", "%}", "#}"): outside string literals
// for {{ and {%, as jinja2's lexer reads them. npos if it does not.
size_t find_close(const std::string& src, size_t body, const std::string& close) {
  if (close == "#}") return src.find(close, body);
  for (size_t k = body; k + 1 < src.size(); ++k) {
    const char c = src[k];
    if (c == '\'' || c == '"') {
      size_t j = k + 1;
      while (j < src.size() && src[j] != c) j += src[j] == '\\' ? 2 : 1;
      if (j >= src.size()) return std::string::npos;
      k = j;
      continue;
    }
    if (src.compare(k, 2, close) == 0) return k;
    // "-}}" and "-%}" close too; the "-" is seen by the caller.
  }
  return std::string::npos;
}

// jinja2's rules as transformers configures them: "-" strips all whitespace beside the tag,
// lstrip_blocks strips spaces and tabs from the start of a line up to a block tag or a comment
// ("+" keeps them), trim_blocks drops the first newline after one ("+" keeps it), and a single
// trailing newline of the template is dropped (keep_trailing_newline false).
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
    if (!text.empty()) out.push_back({Piece::kText, std::move(text), line});
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
      size_t j = open;
      while (j > i && (src[j - 1] == ' ' || src[j - 1] == '\t')) --j;
      if (j == 0 || src[j - 1] == '\n') text.erase(j - i);
    }
    add_text(std::move(text));
    line += count_lines(src, i, open);
    const std::string close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    const size_t body = open + 2 + (minus || plus ? 1 : 0);
    const size_t end = find_close(src, body, close);
    if (end == std::string::npos)
      throw ConfigError(str(name, ": line ", line, ": '", src.substr(open, 2),
                            "' is not closed by '", close, "'"));
    size_t inner_end = end;
    bool close_minus = false, close_plus = false;
    if (inner_end > body && src[inner_end - 1] == '-')
      close_minus = true, --inner_end;
    else if (inner_end > body && src[inner_end - 1] == '+' && kind != '{')
      close_plus = true, --inner_end;
    if (kind != '#')
      out.push_back(
          {kind == '{' ? Piece::kExpr : Piece::kStmt, src.substr(body, inner_end - body), line});
    line += count_lines(src, open, end + 2);
    i = end + 2;
    strip_next_ws = close_minus;
    trim_next_newline = kind != '{' && !close_plus;
  }
  return out;
}

// ---- tokens ------------------------------------------------------------------------------

struct Tok {
  enum Kind { kName, kString, kInt, kFloat, kOp, kEnd } kind;
  std::string text;
};

template <class Fail>
std::string string_literal(const std::string& s, size_t* i, Fail fail) {
  const char q = s[*i];
  std::string v;
  size_t j = *i + 1;
  for (; j < s.size() && s[j] != q; ++j) {
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
      case '\'':
      case '"':
        v += e;
        break;
      case '\n':
        break;  // a line continuation
      default:
        v += '\\';
        v += e;  // Python keeps an unknown escape as written
    }
  }
  if (j >= s.size()) fail("a string literal is not closed");
  *i = j + 1;
  return v;
}

template <class Fail>
std::vector<Tok> lex_expr(const std::string& s, Fail fail) {
  std::vector<Tok> out;
  size_t i = 0;
  auto is = [&](size_t k, int (*f)(int)) {
    return k < s.size() && f(static_cast<unsigned char>(s[k]));
  };
  while (i < s.size()) {
    const char c = s[i];
    if (is(i, std::isspace)) {
      ++i;
    } else if (is(i, std::isalpha) || c == '_') {
      size_t j = i;
      while (is(j, std::isalnum) || (j < s.size() && s[j] == '_')) ++j;
      out.push_back({Tok::kName, s.substr(i, j - i)});
      i = j;
    } else if (is(i, std::isdigit)) {
      size_t j = i;
      while (is(j, std::isdigit) || (j < s.size() && s[j] == '_')) ++j;
      bool real = j + 1 < s.size() && s[j] == '.' && is(j + 1, std::isdigit);
      if (real) {
        ++j;
        while (is(j, std::isdigit)) ++j;
      }
      if (j < s.size() && (s[j] == 'e' || s[j] == 'E') &&
          (is(j + 1, std::isdigit) ||
           (j + 2 < s.size() && (s[j + 1] == '-' || s[j + 1] == '+') && is(j + 2, std::isdigit)))) {
        real = true;
        j += 2;
        while (is(j, std::isdigit)) ++j;
      }
      std::string t = s.substr(i, j - i);
      t.erase(std::remove(t.begin(), t.end(), '_'), t.end());
      out.push_back({real ? Tok::kFloat : Tok::kInt, t});
      i = j;
    } else if (c == '\'' || c == '"') {
      out.push_back({Tok::kString, string_literal(s, &i, fail)});
    } else {
      static const char* two[] = {"==", "!=", "<=", ">=", "//", "**"};
      std::string op(1, c);
      for (const char* t : two)
        if (s.compare(i, 2, t) == 0) op = t;
      if (std::string("+-*/%~<>()[]{},.:|=!").find(c) == std::string::npos || op == "!")
        fail(str("unexpected character '", std::string(1, c), "'"));
      out.push_back({Tok::kOp, op});
      i += op.size();
    }
  }
  out.push_back({Tok::kEnd, ""});
  return out;
}

// ---- parsing -----------------------------------------------------------------------------

const std::vector<std::string> kFilters = {
    "abs",        "attr",   "batch",      "capitalize", "center",  "count",  "d",      "default",
    "dictsort",   "e",      "escape",     "first",      "float",   "format", "indent", "int",
    "items",      "join",   "last",       "length",     "list",    "lower",  "map",    "max",
    "min",        "reject", "rejectattr", "replace",    "reverse", "round",  "safe",   "select",
    "selectattr", "slice",  "sort",       "string",     "sum",     "title",  "tojson", "trim",
    "unique",     "upper",  "wordcount"};
const std::vector<std::string> kTests = {
    "boolean", "callable", "defined",  "divisibleby", "eq",       "equalto",     "escaped",
    "even",    "false",    "filter",   "float",       "ge",       "greaterthan", "gt",
    "in",      "integer",  "iterable", "le",          "lessthan", "lower",       "lt",
    "mapping", "ne",       "none",     "number",      "odd",      "sameas",      "sequence",
    "string",  "test",     "true",     "undefined",   "upper",    "==",          "!=",
    "<",       "<=",       ">",        ">="};

}  // namespace

bool known_filter(const std::string& n) {
  return std::find(kFilters.begin(), kFilters.end(), n) != kFilters.end();
}
bool known_test(const std::string& n) {
  return std::find(kTests.begin(), kTests.end(), n) != kTests.end();
}

namespace {

class Parser {
 public:
  Parser(std::vector<Piece> pieces, const std::string& name, const Limits& limits)
      : pieces_(std::move(pieces)), name_(name), max_depth_(limits.max_depth) {}

  NodeP parse() {
    NodeP body = block({});
    if (pos_ < pieces_.size()) fail(str("unexpected '", first_word(pieces_[pos_].text), "'"));
    return body;
  }

 private:
  // ---- depth: the one place nesting is counted
  struct Nest {
    Parser* p;
    explicit Nest(Parser* parser) : p(parser) { p->deeper(++p->depth_); }
    ~Nest() { --p->depth_; }
  };
  void deeper(int depth) const {
    if (depth > max_depth_)
      fail(str("the template nests more than ", max_depth_, " deep (the limit max_depth)"));
  }
  // A node over `args`, its depth theirs plus one, counted with the tags around it.
  ExprP node(Expr::Kind k, std::vector<ExprP> args = {}, std::string name = "") {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->name = std::move(name);
    e->line = line_;
    for (const auto& a : args)
      if (a) e->depth = std::max(e->depth, a->depth + 1);
    e->args = std::move(args);
    deeper(depth_ + e->depth);
    return e;
  }
  static std::vector<ExprP> two(ExprP a, ExprP b) {
    std::vector<ExprP> v;
    v.push_back(std::move(a));
    v.push_back(std::move(b));
    return v;
  }
  static std::vector<ExprP> one(ExprP a) {
    std::vector<ExprP> v;
    v.push_back(std::move(a));
    return v;
  }

  [[noreturn]] void fail(const std::string& why) const {
    throw ConfigError(str(name_, ": line ", line_, ": ", why));
  }
  static std::string first_word(const std::string& s) {
    size_t b = s.find_first_not_of(" \t\r\n");
    if (b == std::string::npos) return "";
    size_t e = b;
    while (e < s.size() && (std::isalnum(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
    return s.substr(b, std::max<size_t>(e - b, 1));
  }

  // ---- tokens of the tag being parsed
  void start(const std::string& text) {
    t_ = lex_expr(text, [this](const std::string& w) { fail(w); });
    p_ = 0;
  }
  bool at(const std::string& op) const { return t_[p_].kind == Tok::kOp && t_[p_].text == op; }
  bool at_name(const std::string& n) const { return t_[p_].kind == Tok::kName && t_[p_].text == n; }
  bool done() const { return t_[p_].kind == Tok::kEnd; }
  bool accept(const std::string& op) {
    if (!at(op)) return false;
    ++p_;
    return true;
  }
  bool accept_name(const std::string& n) {
    if (!at_name(n)) return false;
    ++p_;
    return true;
  }
  void expect(const std::string& op) {
    if (!accept(op)) fail(str("expected '", op, "', found '", t_[p_].text, "'"));
  }
  std::string name() {
    if (t_[p_].kind != Tok::kName) fail(str("expected a name, found '", t_[p_].text, "'"));
    return t_[p_++].text;
  }
  void end() {
    if (!done()) fail(str("unexpected '", t_[p_].text, "'"));
  }

  // ---- expressions, by jinja2's precedence (lowest first)
  ExprP expression() {
    Nest nest(this);
    ExprP a = or_expr();
    if (!at_name("if")) return a;
    ++p_;
    std::vector<ExprP> args;
    args.push_back(or_expr());
    args.push_back(std::move(a));
    args.push_back(accept_name("else") ? expression() : nullptr);
    return node(Expr::kCond, std::move(args));
  }
  // A tuple without brackets where jinja2 allows one (set a, b = ...; for's iterable).
  ExprP tuple_or_expression(bool conditional) {
    ExprP a = conditional ? expression() : or_expr();
    if (!at(",")) return a;
    std::vector<ExprP> items;
    items.push_back(std::move(a));
    while (accept(",") && !done() && !at_name("if"))
      items.push_back(conditional ? expression() : or_expr());
    return node(Expr::kTuple, std::move(items));
  }
  ExprP or_expr() {
    ExprP a = and_expr();
    while (accept_name("or")) a = node(Expr::kBinary, two(std::move(a), and_expr()), "or");
    return a;
  }
  ExprP and_expr() {
    ExprP a = not_expr();
    while (accept_name("and")) a = node(Expr::kBinary, two(std::move(a), not_expr()), "and");
    return a;
  }
  ExprP not_expr() {
    if (!accept_name("not")) return compare();
    Nest nest(this);
    return node(Expr::kNot, one(not_expr()));
  }
  ExprP compare() {
    ExprP a = concat();
    for (;;) {
      std::string op;
      for (const char* o : {"==", "!=", "<", "<=", ">", ">="})
        if (at(o)) op = o;
      if (!op.empty()) {
        ++p_;
      } else if (accept_name("in")) {
        op = "in";
      } else if (at_name("not") && t_[p_ + 1].kind == Tok::kName && t_[p_ + 1].text == "in") {
        p_ += 2;
        op = "not in";
      } else {
        return a;
      }
      a = node(Expr::kBinary, two(std::move(a), concat()), op);
    }
  }
  ExprP concat() {
    ExprP a = add();
    while (accept("~")) a = node(Expr::kBinary, two(std::move(a), add()), "~");
    return a;
  }
  ExprP add() {
    ExprP a = mul();
    while (at("+") || at("-")) {
      std::string op = t_[p_++].text;
      a = node(Expr::kBinary, two(std::move(a), mul()), op);
    }
    return a;
  }
  ExprP mul() {
    ExprP a = pow();
    while (at("*") || at("/") || at("//") || at("%")) {
      std::string op = t_[p_++].text;
      a = node(Expr::kBinary, two(std::move(a), pow()), op);
    }
    return a;
  }
  ExprP pow() {
    ExprP a = unary();
    while (accept("**")) a = node(Expr::kBinary, two(std::move(a), unary()), "**");
    return a;
  }
  // As jinja2: "-x|f" is "(-x)|f".
  ExprP unary(bool with_filters = true) {
    Nest nest(this);
    ExprP e;
    if (accept("-"))
      e = node(Expr::kNeg, one(unary(false)));
    else if (accept("+"))
      e = unary(false);
    else
      e = postfix(primary());
    return with_filters ? postfix_filters(std::move(e)) : std::move(e);
  }
  ExprP primary() {
    const Tok t = t_[p_];
    if (t.kind == Tok::kString) {
      ++p_;
      ExprP e = node(Expr::kLiteral);
      std::string s = t.text;
      while (t_[p_].kind == Tok::kString) s += t_[p_++].text;  // adjacent literals join
      e->value.kind = Value::kString;
      e->value.bytes = s.size();
      e->value.str = std::make_shared<const std::string>(std::move(s));
      return e;
    }
    if (t.kind == Tok::kInt || t.kind == Tok::kFloat) {
      ++p_;
      ExprP e = node(Expr::kLiteral);
      if (t.kind == Tok::kInt && t.text.size() > 18)
        fail(str("integer literal ", t.text, " is too large"));
      e->value = t.kind == Tok::kInt ? Value::integer(std::stoll(t.text))
                                     : Value::real(std::strtod(t.text.c_str(), nullptr));
      return e;
    }
    if (t.kind == Tok::kName) {
      ++p_;
      ExprP e = node(Expr::kLiteral);
      if (t.text == "true" || t.text == "True")
        e->value = Value::boolean(true);
      else if (t.text == "false" || t.text == "False")
        e->value = Value::boolean(false);
      else if (t.text == "none" || t.text == "None")
        e->value = Value::none();
      else
        e = node(Expr::kName, {}, t.text);
      return e;
    }
    if (accept("(")) {
      if (accept(")")) return node(Expr::kTuple);
      ExprP e = expression();
      if (at(",")) {
        std::vector<ExprP> items;
        items.push_back(std::move(e));
        while (accept(",") && !at(")")) items.push_back(expression());
        e = node(Expr::kTuple, std::move(items));
      }
      expect(")");
      return e;
    }
    if (accept("[")) {
      std::vector<ExprP> items;
      while (!accept("]")) {
        items.push_back(expression());
        if (!at("]")) expect(",");
      }
      return node(Expr::kList, std::move(items));
    }
    if (accept("{")) {
      std::vector<ExprP> items;
      while (!accept("}")) {
        items.push_back(expression());
        expect(":");
        items.push_back(expression());
        if (!at("}")) expect(",");
      }
      return node(Expr::kDict, std::move(items));
    }
    fail(t.kind == Tok::kEnd ? "unexpected end of the tag" : str("unexpected '", t.text, "'"));
  }
  // (args, name=value...) after the "(".
  void call_args(std::vector<ExprP>* args, KwArgs* kwargs) {
    while (!accept(")")) {
      if (t_[p_].kind == Tok::kName && t_[p_ + 1].kind == Tok::kOp && t_[p_ + 1].text == "=") {
        std::string k = t_[p_].text;
        p_ += 2;
        kwargs->emplace_back(std::move(k), expression());
      } else {
        if (!kwargs->empty()) fail("a positional argument follows a keyword argument");
        args->push_back(expression());
      }
      if (!at(")")) expect(",");
    }
  }
  ExprP postfix(ExprP e) {
    for (;;) {
      if (accept(".")) {
        std::string n = t_[p_].kind == Tok::kInt ? t_[p_++].text : name();
        e = node(Expr::kAttr, one(std::move(e)), n);
      } else if (accept("[")) {
        std::vector<ExprP> parts(1);
        bool slice = false;
        for (int k = 0; k < 3; ++k) {
          parts.push_back(at(":") || at("]") ? nullptr : expression());
          if (!accept(":")) break;
          slice = true;
          if (k == 2) fail("a slice has at most three parts");
        }
        expect("]");
        parts[0] = std::move(e);
        if (slice) {
          parts.resize(4);
          e = node(Expr::kSlice, std::move(parts));
        } else {
          if (!parts[1]) fail("expected a subscript");
          parts.resize(2);
          e = node(Expr::kIndex, std::move(parts));
        }
      } else if (accept("(")) {
        std::vector<ExprP> args = one(std::move(e));
        KwArgs kwargs;
        call_args(&args, &kwargs);
        e = node(Expr::kCall, std::move(args));
        e->kwargs = std::move(kwargs);
      } else {
        return e;
      }
    }
  }
  // | filters and "is" tests, which bind to the unary expression before them.
  ExprP postfix_filters(ExprP e) {
    for (;;) {
      if (accept("|")) {
        std::string f = name();
        while (accept(".")) f += "." + name();
        if (!known_filter(f)) fail(str("no filter named '", f, "'"));
        std::vector<ExprP> args = one(std::move(e));
        KwArgs kwargs;
        if (accept("(")) call_args(&args, &kwargs);
        e = node(Expr::kFilter, std::move(args), f);
        e->kwargs = std::move(kwargs);
      } else if (accept_name("is")) {
        const bool negated = accept_name("not");
        std::string t = t_[p_].kind == Tok::kName ? t_[p_++].text : "";
        if (t.empty() && t_[p_].kind == Tok::kOp) t = t_[p_++].text;
        if (!known_test(t)) fail(str("no test named '", t, "'"));
        std::vector<ExprP> args = one(std::move(e));
        KwArgs kwargs;
        if (accept("(")) {
          call_args(&args, &kwargs);
        } else if (t_[p_].kind == Tok::kString || t_[p_].kind == Tok::kInt ||
                   t_[p_].kind == Tok::kFloat || at("[") || at("(") ||
                   (t_[p_].kind == Tok::kName && !at_name("and") && !at_name("or") &&
                    !at_name("else") && !at_name("if") && !at_name("is") && !at_name("in") &&
                    !at_name("not"))) {
          args.push_back(postfix(primary()));  // "is divisibleby 3", "is sameas false"
        }
        e = node(Expr::kTest, std::move(args), t);
        e->negated = negated;
      } else {
        return e;
      }
    }
  }

  // ---- statements
  Piece& piece() { return pieces_[pos_]; }
  // Nodes up to one of the `stops` tags (left unconsumed) or the end.
  NodeP block(const std::vector<std::string>& stops) {
    Nest nest(this);
    auto body = std::make_unique<Node>();
    body->kind = Node::kBody;
    while (pos_ < pieces_.size()) {
      const Piece& p = piece();
      line_ = p.line;
      if (p.kind == Piece::kText) {
        auto n = std::make_unique<Node>();
        n->kind = Node::kText;
        n->text = p.text;
        body->children.push_back(std::move(n));
        ++pos_;
        continue;
      }
      if (p.kind == Piece::kExpr) {
        auto n = leaf(Node::kOutput);
        start(p.text);
        n->expr = expression();
        end();
        body->children.push_back(std::move(n));
        ++pos_;
        continue;
      }
      const std::string word = first_word(p.text);
      if (std::find(stops.begin(), stops.end(), word) != stops.end()) return body;
      body->children.push_back(statement(word));
    }
    if (!stops.empty()) fail(str("missing '", stops.back(), "'"));
    return body;
  }
  NodeP leaf(Node::Kind k) {
    auto n = std::make_unique<Node>();
    n->kind = k;
    n->line = line_;
    return n;
  }
  // Starts lexing the tag at pos_ after its keyword, and moves past it.
  void tag_rest(const std::string& word) {
    const std::string& t = piece().text;
    start(t.substr(t.find(word) + word.size()));
    ++pos_;
  }
  void close(const std::string& word) {
    if (pos_ >= pieces_.size()) fail(str("missing '", word, "'"));
    line_ = piece().line;
    tag_rest(word);
    end();
  }
  NodeP statement(const std::string& word) {
    if (word == "if") return if_node();
    if (word == "for") return for_node();
    if (word == "set") return set_node();
    if (word == "macro") return macro_node();
    if (word == "call") return call_node();
    if (word == "generation") {  // transformers' tag: its body renders as written
      NodeP n = leaf(Node::kGeneration);
      tag_rest(word);
      end();
      n->body = block({"endgeneration"});
      close("endgeneration");
      return n;
    }
    if (word == "break" || word == "continue") {
      if (loops_ == 0) fail(str("'", word, "' outside a loop"));
      tag_rest(word);
      end();
      return leaf(word == "break" ? Node::kBreak : Node::kContinue);
    }
    static const std::vector<std::string> closers = {
        "endif", "endfor", "elif", "else", "endset", "endmacro", "endcall", "endgeneration"};
    if (std::find(closers.begin(), closers.end(), word) != closers.end())
      fail(str("'", word, "' without its opening tag"));
    fail(str("unsupported tag '", word,
             "' (supported: if, for, set, macro, call, break, continue, generation)"));
  }
  NodeP if_node() {
    NodeP n = leaf(Node::kIf);
    std::string word = "if";
    for (;;) {
      tag_rest(word);
      ExprP cond;
      if (word != "else") cond = expression();
      end();
      NodeP body = block({"elif", "else", "endif"});
      n->branches.emplace_back(std::move(cond), std::move(body));
      if (pos_ >= pieces_.size()) fail("missing 'endif'");
      word = first_word(piece().text);
      if (word == "endif") {
        close("endif");
        return n;
      }
      if (n->branches.back().first == nullptr) fail(str("'", word, "' after 'else'"));
    }
  }
  std::vector<std::string> targets() {
    std::vector<std::string> t = {name()};
    while (accept(",")) t.push_back(name());
    return t;
  }
  NodeP for_node() {
    NodeP n = leaf(Node::kFor);
    tag_rest("for");
    const bool bracket = accept("(");
    n->targets = targets();
    if (bracket) expect(")");
    if (!accept_name("in")) fail(str("expected 'in', found '", t_[p_].text, "'"));
    n->expr = tuple_or_expression(false);
    if (accept_name("if")) n->cond = expression();
    if (at_name("recursive")) fail("recursive loops are not supported");
    end();
    ++loops_;
    n->body = block({"else", "endfor"});
    --loops_;
    if (pos_ < pieces_.size() && first_word(piece().text) == "else") {
      close("else");
      n->otherwise = block({"endfor"});
    }
    close("endfor");
    return n;
  }
  NodeP set_node() {
    NodeP n = leaf(Node::kSet);
    tag_rest("set");
    n->targets = targets();
    if (n->targets.size() == 1 && accept(".")) {
      n->text = n->targets[0];
      n->attr = name();
    }
    if (done()) {
      if (!n->attr.empty() || n->targets.size() != 1) fail("a block set takes one name");
      n->kind = Node::kSetBlock;
      n->body = block({"endset"});
      close("endset");
      return n;
    }
    expect("=");
    n->expr = tuple_or_expression(true);
    end();
    return n;
  }
  void params(KwArgs* out) {
    if (!accept("(")) return;
    while (!accept(")")) {
      std::string p = name();
      out->emplace_back(p, accept("=") ? expression() : nullptr);
      if (!at(")")) expect(",");
    }
  }
  NodeP macro_node() {
    NodeP n = leaf(Node::kMacro);
    tag_rest("macro");
    n->text = name();
    if (!at("(")) fail("expected '(' after the macro's name");
    params(&n->params);
    end();
    const int loops = loops_;
    loops_ = 0;  // a break in a macro does not leave the loop around it
    n->body = block({"endmacro"});
    loops_ = loops;
    close("endmacro");
    return n;
  }
  NodeP call_node() {
    NodeP n = leaf(Node::kCallBlock);
    tag_rest("call");
    params(&n->params);
    n->expr = expression();
    if (n->expr->kind != Expr::kCall) fail("a call block needs a call");
    end();
    n->body = block({"endcall"});
    close("endcall");
    return n;
  }

  std::vector<Piece> pieces_;
  const std::string& name_;
  int max_depth_;
  size_t pos_ = 0;
  int line_ = 1;
  int depth_ = 0;
  int loops_ = 0;
  std::vector<Tok> t_;
  size_t p_ = 0;
};

}  // namespace

NodeP parse_template(const std::string& source, const std::string& name, const Limits& limits) {
  return Parser(split_template(source, name), name, limits).parse();
}

}  // namespace fuyou::jinja
