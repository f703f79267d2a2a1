// The subcommands of the attnforge tool. main.cc parses the command line and calls one of these; each returns
// the process exit status and throws only for errors that end the command (main prints them).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace attnforge::cli {

struct CheckOptions {
  bool quick = false;
  uint64_t seed = 0;  // shifts every case's seed: 0 runs the unit tests' data, another value new data
};

struct BenchOptions {
  bool quick = false;
  std::string json_path;  // empty: no JSON
  std::string device;  // empty: the best device present
  int32_t iters = 0;  // 0: the suite's default
  std::string suite = "all";  // GPU: all, decode or prefill
  std::string case_filter;     // only the cases whose name contains this (empty: all)
  int32_t gpus = 0;            // suite long: the most GPUs to split over (0: every visible one, at most 8)
  int32_t workers = 0;         // PlanOptions::num_workers of every case (0: the device's); a tuning knob
  int32_t tile_rows = 0;       // PlanOptions::tile_rows of every prefill case (0: the planner's choice)
  bool warm_code = false;      // GPU: a small run of the same kernels before every timed call (a measuring knob)
};

struct WarmupCommandOptions {
  std::vector<std::string> archs;  // empty: the visible GPUs' (or sm_90a for --bench without a GPU)
  std::vector<int32_t> head_dims;  // empty: the default set's (64, 128, 256)
  std::vector<std::string> dtypes;  // fp16, bf16; empty: both
  std::vector<std::string> kv_dtypes;  // same (K/V in the dtype of Q), e4m3, e5m2; empty: all
  std::vector<int32_t> page_sizes;  // empty: 1 and 16
  int32_t threads = 0;              // 0: every core
  std::string cache_dir;            // empty: ATTNFORGE_CACHE_DIR or the default
  bool quiet = false;
  bool bench = false;  // compile and load times, warm-up time, NVRTC vs nvcc kernel speed
  bool quick = false;  // --bench: the quick GPU suite for the speed comparison
  bool compile_check = false;  // --bench: one cold compile each and the one-model warm-up only (slow machines, CI)
  int32_t iters = 0;   // --bench: timed runs per case (0: 100, 20 with --quick)
  std::string json_path;
};

int run_info();
int run_check(const CheckOptions& options);
int run_bench(const BenchOptions& options);
int run_warmup(const WarmupCommandOptions& options);

}  // namespace attnforge::cli
