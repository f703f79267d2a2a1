// Merges the partial attention states of KV split into several work items (decode and prefill alike).
// Self-contained for NVRTC.
#pragma once

#include "attnforge/kernel/op_params.h"
#include "attnforge/kernel/params.h"
#include "attnforge/kernel/state.h"
#include "attnforge/kernel/variant.h"
#include "backends/cuda/device/ptx.cuh"

namespace attnforge::cuda {

constexpr int kMergeThreads = 128;
constexpr int kMergeChunk = 256;  // partial states whose weights sit in shared memory at once

__device__ __forceinline__ float block_reduce_max(float x, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = x;
  __syncthreads();
  x = scratch[0];
  for (int w = 1; w < kMergeThreads / 32; ++w) x = fmaxf(x, scratch[w]);
  __syncthreads();
  return x;
}

// Combines the partial states of each merge item: one CTA per (merge, query head). The weights of up to
// kMergeChunk partial states are computed in parallel into shared memory, then each thread accumulates its
// dimensions over them with independent loads (a serial chain of dependent loads per state was 11 us for 16
// states: every one waited a full L2 round trip).
// The minimum of one block per SM lifts the register cap ptxas otherwise chose (32, with a spill).
__global__ void __launch_bounds__(kMergeThreads, 1) merge_kernel(const AttentionParams p) {
  __shared__ float s_w[kMergeChunk];
  __shared__ int64_t s_row[kMergeChunk];
  __shared__ float s_red[kMergeThreads / 32];
  const PlanView& plan = *p.plan;
  const int h = blockIdx.y;
  const int dvo = p.head_dim_vo;
  const int tid = threadIdx.x;
  for (int mi_index = blockIdx.x; mi_index < plan.num_merges; mi_index += gridDim.x) {
    const MergeItem mi = plan.merges[mi_index];
    const int qo_start = plan.qo_indptr[mi.request];
    for (int tok = mi.qo_begin; tok < mi.qo_end; ++tok) {
      const WorkItem* items = plan.items + mi.first_item;
      const int row_offset = tok - mi.qo_begin;
      float m = -ATTNFORGE_INFINITY;
      for (int k = tid; k < mi.num_items; k += kMergeThreads) m = fmaxf(m, plan.partial_lse[(static_cast<int64_t>(items[k].partial_row) + row_offset) * p.num_qo_heads + h]);
      m = block_reduce_max(m, s_red);
      float l = 0.f, o0 = 0.f, o1 = 0.f;  // dims tid and tid + 128 (head_dim <= 256)
      for (int base = 0; base < mi.num_items; base += kMergeChunk) {
        const int n = min(kMergeChunk, mi.num_items - base);
        for (int k = tid; k < n; k += kMergeThreads) {
          const int64_t row = static_cast<int64_t>(items[base + k].partial_row) + row_offset;
          const float lse_k = plan.partial_lse[row * p.num_qo_heads + h];
          s_w[k] = m == -ATTNFORGE_INFINITY || lse_k == -ATTNFORGE_INFINITY ? 0.f : exp2f(lse_k - m);
          s_row[k] = (row * p.num_qo_heads + h) * dvo;
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < n; ++k) {
          const float w = s_w[k];
          l += w;
          const float* part = plan.partial_o + s_row[k];
          if (tid < dvo) o0 += w * part[tid];
          if (tid + kMergeThreads < dvo) o1 += w * part[tid + kMergeThreads];
        }
        __syncthreads();
      }
      float lse = l > 0.f ? m + log2f(l) : -ATTNFORGE_INFINITY;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const float f = inv * apply_sink(p.variant, h, &lse);
      const int64_t out_row = (qo_start + tok) * p.o_stride_token + h * p.o_stride_head;
      if (tid < dvo) store_element(p.o, p.o_dtype, out_row + tid, o0 * f);
      if (tid + kMergeThreads < dvo) store_element(p.o, p.o_dtype, out_row + tid + kMergeThreads, o1 * f);
      if (p.lse && tid == 0) p.lse[(qo_start + tok) * p.lse_stride_token + h] = lse;
    }
  }
}

// merge_state / merge_states (the operators, attnforge/ops.h): one warp per (row, head) combines its num_states
// states. The weights come from the states' LSEs alone (2^(lse_k - max) over their sum), so every lane of the
// warp uses the same ones for its dims; an empty state (lse -inf) weighs 0, and all-empty rows give (0, -inf),
// the identity, as merge_weights does.
constexpr int kMergeStatesWarps = 4;

__global__ void __launch_bounds__(32 * kMergeStatesWarps) merge_states_kernel(const MergeStatesParams p) {
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kMergeStatesWarps + threadIdx.x / 32;
  if (task >= p.n * p.num_heads) return;
  const int lane = threadIdx.x & 31;
  const int64_t i = task / p.num_heads;
  const int h = static_cast<int>(task % p.num_heads);
  auto state = [&](int k) -> const StateView& { return p.num_sources > 0 ? p.sources[k] : p.stacked; };
  auto lse_of = [&](int k) {
    const StateView& src = state(k);
    const int64_t off = p.num_sources > 0 ? 0 : k * p.s_stride_state;
    return src.s[off + i * src.s_stride_n + h * src.s_stride_head];
  };
  float m = -ATTNFORGE_INFINITY;
  for (int k = 0; k < p.num_states; ++k) m = fmaxf(m, lse_of(k));
  float sum = 0.f;
  if (m != -ATTNFORGE_INFINITY)
    for (int k = 0; k < p.num_states; ++k) {
      const float l = lse_of(k);
      sum += l == -ATTNFORGE_INFINITY ? 0.f : exp2f(l - m);
    }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  for (int d = lane; d < p.head_dim; d += 32) {
    float o = 0.f;
    for (int k = 0; k < p.num_states; ++k) {
      const float l = lse_of(k);
      if (l == -ATTNFORGE_INFINITY) continue;
      const StateView& src = state(k);
      const int64_t off = p.num_sources > 0 ? 0 : k * p.v_stride_state;
      o += exp2f(l - m) * load_element(src.v, src.v_dtype, off + i * src.v_stride_n + h * src.v_stride_head + d);
    }
    store_element(p.o, p.o_dtype, i * p.o_stride_n + h * p.o_stride_head + d, o * inv);
  }
  if (p.lse && lane == 0) p.lse[i * p.lse_stride_n + h * p.lse_stride_head] = sum > 0.f ? m + log2f(sum) : -ATTNFORGE_INFINITY;
}

}  // namespace attnforge::cuda
