// The OpenMP team of the calling thread. Every thread that runs the engine's parallel loops
// or its GEMMs (the main thread, the executor's workers, the optimizer's worker, the
// cpu-streams queues) sets its own: OpenMP's thread count and dynamic adjustment are per
// thread.
#pragma once

namespace fuyou {

// Asks for `threads` (>= 1) threads in the calling thread's parallel regions, capped at
// OMP_THREAD_LIMIT, with dynamic adjustment off, and returns the count it set. oneDNN splits
// a GEMM's work by the team size it asks for: a runtime that then hands it fewer threads
// (OMP_DYNAMIC=true, or a thread limit below the request) leaves part of the product
// uncomputed without any error.
int set_thread_team(int threads);

}  // namespace fuyou
