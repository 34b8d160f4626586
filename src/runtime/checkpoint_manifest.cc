#include "src/runtime/checkpoint_manifest.h"

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/hf_checkpoint.h"
#include "fuyou/log.h"
#include "fuyou/optim.h"
#include "src/common/xxh3.h"
#include "src/runtime/checkpoint_dirs.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace fuyou {
namespace {

// The files of a checkpoint, each listed once in its manifest.
const char* const kCheckpointFiles[] = {kEngineConfigFile, "model.safetensors", kOptimizerFile};

// XXH3-64 of the manifest's canonical form: nlohmann::json's compact dump, whose objects are
// sorted by key and whose numbers print as the shortest text that reads back as the same
// value, so parsing the file and dumping it again gives back exactly the text hashed here.
std::string canonical_xxh3(const json& j) {
  const std::string text = j.dump();
  return hex64(xxh3_64(text.data(), text.size()));
}

json split_json(const DataSplitIdentity& s) {
  json shards = json::array();
  for (const auto& sh : s.shards)
    shards.push_back({{"path", sh.path}, {"bytes", sh.bytes}, {"head_xxh3", sh.head_xxh3}});
  return {{"tokens", s.tokens}, {"xxh3", s.xxh3}, {"shards", shards}};
}

// Field access naming the manifest and the field in every error, with each value's type and
// range checked: a number too large for its field, or of the wrong sign, is refused rather
// than converted into something else.
class Fields {
 public:
  explicit Fields(const std::string& path) : path_(path) {}

  [[noreturn]] void fail(const std::string& field, const std::string& why) const {
    throw IoError(
        str(path_, ": field '", field, "' ", why, " (the checkpoint is damaged or was edited)"));
  }
  const json& at(const json& j, const std::string& key, const std::string& field) const {
    if (!j.is_object() || !j.contains(key)) fail(field, "is missing");
    return j.at(key);
  }
  int64_t integer(const json& v, const std::string& field, int64_t lo, int64_t hi) const {
    if (!v.is_number_integer())
      fail(field, str("is ", printable(v.dump(), 60), "; expected an integer"));
    if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(hi)
                               : v.get<int64_t>() > hi)
      fail(field, str("is ", printable(v.dump(), 60), "; expected at most ", hi));
    if (!v.is_number_unsigned() && v.get<int64_t>() < lo)
      fail(field, str("is ", v.get<int64_t>(), "; expected at least ", lo));
    return v.is_number_unsigned() ? static_cast<int64_t>(v.get<uint64_t>()) : v.get<int64_t>();
  }
  uint64_t count(const json& v, const std::string& field) const {
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
      fail(field, str("is ", printable(v.dump(), 60), "; expected an integer of at least 0"));
    return v.get<uint64_t>();
  }
  double number(const json& v, const std::string& field, double lo, double hi) const {
    if (!v.is_number()) fail(field, str("is ", printable(v.dump(), 60), "; expected a number"));
    const double d = v.get<double>();
    if (!std::isfinite(d) || d < lo || d > hi)
      fail(field, str("is ", d, "; expected a number in [", lo, ", ", hi, "]"));
    return d;
  }
  std::string string(const json& v, const std::string& field) const {
    if (!v.is_string()) fail(field, str("is ", printable(v.dump(), 60), "; expected a string"));
    return v.get<std::string>();
  }
  std::string hex(const json& v, const std::string& field, bool may_be_empty = false) const {
    std::string s = string(v, field);
    if (may_be_empty && s.empty()) return s;
    if (s.size() != 16 || s.find_first_not_of("0123456789abcdef") != std::string::npos)
      fail(field, str("is '", printable(s, 40), "'; expected 16 lower-case hex digits"));
    return s;
  }

 private:
  const std::string& path_;
};

DataSplitIdentity split_from_json(const Fields& f, const json& j, const std::string& field) {
  DataSplitIdentity s;
  s.tokens = f.count(f.at(j, "tokens", field + ".tokens"), field + ".tokens");
  s.xxh3 = f.hex(f.at(j, "xxh3", field + ".xxh3"), field + ".xxh3", /*may_be_empty=*/s.tokens == 0);
  const json& shards = f.at(j, "shards", field + ".shards");
  if (!shards.is_array()) f.fail(field + ".shards", "is not a list");
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string at = str(field, ".shards[", i, "]");
    s.shards.push_back({f.string(f.at(shards[i], "path", at + ".path"), at + ".path"),
                        f.count(f.at(shards[i], "bytes", at + ".bytes"), at + ".bytes"),
                        f.hex(f.at(shards[i], "head_xxh3", at + ".head_xxh3"), at + ".head_xxh3")});
  }
  return s;
}

