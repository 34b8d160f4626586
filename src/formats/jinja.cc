// The chat-template renderer (src/formats/jinja.h): walks the tree jinja_parse.cc builds, with
// jinja2's scoping (a for loop's body is a scope of its own each turn; if does not open one; a
// macro sees the template's top-level names as they are when it is called and the scopes it
// was defined in), over the values and operations of jinja_value.h and jinja_builtins.h.
// Renderer::Nest is the one place the render's nesting (statements, expressions, macro calls)
// is counted against Limits::max_depth.
#include <unordered_map>

#include "fuyou/error.h"
#include "src/formats/jinja_builtins.h"
#include "src/formats/jinja_syntax.h"

namespace fuyou::jinja {

struct Frame {
  std::unordered_map<std::string, Value> vars;
};

namespace {

class Renderer {
 public:
  Renderer(Ctx& c, Template::Spans* generation, Template::Turns* turns)
      : c_(c), spans_(generation), turns_(turns) {
    frames_.emplace_back();
  }
  void set_global(const std::string& name, Value v) {
    if (turns_ && name == "messages" && v.kind == Value::kList)
      for (size_t k = 0; k < v.list->size(); ++k)
        if ((*v.list)[k].kind == Value::kDict) message_index_[(*v.list)[k].dict.get()] = k;
    frames_[0].vars[name] = std::move(v);
  }
  std::string render(const Node& root) {
    run(root);
    if (turns_ && turns_lost_) turns_->clear();
    return std::move(out_);
  }

 private:
  enum Flow { kNext, kBreak, kContinue };

  struct Nest {
    Renderer* r;
    explicit Nest(Renderer* renderer, int line) : r(renderer) {
      r->c_.line = line;
      if (++r->depth_ > r->c_.limits().max_depth)
        r->c_.fail(str("the render nests more than ", r->c_.limits().max_depth,
                       " deep (the limit max_depth)"));
    }
    ~Nest() { --r->depth_; }
  };

  void emit(const std::string& s) {
    c_.charge(1, s.size());
    if (out_.size() + s.size() > c_.limits().max_output_bytes)
      c_.fail(str("the rendered text is longer than ", c_.limits().max_output_bytes,
                  " bytes (the limit max_output_bytes)"));
    out_ += s;
  }

  Value lookup(const std::string& n) const {
    for (auto it = frames_.rbegin(); it != frames_.rend(); ++it) {
      auto f = it->vars.find(n);
      if (f != it->vars.end()) return f->second;
    }
    if (is_global(n)) {
      auto fn = std::make_shared<Callable>();
      fn->name = n;
      return Value::callable(std::move(fn));
    }
    return Value::undefined(str("'", n, "' is undefined"));
  }

  Flow run(const Node& n) {
    Nest nest(this, n.line ? n.line : c_.line);
    c_.charge();
    switch (n.kind) {
      case Node::kBody:
        for (const NodeP& child : n.children) {
          const Flow f = run(*child);
          if (f != kNext) return f;
        }
        return kNext;
      case Node::kText:
        emit(n.text);
        return kNext;
      case Node::kOutput:
        emit(to_string(c_, eval(*n.expr)));
        return kNext;
      case Node::kIf:
        for (const auto& [cond, body] : n.branches)
          if (!cond || truthy(eval(*cond))) return run(*body);
        return kNext;
      case Node::kFor:
        return run_for(n);
      case Node::kSet:
        assign(n, eval(*n.expr));
        return kNext;
      case Node::kSetBlock:
        frames_.back().vars[n.targets[0]] = c_.string(capture(*n.body));
        return kNext;
      case Node::kMacro:
        frames_.back().vars[n.text] = Value::callable(callable(n, n.text));
        return kNext;
      case Node::kCallBlock: {
        Value caller = Value::callable(callable(n, "caller"));
        emit(to_string(c_, call(*n.expr, &caller)));
        return kNext;
      }
      case Node::kGeneration: {
        if (spans_ && capturing_ > 0)
          c_.fail(
              "a {% generation %} block inside a macro, call or set block cannot mark the "
              "assistant's text (its position in the rendered text is not known there)");
        const size_t begin = out_.size();
        const Flow f = run(*n.body);
        if (spans_ && out_.size() > begin) spans_->emplace_back(begin, out_.size());
        return f;
      }
      case Node::kBreak:
        return kBreak;
      case Node::kContinue:
        return kContinue;
    }
    return kNext;
  }

