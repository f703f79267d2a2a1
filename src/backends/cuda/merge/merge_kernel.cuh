// Merges the partial attention states of KV split into several work items (decode and prefill alike).
// Self-contained for NVRTC.
#pragma once

#include "attnforge/kernel/op_params.h"
#include "attnforge/kernel/params.h"
#include "attnforge/kernel/state.h"
#include "attnforge/kernel/variant.h"
#include "backends/cuda/decode/decode_defaults.cuh"
#include "backends/cuda/device/ptx.cuh"
#include "backends/cuda/device/timeline.cuh"

namespace attnforge::cuda {

constexpr int kMergeThreads = 128;
constexpr int kMergeWarps = kMergeThreads / 32;
constexpr int kMergeMaxDim = 256;  // head_dim_vo of every kernel family that splits KV

// A merge has two shapes. Few states (speculative verification, small batches split a little: 2-3 states, many
// rows): a warp per (row, head), four heads per CTA, no shared memory and no barrier. More states (one request
// split over the SMs: 16 to dozens of states, few rows): the four warps of a CTA share a row. The host picks one
// per launch from the plan's largest merge (merge_dims, merge_one_warp); both are correct for any plan, so a graph
// captured with one replays every re-plan. The bound, 8 states (one batch of O loads per lane at head_dim 128), is
// measured (ncu, H200, 3f6c00c): verify 64x8+4096 (2 states) 66.9 -> 22.7 us and 16x2048 (3) 6.21 -> 6.02 us with a
// warp per row, but decode 1x2048 (16 states, one row) 6.08 -> 8.06 us.
constexpr int kMergeWarpMaxStates = 8;
__host__ __device__ __forceinline__ bool merge_one_warp(const AttentionParams& p) {
  return p.max_merge_states <= kMergeWarpMaxStates;
}

// A warp's running state over some of a row's partial states: the maximum LSE seen (log2 units), the sum of its
// lanes' weights (per lane until reduced), and float2 slices of O (dims 2 lane + 64 j: 256 contiguous bytes per
// slice and warp).
template <int kPairs>
struct WarpState {
  float m = -ATTNFORGE_INFINITY, l = 0.f;
  float2 acc[kPairs];
};

// Adds the states first, first + stride, first + 2 stride, ... of merge `mi`'s row `tok` to the warp's state, 32 at
// a time: lane i holds the LSE and weight of the i-th, and every lane loads its O slices of kBatch states at once
// (two dependent L2 trips per 32 states: the LSEs, then the slices). `first_row`: the first state's partial row,
// read before the wait for the attention grid.
template <int kPairs>
__device__ __forceinline__ void warp_accumulate(const AttentionParams& p, const PlanView& plan, const MergeItem& mi,
                                                int tok, int first, int stride, int first_row, int h,
                                                WarpState<kPairs>& st, long long* tl_lse = nullptr) {
  // States whose slices a lane loads at once: 32 registers of O in flight (64 made the kernel 143 registers, three
  // CTAs per SM, and merges of many rows slower than the block-wide pass: 120 us against 36 us, H200, 15e76a7).
  constexpr int kBatch = 16 / kPairs;
  const int heads = p.num_qo_heads, dvo = p.head_dim_vo, lane = threadIdx.x % 32;
  const WorkItem* items = plan.items + mi.first_item;
  const int row_offset = tok - mi.qo_begin;
  for (int base = first; base < mi.num_items; base += 32 * stride) {
    const int k = base + stride * lane;
    int row = -1;
    if (k < mi.num_items) row = (base == first ? first_row : items[k].partial_row) + row_offset;
    const float lse = row >= 0 ? plan.partial_lse[static_cast<int64_t>(row) * heads + h] : -ATTNFORGE_INFINITY;
    float chunk_max = lse;
    for (int o = 16; o > 0; o >>= 1) chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, o));
    ATTNFORGE_TL(if (tl_lse && *tl_lse == 0) *tl_lse = global_ns();)
    const float m_new = fmaxf(st.m, chunk_max);
    if (m_new == -ATTNFORGE_INFINITY) continue;  // warp-uniform: every state so far is empty
    const float scale = exp2f(st.m - m_new);     // 0 while m is -inf (acc and l are 0 then)
    st.l *= scale;
    for (int j = 0; j < kPairs; ++j) st.acc[j].x *= scale, st.acc[j].y *= scale;
    st.m = m_new;
    const float w = lse == -ATTNFORGE_INFINITY ? 0.f : exp2f(lse - st.m);
    st.l += w;
    const int count = min(32, (mi.num_items - base + stride - 1) / stride);
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
        for (int j = 0; j < kPairs; ++j) st.acc[j].x += wb[u] * v[u][j].x, st.acc[j].y += wb[u] * v[u][j].y;
    }
  }
  for (int o = 16; o > 0; o >>= 1) st.l += __shfl_xor_sync(0xffffffffu, st.l, o);
}

