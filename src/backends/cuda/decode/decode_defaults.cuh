// The decode kernel's default tile configuration, in a header that host code, nvcc and NVRTC all include: the
// nvcc build instantiates it, and the run-time compiler's keys (jit/kernel_key.h) default to it, so warm-up
// builds exactly what run() launches.
#pragma once

namespace attnforge::cuda {

// Two cp.async stages: one tile in flight while the other is consumed (why two: see DecodeTraits).
constexpr int kDefaultDecodeStages = 2;

}  // namespace attnforge::cuda
