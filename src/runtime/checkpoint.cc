// Writing and reading training-state checkpoints (include/fuyou/checkpoint.h). The directory
// handling (staging, latest, pruning, leftovers) is in checkpoint_dirs.cc; the comparison of
// a resume's config and data with the checkpoint's in resume_check.cc.
#include "fuyou/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/hf_checkpoint.h"
#include "fuyou/log.h"
#include "fuyou/model.h"
#include "fuyou/safetensors.h"
#include "src/runtime/checkpoint_dirs.h"
#include "src/runtime/checkpoint_packed.h"
#include "src/runtime/checkpoint_tensors.h"

namespace fs = std::filesystem;

namespace fuyou {
namespace {

constexpr StateKind kKinds[] = {StateKind::kMaster, StateKind::kAdamM, StateKind::kAdamV};

std::string utc_now() {
  std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return buf;
}

std::vector<StEntry> entries(const ParamLayout& layout, const std::string& prefix) {
  std::vector<StEntry> out;
  for (const TensorSpec& t : layout.tensors) out.push_back({prefix + t.name, StDtype::kF32, t.shape});
  return out;
}

nlohmann::json split_json(const DataSplitIdentity& s) {
  nlohmann::json shards = nlohmann::json::array();
  for (const auto& sh : s.shards) shards.push_back({{"path", sh.path}, {"bytes", sh.bytes}, {"head_xxh3", sh.head_xxh3}});
  return {{"tokens", s.tokens}, {"xxh3", s.xxh3}, {"shards", shards}};
}

DataSplitIdentity split_from_json(const nlohmann::json& j) {
  DataSplitIdentity s;
  s.tokens = j.at("tokens").get<uint64_t>();
  s.xxh3 = j.at("xxh3").get<std::string>();
  for (const auto& sh : j.at("shards"))
    s.shards.push_back({sh.at("path").get<std::string>(), sh.at("bytes").get<uint64_t>(),
                        sh.at("head_xxh3").get<std::string>()});
  return s;
}

nlohmann::json manifest_json(const CheckpointManifest& m) {
  nlohmann::json files = nlohmann::json::array();
  for (const auto& f : m.files) files.push_back({{"name", f.name}, {"bytes", f.bytes}});
  nlohmann::json j{{"format", "fuyou-checkpoint"},
                   {"version", m.version},
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
                   {"group_xxh3", {{"master", m.group_xxh3[0]}, {"adam_m", m.group_xxh3[1]}, {"adam_v", m.group_xxh3[2]}}},
                   {"optimizer_state", {{"moments", moment_format_name(m.optim_format.moments)},
                                        {"master", master_format_name(m.optim_format.master)},
                                        {"block", kStateBlock}}}};
  j["loss_scale"] = nullptr;
  if (m.counters.has_loss_scale)
    j["loss_scale"] = {{"scale", m.counters.loss_scale.scale},
                       {"clean_steps", m.counters.loss_scale.clean},
                       {"skipped_steps", m.counters.loss_scale.skipped}};
  return j;
}

// Streams every group of one kind into `w` (entries `prefix` + name) and returns the
// groups' checksums.
std::vector<std::string> write_kind(TrainEngine& engine, const ParamLayout& layout, SafetensorsStreamWriter& w,
                                    StateKind kind, const std::string& prefix) {
  GroupTensorWriter gw(w, layout, prefix);
  std::vector<std::string> sums;
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    engine.read_state(static_cast<int>(g), kind, gw.group_sink(static_cast<int>(g)));
    sums.push_back(gw.finish_group());
  }
  return sums;
}

std::string kind_prefix(StateKind k) { return k == StateKind::kMaster ? "" : std::string(state_kind_name(k)) + "."; }

// The files of one checkpoint, written into `dir` (the staging directory).
CheckpointManifest write_files(const fs::path& dir, const Config& cfg, TrainEngine& engine,
                               const TrainProgress& progress, const DataIdentity& data, const CheckpointIo& io) {
  const ParamLayout layout = make_gpt_layout(cfg.model);
  const std::string yaml = config_to_self_contained_yaml(cfg);
  CheckpointManifest m;
  m.step = progress.step;
  m.engine = engine.offloaded() ? "offloaded" : "in-memory";
  m.counters = engine.counters();
  m.progress = progress;
  m.data = data;
  m.created = utc_now();
  m.group_xxh3.resize(3);
  m.optim_format = engine.optim_format();
  const bool packed = m.optim_format.moments != MomentFormat::kF32;
  write_file_atomic((dir / kEngineConfigFile).string(), yaml.data(), yaml.size());
  {
    // The master weights with the metadata of a run's model.safetensors, so that the
    // directory is also an engine checkpoint fuyou-convert to-hf and model.checkpoint take.
    SafetensorsStreamWriter w((dir / "model.safetensors").string(), entries(layout, ""),
                              {{"format", "fuyou"}, {"step", std::to_string(progress.step)}, {"config", yaml}});
    if (io.write) w.set_write_function(io.write);
    m.group_xxh3[0] = write_kind(engine, layout, w, StateKind::kMaster, "");
    w.finish();
  }
  {
    // fp32 moments per tensor; packed ones per group, as the optimizer stores them
    // (checkpoint_packed.h).
    std::vector<StEntry> e = packed ? packed_moment_entries(layout, m.optim_format.moments, StateKind::kAdamM)
                                    : entries(layout, kind_prefix(StateKind::kAdamM));
    std::vector<StEntry> v = packed ? packed_moment_entries(layout, m.optim_format.moments, StateKind::kAdamV)
                                    : entries(layout, kind_prefix(StateKind::kAdamV));
    e.insert(e.end(), v.begin(), v.end());
    SafetensorsStreamWriter w((dir / kOptimizerFile).string(), e,
                              {{"format", "fuyou-optimizer"}, {"step", std::to_string(progress.step)},
                               {"moments", moment_format_name(m.optim_format.moments)}});
    if (io.write) w.set_write_function(io.write);
    for (StateKind k : {StateKind::kAdamM, StateKind::kAdamV})
      m.group_xxh3[k == StateKind::kAdamM ? 1 : 2] =
          packed ? write_packed_moments(engine, layout, w, k) : write_kind(engine, layout, w, k, kind_prefix(k));
    w.finish();
  }
  for (const char* name : {kEngineConfigFile, "model.safetensors", kOptimizerFile})
    m.files.push_back({name, fs::file_size(dir / name)});
  const std::string text = manifest_json(m).dump(2) + "\n";
  write_file_atomic((dir / kManifestFile).string(), text.data(), text.size());
  return m;
}

}  // namespace