// A finished row (maximum m, weight sum l): o = acc x scale (1 / l, sinks folded in), lse = m + log2 l. The thread
// that passes write_lse writes the LSE.
struct MergedRow {
  int64_t out_row;
  float scale;
};
__device__ __forceinline__ MergedRow finish_row(const AttentionParams& p, int qo_start, int tok, int h, float m,
                                                float l, bool write_lse) {
  float lse = l > 0.f ? m + log2f(l) : -ATTNFORGE_INFINITY;
  const float scale = (l > 0.f ? 1.f / l : 0.f) * apply_sink(p.variant, h, &lse);
  if (p.lse && write_lse) p.lse[(qo_start + tok) * p.lse_stride_token + h] = lse;
  return {(qo_start + tok) * p.o_stride_token + h * p.o_stride_head, scale};
}
// Columns 2 e and 2 e + 1 of a finished row.
__device__ __forceinline__ void store_pair(const AttentionParams& p, const MergedRow& r, int e, float2 o) {
  store_element(p.o, p.o_dtype, r.out_row + 2 * e, o.x * r.scale);
  store_element(p.o, p.o_dtype, r.out_row + 2 * e + 1, o.y * r.scale);
}

// Few states: this warp's (row, head), every state of the row.
template <int kPairs>
__device__ __forceinline__ void merge_row_warp(const AttentionParams& p, const PlanView& plan, const MergeItem& mi,
                                               int qo_start, int tok, int h, int first_row) {
  WarpState<kPairs> st;
  for (int j = 0; j < kPairs; ++j) st.acc[j] = make_float2(0.f, 0.f);
  warp_accumulate<kPairs>(p, plan, mi, tok, 0, 1, first_row, h, st);
  const int lane = threadIdx.x % 32;
  const MergedRow r = finish_row(p, qo_start, tok, h, st.m, st.l, lane == 0);
  for (int j = 0; j < kPairs; ++j) store_pair(p, r, lane + 32 * j, st.acc[j]);
}

// Many states: warp w takes the states w, w + 4, ...; the four warps meet in shared memory.
template <int kPairs>
__device__ __forceinline__ void merge_row_block(const AttentionParams& p, const PlanView& plan, const MergeItem& mi,
                                                int qo_start, int tok, int h, int first_row, float* s_m, float* s_l,
                                                float2 (*s_o)[kMergeMaxDim / 2], long long* tl = nullptr) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  WarpState<kPairs> st;
  for (int j = 0; j < kPairs; ++j) st.acc[j] = make_float2(0.f, 0.f);
  warp_accumulate<kPairs>(p, plan, mi, tok, warp, kMergeWarps, first_row, h, st, tl);
  ATTNFORGE_TL(if (tl && tl[1] == 0) tl[1] = global_ns();)
  if (lane == 0) s_m[warp] = st.m, s_l[warp] = st.l;
  for (int j = 0; j < kPairs; ++j) s_o[warp][lane + 32 * j] = st.acc[j];
  __syncthreads();
  ATTNFORGE_TL(if (tl && tl[2] == 0) tl[2] = global_ns();)
  float m_all = s_m[0];
  for (int w = 1; w < kMergeWarps; ++w) m_all = fmaxf(m_all, s_m[w]);
  float f[kMergeWarps], l_all = 0.f;
  for (int w = 0; w < kMergeWarps; ++w) {
    f[w] = s_m[w] == -ATTNFORGE_INFINITY ? 0.f : exp2f(s_m[w] - m_all);
    l_all += f[w] * s_l[w];
  }
  const MergedRow r = finish_row(p, qo_start, tok, h, m_all, l_all, threadIdx.x == 0);
  for (int e = threadIdx.x; e < p.head_dim_vo / 2; e += kMergeThreads) {
    float2 o = make_float2(0.f, 0.f);
    for (int w = 0; w < kMergeWarps; ++w) o.x += f[w] * s_o[w][e].x, o.y += f[w] * s_o[w][e].y;
    store_pair(p, r, e, o);
  }
  __syncthreads();  // shared memory is reused by the next row
}

