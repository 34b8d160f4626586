// Config loading: the embedded default and every shipped config parse; bad input is
// refused with a message naming the key and what is allowed.
#include <yaml-cpp/yaml.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>

#include "fuyou/config.h"
#include "fuyou/error.h"
#include "fuyou/model.h"
#include "fuyou/sizes.h"
#include "test_support.h"

using namespace fuyou;
using Catch::Matchers::Contains;

TEST_CASE("the embedded default and every config in configs/ parse", "[config]") {
  Config d = parse_config(default_config_text(), "<default>");
  CHECK(d.model.n_layer == 6);
  CHECK(d.model.d_ff == 1536);
  int n = 0;
  for (auto& e : std::filesystem::directory_iterator(test::source_path("configs")))
    if (e.path().extension() == ".yaml") {
      INFO(e.path());
      CHECK_NOTHROW(load_config_file(e.path().string()));
      ++n;
    }
  CHECK(n >= 2);
}

TEST_CASE("config errors name the key and the allowed values", "[config]") {
  CHECK_THROWS_WITH(parse_config("model: {n_layers: 4}", "x.yaml"),
                    Contains("unknown key 'model.n_layers'") && Contains("n_layer"));
  CHECK_THROWS_WITH(parse_config("modle: {}", "x.yaml"), Contains("unknown section 'modle'"));
  CHECK_THROWS_WITH(parse_config("model: {n_layer: four}", "x.yaml"),
                    Contains("model.n_layer") && Contains("expected an integer"));
  CHECK_THROWS_WITH(parse_config("model: {d_model: 100, n_head: 3}", "x.yaml"),
                    Contains("model.d_model") && Contains("multiple of model.n_head"));
  CHECK_THROWS_WITH(
      parse_config("runtime: {backend: tpu}", "x.yaml"),
      Contains("runtime.backend") && Contains("cpu, cuda, auto, cpu-streams, emulated"));
  CHECK_THROWS_WITH(parse_config("offload: {activations: sometimes}", "x.yaml"),
                    Contains("offload.activations") && Contains("auto, keep, swap, recompute"));
  CHECK_THROWS_WITH(parse_config("offload: {host_memory: 8 parsecs}", "x.yaml"),
                    Contains("offload.host_memory") && Contains("unknown unit"));
  CHECK_THROWS_WITH(parse_config("model: {n_layer: 4}\noffload: {deferred_updates: 4}", "x.yaml"),
                    Contains("offload.deferred_updates") && Contains("[0, model.n_layer - 1 = 3]"));
  CHECK_THROWS_WITH(
      parse_config("offload: {deferred_updates: some}", "x.yaml"),
      Contains("offload.deferred_updates") && Contains("neither auto nor a layer count"));
  CHECK(parse_config("model: {n_layer: 4}\noffload: {deferred_updates: 2}", "x.yaml")
            .offload.deferred_updates == 2);
  CHECK(parse_config("", "x.yaml").offload.deferred_updates == -1);
  // runtime.cuda_wait: the CUDA backend's, so an error with another backend named.
  CHECK(parse_config("", "x.yaml").runtime.cuda_wait == "auto");
  CHECK_THROWS_WITH(parse_config("runtime: {cuda_wait: nap}", "x.yaml"),
                    Contains("runtime.cuda_wait") && Contains("auto, spin, yield, block"));
  CHECK_THROWS_WITH(parse_config("runtime: {cuda_wait: block, backend: cpu}", "x.yaml"),
                    Contains("runtime.cuda_wait") && Contains("'cpu'"));
  for (const char* b : {"cuda", "auto"})
    CHECK(parse_config(str("runtime: {cuda_wait: block, backend: ", b, "}"), "x.yaml")
              .runtime.cuda_wait == "block");
  CHECK_THROWS_WITH(parse_config("optimizer: {lr: -1}", "x.yaml"), Contains("optimizer.lr"));
  CHECK_THROWS_WITH(parse_config("model: [1, 2]", "x.yaml"),
                    Contains("section 'model' must be a mapping"));
  // Found by fuzz_config: the llama rules divided by n_head before it was checked.
  CHECK_THROWS_WITH(parse_config("model: {family: llama, n_head: 0, d_ff: 64}", "x.yaml"),
                    Contains("model.n_head: value 0 is not allowed: must be in 1..1048576"));
  CHECK_THROWS_WITH(parse_config("model: {n_layer: 4", "x.yaml"), Contains("x.yaml: line"));
  CHECK_THROWS_WITH(load_config_file("/nonexistent/c.yaml"), Contains("/nonexistent/c.yaml"));
}

