// A fixed pool of worker threads for the CPU backend. The calling thread takes part as worker 0. Each worker
// owns a scratch area allocated once when the pool starts, so run() allocates nothing.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace attnforge::cpu {

class ThreadPool {
 public:
  // Threads: ATTNFORGE_NUM_THREADS if set, else the hardware concurrency.
  static ThreadPool& instance();

  explicit ThreadPool(int32_t num_workers, size_t scratch_floats);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int32_t size() const { return num_workers_; }
  // Runs task(i, worker) for i in [0, n) and returns when all are done. Tasks must not throw. A call made
  // from inside a task runs its tasks serially on that worker. The task is referenced, never copied, so a call
  // allocates nothing (std::function could).
  template <typename F>
  void parallel_for(int64_t n, const F& task) {
    run_tasks(n, TaskRef{&task, [](const void* f, int64_t i, int32_t w) { (*static_cast<const F*>(f))(i, w); }});
  }
  float* scratch(int32_t worker) { return scratch_.get() + static_cast<size_t>(worker) * scratch_floats_; }

 private:
  struct TaskRef {
    const void* object;
    void (*call)(const void*, int64_t, int32_t);
    void operator()(int64_t i, int32_t w) const { call(object, i, w); }
  };
  void run_tasks(int64_t n, TaskRef task);
  void worker_loop(int32_t worker);
  void drain(int32_t worker);

  int32_t num_workers_;
  size_t scratch_floats_;
  std::unique_ptr<float[]> scratch_;
  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  TaskRef task_{nullptr, nullptr};
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  int32_t busy_ = 0;
  std::mutex call_mutex_;  // one parallel_for at a time
};

}  // namespace attnforge::cpu
