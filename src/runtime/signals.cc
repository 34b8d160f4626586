#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>

#include "fuyou/error.h"
#include "fuyou/log.h"
#include "fuyou/stop.h"

namespace fuyou {
namespace {

constexpr int kStopSignals[] = {SIGINT, SIGTERM};

// Signal masks and dispositions are process-wide; two receivers would race for each signal.
std::atomic<bool> g_instance{false};

sigset_t stop_set() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : kStopSignals) sigaddset(&set, s);
  return set;
}

void say(const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t w = ::write(STDERR_FILENO, text.data() + done, text.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    done += static_cast<size_t>(w);
  }
}

}  // namespace

StopSignals::StopSignals() {
  bool expected = false;
  if (!g_instance.compare_exchange_strong(expected, true))
    throw Error(
        "StopSignals: another instance already receives SIGINT and SIGTERM in this process");
  const sigset_t set = stop_set();
  ::pthread_sigmask(SIG_BLOCK, &set, nullptr);
  // A shell starts background jobs of a script with SIGINT ignored, and an ignored signal is
  // discarded before anyone can receive it: the default disposition lets it wait (blocked)
  // for the receiving thread.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  for (int s : kStopSignals) ::sigaction(s, &dfl, nullptr);
  signal_fd_ = ::signalfd(-1, &set, SFD_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (signal_fd_ < 0 || wake_fd_ < 0) {
    const int err = errno;
    if (signal_fd_ >= 0) ::close(signal_fd_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
    g_instance.store(false);
    throw Error(str("StopSignals: cannot create the signal descriptors: ", std::strerror(err)));
  }
  receiver_ = std::thread([this] { receive(); });
  const std::vector<int> open = threads_not_blocking_stop_signals();
  if (!open.empty())
    spdlog::warn(
        "{} thread(s) started before StopSignals do not block SIGINT and SIGTERM (first: {}); a "
        "stop signal may run on them",
        open.size(), open.front());
}

StopSignals::~StopSignals() {
  const uint64_t one = 1;
  ssize_t w = ::write(wake_fd_, &one, sizeof one);
  (void)w;
  receiver_.join();
  ::close(signal_fd_);
  ::close(wake_fd_);
  g_instance.store(false);
}

void StopSignals::receive() {
  for (;;) {
    struct pollfd fds[2] = {{signal_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents) return;
    struct signalfd_siginfo info {};
    const ssize_t r = ::read(signal_fd_, &info, sizeof info);
    if (r == static_cast<ssize_t>(sizeof info)) on_signal(static_cast<int>(info.ssi_signo));
  }
}

void StopSignals::on_signal(int signal) {
  std::unique_lock<std::mutex> lock(mu_);
  int none = 0;
  if (graceful_ && requested_.compare_exchange_strong(none, signal)) {
    say(str("\nfuyou: ", signal_name(signal), ": ", message_, "; ",
            signal == SIGINT ? "press Ctrl-C again" : "send it again", " to stop at once\n"));
    return;
  }
  lock.unlock();
  end_process(signal);
}

void StopSignals::end_process(int signal) {
  std::vector<std::string> paths;
  bool second = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    paths = cleanup_;
    second = graceful_;
  }
  for (const std::string& p : paths)
    if (!p.empty() && p.back() != '/') ::unlink(p.c_str());
  for (const std::string& p : paths)
    if (!p.empty() && p.back() == '/') ::rmdir(p.c_str());
  say(second ? str("\nfuyou: second stop signal: exiting now",
                   paths.empty() ? "" : "; the engine's temporary files are removed",
                   ", the last checkpoint is intact\n")
             : str("\nfuyou: ", signal_name(signal), ": stopped\n"));
  ::_exit(128 + signal);
}

void StopSignals::check(const std::string& where) const {
  if (const int s = requested())
    throw StopRequested(s, str("stopped by ", signal_name(s), " ", where));
}

void StopSignals::request(int signal) {
  int none = 0;
  requested_.compare_exchange_strong(none, signal);
}

void StopSignals::set_graceful(const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  graceful_ = true;
  message_ = message;
}

void StopSignals::set_at_once() {
  std::lock_guard<std::mutex> lock(mu_);
  graceful_ = false;
}

void StopSignals::set_cleanup_paths(const std::vector<std::string>& paths) {
  std::lock_guard<std::mutex> lock(mu_);
  cleanup_ = paths;
}

std::string signal_name(int signal) {
  if (signal == SIGINT) return "SIGINT";
  if (signal == SIGTERM) return "SIGTERM";
  return str("signal ", signal);
}

std::vector<int> threads_not_blocking_stop_signals() {
  std::vector<int> out;
  DIR* d = ::opendir("/proc/self/task");
  if (!d) return out;
  while (const struct dirent* e = ::readdir(d)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    std::ifstream status(str("/proc/self/task/", e->d_name, "/status"));
    unsigned long long blocked = 0;
    bool found = false;
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("SigBlk:", 0) != 0) continue;
      found = std::sscanf(line.c_str() + 7, "%llx", &blocked) == 1;
      break;
    }
    if (!found) continue;  // the thread ended while we looked
    for (int s : kStopSignals)
      if (!(blocked & (1ull << (s - 1)))) {
        out.push_back(std::atoi(e->d_name));
        break;
      }
  }
  ::closedir(d);
  return out;
}

}  // namespace fuyou
