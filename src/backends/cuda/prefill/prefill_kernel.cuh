// Batch prefill and append on tensor cores (sm_80 and newer: mma.sync m16n8k16, ldmatrix, cp.async, swizzled
// shared memory, online softmax in fp32). One CTA = (work item, KV head, block of kRows packed rows); rows are
// the item's query tokens times the query heads of the KV head's group, so one K/V tile serves them all.
// Each of the 4 warps owns kMTiles consecutive m16 tiles of rows and reads every K/V tile of the item: the K
// and V fragments a warp loads from shared memory feed kMTiles mma each, which keeps shared-memory traffic
// under the tensor cores' appetite (see docs/perf-notes.md). A warp whose rows cannot see a tile (causal
// diagonal, window) skips its compute. K/V stream through a cp.async pipeline (3 stages of 32 tokens at head_dim
// <= 128, 2 at 256), the page ids of each stage fetched one stage ahead into shared memory. Self-contained for
// NVRTC.
#pragma once

#include "attnforge/kernel/params.h"
#include "attnforge/kernel/state.h"
#include "attnforge/kernel/variant.h"
#include "backends/cuda/device/hooks.cuh"
#include "backends/cuda/device/ptx.cuh"
#include "backends/cuda/device/tiles.cuh"
#include "backends/cuda/prefill/tile_config.cuh"

namespace attnforge::cuda {

template <int kHeadDim_, typename Elem_, bool kRope_ = false, int kStageTokens_ = prefill_tile_tokens(kHeadDim_),
          int kRows_ = prefill_rows(kHeadDim_)>
struct PrefillTraits {
  using Elem = Elem_;  // Bf16 or F16: Q and K/V element type, and the mma operand type
  static constexpr int kHeadDim = kHeadDim_;
  // RoPE fused (Q and each K stage rotated in shared memory): its own instantiation, so the register budget of
  // the common case does not carry it (it raised the head_dim 128 spills from 44 to 104 bytes).
  static constexpr bool kRope = kRope_;
  static constexpr int kWarps = kPrefillWarps;
  static constexpr int kThreads = 32 * kWarps;
  // Rows per CTA: the head dim's (prefill_rows), or the short tile (kPrefillShortRows: one m16 tile per warp).
  static constexpr int kRows = kRows_;
  static constexpr int kMTiles = kRows / (16 * kWarps);
  static constexpr int kWarpRows = 16 * kMTiles;
  static constexpr int kTileTokens = prefill_tile_tokens(kHeadDim);  // K/V tokens per softmax step
  static constexpr int kStageTokens = kStageTokens_;  // K/V tokens per pipeline stage (a multiple of the above)
  // Three stages where they fit two CTAs per SM (80 KB at head_dim 128), two at head_dim 256 (96 KB).
  static constexpr int kStages = kHeadDim <= 128 && kStageTokens == kTileTokens ? 3 : 2;
  static constexpr int kStageElems = kStageTokens * kHeadDim;
  // Shared memory: Q, then K stages, then V stages (16-bit elements).
  static constexpr int kSmemBytes = 2 * (kRows * kHeadDim + 2 * kStages * kStageElems);
  // The short tile's 64 KB of shared memory (head_dim <= 128) leaves room for three CTAs per SM: registers capped
  // to fit them (189 uncapped held it to two; H200 ncu at c4a3fbf).
  static constexpr int kMinBlocksPerSM = kRows == kPrefillShortRows && kHeadDim <= 128 ? 3 : 2;
  static_assert(kRows == kWarps * kWarpRows, "rows are split evenly over the warps");
  static_assert(kMTiles >= 1 && kMTiles <= prefill_m_tiles(kHeadDim), "at most the head dim's m tiles per warp");
  static_assert(kHeadDim % 16 == 0 && kTileTokens % 16 == 0, "mma k16 steps");
  static_assert(kStageTokens % kTileTokens == 0, "a stage holds whole softmax steps");
};

// A finished row's LSE (log2 units) and the factor its o accumulators take: 1 / l with softmax (sinks folded in
// for a final row), the V scale alone without softmax (LSE NaN).
template <bool kSoftmax>
__device__ __forceinline__ void row_scale(const VariantParams& vp, int head, float m, float l, float v_scale,
                                          bool final_row, float* lse, float* f) {
  if constexpr (kSoftmax) {
    // l >= 1 (the row's largest logit counts 2^0): the hardware's approximate log2 and division are within a few
    // ulp there, and skip the library's range reduction and the division's slow-path test on an item's last step.
    *lse = l > 0.f ? m + __log2f(l) : -ATTNFORGE_INFINITY;
    *f = l > 0.f ? __fdividef(v_scale, l) : 0.f;
    if (final_row) *f *= apply_sink(vp, head, lse);
  } else {
    *lse = __int_as_float(0x7fc00000);
    *f = v_scale;
  }
}

// Writes a finished row that a quad of lanes holds (this lane: columns 8 n + 2 (lane % 4) and the next, n < D / 8,
// as pair(n) returns them), times f, to the output and the LSE, or to the item's partial state.
template <int D, class Pair>
__device__ __forceinline__ void store_quad_row(const AttentionParams& p, const WorkItem& it, const QueryRow& q,
                                               int qo_start, float f, float lse, Pair pair) {
  const PlanView& plan = *p.plan;
  const int lane = threadIdx.x & 31;
  if (it.partial_row < 0) {
    const int64_t base = (qo_start + q.tok) * p.o_stride_token + q.head * p.o_stride_head;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int col = n * 8 + 2 * (lane % 4);
      const float2 v = pair(n);
      store_element(p.o, p.o_dtype, base + col, v.x * f);
      store_element(p.o, p.o_dtype, base + col + 1, v.y * f);
    }
    if (p.lse && lane % 4 == 0) p.lse[(qo_start + q.tok) * p.lse_stride_token + q.head] = lse;
  } else {
    const int64_t prow = static_cast<int64_t>(it.partial_row) + (q.tok - it.qo_begin);
    float* dst = plan.partial_o + (prow * p.num_qo_heads + q.head) * D;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const float2 v = pair(n);
      *reinterpret_cast<float2*>(dst + n * 8 + 2 * (lane % 4)) = make_float2(v.x * f, v.y * f);
    }
    if (lane % 4 == 0) plan.partial_lse[prow * p.num_qo_heads + q.head] = lse;
  }
}