TEST_CASE("lora keys are refused naming the key and the value", "[config][lora]") {
  CHECK_FALSE(parse_config("", "x.yaml").lora.enabled());
  CHECK_THROWS_WITH(parse_config("lora: {rank: -1}", "x.yaml"),
                    Contains("lora.rank") && Contains("0..65536"));
  CHECK_THROWS_WITH(parse_config("lora: {alpha: 16}", "x.yaml"),
                    Contains("lora.alpha") && Contains("lora.rank is 0"));
  CHECK_THROWS_WITH(parse_config("lora: {rank: 8}", "x.yaml"),
                    Contains("lora.targets") && Contains("c_attn, c_proj, c_fc"));
  CHECK_THROWS_WITH(
      parse_config("lora: {rank: 8, targets: [q_proj]}", "x.yaml"),
      Contains("lora.targets") && Contains("'q_proj' is not a module of family gpt2"));
  CHECK_THROWS_WITH(parse_config("lora: {rank: 8, targets: [all-linear, c_fc]}", "x.yaml"),
                    Contains("lora.targets") && Contains("all-linear stands alone"));
  CHECK_THROWS_WITH(
      parse_config("model: {family: llama, d_ff: 64}\nlora: {rank: 8, targets: [c_attn]}",
                   "x.yaml"),
      Contains("'c_attn' is not a module of family llama") && Contains("gate_proj"));
  CHECK_THROWS_WITH(
      parse_config("model: {family: opt}\nlora: {rank: 8, targets: [q_proj]}", "x.yaml"),
      Contains("lora.targets") && Contains("family 'opt' has no LoRA targets"));
  CHECK_THROWS_WITH(parse_config("lora: {rank: 8, targets: [c_fc], dropout: 0.1}", "x.yaml"),
                    Contains("lora.dropout") && Contains("0.1") && Contains("not implemented"));
  CHECK_THROWS_WITH(parse_config("lora: {rank: 8, targets: [c_fc], dropout: 1}", "x.yaml"),
                    Contains("lora.dropout") && Contains("[0, 1)"));
  CHECK_THROWS_WITH(parse_config("lora: {rank: 8, targets: [c_fc], base: nf4}", "x.yaml"),
                    Contains("lora.base") && Contains("nf4") && Contains("NF4"));
  CHECK_THROWS_WITH(parse_config("lora: {rank: 8, targets: [c_fc], base: int3}", "x.yaml"),
                    Contains("lora.base") && Contains("fp32, bf16, nf4"));
  CHECK_THROWS_WITH(
      parse_config("lora: {rank: 8, targets: [c_fc], init: /nonexistent/a}", "x.yaml"),
      Contains("lora.init") && Contains("/nonexistent/a"));
  CHECK_THROWS_WITH(parse_config("lora: {rank: 8, targets: [c_fc], use_rslora: maybe}", "x.yaml"),
                    Contains("lora.use_rslora"));
  CHECK_THROWS_WITH(parse_config("lora: {rank: 8, targets: all-linear}", "x.yaml"),
                    Contains("lora.rank") && Contains("model.checkpoint"));
  CHECK_THROWS_WITH(parse_config("lora: {r: 8}", "x.yaml"), Contains("unknown key 'lora.r'"));
  // What the LoRA step does not run yet, refused at the config check naming the key.
  for (const auto& [text, key] : std::vector<std::pair<std::string, std::string>>{
           {"runtime: {backend: cuda}", "runtime.backend cuda"},
           {"runtime: {device_tensors: bf16}", "runtime.device_tensors bf16"},
           {"offload: {activations: swap}", "offload.activations swap"},
           {"offload: {ssd_paths: [/tmp]}", "offload.ssd_paths"},
           {"optimizer: {state: int8}", "optimizer.state int8"},
           {"optimizer: {placement: device}", "optimizer.placement device"}}) {
    INFO(text);
    CHECK_THROWS_WITH(parse_config(text + "\nlora: {rank: 8, targets: [c_fc]}", "x.yaml"),
                      Contains("lora.rank") && Contains("LoRA does not run with " + key));
  }
}

