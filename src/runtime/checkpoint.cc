// Writing and reading training-state checkpoints (include/fuyou/checkpoint.h). The directory
// handling (staging, latest, pruning, leftovers) is in checkpoint_dirs.cc; the comparison of
// a resume's config and data with the checkpoint's in resume_check.cc.
#include "fuyou/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <ctime>
#include <filesystem>

#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/hf_checkpoint.h"
#include "fuyou/log.h"
#include "fuyou/lora.h"
#include "fuyou/model.h"
#include "fuyou/read_file.h"
#include "fuyou/safetensors.h"
#include "fuyou/timing.h"
#include "src/common/xxh3.h"
#include "src/runtime/checkpoint_dirs.h"
#include "src/runtime/checkpoint_manifest.h"
#include "src/runtime/checkpoint_packed.h"
#include "src/runtime/checkpoint_tensors.h"

namespace fs = std::filesystem;

namespace fuyou {
namespace {

constexpr StateKind kKinds[] = {StateKind::kMaster, StateKind::kAdamM, StateKind::kAdamV};

// manifest.json and config.yaml are a few KiB; anything near this is not a checkpoint's.
constexpr uint64_t kMaxManifestBytes = 16ull << 20;

std::string utc_now() {
  std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return buf;
}

std::vector<StEntry> entries(const ParamLayout& layout, const std::string& prefix) {
  std::vector<StEntry> out;
  for (const TensorSpec& t : layout.tensors)
    out.push_back({prefix + t.name, StDtype::kF32, t.shape});
  return out;
}

// Streams every group of one kind into `w` (entries `prefix` + name) and returns the
// groups' checksums.
std::vector<std::string> write_kind(TrainEngine& engine, const ParamLayout& layout,
                                    SafetensorsStreamWriter& w, StateKind kind,
                                    const std::string& prefix) {
  GroupTensorWriter gw(w, layout, prefix);
  std::vector<std::string> sums;
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    engine.read_state(static_cast<int>(g), kind, gw.group_sink(static_cast<int>(g)));
    sums.push_back(gw.finish_group());
  }
  return sums;
}

std::string kind_prefix(StateKind k) {
  return k == StateKind::kMaster ? "" : std::string(state_kind_name(k)) + ".";
}

// The files of one checkpoint, written into `dir` (the staging directory).
CheckpointManifest write_files(const fs::path& dir, const Config& cfg, TrainEngine& engine,
                               const TrainProgress& progress, const DataIdentity& data,
                               const CheckpointIo& io) {
  const ParamLayout layout = checkpoint_layout(cfg);
  const std::string yaml = config_to_self_contained_yaml(cfg);
  CheckpointManifest m;
  m.base_xxh3 = engine.base_xxh3();
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
                              {{"format", "fuyou"},
                               {"step", std::to_string(progress.step)},
                               {"config", yaml},
                               {kVersionMetadataKey, std::to_string(kCheckpointVersion)}});
    if (io.write) w.set_write_function(io.write);
    m.group_xxh3[0] = write_kind(engine, layout, w, StateKind::kMaster, "");
    w.finish();
  }
  {
    // fp32 moments per tensor; packed ones per group, as the optimizer stores them
    // (checkpoint_packed.h).
    std::vector<StEntry> e =
        packed ? packed_moment_entries(layout, m.optim_format.moments, StateKind::kAdamM)
               : entries(layout, kind_prefix(StateKind::kAdamM));
    std::vector<StEntry> v =
        packed ? packed_moment_entries(layout, m.optim_format.moments, StateKind::kAdamV)
               : entries(layout, kind_prefix(StateKind::kAdamV));
    e.insert(e.end(), v.begin(), v.end());
    SafetensorsStreamWriter w((dir / kOptimizerFile).string(), e,
                              {{"format", "fuyou-optimizer"},
                               {"step", std::to_string(progress.step)},
                               {"moments", moment_format_name(m.optim_format.moments)},
                               {kVersionMetadataKey, std::to_string(kCheckpointVersion)}});
    if (io.write) w.set_write_function(io.write);
    for (StateKind k : {StateKind::kAdamM, StateKind::kAdamV})
      m.group_xxh3[k == StateKind::kAdamM ? 1 : 2] =
          packed ? write_packed_moments(engine, layout, w, k)
                 : write_kind(engine, layout, w, k, kind_prefix(k));
    w.finish();
  }
  for (const char* name : {kEngineConfigFile, "model.safetensors", kOptimizerFile})
    m.files.push_back({name, fs::file_size(dir / name)});
  const std::string text = manifest_text(m, hex64(xxh3_64(yaml.data(), yaml.size())));
  write_file_atomic((dir / kManifestFile).string(), text.data(), text.size());
  return m;
}

}  // namespace

namespace {
constexpr uint64_t kHeaderEntryBytes = 256;
}  // namespace

ParamLayout checkpoint_layout(const Config& cfg) {
  return cfg.lora.enabled() ? make_lora_layout(cfg.model, cfg.lora).params
                            : make_gpt_layout(cfg.model);
}

