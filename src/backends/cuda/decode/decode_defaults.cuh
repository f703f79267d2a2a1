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

#if !defined(__CUDACC_RTC__)  // host code only (NVRTC takes no host functions)
constexpr bool is_fp8(DType t) { return t == DType::kFloat8E4M3 || t == DType::kFloat8E5M2; }
constexpr int default_decode_stages(DType kv_dtype) {
  return is_fp8(kv_dtype) ? kDefaultDecodeStagesFp8 : kDefaultDecodeStages;
}
#endif

}  // namespace attnforge::cuda