TEST_CASE("config overrides from --set apply before validation", "[config]") {
  Config c = parse_config("model: {n_layer: 2}", "x",
                          {"model.n_layer=5", "offload.host_memory=2GiB", "data.text=[a, b]"});
  CHECK(c.model.n_layer == 5);
  CHECK(c.offload.host_memory == (2ull << 30));
  CHECK(c.data.text == std::vector<std::string>{"a", "b"});
  CHECK_THROWS_WITH(parse_config("", "x", {"model.n_layer"}), Contains("section.key=value"));
  CHECK_THROWS_WITH(parse_config("", "x", {"modell.n_layer=3"}),
                    Contains("unknown section 'modell'"));
  CHECK_THROWS_WITH(parse_config("", "x", {"model.depth=3"}),
                    Contains("unknown key 'model.depth'"));
}

TEST_CASE("config round-trips through YAML", "[config]") {
  Config a = parse_config(default_config_text(), "<default>");
  Config b = parse_config(config_to_yaml(a), "<roundtrip>");
  CHECK(config_to_yaml(a) == config_to_yaml(b));
}

namespace {

std::string listed(const std::set<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) out += " " + k;
  return out.empty() ? " (none)" : out;
}

// a minus b.
std::set<std::string> minus(const std::set<std::string>& a, const std::set<std::string>& b) {
  std::set<std::string> d;
  for (const auto& k : a)
    if (!b.count(k)) d.insert(k);
  return d;
}

}  // namespace

TEST_CASE("every key parsed is emitted into a run's config.yaml and documented, and back",
          "[config]") {
  const std::vector<ConfigKey> list = config_keys();
  std::set<std::string> parsed;
  for (const ConfigKey& k : list) parsed.insert(k.name);
  REQUIRE(parsed.size() == list.size());  // no key listed twice
  REQUIRE(parsed.count("model.n_layer"));
  REQUIRE(parsed.count("checkpoint.keep_best"));
  // What a run directory's config.yaml (and a resume's trajectory check) holds.
  // Keys written only when set (model.checkpoint) are set here.
  std::set<std::string> emitted;
  Config c = parse_config(default_config_text(), "<default>");
  c.model.checkpoint = "base";
  c.data.chat_template_kwargs = R"({"enable_thinking":false})";
  const YAML::Node root = YAML::Load(config_to_yaml(c));
  for (const auto& section : root)
    for (const auto& key : section.second)
      emitted.insert(section.first.Scalar() + "." + key.first.Scalar());
  // docs/config.md: the `| key | type | ...` table under each `## section` heading.
  std::set<std::string> documented;
  std::map<std::string, std::string> doc_values;  // "section.key" -> the type column
  std::ifstream doc(test::source_path("docs/config.md"));
  REQUIRE(doc);
  // A row may document several keys ("| beta1, beta2 | ...").
  const std::regex heading("^## ([a-z]+)"),
      row("^\\| ([a-z_0-9]+(, [a-z_0-9]+)*) \\| ([^|]*[^| ]) \\|"), name("[a-z_0-9]+");
  std::string line, section;
  bool in_table = false;
  for (std::smatch m; std::getline(doc, line);) {
    if (std::regex_search(line, m, heading))
      section = m[1], in_table = false;
    else if (line.rfind("| key | type", 0) == 0)
      in_table = true;
    else if (line.empty() || line[0] != '|')
      in_table = false;
    else if (in_table && std::regex_search(line, m, row))
      for (std::sregex_iterator k(m[1].first, m[1].second, name), end; k != end; ++k) {
        documented.insert(section + "." + k->str());
        doc_values[section + "." + k->str()] = m[3];
      }
  }
  INFO("parsed, not emitted:" << listed(minus(parsed, emitted)));
  INFO("emitted, not parsed:" << listed(minus(emitted, parsed)));
  INFO("parsed, not in docs/config.md:" << listed(minus(parsed, documented)));
  INFO("in docs/config.md, not parsed:" << listed(minus(documented, parsed)));
  CHECK(emitted == parsed);
  CHECK(documented == parsed);
  // The type column states the values the key list allows.
  for (const ConfigKey& k : list) {
    INFO(k.name);
    if (doc_values.count(k.name)) CHECK(doc_values[k.name] == k.values);
  }
}

