// Batch prefill on Hopper warpgroup products (sm_90a; prefill.h says which plans it takes: 128-row tiles of head_dim
// 64, 128 and 256, where the H200 measured it faster than prefill_kernel.cuh). The work split is the mma.sync
// kernel's (prefill_kernel.cuh): one CTA = (work item, KV head, block of 128 packed rows). Two warpgroups own 64 rows
// each and read every K/V tile of the item: S = Q K^T is one m64nNk16 wgmma per 16 head dims with Q and K from shared
// memory, the online softmax runs on the accumulator registers, and O += P V takes P from registers (the accumulators
// of two n8 blocks are one k16 A fragment, as with mma.sync) and V from shared memory, transposed by the instruction.
// Q, K and V sit in 64-element panels in the 128-byte swizzle (device/wgmma.cuh), K/V in tiles of N = 128 tokens (64
// at head_dim 256) through a two-stage cp.async pipeline: fed by a third, copying warpgroup in the warp-specialized
// forms (the default), or by all 256 threads with a barrier per tile. Built-in options (causal, window, soft-cap,
// ALiBi, custom mask, sinks); not RoPE, not custom variants (those keep prefill_kernel). bf16 and fp16.
// Self-contained for NVRTC.
#pragma once

#include "attnforge/kernel/params.h"
#include "attnforge/kernel/variant.h"
#include "backends/cuda/device/mbarrier.cuh"
#include "backends/cuda/device/ptx.cuh"
#include "backends/cuda/device/tiles.cuh"
#include "backends/cuda/device/tma.cuh"
#include "backends/cuda/device/wgmma.cuh"
#include "backends/cuda/prefill/prefill_kernel.cuh"

namespace attnforge::cuda {

// Where an item's time goes in the pipelined form: built with -DATTNFORGE_WGMMA_TRACE=1 (never by default), each
// persistent CTA leaves in wgmma_trace the clock cycles its copier and its computing warpgroups spent in each phase
// of their items, which run_prefill prints after the launch (scripts/device-check trace sums the lines). Stores, not
// printf: a call in the kernel made ptxas serialize the wgmma products. Production builds compile none of it.
#if defined(ATTNFORGE_WGMMA_TRACE) && ATTNFORGE_WGMMA_TRACE
#define ATTNFORGE_TRACE(...) __VA_ARGS__
constexpr int kTraceCtas = 1024, kTraceFields = 22;
static __device__ long long wgmma_trace[kTraceCtas][3][kTraceFields];  // [slot][copier, computing 0, 1][field]
// Adds one side's counters (the order run_prefill prints) to the slot of this CTA (persistent forms: its index;
// the warp-specialized form's many CTAs share slots modulo kTraceCtas).
template <int kCount>
__device__ __forceinline__ void trace_add(int role, const long long (&v)[kCount]) {
  if (blockIdx.z != 0) return;
  long long* o = wgmma_trace[(blockIdx.x + blockIdx.y * gridDim.x) % kTraceCtas][role];
#pragma unroll
  for (int i = 0; i < kCount; ++i) atomicAdd(reinterpret_cast<unsigned long long*>(o + i), v[i]);
}
__device__ __forceinline__ long long trace_clock() {
#if defined(__CUDA_ARCH__)
  return clock64();
#else
  return 0;  // the host pass parses the device code too
#endif
}
// A computing warpgroup's counters: lap(phase) adds the cycles since the last lap to `phase`.
struct ConsumerTrace {
  long long begin = trace_clock(), t = begin;
  long long setup = 0, first = 0, wait = 0, plain = 0, masked = 0, store = 0, items = 0, tiles = 0, masked_tiles = 0;
  long long qwait = 0, stage = 0;  // the wait for the copier's Q (kCopierQ); the staged store up to its first barrier
  long long lastpv = 0;             // kOverlapped: the item's last P V, issued after the loop and waited for
  long long ssync = 0, between = 0;  // the staged store's barrier; from an item's last lap to the next item's start
  long long sfence = 0;              // the staged store's proxy fence (before boxes of O), apart from its writes
  // kCopierQ: the wait on q_full alone (q_wait, part of qwait), and when the copier got to the item whose Q it
  // waits for, in SM clock cycles from the start of that wait (negative: before it): its stage wait for the last
  // tile of the item before (q_empty), the top of its item (q_top), its Q request (q_issue) and its bounds published
  // (q_ready); q_late counts the items whose bounds came after the wait had begun.
  long long q_wait = 0, q_empty = 0, q_top = 0, q_issue = 0, q_ready = 0, q_late = 0;
  // The copier's times for this item (s_qtrace of the Q buffer), the wait on q_full from k1 to k2.
  __device__ __forceinline__ void copier_times(const long long (&c)[4], long long k1, long long k2) {
    q_wait += k2 - k1;
    q_empty += c[0] - k1, q_top += c[1] - k1, q_issue += c[2] - k1, q_ready += c[3] - k1, q_late += c[3] > k1;
  }
  __device__ __forceinline__ void lap(long long& phase) {
    const long long now = trace_clock();
    phase += now - t;
    t = now;
  }
  __device__ __forceinline__ void report(int cwg) {
    if ((threadIdx.x & 127) == 0)
      trace_add(1 + cwg, {items, tiles, trace_clock() - begin, masked_tiles, setup, first, wait, plain, masked, store,
                          qwait, stage, lastpv, ssync, between, sfence, q_wait, q_empty, q_top, q_issue, q_ready,
                          q_late});
  }
};
#else
#define ATTNFORGE_TRACE(...)
#endif

// The kernel's forms (prefill.h: prefill_wgmma_form):
//   kBarrier: all 256 threads copy every K/V tile and meet at a barrier per tile (prefill_wgmma_body);
//   kWarpSpecialized: a third warpgroup copies the tiles into the stages and the two that compute never meet at a
//     CTA barrier inside an item; the CTA meets twice per item (prefill_wgmma_ws_body);
//   kPipelined: as kWarpSpecialized, but the CTA never meets after its start: the copier runs into the next item's
//     tiles while the computing warpgroups finish the last; at head_dim 64 and 128 it also copies each item's Q and
//     the computing warps' KV bounds into one of two buffers (at 256 each computing warpgroup loads its own half of
//     Q and finds the bounds itself) (prefill_wgmma_pipelined_body).
//   kOverlapped: as kPipelined, and each computing warpgroup issues tile t's S = Q K^T together with tile t - 1's
//     O += P V and runs tile t's softmax while the latter runs (K and V stages get barriers of their own: a tile's K
//     is free once its S has completed, its V once its P V has).
enum class WgmmaForm { kBarrier = 0, kWarpSpecialized = 1, kPipelined = 2, kOverlapped = 3 };

template <int kHeadDim_, typename Elem_, WgmmaForm kForm_ = WgmmaForm::kBarrier>
struct PrefillWgmmaTraits {
  using Elem = Elem_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr WgmmaForm kForm = kForm_;
  static constexpr bool kWarpSpecialized = kForm != WgmmaForm::kBarrier;
  static constexpr int kWarpgroups = 2;  // the warpgroups that compute, 64 rows each
  static constexpr int kThreads = 128 * (kWarpgroups + (kWarpSpecialized ? 1 : 0));
  static constexpr int kWarps = kThreads / 32;
  // Registers per thread after the producer hands its share to the consumers (setmaxnreg). The CTA keeps the
  // registers it was launched with (ptxas: 168 a thread at 384 threads, 64,512 in all) and setmaxnreg.inc waits until
  // the pool holds what it asks for: 128 x 24 + 2 x 128 x 240 = 64,512 exactly (32 for the producer hung the kernel
  // on the H200: 65,536). ptxas sm_90a: 36 bytes of spill at head_dim 128 (12 with the producer at 32).
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(!kWarpSpecialized || 128 * kProducerRegs + 256 * kConsumerRegs <= kThreads * (65536 / kThreads / 8 * 8),
                "setmaxnreg would ask for more registers than the CTA was launched with, and wait forever");
  // 128 packed rows a CTA at every head dim (the planner's tiles where this kernel serves: prefill_tile_rows), 64
  // a computing warpgroup. K/V tiles of 128 tokens, 64 at head_dim 256 (O is 128 registers a thread there, S over
  // 64 tokens 32 more), two stages.
  static constexpr int kRows = 64 * kWarpgroups;
  static_assert(kRows == kPrefillWgmmaRows, "the planner's tiles for this kernel");
  static constexpr int kTileTokens = kHeadDim == 256 ? 64 : 128;  // K/V tokens per stage and softmax step (S: m64nN)
  static constexpr int kStages = 2;
  static constexpr int kStageReaders = 256;  // arrivals that release a stage
  static constexpr int kQBytes = kRows * kHeadDim * 2;
  static constexpr int kStageBytes = kTileTokens * kHeadDim * 2;
  // The persistent forms keep two Q buffers where they fit: the copier copies the next item's rows into one while
  // the computing warpgroups work on the item in the other (a Q load was most of an item's 4,300 cycles of setup,
  // H200 trace at fd447de; 931 cycles with Q and bounds by the copier at 1d7130c). Head_dim 256's Q is 64 KB: one
  // buffer.
  static constexpr int kQBuffers =
      (kForm == WgmmaForm::kPipelined || kForm == WgmmaForm::kOverlapped) && kHeadDim != 256 ? 2 : 1;
  // Q, the K and V stages (160 KB at head_dim 128, 192 KB with two Q buffers or at head_dim 256), and 1 KB to align
  // the panels to 1024 bytes.
  static constexpr int kSmemBytes = kQBuffers * kQBytes + 2 * kStages * kStageBytes + 1024;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head_dim 64, 128 or 256");
  static_assert(kSmemBytes <= 227 * 1024 - 8 * 1024, "shared memory, with room for the static arrays");
};

// One warpgroup's running state for this thread's two rows (warp_row0 + lane / 4 and + 8).
template <int D>
struct WgmmaRows {
  float o_acc[D / 2];  // m64 x D accumulators: n8 block n, element e at o_acc[4 n + e]
  float m_run[2], l_run[2];
};

template <int D>
__device__ __forceinline__ void wgmma_reset_rows(WgmmaRows<D>& st) {
#pragma unroll
  for (int i = 0; i < D / 2; ++i) st.o_acc[i] = 0.f;
  st.m_run[0] = st.m_run[1] = -ATTNFORGE_INFINITY;
  st.l_run[0] = st.l_run[1] = 0.f;
}

// The (KV head, item) pairs a persistent CTA walks, by position k in [begin, end) step `step`: its list in the plan's
// schedule (AttentionPlan::schedule, where p.schedule_ctas gives the grid it was balanced for), or every gridDim.x-th
// pair from blockIdx.x. A pair w is KV head w / items and item items - 1 - w % items of the plan.
struct PairWalk {
  const int32_t* pairs;  // null: the stride walk
  int begin, end, step;
  __device__ __forceinline__ static PairWalk make(const AttentionParams& p, int num_work) {
    if (p.schedule_ctas > 0)
      return {p.schedule + p.schedule_ctas + 1, p.schedule[blockIdx.x], p.schedule[blockIdx.x + 1], 1};
    return {nullptr, static_cast<int>(blockIdx.x), num_work, static_cast<int>(gridDim.x)};
  }
  __device__ __forceinline__ int at(int k) const { return pairs != nullptr ? pairs[k] : k; }
  // The pair at k, or 0 past the end.
  __device__ __forceinline__ int at_or_0(int k) const { return k < end ? at(k) : 0; }
};

// What one thread knows of its item and rows; w_max_lo / w_min_hi: the intersection of the warp's row ranges.
struct WgmmaItem {
  WorkItem it;
  int b, rows, row0, group, kv_head, qo_start, qo_len, kv_len, warp_row0, lane, w_max_lo, w_min_hi;
  float scale_log2;
  bool transform;
};

// The phases of one K/V tile for one warpgroup's 64 rows (Q at q_addr, the tile's K and V panels at k_addr /
// v_addr): S = Q K^T issued (wgmma_issue_s), the masks and the online softmax on the accumulators
// (wgmma_softmax), P packed (wgmma_pack_p), O += P V issued (wgmma_issue_pv). wgmma_attend_tile runs them in order,
// waiting for each product; the overlapped form issues tile t's S with tile t - 1's P V and runs tile t's softmax
// while that product runs.
// kN: the tile's first kN tokens only (a multiple of 32, at most N): a warpgroup's last tile of an item whose rows see
// no key past them (wgmma_consume_tiles); the stage keeps its N-token panels.
template <class Tr, int kN = Tr::kTileTokens>
__device__ __forceinline__ void wgmma_issue_s(float (&s_acc)[kN / 2], uint32_t q_addr, uint32_t k_addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Elem = typename Tr::Elem;
  constexpr int D = Tr::kHeadDim, N = Tr::kTileTokens;
  static_assert(kN % 32 == 0 && kN <= N, "32 to N tokens");
  // S = Q K^T (64 rows x kN tokens), 16 head dims a product: panel k / 4, step k % 4 in it.
  wgmma::fence();
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {
    const uint64_t q_desc = wgmma::k_major(q_addr + (k / 4) * (Tr::kRows * 128), k % 4);
    const uint64_t k_desc = wgmma::k_major(k_addr + (k / 4) * (N * 128), k % 4);
    if constexpr (kN == 128)
      wgmma::m64n128k16_ss(s_acc, q_desc, k_desc, k > 0, Elem{});
    else if constexpr (kN == 96)
      wgmma::m64n96k16_ss(s_acc, q_desc, k_desc, k > 0, Elem{});
    else if constexpr (kN == 64)
      wgmma::m64n64k16_ss(s_acc, q_desc, k_desc, k > 0, Elem{});
    else
      wgmma::m64n32k16_ss(s_acc, q_desc, k_desc, k > 0, Elem{});
  }
  wgmma::commit();
#endif
}

// S (completed) to P in place; the rows' m and l advance. corr: the factors O's accumulators of each of this
// thread's two rows take before P V is added (the caller applies them: the overlapped form's O is still being
// accumulated by the last tile's product meanwhile).
// kRangesOnly: the caller knows there is no soft-cap, ALiBi or custom mask (the overlapped form, which the host
// launches only then): the per-key path is not compiled in.
template <class Tr, bool kRangesOnly = false, int kN = Tr::kTileTokens>
__device__ __forceinline__ void wgmma_softmax(const AttentionParams& p, const WgmmaItem& c,
                                              WgmmaRows<Tr::kHeadDim>& st, float (&s_acc)[kN / 2], int tile_start,
                                              float (&corr)[2]) {
  constexpr int N = kN;  // the keys computed (the plain-tile test asks for these alone)
  const VariantParams& vp = p.variant;
  const KVParams& kv = p.kv;
  const WorkItem& it = c.it;
  // Mask and online softmax, as prefill_kernel (one m tile: s_acc[4 n + e] is its s_acc[0][n][e]). Without soft-cap,
  // ALiBi or a custom mask the masks are the rows' KV ranges alone: a tile they cut (the causal diagonal, a window's
  // edge) gets -inf outside them and then the plain tile's code. That compact pass replaced the per-key
  // builtin_logit path there, which ran a masked tile 4.8x as long as a plain one (H200 trace at fd447de: 17,400
  // cycles against 3,600, a quarter of a short item's time), now left to the options that need it.
  const bool ranges_only = kRangesOnly || (!c.transform && !vp.custom_mask);
  const bool plain = ranges_only && tile_start >= c.w_max_lo && tile_start + N <= c.w_min_hi;
  const float s_mul = ranges_only ? c.scale_log2 : 1.f;
  float tile_max[2] = {-ATTNFORGE_INFINITY, -ATTNFORGE_INFINITY};
  if (ranges_only) {
    if (!plain) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = c.warp_row0 + c.lane / 4 + 8 * h;
        int lo, hi;
        row_kv_range(vp, it, r, c.rows, c.row0 + r, c.group, c.qo_len, c.kv_len, &lo, &hi);
        const int j0 = tile_start + 2 * (c.lane % 4);  // this lane's first key of the tile
        lo -= j0, hi -= j0;
#pragma unroll
        for (int n = 0; n < N / 8; ++n)
#pragma unroll
          for (int e = 2 * h; e < 2 * h + 2; ++e) {
            const int j = n * 8 + (e % 2);
            if (j < lo || j >= hi) s_acc[4 * n + e] = -ATTNFORGE_INFINITY;
          }
      }
    }
#pragma unroll
    for (int i = 0; i < N / 2; ++i) tile_max[(i % 4) / 2] = fmaxf(tile_max[(i % 4) / 2], s_acc[i]);
    tile_max[0] *= c.scale_log2;
    tile_max[1] *= c.scale_log2;
  } else if constexpr (!kRangesOnly) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = c.warp_row0 + c.lane / 4 + 8 * h;
      const QueryRow q = query_row(it, c.row0 + r, c.group, c.kv_head);
      const int q_pos = query_position(q.tok, c.qo_len, c.kv_len);
      int lo, hi;
      row_kv_range(vp, it, r, c.rows, c.row0 + r, c.group, c.qo_len, c.kv_len, &lo, &hi);
