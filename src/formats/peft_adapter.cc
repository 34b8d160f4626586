#include "fuyou/peft_adapter.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "fuyou/error.h"
#include "fuyou/read_file.h"
#include "fuyou/safetensors.h"

namespace fuyou {
namespace {

constexpr uint64_t kMaxAdapterConfigBytes = 1 << 20;

std::string config_path(const std::string& dir) { return dir + "/adapter_config.json"; }
std::string tensors_path(const std::string& dir) { return dir + "/adapter_model.safetensors"; }

[[noreturn]] void refuse(const std::string& dir, const std::string& why) {
  throw ConfigError(str("lora.init '", dir, "': ", why));
}

}  // namespace

void read_peft_adapter(const std::string& dir, const LoraConfig& lora, const ModelConfig& model,
                       const LoraLayout& layout, float* params) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(
        read_file_bounded(config_path(dir), kMaxAdapterConfigBytes, "adapter config"));
  } catch (const nlohmann::json::exception& e) {
    refuse(dir, str("adapter_config.json is not JSON: ", e.what()));
  } catch (const IoError& e) {
    refuse(dir, e.what());
  }
  auto field = [&](const char* key) -> const nlohmann::json& {
    if (!j.contains(key)) refuse(dir, str("adapter_config.json has no '", key, "'"));
    return j[key];
  };
  if (field("peft_type") != "LORA")
    refuse(dir, str("peft_type is ", field("peft_type").dump(), ", not \"LORA\""));
  if (!field("r").is_number_integer() || field("r").get<int>() != lora.rank)
    refuse(dir, str("r is ", field("r").dump(), " but lora.rank is ", lora.rank));
  if (!field("lora_alpha").is_number() || field("lora_alpha").get<double>() != lora.alpha)
    refuse(dir,
           str("lora_alpha is ", field("lora_alpha").dump(), " but lora.alpha is ", lora.alpha));
  const bool rslora = j.value("use_rslora", false);
  if (rslora != lora.use_rslora)
    refuse(dir, str("use_rslora is ", rslora, " but lora.use_rslora is ", lora.use_rslora));
  if (j.value("bias", std::string("none")) != "none")
    refuse(dir, str("bias is ", j["bias"].dump(),
                    ": adapters with trained biases are not "
                    "supported (bias: none)"));
  if (j.contains("modules_to_save") && !j["modules_to_save"].is_null() &&
      !j["modules_to_save"].empty())
    refuse(dir,
           "modules_to_save is set: training whole modules beside the adapters is not "
           "supported yet");
  // Which modules the adapter's target_modules adapt, as PEFT matches them (a name equal to a
  // module's path or ending it after a dot; all-linear: every linear), against the run's.
  const nlohmann::json& tm = field("target_modules");
  std::vector<std::string> theirs;
  if (tm.is_string()) {
    theirs.push_back(tm.get<std::string>());
  } else if (tm.is_array()) {
    for (const auto& t : tm) {
      if (!t.is_string()) refuse(dir, str("target_modules holds ", t.dump(), ", not a name"));
      theirs.push_back(t.get<std::string>());
    }
  } else {
    refuse(dir, str("target_modules is ", tm.dump()));
  }
  LoraConfig all = lora;
  all.targets = {"all-linear"};
  const LoraLayout every = make_lora_layout(model, all);
  const std::string root = "base_model.model.";
  auto matched = [&](const std::vector<std::string>& targets) {
    std::set<std::string> out;
    for (const LoraAdapter& a : every.adapters)
      for (const LoraPart& p : a.parts) {
        const std::string path = p.peft_prefix.substr(root.size());
        for (const std::string& t : targets)
          if (t == "all-linear" || path == t ||
              (path.size() > t.size() && path.compare(path.size() - t.size(), t.size(), t) == 0 &&
               path[path.size() - t.size() - 1] == '.'))
            out.insert(path);
      }
    return out;
  };
  if (matched(theirs) != matched(lora.targets))
    refuse(dir, str(
                    "target_modules is ", tm.dump(), " but lora.targets is [",
                    [&] {
                      std::string t;
                      for (const std::string& x : lora.targets) t += (t.empty() ? "" : ", ") + x;
                      return t;
                    }(),
                    "]: they adapt different modules"));

  SafetensorsReader st(tensors_path(dir));
  const std::vector<PeftTensor> want = peft_tensors(layout);
  std::set<std::string> names;
  for (size_t i = 0; i < want.size(); ++i) {
    const PeftTensor& t = want[i];
    names.insert(t.name);
    if (!st.has(t.name)) refuse(dir, str("adapter_model.safetensors has no tensor ", t.name));
    const std::vector<float> v = st.read_f32(t.name, {t.rows, t.cols});
    set_peft_tensor(layout, i, params, v.data());
  }
  for (const StTensorInfo& t : st.tensors())
    if (!names.count(t.name))
      refuse(dir, str("adapter_model.safetensors has tensor ", t.name,
                      ", which this run's adapters do not have"));
}

void write_peft_adapter(const std::string& dir, const LoraConfig& lora, const ModelConfig& model,
                        const LoraLayout& layout, const float* params) {
  std::filesystem::create_directories(dir);
  nlohmann::json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["r"] = lora.rank;
  j["lora_alpha"] = lora.alpha;
  j["lora_dropout"] = lora.dropout;
  j["target_modules"] = lora_target_modules(model, lora);
  j["use_rslora"] = lora.use_rslora;
  j["bias"] = "none";
  j["fan_in_fan_out"] = model.family == "gpt2";  // GPT-2's Conv1D stores (in, out)
  j["modules_to_save"] = nullptr;
  j["inference_mode"] = true;
  j["base_model_name_or_path"] = nullptr;
  const std::string text = j.dump(2) + "\n";
  write_file_atomic(config_path(dir), text.data(), text.size());
  SafetensorsWriter w;
  const std::vector<PeftTensor> tensors = peft_tensors(layout);
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::vector<float> v(static_cast<size_t>(tensors[i].rows) * tensors[i].cols);
    get_peft_tensor(layout, i, params, v.data());
    w.add(tensors[i].name, StDtype::kF32, {tensors[i].rows, tensors[i].cols}, v.data());
  }
  w.set_metadata("format", "pt");
  w.write(tensors_path(dir));
}

}  // namespace fuyou