template <int kPairs>
__device__ __forceinline__ void merge_items(const AttentionParams& p, float* s_m, float* s_l,
                                            float2 (*s_o)[kMergeMaxDim / 2]) {
  const PlanView& plan = *p.plan;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool one_warp = merge_one_warp(p);
  // One warp per row: this warp's head (none past the last); else the CTA's head.
  const int h = one_warp ? static_cast<int>(blockIdx.y) * kMergeWarps + warp : static_cast<int>(blockIdx.y);
  if (one_warp && h >= p.num_qo_heads) return;  // no barrier in this shape
  // Trace builds (device/timeline.cuh): the global time at the start, past the first wait, and at the end.
  // Trace builds also stamp the first row's steps past the wait (block shape): its LSEs known, its O slices summed,
  // the warps met.
  ATTNFORGE_TL(const long long tl_start = global_ns(); long long tl_waited = 0, tl_merges = 0, tl_row[3] = {0, 0, 0};)
  for (int mi_index = blockIdx.x; mi_index < plan.num_merges; mi_index += gridDim.x) {
    const MergeItem mi = plan.merges[mi_index];
    // The first states' partial rows (plan metadata, not written by the attention kernel) before the wait.
    const int k = one_warp ? lane : warp + kMergeWarps * lane;
    const int first_row = k < mi.num_items ? plan.items[mi.first_item + k].partial_row : 0;
    // So are the row's place in O and the pointers to the partial states: read here, they cost no trip after the
    // wait, where the timelines put 2.4-3.7 us of trips (five: these two, the LSEs, two batches of O slices).
    const int qo_start = plan.qo_indptr[mi.request];
    PlanView states{};
    states.items = plan.items, states.partial_o = plan.partial_o, states.partial_lse = plan.partial_lse;
    grid_dependency_wait();
    // The next kernel on the stream, where it is a programmatic dependent (the next decode call's kernel), may be
    // scheduled now: it waits for this grid's end before it reads anything this grid or the caller writes.
    grid_launch_dependents();
    ATTNFORGE_TL(if (tl_waited == 0) tl_waited = global_ns();)
    for (int tok = mi.qo_begin + static_cast<int>(blockIdx.z); tok < mi.qo_end; tok += gridDim.z) {
      if (one_warp)
        merge_row_warp<kPairs>(p, states, mi, qo_start, tok, h, first_row);
      else
        merge_row_block<kPairs>(p, states, mi, qo_start, tok, h, first_row, s_m, s_l, s_o ATTNFORGE_TL(, tl_row));
    }
    ATTNFORGE_TL(++tl_merges;)
  }
  ATTNFORGE_TL(if (long long* f = timeline_slot(); f && threadIdx.x == 0) {
    f[0] = tl_start, f[1] = global_ns(), f[2] = tl_waited, f[10] = (sm_id() << 32) | tl_merges;
    f[3] = tl_row[0], f[4] = tl_row[1], f[5] = tl_row[2];
  })
}