  std::string capture(const Node& body) {
    std::string saved;
    std::swap(saved, out_);
    ++capturing_;
    run(body);
    --capturing_;
    std::swap(saved, out_);
    return saved;
  }

  std::shared_ptr<const Callable> callable(const Node& n, const std::string& name) {
    auto fn = std::make_shared<Callable>();
    fn->name = name;
    fn->node = &n;
    fn->closure = std::make_shared<const std::vector<Frame>>(frames_.begin() + 1, frames_.end());
    return fn;
  }

  // Binds `targets` to `v` (unpacking a list or tuple into several) in the innermost scope.
  void bind(const std::vector<std::string>& targets, const Value& v, Frame& f) {
    if (targets.size() == 1) {
      f.vars[targets[0]] = v;
      return;
    }
    if (v.kind != Value::kList || v.list->size() != targets.size())
      c_.fail(str("cannot unpack a ", kind_name(v), " into ", targets.size(), " names"));
    for (size_t t = 0; t < targets.size(); ++t) f.vars[targets[t]] = (*v.list)[t];
  }

  void assign(const Node& n, Value v) {
    if (n.attr.empty()) return bind(n.targets, v, frames_.back());
    Value ns = lookup(n.text);
    if (ns.kind != Value::kNamespace) c_.fail("cannot assign attribute on non-namespace object");
    if (!n.attr.empty() && n.attr[0] == '_')
      c_.fail(
          str("Chat templates cannot store underscore-prefixed attributes on a namespace, "
              "but got '",
              n.attr, "'. Please rename the attribute."));
    if (v.kind == Value::kNamespace || v.holds_ns)
      c_.fail(str("a namespace cannot hold a namespace ('", n.attr, "')"));
    uint64_t bytes = v.bytes + n.attr.size() + kItemBytes;
    for (const auto& [k, x] : ns.dict->items)
      if (k != n.attr) bytes += x.bytes + k.size() + kItemBytes;
    c_.check_size(bytes);
    if (Value* f = ns.dict->find(n.attr))
      *f = std::move(v);
    else
      ns.dict->items.emplace_back(n.attr, std::move(v));
  }

  Flow run_for(const Node& n) {
    List items = iterate(c_, eval(*n.expr));
    if (n.cond) {  // the filter sees the loop variables, not `loop`
      List kept;
      for (Value& item : items) {
        frames_.emplace_back();
        bind(n.targets, item, frames_.back());
        const bool keep = truthy(eval(*n.cond));
        frames_.pop_back();
        if (keep) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) return n.otherwise ? run(*n.otherwise) : kNext;
    const int64_t len = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < len; ++k) {
      c_.charge(16);  // a turn makes its `loop` of eleven values
      frames_.emplace_back();
      Frame& f = frames_.back();
      Value loop = c_.dict(Dict{
          {{"index0", Value::integer(k)},
           {"index", Value::integer(k + 1)},
           {"revindex", Value::integer(len - k)},
           {"revindex0", Value::integer(len - k - 1)},
           {"first", Value::boolean(k == 0)},
           {"last", Value::boolean(k == len - 1)},
           {"length", Value::integer(len)},
           {"depth", Value::integer(1)},
           {"depth0", Value::integer(0)},
           {"previtem", k > 0 ? items[k - 1] : Value::undefined("there is no previous item")},
           {"nextitem", k + 1 < len ? items[k + 1] : Value::undefined("there is no next item")}}});
      loop.loop = true;
      f.vars["loop"] = std::move(loop);
      bind(n.targets, items[k], f);
      const size_t message = turn_of(items[k]), begin = out_.size();
      if (message != kNoTurn) in_turn_ = true;
      const Flow flow = run(*n.body);
      if (message != kNoTurn) {
        in_turn_ = false;
        if (out_.size() > begin) turns_->push_back({message, begin, out_.size()});
      }
      frames_.pop_back();
      if (flow == kBreak) break;
    }
    return kNext;
  }

  static constexpr size_t kNoTurn = ~size_t(0);
  // The index of the message a loop turn's item is, when turns are recorded and no loop around
  // this one has a message for its item; kNoTurn otherwise.
  size_t turn_of(const Value& item) {
    if (!turns_ || in_turn_ || item.kind != Value::kDict) return kNoTurn;
    auto it = message_index_.find(item.dict.get());
    if (it == message_index_.end()) return kNoTurn;
    if (capturing_ > 0) {
      turns_lost_ = true;
      return kNoTurn;
    }
    return it->second;
  }