#pragma unroll
      for (int n = 0; n < N / 8; ++n)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          const int j = tile_start + n * 8 + 2 * (c.lane % 4) + (e % 2);
          const float x = builtin_logit(vp, kv, s_acc[4 * n + e], j >= lo && j < hi, c.transform, c.scale_log2, c.b,
                                        q.tok, q.head, q_pos, j, c.kv_len);
          s_acc[4 * n + e] = x;
          tile_max[h] = fmaxf(tile_max[h], x);
        }
    }
  }
  float m_sub[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m_new = fmaxf(st.m_run[h], warp_max_quad(tile_max[h]));
    m_sub[h] = m_new == -ATTNFORGE_INFINITY ? 0.f : m_new;
    corr[h] = fast_exp2(st.m_run[h] - m_sub[h]);
    st.m_run[h] = m_new;
    st.l_run[h] *= corr[h];
  }
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const float pr = fast_exp2(fmaf(s_acc[i], s_mul, -m_sub[(i % 4) / 2]));
    s_acc[i] = pr;
    st.l_run[(i % 4) / 2] += pr;
  }
}

// P's k16 fragment kt: the accumulators of n8 blocks 2 kt and 2 kt + 1, in Q's type.
template <class Tr, int kN = Tr::kTileTokens>
__device__ __forceinline__ void wgmma_pack_p(const float (&s_acc)[kN / 2], uint32_t (&p_frag)[kN / 16][4]) {
  using Elem = typename Tr::Elem;
#pragma unroll
  for (int kt = 0; kt < kN / 16; ++kt) {
    p_frag[kt][0] = pack2(s_acc[8 * kt + 0], s_acc[8 * kt + 1], Elem{});
    p_frag[kt][1] = pack2(s_acc[8 * kt + 2], s_acc[8 * kt + 3], Elem{});
    p_frag[kt][2] = pack2(s_acc[8 * kt + 4], s_acc[8 * kt + 5], Elem{});
    p_frag[kt][3] = pack2(s_acc[8 * kt + 6], s_acc[8 * kt + 7], Elem{});
  }
}