// files: exactly the checkpoint's files, each once, under its plain name.
void read_files(const Fields& f, const json& j, ParsedManifest* p, int version) {
  const json& files = f.at(j, "files", "files");
  if (!files.is_array()) f.fail("files", "is not a list");
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string at = str("files[", i, "]");
    const std::string name = f.string(f.at(files[i], "name", at + ".name"), at + ".name");
    bool known = false;
    for (const char* k : kCheckpointFiles) known |= name == k;
    if (!known)
      f.fail(at + ".name",
             str("is '", printable(name, 80), "'; a checkpoint's files are ", kCheckpointFiles[0],
                 ", ", kCheckpointFiles[1], " and ", kCheckpointFiles[2]));
    for (const auto& other : p->manifest.files)
      if (other.name == name) f.fail(at + ".name", str("lists '", name, "' a second time"));
    p->manifest.files.push_back(
        {name, f.count(f.at(files[i], "bytes", at + ".bytes"), at + ".bytes")});
    if (name == kEngineConfigFile && version >= 2)
      p->config_xxh3 = f.hex(f.at(files[i], "xxh3", at + ".xxh3"), at + ".xxh3");
  }
  if (p->manifest.files.size() != std::size(kCheckpointFiles))
    f.fail("files", str("lists ", p->manifest.files.size(), " files; a checkpoint has ",
                        std::size(kCheckpointFiles)));
}

}  // namespace

std::string manifest_text(const CheckpointManifest& m, const std::string& config_xxh3) {
  json files = json::array();
  for (const auto& f : m.files) {
    json e{{"name", f.name}, {"bytes", f.bytes}};
    if (f.name == kEngineConfigFile) e["xxh3"] = config_xxh3;
    files.push_back(e);
  }
  json j{{"format", "fuyou-checkpoint"},
         {"version", kCheckpointVersion},
         {"step", m.step},
         {"micro_batch_in_step", m.micro_batch_in_step},
         {"engine", m.engine},
         {"adam_step", m.counters.adam_step},
         {"sampler_position", m.progress.sampler_position},
         {"first_val_loss", m.progress.first_val_loss},
         {"last_val_loss", m.progress.last_val_loss},
         {"train_seconds", m.progress.train_seconds},
         {"data", {{"train", split_json(m.data.train)}, {"val", split_json(m.data.val)}}},
         {"created", m.created},
         {"files", files},
         {"group_xxh3",
          {{"master", m.group_xxh3[0]}, {"adam_m", m.group_xxh3[1]}, {"adam_v", m.group_xxh3[2]}}},
         {"optimizer_state",
          {{"moments", moment_format_name(m.optim_format.moments)},
           {"master", master_format_name(m.optim_format.master)},
           {"block", kStateBlock}}}};
  if (!m.base_xxh3.empty()) j["lora_base_xxh3"] = m.base_xxh3;
  j["loss_scale"] = nullptr;
  if (m.counters.has_loss_scale)
    j["loss_scale"] = {{"scale", m.counters.loss_scale.scale},
                       {"clean_steps", m.counters.loss_scale.clean},
                       {"skipped_steps", m.counters.loss_scale.skipped}};
  j["xxh3"] = canonical_xxh3(j);
  return j.dump(2) + "\n";
}

