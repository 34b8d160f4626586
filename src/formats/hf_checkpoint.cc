// Checkpoint conversion between Hugging Face directories (gpt2, opt, llama) and the engine's
// layout.
//
// Both directions run the same loop over hf_tensor_map(): validate every source tensor
// (present, float dtype, expected shape) and refuse unknown ones before anything is
// written, then copy tensor by tensor through fixed-size buffers, converting dtype and
// transposing Conv1D weights on the way. The output is assembled in a staging directory and
// renamed into place only when complete.
#include "fuyou/hf_checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "fuyou/error.h"
#include "fuyou/lora.h"
#include "fuyou/model.h"
#include "fuyou/peft_adapter.h"
#include "fuyou/safetensors.h"
#include "fuyou/tokenizer.h"
#include "src/formats/safetensors_stream.h"

namespace fs = std::filesystem;

namespace fuyou {
namespace {

// Bytes of fp32 staging per buffer. Three such buffers are alive while a tensor is copied,
// so conversion needs a few times this much memory whatever the model size.
constexpr size_t kChunkBytes = size_t{8} << 20;

std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw IoError(str(p.string(), ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void check_output_dir(const fs::path& out) {
  std::error_code ec;
  if (!fs::exists(out, ec)) return;
  if (!fs::is_directory(out, ec))
    throw IoError(str(out.string(), ": exists and is not a directory; choose a new output path"));
  if (!fs::is_empty(out, ec))
    throw IoError(str(out.string(),
                      ": exists and is not empty; refusing to overwrite (choose a "
                      "new output directory)"));
}

// The output is built in OUT.partial-PID beside OUT and renamed to OUT at the end; on any
// error the staging directory (which only we created) is removed.
class StagingDir {
 public:
  explicit StagingDir(fs::path out) : out_(std::move(out)) {
    check_output_dir(out_);
    std::error_code ec;
    fs::path parent = out_.parent_path();
    if (!parent.empty()) fs::create_directories(parent, ec);
    if (ec) throw IoError(str(parent.string(), ": cannot create: ", ec.message()));
    staging_ = out_;
    staging_ += str(".partial-", ::getpid());
    if (!fs::create_directory(staging_, ec) || ec)
      throw IoError(str(staging_.string(), ": cannot create staging directory",
                        ec ? ": " + ec.message() : std::string(" (it already exists)")));
  }
  ~StagingDir() {
    if (!committed_) {
      std::error_code ec;
      fs::remove_all(staging_, ec);
    }
  }
  StagingDir(const StagingDir&) = delete;
  StagingDir& operator=(const StagingDir&) = delete;

  const fs::path& path() const { return staging_; }

  void commit() {
    check_output_dir(out_);  // someone may have written there meanwhile
    std::error_code ec;
    if (fs::exists(out_, ec)) fs::remove(out_, ec);  // empty, checked above
    fs::rename(staging_, out_, ec);
    if (ec)
      throw IoError(
          str(out_.string(), ": rename from ", staging_.string(), " failed: ", ec.message()));
    committed_ = true;
  }

 private:
  fs::path out_;
  fs::path staging_;
  bool committed_ = false;
};

fs::path normalized_out(const std::string& out_dir) {
  fs::path p = fs::path(out_dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();  // "out/" -> "out"
  if (p.empty()) throw IoError("--out: empty output path");
  return p;
}

// One source tensor range copied into (part of) one destination tensor. Consecutive jobs
// with the same dst fill it in order (packed q|k|v, gate|up).
struct Job {
  std::string src;
  std::string dst;
  bool transpose = false;
  std::vector<int64_t> src_shape;  // the whole source tensor
  std::vector<int64_t> dst_shape;  // the whole destination tensor
  size_t src_offset = 0;           // elements into the source tensor
  size_t numel = 0;                // elements copied
};

size_t numel_of(const std::vector<int64_t>& shape) {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

void validate_sources(const TensorSet& set, const std::vector<Job>& jobs) {
  for (const Job& j : jobs) {
    if (!set.has(j.src))
      throw IoError(str(set.source(), ": missing tensor '", j.src, "' (expected shape ",
                        shape_str(j.src_shape), ")"));
    const StTensorInfo& t = set.info(j.src);
    const std::string& file = set.file(j.src).path();
    if (!is_float_dtype(t.dtype))
      throw IoError(str(file, ": tensor '", j.src, "' has dtype ", st_dtype_name(t.dtype),
                        "; expected F32, F16 or BF16"));
    if (t.shape != j.src_shape)
      throw IoError(str(file, ": tensor '", j.src, "' has shape ", shape_str(t.shape),
                        " but the config needs ", shape_str(j.src_shape)));
  }
}

// Buffers reused across tensors: the largest chunk seen sets their size.
struct Buffers {
  std::vector<char> raw;
  std::vector<float> f32;
  std::vector<float> t32;
  std::vector<char> out;
};

// A weight that is NaN or infinite makes every loss NaN from the first step (and an export a
// broken model): refused, naming the tensor and the element, before the file is complete.
void check_finite(const void* data, StDtype dtype, size_t n, const Job& job, size_t first) {
  for (size_t i = 0; i < n; ++i) {
    bool finite;
    if (dtype == StDtype::kF32) {
      uint32_t u;
      std::memcpy(&u, static_cast<const char*>(data) + 4 * i, 4);
      finite = (u & 0x7f800000u) != 0x7f800000u;
    } else {
      uint16_t h;
      std::memcpy(&h, static_cast<const char*>(data) + 2 * i, 2);
      finite = dtype == StDtype::kBF16 ? (h & 0x7f80u) != 0x7f80u : (h & 0x7c00u) != 0x7c00u;
    }
    if (!finite)
      throw IoError(str("tensor '", job.src, "' (written as '", job.dst, "'): element ", first + i,
                        " is NaN or infinite",
                        dtype == StDtype::kF32 ? "" : str(" as ", st_dtype_name(dtype)),
                        "; refusing to write a model with it"));
  }
}

// Where converted bytes go: a safetensors writer, or an array in memory.
using Append = std::function<void(const void* data, size_t bytes)>;

void copy_tensor(const TensorSet& set, const Job& job, StDtype out_dtype, const Append& append,
                 Buffers& b) {
  const StTensorInfo& t = set.info(job.src);
  const RangedTensorFile& file = set.file(job.src);
  const size_t in_size = st_dtype_size(t.dtype), out_size = st_dtype_size(out_dtype);
  if (!job.transpose) {
    const size_t n = job.numel;
    const size_t per_chunk = kChunkBytes / sizeof(float);
    for (size_t done = 0; done < n; done += per_chunk) {
      size_t k = std::min(per_chunk, n - done);
      b.raw.resize(std::max(b.raw.size(), k * in_size));
      b.out.resize(std::max(b.out.size(), k * out_size));
      file.read(t, (job.src_offset + done) * in_size, b.raw.data(), k * in_size);
      convert_float_elements(b.raw.data(), t.dtype, b.out.data(), out_dtype, k);
      check_finite(b.out.data(), out_dtype, k, job, job.src_offset + done);
      append(b.out.data(), k * out_size);
    }
    return;
  }
  // Source (R, K) -> destination (K, R), a block of destination rows at a time. A block is
  // a column slice of the source: one read per source row, or one read in all when the
  // block covers every column.
  const size_t R = static_cast<size_t>(job.src_shape[0]), K = static_cast<size_t>(job.src_shape[1]);
  const size_t block =
      std::max<size_t>(1, std::min(K, kChunkBytes / sizeof(float) / std::max<size_t>(R, 1)));
  for (size_t c0 = 0; c0 < K; c0 += block) {
    const size_t nb = std::min(block, K - c0);
    const size_t n = R * nb;
    b.raw.resize(std::max(b.raw.size(), n * in_size));
    b.f32.resize(std::max(b.f32.size(), n));
    b.t32.resize(std::max(b.t32.size(), n));
    b.out.resize(std::max(b.out.size(), n * out_size));
    if (nb == K) {
      file.read(t, 0, b.raw.data(), n * in_size);
    } else {
      for (size_t i = 0; i < R; ++i)
        file.read(t, (i * K + c0) * in_size, b.raw.data() + i * nb * in_size, nb * in_size);
    }
    convert_float_elements(b.raw.data(), t.dtype, b.f32.data(), StDtype::kF32, n);
    for (size_t i = 0; i < R; ++i)
      for (size_t j = 0; j < nb; ++j) b.t32[j * R + i] = b.f32[i * nb + j];
    convert_float_elements(b.t32.data(), StDtype::kF32, b.out.data(), out_dtype, n);
    check_finite(b.out.data(), out_dtype, n, job, c0 * R);
    append(b.out.data(), n * out_size);
  }
}

// Every source tensor against the checksum its file records (files the engine wrote record
// them), before anything is written: a damaged checkpoint is refused, not converted. Each
// tensor is read once more for this; it is then in the page cache for the conversion.
void verify_sources(const TensorSet& set, const std::vector<Job>& jobs) {
  std::set<std::string> done;
  for (const Job& j : jobs)
    if (done.insert(j.src).second) set.verify(j.src);
}

// Writes every job's tensor into `dir`, returning the files written.
std::vector<std::string> write_tensors(const TensorSet& set, const std::vector<Job>& jobs,
                                       StDtype out_dtype, const fs::path& dir,
                                       const ConvertOptions& opts,
                                       const std::map<std::string, std::string>& metadata,
                                       uint64_t* bytes) {
  std::vector<StEntry> entries;
  std::vector<size_t> filled;  // elements the jobs put into each entry
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Job& j = jobs[i];
    if (i == 0 || jobs[i - 1].dst != j.dst) {
      entries.push_back({j.dst, out_dtype, j.dst_shape});
      filled.push_back(0);
    }
    filled.back() += j.numel;
  }
  for (size_t e = 0; e < entries.size(); ++e)
    FY_CHECK(filled[e] == numel_of(entries[e].shape), "tensor map: '", entries[e].name, "' gets ",
             filled[e], " elements, needs ", numel_of(entries[e].shape));
  *bytes = 0;
  for (const auto& e : entries) *bytes += e.bytes();
  ShardedSafetensorsWriter w(dir.string(), entries, opts.max_shard_bytes, metadata);
  Buffers buffers;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (opts.progress) opts.progress(i, jobs.size(), jobs[i].dst);
    if (i == 0 || jobs[i - 1].dst != jobs[i].dst) w.begin_tensor(jobs[i].dst);
    copy_tensor(
        set, jobs[i], out_dtype, [&](const void* p, size_t n) { w.append(p, n); }, buffers);
  }
  return w.finish();
}

bool is_layer_buffer(const std::string& name, const std::string& prefix) {
  // h.{l}.attn.bias and h.{l}.attn.masked_bias are the causal-mask buffers older
  // transformers versions saved; they hold no weights.
  if (name.compare(0, prefix.size() + 2, prefix + "h.") != 0) return false;
  size_t i = prefix.size() + 2, digits = 0;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9') ++i, ++digits;
  if (digits == 0) return false;
  std::string rest = name.substr(i);
  return rest == ".attn.bias" || rest == ".attn.masked_bias";
}

// A checkpoint whose config.json ties the head but whose lm_head.weight differs from the
// embedding: transformers 5 then keeps the two apart (it does not tie them), so converting it
// as tied would train another model. Refused, naming the fix.
void refuse_untied_head(const TensorSet& set, const std::vector<Job>& jobs,
                        const std::string& head) {
  const Job* wte = nullptr;
  for (const Job& j : jobs)
    if (j.dst == "wte.weight") wte = &j;
  FY_CHECK(wte, "no job fills wte.weight");
  const StTensorInfo &h = set.info(head), &e = set.info(wte->src);
  bool same = h.dtype == e.dtype && h.shape == e.shape && h.end - h.begin == e.end - e.begin;
  constexpr uint64_t kChunk = 16ull << 20;
  std::vector<char> a, b;
  for (uint64_t off = 0; same && off < h.end - h.begin; off += kChunk) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, h.end - h.begin - off));
    a.resize(n);
    b.resize(n);
    set.file(head).read(h, off, a.data(), n);
    set.file(wte->src).read(e, off, b.data(), n);
    same = std::memcmp(a.data(), b.data(), n) == 0;
  }
  if (!same)
    throw IoError(str(set.file(head).path(), ": tensor '", head, "' differs from '", wte->src,
                      "' although config.json says tie_word_embeddings: true; transformers then "
                      "keeps the two apart. Set tie_word_embeddings to false in config.json to "
                      "convert the head as it is"));
}

void refuse_unknown(const TensorSet& set, const std::vector<Job>& jobs, const std::string& prefix,
                    const ModelConfig& m, bool hf_side) {
  std::set<std::string> expected;
  for (const Job& j : jobs) expected.insert(j.src);
  for (const std::string& name : set.names()) {
    if (expected.count(name)) continue;
    if (hf_side && is_layer_buffer(name, prefix)) continue;
    // Older Llama checkpoints saved the rotary frequencies, which the config determines.
    if (hf_side && name.ends_with(".self_attn.rotary_emb.inv_freq")) continue;
    if (hf_side && m.tie_embeddings &&
        (name == "lm_head.weight" || name == prefix + "lm_head.weight")) {
      // The LM head is tied to wte (config.json says so, or parse_hf_config refused it);
      // transformers ties it on load when the file's head equals the embedding, and so do we.
      const StTensorInfo& t = set.info(name);
      std::vector<int64_t> want = {m.vocab_size, m.d_model};
      if (t.shape != want)
        throw IoError(str(set.file(name).path(), ": tensor '", name, "' has shape ",
                          shape_str(t.shape), " but a tied LM head is ", shape_str(want)));
      refuse_untied_head(set, jobs, name);
      continue;
    }
    const char* family = m.family == "gpt2" ? "GPT-2" : m.family == "opt" ? "OPT" : "Llama";
    throw IoError(str(set.file(name).path(), ": tensor '", name, "' is not part of a ", family,
                      " model with n_layer=", m.n_layer,
                      m.family == "opt" && name.find("project_") != std::string::npos
                          ? " (OPT's project_in/project_out are not supported)"
                          : "",
                      "; refusing to drop it silently"));
  }
}

void copy_through(const fs::path& from_dir, const fs::path& to_dir,
                  const std::vector<std::pair<std::string, std::string>>& names,
                  std::vector<std::string>* copied) {
  for (const auto& [from, to] : names) {
    std::error_code ec;
    fs::path src = from_dir / from;
    if (!fs::is_regular_file(src, ec)) continue;
    fs::copy_file(src, to_dir / to, fs::copy_options::none, ec);
    if (ec)
      throw IoError(
          str(src.string(), ": cannot copy to ", (to_dir / to).string(), ": ", ec.message()));
    copied->push_back(to);
  }
}

std::vector<std::pair<std::string, std::string>> tokenizer_copies() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& n : tokenizer_file_names()) out.emplace_back(n, n);
  out.emplace_back(kGenerationConfigFile, kGenerationConfigFile);
  return out;
}