// O += P V, 16 tokens a product (the tile's first kN), issued and committed.
template <class Tr, int kN = Tr::kTileTokens>
__device__ __forceinline__ void wgmma_issue_pv(float (&o_acc)[Tr::kHeadDim / 2], const uint32_t (&p_frag)[kN / 16][4],
                                               uint32_t v_addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Elem = typename Tr::Elem;
  constexpr int D = Tr::kHeadDim, N = Tr::kTileTokens;
  wgmma::fence();
#pragma unroll
  for (int kt = 0; kt < kN / 16; ++kt) {
    const uint64_t v_desc = wgmma::mn_major(v_addr, kt, N * 128);
    if constexpr (D == 256) {  // two products of 128 dims (panels 0-1, 2-3)
      wgmma::m64n128k16_rs_tb(o_acc, p_frag[kt], v_desc, true, Elem{});
      wgmma::m64n128k16_rs_tb(o_acc + 64, p_frag[kt], wgmma::mn_major(v_addr + 2 * N * 128, kt, N * 128), true,
                              Elem{});
    } else if constexpr (D == 128) {
      wgmma::m64n128k16_rs_tb(o_acc, p_frag[kt], v_desc, true, Elem{});
    } else {
      wgmma::m64n64k16_rs_tb(o_acc, p_frag[kt], v_desc, true, Elem{});
    }
  }
  wgmma::commit();
#endif
}

// One K/V tile (its first kN tokens), its phases in order; returns when both products have completed.
// kRangesOnly: as wgmma_softmax's.
template <class Tr, int kN = Tr::kTileTokens, bool kRangesOnly = false>
__device__ __forceinline__ void wgmma_attend_tile(const AttentionParams& p, const WgmmaItem& c,
                                                  WgmmaRows<Tr::kHeadDim>& st, uint32_t q_addr, uint32_t k_addr,
                                                  uint32_t v_addr, int tile_start) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  float s_acc[kN / 2];
  wgmma_issue_s<Tr, kN>(s_acc, q_addr, k_addr);
  wgmma::wait<0>();
  float corr[2];
  wgmma_softmax<Tr, kRangesOnly, kN>(p, c, st, s_acc, tile_start, corr);
#pragma unroll
  for (int i = 0; i < Tr::kHeadDim / 2; ++i) st.o_acc[i] *= corr[(i % 4) / 2];
  uint32_t p_frag[kN / 16][4];
  wgmma_pack_p<Tr, kN>(s_acc, p_frag);
  wgmma_issue_pv<Tr, kN>(st.o_acc, p_frag, v_addr);
  wgmma::wait<0>();
#endif
}

// A tile from tile_start whose keys past `hi` no row of the warpgroup sees: its first kN tokens, kN the smallest
// multiple of 32 that covers them where p.narrow_tiles allows (ATTNFORGE_PREFILL_NARROW) and the masks are the rows'
// KV ranges alone (no soft-cap, ALiBi or custom mask: the narrow forms compile only that softmax, about 1,000 SASS
// instructions each where the per-key one doubles them), else all N. The causal diagonal of a 32-token query tile
// (128 packed rows at group 4) leaves 16 to 112 of a 128-token tile's keys unseen; in a batch of short requests
// that was 4.4% of the products (ragged 16 x [512, 4096]).
template <class Tr>
__device__ __forceinline__ void wgmma_attend_tile_upto(const AttentionParams& p, const WgmmaItem& c,
                                                       WgmmaRows<Tr::kHeadDim>& st, uint32_t q_addr, uint32_t k_addr,
                                                       uint32_t v_addr, int tile_start, int hi) {
  constexpr int N = Tr::kTileTokens;
  const bool narrow = p.narrow_tiles && !c.transform && !p.variant.custom_mask;
  const int need = narrow ? (min(hi - tile_start, N) + 31) / 32 * 32 : N;
  if (need >= N) return wgmma_attend_tile<Tr>(p, c, st, q_addr, k_addr, v_addr, tile_start);
  if constexpr (N == 128) {
    if (need == 96) return wgmma_attend_tile<Tr, 96, true>(p, c, st, q_addr, k_addr, v_addr, tile_start);
  }
  if constexpr (N >= 128) {
    if (need == 64) return wgmma_attend_tile<Tr, 64, true>(p, c, st, q_addr, k_addr, v_addr, tile_start);
  }
  wgmma_attend_tile<Tr, 32, true>(p, c, st, q_addr, k_addr, v_addr, tile_start);
}

// Each row's state is complete in its quad of lanes: normalize and write it, as prefill_kernel.
template <int D>
__device__ __forceinline__ void wgmma_store_rows(const AttentionParams& p, const WgmmaItem& c,
                                                 const WgmmaRows<D>& st) {
  const VariantParams& vp = p.variant;
  const KVParams& kv = p.kv;
  const WorkItem& it = c.it;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = warp_sum_quad(st.l_run[h]);
    const int r = c.warp_row0 + c.lane / 4 + 8 * h;
    if (r >= c.rows) continue;
    const QueryRow q = query_row(it, c.row0 + r, c.group, c.kv_head);
    float lse, f;
    row_scale<true>(vp, q.head, st.m_run[h], l, kv.v_scale, it.partial_row < 0, &lse, &f);
    store_quad_row<D>(p, it, q, c.qo_start, f, lse,
                      [&](int n) { return make_float2(st.o_acc[4 * n + 2 * h], st.o_acc[4 * n + 2 * h + 1]); });
  }
}

// As wgmma_store_rows, for final rows written in Q's type to 16-byte aligned rows (wgmma_staged_store): the
// warpgroup puts its 64 normalized rows into its own rows of the Q panels (`q_rows`, read by no product of the item
// any more) and meets at named barrier `bar` (its 128 threads). Then either (`by_box`: p.tma_store, and all 64
// rows are the item's) its thread 0 writes them as boxes of O through p.tma_o, one a 64-dim panel, and returns
// true (its bulk group must have read the rows before they are written again: tma::store_wait_read), or each
// row's 16-byte chunks are written by consecutive threads along a row and the warpgroup meets again, so the next
// item's Q may land there. The direct stores wrote 2 bytes a lane and touched eight rows an instruction: 10,500
// cycles an item on the H200 (trace at fd447de), as long as three K/V tiles. `wg_row0`: the warpgroup's first row
// of the CTA's (its rows of the panels start there).
template <class Tr>
__device__ __forceinline__ bool wgmma_store_rows_staged(const AttentionParams& p, const WgmmaItem& c,
                                                        const WgmmaRows<Tr::kHeadDim>& st, uint8_t* q_rows,
                                                        int wg_row0, int bar,
                                                        bool by_box ATTNFORGE_TRACE(, ConsumerTrace& tr)) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Elem = typename Tr::Elem;
  constexpr int D = Tr::kHeadDim, kChunks = D / 8;
  const WorkItem& it = c.it;
  // The warpgroup's row lr, 16-byte chunk n, in the panels' 128-byte swizzle (conflict-free both ways).
  auto staged = [&](int lr, int n) {
    return q_rows + (n / 8) * (Tr::kRows * 128) + lr * 128 + ((n % 8) ^ (lr % 8)) * 16;
  };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = warp_sum_quad(st.l_run[h]);
    const int r = c.warp_row0 + c.lane / 4 + 8 * h, lr = r - wg_row0;  // the CTA's row, the warpgroup's
    const QueryRow q = query_row(it, c.row0 + r, c.group, c.kv_head);
    float lse, f;
    row_scale<true>(p.variant, q.head, st.m_run[h], l, p.kv.v_scale, true, &lse, &f);
    if (p.lse && c.lane % 4 == 0 && r < c.rows) p.lse[(c.qo_start + q.tok) * p.lse_stride_token + q.head] = lse;
#pragma unroll
    for (int n = 0; n < kChunks; ++n)
      *reinterpret_cast<uint32_t*>(staged(lr, n) + 4 * (c.lane % 4)) =
          pack2(st.o_acc[4 * n + 2 * h] * f, st.o_acc[4 * n + 2 * h + 1] * f, Elem{});
  }
  const int t = threadIdx.x & 127;
  if (by_box) {
    ATTNFORGE_TRACE(tr.lap(tr.stage);)
    wgmma::fence_operands();  // this thread's staged rows, visible to the accelerator's reads (the async proxy)
    ATTNFORGE_TRACE(tr.lap(tr.sfence);)
    mbar::named_sync(bar, 128);
    ATTNFORGE_TRACE(tr.lap(tr.ssync);)
    if (t != 0) return false;
    // Packed row wg_row0 + lr is token (c.row0 + wg_row0 + lr) / group of the item, head kv_head * group + lr %
    // group: 64 rows are 64 / group whole tokens (group divides 64: the host sets tma_store only then).
#pragma unroll
    for (int panel = 0; panel < D / 64; ++panel)
      tma::store_3d(&p.tma_o, 64 * panel, c.kv_head * c.group,
                    c.qo_start + it.qo_begin + (c.row0 + wg_row0) / c.group, q_rows + panel * (Tr::kRows * 128));
    tma::store_commit();
    return true;
  }
  mbar::named_sync(bar, 128);
  ATTNFORGE_TRACE(tr.lap(tr.stage);)  // normalized and staged: the writes count as the caller's store
  uint16_t* o = static_cast<uint16_t*>(p.o);
#pragma unroll
  for (int k = 0; k < 64 * kChunks / 128; ++k) {
    const int i = k * 128 + t, lr = i / kChunks, n = i % kChunks;
    if (wg_row0 + lr >= c.rows) continue;
    const QueryRow q = query_row(it, c.row0 + wg_row0 + lr, c.group, c.kv_head);
    *reinterpret_cast<uint4*>(o + (c.qo_start + q.tok) * p.o_stride_token + q.head * p.o_stride_head + n * 8) =
        *reinterpret_cast<const uint4*>(staged(lr, n));
  }
  mbar::named_sync(bar, 128);
#endif
  return false;
}

