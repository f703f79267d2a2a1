// What the built-in options do to one logit, written once for every backend. NVRTC-clean.
//
// Positions: query row i of a request with qo_len queries and kv_len keys sits at position
// q_pos = kv_len - qo_len + i (bottom-right alignment: the last query sees the last key), KV token j at j.
#pragma once

#include "attnforge/kernel/params.h"
#include "attnforge/kernel/state.h"

#if !defined(__CUDACC_RTC__)
#include <math.h>
#endif

namespace attnforge {

ATTNFORGE_HOST_DEVICE int32_t query_position(int32_t i, int32_t qo_len, int32_t kv_len) { return kv_len - qo_len + i; }

// KV positions [*lo, *hi) that causal and window allow for a query at q_pos. The custom mask can forbid more.
ATTNFORGE_HOST_DEVICE void allowed_kv_range(const VariantParams& v, int32_t q_pos, int32_t kv_len, int32_t* lo,
                                            int32_t* hi) {
  int64_t begin = 0, end = kv_len;
  if (v.causal && q_pos + 1 < end) end = q_pos + 1;
  if (v.window_right >= 0 && static_cast<int64_t>(q_pos) + v.window_right + 1 < end) end = q_pos + v.window_right + 1;
  if (v.window_left >= 0 && static_cast<int64_t>(q_pos) - v.window_left > begin) begin = q_pos - v.window_left;
  if (end < begin) end = begin;
  *lo = static_cast<int32_t>(begin);
  *hi = static_cast<int32_t>(end);
}

// Bit (i, j) of request b's custom mask; true where attention is allowed.
ATTNFORGE_HOST_DEVICE bool custom_mask_allows(const VariantParams& v, int32_t b, int32_t i, int32_t j,
                                              int32_t kv_len) {
  const int64_t bit = static_cast<int64_t>(v.mask_byte_indptr[b]) * 8 + static_cast<int64_t>(i) * kv_len + j;
  return (v.custom_mask[bit >> 3] >> (bit & 7)) & 1;
}

// Soft-cap and ALiBi on a scaled logit s (natural-log units).
ATTNFORGE_HOST_DEVICE float transform_logit(const VariantParams& v, float s, int32_t qo_head, int32_t q_pos,
                                            int32_t kv_pos) {
  if (v.soft_cap > 0.f) s = v.soft_cap * tanhf(s / v.soft_cap);
  if (v.alibi_slopes) s += v.alibi_slopes[qo_head] * static_cast<float>(kv_pos - q_pos);
  return s;
}

// Folds head's sink logit into a finished row state whose lse is in log2 units: updates *lse and returns the
// factor the normalized o is multiplied by (1 without sinks). An empty row (lse -inf) stays at o = 0.
ATTNFORGE_HOST_DEVICE float apply_sink(const VariantParams& v, int32_t head, float* lse) {
  if (!v.sinks) return 1.f;
  const float sink = v.sinks[head] * kLog2e;
  const float m = fmaxf(*lse, sink);
  const float total = m + log2f(exp2f(*lse - m) + exp2f(sink - m));
  const float f = exp2f(*lse - total);
  *lse = total;
  return f;
}

// Frequency of rotary pair p (0 <= p < rotary_dim / 2), Llama 3.1 scaling included.
ATTNFORGE_HOST_DEVICE float rope_frequency(const RopeParams& r, int32_t p) {
  float freq = powf(r.theta, -2.f * static_cast<float>(p) / static_cast<float>(r.rotary_dim));
  if (r.llama31_factor > 0.f) {
    const float kTwoPi = 6.283185307179586f;
    const float wavelen = kTwoPi / freq;
    const float low_wavelen = r.llama31_old_context_len / r.llama31_low_freq_factor;
    const float high_wavelen = r.llama31_old_context_len / r.llama31_high_freq_factor;
    if (wavelen > low_wavelen) {
      freq = freq / r.llama31_factor;
    } else if (wavelen >= high_wavelen) {
      const float smooth = (r.llama31_old_context_len / wavelen - r.llama31_low_freq_factor) /
                           (r.llama31_high_freq_factor - r.llama31_low_freq_factor);
      freq = (1.f - smooth) * freq / r.llama31_factor + smooth * freq;
    }
  }
  return freq;
}

// Indices of the two elements rotary pair p mixes.
ATTNFORGE_HOST_DEVICE void rope_pair(const RopeParams& r, int32_t p, int32_t* a, int32_t* b) {
  if (r.interleave) {
    *a = 2 * p;
    *b = 2 * p + 1;
  } else {
    *a = p;
    *b = p + r.rotary_dim / 2;
  }
}

// Rotates x (fp32, head_dim elements, in place) to position pos. freqs holds rope_frequency for each pair.
ATTNFORGE_HOST_DEVICE void rope_rotate(const RopeParams& r, const float* freqs, float* x, int32_t pos) {
  const float scaled_pos = static_cast<float>(pos) * r.rcp_scale;
  for (int32_t p = 0; p < r.rotary_dim / 2; ++p) {
    int32_t a, b;
    rope_pair(r, p, &a, &b);
    const float angle = scaled_pos * freqs[p];
    const float c = cosf(angle), s = sinf(angle);
    const float xa = x[a], xb = x[b];
    x[a] = xa * c - xb * s;
    x[b] = xb * c + xa * s;
  }
}

}  // namespace attnforge