bool holds_carried_files(const fs::path& dir) {
  std::error_code ec;
  for (const auto& n : carried_file_names())
    if (fs::is_regular_file(dir / n, ec)) return true;
  return false;
}

void write_text(const fs::path& p, const std::string& text) {
  write_file_atomic(p.string(), text.data(), text.size());
}

// Runs the engine's own validation on a model section (engine limits, d_ff default).
ModelConfig validated(const ModelConfig& m, const std::string& source) {
  return parse_config(engine_config_yaml(m), source).model;
}

struct EngineSource {
  ModelConfig model;
  LoraConfig lora;  // a LoRA run's: its tensors are the adapters (make_lora_layout)
  TensorSet set;
  fs::path dir;  // where tokenizer files and hf_config.json are looked for
};

EngineSource open_engine_source(const std::string& checkpoint) {
  std::error_code ec;
  fs::path p(checkpoint);
  auto from_metadata = [](const TensorSet& set, Config* c) {
    auto it = set.metadata().find("config");
    if (it == set.metadata().end()) return false;
    *c = parse_config(it->second, set.source() + " (metadata 'config')");
    return true;
  };
  Config c;
  if (fs::is_directory(p, ec)) {
    TensorSet set = TensorSet::open_dir(p.string());
    fs::path yaml = p / kEngineConfigFile;
    if (fs::exists(yaml, ec))
      c = load_config_file(yaml.string());
    else if (!from_metadata(set, &c))
      throw ConfigError(str(checkpoint, ": no ", kEngineConfigFile, " and no 'config' entry in ",
                            set.source(), "'s metadata: cannot tell the model's shape"));
    return {c.model, c.lora, std::move(set), p};
  }
  if (!fs::is_regular_file(p, ec))
    throw IoError(str(checkpoint, ": no such checkpoint directory or safetensors file"));
  TensorSet set = TensorSet::open_file(p.string());
  fs::path yaml = p.parent_path() / kEngineConfigFile;
  if (!from_metadata(set, &c)) {
    if (!fs::exists(yaml, ec))
      throw ConfigError(str(checkpoint, ": no 'config' entry in the metadata and no ",
                            yaml.string(), ": cannot tell the model's shape"));
    c = load_config_file(yaml.string());
  }
  return {c.model, c.lora, std::move(set), p.parent_path()};
}