// Streamed merges (AttentionParams::merge_flags, decode): the merge runs beside the decode grid instead of after it.
// The decode kernel releases one flag per (item, KV head, block of its CTA rows) once that CTA's partial rows are
// written, and lets this grid be scheduled from its first instruction; a CTA here takes one (merge, KV head, row
// block), the rows of exactly one decode CTA of each state, and folds the states in KV order as their flags appear,
// so when the last state lands only its own trip and one update remain (the decode kernel's own merge waited for the
// last state, then fetched all of them and reduced them: 3.8 us of the 1 x 32768 step, perf-notes v21).
// A thread owns (row, four dims) pairs; each warp polls a window of 32 flags (an acquire load per lane, a ballot for
// the ready prefix) and, between polls, updates its pairs' running (m, l, o) a batch of states at a time. (Relaxed
// polls with one acquire fence a ready batch, and shorter sleeps, made it slower together with a later launch of
// this grid: perf-notes v22.) The flags are
// read by this CTA alone, which puts them back to zero for the next launch. Never waits on a flag a decode CTA will
// not release: this grid starts only once every decode CTA has (launch_dependents), so every CTA it waits for is
// resident or done, and each (item, KV head, row block) with rows publishes exactly once.

// A streamed merge's output for four dims d4 .. d4 + 3 of (token `tok` of Q and O, query head h) from the states'
// maximum m, weight sum l and weighted sum acc: normalized, sinks folded in, and the LSE with the first four dims.
__device__ __forceinline__ void write_merged_quad(const AttentionParams& p, int tok, int h, int d4, float m, float l,
                                                  float4 acc) {
  float lse = l > 0.f ? m + log2f(l) : -ATTNFORGE_INFINITY;
  const float f = (l > 0.f ? 1.f / l : 0.f) * apply_sink(p.variant, h, &lse);
  const int64_t out = static_cast<int64_t>(tok) * p.o_stride_token + h * p.o_stride_head + d4;
  store_element(p.o, p.o_dtype, out, acc.x * f);
  store_element(p.o, p.o_dtype, out + 1, acc.y * f);
  store_element(p.o, p.o_dtype, out + 2, acc.z * f);
  store_element(p.o, p.o_dtype, out + 3, acc.w * f);
  if (p.lse && d4 == 0) p.lse[static_cast<int64_t>(tok) * p.lse_stride_token + h] = lse;
}