// Whether wgmma_store_rows_staged may write an item's rows: final rows (not a split's partial state) in Q's type,
// rows 16-byte aligned.
__device__ __forceinline__ bool wgmma_staged_store(const AttentionParams& p, const WorkItem& it) {
  return it.partial_row < 0 && p.o_dtype == p.q_dtype && (reinterpret_cast<uintptr_t>(p.o) & 15) == 0 &&
         p.o_stride_token % 8 == 0 && p.o_stride_head % 8 == 0;
}

// The warp-specialized and pipelined forms' computing warpgroup on an item's num_tiles K/V tiles from range_lo,
// in the stages' order (tile count `count`): each waited for on its full barrier, attended where some row of the
// warpgroup sees it ([g_lo, g_hi)), and released on its empty one.
template <class Tr>
__device__ __forceinline__ void wgmma_consume_tiles(const AttentionParams& p, const WgmmaItem& c,
                                                    WgmmaRows<Tr::kHeadDim>& st, uint32_t q_addr, uint8_t* sK,
                                                    uint8_t* sV, uint64_t* full, uint64_t* empty, uint32_t& count,
                                                    int range_lo, int num_tiles, int g_lo,
                                                    int g_hi ATTNFORGE_TRACE(, ConsumerTrace& tr)) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int N = Tr::kTileTokens, S = Tr::kStages;
#pragma unroll 1
  for (int t = 0; t < num_tiles; ++t, ++count) {
    const int s = count % S;
    mbar::wait(&full[s], (count / S) & 1);
    ATTNFORGE_TRACE(tr.lap(t == 0 ? tr.first : tr.wait);)
    wgmma::fence_operands();  // the copier's copies, seen through the barrier, before the tensor cores read
    const int tile_start = range_lo + t * N;
    if (tile_start < g_hi && tile_start + N > g_lo)  // some row of this warpgroup sees the tile
      wgmma_attend_tile_upto<Tr>(p, c, st, q_addr, smem_address(sK + s * Tr::kStageBytes),
                                 smem_address(sV + s * Tr::kStageBytes), tile_start, g_hi);
    mbar::arrive(&empty[s]);
    ATTNFORGE_TRACE(const bool tr_is_plain = !c.transform && !p.variant.custom_mask && tile_start >= c.w_max_lo &&
                                             tile_start + N <= c.w_min_hi;
                    tr.lap(tr_is_plain ? tr.plain : tr.masked); tr.masked_tiles += !tr_is_plain;)
  }
#endif
}

// An item's rows written: staged through the warpgroup's own Q rows (q_rows, its first row wg_row0, named barrier
// `bar`) where wgmma_staged_store allows, else directly; by boxes of O where `by_box` also holds (the 64 rows are
// all the item's). True on the thread that issued boxes (wgmma_store_rows_staged).
template <class Tr>
__device__ __forceinline__ bool wgmma_store_item(const AttentionParams& p, const WgmmaItem& c,
                                                 const WgmmaRows<Tr::kHeadDim>& st, uint8_t* q_rows, int wg_row0,
                                                 int bar, bool by_box ATTNFORGE_TRACE(, ConsumerTrace& tr)) {
  if (wgmma_staged_store(p, c.it))
    return wgmma_store_rows_staged<Tr>(p, c, st, q_rows, wg_row0, bar, by_box && wg_row0 + 64 <= c.rows
                                       ATTNFORGE_TRACE(, tr));
  wgmma_store_rows<Tr::kHeadDim>(p, c, st);
  return false;
}

// The rows of this thread's warp (warp_row0 + lane / 4 + 8 h over its lanes): the union of their KV ranges [w_lo,
// w_hi) and their intersection over the item's rows (w_max_lo, w_min_hi: the plain-tile test).
__device__ __forceinline__ void wgmma_row_bounds(const VariantParams& vp, const WorkItem& it, const ItemRows& m,
                                                 int row0, int group, int warp_row0, int lane, int& w_lo, int& w_hi,
                                                 int& w_max_lo, int& w_min_hi) {
  w_lo = it.kv_end, w_hi = it.kv_begin, w_max_lo = it.kv_begin, w_min_hi = it.kv_end;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp_row0 + lane / 4 + 8 * h;
    int lo, hi;
    row_kv_range(vp, it, r, m.rows, row0 + r, group, m.qo_len, m.kv_len, &lo, &hi);
    if (r < m.rows) w_max_lo = max(w_max_lo, lo), w_min_hi = min(w_min_hi, hi);
    if (lo < hi) w_lo = min(w_lo, lo), w_hi = max(w_hi, hi);
  }
  warp_kv_bounds(w_lo, w_hi, w_max_lo, w_min_hi);
}

// wgmma_row_bounds, the union published by lane 0 in s_bounds[.][warp].
template <int kWarps>
__device__ __forceinline__ void wgmma_warp_bounds(const VariantParams& vp, const WorkItem& it, const ItemRows& m,
                                                  int row0, int group, int warp_row0, int lane, int warp,
                                                  int (*s_bounds)[kWarps], int& w_max_lo, int& w_min_hi) {
  int w_lo, w_hi;
  wgmma_row_bounds(vp, it, m, row0, group, warp_row0, lane, w_lo, w_hi, w_max_lo, w_min_hi);
  if (lane == 0) s_bounds[0][warp] = w_lo, s_bounds[1][warp] = w_hi;
}

// Once every computing warp (kFirstWarp .. kWarps - 1) has published its bounds: the CTA's KV range, warpgroup
// wg's (a wgmma is issued by all four warps or none), and the number of N-token tiles that cover the CTA's.
template <int kFirstWarp, int kWarps, int N>
__device__ __forceinline__ int wgmma_cta_tiles(const int (*s_bounds)[kWarps], const WorkItem& it, int wg,
                                               int& range_lo, int& range_hi, int& g_lo, int& g_hi) {
  range_lo = it.kv_end, range_hi = it.kv_begin, g_lo = it.kv_end, g_hi = it.kv_begin;
#pragma unroll
  for (int w = kFirstWarp; w < kWarps; ++w) {
    if (s_bounds[0][w] >= s_bounds[1][w]) continue;
    range_lo = min(range_lo, s_bounds[0][w]), range_hi = max(range_hi, s_bounds[1][w]);
    if (w / 4 == wg) g_lo = min(g_lo, s_bounds[0][w]), g_hi = max(g_hi, s_bounds[1][w]);
  }
  return range_hi > range_lo ? (range_hi - range_lo + N - 1) / N : 0;
}

template <class Tr>
__device__ __forceinline__ void prefill_wgmma_body(const AttentionParams& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Elem = typename Tr::Elem;
  constexpr int D = Tr::kHeadDim, N = Tr::kTileTokens;
  extern __shared__ uint8_t smem_raw[];
  __shared__ int s_bounds[2][Tr::kWarps];
  __shared__ int32_t s_pages[Tr::kStages * N];
  uint8_t* smem = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);  // panels need 1024-byte alignment
  uint8_t* sQ = smem;
  uint8_t* sK = sQ + Tr::kQBytes;
  uint8_t* sV = sK + Tr::kStages * Tr::kStageBytes;

  const PlanView& plan = *p.plan;
  const KVParams& kv = p.kv;
  const VariantParams& vp = p.variant;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
  const int kv_head = blockIdx.y;
  const int group = p.num_qo_heads / p.num_kv_heads;
  const int row0 = blockIdx.z * Tr::kRows;
  const int warp_row0 = 16 * warp;  // warpgroup wg's rows are 64 wg .. 64 wg + 63, warp w's 16 w .. 16 w + 15
  const float scale_log2 = vp.sm_scale * kv.k_scale * kLog2e;
  const bool transform = vp.soft_cap > 0.f || vp.alibi_slopes != nullptr;
  const int num_items = plan.num_items;

  // Items in reverse plan order, as prefill_kernel: each request's heaviest causal tiles first.
  for (int index = blockIdx.x; index < num_items; index += gridDim.x) {
    const WorkItem it = plan.items[num_items - 1 - index];
    ItemRows m;
    if (!item_rows<Tr::kRows>(it, group, row0, m)) continue;
    const int b = m.b, rows = m.rows, qo_start = m.qo_start, qo_len = m.qo_len, kv_len = m.kv_len;

    load_query_rows<D, Tr::kRows, Tr::kThreads, true>(p, it, qo_start, row0, rows, group, kv_head,
                                                      reinterpret_cast<uint16_t*>(sQ));
    int w_max_lo, w_min_hi;
    wgmma_warp_bounds<Tr::kWarps>(vp, it, m, row0, group, warp_row0, lane, warp, s_bounds, w_max_lo, w_min_hi);
    __syncthreads();
    int range_lo, range_hi, g_lo, g_hi;
    const int num_tiles = wgmma_cta_tiles<0, Tr::kWarps, N>(s_bounds, it, wg, range_lo, range_hi, g_lo, g_hi);

    KVTileLoader<D, N, Tr::kThreads, Tr::kStages, 2, true> loader(kv, b, kv_head, range_lo, range_hi, s_pages);
    if (num_tiles > 0) loader.fetch_pages(0);
    __syncthreads();  // the first tile's page ids are in shared memory
    if (num_tiles > 0) loader.load(0, sK, sV);
    cp_async_commit();  // with Q
    if (num_tiles > 1) loader.fetch_pages(1);

    const WgmmaItem c{it, b, rows, row0, group, kv_head, qo_start, qo_len, kv_len, warp_row0, lane, w_max_lo,
                      w_min_hi, scale_log2, transform};
    WgmmaRows<D> st;
    wgmma_reset_rows(st);
    const uint32_t q_addr = smem_address(sQ) + 64 * wg * 128;  // this warpgroup's 64 rows of each Q panel

    for (int t = 0; t < num_tiles; ++t) {
      cp_async_wait<0>();
      wgmma::fence_operands();  // this thread's copies, visible to the tensor cores' reads
      __syncthreads();          // every thread's copies of tile t landed; every wgmma of tile t - 1 completed
      if (t + 1 < num_tiles) {
        const int s = (t + 1) % Tr::kStages;
        loader.load(t + 1, sK + s * Tr::kStageBytes, sV + s * Tr::kStageBytes);
        if (t + 2 < num_tiles) loader.fetch_pages(t + 2);
      }
      cp_async_commit();
      const int tile_start = range_lo + t * N;
      if (tile_start >= g_hi || tile_start + N <= g_lo) continue;  // no row of this warpgroup sees the tile
      const uint32_t k_addr = smem_address(sK + (t % Tr::kStages) * Tr::kStageBytes);
      const uint32_t v_addr = smem_address(sV + (t % Tr::kStages) * Tr::kStageBytes);

      wgmma_attend_tile<Tr>(p, c, st, q_addr, k_addr, v_addr, tile_start);
    }
    cp_async_wait<0>();
    grid_launch_dependents();  // the merge kernel may be scheduled (it waits for this grid's end before reading)

    wgmma_store_rows<D>(p, c, st);
    __syncthreads();  // shared memory (Q, stages, bounds, page ids) is reused by the next item
  }
