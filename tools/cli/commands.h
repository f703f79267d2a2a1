// The subcommands of the attnforge tool. main.cc parses the command line and calls one of these; each returns
// the process exit status and throws only for errors that end the command (main prints them).
#pragma once

#include <cstdint>
#include <string>

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
};

int run_info();
int run_check(const CheckOptions& options);
int run_bench(const BenchOptions& options);
int run_warmup();

}  // namespace attnforge::cli