ParsedManifest parse_manifest(const std::string& text, const std::string& path) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw IoError(str(path, ": not valid JSON: ", e.what()));
  }
  const Fields f(path);
  if (!j.is_object()) throw IoError(str(path, ": not a JSON object"));
  const std::string format = f.string(f.at(j, "format", "format"), "format");
  if (format != "fuyou-checkpoint")
    throw IoError(str(path, ": format '", printable(format, 60), "' is not fuyou-checkpoint"));
  const int version =
      static_cast<int>(f.integer(f.at(j, "version", "version"), "version", 0, INT32_MAX));
  if (version != kCheckpointVersion && version != 1)
    throw IoError(
        str(path, ": version ", version, "; this build reads versions 1 and ", kCheckpointVersion));
  if (version >= 2) {
    const std::string want = f.hex(f.at(j, "xxh3", "xxh3"), "xxh3");
    j.erase("xxh3");
    const std::string got = canonical_xxh3(j);
    if (got != want)
      throw IoError(str(
          path, ": its content has checksum ", got, " but it records ", want,
          " (the manifest was edited or damaged; a checkpoint's files are not to be edited: change "
          "what a resume may change with --set or --config)"));
  } else {
    // Version 2 added the checksums; a version-1 manifest that has them was edited.
    bool v2_fields = j.contains("xxh3");
    if (j.contains("files") && j["files"].is_array())
      for (const json& e : j["files"]) v2_fields |= e.is_object() && e.contains("xxh3");
    if (v2_fields)
      throw IoError(str(path,
                        ": version 1, but it carries the checksums version 2 added (xxh3): "
                        "the version was edited; a checkpoint's version is not to be edited"));
    spdlog::warn(
        "{}: version 1 (written by an older build): its manifest carries no checksum of its own "
        "(config.yaml is compared with the config model.safetensors records; the tensors are "
        "verified)",
        path);
  }
  ParsedManifest p;
  CheckpointManifest& m = p.manifest;
  m.version = version;
  m.step = f.integer(f.at(j, "step", "step"), "step", 0, kMaxSteps);
  m.micro_batch_in_step = static_cast<int>(f.integer(
      f.at(j, "micro_batch_in_step", "micro_batch_in_step"), "micro_batch_in_step", 0, 0));
  m.engine = f.string(f.at(j, "engine", "engine"), "engine");
  if (m.engine != "in-memory" && m.engine != "offloaded")
    f.fail("engine", str("is '", printable(m.engine, 40), "'; expected in-memory or offloaded"));
  m.counters.adam_step = f.integer(f.at(j, "adam_step", "adam_step"), "adam_step", 0, m.step);
  const json& ls = f.at(j, "loss_scale", "loss_scale");
  if (!ls.is_null()) {
    m.counters.has_loss_scale = true;
    m.counters.loss_scale = {
        f.number(f.at(ls, "scale", "loss_scale.scale"), "loss_scale.scale", 1e-30, 1e30),
        f.integer(f.at(ls, "clean_steps", "loss_scale.clean_steps"), "loss_scale.clean_steps", 0,
                  m.step),
        f.integer(f.at(ls, "skipped_steps", "loss_scale.skipped_steps"), "loss_scale.skipped_steps",
                  0, m.step)};
  }
  m.progress.step = m.step;
  m.progress.sampler_position =
      f.count(f.at(j, "sampler_position", "sampler_position"), "sampler_position");
  m.progress.first_val_loss =
      f.number(f.at(j, "first_val_loss", "first_val_loss"), "first_val_loss", 0, 1e6);
  m.progress.last_val_loss =
      f.number(f.at(j, "last_val_loss", "last_val_loss"), "last_val_loss", 0, 1e6);
  m.progress.train_seconds =
      f.number(f.at(j, "train_seconds", "train_seconds"), "train_seconds", 0, 1e12);
  const json& data = f.at(j, "data", "data");
  m.data.train = split_from_json(f, f.at(data, "train", "data.train"), "data.train");
  m.data.val = split_from_json(f, f.at(data, "val", "data.val"), "data.val");
  m.created = f.string(f.at(j, "created", "created"), "created");
  read_files(f, j, &p, version);
  if (j.contains("lora_base_xxh3")) m.base_xxh3 = f.hex(j.at("lora_base_xxh3"), "lora_base_xxh3");
  const json& sums = f.at(j, "group_xxh3", "group_xxh3");
  for (const char* k : {"master", "adam_m", "adam_v"}) {
    const std::string field = str("group_xxh3.", k);
    const json& list = f.at(sums, k, field);
    if (!list.is_array()) f.fail(field, "is not a list");
    std::vector<std::string> v;
    for (size_t i = 0; i < list.size(); ++i) v.push_back(f.hex(list[i], str(field, "[", i, "]")));
    m.group_xxh3.push_back(std::move(v));
  }
  // Written since the optimizer's state could be packed; absent (older checkpoints): fp32.
  if (j.contains("optimizer_state")) {
    const json& os = j.at("optimizer_state");
    const std::string moments =
        f.string(f.at(os, "moments", "optimizer_state.moments"), "optimizer_state.moments");
    const std::string master =
        f.string(f.at(os, "master", "optimizer_state.master"), "optimizer_state.master");
    if (moments == "bf16")
      m.optim_format.moments = MomentFormat::kBF16;
    else if (moments == "int8")
      m.optim_format.moments = MomentFormat::kInt8;
    else if (moments != "fp32")
      f.fail("optimizer_state.moments",
             str("is '", printable(moments, 40), "'; expected fp32, bf16 or int8"));
    if (master == "split")
      m.optim_format.master = MasterFormat::kSplit;
    else if (master != "fp32")
      f.fail("optimizer_state.master",
             str("is '", printable(master, 40), "'; expected fp32 or split"));
    const uint64_t block =
        f.count(f.at(os, "block", "optimizer_state.block"), "optimizer_state.block");
    if (block != kStateBlock)
      f.fail("optimizer_state.block",
             str("is ", block, "; this build's int8 blocks are ", kStateBlock, " elements"));
  }
  return p;
}