// A LoRA run's weights are its adapters: what reads a whole model from them says so.
void refuse_lora_weights(const EngineSource& src, const std::string& checkpoint,
                         const std::string& what) {
  if (!src.lora.enabled()) return;
  throw ConfigError(
      str(checkpoint, ": a LoRA run's weights are its adapters (its config has a lora ",
          "section of rank ", src.lora.rank, "), not a whole model; ", what,
          " does not apply adapters yet: export them with fuyou-convert to-hf (a "
          "PEFT adapter directory) and give the base model.checkpoint (docs/lora.md)"));
}

// A LoRA run's to-hf: its adapters (engine names, fp32) as a PEFT adapter directory
// (write_peft_adapter), which PeftModel.from_pretrained loads over the base.
ConvertResult export_peft_adapter(const EngineSource& src, const fs::path& out,
                                  const ConvertOptions& opts) {
  if (opts.dtype && *opts.dtype != StDtype::kF32)
    throw ConfigError(str("--dtype ", st_dtype_name(*opts.dtype),
                          ": a LoRA run exports its adapters as PEFT saves them, in fp32 (give "
                          "--dtype f32 or none; docs/lora.md)"));
  ConvertResult r;
  r.model = src.model;
  const LoraLayout layout = make_lora_layout(src.model, src.lora);
  const ParamLayout& pl = layout.params;
  std::vector<float> params(pl.total, 0.0f);
  for (const TensorSpec& t : pl.tensors) {
    if (!src.set.has(t.name))
      throw IoError(str(src.set.source(), ": missing adapter tensor '", t.name,
                        "' of the run's lora section"));
    const StTensorInfo& info = src.set.info(t.name);
    if (info.dtype != StDtype::kF32 || info.shape != t.shape)
      throw IoError(str(src.set.file(t.name).path(), ": adapter tensor '", t.name, "' is ",
                        st_dtype_name(info.dtype), " ", shape_str(info.shape),
                        "; the lora section ", "makes it F32 ", shape_str(t.shape)));
    src.set.file(t.name).read(info, 0, params.data() + t.offset, 4 * t.numel);
    src.set.check(t.name, params.data() + t.offset);
  }
  StagingDir stage(out);
  write_peft_adapter(stage.path().string(), src.lora, src.model, layout, params.data());
  stage.commit();
  r.tensors = peft_tensors(layout).size();
  r.bytes = 4 * pl.num_params();
  r.files = {"adapter_config.json", "adapter_model.safetensors"};
  r.dtype = StDtype::kF32;
  r.dtype_origin = "a LoRA run: its adapters as a PEFT adapter directory, fp32";
  return r;
}