  Value eval(const Expr& e) {
    Nest nest(this, e.line);
    c_.charge();
    switch (e.kind) {
      case Expr::kLiteral:
        return e.value;
      case Expr::kName:
        return lookup(e.name);
      case Expr::kAttr:
        return attribute(c_, eval(*e.args[0]), e.name);
      case Expr::kIndex: {
        Value v = eval(*e.args[0]);
        return subscript(c_, v, eval(*e.args[1]));
      }
      case Expr::kSlice: {
        Value v = eval(*e.args[0]);
        Value b[3];
        for (int k = 0; k < 3; ++k)
          if (e.args[k + 1]) b[k] = eval(*e.args[k + 1]);
        return slice(c_, v, e.args[1] ? &b[0] : nullptr, e.args[2] ? &b[1] : nullptr,
                     e.args[3] ? &b[2] : nullptr);
      }
      case Expr::kCall:
        return call(e, nullptr);
      case Expr::kFilter: {
        Value v = eval(*e.args[0]);
        Args args;
        Kwargs kwargs;
        arguments(e, &args, &kwargs);
        return apply_filter(c_, e.name, v, args, kwargs);
      }
      case Expr::kTest: {
        Value v = eval(*e.args[0]);
        Args args;
        Kwargs kwargs;
        arguments(e, &args, &kwargs);
        return Value::boolean(apply_test(c_, e.name, v, args) != e.negated);
      }
      case Expr::kNot:
        return Value::boolean(!truthy(eval(*e.args[0])));
      case Expr::kNeg:
        return negate(c_, eval(*e.args[0]));
      case Expr::kBinary: {
        Value a = eval(*e.args[0]);
        if (e.name == "and") return truthy(a) ? eval(*e.args[1]) : a;
        if (e.name == "or") return truthy(a) ? a : eval(*e.args[1]);
        Value b = eval(*e.args[1]);
        c_.line = e.line;
        return binary_op(c_, e.name, a, b);
      }
      case Expr::kCond:
        if (truthy(eval(*e.args[0]))) return eval(*e.args[1]);
        if (e.args[2]) return eval(*e.args[2]);
        return Value::undefined(
            "the inline if-expression evaluated to false and no else section was defined.");
      case Expr::kList:
      case Expr::kTuple: {
        List items;
        for (const ExprP& a : e.args) items.push_back(eval(*a));
        return c_.list(std::move(items), e.kind == Expr::kTuple);
      }
      case Expr::kDict: {
        Dict d;
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
          Value key = eval(*e.args[k]);
          if (key.kind != Value::kString) c_.fail("mapping keys must be strings");
          Value v = eval(*e.args[k + 1]);
          if (Value* f = d.find(key.s()))
            *f = std::move(v);
          else
            d.items.emplace_back(key.s(), std::move(v));
        }
        return c_.dict(std::move(d));
      }
    }
    return Value();
  }

  // Arguments after the first of a call, filter or test.
  void arguments(const Expr& e, Args* args, Kwargs* kwargs) {
    for (size_t k = 1; k < e.args.size(); ++k) args->push_back(eval(*e.args[k]));
    for (const auto& [name, x] : e.kwargs) kwargs->emplace_back(name, eval(*x));
  }

  Value call(const Expr& e, const Value* caller) {
    const Expr& callee = *e.args[0];
    Args args;
    Kwargs kwargs;
    if (callee.kind == Expr::kAttr) {
      Value self = eval(*callee.args[0]);
      const Value* member = self.find(callee.name);
      arguments(e, &args, &kwargs);
      c_.line = e.line;
      if (!member || member->kind != Value::kCallable)
        return call_method(c_, self, callee.name, args, kwargs);
      return invoke(*member, args, kwargs, caller);
    }
    Value fn = eval(callee);
    arguments(e, &args, &kwargs);
    c_.line = e.line;
    return invoke(fn, args, kwargs, caller);
  }

  Value invoke(const Value& fn, const Args& args, const Kwargs& kwargs, const Value* caller) {
    if (fn.kind == Value::kUndefined) c_.fail(fn.s());
    if (fn.kind != Value::kCallable) c_.fail(str("'", kind_name(fn), "' object is not callable"));
    if (!fn.fn->node) return call_global(c_, fn.fn->name, args, kwargs);
    return call_macro(*fn.fn, args, kwargs, caller);
  }

