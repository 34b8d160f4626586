// manifest.json of a training checkpoint (docs/checkpoints.md): written last, it says what
// the checkpoint holds. It carries its own XXH3-64 (over its canonical JSON without that
// field) and that of config.yaml, beside the tensors' per-group checksums, so that an edited
// or damaged manifest or config is refused instead of trained on. Every field is read with its
// type and range checked; what can be cross-checked is (the step against the directory's name
// and the config's schedule, Adam's step against the step, the file list against the files a
// checkpoint has).
#pragma once

#include <map>
#include <string>

#include "fuyou/checkpoint.h"

namespace fuyou {

// The manifest's text (version kCheckpointVersion); `config_xxh3` is that of config.yaml's bytes.
std::string manifest_text(const CheckpointManifest& m, const std::string& config_xxh3);

struct ParsedManifest {
  CheckpointManifest manifest;
  std::string config_xxh3;  // empty for version 1, which had none
};
// Parses and checks manifest.json's text; `path` names it in errors. Version 1 manifests (no
// checksums of their own) are read with a warning.
ParsedManifest parse_manifest(const std::string& text, const std::string& path);

// The metadata key of both tensor files that records the version their checkpoint was written
// with (since version 2), so that a manifest's version is derivable from the other files.
inline constexpr const char* kVersionMetadataKey = "checkpoint_version";

// Cross-checks the manifest's version with what the tensor files' metadata record: a version
// that differs from theirs was edited (a version-1 manifest's own fields and config.yaml carry
// no checksum, so a downgrade must not switch the checksums off). A version-1 checkpoint's
// config.yaml must equal the config model.safetensors records (written from the same text).
// IoError naming the file.
void check_manifest_version(const ParsedManifest& p, const std::string& dir,
                            const std::map<std::string, std::string>& weights_metadata,
                            const std::map<std::string, std::string>& optimizer_metadata,
                            const std::string& config_text);

// Cross-checks a parsed manifest with the checkpoint's directory name (step-N) and its
// config's schedule. IoError naming the field. (The sampler's position depends on the data:
// the run checks it once the data is loaded, check_sampler_position.)
void check_manifest_against(const CheckpointManifest& m, const std::string& dir, const Config& cfg);

}  // namespace fuyou
