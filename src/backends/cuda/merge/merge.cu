#include "backends/cuda/merge/merge.h"

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/merge/merge_kernel.cuh"

namespace attnforge::cuda {

void run_merge(const AttentionParams& p, int merge_capacity, cudaStream_t stream) {
  if (merge_capacity <= 0) return;
  const dim3 grid(merge_capacity, p.num_qo_heads);
  merge_kernel<<<grid, kMergeThreads, 0, stream>>>(p);
  ATTNFORGE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace attnforge::cuda
