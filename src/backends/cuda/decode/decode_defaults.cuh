// The decode kernel's default tile configuration, in a header that host code, nvcc and NVRTC all include: the
// nvcc build instantiates it, and the run-time compiler's keys (jit/kernel_key.h) default to it, so warm-up
// builds exactly what run() launches.
#pragma once

#include "attnforge/kernel/types.h"

namespace attnforge::cuda {

// Two cp.async stages: one tile in flight while the other is consumed (why two: see DecodeTraits).
constexpr int kDefaultDecodeStages = 2;
// fp8 K/V: four stages of half-size tiles, the shared memory of two 16-bit stages.
constexpr int kDefaultDecodeStagesFp8 = 4;
// The small-batch pipeline's stages (small_batch_decode_stages below names the shapes that take them).
constexpr int kSmallBatchDecodeStages = 3;
// Query rows of a decode CTA (one mma M tile; DecodeTraits::kRows): the planner keeps a merge's arrival counters
// per block of them (Backend::decode_merge).
constexpr int kDecodeCtaRows = 16;

#if !defined(__CUDACC_RTC__)  // host code only (NVRTC takes no host functions)
constexpr bool is_fp8(DType t) { return t == DType::kFloat8E4M3 || t == DType::kFloat8E5M2; }
constexpr int default_decode_stages(DType kv_dtype) {
  return is_fp8(kv_dtype) ? kDefaultDecodeStagesFp8 : kDefaultDecodeStages;
}
// Decode batches too small to fill the GPU (the planner's small-batch pipeline, Backend::small_batch_pipeline):
// three stages, so two tiles in flight per CTA: at head_dim 128 two CTAs per SM, 128 KB in flight per SM against
// 96 KB for three CTAs of two stages (H200, session 22: 1 x 32768 and 16 x 2048 -4%, 1 x 2048 -5% a call in a graph
// of many; 64 x 4096, 3.3 waves, +1% with three stages: larger batches keep two); at head_dim 256 one CTA either way,
// 128 KB against 64 (-2 to -3%). At head_dim 64 (three CTAs either way, 96 KB against 48) it measured level: not
// used there. 16-bit K/V (fp8 K/V runs four stages of half the bytes already); 0: the default stages serve every
// batch of the shape.
constexpr int small_batch_decode_stages(int head_dim, DType q_dtype, DType kv_dtype) {
  return (head_dim == 128 || head_dim == 256) && kv_dtype == q_dtype ? kSmallBatchDecodeStages : 0;
}
#endif

}  // namespace attnforge::cuda
