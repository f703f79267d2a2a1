// The CPU backend's thread pool, constructed directly with 3 workers: every index runs exactly once, worker ids
// are in range, every worker takes part, and a parallel_for called from inside a task runs inline on that
// task's worker.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "backends/cpu/thread_pool.h"

namespace attnforge::cpu {
namespace {

constexpr int32_t kWorkers = 3;
constexpr uint32_t kAllWorkers = (1u << kWorkers) - 1;

// Holds each task until every worker has started one (or 5 s have passed). Without it the calling thread
// could drain a short call alone before the other workers wake, and a test would not see them.
struct AllWorkersGate {
  std::atomic<uint32_t> seen{0};
  void arrive(int32_t worker) {
    if (worker >= 0 && worker < kWorkers) seen.fetch_or(1u << worker);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (seen.load() != kAllWorkers && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  }
};

TEST(ThreadPool, SizeIsTheWorkerCount) {
  ThreadPool pool(kWorkers, 16);
  EXPECT_EQ(pool.size(), kWorkers);
  ThreadPool clamped(0, 16);  // fewer than one worker means one
  EXPECT_EQ(clamped.size(), 1);
}

TEST(ThreadPool, EveryIndexExactlyOnceWithWorkerIdsInRange) {
  ThreadPool pool(kWorkers, 16);
  for (int64_t n : {0, 1, 2, 7, 1000}) {
    std::vector<std::atomic<int32_t>> runs(static_cast<size_t>(n));
    std::atomic<int32_t> bad_worker{-1};
    AllWorkersGate gate;
    pool.parallel_for(n, [&](int64_t i, int32_t worker) {
      if (worker < 0 || worker >= kWorkers) bad_worker = worker;
      if (n >= kWorkers) gate.arrive(worker);
      runs[static_cast<size_t>(i)].fetch_add(1);
    });
    EXPECT_EQ(bad_worker.load(), -1) << "n = " << n << ": a task ran with worker id " << bad_worker.load();
    if (n >= kWorkers) EXPECT_EQ(gate.seen.load(), kAllWorkers) << "n = " << n << ": not every worker ran a task";
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(runs[static_cast<size_t>(i)].load(), 1) << "n = " << n << ": index " << i;
  }
}

TEST(ThreadPool, ManyConsecutiveCalls) {
  // Each call is a new generation for the workers; a worker that missed or repeated one would lose or double
  // indices, or hang the call.
  ThreadPool pool(kWorkers, 16);
  for (int call = 0; call < 300; ++call) {
    const int64_t n = 1 + call % 17;
    std::atomic<int64_t> sum{0};
    pool.parallel_for(n, [&](int64_t i, int32_t) { sum.fetch_add(i + 1); });
    ASSERT_EQ(sum.load(), n * (n + 1) / 2) << "call " << call << " with n = " << n;
  }
}

TEST(ThreadPool, NestedParallelForRunsInlineOnTheSameWorker) {
  ThreadPool pool(kWorkers, 16);
  constexpr int64_t kOuter = 12, kInner = 5;
  std::vector<std::atomic<int32_t>> runs(kOuter * kInner);
  std::atomic<int32_t> wrong_worker{0}, wrong_thread{0};
  AllWorkersGate gate;  // outer tasks on every worker, so that "the same worker" is not always worker 0
  pool.parallel_for(kOuter, [&](int64_t i, int32_t worker) {
    gate.arrive(worker);
    const std::thread::id outer_thread = std::this_thread::get_id();
    pool.parallel_for(kInner, [&](int64_t j, int32_t inner_worker) {
      if (inner_worker != worker) wrong_worker.fetch_add(1);
      if (std::this_thread::get_id() != outer_thread) wrong_thread.fetch_add(1);
      runs[static_cast<size_t>(i * kInner + j)].fetch_add(1);
    });
  });
  ASSERT_EQ(gate.seen.load(), kAllWorkers) << "not every worker ran an outer task";
  EXPECT_EQ(wrong_worker.load(), 0) << "inner tasks ran with another worker id than their outer task";
  EXPECT_EQ(wrong_thread.load(), 0) << "inner tasks ran on another thread than their outer task";
  for (size_t k = 0; k < runs.size(); ++k) ASSERT_EQ(runs[k].load(), 1) << "outer " << k / kInner << ", inner " << k % kInner;
}

TEST(ThreadPool, ScratchAreasAreDisjoint) {
  constexpr size_t kFloats = 64;
  ThreadPool pool(kWorkers, kFloats);
  for (int32_t w = 0; w + 1 < kWorkers; ++w) EXPECT_EQ(pool.scratch(w + 1) - pool.scratch(w), static_cast<ptrdiff_t>(kFloats));
  // Each worker fills its own scratch with its id during the tasks; no task may see another worker's id there.
  std::atomic<int32_t> clobbered{0};
  AllWorkersGate gate;
  pool.parallel_for(3000, [&](int64_t, int32_t worker) {
    gate.arrive(worker);
    float* s = pool.scratch(worker);
    for (size_t k = 0; k < kFloats; ++k) s[k] = static_cast<float>(worker);
    for (size_t k = 0; k < kFloats; ++k)
      if (s[k] != static_cast<float>(worker)) clobbered.fetch_add(1);
  });
  EXPECT_EQ(gate.seen.load(), kAllWorkers) << "not every worker ran a task";
  EXPECT_EQ(clobbered.load(), 0);
}

}  // namespace
}  // namespace attnforge::cpu