uint64_t checkpoint_bytes(const ModelConfig& model) {
  const ParamLayout layout = make_gpt_layout(model);
  // Three fp32 copies, and headers: a few hundred bytes per tensor name and shape.
  return 12ull * layout.num_params() + 512ull * 3 * layout.tensors.size() + (1u << 16);
}

SavedCheckpoint save_checkpoint(const std::string& run_dir, const Config& cfg, TrainEngine& engine,
                                const TrainProgress& progress, const DataIdentity& data, const CheckpointIo& io) {
  const auto t0 = std::chrono::steady_clock::now();
  const fs::path root = fs::path(run_dir) / kCheckpointsDir;
  const std::string name = step_dir_name(progress.step);
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) throw IoError(str(root.string(), ": cannot create the checkpoints directory: ", ec.message()));
  const fs::path staging = root / str(".staging-", name, "-", ::getpid());
  fs::remove_all(staging, ec);
  fs::create_directory(staging, ec);
  if (ec) throw IoError(str(staging.string(), ": cannot create: ", ec.message()));
  SavedCheckpoint out;
  try {
    CheckpointManifest m = write_files(staging, cfg, engine, progress, data, io);
    for (const auto& f : m.files) out.bytes += f.bytes;
    // The base model's config.json and tokenizer, for to-hf and fuyou-generate.
    copy_carried_files(run_dir, staging.string());
    fsync_dir(staging.string());
    out.dir = commit_staging(root.string(), staging.string(), name);
  } catch (...) {
    fs::remove_all(staging, ec);  // the previous checkpoints and `latest` were not touched
    throw;
  }
  write_latest(root.string(), name);
  out.pruned = prune_checkpoints(run_dir, cfg.checkpoint.keep);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

