// Ceilings measured in the same run as the bench, so each case can be reported as a fraction of what this
// machine does at best: a streaming read for memory-bound cases, an fp32 matrix product for compute-bound ones.
#pragma once

#include <cstdint>
#include <string>

#include "measure.h"

namespace attnforge::cli {

struct Ceiling {
  std::string name;    // "streaming read", "fp32 gemm"
  std::string detail;  // how it was measured, printed and recorded with the number
  Measurement m;       // work: bytes read, or floating-point operations
};

// One std::thread per hardware thread sums 16 MiB chunks of a 1 GiB fp32 buffer (taken from a shared counter);
// GB/s of the whole pass.
Ceiling measure_read_bandwidth(int32_t passes);
// attnforge's own fp32 GEMM loop, C = A x B of 1024^3, row blocks over all hardware threads; GFLOP/s. It is a
// plain register-blocked loop, not a tuned BLAS: a percentage against it says how close attention gets to the
// arithmetic this tool can reach, not to the hardware's peak.
Ceiling measure_fp32_gemm(int32_t passes);

}  // namespace attnforge::cli
