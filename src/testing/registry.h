// The registry of attention cases: the same list runs in the unit tests (tests/test_attention.cc), in
// `attnforge check`, and, on a GPU, against every backend. random_spec() drives the fuzz test.
#pragma once

#include <vector>

#include "testing/cases.h"

namespace attnforge::testing {

// Every operator path and option on odd sizes; `quick` keeps a representative dozen.
std::vector<CaseSpec> registry_cases(bool quick = false);

// A random batch (lengths, heads, dims, dtypes, formats, options) drawn from `seed`.
CaseSpec random_spec(uint64_t seed);

}  // namespace attnforge::testing
