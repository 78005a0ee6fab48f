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

// Calls f(begin, end) over [0, n) in chunks of at most `chunk` items (in increasing order within a thread),
// from up to at::get_num_threads() threads; all calls have returned when this does.
template <typename F>
void shared_for(int64_t n, int64_t chunk, const F& f) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), chunks);
  if (workers <= 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t b; (b = next.fetch_add(chunk, std::memory_order_relaxed)) < n;) f(b, std::min(n, b + chunk));
  });
}

// A chunk size that gives each thread about `per_thread` chunks of [0, n): small enough that one thread
// can take over most of another's work, large enough that each chunk streams a long contiguous run.
inline int64_t chunk_for(int64_t n, int64_t per_thread = 8) {
  return std::max<int64_t>(1, n / (std::max<int64_t>(1, at::get_num_threads()) * per_thread));
}

}  // namespace pagedserve
