// fuyou-bench checkpoint: times saving and restoring a config's whole training state
// (save_checkpoint / restore_checkpoint) in a directory, beside fio's sequential write and
// read of the same number of bytes in the same directory, in the same run.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "fuyou/config.h"

namespace fuyou {

struct CheckpointBenchOptions {
  std::string dir;  // where the checkpoint and fio's file go; empty: ./fuyou-bench-checkpoint-PID
  bool fio = true;  // run fio beside (skipped, and said so, when it is not installed)
};

// save_s, restore_s, bytes, save_MBps, restore_MBps, fio_write_MBps, fio_read_MBps and the
// ratios; the directory is removed afterwards.
nlohmann::json run_checkpoint_bench(const Config& cfg, const CheckpointBenchOptions& opts);
void print_checkpoint_bench(const nlohmann::json& r);

}  // namespace fuyou
