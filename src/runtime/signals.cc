#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "fuyou/error.h"
#include "fuyou/stop.h"

namespace fuyou {
namespace {

// The one StopSignals the handlers report to: a signal handler has no other way to reach
// an object.
std::atomic<StopSignals*> g_active{nullptr};

void handler(int sig) {
  if (StopSignals* s = g_active.load()) s->on_signal(sig);
}

void say(const char* text) {
  ssize_t r = ::write(STDERR_FILENO, text, ::strlen(text));
  (void)r;
}

}  // namespace

struct StopSignals::Saved {
  struct sigaction old_int {}, old_term {};
};

StopSignals::StopSignals() : saved_(std::make_unique<Saved>()) {
  StopSignals* expected = nullptr;
  if (!g_active.compare_exchange_strong(expected, this))
    throw Error("StopSignals: another instance already handles SIGINT and SIGTERM in this process");
  struct sigaction sa {};
  sa.sa_handler = handler;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &sa, &saved_->old_int);
  ::sigaction(SIGTERM, &sa, &saved_->old_term);
}

StopSignals::~StopSignals() {
  ::sigaction(SIGINT, &saved_->old_int, nullptr);
  ::sigaction(SIGTERM, &saved_->old_term, nullptr);
  g_active.store(nullptr);
}

void StopSignals::request(int signal) {
  int none = 0;
  requested_.compare_exchange_strong(none, signal);
}

void StopSignals::set_cleanup_paths(const std::vector<std::string>& paths) {
  lists_.push_back(std::make_unique<std::vector<std::string>>(paths));
  cleanup_.store(lists_.back().get());
}

// Async-signal-safe only: atomics, write, unlink, _exit.
void StopSignals::on_signal(int signal) {
  int none = 0;
  if (requested_.compare_exchange_strong(none, signal)) {
    say(signal == SIGINT ? "\nfuyou: SIGINT: stopping after this step (a checkpoint follows); press Ctrl-C again to "
                           "stop at once\n"
                         : "\nfuyou: SIGTERM: stopping after this step (a checkpoint follows)\n");
    return;
  }
  if (const std::vector<std::string>* paths = cleanup_.load())
    for (const std::string& p : *paths) ::unlink(p.c_str());
  say("\nfuyou: second stop signal: exiting now; the SSD store files are removed, the last checkpoint is intact\n");
  ::_exit(128 + signal);
}

std::string signal_name(int signal) {
  if (signal == SIGINT) return "SIGINT";
  if (signal == SIGTERM) return "SIGTERM";
  return str("signal ", signal);
}

}  // namespace fuyou