// One merge's rows row0 .. row0 + rows - 1 (packed: token x head of the group) at kPairs (row, four dims) pairs a
// thread (kThreads of them), kBatch states' loads in flight together (40 registers of them whatever kPairs).
template <int D, int kThreads, int kPairs>
__device__ __forceinline__ void stream_rows(const AttentionParams& p, const MergeItem& mi, int32_t* flags,
                                            int first_row, int qo_start, int row0, int rows, long long* tl_seen) {
  constexpr int kQuads = D / 4, kBatch = 8 / kPairs;
  const int heads = p.num_qo_heads, group = heads / p.num_kv_heads, kv_head = static_cast<int>(blockIdx.y);
  const int lane = threadIdx.x % 32, states = mi.num_items, nq = mi.qo_end - mi.qo_begin;
  // State k of packed row r is partial row first_row + k x nq + r / group (WorkItem::merge_row0); a pair's element
  // of state k is (its row's) LSE at lse_row + k x nq x heads, its O quad D times that plus 4 q.
  const int64_t lse_step = static_cast<int64_t>(nq) * heads;
  int lse_row[kPairs];
  float m[kPairs], l[kPairs];
  float4 acc[kPairs];
  bool any = false;
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int i = threadIdx.x + j * kThreads, r = row0 + i / kQuads;
    lse_row[j] = i < rows * kQuads ? (first_row + r / group) * heads + kv_head * group + r % group : -1;
    any |= lse_row[j] >= 0;
    m[j] = -ATTNFORGE_INFINITY, l[j] = 0.f, acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (!__any_sync(0xffffffffu, any)) return;  // warp-uniform: no pair in this warp
  const int q4 = 4 * (threadIdx.x % kQuads);  // kThreads is a multiple of kQuads: every pair's dims
  for (int k0 = 0; k0 < states;) {
    const int k = k0 + lane;
    const bool ready = k >= states || load_acquire_gpu(flags + k) != 0;
    __syncwarp();  // the lanes' acquires order every lane's loads below (.cg: never a stale L1 line)
    const unsigned pending = ~__ballot_sync(0xffffffffu, ready);
    const int n = min(pending == 0u ? 32 : __ffs(pending) - 1, states - k0);
    if (n == 0) continue;  // a poll is one L2 trip a warp (a 100 ns sleep between polls: the last state seen 2.7 us
                           // after the decode grid's end, per-CTA timelines of 1 x 32768, H200)
    ATTNFORGE_TL(if (k0 + n == states) *tl_seen = global_ns();)
    for (int u0 = 0; u0 < n; u0 += kBatch) {
      float lse[kBatch][kPairs];
      float4 o[kBatch][kPairs];
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
#pragma unroll
        for (int j = 0; j < kPairs; ++j) {
          const int64_t e = lse_row[j] + (k0 + u0 + u) * lse_step;
          const bool load = lse_row[j] >= 0 && u0 + u < n;
          lse[u][j] = load ? load_cg(p.partial_lse + e) : -ATTNFORGE_INFINITY;
          o[u][j] = load ? load_cg4(p.partial_o + e * D + q4) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
#pragma unroll
        for (int j = 0; j < kPairs; ++j) {
          const float m_new = fmaxf(m[j], lse[u][j]);
          if (m_new == -ATTNFORGE_INFINITY) continue;  // every state so far is empty
          const float scale = exp2f(m[j] - m_new);     // 0 while m is -inf (acc and l are 0 then)
          const float w = lse[u][j] == -ATTNFORGE_INFINITY ? 0.f : exp2f(lse[u][j] - m_new);
          l[j] = l[j] * scale + w;
          acc[j].x = acc[j].x * scale + w * o[u][j].x, acc[j].y = acc[j].y * scale + w * o[u][j].y;
          acc[j].z = acc[j].z * scale + w * o[u][j].z, acc[j].w = acc[j].w * scale + w * o[u][j].w;
          m[j] = m_new;
        }
    }
    k0 += n;
  }
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    if (lse_row[j] < 0) continue;
    const int r = row0 + (threadIdx.x + j * kThreads) / kQuads;
    write_merged_quad(p, qo_start + mi.qo_begin + r / group, kv_head * group + r % group, q4, m[j], l[j], acc[j]);
  }
}

