// Host-side pieces the nvcc-compiled decode instantiations share (decode.cu: 16-bit K/V; decode_fp8.cu: fp8 K/V,
// a translation unit of its own so the two compile in parallel). Included by .cu files only.
#pragma once

#include <cuda_runtime.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/decode/decode.h"
#include "backends/cuda/decode/decode_kernel.cuh"
#include "backends/cuda/kernel_config.h"

namespace attnforge::cuda {

// The attributes of one instantiation: its threads and shared memory come from its traits.
template <class Tr>
KernelAttributes attributes_of() {
  return KernelAttributes{Tr::kThreads, Tr::kSmemBytes, 100};
}

// Sets the attributes once per instantiation and device; returns the CTAs one SM holds.
template <class Tr>
int configure_decode() {
  static PerDevice ctas_per_sm;
  return ctas_per_sm.get([] {
    const KernelAttributes a = attributes_of<Tr>();
    return configure_kernel(decode_kernel<Tr>, a.threads, a.max_dynamic_smem, a.carveout_percent);
  });
}

template <class Tr>
void launch_decode(const AttentionParams& p, const KernelDims& dims, cudaStream_t stream) {
  configure_decode<Tr>();
  launch_kernel(decode_kernel<Tr>, dims, stream, p.programmatic_launch && decode_programmatic_launch(), p);
}

// fp8 K/V instantiations (decode_fp8.cu).
int decode_fp8_ctas_per_sm(int head_dim, DType kv_dtype);
void launch_decode_fp8(const AttentionParams& p, const KernelDims& dims, cudaStream_t stream);

}  // namespace attnforge::cuda
