// Launch set-up the kernel families share (host side).
#pragma once

#include <cuda_runtime.h>

#include "backends/cuda/cuda_check.h"

namespace attnforge::cuda {

// Grid, block and dynamic shared memory of one launch.
struct KernelDims {
  dim3 grid, block;
  unsigned smem_bytes;
};

// Raises the kernel's dynamic shared memory limit to smem_bytes and sets its shared-memory carveout (100: prefer
// shared memory over L1, so the CTAs the occupancy calculation counts on fit); returns the CTAs of `threads`
// threads one SM holds. Callers keep the result in a function-local static: once per instantiation.
template <typename Kernel>
int configure_kernel(Kernel kernel, int threads, int smem_bytes, int carveout_percent = 100) {
  ATTNFORGE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  ATTNFORGE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, carveout_percent));
  int n = 0;
  ATTNFORGE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem_bytes));
  return n;
}

}  // namespace attnforge::cuda
