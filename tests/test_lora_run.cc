// fuyou-train's LoRA runs (docs/lora.md, "fuyou-train"): the run directory over a frozen base,
// its checkpoints holding the adapters' state with the base's checksum, resume bit for bit, and
// a resume over another base refused. Against PEFT: tests/reference/check_lora_train_peft.py.
#include <catch2/catch.hpp>
#include <filesystem>
#include <string>

#include "fuyou/checkpoint.h"
#include "fuyou/config.h"
#include "fuyou/error.h"
#include "fuyou/lora.h"
#include "fuyou/read_file.h"
#include "fuyou/train.h"
#include "run_dir_support.h"

using namespace fuyou;
using test::losses;
using test::resume;
using test::tensors;
using test::train;

namespace {

// A tiny GPT-2-style base, trained 2 steps from runtime.seed `seed` on the scratch's corpus:
// its run directory is an engine checkpoint that model.checkpoint takes.
std::string make_base(const test::RunScratch& s, const std::string& name, int seed) {
  const Config cfg = parse_config(
      str("model: {n_layer: 2, n_head: 2, d_model: 16, d_ff: 32, vocab_size: 256, seq_len: 16}\n"
          "data: {text: [",
          s.corpus(),
          "], val_fraction: 0.1}\n"
          "schedule: {steps: 2, warmup_steps: 0, micro_batch: 2}\n"
          "runtime: {backend: cpu, threads: 2, seed: ",
          seed, "}\ncheckpoint: {every_steps: 0, every_minutes: 0}\n"),
      "<test>");
  train(cfg, s.run(name));
  return s.run(name);
}

Config lora_config(const test::RunScratch& s, const std::string& base) {
  return parse_config(
      str("model: {checkpoint: ", base,
          "}\n"
          "data: {text: [",
          s.corpus(),
          "], val_fraction: 0.1}\n"
          "optimizer: {lr: 1.0e-2, min_lr: 1.0e-3, grad_clip: 1.0}\n"
          "schedule: {steps: 6, warmup_steps: 1, micro_batch: 2, grad_accum: 2, log_every: 1, "
          "eval_every: 3, eval_batches: 2}\nruntime: {backend: cpu, threads: 2, seed: 7}\n"
          "checkpoint: {every_steps: 2, keep: 10}\n"
          "lora: {rank: 2, alpha: 4, targets: all-linear}\n"),
      "<test>");
}

}  // namespace

TEST_CASE("a LoRA run resumes bit for bit and refuses another base", "[lora][checkpoint]") {
  test::RunScratch s("lora-run", "resume", 0);
  const std::string base = make_base(s, "base", 3);
  const Config cfg = lora_config(s, base);
  train(cfg, s.run("lora"));
  const auto l = losses(s.run("lora"));
  REQUIRE(l.size() == 6);
  CHECK(l.at(6) < l.at(1));  // the adapters learn

  // The final weights and each checkpoint hold the adapters only, under their engine names.
  const LoraLayout layout = make_lora_layout(cfg.model, cfg.lora);
  const auto final = tensors(s.run("lora") + "/model.safetensors");
  CHECK(final.size() == layout.params.tensors.size());
  for (const TensorSpec& t : layout.params.tensors) CHECK(final.count(t.name));
  const CheckpointManifest m = read_checkpoint_manifest(s.run("lora") + "/checkpoints/step-4");
  CHECK(m.base_xxh3.size() == 16);
  // model.checkpoint stays in a LoRA run's config: the base is not copied into the run.
  CHECK(read_checkpoint_config(s.run("lora") + "/checkpoints/step-4").model.checkpoint == base);

  // Resumed from step 2 and from step 4: every later loss, the final adapters and the final
  // checkpoint's adapters and moments as the straight run's, bit for bit.
  test::check_resume(s, "lora", 2, 6);
  test::check_resume(s, "lora", 4, 6);

  // Over another base of the same shape, moved to the same path: refused with both checksums.
  const std::string other = make_base(s, "other", 4);
  CHECK(tensors(other + "/model.safetensors") != tensors(base + "/model.safetensors"));
  REQUIRE_THROWS_WITH(
      resume(s.run("lora") + "/checkpoints/step-4", s.run("wrong"), {"model.checkpoint=" + other}),
      Catch::Contains("holds adapters trained over a base of checksum " + m.base_xxh3) &&
          Catch::Contains("model.checkpoint " + other));
  CHECK(!std::filesystem::exists(s.run("wrong")));  // refused before the directory changed
  // The same base at another path resumes: the checksum names the base, not its path.
  std::filesystem::copy(base, s.run("moved"), std::filesystem::copy_options::recursive);
  resume(s.run("lora") + "/checkpoints/step-4", s.run("lora-moved"),
         {"model.checkpoint=" + s.run("moved")});
  CHECK(tensors(s.run("lora-moved") + "/model.safetensors") == final);
}

TEST_CASE("a LoRA config refuses samples and a host budget, and a LoRA run is not a base",
          "[lora]") {
  test::RunScratch s("lora-run", "refusals", 0);
  const std::string base = make_base(s, "base", 3);
  REQUIRE_THROWS_WITH(parse_config(str("model: {checkpoint: ", base,
                                       "}\nschedule: {sample_every: 2, sample_prompts: [hi]}\n"
                                       "lora: {rank: 2, targets: all-linear}\n"),
                                   "<test>"),
                      Catch::Contains("schedule.sample_every 2"));
  // A host budget the LoRA step cannot hold yet (its memory is not planned) is refused, not
  // ignored.
  REQUIRE_THROWS_WITH(parse_config(str("model: {checkpoint: ", base,
                                       "}\noffload: {host_memory: 1GiB}\n"
                                       "lora: {rank: 2, targets: all-linear}\n"),
                                   "<test>"),
                      Catch::Contains("LoRA does not run with offload.host_memory"));
  Config cfg = lora_config(s, base);
  cfg.schedule.steps = 1;
  cfg.checkpoint.every_steps = 0;
  train(cfg, s.run("lora"));
  // A LoRA run's weights as model.checkpoint (a base to fine-tune) are refused, naming what
  // they are.
  const Config ft = parse_config(
      str("model: {checkpoint: ", s.run("lora"), "}\ndata: {text: [", s.corpus(),
          "], val_fraction: 0.1}\nschedule: {steps: 1, warmup_steps: 0, micro_batch: 2}\n"
          "runtime: {backend: cpu, threads: 2}\n"),
      "<test>");
  REQUIRE_THROWS_WITH(train(ft, s.run("ft")),
                      Catch::Contains("a LoRA run's weights are its adapters"));
}
