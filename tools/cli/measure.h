// Timing shared by the bench cases and the ceilings: warm-up calls, then timed calls with steady_clock around
// each one, reduced to the median (robust to the odd preempted run on a shared machine).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

namespace attnforge::cli {

struct Measurement {
  double median_us = 0;
  double work = 0;  // per call: bytes moved (memory-bound) or floating-point operations (compute-bound)
  int32_t iters = 0;
  // GB/s for bytes, GFLOP/s for operations.
  double rate() const { return work / (median_us * 1e3); }
};

// Calls fn(i) for i = 0, 1, ...: `warmup` untimed calls, then `iters` timed ones. The index lets a caller
// rotate between copies of its inputs.
template <typename Fn>
Measurement measure(double work, int32_t warmup, int32_t iters, Fn&& fn) {
  for (int32_t i = 0; i < warmup; ++i) fn(i);
  std::vector<double> us(static_cast<size_t>(iters));
  for (int32_t i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn(warmup + i);
    const auto t1 = std::chrono::steady_clock::now();
    us[i] = std::chrono::duration<double, std::micro>(t1 - t0).count();
  }
  std::sort(us.begin(), us.end());
  const size_t mid = us.size() / 2;
  const double median = us.size() % 2 ? us[mid] : (us[mid - 1] + us[mid]) / 2;
  return {median, work, iters};
}

}  // namespace attnforge::cli