TEST_CASE("data.chat_template_kwargs is a mapping, kept through config.yaml", "[config]") {
  const std::string chat = "schedule: {sample_chat: true}\n";
  const Config c = parse_config(
      chat +
          "data: {chat_template_kwargs: {enable_thinking: false, name: x, n: 3, r: 0.5, "
          "tags: [a, '1'], none: null}}",
      "x");
  // YAML's values as JSON's, in the order written; a quoted scalar stays a string.
  CHECK(c.data.chat_template_kwargs ==
        R"({"enable_thinking":false,"name":"x","n":3,"r":0.5,"tags":["a","1"],"none":null})");
  CHECK(parse_config(config_to_yaml(c), "<roundtrip>").data.chat_template_kwargs ==
        c.data.chat_template_kwargs);
  // --set gives it as YAML or as a JSON object's text.
  CHECK(parse_config(chat, "x", {R"(data.chat_template_kwargs={"enable_thinking": true})"})
            .data.chat_template_kwargs == R"({"enable_thinking":true})");
  CHECK(parse_config(chat, "x", {R"(data.chat_template_kwargs='{"a": [1, {"b": null}]}')"})
            .data.chat_template_kwargs == R"({"a":[1,{"b":null}]})");
  CHECK(parse_config("data: {chat_template_kwargs: {}}", "x").data.chat_template_kwargs.empty());
  CHECK_THROWS_WITH(parse_config(chat + "data: {chat_template_kwargs: [enable_thinking]}", "x"),
                    Contains("x: data.chat_template_kwargs: expected a mapping of template "
                             "variables, e.g. {enable_thinking: false}, got a list"));
  CHECK_THROWS_WITH(parse_config(chat + "data: {chat_template_kwargs: enable_thinking}", "x"),
                    Contains("got 'enable_thinking'"));
  CHECK_THROWS_WITH(parse_config(chat, "x", {"data.chat_template_kwargs=3"}),
                    Contains("--set 'data.chat_template_kwargs=3': data.chat_template_kwargs: "
                             "expected a mapping"));
  // Kept without samples too: fuyou-generate --chat reads them from a run's config.yaml.
  CHECK(parse_config("data: {chat_template_kwargs: {enable_thinking: false}}", "x")
            .data.chat_template_kwargs == R"({"enable_thinking":false})");
}

TEST_CASE("sizes parse in binary and decimal units", "[config]") {
  CHECK(parse_size("4096", "k") == 4096);
  CHECK(parse_size("512MiB", "k") == 512ull << 20);
  CHECK(parse_size("1.5GiB", "k") == 3ull << 29);
  CHECK(parse_size("2GB", "k") == 2000000000ull);
  CHECK_THROWS_AS(parse_size("lots", "k"), ConfigError);
  CHECK_THROWS_AS(parse_size("-1GiB", "k"), ConfigError);
  CHECK(format_size(3ull << 29) == "1.50 GiB");
}