// The jobs that read a Hugging Face checkpoint into the engine's tensors, each source checked
// (present, float dtype, shape) and unknown tensors refused.
std::vector<Job> hf_source_jobs(const TensorSet& set, const ModelConfig& model,
                                const std::string& model_type, const std::string& config_path) {
  // GPT-2 checkpoints saved from GPT2LMHeadModel name tensors "transformer.*"; those saved
  // from GPT2Model (the original OpenAI upload among them) have no prefix.
  std::string prefix, strip;
  auto map = hf_tensor_map(model, model_type);
  if (model.family == "gpt2") {
    if (set.has("transformer.wte.weight"))
      prefix = "transformer.";
    else if (set.has("wte.weight"))
      strip = "transformer.";
    else
      throw IoError(str(set.source(),
                        ": no tensor 'transformer.wte.weight' or 'wte.weight': not a "
                        "GPT-2 checkpoint"));
  } else if (!set.has(map.front().hf)) {
    throw IoError(str(set.source(), ": no tensor '", map.front().hf, "': not a ", model.family,
                      " checkpoint as ", config_path, " says"));
  }
  std::vector<Job> jobs;
  const ParamLayout layout = make_gpt_layout(model);
  size_t next = 0;  // engine tensors must come in layout order
  for (const HfTensorMap& m : map) {
    std::string hf = strip.empty() ? m.hf : m.hf.substr(strip.size());
    if (jobs.empty() || jobs.back().dst != m.engine) {
      FY_CHECK(next < layout.tensors.size() && layout.tensors[next].name == m.engine,
               "tensor map order: ", m.engine);
      ++next;
    }
    jobs.push_back(
        {hf, m.engine, m.transpose, m.hf_shape, m.engine_shape, 0, numel_of(m.hf_shape)});
  }
  FY_CHECK(next == layout.tensors.size(), "tensor map and layout disagree");
  validate_sources(set, jobs);
  refuse_unknown(set, jobs, prefix, model, true);
  verify_sources(set, jobs);
  return jobs;
}

