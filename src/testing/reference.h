// The float64 reference: the plainest loops that compute attention from a Case's logical arrays (never from its
// page table), for tests and `attnforge check` only. Instantiated in float as well: that is the "same-precision
// naive computation" whose error sets the tolerance.
#pragma once

#include <vector>

#include "testing/cases.h"

namespace attnforge::testing {

struct Reference {
  std::vector<double> o;    // [total_qo, num_qo_heads, head_dim_vo]; rows not computed hold NaN
  std::vector<double> lse;  // [total_qo, num_qo_heads], log2
};

// Rows (query tokens, indices into the batch's total_qo) to compute; empty = all.
Reference reference_f64(const Case& c, const std::vector<int64_t>& rows = {});
// The same loops in float, with the output rounded to o_dtype as a kernel must round it.
Reference naive_f32(const Case& c, const std::vector<int64_t>& rows = {});

// Merge of states in float64 (for merge_state tests): v [n][states][heads][dim], s log2.
void reference_merge(const std::vector<double>& v, const std::vector<double>& s, int64_t n, int32_t states,
                     int32_t heads, int32_t dim, std::vector<double>* v_out, std::vector<double>* s_out);

}  // namespace attnforge::testing
