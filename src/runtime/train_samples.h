// fuyou-train's samples (schedule.sample_every, sample_prompts, sample_tokens): each prompt
// continued greedily with the run's current weights, logged and appended to samples.jsonl.
#pragma once

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/config.h"
#include "fuyou/generate.h"

namespace fuyou {

class TrainEngine;

class RunSamples {
 public:
  // The run's tokenizer (the carried tokenizer.json in run_dir, or byte-level for a 256-token
  // model) and a decoder on a CPU backend: samples read the engine's fp32 master weights
  // into host memory and decode there, whatever device trains. Refused at start, with the
  // sizes, when those two copies of the weights exceed the memory this machine has available.
  RunSamples(const Config& cfg, const std::string& run_dir);
  ~RunSamples();
  // Samples of every prompt at `step`: logged, and appended to run_dir/samples.jsonl.
  void write(int64_t step, TrainEngine& engine);

 private:
  Config cfg_;
  std::string path_;
  std::unique_ptr<TextCodec> codec_;
  std::vector<std::vector<int32_t>> prompts_;
  int capacity_ = 0;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<GptDecoder> decoder_;
  std::ofstream out_;
};

}  // namespace fuyou
