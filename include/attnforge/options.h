// Per-run (per-layer) attention options. None of these is frozen into a plan.
#pragma once

#include "attnforge/tensor.h"

namespace attnforge {

// RoPE applied to Q and K inside attention (or by apply_rope). Positions: KV token j of request b is at
// j + pos_offset[b]; query row i at kv_len - qo_len + i + pos_offset[b].
struct RopeOptions {
  bool enabled = false;
  int32_t rotary_dim = 0;   // 0: the whole head_dim
  bool interleave = false;  // false: rotate halves (Llama); true: rotate adjacent pairs (GPT-J)
  float theta = 1e4f;
  float scale = 1.f;        // positions are divided by this
  // Llama 3.1 frequency scaling, on when factor > 0 (Llama 3.1 uses 8, 1, 4, 8192).
  float llama31_factor = 0.f;
  float llama31_low_freq_factor = 1.f;
  float llama31_high_freq_factor = 4.f;
  float llama31_old_context_len = 8192.f;
  TensorView pos_offset;  // optional int32 [batch]
};

// Bit-packed custom mask for tree-shaped speculative decoding. Request b's [qo_len, kv_len] boolean mask is
// stored row-major from byte indptr[b], bit k of the request at byte k / 8, bit k % 8 (little bit order, as
// numpy.packbits(..., bitorder="little")). 1 = attend.
struct CustomMask {
  TensorView bits;    // uint8 [total bytes]
  TensorView indptr;  // int32 [batch + 1], byte offsets; each segment holds ceil(qo_len * kv_len / 8) bytes
};

// The order in which options act on a logit is in kernel/variant.h: scale, soft-cap, ALiBi, masks; then a
// softmax that includes the sink logit of the head, if sinks are given.
struct AttentionOptions {
  float sm_scale = 0.f;  // 0: 1 / sqrt(head_dim_qk)
  bool causal = false;   // bottom-right aligned; needs qo_len <= kv_len for every request
  int32_t window_left = -1;   // -1: unbounded
  int32_t window_right = -1;  // -1: unbounded
  float logits_soft_cap = 0.f;  // 0: off
  TensorView alibi_slopes;      // optional float32 [num_qo_heads]
  TensorView sinks;             // optional float32 [num_qo_heads]
  CustomMask custom_mask;       // optional
  RopeOptions rope;
  // CUDA, compute capability 9.0+: the decode kernel is launched as a programmatic dependent of the kernel before it
  // on the stream, so its CTAs can be scheduled during that kernel's last moments; it reads the plan's metadata first
  // and Q, the page table, K/V and option tensors only after that kernel has finished (griddepcontrol.wait). false:
  // a plain launch. ATTNFORGE_DECODE_PDL=0 turns it off for the whole process. Ignored elsewhere.
  bool programmatic_launch = true;
};

}  // namespace attnforge