TEST_CASE("a key given twice is an error naming both lines", "[config]") {
  CHECK_THROWS_WITH(parse_config("model:\n  n_layer: 2\n  n_head: 2\n  n_layer: 4\n", "x.yaml"),
                    Contains("x.yaml: line 4, column 3: key 'model.n_layer' is given a second time "
                             "(first at line 2, column 3)"));
  // A repeated, empty section line used to reset the section to its defaults silently.
  CHECK_THROWS_WITH(parse_config("schedule:\n  steps: 7\nschedule:\n", "x.yaml"),
                    Contains("line 3, column 1: key 'schedule' is given a second time "
                             "(first at line 1, column 1)"));
  CHECK_THROWS_WITH(parse_config("data: {text: [a], text: [b]}", "x.yaml"),
                    Contains("key 'data.text' is given a second time"));
}

TEST_CASE("YAML that yaml-cpp accepts but a config cannot hold is a ConfigError", "[config]") {
  // A complex key used to escape parse_config as a yaml-cpp exception.
  CHECK_THROWS_AS(parse_config("model:\n  ? [x]\n  : 1\n", "x.yaml"), ConfigError);
  CHECK_THROWS_WITH(parse_config("model:\n  ? [x]\n  : 1\n", "x.yaml"),
                    Contains("x.yaml: line 2, column 5: a key in 'model' is a list"));
  CHECK_THROWS_WITH(parse_config("? {a: 1}\n: 2\n", "x.yaml"),
                    Contains("a key in 'the top level' is a mapping"));
  CHECK_THROWS_WITH(parse_config("a: &x [*x]", "x.yaml"), Contains("x.yaml"));
  CHECK_THROWS_WITH(parse_config(std::string(5000, '[') + std::string(5000, ']'), "x.yaml"),
                    Contains("x.yaml"));
  CHECK_THROWS_WITH(parse_config("model: 3", "x.yaml", {"model.n_layer=2"}), Contains("x.yaml"));
}

