#include "backends/cpu/thread_pool.h"

#include <string>

#include "backends/cpu/kernels.h"
#include "core/env.h"

namespace attnforge::cpu {

namespace {
thread_local int32_t t_worker = -1;  // the worker running a task on this thread, -1 outside tasks

int32_t threads_from_env() {
  if (const int v = detail::env_int("ATTNFORGE_NUM_THREADS", 1, 4096, 0); v > 0) return v;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int32_t>(hw) : 1;
}
}  // namespace

ThreadPool& ThreadPool::instance() {
  static ThreadPool pool(threads_from_env(), kScratchFloats);
  return pool;
}

ThreadPool::ThreadPool(int32_t num_workers, size_t scratch_floats)
    : num_workers_(num_workers < 1 ? 1 : num_workers),
      scratch_floats_(scratch_floats),
      scratch_(new float[static_cast<size_t>(num_workers_) * scratch_floats]) {
  for (int32_t w = 1; w < num_workers_; ++w) threads_.emplace_back([this, w] { worker_loop(w); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::drain(int32_t worker) {
  t_worker = worker;
  for (int64_t i = next_.fetch_add(1); i < num_tasks_; i = next_.fetch_add(1)) task_(i, worker);
  t_worker = -1;
}

void ThreadPool::worker_loop(int32_t worker) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    drain(worker);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--busy_ == 0) done_.notify_one();
    }
  }
}

void ThreadPool::run_tasks(int64_t n, TaskRef task) {
  if (n <= 0) return;
  if (t_worker >= 0 || num_workers_ == 1 || n == 1) {
    // Nested (inside a task: keep that task's worker and scratch) or trivial: run here.
    const int32_t worker = t_worker >= 0 ? t_worker : 0;
    for (int64_t i = 0; i < n; ++i) task(i, worker);
    return;
  }
  std::lock_guard<std::mutex> call(call_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    task_ = task;
    num_tasks_ = n;
    next_.store(0);
    busy_ = num_workers_ - 1;
    ++generation_;
  }
  wake_.notify_all();
  drain(0);
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return busy_ == 0; });
  task_ = {nullptr, nullptr};
}

}  // namespace attnforge::cpu
