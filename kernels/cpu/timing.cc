// Step timing marks (Backend: step timing): the clock-based default, right where compute is
// synchronous (the CPU backend), and cpu-streams' marks queued on its compute queue.
#include <chrono>
#include <mutex>

#include "fuyou/backend.h"
#include "kernels/cpu/stream_backend.h"

namespace fuyou {

namespace {

double clock_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<Backend::TimingMark> relative(const std::vector<std::pair<int, double>>& marks) {
  std::vector<Backend::TimingMark> out;
  for (const auto& [tag, t] : marks) out.push_back({tag, t - marks.front().second});
  return out;
}

}  // namespace

void Backend::timing_start() {
  std::lock_guard<std::mutex> lock(timing_mu_);
  host_marks_.clear();
  timing_on_ = true;
}

void Backend::timing_mark(int tag) {
  std::lock_guard<std::mutex> lock(timing_mu_);
  if (timing_on_) host_marks_.push_back({tag, clock_seconds()});
}

std::vector<Backend::TimingMark> Backend::timing_stop() {
  std::lock_guard<std::mutex> lock(timing_mu_);
  timing_on_ = false;
  return relative(host_marks_);
}

namespace cpu {

void StreamBackend::timing_start() {
  std::lock_guard<std::mutex> lock(marks_mu_);
  marks_.clear();
  timing_on_ = true;
}

void StreamBackend::timing_mark(int tag) {
  if (!timing_on()) return;
  kernel([tag, this] {
    std::lock_guard<std::mutex> lock(marks_mu_);
    marks_.push_back({tag, clock_seconds()});
  });
}

std::vector<Backend::TimingMark> StreamBackend::timing_stop() {
  compute_.wait_all();
  std::lock_guard<std::mutex> lock(marks_mu_);
  timing_on_ = false;
  return relative(marks_);
}

}  // namespace cpu
}  // namespace fuyou
