#include "src/formats/yaml_checks.h"

#include <yaml-cpp/eventhandler.h>

#include <map>
#include <sstream>
#include <vector>

#include "fuyou/error.h"

namespace fuyou {
namespace {

// Configs nest two levels deep (section, key, list). The walk refuses anything much deeper,
// which also stops it on the cycles yaml-cpp can build from an anchor inside its own node
// (`&a [*a]`).
constexpr int kMaxDepth = 32;

// A config has about a hundred nodes, a long data.text list thousands; walking a million
// takes a fraction of a second.
constexpr uint64_t kMaxYamlNodes = 1'000'000;

class Checker {
 public:
  explicit Checker(const std::string& source) : source_(source) {}

  void walk(const YAML::Node& n, const std::string& path, int depth) {
    if (depth > kMaxDepth)
      throw ConfigError(str(source_, ": ", yaml_position(n.Mark()), ": '", path,
                            "' nests deeper than ", kMaxDepth,
                            " levels (or refers to itself through an alias)"));
    if (n.IsSequence()) {
      for (size_t i = 0; i < n.size(); ++i) walk(n[i], str(path, "[", i, "]"), depth + 1);
    } else if (n.IsMap()) {
      check_map(n, path, depth);
    }
  }

 private:
  void check_map(const YAML::Node& n, const std::string& path, int depth) {
    std::map<std::string, YAML::Mark> seen;
    for (const auto& kv : n) {
      const YAML::Node& key = kv.first;
      const std::string where = str(source_, ": ", yaml_position(key.Mark()), ": ");
      if (!key.IsScalar())
        throw ConfigError(str(where, "a key in '", path.empty() ? "the top level" : path, "' is a ",
                              key.IsSequence() ? "list"
                              : key.IsMap()    ? "mapping"
                                               : "null",
                              "; keys must be plain names (a '? ' complex key is not allowed)"));
      const std::string& name = key.Scalar();
      const std::string full = path.empty() ? name : path + "." + name;
      auto [it, inserted] = seen.emplace(name, key.Mark());
      if (!inserted)
        throw ConfigError(str(where, "key '", full, "' is given a second time (first at ",
                              yaml_position(it->second), "); each key may appear once"));
      walk(kv.second, full, depth + 1);
    }
  }

  const std::string& source_;
};

// Counts the nodes the tree holds once every alias is expanded, from the parser's events,
// before a tree is built or walked: a few lines of nested aliases (`b: &b [*a, *a, ...]`,
// each level multiplying the last) expand to more nodes than any machine can walk. An alias
// adds the size of what it names; an alias to a node still open (one that contains itself)
// is refused outright.
class AliasBound : public YAML::EventHandler {
 public:
  AliasBound(const std::string& source, uint64_t limit) : source_(source), limit_(limit) {}

  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark& m, YAML::anchor_t anchor) override { leaf(m, anchor); }
  void OnScalar(const YAML::Mark& m, const std::string&, YAML::anchor_t anchor,
                const std::string&) override {
    leaf(m, anchor);
  }
  void OnAlias(const YAML::Mark& m, YAML::anchor_t anchor) override {
    auto it = sizes_.find(anchor);
    if (it == sizes_.end())
      throw ConfigError(
          str(source_, ": ", yaml_position(m),
              ": an alias refers to a node that contains it (a node cannot include itself)"));
    add(m, it->second);
  }
  void OnSequenceStart(const YAML::Mark& m, const std::string&, YAML::anchor_t anchor,
                       YAML::EmitterStyle::value) override {
    open(m, anchor);
  }
  void OnSequenceEnd() override { close(); }
  void OnMapStart(const YAML::Mark& m, const std::string&, YAML::anchor_t anchor,
                  YAML::EmitterStyle::value) override {
    open(m, anchor);
  }
  void OnMapEnd() override { close(); }

 private:
  struct Open {
    YAML::anchor_t anchor;
    uint64_t size;  // nodes inside, expanded, and the node itself
  };
  void leaf(const YAML::Mark& m, YAML::anchor_t anchor) {
    if (anchor) sizes_[anchor] = 1;
    add(m, 1);
  }
  void open(const YAML::Mark& m, YAML::anchor_t anchor) {
    add(m, 1);
    stack_.push_back({anchor, 1});
  }
  void close() {
    const Open o = stack_.back();
    stack_.pop_back();
    if (o.anchor) sizes_[o.anchor] = o.size;
    if (!stack_.empty()) stack_.back().size += o.size - 1;  // its own 1 was added when it opened
  }
  void add(const YAML::Mark& m, uint64_t n) {
    total_ += n;
    if (!stack_.empty()) stack_.back().size += n;
    if (total_ > limit_)
      throw ConfigError(
          str(source_, ": ", yaml_position(m), ": the document expands to more than ", limit_,
              " nodes once its aliases (*name) are replaced by what they name; aliases that repeat "
              "aliases multiply (an 'alias bomb'): write the values out instead"));
  }

  const std::string& source_;
  uint64_t limit_;
  uint64_t total_ = 0;
  std::vector<Open> stack_;
  std::map<YAML::anchor_t, uint64_t> sizes_;
};

}  // namespace

std::string yaml_position(const YAML::Mark& m) {
  if (m.is_null()) return "unknown line";
  return str("line ", m.line + 1, ", column ", m.column + 1);
}

YAML::Node load_yaml_checked(const std::string& text, const std::string& source) {
  YAML::Node root;
  try {
    std::istringstream in(text);
    YAML::Parser parser(in);
    AliasBound bound(source, kMaxYamlNodes);
    while (parser.HandleNextDocument(bound)) {
    }
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(str(source, ": ", yaml_position(e.mark), ": ", e.msg));
  }
  try {
    Checker(source).walk(root, "", 0);
  } catch (const YAML::Exception& e) {
    throw ConfigError(str(source, ": ", yaml_position(e.mark), ": ", e.msg));
  }
  return root;
}

}  // namespace fuyou
