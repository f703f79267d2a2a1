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
constexpr int kMergeWarps = kMergeThreads / 32;
constexpr int kMergeMaxDim = 256;  // head_dim_vo of every kernel family that splits KV

// One (merge, query head, token) row: warp w combines the states w, w + 4, w + 8, ... with a running maximum, lane
// i holding state w + 4 i's LSE and weight and every lane accumulating float2 slices of each state's O (dims
// 2 lane + 64 j, so a warp reads 256 contiguous bytes per slice); the four warps then meet in shared memory. After
// the wait for the attention grid, a row of up to 128 states costs two dependent L2 trips (the LSEs, then all the
// warp's O slices at once: kBatch states per lane in flight) where a block-wide pass over the states cost one trip
// per eight of them plus two block barriers (8.9 us for 49 states under ncu, H200).
template <int kPairs>
__device__ __forceinline__ void merge_row(const AttentionParams& p, const PlanView& plan, const MergeItem& mi,
                                          int tok, int first_row, float* s_m, float* s_l,
                                          float2 (*s_o)[kMergeMaxDim / 2]) {
  // States whose slices a lane loads at once: 32 registers of O in flight (64 made the kernel 143 registers, three
  // CTAs per SM, and merges of many rows slower than the block-wide pass: 120 us against 36 us, H200, 15e76a7).
  constexpr int kBatch = 16 / kPairs;
  const int h = blockIdx.y, heads = p.num_qo_heads, dvo = p.head_dim_vo;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const WorkItem* items = plan.items + mi.first_item;
  const int row_offset = tok - mi.qo_begin;
  float m = -ATTNFORGE_INFINITY, l = 0.f;  // the warp's running maximum; l: this lane's states' weights
  float2 acc[kPairs];
  for (int j = 0; j < kPairs; ++j) acc[j] = make_float2(0.f, 0.f);
  for (int base = warp; base < mi.num_items; base += 32 * kMergeWarps) {
    const int k = base + kMergeWarps * lane;
    int row = -1;
    if (k < mi.num_items) row = (base == warp ? first_row : items[k].partial_row) + row_offset;
    const float lse = row >= 0 ? plan.partial_lse[static_cast<int64_t>(row) * heads + h] : -ATTNFORGE_INFINITY;
    float chunk_max = lse;
    for (int o = 16; o > 0; o >>= 1) chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, o));
    const float m_new = fmaxf(m, chunk_max);
    if (m_new == -ATTNFORGE_INFINITY) continue;  // warp-uniform: every state so far is empty
    const float scale = exp2f(m - m_new);        // 0 while m is -inf (acc and l are 0 then)
    l *= scale;
    for (int j = 0; j < kPairs; ++j) acc[j].x *= scale, acc[j].y *= scale;
    m = m_new;
    const float w = lse == -ATTNFORGE_INFINITY ? 0.f : exp2f(lse - m);
    l += w;
    const int count = min(32, (mi.num_items - base + kMergeWarps - 1) / kMergeWarps);
    for (int i0 = 0; i0 < count; i0 += kBatch) {
      float2 v[kBatch][kPairs];
      float wb[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = i0 + u;
        wb[u] = __shfl_sync(0xffffffffu, w, i & 31);
        const int r = __shfl_sync(0xffffffffu, row, i & 31);
        if (i < count && wb[u] != 0.f) {  // an empty state's O is never read
          const float2* src =
              reinterpret_cast<const float2*>(plan.partial_o + (static_cast<int64_t>(r) * heads + h) * dvo) + lane;
#pragma unroll
          for (int j = 0; j < kPairs; ++j) v[u][j] = src[32 * j];
        } else {
          wb[u] = 0.f;
#pragma unroll
          for (int j = 0; j < kPairs; ++j) v[u][j] = make_float2(0.f, 0.f);
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
#pragma unroll
        for (int j = 0; j < kPairs; ++j) acc[j].x += wb[u] * v[u][j].x, acc[j].y += wb[u] * v[u][j].y;
    }
  }
  for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
  if (lane == 0) s_m[warp] = m, s_l[warp] = l;
  for (int j = 0; j < kPairs; ++j) s_o[warp][lane + 32 * j] = acc[j];
  __syncthreads();
  float m_all = s_m[0];
  for (int w = 1; w < kMergeWarps; ++w) m_all = fmaxf(m_all, s_m[w]);
  float f[kMergeWarps], l_all = 0.f;
  for (int w = 0; w < kMergeWarps; ++w) {
    f[w] = s_m[w] == -ATTNFORGE_INFINITY ? 0.f : exp2f(s_m[w] - m_all);
    l_all += f[w] * s_l[w];
  }
  float lse = l_all > 0.f ? m_all + log2f(l_all) : -ATTNFORGE_INFINITY;
  const float inv = l_all > 0.f ? 1.f / l_all : 0.f;
  const float out_scale = inv * apply_sink(p.variant, h, &lse);
  const int qo_start = plan.qo_indptr[mi.request];
  const int64_t out_row = (qo_start + tok) * p.o_stride_token + h * p.o_stride_head;
  for (int e = threadIdx.x; e < dvo / 2; e += kMergeThreads) {
    float2 o = make_float2(0.f, 0.f);
    for (int w = 0; w < kMergeWarps; ++w) o.x += f[w] * s_o[w][e].x, o.y += f[w] * s_o[w][e].y;
    store_element(p.o, p.o_dtype, out_row + 2 * e, o.x * out_scale);
    store_element(p.o, p.o_dtype, out_row + 2 * e + 1, o.y * out_scale);
  }
  if (p.lse && threadIdx.x == 0) p.lse[(qo_start + tok) * p.lse_stride_token + h] = lse;
  __syncthreads();  // shared memory is reused by the next row
}

// Combines the partial states of each merge item: one CTA per (merge, query head, row block), grid-stride over the
// plan's merges and over the merge's query rows by gridDim.z (merge_row). Launched as a programmatic dependent of
// the attention kernel where the GPU has it (sm_90+): the plan's metadata (uploaded before the attention kernel) is
// read first, then griddepcontrol.wait holds the CTA until the attention grid has finished and its partial states
// are visible.
// At most 102 registers: five CTAs per SM or more (at six, ptxas spilled 32 bytes).
__global__ void __launch_bounds__(kMergeThreads, 5) merge_kernel(const AttentionParams p) {
  __shared__ float s_m[kMergeWarps], s_l[kMergeWarps];
  __shared__ float2 s_o[kMergeWarps][kMergeMaxDim / 2];
  const PlanView& plan = *p.plan;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int mi_index = blockIdx.x; mi_index < plan.num_merges; mi_index += gridDim.x) {
    const MergeItem mi = plan.merges[mi_index];
    // The first states' partial rows (plan metadata, not written by the attention kernel) before the wait.
    const int k = warp + kMergeWarps * lane;
    const int first_row = k < mi.num_items ? plan.items[mi.first_item + k].partial_row : 0;
    grid_dependency_wait();
    for (int tok = mi.qo_begin + static_cast<int>(blockIdx.z); tok < mi.qo_end; tok += gridDim.z) {
      switch (p.head_dim_vo) {
        case 64: merge_row<1>(p, plan, mi, tok, first_row, s_m, s_l, s_o); break;
        case 128: merge_row<2>(p, plan, mi, tok, first_row, s_m, s_l, s_o); break;
        default: merge_row<4>(p, plan, mi, tok, first_row, s_m, s_l, s_o); break;  // 256
      }
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