// The epilogue of a custom variant with an output transform: each warp stages one m tile of finished fp32 rows
// (16 x head_dim) in shared memory, then one lane per row runs V::output_transform on it and writes it.
template <class Tr, class V, int M = Tr::kMTiles, int D = Tr::kHeadDim>
__device__ __forceinline__ void prefill_variant_epilogue(const AttentionParams& p, const VariantArgs& va,
                                                         const WorkItem& it, float (&o_acc)[M][D / 8][4],
                                                         float (&m_run)[M][2], float (&l_run)[M][2], uint16_t* smem,
                                                         int row0, int rows, int group, int kv_head, int qo_start,
                                                         int qo_len, int kv_len) {
  constexpr int kStride = D + 4;  // floats per staged row
  static_assert(Tr::kWarps * 16 * kStride * 4 <= Tr::kSmemBytes, "the staged rows fit the kernel's shared memory");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* stage = reinterpret_cast<float*>(smem) + warp * 16 * kStride;
  __syncthreads();  // every warp is done with Q and the K/V stages
  #pragma unroll
  for (int mt = 0; mt < M; ++mt) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = warp_sum_quad(l_run[mt][h]);
      const int rl = lane / 4 + 8 * h, r = warp * Tr::kWarpRows + 16 * mt + rl;
      if (r >= rows) continue;
      const QueryRow q = query_row(it, row0 + r, group, kv_head);
      float lse, f;
      row_scale<V::kSoftmax>(p.variant, q.head, m_run[mt][h], l, p.kv.v_scale, true, &lse, &f);
      #pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const int col = n * 8 + 2 * (lane % 4);
        stage[rl * kStride + col] = o_acc[mt][n][2 * h] * f;
        stage[rl * kStride + col + 1] = o_acc[mt][n][2 * h + 1] * f;
      }
      if (p.lse && lane % 4 == 0) p.lse[(qo_start + q.tok) * p.lse_stride_token + q.head] = lse;
    }
    __syncwarp();
    const int r = warp * Tr::kWarpRows + 16 * mt + lane;
    if (lane < 16 && r < rows) {
      const QueryRow q = query_row(it, row0 + r, group, kv_head);
      const LogitIndex li{it.request, q.tok, query_position(q.tok, qo_len, kv_len), 0, kv_len, q.head, kv_head};
      float* x = stage + lane * kStride;
      V::output_transform(va, li, x, D);
      const int64_t base = (qo_start + q.tok) * p.o_stride_token + q.head * p.o_stride_head;
      for (int d = 0; d < D; ++d) store_element(p.o, p.o_dtype, base + d, x[d]);
    }
    __syncwarp();  // the next m tile reuses the stage
  }
}