// stream_rows for the usual decode merge (head_dim 128, a warp per row, one (row, four dims) pair a thread, at most
// 32 states): each state's O quad is loaded as soon as its flag is seen, whatever the KV order, into registers of
// its own (o[k], unrolled), and lane k keeps state k's LSE. The states are combined only once all have landed, in
// KV order (the maximum, the weights and their sum by a fixed shuffle tree, then the weighted O in state order), so
// the result does not depend on the order the flags appear in. stream_rows folds the ready prefix in KV order as it
// goes, so a state that ends late held back every later one: when the last flag appeared, 20-30 of a merge's 32
// states were still to load, four batches of serial trips (1 x 32768: the merge ended 4.5 us after the last decode
// CTA; per-CTA timelines, H200, session 32).
__device__ __forceinline__ void stream_rows_resident(const AttentionParams& p, const MergeItem& mi, int32_t* flags,
                                                     int first_row, int qo_start, int row0, int rows,
                                                     long long* tl_seen) {
  constexpr int D = 128, kMaxStates = 32;
  const int heads = p.num_qo_heads, group = heads / p.num_kv_heads, kv_head = static_cast<int>(blockIdx.y);
  const int lane = threadIdx.x % 32, r = row0 + static_cast<int>(threadIdx.x) / 32, states = mi.num_items;
  if (r >= row0 + rows) return;  // warp-uniform: a warp per row
  const int64_t lse_step = static_cast<int64_t>(mi.qo_end - mi.qo_begin) * heads;
  const int64_t lse0 = static_cast<int64_t>(first_row + r / group) * heads + kv_head * group + r % group;
  const float* const o0 = p.partial_o + lse0 * D + 4 * lane;
  float4 o[kMaxStates];
#pragma unroll
  for (int k = 0; k < kMaxStates; ++k) o[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  float lse = -ATTNFORGE_INFINITY;  // state `lane`'s
  unsigned pending = states >= kMaxStates ? 0xffffffffu : (1u << states) - 1u;  // warp-uniform
  while (pending != 0u) {
    const bool ready = !((pending >> lane) & 1u) || load_acquire_gpu(flags + lane) != 0;
    __syncwarp();  // the lanes' acquires order every lane's loads below (.cg: never a stale L1 line)
    const unsigned got = __ballot_sync(0xffffffffu, ready) & pending;
    if (got == 0u) continue;
    if ((got >> lane) & 1u) lse = load_cg(p.partial_lse + lse0 + lane * lse_step);
    // Each address made from the one before through a move the compiler cannot see through, right before its
    // load: made all at once (or hoisted out of the loop), the 32 of them took 64 registers.
    const float* src = o0;
#pragma unroll
    for (int k = 0; k < kMaxStates; ++k) {
      src = opaque_pointer(src);
      if ((got >> k) & 1u) o[k] = load_cg4(src);
      src += lse_step * D;
    }
    pending &= ~got;
  }
  ATTNFORGE_TL(if (tl_seen) *tl_seen = global_ns();)
  float m = lse;
  for (int x = 16; x > 0; x >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
  const float w = lse == -ATTNFORGE_INFINITY ? 0.f : exp2f(lse - m);  // every state empty: m = -inf, w = 0
  float l = w;
  for (int x = 16; x > 0; x >>= 1) l += __shfl_xor_sync(0xffffffffu, l, x);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int k = 0; k < kMaxStates; ++k) {
    const float wk = __shfl_sync(0xffffffffu, w, k);
    acc.x += wk * o[k].x, acc.y += wk * o[k].y, acc.z += wk * o[k].z, acc.w += wk * o[k].w;
  }
  write_merged_quad(p, qo_start + mi.qo_begin + r / group, kv_head * group + r % group, 4 * lane, m, l, acc);
}

// A CTA's threads: four pairs a thread at most (head_dim 256: 256 threads).
template <int D>
constexpr int kStreamThreads = D <= 128 ? kMergeThreads : 2 * kMergeThreads;

template <int D>
__device__ __forceinline__ void merge_streamed(const AttentionParams& p) {
  constexpr int kRows = kDecodeCtaRows, kQuads = D / 4, kThreads = kStreamThreads<D>;
  static_assert(kThreads % kQuads == 0 && (kRows * kQuads) % kThreads == 0, "whole rows a pass");
  const PlanView& plan = *p.plan;
  const int group = p.num_qo_heads / p.num_kv_heads, row0 = static_cast<int>(blockIdx.z) * kRows;
  // The next kernel on the stream (a programmatic dependent: the next decode call) may be scheduled now; it waits
  // for this grid's end before it reads or writes anything this grid touches.
  grid_launch_dependents();
  ATTNFORGE_TL(const long long tl_start = global_ns(); long long tl_seen = 0, tl_merges = 0;)
  for (int mi_index = blockIdx.x; mi_index < plan.num_merges; mi_index += gridDim.x) {
    const MergeItem mi = plan.merges[mi_index];
    const int rows = min(kRows, (mi.qo_end - mi.qo_begin) * group - row0);
    if (rows <= 0) continue;  // no decode CTA of this row block either
    const int first_row = plan.items[mi.first_item].partial_row;
    const int qo_start = plan.qo_indptr[mi.request];
    int32_t* const flags =
        p.merge_flags + (blockIdx.y * static_cast<int64_t>(gridDim.z) + blockIdx.z) * p.item_capacity + mi.first_item;
    long long* seen = nullptr;
    ATTNFORGE_TL(seen = &tl_seen;)
    constexpr int kMaxPairs = kRows * kQuads / kThreads;  // 2 at head_dim 64, else 4
    const int pairs = (rows * kQuads + kThreads - 1) / kThreads;
    if (D == 128 && pairs <= 1 && mi.num_items <= 32)
      stream_rows_resident(p, mi, flags, first_row, qo_start, row0, rows, seen);
    else if (pairs <= 1)
      stream_rows<D, kThreads, 1>(p, mi, flags, first_row, qo_start, row0, rows, seen);
    else if (pairs <= 2 || kMaxPairs <= 2)
      stream_rows<D, kThreads, 2>(p, mi, flags, first_row, qo_start, row0, rows, seen);
    else
      stream_rows<D, kThreads, kMaxPairs>(p, mi, flags, first_row, qo_start, row0, rows, seen);
    __syncthreads();  // every warp has read the flags
    for (int k = threadIdx.x; k < mi.num_items; k += kThreads) flags[k] = 0;
    ATTNFORGE_TL(++tl_merges;)
  }
  ATTNFORGE_TL(if (long long* f = timeline_slot(); f && threadIdx.x == 0) {
    f[0] = tl_start, f[1] = global_ns(), f[2] = tl_seen, f[10] = (sm_id() << 32) | tl_merges;
  })
}

// ATTNFORGE_MERGE_KERNELS picks the kernels a run-time compiled merge module holds (jit::merge_source): 1 the merge
// kernel alone, 2 the streamed merge alone; unset (the nvcc build) all three. Each module then compiles only its own
// kernel (the merge kernel alone in a third of the time of all three).
#if !defined(ATTNFORGE_MERGE_KERNELS) || ATTNFORGE_MERGE_KERNELS == 1
// Combines the partial states of each merge item (the shapes above), grid-stride over the plan's merges and over a
// merge's query rows by gridDim.z. Launched as a programmatic dependent of the attention kernel where the GPU has
// it (sm_90+): the plan's metadata (uploaded before the attention kernel) is read first, then griddepcontrol.wait
// holds the CTA until the attention grid has finished and its partial states are visible.
// At most 102 registers: five CTAs per SM or more (at six, ptxas spilled 32 bytes).
__global__ void __launch_bounds__(kMergeThreads, 5) merge_kernel(const AttentionParams p) {
  __shared__ float s_m[kMergeWarps], s_l[kMergeWarps];
  __shared__ float2 s_o[kMergeWarps][kMergeMaxDim / 2];
  switch (p.head_dim_vo) {
    case 64: merge_items<1>(p, s_m, s_l, s_o); break;
    case 128: merge_items<2>(p, s_m, s_l, s_o); break;
    default: merge_items<4>(p, s_m, s_l, s_o); break;  // 256
  }
}
#endif

#if !defined(ATTNFORGE_MERGE_KERNELS) || ATTNFORGE_MERGE_KERNELS == 2

// Streamed merges (merge_streamed), over merge_dims' grid; launched as a programmatic dependent of the decode kernel
// where the GPU has it, else after it (every flag is then set when a CTA starts). A CTA holds up to 16 rows and its
// (m, l, o) of up to 4 pairs a thread (kStreamThreads), or 32 states' O quads (stream_rows_resident). At most 168
// registers (no launch bounds: they cannot go with __maxnreg__; up to 256 threads a CTA): a CTA of 128 threads then
// fits beside two 168-register CTAs of the head_dim 128 decode kernel, as the merge CTAs must, so that they poll
// while the decode grid streams (at 186 registers they fitted only SMs holding one decode CTA).
__global__ void __maxnreg__(168) merge_stream_kernel(const AttentionParams p) {
  switch (p.head_dim_vo) {
    case 64: merge_streamed<64>(p); break;
    case 128: merge_streamed<128>(p); break;
    default: merge_streamed<256>(p); break;  // 256
  }
}
#endif

#if !defined(ATTNFORGE_MERGE_KERNELS)

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

#endif

}  // namespace attnforge::cuda