void check_manifest_version(const ParsedManifest& p, const std::string& dir,
                            const std::map<std::string, std::string>& weights_metadata,
                            const std::map<std::string, std::string>& optimizer_metadata,
                            const std::string& config_text) {
  const int version = p.manifest.version;
  const std::string path = (fs::path(dir) / kManifestFile).string();
  for (const auto& [file, meta] : {std::pair{"model.safetensors", &weights_metadata},
                                   std::pair{kOptimizerFile, &optimizer_metadata}}) {
    const auto it = meta->find(kVersionMetadataKey);
    if (it != meta->end() && it->second != std::to_string(version))
      throw IoError(str(path, ": version ", version, ", but ", dir, "/", file,
                        " was written as part of a version ", printable(it->second, 20),
                        " checkpoint: the manifest's version was edited (the checkpoint is not to "
                        "be edited; change what a resume may change with --set or --config)"));
  }
  if (version >= 2) return;  // config.yaml is under the manifest's checksum
  const auto config = weights_metadata.find("config");
  if (config == weights_metadata.end() || config->second != config_text)
    throw IoError(str(dir, "/", kEngineConfigFile, ": differs from the config ", dir,
                      "/model.safetensors records",
                      config == weights_metadata.end() ? " (it records none)" : "",
                      "; in a version-1 checkpoint the two are written from the same text, so "
                      "config.yaml was edited or damaged"));
}

void check_manifest_against(const CheckpointManifest& m, const std::string& dir,
                            const Config& cfg) {
  const std::string path = (fs::path(dir) / kManifestFile).string();
  fs::path name = fs::path(dir).lexically_normal();
  if (name.filename().empty()) name = name.parent_path();
  const int64_t named = step_of(name.filename().string());
  if (named >= 0 && named != m.step)
    throw IoError(str(path, ": step ", m.step, " but the directory is ", name.filename().string(),
                      " (the checkpoint was renamed, edited or damaged)"));
  if (cfg.lora.enabled() == m.base_xxh3.empty())
    throw IoError(str(path,
                      cfg.lora.enabled()
                          ? ": no lora_base_xxh3, but the checkpoint's config has a lora "
                            "section"
                          : ": lora_base_xxh3 is set, but the checkpoint's config has no "
                            "lora section",
                      " (the checkpoint is damaged or was edited)"));
  if (m.step > cfg.schedule.steps)
    throw IoError(
        str(path, ": step ", m.step, " is beyond the ", cfg.schedule.steps,
            " steps of the checkpoint's own config (schedule.steps); the checkpoint is damaged"));
}

void check_sampler_position(const CheckpointManifest& m, const Config& cfg, bool masked,
                            const std::string& path) {
  // One draw per window without a loss mask; with one, a window may be redrawn up to
  // kMaxRedraws times when none of its targets counts.
  const uint64_t windows = static_cast<uint64_t>(m.step) *
                           static_cast<uint64_t>(cfg.schedule.micro_batch) *
                           static_cast<uint64_t>(cfg.schedule.grad_accum);
  const uint64_t most = masked ? windows * (1 + BatchSampler::kMaxRedraws) : windows;
  const uint64_t pos = m.progress.sampler_position;
  if (pos < windows || pos > most)
    throw IoError(
        str(path, ": sampler_position ", pos, " does not fit step ", m.step, " x micro_batch ",
            cfg.schedule.micro_batch, " x grad_accum ", cfg.schedule.grad_accum, " = ", windows,
            " windows",
            masked ? str(" (at most ", most, " draws with loss-mask redraws)") : std::string(),
            " (the checkpoint is damaged or was edited)"));
}

}  // namespace fuyou
