#include "backends/cuda/merge/merge.h"

#include <string>

#include "attnforge/error.h"
#include "core/env.h"

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/merge/merge_kernel.cuh"

namespace attnforge::cuda {

// Query rows of a merge run in parallel CTAs (up to 8; more loop): speculative verification merges 4-8 rows each.
// Any re-plan's rows are covered whatever qo_tile it has, since the kernel strides over them by gridDim.z. A warp
// per (row, head) takes four heads per CTA; four warps per row, one head (merge_one_warp). Streamed merges
// (merge_streamed) take the decode kernel's grid less its items: one CTA per (merge, KV head, block of its CTA rows).
KernelDims merge_dims(const AttentionParams& p) {
  if (p.merge_flags != nullptr) {  // streamed: one CTA per (merge, KV head, decode CTA's row block)
    const int rows = p.qo_tile * (p.num_qo_heads / p.num_kv_heads);
    return {dim3(p.merge_capacity > 0 ? p.merge_capacity : 1, p.num_kv_heads,
                 (rows + kDecodeCtaRows - 1) / kDecodeCtaRows),
            dim3(p.head_dim_vo <= 128 ? kStreamThreads<128> : kStreamThreads<256>), 0};
  }
  const unsigned row_blocks = static_cast<unsigned>(p.qo_tile < 1 ? 1 : p.qo_tile > 8 ? 8 : p.qo_tile);
  const unsigned head_blocks = merge_one_warp(p) ? (p.num_qo_heads + kMergeWarps - 1) / kMergeWarps : p.num_qo_heads;
  return {dim3(p.merge_capacity > 0 ? p.merge_capacity : 1, head_blocks, row_blocks), dim3(kMergeThreads), 0};
}

LaunchConfig attention_launch_config(const AttentionParams& p, int rows_per_cta, const KernelAttributes& a) {
  const int group = p.num_qo_heads / p.num_kv_heads;
  const unsigned row_blocks = (p.qo_tile * group + rows_per_cta - 1) / rows_per_cta;
  LaunchConfig c;
  c.attention = {dim3(p.item_capacity > 0 ? p.item_capacity : 1, p.num_kv_heads, row_blocks), dim3(a.threads),
                 static_cast<unsigned>(a.max_dynamic_smem)};
  c.merge = merge_dims(p);
  c.run_merge = p.merge_capacity > 0 && p.merge_counters == nullptr;  // else the decode kernel merges
  return c;
}

bool merge_programmatic_launch() {
  static const bool allowed = detail::env_choice("ATTNFORGE_MERGE_PDL", {"0", "1"}, "1") == "1";
  return allowed && compute_capability() >= 90;
}

const std::string& decode_kernel_merge_mode() {
  static const std::string mode =
      detail::env_choice("ATTNFORGE_DECODE_KERNEL_MERGE", {"0", "1", "kernel", "several", "stream"}, "1");
  return mode;
}

bool decode_merges_streamed() { return decode_kernel_merge_mode() == "stream"; }

void run_merge(const AttentionParams& p, cudaStream_t stream) {
  if (p.merge_capacity <= 0 || p.merge_counters != nullptr) return;  // none, or merged by the decode kernel
  launch_kernel(p.merge_flags != nullptr ? merge_stream_kernel : merge_kernel, merge_dims(p), stream,
                merge_programmatic_launch(), p);
  ATTNFORGE_TL(print_timeline("merge", stream);)  // trace builds: before the attention kernel's lines
}

void run_merge_states(const MergeStatesParams& p, cudaStream_t stream) {
  const int64_t tasks = p.n * p.num_heads;
  if (tasks == 0) return;
  const int64_t blocks = (tasks + kMergeStatesWarps - 1) / kMergeStatesWarps;
  merge_states_kernel<<<static_cast<unsigned>(blocks), 32 * kMergeStatesWarps, 0, stream>>>(p);
  ATTNFORGE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace attnforge::cuda
