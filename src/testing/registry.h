// The registry of attention cases: the same list runs in the unit tests (tests/test_attention.cc), in
// `attnforge check`, and, on a GPU, against every backend. random_spec() drives the fuzz test.
#pragma once

#include <vector>

#include "testing/cases.h"

namespace attnforge::testing {

// Every operator path and option on odd sizes; `quick` keeps a representative dozen.
std::vector<CaseSpec> registry_cases(bool quick = false);

// Decode with fp8 K/V (e4m3fn and e5m2, k_scale and v_scale != 1) on every path of the CUDA fp8 decode kernel:
// bf16 and fp16 Q, head dims 64/128/256, GQA groups 1, 3, 4 and 7, page sizes 1, 16 and 3, NHD and HND, CSR,
// block table and ragged KV, empty requests, odd lengths, several query tokens per request, split KV with
// merges, and the per-element options (fused RoPE aside: CUDA refuses it with fp8 K/V).
std::vector<CaseSpec> fp8_decode_cases();

// A random batch (lengths, heads, dims, dtypes, formats, options) drawn from `seed`.
CaseSpec random_spec(uint64_t seed);

}  // namespace attnforge::testing
