// The engine's LoRA step for the PEFT reference (tests/reference/check_lora_peft.py):
//   fuyou-lora-tool CONFIG BATCH STEPS OUT [PEFT_DIR]
// CONFIG is a fuyou config with a lora section, BATCH a safetensors file whose "tokens" (I32,
// (micro_batch, seq_len + 1)) is every step's micro-batch. Runs STEPS steps and writes OUT
// (safetensors): "loss" (STEPS) the loss of each step before its update, "grad.<PEFT name>" each
// adapter tensor's gradient of the first step, "final.<PEFT name>" the adapters after the last
// step and "logits" (micro_batch, seq_len, vocab) of the batch's inputs with those adapters.
// With PEFT_DIR, also writes the final adapters there as a PEFT adapter directory. Exit status
// 1 with the message on any error.
#include <iostream>
#include <string>
#include <vector>

#include "fuyou/backend_select.h"
#include "fuyou/config.h"
#include "fuyou/error.h"
#include "fuyou/lora_step.h"
#include "fuyou/safetensors.h"
#include "fuyou/train.h"

using namespace fuyou;

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) {
    std::cerr << "usage: fuyou-lora-tool CONFIG BATCH STEPS OUT [PEFT_DIR]\n";
    return 2;
  }
  try {
    const Config cfg = load_config_file(argv[1]);
    const int steps = std::stoi(argv[3]);
    std::string why;
    std::unique_ptr<Backend> be = make_backend(cfg, &why);
    LoraStep lora(cfg, *be);
    const int B = cfg.schedule.micro_batch, T = cfg.model.seq_len, V = cfg.model.vocab_size;
    SafetensorsReader in(argv[2]);
    const std::vector<int32_t> batch = in.read_i32("tokens");
    if (batch.size() != static_cast<size_t>(B) * (T + 1))
      throw Error(str("tokens has ", batch.size(), " values, not micro_batch x (seq_len + 1)"));
    SafetensorsWriter out;
    std::vector<float> losses;
    const std::vector<PeftTensor> names = peft_tensors(lora.layout());
    for (int s = 0; s < steps; ++s) {
      losses.push_back(lora.step(s, {batch.data()}).loss);
      if (s > 0) continue;
      for (size_t i = 0; i < names.size(); ++i) {
        std::vector<float> g(static_cast<size_t>(names[i].rows) * names[i].cols);
        get_peft_tensor(lora.layout(), i, lora.adapter_gradient().data(), g.data());
        out.add("grad." + names[i].name, StDtype::kF32, {names[i].rows, names[i].cols}, g.data());
      }
    }
    out.add("loss", StDtype::kF32, {steps}, losses.data());
    for (size_t i = 0; i < names.size(); ++i) {
      std::vector<float> w(static_cast<size_t>(names[i].rows) * names[i].cols);
      get_peft_tensor(lora.layout(), i, lora.adapters().data(), w.data());
      out.add("final." + names[i].name, StDtype::kF32, {names[i].rows, names[i].cols}, w.data());
    }
    std::vector<int32_t> inputs(static_cast<size_t>(B) * T), targets(inputs.size());
    split_batch(batch.data(), B, T, inputs.data(), targets.data());
    std::vector<float> logits(inputs.size() * V);
    lora.logits(inputs.data(), logits.data());
    out.add("logits", StDtype::kF32, {B, T, V}, logits.data());
    out.write(argv[4]);
    if (argc == 6) lora.write_peft(argv[5]);
  } catch (const std::exception& e) {
    std::cerr << "fuyou-lora-tool: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