// The dtype to-hf writes: --dtype, else the base model's, else fp32.
StDtype export_dtype(const ConvertOptions& opts, const std::string& base, std::string* origin) {
  if (opts.dtype) {
    *origin = "--dtype";
    return *opts.dtype;
  }
  if (std::optional<StDtype> d = base.empty() ? std::nullopt : hf_torch_dtype(base)) {
    *origin = "the base model's torch_dtype";
    return *d;
  }
  *origin = base.empty() ? "no base model config (hf_config.json): fp32"
                         : "the base model's torch_dtype is not "
                           "bfloat16, float16 or float32: fp32";
  return StDtype::kF32;
}

}  // namespace

std::vector<std::string> copy_carried_files(const std::string& from_dir,
                                            const std::string& to_dir) {
  std::vector<std::string> copied;
  for (const auto& n : carried_file_names()) {
    const fs::path src = fs::path(from_dir) / n;
    std::error_code ec;
    if (!fs::is_regular_file(src, ec)) continue;
    const std::string text = read_text(src);
    write_file_atomic((fs::path(to_dir) / n).string(), text.data(), text.size());
    copied.push_back(n);
  }
  return copied;
}

std::string carried_files_dir(const std::string& dir) {
  const fs::path p(dir);
  if (holds_carried_files(p)) return dir;
  const fs::path parent = p.lexically_normal().parent_path();
  if (parent.filename() == "checkpoints" && holds_carried_files(parent.parent_path()))
    return parent.parent_path().string();
  return dir;
}

