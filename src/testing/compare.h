// Comparator: kernel output against the float64 reference, with a tolerance derived from the same-precision
// naive computation (reference.h: float32 loops, V weighted by probabilities held in the 16-bit input type,
// output rounded to its dtype): max |kernel - ref| <= 2 x max |naive - ref| + (4 fp32 rounding steps at the
// largest reference magnitude). It reports the worst element, its index and both values, and requires NaN
// and infinity positions to match exactly.
#pragma once

#include <string>
#include <vector>

#include "testing/cases.h"
#include "testing/reference.h"

namespace attnforge::testing {

struct Verdict {
  bool ok = true;
  std::string message;  // what failed, or a one-line summary
  double max_err = 0, tolerance = 0, naive_err = 0;
};

// Compares `got` (read from a buffer of `dtype` through the index function the case gives) with ref.
Verdict compare_values(const char* what, const std::vector<double>& got, const std::vector<double>& ref,
                       const std::vector<double>& naive, DType out_dtype, int32_t inner_dims[2]);

// Checks out and lse of a case that has been run, on the given rows (empty = all).
Verdict check_case(const Case& c, const std::vector<int64_t>& rows = {});

double rounding_step(DType t);  // relative spacing of the dtype near 1

}  // namespace attnforge::testing