TEST_CASE("every integer key has an upper bound", "[config]") {
  struct Case {
    const char* yaml;
    const char* key;
    const char* rule;
  };
  const Case cases[] = {
      {"schedule: {eval_batches: 2147483647}", "schedule.eval_batches", "must be in 1..10000"},
      {"schedule: {steps: 1000000000000, warmup_steps: 0}", "schedule.steps",
       "must be in 1..1000000000"},
      {"schedule: {micro_batch: 100000}", "schedule.micro_batch", "must be in 1..65536"},
      {"schedule: {micro_batch: 65536}\nmodel: {seq_len: 1024}", "schedule.micro_batch",
       "at most 16777216 tokens"},
      {"schedule: {grad_accum: 1000000}", "schedule.grad_accum", "must be in 1..65536"},
      {"schedule: {eval_every: 10000000000}", "schedule.eval_every", "must be in 0..1000000000"},
      {"schedule: {log_every: 10000000000}", "schedule.log_every", "must be in 1..1000000000"},
      {"model: {n_layer: 1025}", "model.n_layer", "must be in 1..1024"},
      {"model: {n_head: 2000000, d_model: 2000000}", "model.n_head", "must be in 1..1048576"},
      {"model: {d_model: 2097152, n_head: 1}", "model.d_model", "must be in 1..1048576"},
      {"model: {d_ff: 8388608}", "model.d_ff", "must be in 0..4194304 (0: 4 * d_model)"},
      {"model: {vocab_size: 16777217}", "model.vocab_size", "must be in 2..16777216"},
      {"model: {seq_len: 2000000}", "model.seq_len", "must be in 1..1048576"},
      {"runtime: {threads: 5000}", "runtime.threads", "must be in 0..4096"},
      {"optimizer: {eps: .inf}", "optimizer.eps", "must be in (0, 1)"},
      {"optimizer: {weight_decay: .inf}", "optimizer.weight_decay", "must be in [0, 100)"},
      {"optimizer: {grad_clip: .inf}", "optimizer.grad_clip", "must be in [0, inf)"},
      {"model: {family: llama, d_ff: 64, rope_theta: .inf}", "model.rope_theta", "(1, 1e12)"},
      // The rotary variants read their own parameters; a parameter no variant reads is refused,
      // and so are contexts where the engine's attention is not transformers'.
      {"model: {family: llama, d_ff: 64, rope_factor: 8}", "model.rope_factor", "does not use it"},
      {"model: {family: llama, d_ff: 64, rope_type: linear, rope_factor: 2, rope_beta_fast: 8}",
       "model.rope_beta_fast", "does not use it"},
      {"model: {family: llama, d_ff: 64, rope_type: llama3, rope_factor: 8}",
       "model.rope_original_context", "needs the original context"},
      {"model: {family: llama, d_ff: 64, rope_type: dynamic, rope_factor: 2, "
       "rope_original_context: 128, seq_len: 256}",
       "model.seq_len", "dynamic NTK"},
      {"model: {family: llama, d_ff: 64, sliding_window: 128, seq_len: 256}", "model.seq_len",
       "sliding-window"},
      {"model: {family: llama, d_ff: 64, rope_type: yarn2}", "model.rope_type", "llama3"},
      {"model: {family: gpt2, rope_type: linear}", "model.rope_type", "no rotary embeddings"},
      {"model: {family: opt, sliding_window: 64}", "model.sliding_window", "no rotary"},
      // A learned position table holds seq_len; rotary families have none.
      {"model: {family: gpt2, positions: 128, seq_len: 256}", "model.seq_len",
       "position table's 128 rows"},
      {"model: {family: llama, d_ff: 64, positions: 512}", "model.positions", "no position table"},
  };
  for (const Case& c : cases) {
    INFO(c.yaml);
    CHECK_THROWS_WITH(parse_config(c.yaml, "x.yaml"), Contains(c.key) && Contains(c.rule));
  }
  // The bounds themselves are allowed.
  CHECK_NOTHROW(
      parse_config("schedule: {eval_batches: 10000, micro_batch: 16384, grad_accum: 65536}\n"
                   "model: {n_layer: 1024, vocab_size: 16777216, seq_len: 1024}",
                   "x.yaml"));
  CHECK_THROWS_WITH(parse_size("1e30", "offload.host_memory"),
                    Contains("offload.host_memory") && Contains("too large"));
  // Above 2^63 a size no longer fits the signed type llround returns.
  CHECK(parse_size("18000000TB", "k") == 18000000000000000000ull);
}

namespace {

// A checkpoint directory whose config.yaml names `target` as its model.checkpoint.
void write_checkpoint_config(const std::string& dir, const std::string& target) {
  std::filesystem::create_directories(dir);
  test::write_all(dir + "/config.yaml", "model:\n  n_layer: 2\n  checkpoint: " + target + "\n");
}

}  // namespace

TEST_CASE("checkpoints that name each other in a cycle are refused", "[config]") {
  test::TempDir tmp("ckcycle");
  const std::string a = tmp.path + "/a", b = tmp.path + "/b";
  // A checkpoint naming itself used to recurse until the stack overflowed.
  write_checkpoint_config(a, a);
  CHECK_THROWS_WITH(parse_config("model: {checkpoint: " + a + "}", "x.yaml"),
                    Contains("x.yaml: model.checkpoint") && Contains("in a cycle") &&
                        Contains(a + "/config.yaml"));
  CHECK_THROWS_WITH(load_config_file(a + "/config.yaml"), Contains("in a cycle"));
  write_checkpoint_config(a, b);
  write_checkpoint_config(b, tmp.path + "/./a");
  CHECK_THROWS_WITH(parse_config("model: {checkpoint: " + a + "}", "x.yaml"),
                    Contains("in a cycle: '" + a + "' -> '" + b + "' -> '" + a + "'"));
  // A long chain without a cycle is bounded too.
  for (int i = 0; i < 20; ++i)
    write_checkpoint_config(tmp.path + "/c" + std::to_string(i),
                            tmp.path + "/c" + std::to_string(i + 1));
  CHECK_THROWS_WITH(parse_config("model: {checkpoint: " + tmp.path + "/c0}", "x.yaml"),
                    Contains("more than 16 checkpoints"));
}