ConvertResult convert_hf_to_engine(const std::string& hf_dir, const std::string& out_dir,
                                   const ConvertOptions& opts) {
  const fs::path out = normalized_out(out_dir);
  check_output_dir(out);
  const fs::path src(hf_dir);
  std::error_code ec;
  if (!fs::is_directory(src, ec))
    throw IoError(str(hf_dir, fs::exists(src, ec) ? ": not a directory" : ": no such directory",
                      " (from-hf takes a Hugging Face model directory)"));
  const std::string config_path = (src / kHfConfigFile).string();
  ConvertResult r;
  std::string model_type;
  r.model = validated(load_hf_config(config_path, &model_type), config_path);
  TensorSet set = TensorSet::open_dir(hf_dir);

  std::vector<Job> jobs = hf_source_jobs(set, r.model, model_type, config_path);

  StagingDir stage(out);
  const std::string yaml = engine_config_yaml(r.model);
  r.files = write_tensors(set, jobs, StDtype::kF32, stage.path(), opts,
                          {{"format", "fuyou"}, {"config", yaml}}, &r.bytes);
  r.tensors = jobs.size();
  write_text(stage.path() / kEngineConfigFile, yaml);
  r.files.push_back(kEngineConfigFile);
  auto copies = tokenizer_copies();  // with generation_config.json
  copies.emplace_back(kHfConfigFile, kKeptHfConfigFile);
  copy_through(src, stage.path(), copies, &r.copied);
  stage.commit();
  return r;
}

