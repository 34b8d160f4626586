#include "fuyou/threads.h"

#include <omp.h>

#include <algorithm>

namespace fuyou {

int set_thread_team(int threads) {
  omp_set_dynamic(0);
  const int n = std::max(1, std::min(threads, omp_get_thread_limit()));
  omp_set_num_threads(n);
  return n;
}

}  // namespace fuyou
