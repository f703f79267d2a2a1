#include "backends/cuda/merge/merge.h"

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/merge/merge_kernel.cuh"

namespace attnforge::cuda {

KernelDims merge_dims(const AttentionParams& p) {
  return {dim3(p.merge_capacity > 0 ? p.merge_capacity : 1, p.num_qo_heads), dim3(kMergeThreads), 0};
}

LaunchConfig attention_launch_config(const AttentionParams& p, int rows_per_cta, const KernelAttributes& a) {
  const int group = p.num_qo_heads / p.num_kv_heads;
  const unsigned row_blocks = (p.qo_tile * group + rows_per_cta - 1) / rows_per_cta;
  LaunchConfig c;
  c.attention = {dim3(p.item_capacity > 0 ? p.item_capacity : 1, p.num_kv_heads, row_blocks), dim3(a.threads),
                 static_cast<unsigned>(a.max_dynamic_smem)};
  c.merge = merge_dims(p);
  c.run_merge = p.merge_capacity > 0;
  return c;
}

void run_merge(const AttentionParams& p, cudaStream_t stream) {
  if (p.merge_capacity <= 0) return;
  const KernelDims d = merge_dims(p);
  merge_kernel<<<d.grid, d.block, d.smem_bytes, stream>>>(p);
  ATTNFORGE_CUDA_CHECK(cudaGetLastError());
}

void run_merge_states(const MergeStatesParams& p, cudaStream_t stream) {
  const int64_t tasks = p.n * p.num_heads;
  if (tasks == 0) return;
  const int64_t blocks = (tasks + kMergeStatesWarps - 1) / kMergeStatesWarps;
  merge_states_kernel<<<static_cast<unsigned>(blocks), 32 * kMergeStatesWarps, 0, stream>>>(p);
  ATTNFORGE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace attnforge::cuda