namespace {

uint64_t layout_weights_bytes(const ParamLayout& layout) {
  // fp32 tensors and a header entry per tensor (name, shape, offsets and checksum: 100-150
  // bytes in practice; 256 counted).
  return 4ull * layout.num_params() + kHeaderEntryBytes * layout.tensors.size() + (1u << 16);
}

uint64_t layout_checkpoint_bytes(const ParamLayout& layout, const OptimFormat& format) {
  // The moments as stored (fp32 per tensor; packed per group, int8 with a scale entry each),
  // with headers of the same few hundred bytes per entry.
  const uint64_t entries = format.moments == MomentFormat::kF32    ? 2 * layout.tensors.size()
                           : format.moments == MomentFormat::kInt8 ? 4 * layout.groups.size()
                                                                   : 2 * layout.groups.size();
  uint64_t moments = 0;
  for (const auto& g : layout.groups) moments += 2 * moment_bytes(format.moments, g.numel);
  return layout_weights_bytes(layout) + moments + kHeaderEntryBytes * entries + (1u << 16);
}

}  // namespace

uint64_t weights_file_bytes(const ModelConfig& model) {
  return layout_weights_bytes(make_gpt_layout(model));
}
uint64_t checkpoint_bytes(const ModelConfig& model, const OptimFormat& format) {
  return layout_checkpoint_bytes(make_gpt_layout(model), format);
}
uint64_t weights_file_bytes(const Config& cfg) {
  return layout_weights_bytes(checkpoint_layout(cfg));
}
uint64_t checkpoint_bytes(const Config& cfg) {
  return layout_checkpoint_bytes(checkpoint_layout(cfg), optim_format(cfg.optimizer));
}

SavedCheckpoint save_checkpoint(const std::string& run_dir, const Config& cfg, TrainEngine& engine,
                                const TrainProgress& progress, const DataIdentity& data,
                                const CheckpointIo& io) {
  const auto t0 = std::chrono::steady_clock::now();
  const fs::path root = fs::path(run_dir) / kCheckpointsDir;
  const std::string name = step_dir_name(progress.step);
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec)
    throw IoError(str(root.string(), ": cannot create the checkpoints directory: ", ec.message()));
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
  out.pruned = prune_checkpoints(run_dir, cfg.checkpoint.keep, cfg.checkpoint.keep_best);
  out.seconds = seconds_since(t0);
  return out;
}

struct CheckpointSource::Impl {
  std::string dir;
  CheckpointManifest manifest;
  std::string config_text;
  Config config;
  std::unique_ptr<RangedTensorFile> weights, optimizer;
};

CheckpointSource::CheckpointSource(const std::string& dir) : impl_(std::make_unique<Impl>()) {
  Impl& c = *impl_;
  c.dir = dir;
  const fs::path d(dir);
  // Everything is opened before anything is checked: once open, the files stay readable
  // even if the directory is pruned (renamed, its files unlinked) under us.
  const std::string manifest_path = (d / kManifestFile).string();
  const std::string config_path = (d / kEngineConfigFile).string();
  const std::string manifest =
      read_file_bounded(manifest_path, kMaxManifestBytes, "checkpoint manifest");
  c.config_text = read_file_bounded(config_path, kMaxManifestBytes, "checkpoint config");
  c.weights = std::make_unique<RangedTensorFile>((d / "model.safetensors").string());
  c.optimizer = std::make_unique<RangedTensorFile>((d / kOptimizerFile).string());
  ParsedManifest p = parse_manifest(manifest, manifest_path);
  check_manifest_version(p, dir, c.weights->reader().metadata(), c.optimizer->reader().metadata(),
                         c.config_text);
  c.manifest = std::move(p.manifest);
  const std::string config_sum = hex64(xxh3_64(c.config_text.data(), c.config_text.size()));
  if (!p.config_xxh3.empty() && config_sum != p.config_xxh3)
    throw IoError(str(
        config_path, ": checksum ", config_sum, " but the manifest records ", p.config_xxh3,
        " (config.yaml was edited or damaged; a resume changes what it may change with --set or "
        "--config, never by editing a checkpoint)"));
  for (const CheckpointFile& f : c.manifest.files) {
    const uint64_t size = f.name == kEngineConfigFile ? c.config_text.size()
                          : f.name == kOptimizerFile  ? c.optimizer->size()
                                                      : c.weights->size();
    if (size != f.bytes)
      throw IoError(str(dir, "/", f.name, ": ", size, " bytes; the manifest says ", f.bytes,
                        " bytes (the checkpoint was damaged or copied incompletely)"));
  }
  c.config = parse_config(c.config_text, config_path);
  check_manifest_against(c.manifest, dir, c.config);
}

CheckpointSource::~CheckpointSource() = default;
const std::string& CheckpointSource::dir() const { return impl_->dir; }
const CheckpointManifest& CheckpointSource::manifest() const { return impl_->manifest; }
const Config& CheckpointSource::config() const { return impl_->config; }
const std::string& CheckpointSource::config_text() const { return impl_->config_text; }