TEST_CASE("a gpt2/opt checkpoint trains at a shorter seq_len with its whole position table",
          "[config]") {
  test::TempDir tmp("ckpositions");
  const std::string ck = tmp.path + "/ck";
  std::filesystem::create_directories(ck);
  test::write_all(ck + "/config.yaml", "model: {family: opt, n_layer: 2, seq_len: 64}\n");
  const Config c = parse_config("model: {checkpoint: " + ck + ", seq_len: 16}", "x.yaml");
  CHECK(c.model.seq_len == 16);
  CHECK(c.model.positions == 64);
  CHECK(position_rows(c.model) == 64 + 2);  // OPT's table starts at row 2
  // Naming the table's rows is allowed; another number is a different model.
  CHECK(parse_config("model: {checkpoint: " + ck + ", seq_len: 16, positions: 64}", "x.yaml")
            .model.positions == 64);
  CHECK_THROWS_WITH(parse_config("model: {checkpoint: " + ck + ", positions: 32}", "x.yaml"),
                    Contains("model.positions") && Contains("the checkpoint"));
  CHECK_THROWS_WITH(parse_config("model: {checkpoint: " + ck + ", seq_len: 65}", "x.yaml"),
                    Contains("model.seq_len") && Contains("position table's 64 rows"));
  // The written config says the table's rows, so a resumed run builds the same layout.
  const Config back = parse_config(config_to_yaml(c), "back.yaml");
  CHECK(back.model.positions == 64);
  CHECK(back.model.seq_len == 16);
}

TEST_CASE("a vocabulary over 64k defaults to a chunked LM head", "[config]") {
  const std::string llama = "model: {family: llama, d_ff: 1024, vocab_size: ";
  // Over 65,536 columns, unless the text gives the key: 2048 tokens at a time.
  CHECK(parse_config(llama + "128256}", "x.yaml").model.head_chunk_tokens == 2048);
  CHECK(parse_config(llama + "65537}", "x.yaml").model.head_chunk_tokens == 2048);
  CHECK(parse_config(llama + "65536}", "x.yaml").model.head_chunk_tokens == 0);
  CHECK(parse_config("model: {vocab_size: 50257}", "x.yaml").model.head_chunk_tokens == 0);
  // Given, it is kept, 0 (the whole micro-batch's logits, as a forward without targets needs)
  // included, in the text or by --set.
  CHECK(parse_config(llama + "128256, head_chunk_tokens: 0}", "x.yaml").model.head_chunk_tokens ==
        0);
  CHECK(parse_config(llama + "128256}", "x.yaml", {"model.head_chunk_tokens=512"})
            .model.head_chunk_tokens == 512);
  CHECK(parse_config(llama + "128256}", "x.yaml", {"model.head_chunk_tokens=0"})
            .model.head_chunk_tokens == 0);
  // The shipped configs of large-vocabulary models all chunk their head.
  for (const char* name : {"llama3-8b", "llama3-70b", "llama3.1-8b", "llama3.1-70b",
                           "llama3.1-405b", "qwen3-8b", "qwen3-32b", "mistral-nemo-12b"}) {
    INFO(name);
    const Config c = load_config_file(test::source_path(str("configs/", name, ".yaml")), {});
    CHECK(c.model.vocab_size > 65536);
    CHECK(c.model.head_chunk_tokens == 2048);
  }
}
