// Graceful stop on SIGINT / SIGTERM. The first signal only asks: the training loop finishes
// its step, writes a checkpoint and the weights, flushes its metrics, removes its SSD store
// files and returns, and fuyou-train exits 128 + the signal (130 / 143). A second signal
// ends the process at once: the handler unlinks the paths it was given (the store's backing
// files and locks) and calls _exit(128 + signal). What a second signal interrupts (a
// checkpoint being written) is left as a staging directory that the next start removes.
//
// Signal handlers are process-wide, so while a StopSignals object exists it is the one
// the handlers report to (at most one at a time); everything else reaches it explicitly
// (TrainOptions::stop).
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

namespace fuyou {

class StopSignals {
 public:
  // Installs the SIGINT and SIGTERM handlers; the destructor restores the previous ones.
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // 0, or the first stop signal received (SIGINT, SIGTERM, or one request() gave).
  int requested() const { return requested_.load(); }
  // Asks for a graceful stop as the first signal would (tests, and callers with their own
  // reasons to stop).
  void request(int signal);
  // The paths a second signal unlinks before it ends the process. Replaces the previous list.
  void set_cleanup_paths(const std::vector<std::string>& paths);

  // For the handler: the first signal asks, a second one ends the process.
  void on_signal(int signal);

 private:
  std::atomic<int> requested_{0};
  // Published lists are kept until destruction: the handler may be reading an older one.
  std::vector<std::unique_ptr<std::vector<std::string>>> lists_;
  std::atomic<const std::vector<std::string>*> cleanup_{nullptr};
  struct Saved;
  std::unique_ptr<Saved> saved_;
};

// "SIGINT", "SIGTERM", else "signal N".
std::string signal_name(int signal);

}  // namespace fuyou
