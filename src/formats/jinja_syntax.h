// The parsed form of a chat template (src/formats/jinja.h): expressions and statements as
// trees whose depth the parser bounds (Limits::max_depth, counted with the nesting of the tags
// around them), so that the renderer's and the destructors' recursion over them is bounded too.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "src/formats/jinja_value.h"

namespace fuyou::jinja {

struct Expr;
using ExprP = std::unique_ptr<Expr>;
using KwArgs = std::vector<std::pair<std::string, ExprP>>;

struct Expr {
  enum Kind {
    kLiteral,  // value
    kName,     // name
    kAttr,     // args[0].name
    kIndex,    // args[0][args[1]]
    kSlice,    // args[0][args[1]:args[2]:args[3]], each bound may be null
    kCall,     // args[0](args[1:], kwargs)
    kFilter,   // args[0] | name(args[1:], kwargs)
    kTest,     // args[0] is [not] name(args[1:])
    kNot,
    kNeg,
    kBinary,  // args[0] name args[1]; name is the operator
    kCond,    // args[1] if args[0] else args[2] (null: undefined)
    kList,
    kTuple,
    kDict  // keys and values alternate in args
  } kind;
  Value value;
  std::string name;
  std::vector<ExprP> args;
  KwArgs kwargs;
  bool negated = false;  // kTest: "is not"
  int line = 0;
  int depth = 1;  // of this tree
};

struct Node;
using NodeP = std::unique_ptr<Node>;

struct Node {
  enum Kind {
    kBody,        // children, in order
    kText,        // text
    kOutput,      // {{ expr }}
    kIf,          // branches (a null condition: else)
    kFor,         // for targets in expr [if cond]: body [else: otherwise]
    kSet,         // set targets = expr; set name.attr = expr (attr not empty)
    kSetBlock,    // set targets[0]: body
    kMacro,       // macro name(params): body
    kCallBlock,   // call(params) expr: body (the caller)
    kGeneration,  // generation: body (what the assistant writes; transformers' tag)
    kBreak,
    kContinue,
  } kind;
  int line = 0;
  std::string text;  // kText; kMacro: its name; kSet: the namespace's name for name.attr
  std::string attr;  // kSet: the attribute of name.attr
  std::vector<std::string> targets;
  ExprP expr, cond;
  std::vector<std::pair<ExprP, NodeP>> branches;
  NodeP body, otherwise;
  KwArgs params;  // kMacro, kCallBlock: parameter names and defaults (null: none)
  std::vector<NodeP> children;
};

// Parses a whole template; ConfigError "NAME: line L: ..." for what jinja2 refuses to compile
// and for nesting beyond limits.max_depth.
NodeP parse_template(const std::string& source, const std::string& name, const Limits& limits);

}  // namespace fuyou::jinja
