// RopeOptions -> RopeParams, shared by fused RoPE in attention and apply_rope.
#include <cmath>

#include "core/check.h"
#include "core/shape.h"

namespace attnforge::detail {

RopeParams rope_params(const RopeOptions& r, int32_t head_dim) {
  RopeParams p{};
  p.enabled = 1;
  p.rotary_dim = r.rotary_dim == 0 ? head_dim : r.rotary_dim;
  if (p.rotary_dim < 2 || p.rotary_dim % 2 != 0 || p.rotary_dim > head_dim)
    fail_arg("rope.rotary_dim: {}; expected 0 (all of head_dim) or an even value in [2, head_dim={}]", r.rotary_dim, head_dim);
  if (!std::isfinite(r.theta) || r.theta <= 0.f) fail_arg("rope.theta: {}; expected a finite value > 0", r.theta);
  if (!std::isfinite(r.scale) || r.scale <= 0.f) fail_arg("rope.scale: {}; expected a finite value > 0", r.scale);
  if (!(r.llama31_factor >= 0.f) || !std::isfinite(r.llama31_factor))
    fail_arg("rope.llama31_factor: {}; expected 0 (off) or a finite value > 0", r.llama31_factor);
  if (r.llama31_factor > 0.f && (!(r.llama31_low_freq_factor > 0.f) ||
                                 !(r.llama31_high_freq_factor > r.llama31_low_freq_factor) ||
                                 !(r.llama31_old_context_len > 0.f)))
    fail_arg("rope.llama31_*: low {} / high {} / old_context_len {}; expected 0 < low < high and old_context_len > 0",
             r.llama31_low_freq_factor, r.llama31_high_freq_factor, r.llama31_old_context_len);
  p.interleave = r.interleave ? 1 : 0;
  p.theta = r.theta;
  p.rcp_scale = 1.f / r.scale;
  p.llama31_factor = r.llama31_factor;
  p.llama31_low_freq_factor = r.llama31_low_freq_factor;
  p.llama31_high_freq_factor = r.llama31_high_freq_factor;
  p.llama31_old_context_len = r.llama31_old_context_len;
  return p;
}

}  // namespace attnforge::detail
