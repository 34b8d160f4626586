// The GEMM bench's instruments (fuyou-bench gemm --backend cuda, src/runtime/profile_bench.cc)
// on the CPU backend: its operands are random bf16 over every byte of each buffer (the arena's
// blocks start zeroed, and zeros multiply faster), and its timing is the span between two
// marks around queued calls, as the cuBLASLt side's events.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/sim_bench.h"
#include "kernels/common/element_math.h"

using namespace fuyou;

TEST_CASE("gemm bench operands are random bf16 over the whole buffer", "[bench]") {
  auto be = make_cpu_backend(1, 0);
  be->set_storage_type(ElemType::kBF16);
  // Two copy chunks (4 Mi values each) and a partial third: every chunk written, the stream
  // continued across them (a chunk is not the previous one again).
  constexpr size_t kChunk = size_t(1) << 22;
  const size_t n = 2 * kChunk + 1001;
  void* dst = be->alloc(2 * n, "operands");
  be->zero(dst, 2 * n);
  fill_random_bf16(*be, dst, n, 7);
  std::vector<uint16_t> got(n);
  be->copy_to_host(got.data(), dst, 2 * n);
  size_t zeros = 0;
  double sum = 0, sum_sq = 0;
  float lo = 1, hi = -1;
  for (uint16_t h : got) {
    const float v = math::bf16_to_float(h);
    zeros += v == 0.0f;
    sum += v;
    sum_sq += double(v) * v;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  // Uniform on [-1, 1): mean 0 and variance 1/3; the sample's standard errors at n ~ 8.4M are
  // 2e-4 and 1e-4, so 5e-3 bounds are met unless the values are not that distribution. The
  // values that round to zero in bf16 are those within 2^-134 of it: none should occur.
  CHECK(zeros == 0);
  CHECK(std::abs(sum / n) < 5e-3);
  CHECK(std::abs(sum_sq / n - 1.0 / 3) < 5e-3);
  CHECK(lo >= -1.0f);
  CHECK(hi <= 1.0f);
  CHECK(lo < -0.99f);
  CHECK(hi > 0.99f);
  CHECK(std::memcmp(got.data(), got.data() + kChunk, 2 * 1000) != 0);
  CHECK(std::memcmp(got.data() + kChunk, got.data() + 2 * kChunk, 2 * 1000) != 0);
  // The tail of the partial chunk was written too.
  size_t tail_zeros = 0;
  for (size_t i = n - 1001; i < n; ++i) tail_zeros += got[i] == 0;
  CHECK(tail_zeros == 0);

  // Another seed, other numbers: the bench's buffers do not repeat one another.
  std::vector<uint16_t> other(1000);
  void* dst2 = be->alloc(2 * other.size(), "operands 2");
  fill_random_bf16(*be, dst2, other.size(), 8);
  be->copy_to_host(other.data(), dst2, 2 * other.size());
  CHECK(std::memcmp(other.data(), got.data(), 2 * other.size()) != 0);
  be->free(dst2);
  be->free(dst);
}