void CheckpointSource::restore(const ModelConfig& model, TrainEngine& engine,
                               const std::function<void()>& between_groups) const {
  const Impl& c = *impl_;
  const CheckpointManifest& m = c.manifest;
  // The checkpoint's own lora section (a resume may not change it: check_resume_config).
  Config shape = c.config;
  shape.model = model;
  const ParamLayout layout = checkpoint_layout(shape);
  check_resume_base(m, c.dir, model, engine);
  for (const auto& sums : m.group_xxh3)
    if (sums.size() != layout.groups.size())
      throw IoError(str(c.dir, "/", kManifestFile, ": ", sums.size(),
                        " group checksums for a model of ", layout.groups.size(),
                        " parameter groups"));
  // Moments in the engine's format are restored as stored; in another they are converted
  // (fp32 to packed: the engine encodes; packed to anything else: decoded here first).
  const MomentFormat file_moments = m.optim_format.moments;
  if (m.optim_format != engine.optim_format())
    spdlog::info(
        "resume: {} holds {} moments and a {} master; converting to this run's {} / {} "
        "(optimizer.state / optimizer.master)",
        c.dir, moment_format_name(file_moments), master_format_name(m.optim_format.master),
        moment_format_name(engine.optim_format().moments),
        master_format_name(engine.optim_format().master));
  const bool packed = file_moments != MomentFormat::kF32;
  std::vector<GroupTensorReader> readers;
  readers.emplace_back(*c.weights, layout, "");
  if (!packed) {
    readers.emplace_back(*c.optimizer, layout, kind_prefix(StateKind::kAdamM));
    readers.emplace_back(*c.optimizer, layout, kind_prefix(StateKind::kAdamV));
  }
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    if (between_groups) between_groups();
    for (int k = 0; k < 3; ++k) {  // master, then both moments: each written once
      std::string sum;
      if (k > 0 && packed) {
        sum = restore_packed_moment(engine, *c.optimizer, layout, static_cast<int>(g), kKinds[k],
                                    file_moments);
      } else {
        engine.write_state(static_cast<int>(g), kKinds[k],
                           readers[k].group_source(static_cast<int>(g)));
        sum = readers[k].finish_group();
      }
      if (sum != m.group_xxh3[k][g])
        throw IoError(str(c.dir, ": ", state_kind_name(kKinds[k]), " of parameter group ",
                          layout.groups[g].name, " has checksum ", sum, " but the manifest says ",
                          m.group_xxh3[k][g], " (the checkpoint is damaged)"));
    }
  }
  engine.set_counters(m.counters);
}

void check_resume_base(const CheckpointManifest& m, const std::string& dir,
                       const ModelConfig& model, const TrainEngine& engine) {
  if (m.base_xxh3 == engine.base_xxh3()) return;
  throw ConfigError(
      m.base_xxh3.empty()
          ? str("resume: ", dir, " is a full fine-tune's checkpoint, and this run is LoRA")
      : engine.base_xxh3().empty()
          ? str("resume: ", dir, " is a LoRA run's checkpoint, and this run is not LoRA")
          : str("resume: ", dir, " holds adapters trained over a base of checksum ", m.base_xxh3,
                " (", kManifestFile, " lora_base_xxh3), but model.checkpoint ", model.checkpoint,
                " now holds a base of checksum ", engine.base_xxh3(),
                ": a LoRA run resumes only on the base it was trained over (put that base back, "
                "or start a new run with lora.init: a PEFT directory of these adapters)"));
}

std::shared_ptr<const CheckpointSource> open_resume_checkpoint(const std::string& path) {
  for (int attempt = 1;; ++attempt) {
    const std::string dir = resolve_checkpoint(path);
    try {
      return std::make_shared<const CheckpointSource>(dir);
    } catch (const Error& e) {
      std::error_code ec;
      // Gone since `latest` named it: its run pruned it after writing a newer one.
      if (!fs::exists(dir, ec) && attempt < 10 &&
          dir != fs::path(path).lexically_normal().string()) {
        spdlog::info(
            "checkpoints: {} was removed while being opened (its run is pruning); reading latest "
            "again",
            dir);
        continue;
      }
      throw IoError(str(e.what(), earlier_checkpoint_hint(dir)));
    }
  }
}

std::string earlier_checkpoint_hint(const std::string& checkpoint_dir) {
  fs::path p = fs::path(checkpoint_dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  const int64_t step = step_of(p.filename().string());
  std::string earlier;
  for (const std::string& c : list_checkpoints(checkpoint_run_dir(checkpoint_dir)))
    if (step < 0 || step_of(fs::path(c).filename().string()) < step) earlier = c;
  if (earlier.empty()) return "";
  return str("; an earlier complete checkpoint of the run: ", earlier,
             " (resume from it with fuyou-train --resume ", earlier, ")");
}

CheckpointManifest read_checkpoint_manifest(const std::string& dir) {
  return CheckpointSource(dir).manifest();
}

Config read_checkpoint_config(const std::string& dir) { return CheckpointSource(dir).config(); }

void restore_checkpoint(const std::string& dir, const CheckpointManifest& m,
                        const ModelConfig& model, TrainEngine& engine) {
  CheckpointSource src(dir);
  (void)m;  // the source's own, read from the same files
  src.restore(model, engine);
}

}  // namespace fuyou
