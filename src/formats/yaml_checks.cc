#include "src/formats/yaml_checks.h"

#include <map>

#include "fuyou/error.h"

namespace fuyou {
namespace {

// Configs nest two levels deep (section, key, list). The walk refuses anything much deeper,
// which also stops it on the cycles yaml-cpp can build from an anchor inside its own node
// (`&a [*a]`).
constexpr int kMaxDepth = 32;

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

}  // namespace

std::string yaml_position(const YAML::Mark& m) {
  if (m.is_null()) return "unknown line";
  return str("line ", m.line + 1, ", column ", m.column + 1);
}

YAML::Node load_yaml_checked(const std::string& text, const std::string& source) {
  YAML::Node root;
  try {
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
