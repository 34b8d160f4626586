// What a resume may change. The checkpoint's config and the resume's are compared key by
// key through their YAML form (config_to_yaml writes every key), so a key added to the
// config later is trajectory-defining, and refused on change, until it is listed here.
#include <xxhash.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <fstream>

#include "fuyou/checkpoint.h"
#include "fuyou/error.h"
#include "fuyou/log.h"
#include "src/common/xxh3.h"

namespace fuyou {
namespace {

bool changeable(const std::string& key) {
  const auto& keys = resume_changeable_keys();
  for (const auto& k : keys) {
    if (k == key) return true;
    if (k.size() > 2 && k.compare(k.size() - 2, 2, ".*") == 0 &&
        key.rfind(k.substr(0, k.size() - 1), 0) == 0)
      return true;
  }
  return false;
}

std::string flow(const YAML::Node& n) {
  YAML::Emitter e;
  e << YAML::Flow << n;
  return e.c_str();
}

}  // namespace

const std::vector<std::string>& resume_changeable_keys() {
  // Length of the run and what is only reported (validation, logging), where state lives and
  // how many threads run (both engines and every placement give the same bits for one thread
  // count), checkpointing itself, data paths (the data is compared by content instead), and
  // the directory the run was initialised from (the checkpoint holds the weights now), and the
  // optimizer's state format (a resume in another format converts the state:
  // docs/checkpoints.md).
  static const std::vector<std::string> keys = {"schedule.steps",
                                                "schedule.epochs",
                                                "schedule.eval_every",
                                                "schedule.eval_batches",
                                                "schedule.log_every",
                                                "schedule.sample_every",
                                                "schedule.sample_prompts",
                                                "schedule.sample_tokens",
                                                "offload.*",
                                                "runtime.threads",
                                                "runtime.backend",
                                                "checkpoint.*",
                                                "data.text",
                                                "data.train_shards",
                                                "data.val_shards",
                                                "model.checkpoint",
                                                "optimizer.placement",
                                                "optimizer.state",
                                                "optimizer.master"};
  return keys;
}

void check_resume_config(const Config& saved, const Config& now) {
  const YAML::Node a = YAML::Load(config_to_yaml(saved)), b = YAML::Load(config_to_yaml(now));
  for (const auto& section : a) {
    const std::string name = section.first.as<std::string>();
    for (const auto& kv : section.second) {
      const std::string key = name + "." + kv.first.as<std::string>();
      const YAML::Node other = b[name][kv.first.as<std::string>()];
      const std::string was = flow(kv.second), is = other ? flow(other) : "(absent)";
      if (was == is || changeable(key)) continue;
      throw ConfigError(str(
          "--resume: ", key, " is ", is, " but the checkpoint was trained with ", was,
          "; it changes the training trajectory, so a resume keeps it (keys that may change: ",
          [] {
            std::string s;
            for (const auto& k : resume_changeable_keys()) s += (s.empty() ? "" : ", ") + k;
            return s;
          }(),
          ")"));
    }
  }
}

Config resume_config(const CheckpointSource& checkpoint, const std::string& config_path,
                     const std::vector<std::string>& overrides) {
  Config cfg = config_path.empty() ? parse_config(checkpoint.config_text(),
                                                  checkpoint.dir() + "/config.yaml", overrides)
                                   : load_config_file(config_path, overrides);
  check_resume_config(checkpoint.config(), cfg);
  return cfg;
}

Config resume_config(const std::string& checkpoint_dir, const std::string& config_path,
                     const std::vector<std::string>& overrides) {
  return resume_config(CheckpointSource(checkpoint_dir), config_path, overrides);
}

DataSplitIdentity split_identity(const std::vector<int32_t>& tokens,
                                 const std::vector<uint8_t>& mask,
                                 const std::vector<std::string>& shard_paths,
                                 const std::vector<uint64_t>& records) {
  DataSplitIdentity s;
  s.tokens = tokens.size();
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  XXH3_64bits_update(st, tokens.data(), tokens.size() * sizeof(int32_t));
  XXH3_64bits_update(st, mask.data(), mask.size());
  XXH3_64bits_update(st, records.data(), records.size() * sizeof(uint64_t));
  s.xxh3 = hex64(XXH3_64bits_digest(st));
  XXH3_freeState(st);
  for (const auto& p : shard_paths) {
    std::ifstream in(p, std::ios::binary);
    std::string head(4096, '\0');
    in.read(head.data(), static_cast<std::streamsize>(head.size()));
    head.resize(static_cast<size_t>(in.gcount()));
    in.clear();
    in.seekg(0, std::ios::end);
    s.shards.push_back(
        {p, static_cast<uint64_t>(in.tellg()), hex64(XXH3_64bits(head.data(), head.size()))});
  }
  return s;
}

void check_resume_data(const DataIdentity& saved, const DataIdentity& now) {
  if (saved.train.tokens != now.train.tokens || saved.train.xxh3 != now.train.xxh3)
    throw ConfigError(str("--resume: the training data differs from the checkpoint's: ",
                          now.train.tokens, " tokens with XXH3 ", now.train.xxh3, " now, ",
                          saved.train.tokens, " tokens with XXH3 ", saved.train.xxh3,
                          " then (data.text / data.train_shards must hold the same tokens; "
                          "their paths may change)"));
  if (saved.val.tokens != now.val.tokens || saved.val.xxh3 != now.val.xxh3)
    spdlog::warn(
        "resume: the validation data differs from the checkpoint's ({} tokens now, {} then): "
        "validation losses after the resume are not comparable with those before it",
        now.val.tokens, saved.val.tokens);
}

}  // namespace fuyou
