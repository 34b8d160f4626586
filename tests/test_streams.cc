// The CPU backend's CUDA-ordered twin (runtime.backend: cpu-streams, kernels/cpu/
// stream_backend.h): kernels run after the call returns, copies wait for them unless the
// caller orders the work itself, new memory holds garbage until its zeroing runs. Each check
// here would pass on the synchronous CPU backend only by accident of timing on the twin, so
// the delays are fixed and long (compute queued behind several of them).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/backend_select.h"
#include "fuyou/config.h"
#include "fuyou/train.h"

using namespace fuyou;

namespace {

constexpr int kDelayUs = 40000;  // every queued operation sleeps this long first

std::unique_ptr<Backend> slow_twin() {
  StreamOptions so;
  so.min_delay_us = so.max_delay_us = kDelayUs;
  return make_cpu_stream_backend(2, 0, so);
}

}  // namespace

TEST_CASE("cpu-streams: copies wait for queued compute unless the caller orders the work",
          "[streams]") {
  auto be = slow_twin();
  CHECK_THAT(be->name(), Catch::Matchers::Contains("cpu-streams"));
  const size_t n = 1024;
  std::vector<float> ones(n, 1.0f), back(n, 0.0f);
  float* x = static_cast<float*>(be->alloc(4 * n, "x"));
  be->copy_to_device(x, ones.data(), 4 * n);  // waits for the zeroing queued by alloc
  // Four kernels, each behind a delay: the last ends about 4 delays from now.
  for (int k = 0; k < 4; ++k) be->add(x, x, x, n);  // x *= 2
  be->copy_to_host(back.data(), x, 4 * n);          // default ordering: after every kernel queued
  CHECK(back[0] == 16.0f);
  CHECK(back[n - 1] == 16.0f);

  be->set_caller_ordered(true);
  for (int k = 0; k < 4; ++k) be->add(x, x, x, n);  // x *= 2
  be->copy_to_host(back.data(), x, 4 * n);          // one delay: overtakes the queued kernels
  INFO("caller-ordered copy read " << back[0]);
  CHECK(back[0] < 256.0f);
  be->finish_compute();
  be->copy_to_host(back.data(), x, 4 * n);
  CHECK(back[0] == 256.0f);
  be->free(x);
  be->synchronize();
}

TEST_CASE("cpu-streams: a caller-ordered copy into new memory lands after its zeroing",
          "[streams]") {
  // On the GPU, alloc queues the arena's zeroing on the compute stream and a caller-ordered
  // copy runs on the copy stream: unordered, the zeroing may land after the copy and erase it.
  auto be = slow_twin();
  be->set_caller_ordered(true);
  const size_t n = 256;
  std::vector<float> data(n), back(n, 0.0f);
  for (size_t i = 0; i < n; ++i) data[i] = 1.0f + static_cast<float>(i);
  // Several allocations: the last one's zeroing runs about that many delays from now.
  std::vector<float*> bufs;
  for (int k = 0; k < 4; ++k) bufs.push_back(static_cast<float*>(be->alloc(4 * n, "buffer")));
  be->copy_to_device(bufs.back(), data.data(), 4 * n);
  be->finish_compute();
  be->copy_to_host(back.data(), bufs.back(), 4 * n);
  CHECK(std::memcmp(back.data(), data.data(), 4 * n) == 0);
  // The other buffers read zero once their zeroing has run.
  be->copy_to_host(back.data(), bufs.front(), 4 * n);
  CHECK(back[0] == 0.0f);
  for (float* b : bufs) be->free(b);
}

TEST_CASE("cpu-streams: in-memory training gives the CPU backend's bits", "[streams]") {
  Config cfg = parse_config(
      "model: {n_layer: 2, n_head: 2, d_model: 32, d_ff: 64, vocab_size: 64, seq_len: 16}\n"
      "schedule: {steps: 3, warmup_steps: 1, micro_batch: 2}\n"
      "runtime: {backend: cpu-streams, stream_delay_us: 200, threads: 2, seed: 3}\n",
      "<test>");
  std::string why;
  auto twin = make_backend(cfg, &why);
  CHECK_THAT(why, Catch::Matchers::Contains("cpu-streams"));
  auto cpu = make_cpu_backend(2, 0);
  std::vector<int32_t> batch(static_cast<size_t>(cfg.schedule.micro_batch) *
                             (cfg.model.seq_len + 1));
  for (size_t i = 0; i < batch.size(); ++i)
    batch[i] = static_cast<int32_t>((i * 7 + 3) % cfg.model.vocab_size);
  InMemoryStep a(cfg, *twin), b(cfg, *cpu);
  a.init_params();
  b.init_params();
  for (int s = 0; s < 3; ++s) {
    const float la = a.step(s, {batch.data()}).loss, lb = b.step(s, {batch.data()}).loss;
    INFO("step " << s << ": cpu-streams " << la << ", cpu " << lb);
    CHECK(std::memcmp(&la, &lb, 4) == 0);
  }
  CHECK(std::memcmp(a.master().data(), b.master().data(), 4 * a.master().size()) == 0);
}