#endif
}

// The warp-specialized form: warpgroup 0 copies K/V tiles into kStages stages, each with a "full" barrier (its 128
// threads' copies have landed: cp.async arrivals) and an "empty" one (the 256 computing threads have read it);
// warpgroups 1 and 2 compute 64 rows each and wait only on those barriers, so one's softmax can run while the
// other's products keep the tensor cores busy. The CTA meets at a barrier twice per item (Q and the bounds in,
// shared memory free again after the item). Stage and phase come from the count of tiles that producer and
// consumers keep alike across items (tile count % kStages, (count / kStages) & 1).
template <class Tr>
__device__ __forceinline__ void prefill_wgmma_ws_body(const AttentionParams& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(Tr::kWarpSpecialized, "three warpgroups");
  constexpr int D = Tr::kHeadDim, N = Tr::kTileTokens, S = Tr::kStages;
  extern __shared__ uint8_t smem_raw[];
  __shared__ int s_bounds[2][Tr::kWarps];
  __shared__ longlong2 s_offsets[S * N];  // the K/V byte offsets of the rows of tiles in flight (fetch_offsets)
  __shared__ alignas(8) uint64_t full[S], empty[S];
  uint8_t* smem = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);  // panels need 1024-byte alignment
  uint8_t* sQ = smem;
  uint8_t* sK = sQ + Tr::kQBytes;
  uint8_t* sV = sK + S * Tr::kStageBytes;

  const PlanView& plan = *p.plan;
  const KVParams& kv = p.kv;
  const VariantParams& vp = p.variant;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
  const bool producer = wg == 0;
  const int cwg = wg - 1;  // a computing warpgroup's index
  const int kv_head = blockIdx.y;
  const int group = p.num_qo_heads / p.num_kv_heads;
  const int row0 = blockIdx.z * Tr::kRows;
  const float scale_log2 = vp.sm_scale * kv.k_scale * kLog2e;
  const bool transform = vp.soft_cap > 0.f || vp.alibi_slopes != nullptr;
  const int num_items = plan.num_items;

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s) mbar::init(&full[s], 128), mbar::init(&empty[s], Tr::kStageReaders);
  }
  __syncthreads();
  uint32_t count = 0;  // tiles through the stages so far

  // The item's shared part: Q copied by the 256 computing threads, then a barrier (id 2) after which every thread
  // reads the computing warps' KV bounds: the CTA's KV range and this warpgroup's. After the register hand-over
  // producer and consumers run separate code (registers are allocated per code path), so each side has its own item
  // loop and the CTA meets at named barriers of all 384 threads (2: Q and bounds in; 3: the item done).
  struct Item : ItemRows {
    WorkItem it;
  };
  auto begin_item = [&](int index, Item& m) {
    m.it = plan.items[num_items - 1 - index];
    if (!item_rows<Tr::kRows>(m.it, group, row0, m)) return false;
    if (!producer) {  // the computing threads copy Q (the producer's registers are few)
      load_query_rows<D, Tr::kRows, 256, true, 128>(p, m.it, m.qo_start, row0, m.rows, group, kv_head,
                                                    reinterpret_cast<uint16_t*>(sQ));
      cp_async_commit();
    }
    return true;
  };
  auto kv_ranges = [&](const WorkItem& it, int& range_lo, int& range_hi, int& g_lo, int& g_hi) {
    cp_async_wait<0>();
    wgmma::fence_operands();  // Q, visible to the tensor cores
    mbar::named_sync(2, Tr::kThreads);
    return wgmma_cta_tiles<4, Tr::kWarps, N>(s_bounds, it, wg, range_lo, range_hi, g_lo, g_hi);
  };

  if (producer) {
    mbar::shrink_registers<Tr::kProducerRegs>();
    ATTNFORGE_TRACE(long long tr_range = 0, tr_fetch = 0, tr_empty = 0, tr_load = 0, tr_items = 0, tr_tiles = 0;
                    const long long tr_begin = clock64(); long long tr_t = tr_begin, tr_now = 0;)
    for (int index = blockIdx.x; index < num_items; index += gridDim.x) {
      ATTNFORGE_TRACE(tr_t = clock64(); ++tr_items;)
      Item m;
      if (!begin_item(index, m)) continue;
      int range_lo, range_hi, g_lo, g_hi;
      const int num_tiles = kv_ranges(m.it, range_lo, range_hi, g_lo, g_hi);
      ATTNFORGE_TRACE(tr_now = clock64(); tr_range += tr_now - tr_t; tr_t = tr_now; tr_tiles += num_tiles;)
      // A tile's row offsets into a shared slot, a producer-only barrier (id 1), then its copies into the stage.
      KVTileLoader<D, N, 128, S, 2, true> loader(kv, m.b, kv_head, range_lo, range_hi);
#pragma unroll 1
      for (int t = 0; t < num_tiles; ++t, ++count) {
        const int s = count % S;
        const uint32_t use = count / S;
        loader.fetch_offsets(t, s_offsets);
        ATTNFORGE_TRACE(tr_now = clock64(); tr_fetch += tr_now - tr_t; tr_t = tr_now;)
        if (use > 0) mbar::wait(&empty[s], (use & 1) ^ 1);  // the consumers read this stage's last tile
        ATTNFORGE_TRACE(tr_now = clock64(); tr_empty += tr_now - tr_t; tr_t = tr_now;)
        mbar::named_sync(1, 128);
        loader.load_offsets(t, sK + s * Tr::kStageBytes, sV + s * Tr::kStageBytes, s_offsets);
        mbar::arrive_on_copies(&full[s]);
        ATTNFORGE_TRACE(tr_now = clock64(); tr_load += tr_now - tr_t; tr_t = tr_now;)
      }
      mbar::named_sync(3, Tr::kThreads);  // shared memory (Q, stages, bounds, page ids) is reused by the next item
    }
    ATTNFORGE_TRACE(if (threadIdx.x == 0) trace_add(0, {tr_items, tr_tiles, clock64() - tr_begin, tr_range, tr_fetch,
                                                        tr_empty, tr_load});)
    grid_launch_dependents();
  } else {
    mbar::grow_registers<Tr::kConsumerRegs>();
    // Warpgroup cwg's rows are 64 cwg .. 64 cwg + 63, warp w's 16 of them.
    const int warp_row0 = 16 * (warp - 4);
    const uint32_t q_addr = smem_address(sQ) + 64 * cwg * 128;  // its rows of each Q panel
    ATTNFORGE_TRACE(ConsumerTrace tr;)
    for (int index = blockIdx.x; index < num_items; index += gridDim.x) {
      ATTNFORGE_TRACE(tr.t = trace_clock(); ++tr.items;)
      Item m;
      if (!begin_item(index, m)) continue;
      const WorkItem& it = m.it;
      int w_max_lo, w_min_hi;
      wgmma_warp_bounds<Tr::kWarps>(vp, it, m, row0, group, warp_row0, lane, warp, s_bounds, w_max_lo, w_min_hi);
      int range_lo, range_hi, g_lo, g_hi;
      const int num_tiles = kv_ranges(it, range_lo, range_hi, g_lo, g_hi);
      const WgmmaItem c{it,        m.b,  m.rows,   row0,     group,      kv_head,  m.qo_start, m.qo_len, m.kv_len,
                        warp_row0, lane, w_max_lo, w_min_hi, scale_log2, transform};
      WgmmaRows<D> st;
      wgmma_reset_rows(st);
      ATTNFORGE_TRACE(tr.lap(tr.setup); tr.tiles += num_tiles;)
      wgmma_consume_tiles<Tr>(p, c, st, q_addr, sK, sV, full, empty, count, range_lo, num_tiles, g_lo,
                              g_hi ATTNFORGE_TRACE(, tr));
      if (index + gridDim.x >= num_items) grid_launch_dependents();  // this CTA's last item
      wgmma_store_item<Tr>(p, c, st, sQ + 64 * cwg * 128, 64 * cwg, 5 + cwg, false ATTNFORGE_TRACE(, tr));
      mbar::named_sync(3, Tr::kThreads);
      ATTNFORGE_TRACE(tr.lap(tr.store);)
    }
    ATTNFORGE_TRACE(tr.report(cwg);)
  }
#endif
}