  Value call_macro(const Callable& fn, const Args& args, const Kwargs& kwargs,
                   const Value* caller) {
    const Node& m = *fn.node;
    Nest nest(this, c_.line);
    const int line = c_.line;
    if (args.size() > m.params.size())
      c_.fail(str("macro '", fn.name, "' takes not more than ", m.params.size(), " argument(s)"));
    std::vector<Frame> frames = {frames_[0]};
    frames.insert(frames.end(), fn.closure->begin(), fn.closure->end());
    frames.emplace_back();
    std::swap(frames, frames_);
    Frame& f = frames_.back();
    for (const auto& kw : kwargs) {
      const std::string& name = kw.first;  // (clang 14 cannot capture a structured binding)
      const bool known = std::any_of(m.params.begin(), m.params.end(),
                                     [&](const auto& p) { return p.first == name; });
      if (!known) c_.fail(str("macro '", fn.name, "' takes no keyword argument '", name, "'"));
    }
    for (size_t k = 0; k < m.params.size(); ++k) {
      const auto& [name, dflt] = m.params[k];
      const Value* given = k < args.size() ? &args[k] : nullptr;
      for (const auto& [kn, x] : kwargs)
        if (kn == name) given = &x;
      if (given)
        f.vars[name] = *given;
      else if (dflt)
        f.vars[name] = eval(*dflt);
      else
        f.vars[name] = Value::undefined(str("parameter '", name, "' was not provided"));
    }
    if (caller) frames_.back().vars["caller"] = *caller;
    std::string text = capture(*m.body);
    std::swap(frames, frames_);
    c_.line = line;
    return c_.string(std::move(text));
  }

  Ctx& c_;
  std::vector<Frame> frames_;
  std::string out_;
  int depth_ = 0;
  Template::Spans* spans_;  // null: generation blocks are not recorded
  int capturing_ = 0;       // macro, call and set bodies being rendered into a value
  Template::Turns* turns_;  // null: the messages' turns are not recorded
  std::unordered_map<const Dict*, size_t> message_index_;  // the messages' mappings
  bool in_turn_ = false;     // inside a loop turn whose item is a message
  bool turns_lost_ = false;  // a message's turn ran where positions are not known
};

// Whether the tree holds a generation block; walked with a stack of its own.
bool holds_generation(const Node& root) {
  std::vector<const Node*> todo = {&root};
  while (!todo.empty()) {
    const Node* n = todo.back();
    todo.pop_back();
    if (n->kind == Node::kGeneration) return true;
    for (const NodeP& c : n->children) todo.push_back(c.get());
    for (const auto& b : n->branches) todo.push_back(b.second.get());
    if (n->body) todo.push_back(n->body.get());
    if (n->otherwise) todo.push_back(n->otherwise.get());
  }
  return false;
}

template <class Json>
std::string render_with(const std::string& name, const Options& options, const Node& root,
                        const Json& vars, Work* work, Template::Spans* generation,
                        Template::Turns* turns = nullptr) {
  Work own(options.limits.max_work);
  Ctx c(name, options, work ? work : &own);
  Renderer r(c, generation, turns);
  if (vars.is_object())
    for (auto it = vars.begin(); it != vars.end(); ++it)
      r.set_global(it.key(), from_json(c, it.value()));
  return r.render(root);
}

}  // namespace

Template::Template(const std::string& source, const std::string& name, Options options)
    : name_(name),
      options_(options),
      root_(parse_template(source, name, options.limits)),
      has_generation_(holds_generation(*root_)) {}
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

std::string Template::render(const nlohmann::json& vars, Work* work) const {
  return render_with(name_, options_, *root_, vars, work, nullptr);
}
std::string Template::render(const nlohmann::ordered_json& vars, Work* work) const {
  return render_with(name_, options_, *root_, vars, work, nullptr);
}
std::string Template::render(const nlohmann::ordered_json& vars, Work* work,
                             Spans* generation) const {
  if (generation) generation->clear();
  return render_with(name_, options_, *root_, vars, work, generation);
}
std::string Template::render(const nlohmann::ordered_json& vars, Work* work, Spans* generation,
                             Turns* turns) const {
  if (generation) generation->clear();
  if (turns) turns->clear();
  return render_with(name_, options_, *root_, vars, work, generation, turns);
}

}  // namespace fuyou::jinja