ConvertResult convert_engine_to_hf(const std::string& checkpoint, const std::string& out_dir,
                                   const ConvertOptions& opts) {
  const fs::path out = normalized_out(out_dir);
  check_output_dir(out);
  EngineSource src = open_engine_source(checkpoint);
  if (src.lora.enabled()) return export_peft_adapter(src, out, opts);
  ConvertResult r;
  r.model = validated(src.model, checkpoint);
  // The base model's config.json and tokenizer: beside the weights, or in the run directory
  // of a training checkpoint written before checkpoints carried them. The base's model type
  // names the exported tensors where it computes the model (hf_model_type).
  const fs::path carried = carried_files_dir(src.dir.string());
  std::string base;
  std::error_code ec;
  if (fs::is_regular_file(carried / kKeptHfConfigFile, ec))
    base = read_text(carried / kKeptHfConfigFile);
  const nlohmann::json base_json = nlohmann::json::parse(base, nullptr, false);
  const std::string base_type = base_json.is_object() && base_json.contains("model_type") &&
                                        base_json["model_type"].is_string()
                                    ? base_json["model_type"].get<std::string>()
                                    : "";
  std::vector<Job> jobs;
  for (const HfTensorMap& t : hf_tensor_map(r.model, hf_model_type(r.model, base_type)))
    jobs.push_back({t.engine, t.hf, t.transpose, t.engine_shape, t.hf_shape,
                    static_cast<size_t>(t.engine_offset), numel_of(t.hf_shape)});
  validate_sources(src.set, jobs);
  refuse_unknown(src.set, jobs, "", r.model, false);
  verify_sources(src.set, jobs);

  r.dtype = export_dtype(opts, base, &r.dtype_origin);
  if (!is_float_dtype(r.dtype))
    throw Error(str("--dtype ", st_dtype_name(r.dtype), ": expected f32, bf16 or f16"));

  StagingDir stage(out);
  // transformers refuses safetensors files whose metadata lacks format "pt".
  r.files = write_tensors(src.set, jobs, r.dtype, stage.path(), opts, {{"format", "pt"}}, &r.bytes);
  r.tensors = jobs.size();
  const std::string config = hf_config_json(r.model, r.dtype, base);
  write_text(stage.path() / kHfConfigFile, config);
  r.files.push_back(kHfConfigFile);
  copy_through(carried, stage.path(), tokenizer_copies(), &r.copied);
  // AutoTokenizer takes its special tokens from tokenizer_config.json; a source that had only
  // tokenizer.json gets one naming the tokens config.json's ids point at.
  if (fs::is_regular_file(stage.path() / "tokenizer.json", ec) &&
      !fs::is_regular_file(stage.path() / "tokenizer_config.json", ec)) {
    const Tokenizer tok = Tokenizer::from_file((stage.path() / "tokenizer.json").string());
    write_text(stage.path() / "tokenizer_config.json", hf_tokenizer_config_json(config, tok));
    r.written.push_back("tokenizer_config.json");
  }
  stage.commit();
  return r;
}

