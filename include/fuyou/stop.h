// Stop signals (SIGINT, SIGTERM) without a signal handler. A handler runs on whichever thread
// the kernel picks, and its frame is pushed onto that thread's stack: on a thread inside a
// library kernel that briefly points its stack pointer elsewhere (oneDNN 2.6's sgemm points it
// into heap memory), that frame corrupts the heap. So no handler is ever installed: main() of
// every tool creates one StopSignals before anything else, which blocks both signals in the
// calling thread (and so in every thread started later, OpenMP teams, oneDNN, io_uring and the
// engine's own threads, which inherit the mask) and receives them on one thread of its own
// (signalfd). That thread never runs engine or library code.
//
// What a signal does depends on what the program has said it can do:
// - at once (the default): the receiving thread unlinks the cleanup paths and ends the
//   process with status 128 + signal (130 / 143), as the default action would;
// - graceful (set_graceful): the first signal only sets the stop flag and prints the message
//   the program gave; the program checks the flag at its safe points (check(), requested())
//   and stops there: fuyou-train finishes its step, writes a checkpoint and exits 130 / 143.
//   A second signal ends the process at once as above. What it interrupts (a checkpoint being
//   written) is left as a staging directory that the next start removes.
#pragma once

#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fuyou {

// Thrown by StopSignals::check(): the program unwinds to main(), which exits 128 + signal
// (tools/tool_errors.h). Not an Error, so that no error handler on the way turns a stop into
// a failure.
class StopRequested : public std::exception {
 public:
  StopRequested(int signal, std::string what) : signal_(signal), what_(std::move(what)) {}
  int signal() const { return signal_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  int signal_;
  std::string what_;
};

class StopSignals {
 public:
  // Blocks SIGINT and SIGTERM in the calling thread and starts the receiving thread. At most
  // one instance per process; create it first in main(), before any other thread exists.
  StopSignals();
  // Stops the receiving thread; the signals stay blocked (the process is ending).
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // 0, or the first stop signal received (SIGINT, SIGTERM, or one request() gave).
  int requested() const { return requested_.load(); }
  // Throws StopRequested, saying `where` it stopped, when a stop was requested.
  void check(const std::string& where) const;
  // Asks for a graceful stop as the first signal would (tests, and callers with their own
  // reasons to stop).
  void request(int signal);
  // Forgets a request: a process that runs several pieces of work in turn (a test binary)
  // starts the next one unstopped.
  void clear() { requested_.store(0); }

  // From now on the first signal only asks; `message` is what it prints (a line saying what
  // the program will do, e.g. "stopping after this step; a checkpoint follows"). May be
  // called again as the program moves on to work with another way of stopping.
  void set_graceful(const std::string& message);
  // From now on the first signal ends the process (the default).
  void set_at_once();
  // The paths a signal that ends the process removes first: files are unlinked in order,
  // then entries ending in '/' are removed as directories if empty. Replaces the list.
  void set_cleanup_paths(const std::vector<std::string>& paths);

 private:
  void receive();              // the receiving thread
  void on_signal(int signal);  // on that thread
  [[noreturn]] void end_process(int signal);

  std::atomic<int> requested_{0};
  std::mutex mu_;  // guards the fields below, read by the receiving thread
  bool graceful_ = false;
  std::string message_;
  std::vector<std::string> cleanup_;
  int signal_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: the destructor's request to the receiving thread to return
  std::thread receiver_;
};

// "SIGINT", "SIGTERM", else "signal N".
std::string signal_name(int signal);

// The threads of this process (ids from /proc/self/task) that do not block both SIGINT and
// SIGTERM, so that a stop signal could run code on them. Empty when every thread blocks them,
// which is what StopSignals needs; tests check it during training.
std::vector<int> threads_not_blocking_stop_signals();

}  // namespace fuyou
