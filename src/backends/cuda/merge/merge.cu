#include "backends/cuda/merge/merge.h"

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/merge/merge_kernel.cuh"

namespace attnforge::cuda {

KernelDims merge_dims(const AttentionParams& p) {
  return {dim3(p.merge_capacity > 0 ? p.merge_capacity : 1, p.num_qo_heads), dim3(kMergeThreads), 0};
}

void run_merge(const AttentionParams& p, cudaStream_t stream) {
  if (p.merge_capacity <= 0) return;
  const KernelDims d = merge_dims(p);
  merge_kernel<<<d.grid, d.block, d.smem_bytes, stream>>>(p);
  ATTNFORGE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace attnforge::cuda