CheckpointManifest read_checkpoint_manifest(const std::string& dir) {
  const fs::path path = fs::path(dir) / kManifestFile;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_text_file(path.string()));
  } catch (const nlohmann::json::exception& e) {
    throw IoError(str(path.string(), ": not valid JSON: ", e.what()));
  }
  CheckpointManifest m;
  try {
    if (j.at("format").get<std::string>() != "fuyou-checkpoint")
      throw IoError(str(path.string(), ": format '", j.at("format").get<std::string>(), "' is not fuyou-checkpoint"));
    m.version = j.at("version").get<int>();
    if (m.version != kCheckpointVersion)
      throw IoError(str(path.string(), ": version ", m.version, "; this build reads version ", kCheckpointVersion));
    m.step = j.at("step").get<int64_t>();
    m.micro_batch_in_step = j.at("micro_batch_in_step").get<int>();
    m.engine = j.at("engine").get<std::string>();
    m.counters.adam_step = j.at("adam_step").get<int64_t>();
    if (!j.at("loss_scale").is_null()) {
      m.counters.has_loss_scale = true;
      m.counters.loss_scale = {j["loss_scale"].at("scale").get<double>(), j["loss_scale"].at("clean_steps").get<int64_t>(),
                               j["loss_scale"].at("skipped_steps").get<int64_t>()};
    }
    m.progress.step = m.step;
    m.progress.sampler_position = j.at("sampler_position").get<uint64_t>();
    m.progress.first_val_loss = j.at("first_val_loss").get<double>();
    m.progress.last_val_loss = j.at("last_val_loss").get<double>();
    m.progress.train_seconds = j.at("train_seconds").get<double>();
    m.data.train = split_from_json(j.at("data").at("train"));
    m.data.val = split_from_json(j.at("data").at("val"));
    m.created = j.at("created").get<std::string>();
    for (const auto& f : j.at("files")) m.files.push_back({f.at("name").get<std::string>(), f.at("bytes").get<uint64_t>()});
    for (const char* k : {"master", "adam_m", "adam_v"})
      m.group_xxh3.push_back(j.at("group_xxh3").at(k).get<std::vector<std::string>>());
    // Written since the optimizer's state could be packed; absent: fp32.
    if (j.contains("optimizer_state")) {
      const auto& os = j.at("optimizer_state");
      m.optim_format = optim_format_from_names(os.at("moments").get<std::string>(), os.at("master").get<std::string>());
      if (os.at("block").get<uint64_t>() != kStateBlock)
        throw IoError(str(path.string(), ": optimizer_state.block is ", os.at("block").get<uint64_t>(),
                          "; this build's int8 blocks are ", kStateBlock, " elements"));
    }
  } catch (const nlohmann::json::exception& e) {
    throw IoError(str(path.string(), ": ", e.what()));
  }
  if (m.step < 0 || m.micro_batch_in_step != 0)
    throw IoError(str(path.string(), ": step ", m.step, ", micro-batch ", m.micro_batch_in_step, " cannot be resumed"));
  for (const auto& f : m.files) {
    std::error_code ec;
    const uint64_t size = fs::file_size(fs::path(dir) / f.name, ec);
    if (ec || size != f.bytes)
      throw IoError(str(dir, "/", f.name, ": ", ec ? ec.message() : str(size, " bytes"), "; the manifest says ",
                        f.bytes, " bytes (the checkpoint was damaged or copied incompletely)"));
  }
  return m;
}

Config read_checkpoint_config(const std::string& dir) {
  return load_config_file((fs::path(dir) / kEngineConfigFile).string());
}

void restore_checkpoint(const std::string& dir, const CheckpointManifest& m, const ModelConfig& model,
                        TrainEngine& engine) {
  const ParamLayout layout = make_gpt_layout(model);
  for (const auto& sums : m.group_xxh3)
    if (sums.size() != layout.groups.size())
      throw IoError(str(dir, "/", kManifestFile, ": ", sums.size(), " group checksums for a model of ",
                        layout.groups.size(), " parameter groups"));
  RangedTensorFile weights((fs::path(dir) / "model.safetensors").string());
  RangedTensorFile optim((fs::path(dir) / kOptimizerFile).string());
  // Moments in the engine's format are restored as stored; in another they are converted
  // (fp32 to packed: the engine encodes; packed to anything else: decoded here first).
  const MomentFormat file_moments = m.optim_format.moments;
  if (m.optim_format != engine.optim_format())
    spdlog::info("resume: {} holds {} moments and a {} master; converting to this run's {} / {} "
                 "(optimizer.state / optimizer.master)",
                 dir, moment_format_name(file_moments), master_format_name(m.optim_format.master),
                 moment_format_name(engine.optim_format().moments), master_format_name(engine.optim_format().master));
  const bool packed = file_moments != MomentFormat::kF32;
  std::vector<GroupTensorReader> readers;
  readers.emplace_back(weights, layout, "");
  if (!packed) {
    readers.emplace_back(optim, layout, kind_prefix(StateKind::kAdamM));
    readers.emplace_back(optim, layout, kind_prefix(StateKind::kAdamV));
  }
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    for (int k = 0; k < 3; ++k) {  // master, then both moments: each written once
      std::string sum;
      if (k > 0 && packed) {
        sum = restore_packed_moment(engine, optim, layout, static_cast<int>(g), kKinds[k], file_moments);
      } else {
        engine.write_state(static_cast<int>(g), kKinds[k], readers[k].group_source(static_cast<int>(g)));
        sum = readers[k].finish_group();
      }
      if (sum != m.group_xxh3[k][g])
        throw IoError(str(dir, ": ", state_kind_name(kKinds[k]), " of parameter group ", layout.groups[g].name,
                          " has checksum ", sum, " but the manifest says ", m.group_xxh3[k][g],
                          " (the checkpoint is damaged)"));
    }
  }
  engine.set_counters(m.counters);
}

}  // namespace fuyou
