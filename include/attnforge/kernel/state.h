// Attention states and their exact merge. NVRTC-clean.
//
// The state of a query row over a KV set S is (o, lse): o = softmax-weighted mean of V over S and
// lse = log2(sum over S of exp(s_j)) with s_j the natural-log logits. The state of an empty set is
// (0, -inf) and is the identity of merge; merge is associative and commutative up to rounding.
#pragma once

#include "attnforge/kernel/types.h"

#if !defined(__CUDACC_RTC__)
#include <math.h>
#endif

namespace attnforge {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Weights of two states in their merge: w_a = 2^(lse_a - m) / (2^(lse_a - m) + 2^(lse_b - m)), m = max.
// Returns the merged lse. Both empty: weights 0 and lse -inf.
ATTNFORGE_HOST_DEVICE float merge_weights(float lse_a, float lse_b, float* w_a, float* w_b) {
  const float m = fmaxf(lse_a, lse_b);
  if (m == -ATTNFORGE_INFINITY) {
    *w_a = 0.f;
    *w_b = 0.f;
    return -ATTNFORGE_INFINITY;
  }
  const float ea = exp2f(lse_a - m), eb = exp2f(lse_b - m);
  const float sum = ea + eb;
  *w_a = ea / sum;
  *w_b = eb / sum;
  return m + log2f(sum);
}

}  // namespace attnforge
