// An ordered queue of host operations run by one worker thread: the CPU's stand-in for a CUDA
// stream (kernels/cpu/stream_backend.cc). Operations run one at a time in submission order;
// each submission returns a ticket, and wait(ticket) returns once that operation and every one
// before it have run, as cudaEventSynchronize on an event recorded after them would.
#pragma once

#include <omp.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "fuyou/rng.h"
#include "fuyou/threads.h"

namespace fuyou::cpu {

class OpQueue {
 public:
  // `omp_threads`: the OpenMP team size of the operations (set on the worker thread, since
  // omp_set_num_threads applies to the calling thread only). Each operation first sleeps a
  // random time in [min_delay_us, max_delay_us] microseconds drawn from Rng(seed, stream): a
  // caller that forgets to wait for it then reads or overwrites its memory early, and a test
  // fails.
  OpQueue(int omp_threads, int min_delay_us, int max_delay_us, uint64_t seed, uint64_t stream)
      : omp_threads_(omp_threads),
        min_delay_us_(min_delay_us),
        max_delay_us_(max_delay_us),
        rng_(seed, stream),
        worker_([this] { run(); }) {}

  // Runs what is queued, then stops.
  ~OpQueue() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  uint64_t submit(std::function<void()> op) {
    std::lock_guard<std::mutex> lock(mu_);
    ops_.emplace_back(++submitted_, std::move(op));
    cv_.notify_all();
    return submitted_;
  }

  // The ticket of the last operation submitted (0: none yet).
  uint64_t submitted() const {
    std::lock_guard<std::mutex> lock(mu_);
    return submitted_;
  }

  // Blocks until operation `ticket` has run. An operation's exception is kept and rethrown
  // by every later wait, as a CUDA stream's error is sticky.
  void wait(uint64_t ticket) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_ >= ticket || error_; });
    if (error_) std::rethrow_exception(error_);
  }

  void wait_all() { wait(submitted()); }

 private:
  void run() {
    set_thread_team(omp_threads_);
    for (;;) {
      std::pair<uint64_t, std::function<void()>> op;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !ops_.empty(); });
        if (ops_.empty()) return;
        op = std::move(ops_.front());
        ops_.pop_front();
      }
      if (max_delay_us_ > 0)
        std::this_thread::sleep_for(std::chrono::microseconds(
            min_delay_us_ + rng_.below(static_cast<uint64_t>(max_delay_us_ - min_delay_us_) + 1)));
      std::exception_ptr err;
      try {
        op.second();
      } catch (...) {
        err = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (err && !error_) error_ = err;
        done_ = op.first;
      }
      cv_.notify_all();
    }
  }

  const int omp_threads_;
  const int min_delay_us_, max_delay_us_;
  Rng rng_;  // the worker's only
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<uint64_t, std::function<void()>>> ops_;
  uint64_t submitted_ = 0, done_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread worker_;  // last: starts once everything above is initialised
};

}  // namespace fuyou::cpu