LoadedCheckpoint load_engine_checkpoint(const std::string& checkpoint) {
  EngineSource src = open_engine_source(checkpoint);
  refuse_lora_weights(src, checkpoint, "loading it as a whole model (fuyou-generate)");
  LoadedCheckpoint out;
  out.model = validated(src.model, checkpoint);
  const ParamLayout layout = make_gpt_layout(out.model);
  // Every tensor is checked before the array is allocated: a config that does not match the
  // file must not make us allocate for a model that is not there.
  for (const TensorSpec& t : layout.tensors) {
    if (!src.set.has(t.name))
      throw IoError(str(src.set.source(), ": missing tensor '", t.name, "'"));
    const StTensorInfo& info = src.set.info(t.name);
    if (info.dtype != StDtype::kF32 || info.shape != t.shape)
      throw IoError(str(src.set.file(t.name).path(), ": tensor '", t.name, "' is ",
                        st_dtype_name(info.dtype), " ", shape_str(info.shape),
                        "; the engine needs F32 ", shape_str(t.shape)));
  }
  out.params.assign(layout.total, 0.0f);
  for (const TensorSpec& t : layout.tensors) {
    src.set.file(t.name).read(src.set.info(t.name), 0, out.params.data() + t.offset,
                              t.numel * sizeof(float));
    src.set.check(t.name, out.params.data() + t.offset);
  }
  return out;
}

LoadedCheckpoint load_hf_checkpoint(const std::string& hf_dir) {
  const std::string config_path = (fs::path(hf_dir) / kHfConfigFile).string();
  LoadedCheckpoint out;
  std::string model_type;
  out.model = validated(load_hf_config(config_path, &model_type), config_path);
  TensorSet set = TensorSet::open_dir(hf_dir);
  const std::vector<Job> jobs = hf_source_jobs(set, out.model, model_type, config_path);
  const ParamLayout layout = make_gpt_layout(out.model);
  out.params.assign(layout.total, 0.0f);
  Buffers buffers;
  std::string last;
  float* dst = nullptr;
  for (const Job& j : jobs) {
    if (j.dst != last) dst = out.params.data() + layout.tensor(j.dst).offset, last = j.dst;
    copy_tensor(
        set, j, StDtype::kF32,
        [&](const void* p, size_t n) {
          std::memcpy(dst, p, n);
          dst += n / sizeof(float);
        },
        buffers);
  }
  return out;
}

}  // namespace fuyou

namespace fuyou {

struct CheckpointGroupReader::Impl {
  EngineSource src;
  ParamLayout layout;
};

CheckpointGroupReader::CheckpointGroupReader(const std::string& checkpoint,
                                             const ModelConfig& model)
    : impl_(std::make_unique<Impl>(Impl{open_engine_source(checkpoint), make_gpt_layout(model)})) {
  refuse_lora_weights(impl_->src, checkpoint, "model.checkpoint (a base)");
  const TensorSet& set = impl_->src.set;
  for (const TensorSpec& t : impl_->layout.tensors) {
    if (!set.has(t.name))
      throw IoError(
          str(set.source(), ": missing tensor '", t.name, "' (model.checkpoint ", checkpoint, ")"));
    const StTensorInfo& info = set.info(t.name);
    if (info.dtype != StDtype::kF32 || info.shape != t.shape)
      throw IoError(str(set.file(t.name).path(), ": tensor '", t.name, "' is ",
                        st_dtype_name(info.dtype), " ", shape_str(info.shape),
                        "; the model needs F32 ", shape_str(t.shape)));
  }
}

CheckpointGroupReader::~CheckpointGroupReader() = default;

void CheckpointGroupReader::read_group(int g, float* dst) const {
  const ParamLayout& layout = impl_->layout;
  const ParamGroup& pg = layout.groups.at(g);
  std::fill(dst, dst + pg.numel, 0.0f);
  for (size_t i = pg.first_tensor; i < pg.first_tensor + pg.num_tensors; ++i) {
    const TensorSpec& t = layout.tensors[i];
    float* p = dst + (t.offset - pg.offset);
    impl_->src.set.file(t.name).read(impl_->src.set.info(t.name), 0, p, t.numel * sizeof(float));
    impl_->src.set.check(t.name, p);
  }
}

}  // namespace fuyou