// The kernel body for the built-in options (V = BuiltinOptions) or a custom variant V (device/hooks.cuh): V's
// logits_mask replaces the built-in masks within the item's KV, logits_transform acts on the scaled logit, query
// and key transforms on fp32 rows of Q (once) and of each K stage (key fields only), output_transform on each
// finished fp32 row, staged through shared memory; without V::kSoftmax, p = the transformed logit and LSE is NaN.
template <class Tr, class V>
__device__ __forceinline__ void prefill_body(const AttentionParams& p, const VariantArgs& va) {
  constexpr bool kCustom = IsCustomVariant<V>::value;
  constexpr bool kSoftmax = V::kSoftmax;
  static_assert(!(kCustom && Tr::kRope), "a custom variant does its own RoPE (BuiltinVariant shows how)");
  using Elem = typename Tr::Elem;
  constexpr int D = Tr::kHeadDim, M = Tr::kMTiles, N = Tr::kTileTokens, NS = Tr::kStageTokens;
  extern __shared__ __align__(128) uint16_t smem[];
  __shared__ int s_bounds[2][Tr::kWarps];
  __shared__ int32_t s_pages[Tr::kStages * NS];  // page ids of the tiles in flight
  __shared__ float s_freqs[D / 2];               // RoPE frequencies, when on
  uint16_t* sQ = smem;
  uint16_t* sK = sQ + Tr::kRows * D;
  uint16_t* sV = sK + Tr::kStages * Tr::kStageElems;

  const PlanView& plan = *p.plan;
  const KVParams& kv = p.kv;
  const VariantParams& vp = p.variant;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kv_head = blockIdx.y;
  const int group = p.num_qo_heads / p.num_kv_heads;
  const int row0 = blockIdx.z * Tr::kRows;
  const int warp_row0 = warp * Tr::kWarpRows;
  const float scale_log2 = vp.sm_scale * kv.k_scale * kLog2e;
  const bool transform = !kCustom && (vp.soft_cap > 0.f || vp.alibi_slopes != nullptr);
  const int num_items = plan.num_items;
  constexpr bool rope = Tr::kRope;
  if (rope) rope_frequencies<Tr::kThreads>(vp.rope, s_freqs);  // read after the first barrier below

  // Items in reverse plan order: each request's last query tiles, the heaviest under causal masking, start
  // first, and the light ones fill the tail of the wave.
  for (int index = blockIdx.x; index < num_items; index += gridDim.x) {
    const WorkItem it = plan.items[num_items - 1 - index];
    ItemRows m;
    if (!item_rows<Tr::kRows>(it, group, row0, m)) continue;
    const int b = m.b, rows = m.rows, qo_start = m.qo_start, qo_len = m.qo_len, kv_len = m.kv_len;

    load_query_rows<D, Tr::kRows, Tr::kThreads>(p, it, qo_start, row0, rows, group, kv_head, sQ);
    // The KV a packed row r of the CTA may see: the built-in masks', or the whole item for a custom variant (its
    // logits_mask decides).
    auto kv_range = [&](int r, int* lo, int* hi) {
      row_kv_range(vp, it, r, rows, row0 + r, group, qo_len, kv_len, lo, hi);
      if constexpr (kCustom) {
        if (r < rows) *lo = it.kv_begin, *hi = it.kv_end;
      }
    };

    // The rows this thread holds in the mma fragments: m tile mt, half h -> warp_row0 + 16 mt + lane / 4 + 8 h.
    // Only the warp's bounds stay in registers; masked tiles recompute a row's range.
    int w_lo = it.kv_end, w_hi = it.kv_begin;          // union of the warp's row ranges
    int w_max_lo = it.kv_begin, w_min_hi = it.kv_end;  // their intersection over the warp's valid rows
    #pragma unroll
    for (int mt = 0; mt < M; ++mt)
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = warp_row0 + 16 * mt + lane / 4 + 8 * h;
        int lo, hi;
        kv_range(r, &lo, &hi);
        if (r < rows) w_max_lo = max(w_max_lo, lo), w_min_hi = min(w_min_hi, hi);
        if (lo < hi) w_lo = min(w_lo, lo), w_hi = max(w_hi, hi);
      }
    // warp_kv_bounds (tiles.cuh) written out: through the helper ptxas allocated this kernel's registers
    // differently (the 64-row tile at head_dim 128 went from 0 to 8 bytes of spill on sm_90a).
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      w_lo = min(w_lo, __shfl_xor_sync(0xffffffffu, w_lo, o));
      w_hi = max(w_hi, __shfl_xor_sync(0xffffffffu, w_hi, o));
      w_max_lo = max(w_max_lo, __shfl_xor_sync(0xffffffffu, w_max_lo, o));
      w_min_hi = min(w_min_hi, __shfl_xor_sync(0xffffffffu, w_min_hi, o));
    }
    if (lane == 0) s_bounds[0][warp] = w_lo, s_bounds[1][warp] = w_hi;
    __syncthreads();
    int range_lo = it.kv_end, range_hi = it.kv_begin;  // the KV any row of the CTA reads
    #pragma unroll
    for (int w = 0; w < Tr::kWarps; ++w)
      if (s_bounds[0][w] < s_bounds[1][w]) range_lo = min(range_lo, s_bounds[0][w]), range_hi = max(range_hi, s_bounds[1][w]);
    const int num_tiles = range_hi > range_lo ? (range_hi - range_lo + NS - 1) / NS : 0;  // pipeline stages

    KVTileLoader<D, NS, Tr::kThreads, Tr::kStages> loader(kv, b, kv_head, range_lo, range_hi, s_pages);
    #pragma unroll
    for (int s = 0; s < Tr::kStages - 1; ++s)
      if (s < num_tiles) loader.fetch_pages(s);
    __syncthreads();  // the page ids of the first tiles are in shared memory
    #pragma unroll
    for (int s = 0; s < Tr::kStages - 1; ++s) {
      if (s < num_tiles) loader.load(s, sK + s * Tr::kStageElems, sV + s * Tr::kStageElems);
      cp_async_commit();  // the first group carries Q as well
    }
    if (Tr::kStages - 1 < num_tiles) loader.fetch_pages(Tr::kStages - 1);
    const int rope_offset = rope && vp.rope.pos_offset ? vp.rope.pos_offset[b] : 0;
    if constexpr (rope) {  // Q rotated in place once it has landed (this drains the prologue's copies: RoPE only)
      cp_async_wait<0>();
      __syncthreads();
      rope_rows<D, Tr::kThreads, Elem>(sQ, Tr::kRows, vp.rope, s_freqs, [&](int r) {
        return r < rows ? query_position(query_row(it, row0 + r, group, kv_head).tok, qo_len, kv_len) + rope_offset
                        : kRopeSkipRow;
      });
    }
    if constexpr (kCustom && OverriddenHooks<V>::kQuery) {  // Q rows in fp32 through the variant, once landed
      cp_async_wait<0>();
      __syncthreads();
      transform_rows<D, Tr::kThreads, Elem>(sQ, rows, [&](int r, float* x) {
        const QueryRow q = query_row(it, row0 + r, group, kv_head);
        const LogitIndex li{b, q.tok, query_position(q.tok, qo_len, kv_len), 0, kv_len, q.head, kv_head};
        V::query_transform(va, li, x, D);
        return true;
      });
    }
    // ldmatrix lanes: Q rows of the warp (A operand), K rows (B of Q K^T), V rows (B of P V, transposed).
    const SwizzledLane<D> q_lane(warp_row0 + lane % 16, lane / 16);
    const SwizzledLane<D> k_lane((lane % 8) + 8 * (lane / 16), (lane / 8) % 2);
    const SwizzledLane<D> v_lane((lane % 8) + 8 * ((lane / 8) % 2), lane / 16);

    float o_acc[M][D / 8][4];
    float m_run[M][2], l_run[M][2];
    #pragma unroll
    for (int mt = 0; mt < M; ++mt) {
      #pragma unroll
      for (int n = 0; n < D / 8; ++n) o_acc[mt][n][0] = o_acc[mt][n][1] = o_acc[mt][n][2] = o_acc[mt][n][3] = 0.f;
      m_run[mt][0] = m_run[mt][1] = kSoftmax ? -ATTNFORGE_INFINITY : 0.f;
      l_run[mt][0] = l_run[mt][1] = 0.f;
    }

    for (int t = 0; t < num_tiles; ++t) {
      cp_async_wait<Tr::kStages - 2>();
      __syncthreads();  // tile t has landed for every thread, and every warp is done with tile t - 1
      const int next = t + Tr::kStages - 1;
      if (next < num_tiles) {
        const int s = next % Tr::kStages;
        loader.load(next, sK + s * Tr::kStageElems, sV + s * Tr::kStageElems);
        if (next + 1 < num_tiles) loader.fetch_pages(next + 1);
      }
      cp_async_commit();
      if constexpr (rope) {  // K of this stage rotated in place; a second barrier before any warp reads it
        const int first = range_lo + t * NS;
        rope_rows<D, Tr::kThreads, Elem>(sK + (t % Tr::kStages) * Tr::kStageElems, NS, vp.rope, s_freqs, [&](int r) {
          return first + r < range_hi ? first + r + rope_offset : kRopeSkipRow;
        });
        __syncthreads();
      }
      if constexpr (kCustom && OverriddenHooks<V>::kKey) {  // K rows of this stage through the variant
        const int first = range_lo + t * NS;
        transform_rows<D, Tr::kThreads, Elem>(sK + (t % Tr::kStages) * Tr::kStageElems, NS, [&](int r, float* x) {
          if (first + r >= range_hi) return false;
          const LogitIndex li{b, -1, -1, first + r, kv_len, -1, kv_head};
          V::key_transform(va, li, x, D);
          return true;
        });
        __syncthreads();
      }

      #pragma unroll 1
      for (int sub = 0; sub < NS / N; ++sub) {  // a real loop: two copies of the body would spill
        const int tile_start = range_lo + t * NS + sub * N;
        if (tile_start >= w_hi || tile_start + N <= w_lo) continue;  // no row of this warp sees the tile
        const uint16_t* k_tile = sK + (t % Tr::kStages) * Tr::kStageElems + sub * N * D;
        const uint16_t* v_tile = sV + (t % Tr::kStages) * Tr::kStageElems + sub * N * D;

        // S = Q K^T: kMTiles x (N / 8) accumulator tiles; each K fragment feeds kMTiles mma.
        float s_acc[M][N / 8][4];
        #pragma unroll
        for (int mt = 0; mt < M; ++mt)
          #pragma unroll
          for (int n = 0; n < N / 8; ++n) s_acc[mt][n][0] = s_acc[mt][n][1] = s_acc[mt][n][2] = s_acc[mt][n][3] = 0.f;
        #pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          uint32_t a[M][4];
          #pragma unroll
          for (int mt = 0; mt < M; ++mt)
            ldmatrix_x4(a[mt], sQ + q_lane.at(kk) + 16 * mt * D);
          #pragma unroll
          for (int np = 0; np < N / 16; ++np) {
            uint32_t bk[4];
            ldmatrix_x4(bk, k_tile + k_lane.at(kk) + 16 * np * D);
            #pragma unroll
            for (int mt = 0; mt < M; ++mt) {
              mma_16816(s_acc[mt][2 * np], a[mt], bk[0], bk[1], Elem{});
              mma_16816(s_acc[mt][2 * np + 1], a[mt], bk[2], bk[3], Elem{});
            }
          }
        }

        // Scale, transform and mask, then the online softmax update (two rows per m tile per thread). Tiles that
        // every row of the warp sees whole, with no per-element transform or custom mask, skip the masking and keep
        // raw logits: the scale folds into the exponent's FMA (it is positive, so it commutes with the max).
        const bool plain =
            !kCustom && !transform && !vp.custom_mask && tile_start >= w_max_lo && tile_start + N <= w_min_hi;
        const float s_mul = plain ? scale_log2 : 1.f;  // masked tiles hold logits in log2 units already
        #pragma unroll
        for (int mt = 0; mt < M; ++mt) {
          float tile_max[2] = {-ATTNFORGE_INFINITY, -ATTNFORGE_INFINITY};
          if (plain) {
            #pragma unroll
            for (int n = 0; n < N / 8; ++n)
              #pragma unroll
              for (int e = 0; e < 4; ++e) tile_max[e / 2] = fmaxf(tile_max[e / 2], s_acc[mt][n][e]);
            tile_max[0] *= scale_log2;
            tile_max[1] *= scale_log2;
          } else {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int r = warp_row0 + 16 * mt + lane / 4 + 8 * h;
              const QueryRow q = query_row(it, row0 + r, group, kv_head);
              const int q_pos = query_position(q.tok, qo_len, kv_len);
              int lo, hi;
              kv_range(r, &lo, &hi);
              #pragma unroll
              for (int n = 0; n < N / 8; ++n)
                #pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                  const int j = tile_start + n * 8 + 2 * (lane % 4) + (e % 2);
                  float x = s_acc[mt][n][e];
                  bool allowed = j >= lo && j < hi;
                  if constexpr (kCustom) {
                    if (allowed) {
                      const LogitIndex li{b, q.tok, q_pos, j, kv_len, q.head, kv_head};
                      allowed = V::logits_mask(va, li);
                      if (allowed) x = V::logits_transform(va, li, x * vp.sm_scale * kv.k_scale);
                    }
                    // Without softmax, p = the transformed logit and a left-out key adds nothing.
                    x = kSoftmax ? (allowed ? x * kLog2e : -ATTNFORGE_INFINITY) : (allowed ? x : 0.f);
                  } else {
                    if (allowed && transform)
                      x = transform_logit(vp, x * vp.sm_scale * kv.k_scale, q.head, q_pos, j) * kLog2e;
                    else
                      x *= scale_log2;
                    if (allowed && vp.custom_mask) allowed = custom_mask_allows(vp, b, q.tok, j, kv_len);
                    x = allowed ? x : -ATTNFORGE_INFINITY;
                  }
                  s_acc[mt][n][e] = x;
                  tile_max[h] = fmaxf(tile_max[h], x);
                }
            }
          }
          if constexpr (kSoftmax) {  // without softmax s_acc already holds p
            // A row that has seen no allowed key yet keeps m = -inf and subtracts 0 instead: its masked logits
            // (-inf) give p = 0, and its o and l are still zero, whatever the correction.
            float corr[2], m_sub[2];
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float m_new = fmaxf(m_run[mt][h], warp_max_quad(tile_max[h]));
              m_sub[h] = m_new == -ATTNFORGE_INFINITY ? 0.f : m_new;
              corr[h] = fast_exp2(m_run[mt][h] - m_sub[h]);
              m_run[mt][h] = m_new;
              l_run[mt][h] *= corr[h];
            }
            #pragma unroll
            for (int n = 0; n < N / 8; ++n)
              #pragma unroll
              for (int e = 0; e < 4; ++e) {
                const float pr = fast_exp2(fmaf(s_acc[mt][n][e], s_mul, -m_sub[e / 2]));
                s_acc[mt][n][e] = pr;
                l_run[mt][e / 2] += pr;
              }
            // Once the running maxima settle, most tiles move none of them: skip the rescale then.
            if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f))
              #pragma unroll
              for (int n = 0; n < D / 8; ++n) {
                o_acc[mt][n][0] *= corr[0], o_acc[mt][n][1] *= corr[0];
                o_acc[mt][n][2] *= corr[1], o_acc[mt][n][3] *= corr[1];
              }
          }
        }

        // O += P V, 16 tokens per k step: the S accumulators of two n8 tiles are exactly the A fragment of one
        // k16 step, and each V fragment feeds kMTiles mma.
        #pragma unroll
        for (int kt = 0; kt < N / 16; ++kt) {
          uint32_t a_p[M][4];
          #pragma unroll
          for (int mt = 0; mt < M; ++mt) {
            a_p[mt][0] = pack2(s_acc[mt][2 * kt][0], s_acc[mt][2 * kt][1], Elem{});
            a_p[mt][1] = pack2(s_acc[mt][2 * kt][2], s_acc[mt][2 * kt][3], Elem{});
            a_p[mt][2] = pack2(s_acc[mt][2 * kt + 1][0], s_acc[mt][2 * kt + 1][1], Elem{});
            a_p[mt][3] = pack2(s_acc[mt][2 * kt + 1][2], s_acc[mt][2 * kt + 1][3], Elem{});
          }
          #pragma unroll
          for (int nd = 0; nd < D / 16; ++nd) {
            uint32_t bv[4];
            ldmatrix_x4_trans(bv, v_tile + v_lane.at(nd) + 16 * kt * D);
            #pragma unroll
            for (int mt = 0; mt < M; ++mt) {
              mma_16816(o_acc[mt][2 * nd], a_p[mt], bv[0], bv[1], Elem{});
              mma_16816(o_acc[mt][2 * nd + 1], a_p[mt], bv[2], bv[3], Elem{});
            }
          }
        }
      }
    }
    cp_async_wait<0>();
    grid_launch_dependents();  // the merge kernel may be scheduled (it waits for this grid's end before reading)

    // Each row's state is complete in its quad of lanes: normalize and write it. A custom variant's output
    // transform needs whole fp32 rows: they go through shared memory instead (custom variants never split KV).
    if constexpr (kCustom && OverriddenHooks<V>::kOutput) {
      prefill_variant_epilogue<Tr, V>(p, va, it, o_acc, m_run, l_run, smem, row0, rows, group, kv_head, qo_start,
                                      qo_len, kv_len);
    } else {
      #pragma unroll
      for (int mt = 0; mt < M; ++mt)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float l = warp_sum_quad(l_run[mt][h]);
          const int r = warp_row0 + 16 * mt + lane / 4 + 8 * h;
          if (r >= rows) continue;
          const QueryRow q = query_row(it, row0 + r, group, kv_head);
          float lse, f;
          row_scale<kSoftmax>(vp, q.head, m_run[mt][h], l, kv.v_scale, it.partial_row < 0, &lse, &f);
          store_quad_row<D>(p, it, q, qo_start, f, lse,
                            [&](int n) { return make_float2(o_acc[mt][n][2 * h], o_acc[mt][n][2 * h + 1]); });
        }
    }
    __syncthreads();  // shared memory (Q, stages, bounds) is reused by the next item
  }
}

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, Tr::kMinBlocksPerSM) prefill_kernel(const AttentionParams p) {
  prefill_body<Tr, BuiltinOptions>(p, VariantArgs{});
}

// A custom variant V's prefill kernel, rendered by NVRTC keys like decode_variant_kernel (decode_kernel.cuh).
template <class Tr, class V>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    prefill_variant_kernel(const AttentionParams p, const VariantArgs args) {
  VariantArgs a = args;
  a.options = &p.variant;
  prefill_body<Tr, V>(p, a);
}

}  // namespace attnforge::cuda