// The pipelined form: as prefill_wgmma_ws_body, persistent (one CTA per SM walks the (KV head, item) pairs,
// head-major: the order the other forms' grid runs in) and without the two CTA barriers per item. The copying
// warpgroup finds the item's KV range from its 128 rows (one a thread) and goes on to the next item's tiles as
// soon as stages free up. With two Q buffers (kCopierQ) it also copies the item's Q and publishes each computing
// warp's bounds with it, so a computing warpgroup starts an item with one barrier wait. With one (head_dim 256)
// each computing warpgroup finds the same range (its rows and the other warpgroup's, two each a thread), its own
// rows' range and masks, and copies its own 64 rows of Q, meeting only its own 128 threads (named barriers 4 and
// 5); those shared bounds are double-buffered by item parity, which the barrier of the next item protects.
template <class Tr>
__device__ __forceinline__ void prefill_wgmma_pipelined_body(const AttentionParams& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(Tr::kForm == WgmmaForm::kPipelined || Tr::kForm == WgmmaForm::kOverlapped, "persistent forms");
  constexpr bool kOverlap = Tr::kForm == WgmmaForm::kOverlapped;
  constexpr int D = Tr::kHeadDim, N = Tr::kTileTokens, S = Tr::kStages;
  extern __shared__ uint8_t smem_raw[];
  __shared__ int2 s_range[2][4];          // copier: its warps' KV range, by item parity
  __shared__ int4 s_wg_bounds[2][2][4];   // computing warpgroup, parity, warp: own rows' [lo, hi), all rows' [lo, hi)
  // The K/V byte offsets of the rows of tiles in flight (fetch_offsets): one slot a stage, one more with kOverlap,
  // whose copier loads a tile's V one tile after its K.
  constexpr int kSlots = kOverlap ? S + 1 : S;
  __shared__ longlong2 s_offsets[kSlots * N];
  // With tensor maps (p.tma_box_slots > 0): a tile's boxes (token slot, page) in slot t % kSlots, as its offsets
  // (kOverlap: tile t - 1's V boxes are issued after the other copier threads may have fetched tile t + 1's); boxes
  // hold 8 tokens at least.
  __shared__ int2 s_boxes[kSlots][N / 8];
  // full / empty: a stage's K and V (kOverlap: its K; full_v / empty_v its V).
  __shared__ alignas(8) uint64_t full[S], empty[S], full_v[kOverlap ? S : 1], empty_v[kOverlap ? S : 1];
  // kCopierQ (two Q buffers: head_dim 64 and 128): the copier copies each item's 128 rows of Q into buffer (items
  // begun) % 2 and publishes with it, in s_qinfo of the buffer, each computing warp's bounds (the union [lo, hi) of
  // its 16 rows' KV ranges, and their intersection over the item's rows: the plain-tile test), so that a computing
  // warpgroup's item starts with one barrier wait: q_full (the copier's 128 threads' arrivals, on their Q copies or
  // with thread 0's Q boxes counted by bytes, and thread 0's second arrival after every copier warp's bounds),
  // q_empty (the 256 computing threads are done with the buffer: products, staged store or boxes of O).
  // The copier also publishes the item's rows (ItemRows: request start, query and KV lengths, rows) in s_qrows, so
  // the computing warpgroups never wait on the plan's qo_indptr and kv_len: those dependent loads, made a pair ahead,
  // still stalled them ~1,700 cycles an item (H200 trace at 1d7130c, "qwait").
  constexpr bool kCopierQ = Tr::kQBuffers == 2;
  __shared__ int4 s_qinfo[2][8], s_qrows[2];
  ATTNFORGE_TRACE(__shared__ long long s_qtrace[2][4];)  // the copier's times for the item of each Q buffer
  __shared__ alignas(8) uint64_t q_full[2], q_empty[2];
  uint8_t* smem = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);  // panels need 1024-byte alignment
  uint8_t* sQ = smem;
  uint8_t* sK = sQ + Tr::kQBuffers * Tr::kQBytes;
  uint8_t* sV = sK + S * Tr::kStageBytes;

  const PlanView& plan = *p.plan;
  const KVParams& kv = p.kv;
  const VariantParams& vp = p.variant;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
  const int group = p.num_qo_heads / p.num_kv_heads;
  const int row0 = blockIdx.z * Tr::kRows;
  const int num_items = plan.num_items;
  const int num_work = num_items * p.num_kv_heads;  // (KV head, item) pairs, head-major as the other forms' grid

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      mbar::init(&full[s], 128), mbar::init(&empty[s], 2 * 128);
      if constexpr (kOverlap) mbar::init(&full_v[s], 128), mbar::init(&empty_v[s], 2 * 128);
    }
    if constexpr (kCopierQ)
      for (int b = 0; b < 2; ++b) mbar::init(&q_full[b], 128 + 1), mbar::init(&q_empty[b], 2 * 128);
  }
  __syncthreads();  // the only CTA barrier
  uint32_t count = 0;  // tiles through the stages so far: stage count % S, phase (count / S) & 1
  int parity = 0;      // items begun by this side, mod 2: which bounds buffer
  uint32_t q_items = 0;  // kCopierQ: items begun by this side (Q buffer q_items % 2, its use q_items / 2)

  if (wg == 0) {
    mbar::shrink_registers<Tr::kProducerRegs>();
    ATTNFORGE_TRACE(long long tr_range = 0, tr_fetch = 0, tr_empty = 0, tr_load = 0, tr_items = 0, tr_tiles = 0;
                    const long long tr_begin = clock64(); long long tr_t = tr_begin;
                    long long tr_qt[4] = {tr_begin, tr_begin, tr_begin, tr_begin};)
    const PairWalk walk = PairWalk::make(p, num_work);
    int w_next = walk.at_or_0(walk.begin);  // the next pair's number, loaded an item ahead
    for (int k = walk.begin; k < walk.end; k += walk.step) {
      ATTNFORGE_TRACE(tr_t = clock64(); ++tr_items; tr_qt[1] = tr_t;)
      const int w = w_next;
      w_next = walk.at_or_0(k + walk.step);
      const int kv_head = w / num_items;
      const WorkItem it = plan.items[num_items - 1 - (w - kv_head * num_items)];
      ItemRows m;
      if (!item_rows<Tr::kRows>(it, group, row0, m)) continue;
      const int qb = q_items & 1;
      // kCopierQ: the item's Q is requested first (it needs only the item's rows), its bounds published after: the
      // bounds were ready long before the computing warpgroups waited (trace), and Q sooner made ragged 16 x 1.2%
      // faster (perf-notes).
      if constexpr (kCopierQ) {
        const uint32_t q_use = q_items++ / 2;
        if (q_use > 0) mbar::wait(&q_empty[qb], (q_use & 1) ^ 1);  // its last item's products and store are done
        if (threadIdx.x == 0) s_qrows[qb] = make_int4(m.qo_start, m.qo_len, m.kv_len, m.rows);
        if (p.tma_q_rows) {
          // One box a 64-dim panel: the 128 packed rows from row0 are 128 / group whole tokens (the host encodes the
          // map only where the group divides 128). Rows past the item's hold the next request's queries (or zeros
          // past Q's end) instead of cp.async's zeros: rows are independent in the products and the softmax, and
          // those rows are never stored.
          if (threadIdx.x == 0) {
            tma::arrive_expect_tx(&q_full[qb], Tr::kQBytes);
#pragma unroll
            for (int panel = 0; panel < D / 64; ++panel)
              tma::load_3d(sQ + qb * Tr::kQBytes + panel * (Tr::kRows * 128), &p.tma_q, 64 * panel, kv_head * group,
                           m.qo_start + it.qo_begin + row0 / group, &q_full[qb]);
            ATTNFORGE_TRACE(tr_qt[2] = clock64();)
          }
        } else {
          load_query_rows<D, Tr::kRows, 128, true>(p, it, m.qo_start, row0, m.rows, group, kv_head,
                                                   reinterpret_cast<uint16_t*>(sQ + qb * Tr::kQBytes));
          ATTNFORGE_TRACE(tr_qt[2] = clock64();)
        }
      }
      int lo, hi;  // this thread's row, then the warp's union of non-empty rows
      row_kv_range(vp, it, threadIdx.x, m.rows, row0 + threadIdx.x, group, m.qo_len, m.kv_len, &lo, &hi);
      // The intersection over the item's rows (rows past them count as the whole item).
      int max_lo = threadIdx.x < m.rows ? lo : it.kv_begin, min_hi = threadIdx.x < m.rows ? hi : it.kv_end;
      if (lo >= hi) lo = it.kv_end, hi = it.kv_begin;
      // kCopierQ: a computing warp's 16 rows are half of this warp's 32.
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) {
        lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
        if constexpr (kCopierQ) {
          max_lo = max(max_lo, __shfl_xor_sync(0xffffffffu, max_lo, o));
          min_hi = min(min_hi, __shfl_xor_sync(0xffffffffu, min_hi, o));
        }
      }
      if constexpr (kCopierQ)
        if ((lane & 15) == 0) s_qinfo[qb][threadIdx.x / 16] = make_int4(lo, hi, max_lo, min_hi);
      lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, 16));
      hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, 16));
      if (lane == 0) s_range[parity][warp] = make_int2(lo, hi);
      mbar::named_sync(1, 128);  // also: every copier thread is done with the last item's offset slots
      // q_full's 129 arrivals, each after the thread's own write of s_qinfo and the named barrier (so
      // compute-sanitizer's racecheck sees every write ordered before the computing warps' reads): thread 0's
      // expect-tx (with the boxes of Q) and one plain arrival each of the other threads, or with cp.async every
      // thread's arrival on its copies; then thread 0's second, which the phase needs in both forms.
      if constexpr (kCopierQ) {
        if (!p.tma_q_rows)
          mbar::arrive_on_copies(&q_full[qb]);
        else if (threadIdx.x != 0)
          mbar::arrive(&q_full[qb]);
        if (threadIdx.x == 0) {
          ATTNFORGE_TRACE(tr_qt[3] = clock64(); for (int i = 0; i < 4; ++i) s_qtrace[qb][i] = tr_qt[i];)
          mbar::arrive(&q_full[qb]);  // after every copier warp's bounds (the named barrier)
        }
      }
      int range_lo = it.kv_end, range_hi = it.kv_begin;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        range_lo = min(range_lo, s_range[parity][i].x);
        range_hi = max(range_hi, s_range[parity][i].y);
      }
      parity ^= 1;
      const int num_tiles = range_hi > range_lo ? (range_hi - range_lo + N - 1) / N : 0;
      KVTileLoader<D, N, 128, kSlots, 2, true> loader(kv, m.b, kv_head, range_lo, range_hi);
      ATTNFORGE_TRACE(long long tr_now = clock64(); tr_range += tr_now - tr_t; tr_t = tr_now; tr_tiles += num_tiles;)
      // Tensor maps (p.tma_box_slots > 0): a tile that lies whole inside the range and starts on a box boundary is
      // copied by box loads from lane 0 of each copier warp, which the stage's full barrier counts by bytes (the
      // other threads arrive plainly); the item's last, partial tile (zeros past the range) and any other take the
      // threads' cp.async.
      const bool ragged = kv.format == KVFormat::kRagged;
      const int box_rows = ragged ? N : p.tma_box_slots;
      auto by_tma = [&](int t) {
        const int tile0 = range_lo + t * N;
        return p.tma_box_slots > 0 && tile0 + N <= range_hi && (ragged || tile0 % p.tma_box_slots == 0);
      };
      // Lane 0 of copier warp `warp`: its boxes (b = warp, warp + 4, ...) of tile t (fetched into s_boxes[t %
      // kSlots]) of K and/or V into stage s, counted on `bar` with their bytes. One thread issuing all 32 boxes of a
      // 16-token-page tile in series measured 18% slower than cp.async (H200, e4daea1); four issue a quarter each.
      // A map's second and third coordinates are (KV head, slot) where its head axis is the inner one (tma.h), else
      // swapped.
      auto issue_boxes = [&](int t, int s, bool k, bool v, uint64_t* bar) {
        const int boxes = N / box_rows, mine = (boxes - warp + 3) / 4;
        if (mine <= 0) return mbar::arrive(bar);
        tma::arrive_expect_tx(bar, mine * (k + v) * (D / 64) * box_rows * 128);
        const bool k_inner = p.tma_heads_inner & 1, v_inner = p.tma_heads_inner & 2;
#pragma unroll 1
        for (int b = warp; b < boxes; b += 4) {
          const int2 box = s_boxes[t % kSlots][b];
#pragma unroll
          for (int panel = 0; panel < D / 64; ++panel) {
            const int offset = s * Tr::kStageBytes + panel * N * 128 + b * box_rows * 128;
            if (k)
              tma::load_4d(sK + offset, &p.tma_k, 64 * panel, k_inner ? kv_head : box.x, k_inner ? box.x : kv_head,
                           box.y, bar);
            if (v)
              tma::load_4d(sV + offset, &p.tma_v, 64 * panel, v_inner ? kv_head : box.x, v_inner ? box.x : kv_head,
                           box.y, bar);
          }
        }
      };
      // kOverlap: tile t's V (stage s, use `use`) once the computing warpgroups' P V of the stage's last tile is done.
      auto load_v = [&](int t, int s, uint32_t use) {
        if (use > 0) mbar::wait(&empty_v[s], (use & 1) ^ 1);
        if (!by_tma(t)) {
          loader.template load_offsets<false, true>(t, nullptr, sV + s * Tr::kStageBytes, s_offsets);
          mbar::arrive_on_copies(&full_v[s]);
        } else if (lane == 0) {
          issue_boxes(t, s, false, true, &full_v[s]);
        } else {
          mbar::arrive(&full_v[s]);
        }
      };
