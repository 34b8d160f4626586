// Loading YAML that a user wrote by hand, with the checks yaml-cpp leaves out. yaml-cpp
// accepts a key given twice in one mapping (and its lookups then see only the first), and
// keys that are lists or maps (`? [x]`), on which a later key-to-string conversion throws.
// Both are refused here, with the line of each, before a config reader looks at the tree. So
// are aliases that expand beyond a bound (nested aliases multiply: nine short lines can stand
// for more nodes than a walk of the tree could visit in days), before the tree is walked.
#pragma once

#include <yaml-cpp/yaml.h>

#include <string>

namespace fuyou {

// Parses `text` and checks every mapping in it: keys are plain scalars and each appears
// once; the document, its aliases expanded, holds at most a million nodes. ConfigError naming
// `source` and the line (and, for a repeated key, both lines); yaml-cpp's own syntax errors become
// ConfigErrors with the line and column too.
YAML::Node load_yaml_checked(const std::string& text, const std::string& source);

// "line 3, column 5" for a node that came from the text (yaml-cpp counts from 0).
std::string yaml_position(const YAML::Mark& m);

}  // namespace fuyou
