// Parallel loops that a thread taken off its core does not hold up.
//
// at::parallel_for splits a range into one fixed share per thread. In the serving app the engine's two
// threads share two cores with the HTTP ingress, the replica and Ray: whenever one of those runs, one engine
// thread waits off-core while the other finishes its share and then spins at the loop's end, so every
// millisecond of serving work stalls the whole engine for as long. Here threads take chunks from a shared
// counter instead: a thread that loses its core holds back only the chunk it is on, and the other takes the
// rest. On an idle machine the cost is one atomic add per chunk.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace pagedserve {

// Calls f(begin, end) over [0, n) in chunks (in increasing order within a thread), from up to
// at::get_num_threads() threads; all calls have returned when this does. About kChunksPerThread chunks per
// thread: small enough that one thread can take over most of another's work, large enough that each chunk
// streams a long contiguous run.
constexpr int64_t kChunksPerThread = 8;

template <typename F>
void shared_for(int64_t n, const F& f) {
  if (n <= 0) return;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunk = std::max<int64_t>(1, n / (threads * kChunksPerThread));
  const int64_t workers = std::min<int64_t>(threads, (n + chunk - 1) / chunk);
  if (workers <= 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t b; (b = next.fetch_add(chunk, std::memory_order_relaxed)) < n;) f(b, std::min(n, b + chunk));
  });
}

}  // namespace pagedserve