#pragma unroll 1
      for (int t = 0; t < num_tiles; ++t, ++count) {
        const int s = count % S;
        const bool tma_tile = by_tma(t);
        if (!tma_tile) {
          loader.fetch_offsets(t, s_offsets);
        } else if (static_cast<int>(threadIdx.x) < N / box_rows) {
          const int token = range_lo + t * N + static_cast<int>(threadIdx.x) * box_rows;
          s_boxes[t % kSlots][threadIdx.x] = make_int2(loader.slot_of(token), loader.page_of(token));
        }
        ATTNFORGE_TRACE(tr_now = clock64(); tr_fetch += tr_now - tr_t; tr_t = tr_now;)
        if (count >= S) mbar::wait(&empty[s], ((count / S) & 1) ^ 1);  // the consumers read this stage's last tile
        ATTNFORGE_TRACE(tr_now = clock64(); tr_empty += tr_now - tr_t; tr_t = tr_now; tr_qt[0] = tr_now;)
        mbar::named_sync(1, 128);
        // kOverlap: K one tile ahead of V: tile t's K as soon as its stage's last K has been read (its S done),
        // then tile t - 1's V, whose stage frees only when the P V before it completes, an iteration later.
        if (!tma_tile) {
          loader.template load_offsets<true, !kOverlap>(t, sK + s * Tr::kStageBytes, sV + s * Tr::kStageBytes,
                                                        s_offsets);
          mbar::arrive_on_copies(&full[s]);
        } else if (lane == 0) {
          issue_boxes(t, s, true, !kOverlap, &full[s]);
        } else {
          mbar::arrive(&full[s]);
        }
        if constexpr (kOverlap)
          if (t > 0) load_v(t - 1, (count - 1) % S, (count - 1) / S);
        ATTNFORGE_TRACE(tr_now = clock64(); tr_load += tr_now - tr_t; tr_t = tr_now;)
      }
      if constexpr (kOverlap)
        if (num_tiles > 0) load_v(num_tiles - 1, (count - 1) % S, (count - 1) / S);
    }
    ATTNFORGE_TRACE(if (threadIdx.x == 0) trace_add(0, {tr_items, tr_tiles, clock64() - tr_begin, tr_range, tr_fetch,
                                                        tr_empty, tr_load});)
    grid_launch_dependents();
  } else {
    mbar::grow_registers<Tr::kConsumerRegs>();
    const int cwg = wg - 1;                   // this computing warpgroup: packed rows 64 cwg .. 64 cwg + 63
    const int warp_row0 = 16 * (warp - 4);    // of this warp, 16 rows
    // One Q buffer: this warpgroup's 64 rows of each Q panel, copied from item `qi` (zeros past its rows).
    auto load_q = [&](const WorkItem& qi, const ItemRows& qm, int q_head) {
      const int own_rows = min(qm.rows - 64 * cwg, 64);
      uint16_t* own_q = reinterpret_cast<uint16_t*>(sQ + 64 * cwg * 128);
      if (own_rows > 0 && cwg == 0)
        load_query_rows<D, 64, 128, true, 128, Tr::kRows>(p, qi, qm.qo_start, row0, own_rows, group, q_head, own_q);
      else if (own_rows > 0)
        load_query_rows<D, 64, 128, true, 256, Tr::kRows>(p, qi, qm.qo_start, row0 + 64, own_rows, group, q_head,
                                                          own_q);
    };
    int q_release = -1;  // kCopierQ: the Q buffer this thread's boxes of O still read (released at the next item)
    const float scale_log2 = vp.sm_scale * kv.k_scale * kLog2e;
    const bool transform = vp.soft_cap > 0.f || vp.alibi_slopes != nullptr;
    ATTNFORGE_TRACE(ConsumerTrace tr;)
    // The pairs' metadata runs ahead of the loop (an item's setup was 5,300 cycles, H200 trace at 6cedce2, mostly
    // the dependent global loads of plan.items and then qo_indptr and kv_len): the next pair's WorkItem and rows,
    // the WorkItem after it, and the number of the pair after that (the schedule's), loaded while the current
    // pair's tiles run and first used by the next iteration.
    const PairWalk walk = PairWalk::make(p, num_work);
    auto item_of = [&](int w) {
      const int h = w / num_items;
      return plan.items[num_items - 1 - (w - h * num_items)];
    };
    // kCopierQ: the rows come with Q (s_qrows); whether the item has any from row0 on needs the WorkItem alone.
    auto has_rows = [&](const WorkItem& x, ItemRows& xm) {
      if constexpr (kCopierQ)
        return row0 < (x.qo_end - x.qo_begin) * group;
      else
        return item_rows<Tr::kRows>(x, group, row0, xm);
    };
    WorkItem it_next{}, it_after{};
    ItemRows m_next{};
    bool ok_next = false;
    int w_next = walk.at_or_0(walk.begin), w_after = walk.at_or_0(walk.begin + walk.step);
    int w_third = walk.at_or_0(walk.begin + 2 * walk.step);
    if (walk.begin < walk.end) {
      it_next = item_of(w_next);
      ok_next = has_rows(it_next, m_next);
    }
    if (walk.begin + walk.step < walk.end) it_after = item_of(w_after);
    for (int k = walk.begin; k < walk.end; k += walk.step) {
      ATTNFORGE_TRACE(tr.lap(tr.between); ++tr.items;)
      const int kv_head = w_next / num_items;
      const WorkItem it = it_next;
      ItemRows m = m_next;
      const bool ok = ok_next;
      const int k_next = k + walk.step;
      w_next = w_after, w_after = w_third;
      it_next = it_after;
      ok_next = k_next < walk.end && has_rows(it_next, m_next);
      if (k_next + walk.step < walk.end) it_after = item_of(w_after);
      w_third = walk.at_or_0(k_next + 2 * walk.step);
      if (!ok) continue;
      int w_max_lo, w_min_hi, range_lo = it.kv_end, range_hi = it.kv_begin, g_lo = it.kv_end, g_hi = it.kv_begin;
      int qb = 0;  // the buffer of this item's Q
      if constexpr (kCopierQ) {
        // The copier's Q and bounds (s_qinfo); then the buffer of the last item's boxes of O, if this thread issued
        // them, is released once they have read it (issued before this wait, so normally done by now).
        qb = q_items & 1;
        ATTNFORGE_TRACE(const long long tr_k1 = trace_clock();)
        mbar::wait(&q_full[qb], (q_items++ / 2) & 1);
        ATTNFORGE_TRACE(tr.copier_times(s_qtrace[qb], tr_k1, trace_clock()); tr.lap(tr.qwait);)
        if (q_release >= 0) {
          tma::store_wait_read();
          mbar::arrive(&q_empty[q_release]);
          q_release = -1;
        }
        wgmma::fence_operands();  // Q, copied by the copier and seen through the barrier, before the tensor cores
        const int4 rows = s_qrows[qb];
        m.b = it.request, m.qo_start = rows.x, m.qo_len = rows.y, m.kv_len = rows.z, m.rows = rows.w;
        const int4 own = s_qinfo[qb][warp - 4];
        w_max_lo = own.z, w_min_hi = own.w;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int4 b = s_qinfo[qb][i];
          if (b.x >= b.y) continue;
          range_lo = min(range_lo, b.x), range_hi = max(range_hi, b.y);
          if (i / 4 == cwg) g_lo = min(g_lo, b.x), g_hi = max(g_hi, b.y);
        }
      } else {
        // One Q buffer (head_dim 256): this warpgroup copies its own rows (the other's half may still be read by
        // its products of the last item). Its warp's own rows' bounds, and the union with the other warpgroup's
        // rows (r ^ 64: the CTA's range, as the copier finds it).
        load_q(it, m, kv_head);
        cp_async_commit();
        int w_lo, w_hi;
        wgmma_row_bounds(vp, it, m, row0, group, warp_row0, lane, w_lo, w_hi, w_max_lo, w_min_hi);
        int a_lo = it.kv_end, a_hi = it.kv_begin;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = (warp_row0 + lane / 4 + 8 * h) ^ 64;
          int lo, hi;
          row_kv_range(vp, it, r, m.rows, row0 + r, group, m.qo_len, m.kv_len, &lo, &hi);
          if (lo < hi) a_lo = min(a_lo, lo), a_hi = max(a_hi, hi);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          a_lo = min(a_lo, __shfl_xor_sync(0xffffffffu, a_lo, o));
          a_hi = max(a_hi, __shfl_xor_sync(0xffffffffu, a_hi, o));
        }
        if (lane == 0)
          s_wg_bounds[cwg][parity][warp & 3] = make_int4(w_lo, w_hi, min(a_lo, w_lo), max(a_hi, w_hi));
        cp_async_wait<0>();
        wgmma::fence_operands();         // this warpgroup's Q, visible to the tensor cores
        mbar::named_sync(4 + cwg, 128);  // its Q and bounds are in
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int4 b = s_wg_bounds[cwg][parity][i];
          if (b.x < b.y) g_lo = min(g_lo, b.x), g_hi = max(g_hi, b.y);
          range_lo = min(range_lo, b.z), range_hi = max(range_hi, b.w);
        }
        parity ^= 1;
      }
      const uint32_t q_addr = smem_address(sQ + qb * Tr::kQBytes) + 64 * cwg * 128;
      const int num_tiles = range_hi > range_lo ? (range_hi - range_lo + N - 1) / N : 0;
      const WgmmaItem c{it,        m.b,  m.rows,   row0,     group,      kv_head,  m.qo_start, m.qo_len, m.kv_len,
                        warp_row0, lane, w_max_lo, w_min_hi, scale_log2, transform};
      WgmmaRows<D> st;
      wgmma_reset_rows(st);
      ATTNFORGE_TRACE(tr.lap(tr.setup); tr.tiles += num_tiles;)
      if constexpr (kOverlap) {
        // The tiles some row of this warpgroup sees are a run [t_lo, t_hi); the others are waited for and released
        // unread, in order. Within the run, tile t's S = Q K^T is issued with tile t - 1's O += P V and its softmax
        // runs while that product does: the first tile of the run has no P V before it and the last one's P V
        // follows the loop, so the loop itself issues both products unconditionally (ptxas serializes products
        // around a branch that may or may not have issued one).
        const int t_lo = min(num_tiles, max(0, (g_lo - range_lo) / N));
        const int t_hi = g_hi > g_lo ? max(t_lo, min(num_tiles, (g_hi - range_lo + N - 1) / N)) : t_lo;
        auto skip = [&](uint32_t cnt) {
          const int s = cnt % S;
          const uint32_t phase = (cnt / S) & 1;
          mbar::wait(&full[s], phase);
          mbar::arrive(&empty[s]);
          mbar::wait(&full_v[s], phase);
          mbar::arrive(&empty_v[s]);
        };
#pragma unroll 1
        for (int t = 0; t < t_lo; ++t) skip(count++);
        if (t_lo < t_hi) {
          // Loop-carried: s_acc holds the last tile's P (fp32) and corr its factors for O, until the top of the next
          // iteration packs them, after the wait for the P V before it. That wait opens the iteration (its own basic
          // block), so ptxas cannot hoist it above the softmax, as it did with the wait at the softmax's end.
          uint32_t p_frag[N / 16][4];
          float s_acc[N / 2], corr[2];
          int s = count % S, pv_stage = 0;
          uint32_t phase = (count / S) & 1;
          mbar::wait(&full[s], phase);
          ATTNFORGE_TRACE(tr.lap(tr.first);)
          wgmma::fence_operands();  // the copier's copies, seen through the barrier, before the tensor cores read
          wgmma_issue_s<Tr>(s_acc, q_addr, smem_address(sK + s * Tr::kStageBytes));
          wgmma::wait<0>();
          mbar::arrive(&empty[s]);
          wgmma_softmax<Tr, true>(p, c, st, s_acc, range_lo + t_lo * N, corr);
          ++count;
#pragma unroll 1
          for (int t = t_lo + 1; t < t_hi; ++t, ++count) {
            wgmma::wait<0>();  // the P V issued one iteration ago (none before the first)
            if (t > t_lo + 1) mbar::arrive(&empty_v[pv_stage]);
#pragma unroll
            for (int i = 0; i < D / 2; ++i) st.o_acc[i] *= corr[(i % 4) / 2];
            wgmma_pack_p<Tr>(s_acc, p_frag);
            pv_stage = s;  // the last tile's V
            const uint32_t pv_phase = phase;
            s = count % S, phase = (count / S) & 1;
            mbar::wait(&full[s], phase);
            mbar::wait(&full_v[pv_stage], pv_phase);
            ATTNFORGE_TRACE(tr.lap(tr.wait);)
            wgmma::fence_operands();
            wgmma_issue_s<Tr>(s_acc, q_addr, smem_address(sK + s * Tr::kStageBytes));
            wgmma_issue_pv<Tr>(st.o_acc, p_frag, smem_address(sV + pv_stage * Tr::kStageBytes));
            wgmma::wait<1>();  // S done; the last tile's P V runs on through the softmax
            mbar::arrive(&empty[s]);
            wgmma_softmax<Tr, true>(p, c, st, s_acc, range_lo + t * N, corr);
            ATTNFORGE_TRACE(tr.lap(tr.plain);)
          }
          wgmma::wait<0>();
          if (t_hi > t_lo + 1) mbar::arrive(&empty_v[pv_stage]);
#pragma unroll
          for (int i = 0; i < D / 2; ++i) st.o_acc[i] *= corr[(i % 4) / 2];
          wgmma_pack_p<Tr>(s_acc, p_frag);
          mbar::wait(&full_v[s], phase);
          wgmma::fence_operands();
          wgmma_issue_pv<Tr>(st.o_acc, p_frag, smem_address(sV + s * Tr::kStageBytes));
          wgmma::wait<0>();
          mbar::arrive(&empty_v[s]);
          ATTNFORGE_TRACE(tr.lap(tr.lastpv);)
        }
#pragma unroll 1
        for (int t = t_hi; t < num_tiles; ++t) skip(count++);
      }
      if constexpr (!kOverlap)
        wgmma_consume_tiles<Tr>(p, c, st, q_addr, sK, sV, full, empty, count, range_lo, num_tiles, g_lo,
                                g_hi ATTNFORGE_TRACE(, tr));
      if (k + walk.step >= walk.end) grid_launch_dependents();  // this CTA's last item
      // Staged through its own rows of Q (which the next item's Q load waits for), by boxes of O where the host
      // encoded the map (kCopierQ only: the issuing thread releases the buffer later, the others now).
      const bool boxed = wgmma_store_item<Tr>(p, c, st, sQ + qb * Tr::kQBytes + 64 * cwg * 128, 64 * cwg, 4 + cwg,
                                              kCopierQ && p.tma_store ATTNFORGE_TRACE(, tr));
      if constexpr (kCopierQ) {
        if (boxed)
          q_release = qb;
        else
          mbar::arrive(&q_empty[qb]);
      }
      ATTNFORGE_TRACE(tr.lap(tr.store);)
    }
    if constexpr (kCopierQ)
      if (q_release >= 0) tma::store_wait();  // the boxes' reads of shared memory and writes of O, before exit
    ATTNFORGE_TRACE(tr.report(cwg);)
  }
#endif
}

// sm_90a only (the host launches it on compute capability 9.0 alone); other targets compile an empty body.
template <class Tr>
// __grid_constant__: the tensor maps in p are read by the accelerator where they lie, in the kernel's parameters.
__global__ void __launch_bounds__(Tr::kThreads, 1) prefill_wgmma_kernel(const __grid_constant__ AttentionParams p) {
  if constexpr (Tr::kForm == WgmmaForm::kPipelined || Tr::kForm == WgmmaForm::kOverlapped)
    prefill_wgmma_pipelined_body<Tr>(p);
  else if constexpr (Tr::kForm == WgmmaForm::kWarpSpecialized)
    prefill_wgmma_ws_body<Tr>(p);
  else
    prefill_wgmma_body<Tr>(p);
}

}  // namespace attnforge::cuda
