#pragma once
// parallel_for for the test harness: the float64 reference and the data of large cases are the slow part of the
// GPU tests and benchmarks (a 16-core device machine otherwise waits on one core). Work items must write disjoint
// memory; results do not depend on the number of threads.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace attnforge::testing {

// Calls fn(i) for every i in [0, n), items taken in order by up to hardware_concurrency threads (inline when
// there is one item or one core).
template <typename Fn>
void parallel_for(int64_t n, Fn&& fn) {
  const int64_t threads = std::min<int64_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(i);
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

}  // namespace attnforge::testing
