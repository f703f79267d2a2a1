// Batch decode on tensor cores. One CTA = (work item, KV head, block of 16 rows); rows are the item's query
// tokens times the query heads of the KV head's group, so every K/V element loaded is used by all of them.
// The 4 warps split each 64-token tile (16 tokens each) and keep their own online-softmax state; the states
// are merged through shared memory at the end. K/V tiles stream through a cp.async pipeline, each row fetched
// from its page with the shared KVParams address arithmetic. Split KV is merged by the merge kernel
// (backends/cuda/merge). Self-contained for NVRTC.
//
// fp8 K/V (KV = E4M3 or E5M2) stream into shared memory as raw codes, half the bytes of a 16-bit tile, and are
// converted to fp16 in registers, exactly (device/fp8.cuh), right after ldmatrix; the fp8 kernels multiply in fp16
// whatever Q's type (bf16 Q rows are stored as fp16 with a power-of-two row scale, load_query_rows_permuted).
// Their products are transposed: S^T = K Q^T and O^T = V^T P^T, so the 16 tokens of a warp (and the head dims)
// are the M side and the query rows the N side, one n8 tile per 8 rows: a CTA of 8 rows or fewer (GQA groups of
// up to 8 with one query token: most decode) issues half the mma, exp2 and softmax work of an m16 row tile, of
// which the fp8 kernels, issue-bound where 16-bit K/V is bound by the bus, spent the half on empty rows.
//   K: an ldmatrix of fp8 rows gives each thread 4 consecutive head dims of one token, the A fragment's k pairs
//      2q and 2q + 8; Q's head dims are permuted in shared memory to match (load_query_rows_permuted).
//   V: ldmatrix.trans of fp8 rows gives each thread 2 tokens x 2 adjacent head dims; one byte permute makes the
//      A fragment's rows c (dim 2c) and c + 8 (dim 2c + 1), so a 16-dim block's output rows come in the order
//      0, 2, .., 14, 1, 3, .., 15, and the finish writes them back in order.
//   P: the S^T accumulators, packed to fp16, are P^T's B fragments once transposed by movmatrix.
// Fused RoPE is not built for fp8 K/V (CudaBackend::check refuses it).
#pragma once

#include "attnforge/kernel/params.h"
#include "attnforge/kernel/state.h"
#include "attnforge/kernel/variant.h"
#include "attnforge/kernel/variant_hooks.h"
#include "backends/cuda/decode/decode_defaults.cuh"
#include "backends/cuda/device/fp8.cuh"
#include "backends/cuda/device/hooks.cuh"
#include "backends/cuda/device/ptx.cuh"
#include "backends/cuda/device/tiles.cuh"
#include "backends/cuda/device/timeline.cuh"

namespace attnforge::cuda {

// The tensor cores' operand type: Q's, or fp16 for fp8 K/V whatever Q's type.
template <bool kFp8, typename Elem>
struct DecodeMmaElem {
  using type = Elem;
};
template <typename Elem>
struct DecodeMmaElem<true, Elem> {
  using type = F16;  // fp8 codes widen to fp16 in one instruction a pair (to bf16: four)
};

// kStages_ is the tile configuration of the run-time compiler's key (jit/kernel_key.h); nvcc builds the default.
template <int kHeadDim_, typename Elem_, int kStages_ = kDefaultDecodeStages, typename KV_ = Elem_>
struct DecodeTraits {
  using Elem = Elem_;  // Bf16 or F16: Q element type
  using KV = KV_;      // K/V storage: Elem, or E4M3 / E5M2 (fp8)
  static constexpr bool kFp8 = KVStorage<KV>::kBytes == 1;
  using MmaElem = typename DecodeMmaElem<kFp8, Elem>::type;  // the tensor cores' operand type (and Q's in smem)
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kThreads = 128;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kRows = kDecodeCtaRows;     // one mma M tile
  static constexpr int kTileTokens = 16 * kWarps;  // 16 tokens per warp per tile
  // Two stages by default: one tile in flight while the other is consumed. Shared memory (68 KB at head_dim 128) then
  // admits three CTAs per SM, whose twelve warps hide the latency that four warps alone could not (profiled:
  // two 100 KB CTAs per SM left every scheduler idle 64% of cycles). fp8 tiles are half the bytes: four stages
  // (kDefaultDecodeStagesFp8) fit the same shared memory and keep twice the tokens in flight.
  static constexpr int kStages = kStages_;
  static constexpr int kMinBlocksPerSM = kHeadDim <= 128 ? 3 : 1;  // caps registers so three CTAs fit
  static constexpr int kKVRowBytes = kHeadDim * KVStorage<KV>::kBytes;
  static constexpr int kTileBytes = kTileTokens * kKVRowBytes;  // one K (or V) stage
  static constexpr int kQBytes = 2 * kRows * kHeadDim;
  // Cross-warp merge buffer: per warp m and l of 16 rows, then 16 rows of kHeadDim + 8 floats (the padding
  // moves each row 8 banks, so the 8 rows a store instruction writes hit different banks).
  static constexpr int kMergeStride = kHeadDim + 8;
  static constexpr int kMergeBytes = kWarps * kRows * (kMergeStride + 2) * 4;
  // Shared memory: Q (16-bit), then K stages, then V stages; the cross-warp merge reuses K/V (and extends them
  // where a shallow fp8 pipeline is smaller than the merge buffer).
  static constexpr int kKVBytes = 2 * kStages * kTileBytes;
  static constexpr int kSmemBytes = kQBytes + (kKVBytes > kMergeBytes ? kKVBytes : kMergeBytes);
  static_assert(kStages >= 2, "one tile in flight while another is consumed");
  static_assert(kHeadDim % 32 == 0 && kHeadDim >= 64 && kHeadDim <= 256, "head_dim 64..256, multiple of 32");
};

// Per-warp row states in shared memory (in the K/V stages once the main loop is done): m (log2 units) and l of
// 16 rows per warp, and o per warp and row, already scaled to the rows' common maximum. The padding of o's rows
// moves each row 8 banks, so the 8 rows a store instruction writes hit different banks.
template <class Tr>
struct DecodeMergeSmem {
  float* m;  // [warps][16]
  float* l;  // [warps][16]
  float* o;  // [warps][16][kMergeStride]
  __device__ __forceinline__ explicit DecodeMergeSmem(void* base)
      : m(reinterpret_cast<float*>(base)), l(m + Tr::kWarps * Tr::kRows), o(l + Tr::kWarps * Tr::kRows) {}
  __device__ __forceinline__ float* o_at(int warp, int r, int col) const {
    return o + (warp * Tr::kRows + r) * Tr::kMergeStride + col;
  }
  // Rows r0 and r0 + 8 of `warp` (the two rows of an mma fragment).
  __device__ __forceinline__ void stash_rows(int warp, int r0, const float mv[2], const float lv[2], bool write) const {
    if (!write) return;
    for (int h = 0; h < 2; ++h) m[warp * Tr::kRows + r0 + 8 * h] = mv[h], l[warp * Tr::kRows + r0 + 8 * h] = lv[h];
  }
  __device__ __forceinline__ float row_max(int r) const {
    float x = -ATTNFORGE_INFINITY;
    for (int w = 0; w < Tr::kWarps; ++w) x = fmaxf(x, m[w * Tr::kRows + r]);
    return x;
  }
};

// Combines the warps' states of rows [0, rows) and writes them: to the partial buffers of a split item
// (to_partial), otherwise as the final output (normalized, o_factor applied, sinks folded in, LSE). A thread takes
// four adjacent dims of a row at a time: one row combination and one division per four outputs, float4 reads of the
// warps' O and a float4 store of a partial row. (One element at a time, every element repeated its row's
// combination and division and reloaded the partial buffers' address: about 1,100 dependent instructions per
// thread after the main loop, 2 us of every CTA by the per-CTA timelines.)
template <class Tr>
__device__ __forceinline__ void finish_rows(const AttentionParams& p, const WorkItem& it, const DecodeMergeSmem<Tr>& ms,
                                            int row0, int rows, int group, int kv_head, int qo_start, float o_factor,
                                            bool to_partial) {
  constexpr int D = Tr::kHeadDim, kQuads = D / 4;
  float* const partial_o = p.partial_o;
  float* const partial_lse = p.partial_lse;
  for (int i = threadIdx.x; i < rows * kQuads; i += Tr::kThreads) {
    const int r = i / kQuads, d = (i % kQuads) * 4;
    const float m_all = ms.row_max(r);
    float l_all = 0.f;
    float4 o{0.f, 0.f, 0.f, 0.f};
    for (int w = 0; w < Tr::kWarps; ++w) {
      const float m_w = ms.m[w * Tr::kRows + r];
      if (m_w != -ATTNFORGE_INFINITY) l_all += ms.l[w * Tr::kRows + r] * fast_exp2(m_w - m_all);
      const float4 x = *reinterpret_cast<const float4*>(ms.o_at(w, r, d));
      o.x += x.x, o.y += x.y, o.z += x.z, o.w += x.w;
    }
    float lse = l_all > 0.f ? m_all + log2f(l_all) : -ATTNFORGE_INFINITY;
    float f = l_all > 0.f ? o_factor / l_all : 0.f;
    const QueryRow q = query_row(it, row0 + r, group, kv_head);
    if (!to_partial) {
      f *= apply_sink(p.variant, q.head, &lse);
      const int64_t out = (qo_start + q.tok) * p.o_stride_token + q.head * p.o_stride_head + d;
      store_element(p.o, p.o_dtype, out, o.x * f);
      store_element(p.o, p.o_dtype, out + 1, o.y * f);
      store_element(p.o, p.o_dtype, out + 2, o.z * f);
      store_element(p.o, p.o_dtype, out + 3, o.w * f);
      if (p.lse && d == 0) p.lse[(qo_start + q.tok) * p.lse_stride_token + q.head] = lse;
    } else {
      const int64_t prow = static_cast<int64_t>(it.partial_row) + (q.tok - it.qo_begin);
      *reinterpret_cast<float4*>(partial_o + (prow * p.num_qo_heads + q.head) * D + d) =
          float4{o.x * f, o.y * f, o.z * f, o.w * f};
      if (d == 0) partial_lse[prow * p.num_qo_heads + q.head] = lse;
    }
  }
}

// Merges in the decode kernel (AttentionParams::merge_counters): one 32-bit word per merge, KV head and row block.
// Each CTA counts its state once its rows are written, by an acq_rel atomic after the barrier (the barrier orders
// every thread's writes before it: cumulativity), and the CTA that counts last merges, after its own writes' fence
// and the atomic's trip; it puts the word back to zero for the next launch. (An earlier count, each CTA arriving as
// its tile loop ended and the last to arrive waiting for the others' rows, measured level or slower: perf-notes v29,
// v32.)
__device__ __forceinline__ int32_t* merge_counter(const AttentionParams& p, const WorkItem& it, int kv_head) {
  return p.merge_counters + (static_cast<int64_t>(it.merge) * p.num_kv_heads + kv_head) * gridDim.z + blockIdx.z;
}
template <class Tr>
__device__ __forceinline__ bool merge_count_written(const AttentionParams& p, const WorkItem& it, int kv_head) {
  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t* counter = merge_counter(p, it, kv_head);
    int32_t before;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(before) : "l"(counter) : "memory");
    const bool last = before == it.merge_states - 1;
    if (last) *counter = 0;
    s_last = last;
  }
  __syncthreads();
  return s_last != 0;
}

// Streamed merges (AttentionParams::merge_flags): releases this CTA's flag once every thread's partial rows are
// written (the barrier orders them before thread 0's release), for the merge kernel that runs beside this grid.
__device__ __forceinline__ void publish_state(const AttentionParams& p, int item_index, int kv_head) {
  __syncthreads();
  if (threadIdx.x == 0) {
    store_release_gpu(
        p.merge_flags + (static_cast<int64_t>(kv_head) * gridDim.z + blockIdx.z) * p.item_capacity + item_index, 1);
  }
}

// The merging CTA (merge_count_written) combines the states of its rows (row0 .. row0 + rows - 1 of every piece of the
// request) in the kernel's shared memory, which the K/V stages and Q no longer need (the caller's barrier). A thread
// owns (row, four dims) pairs: it copies its pairs' O slices of every state by cp.async through L2 and later reads
// back only those, so an O copy costs a pointer step and no index arithmetic (the first version spent 16 us of one
// CTA on it and on per-state divisions: H200 timelines, perf-notes). The LSEs go to shared memory beside them in the
// same trip. In one pass (the usual merge) each thread then folds its own pairs alone: the row's maximum m, the
// weights 2^(lse - m), their sum l and the weighted O, with no barrier after the LSEs land. More states than one
// pass holds (a skewed batch's longest request, where the planner allows several passes: decode_merges_in_kernel)
// first run over the LSEs alone, a warp per row, for m and l, then pass by pass over weights (the same warps) and O.
// States are summed in KV order whichever CTA merges (not in the merge kernel's order: deterministic plans never
// merge here); the output and LSE are written as the merge kernel writes them (finish_row).
template <class Tr>
__device__ __forceinline__ void merge_split_rows(const AttentionParams& p, const WorkItem& it, uint8_t* smem, int row0,
                                                 int rows, int group, int kv_head,
                                                 int qo_start ATTNFORGE_TL(, long long* tl_merge)) {
  // Trace builds: the global times this CTA learned it merges, its states landed, the weights were made, the sums
  // were done (the last pass's), and the rows were written.
  ATTNFORGE_TL(if (threadIdx.x == 0) tl_merge[0] = global_ns();)
  constexpr int D = Tr::kHeadDim, kQuads = D / 4, kPairs = (Tr::kRows * kQuads + Tr::kThreads - 1) / Tr::kThreads;
  __shared__ float s_m[Tr::kRows], s_l[Tr::kRows];
  const int states = it.merge_states, heads = p.num_qo_heads, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row_floats = rows * D;
  float* const s_acc = reinterpret_cast<float*>(smem);  // [rows][D], a thread's own pairs
  float* const s_o = s_acc + row_floats;                // [pass][rows][D], a thread's own pairs
  // States a pass holds: their O rows and, after them, their LSEs (rounded to 16 bytes).
  const int pass = (Tr::kSmemBytes / static_cast<int>(sizeof(float)) - row_floats - 4) / (row_floats + rows);
  float* const s_lse = s_o + ((min(pass, states) * row_floats + 3) & ~3);  // [pass][rows]
  // Partial rows: state k of row r is row merge_row0 + k x nq + (row0 + r) / group (WorkItem), so one state's O
  // slice is nq x heads x D floats past the state before it.
  const int64_t nq = it.qo_end - it.qo_begin;
  auto first_row = [&](int r) { return static_cast<int64_t>(it.merge_row0) + (row0 + r) / group; };
  auto head_of = [&](int r) { return kv_head * group + (row0 + r) % group; };
  const bool one_pass = states <= pass;
  // LSEs of states [k0, k0 + n) into s_lse[k - k0][r].
  auto load_lses = [&](int k0, int n) {
    for (int c = threadIdx.x; c < n * rows; c += Tr::kThreads) {
      const int k = c / rows, r = c - k * rows;
      s_lse[c] = load_cg(p.partial_lse + (first_row(r) + (k0 + k) * nq) * heads + head_of(r));
    }
  };
  // A warp per row over the states in s_lse: with `fresh`, the row's (m, l) from these states alone, else folded
  // into the running (m, l); with `weights`, each LSE replaced by its weight against the row's final m.
  auto row_pass = [&](int n, bool fresh, bool weights) {
    for (int r = warp; r < rows; r += Tr::kWarps) {
      float m = -ATTNFORGE_INFINITY;
      for (int k = lane; k < n; k += 32) m = fmaxf(m, s_lse[k * rows + r]);
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      const float m_old = fresh ? -ATTNFORGE_INFINITY : s_m[r];
      if (!weights || fresh) {
        const float m_new = fmaxf(m, m_old);
        float l = 0.f;
        if (m_new != -ATTNFORGE_INFINITY)
          for (int k = lane; k < n; k += 32) {
            const float lse = s_lse[k * rows + r];
            l += lse == -ATTNFORGE_INFINITY ? 0.f : exp2f(lse - m_new);
          }
        for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
        __syncwarp();  // every lane has read s_m[r] and s_l[r] before lane 0 writes them
        if (lane == 0) {
          const float l_old = fresh || m_old == -ATTNFORGE_INFINITY ? 0.f : s_l[r] * exp2f(m_old - m_new);
          s_m[r] = m_new, s_l[r] = l_old + l;
        }
        m = m_new;
      } else {
        m = m_old;
      }
      if (weights)
        for (int k = lane; k < n; k += 32) {
          const float lse = s_lse[k * rows + r];
          s_lse[k * rows + r] = lse == -ATTNFORGE_INFINITY || m == -ATTNFORGE_INFINITY ? 0.f : exp2f(lse - m);
        }
    }
  };
  // Dims 4q .. 4q + 3 of merged row r (maximum m, weight sum l, weighted sum acc), and its LSE, as the merge kernel
  // writes them (finish_row).
  auto write_row_quad = [&](int r, int q, float m, float l, const float4& acc) {
    const QueryRow qr = query_row(it, row0 + r, group, kv_head);
    float lse = l > 0.f ? m + log2f(l) : -ATTNFORGE_INFINITY;
    const float f = (l > 0.f ? 1.f / l : 0.f) * apply_sink(p.variant, qr.head, &lse);
    const int64_t out = (qo_start + qr.tok) * p.o_stride_token + qr.head * p.o_stride_head + 4 * q;
    store_element(p.o, p.o_dtype, out, acc.x * f);
    store_element(p.o, p.o_dtype, out + 1, acc.y * f);
    store_element(p.o, p.o_dtype, out + 2, acc.z * f);
    store_element(p.o, p.o_dtype, out + 3, acc.w * f);
    if (p.lse && q == 0) p.lse[(qo_start + qr.tok) * p.lse_stride_token + qr.head] = lse;
  };
  // Pass k0's O copies (each thread its own pairs' slices, by cp.async through L2) and LSEs, landed for this thread.
  auto load_states = [&](int k0, int n) {
#pragma unroll 1
    for (int j = 0; j < kPairs; ++j) {
      const int i = threadIdx.x + j * Tr::kThreads;
      if (i >= row_floats / 4) continue;
      const int r = i / kQuads;
      const float* src = p.partial_o + ((first_row(r) + k0 * nq) * heads + head_of(r)) * D + 4 * (i % kQuads);
      float* dst = s_o + 4 * i;
      for (int k = 0; k < n; ++k, src += nq * heads * D, dst += row_floats) cp_async_16(dst, src, 16);
    }
    cp_async_commit();
    load_lses(k0, n);
    cp_async_wait<0>();
  };
  if (one_pass) {
    // Every state in one pass: a thread folds its own pairs alone, with no warp pass, no barrier after the one that
    // publishes the LSEs and no accumulator round trip through shared memory (the warp-per-row weights and the
    // separate sums took 1.2 us of the 1 x 32768 step's merge: H200 timelines, perf-notes v21; v29 for this form).
    load_states(0, states);
    __syncthreads();  // the LSEs are in; every thread's own O copies have landed
    ATTNFORGE_TL(if (threadIdx.x == 0) tl_merge[1] = global_ns();)
#pragma unroll 1
    for (int j = 0; j < kPairs; ++j) {
      const int i = threadIdx.x + j * Tr::kThreads;
      if (i >= row_floats / 4) continue;
      const int r = i / kQuads, q = i % kQuads;
      const float* lse_r = s_lse + r;
      float m = -ATTNFORGE_INFINITY;
      for (int k = 0; k < states; ++k) m = fmaxf(m, lse_r[k * rows]);
      float l = 0.f;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      if (m != -ATTNFORGE_INFINITY) {
        const float* o = s_o + 4 * i;
#pragma unroll 8
        for (int k = 0; k < states; ++k) {
          const float lse = lse_r[k * rows];
          const float w = lse == -ATTNFORGE_INFINITY ? 0.f : exp2f(lse - m);
          const float4 x = *reinterpret_cast<const float4*>(o + k * row_floats);
          l += w;
          acc.x += w * x.x, acc.y += w * x.y, acc.z += w * x.z, acc.w += w * x.w;
        }
      }
      write_row_quad(r, q, m, l, acc);
    }
    ATTNFORGE_TL(if (threadIdx.x == 0) tl_merge[2] = tl_merge[3] = tl_merge[4] = global_ns();)
    return;
  }
  for (int k0 = 0; k0 < states; k0 += pass) {  // several passes: the rows' m and l over every state first
    load_lses(k0, min(pass, states - k0));
    __syncthreads();
    row_pass(min(pass, states - k0), k0 == 0, false);
    __syncthreads();
  }
  for (int k0 = 0; k0 < states; k0 += pass) {
    const int n = min(pass, states - k0);
    load_states(k0, n);
    __syncthreads();  // the LSEs are in; every thread's own O copies have landed
    ATTNFORGE_TL(if (threadIdx.x == 0) tl_merge[1] = global_ns();)
    row_pass(n, false, true);
    __syncthreads();  // the weights are in
    ATTNFORGE_TL(if (threadIdx.x == 0) tl_merge[2] = global_ns();)
#pragma unroll 1
    for (int j = 0; j < kPairs; ++j) {
      const int i = threadIdx.x + j * Tr::kThreads;
      if (i >= row_floats / 4) continue;
      const int r = i / kQuads;
      float4 acc = k0 == 0 ? make_float4(0.f, 0.f, 0.f, 0.f) : *reinterpret_cast<const float4*>(s_acc + 4 * i);
      const float* o = s_o + 4 * i;
#pragma unroll 8
      for (int k = 0; k < n; ++k) {
        const float w = s_lse[k * rows + r];
        const float4 x = *reinterpret_cast<const float4*>(o + k * row_floats);
        acc.x += w * x.x, acc.y += w * x.y, acc.z += w * x.z, acc.w += w * x.w;
      }
      *reinterpret_cast<float4*>(s_acc + 4 * i) = acc;
    }
    __syncthreads();  // the next pass overwrites the LSEs
    ATTNFORGE_TL(if (threadIdx.x == 0) tl_merge[3] = global_ns();)
  }
#pragma unroll 1
  for (int j = 0; j < kPairs; ++j) {
    const int i = threadIdx.x + j * Tr::kThreads;
    if (i >= row_floats / 4) continue;
    const int r = i / kQuads, q = i % kQuads;
    write_row_quad(r, q, s_m[r], s_l[r], *reinterpret_cast<const float4*>(s_acc + 4 * i));
  }
  ATTNFORGE_TL(if (threadIdx.x == 0) tl_merge[4] = global_ns();)
}

// finish_rows for a custom variant (never split: run_variant refuses plans with merges): one thread per row, so
// the output transform sees the whole row in fp32.
template <class Tr, class V>
__device__ __forceinline__ void finish_rows_variant(const AttentionParams& p, const VariantArgs& va, const WorkItem& it,
                                                    const DecodeMergeSmem<Tr>& ms, int row0, int rows, int group,
                                                    int kv_head, int qo_start, int qo_len, int kv_len) {
  constexpr int D = Tr::kHeadDim;
  for (int r = threadIdx.x; r < rows; r += Tr::kThreads) {
    const float m_all = ms.row_max(r);
    float l_all = 0.f;
    for (int w = 0; w < Tr::kWarps; ++w) {
      const float m_w = ms.m[w * Tr::kRows + r];
      if (m_w != -ATTNFORGE_INFINITY) l_all += ms.l[w * Tr::kRows + r] * fast_exp2(m_w - m_all);
    }
    const QueryRow q = query_row(it, row0 + r, group, kv_head);
    float lse = __int_as_float(0x7fc00000);  // NaN: no LSE without softmax
    float f = p.kv.v_scale;
    if constexpr (V::kSoftmax) {
      lse = l_all > 0.f ? m_all + log2f(l_all) : -ATTNFORGE_INFINITY;
      f = l_all > 0.f ? f / l_all : 0.f;
      f *= apply_sink(p.variant, q.head, &lse);
    }
    float x[D];
    for (int d = 0; d < D; ++d) {
      float o = 0.f;
      for (int w = 0; w < Tr::kWarps; ++w) o += *ms.o_at(w, r, d);
      x[d] = o * f;
    }
    if constexpr (OverriddenHooks<V>::kOutput) {
      const LogitIndex li{it.request, q.tok, query_position(q.tok, qo_len, kv_len), 0, kv_len, q.head, kv_head};
      V::output_transform(va, li, x, D);
    }
    const int64_t out = (qo_start + q.tok) * p.o_stride_token + q.head * p.o_stride_head;
    for (int d = 0; d < D; ++d) store_element(p.o, p.o_dtype, out + d, x[d]);
    if (p.lse) p.lse[(qo_start + q.tok) * p.lse_stride_token + q.head] = lse;
  }
}

// kRowPass: 0 takes every item in the m16 form (rows on M). Or two passes over the same items (decode_items), as the
// transposed form's n8 tiles of rows are a constant: pass 1 takes the CTAs' items of 8 rows or fewer (transposed,
// one n8 tile) and returns whether it left any, pass 2 takes the others (fp8: transposed, two n8 tiles; 16-bit K/V:
// the m16 form). A runtime tile count inside one loop left the idle tile's mma predicated off, which costs their
// issue slots all the same.
template <class Tr, class V, int kRowPass = 0>
__device__ __forceinline__ bool decode_body(const AttentionParams& p, const VariantArgs& va) {
  constexpr bool kCustom = IsCustomVariant<V>::value;
  constexpr bool kSoftmax = V::kSoftmax;
  using Elem = typename Tr::Elem;
  using MmaElem = typename Tr::MmaElem;
  constexpr int D = Tr::kHeadDim;
  constexpr bool kFp8 = Tr::kFp8;
  // fp8 with bf16 Q: the logits' factor of each row's Q scale (2^s, load_query_rows_permuted), usually 1.
  constexpr bool kQScaled = kFp8 && IsBf16<Elem>::value;
  // The transposed products, S^T = K Q^T and O^T = V^T P^T (tokens, then dims, on M; query rows on N, an n8 tile per
  // 8 rows): fp8 always, 16-bit K/V (head_dim 256: decode_items) in the first row pass (CTAs of 8 rows or fewer). A
  // decode CTA of one query token holds a GQA group of 4 or 8 rows, on which an m16 tile of rows spends half or more
  // of its mma, exp2 and softmax work on empty rows.
  constexpr bool kTrans = kFp8 || kRowPass == 1;
  // The prologue's order (see `whole` below): the rows' fields and bounds before tile 0's copies for fp8 K/V, and on
  // sm_80-89, where the other order made the 2-stage head_dim 128 kernels spill 4 bytes (ptxas 13.0).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  constexpr bool kRowsFirst = true;
#else
  constexpr bool kRowsFirst = kFp8;
#endif
  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* sQ = smem;
  uint8_t* sK = reinterpret_cast<uint8_t*>(smem) + Tr::kQBytes;
  uint8_t* sV = sK + Tr::kStages * Tr::kTileBytes;
  __shared__ float s_freqs[D / 2];  // RoPE frequencies, when on
  __shared__ float s_qscale[Tr::kRows];  // fp8: each Q row's scale 2^s (1 for fp16 Q)
  // Transposed: each row's token, head, position and KV range [lo, hi), which the m16 form keeps in registers (a
  // transposed thread holds 4 rows: in registers they pushed the fp8 head_dim 128 kernels past 168 and into spills).
  __shared__ int s_row_info[kTrans ? 5 : 1][Tr::kRows];

  const PlanView& plan = *p.plan;
  const KVParams& kv = p.kv;
  const VariantParams& vp = p.variant;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // CTAs start in launch order (blockIdx.x fastest): the linear index takes a work item's KV heads together, so the
  // plan's longest-first item order is the order its CTAs start in, not one head's items after another's.
  const int linear = blockIdx.x + gridDim.x * blockIdx.y;  // gridDim.y is the KV head count
  const int kv_head = linear % p.num_kv_heads;
  // The page-list offset is loaded beside the request's lengths (below), one memory trip for both. Requesting the
  // first item and the request arrays' pointers before the item count was known saved two more trips but nothing
  // measurable (the per-CTA timelines kept the prologue at 3.4-3.8 us: its cost is its instructions, most of them the
  // loader's), and its registers made the fp8 kernel spill once the loader's whole-tile path was on: not done.
  const int group = p.num_qo_heads / p.num_kv_heads;
  const int row0 = blockIdx.z * Tr::kRows;
  const float scale_log2 = vp.sm_scale * kv.k_scale * kLog2e;
  const bool transform = !kCustom && (vp.soft_cap > 0.f || vp.alibi_slopes != nullptr);
  const bool rope = !kFp8 && !kCustom && vp.rope.enabled != 0;  // a custom variant does its own RoPE
  if (rope) rope_frequencies<Tr::kThreads>(vp.rope, s_freqs);  // read after the first barrier below
  // Trace builds (device/timeline.cuh): cycles of the prologue (item to the first copies issued), the first tile's
  // wait, the rest of the loop, and the finish's steps (row states stashed, O spread, rows written, last barrier),
  // summed over the CTA's items; the global time tile 0 landed.
  ATTNFORGE_TL(const long long tl_start = global_ns(); long long tl_t = cycles(), tl_ph[7] = {0, 0, 0, 0, 0, 0, 0};
               long long tl_first = 0, tl_tiles = 0, tl_pro[4] = {0, 0, 0, 0}; bool tl_one = true;
               long long tl_merge[6] = {0, 0, 0, 0, 0, 0};
               auto tl_lap = [&](int i) { const long long n = cycles(); tl_ph[i] += n - tl_t; tl_t = n; };)

  // The item count and the first item go out together: the item's place comes from the launch parameters (items,
  // item_capacity), not from the PlanView, and an index past the count reads a stale entry that is never used. The
  // item carries its request's context (WorkItem), so the page-table reads below are the CTA's second trip to
  // memory (they were its fourth: the PlanView, the item, the request arrays; 0.7-0.9 us each in the per-CTA
  // timelines of 1 x 32768).
  const int num_items = plan.num_items;
  bool left = false;  // an item left to the other row pass
  for (int item_index = linear / p.num_kv_heads;; item_index += gridDim.x) {
    WorkItem it{};
    if (item_index < p.item_capacity) it = p.items[item_index];
    if (item_index >= num_items) break;
    using Loader = KVTileLoader<D, Tr::kTileTokens, Tr::kThreads, 0, KVStorage<typename Tr::KV>::kBytes>;
    ItemRows m;
    if (!item_rows<Tr::kRows>(it, group, row0, m)) continue;
    if constexpr (kRowPass != 0) {
      if ((m.rows <= 8) != (kRowPass == 1)) {
        left = true;
        continue;
      }
    }
    // Launched as a programmatic dependent (decode_programmatic_launch), the CTA may run while the kernel before it
    // on the stream is finishing: the plan's metadata above (written only by upload_plan's copy) is read before this
    // wait, and everything the caller gives (the page table, Q, K/V, option tensors) after it, as is every write. A
    // no-op after the first item, and without the launch attribute.
    grid_dependency_wait();
    // Streamed merges: the merge kernel may be scheduled once every CTA is past this wait, so its CTAs are resident
    // when the states land. Not before it: the merge grid of the call before this one may still be folding its
    // states and putting its flags back to zero, and a merge grid let in at this kernel's start (as until session
    // 32) could see those flags and fold the call before's states (CudaStreamMerge.BackToBackCallsMatchTheReference).
    // 16-bit K/V only: the fp8 kernels never stream (CudaBackend::decode_merge), and compiled into them this code
    // cost fp8 64 x 8192 3-5% (their registers moved).
    if constexpr (!kFp8)
      if (p.merge_flags != nullptr) grid_launch_dependents();
    const int64_t page_list = Loader::page_list_of(kv, it);
    // Tile 0's page-table lines head for L1 now, so that their trip runs under the row arithmetic below rather than
    // after it (1 x 32768 timelines: item at 0.8 us, the rows' bounds at 1.6, tile 0's copies out at 2.9). A window
    // or causal rows may start the first tile later; then the prefetch was wasted, not wrong. Measured (H200,
    // perf-notes v20): the split steps level, fp8 64 x 8192 1.1% faster.
    if constexpr (kRowsFirst) Loader::prefetch_first_pages(kv, page_list, it.kv_begin, it.kv_end);
    const int b = m.b, rows = m.rows, qo_start = m.qo_start, qo_len = m.qo_len, kv_len = m.kv_len;
    // 16-bit K/V: where every query token of the item allows all of the item's KV (one token a request and no left
    // window, the usual decode step; or a custom variant, whose mask decides within the item), the CTA's KV range is
    // the item's, known now: tile 0's copies go out right behind Q's, and the rows' fields are found after them. The
    // bounds are monotone in the query position: the item's first token's upper bound and its last token's lower
    // bound decide. Measured (H200, perf-notes v26): head_dim 256 split steps 5% faster, 64 and 128 level.
    // kRowsFirst (fp8, sm_80-89) keeps the order before it (rows, then copies), written out apart below: in the new
    // order the fp8 kernels' registers moved and fp8 64 x 8192 lost 1-2%, and every shared form of the two orders
    // tried moved their code.
    [[maybe_unused]] bool whole = kCustom;
    if constexpr (!kRowsFirst) {
      if constexpr (!kCustom) {
        int lo_first, hi_first, lo_last, hi_last;
        allowed_kv_range(vp, query_position(it.qo_begin, qo_len, kv_len), kv_len, &lo_first, &hi_first);
        allowed_kv_range(vp, query_position(it.qo_end - 1, qo_len, kv_len), kv_len, &lo_last, &hi_last);
        whole = hi_first >= it.kv_end && lo_last <= it.kv_begin;
      }
      if (!whole) Loader::prefetch_first_pages(kv, page_list, it.kv_begin, it.kv_end);
    }

    ATTNFORGE_TL(if (tl_one) tl_pro[0] = cycles() - tl_t;)
    // Q rows -> shared (zeros past `rows`); committed with the first K/V tile (fp8: after the prologue below). Issued
    // before the K/V copies: after them, the 1 x 2048 step (one CTA an SM) lost 0.2-0.5 us as a graph (H200, d2a8d43).
    if constexpr (!kFp8) load_query_rows<D, Tr::kRows, Tr::kThreads>(p, it, qo_start, row0, rows, group, kv_head, sQ);

    // The rows this thread holds in the mma fragments (kThreadRows, row_of): the m16 form, lane / 4 and lane / 4 + 8
    // (the rows are S = Q K^T's M dimension); transposed, 2 (lane % 4) and 2 (lane % 4) + 1 of each n8 tile of rows
    // (S^T = K Q^T's N dimension: see the tile below). kNT: the n8 tiles of rows the transposed form computes
    // (one for the usual decode CTA of 8 rows or fewer, such as a GQA group of 4 or 8 and one query token).
    constexpr int kThreadRows = kTrans ? 4 : 2;
    constexpr int kNT = kRowPass == 1 ? 1 : 2;
    auto row_of = [&](int h) { return kTrans ? 8 * (h / 2) + 2 * (lane % 4) + h % 2 : lane / 4 + 8 * h; };
    // Each row's token, head and position (its fields) and KV bounds [r_lo, r_hi) (empty past `rows`); the bounds'
    // union [range_lo, range_hi) and their intersection [max_lo, min_hi), the KV every valid row allows. Every lane
    // holds some of the 16 rows and lanes 0..31 cover all of them: a warp reduction gives the union.
    int r_tok[kThreadRows], r_head[kThreadRows], r_pos[kThreadRows], r_lo[kThreadRows], r_hi[kThreadRows];
    int range_lo = it.kv_end, range_hi = it.kv_begin;
    int max_lo = it.kv_begin, min_hi = it.kv_end;
    if constexpr (kRowsFirst) {
      for (int h = 0; h < kThreadRows; ++h) {
        const int r = row_of(h);
        const QueryRow q = query_row(it, row0 + r, group, kv_head);
        r_tok[h] = q.tok;
        r_head[h] = q.head;
        r_pos[h] = query_position(q.tok, qo_len, kv_len);
        row_kv_range(vp, it, r, rows, row0 + r, group, qo_len, kv_len, &r_lo[h], &r_hi[h]);
        if constexpr (kCustom) {  // the variant's logits_mask decides within the item's KV
          if (r < rows) r_lo[h] = it.kv_begin, r_hi[h] = it.kv_end;
        }
        if (r < rows) max_lo = max(max_lo, r_lo[h]), min_hi = min(min_hi, r_hi[h]);
        if (r_lo[h] < r_hi[h]) range_lo = min(range_lo, r_lo[h]), range_hi = max(range_hi, r_hi[h]);
        if constexpr (kTrans) {  // lanes 0-3 of a warp hold every row; read after the main loop's first barrier
          if (warp == 0 && lane < 4) {
            s_row_info[0][r] = r_tok[h], s_row_info[1][r] = r_head[h], s_row_info[2][r] = r_pos[h];
            s_row_info[3][r] = r_lo[h], s_row_info[4][r] = r_hi[h];
          }
        }
      }
      for (int o = 16; o > 0; o >>= 1) {  // warp_kv_bounds, as written when fp8 was measured
        range_lo = min(range_lo, __shfl_xor_sync(0xffffffffu, range_lo, o));
        range_hi = max(range_hi, __shfl_xor_sync(0xffffffffu, range_hi, o));
        max_lo = max(max_lo, __shfl_xor_sync(0xffffffffu, max_lo, o));
        min_hi = min(min_hi, __shfl_xor_sync(0xffffffffu, min_hi, o));
      }
    } else if (whole) {
      range_lo = it.kv_begin, range_hi = it.kv_end;
      for (int h = 0; h < kThreadRows; ++h) r_lo[h] = it.kv_begin, r_hi[h] = row_of(h) < rows ? it.kv_end : it.kv_begin;
    } else {
      for (int h = 0; h < kThreadRows; ++h) {
        const int r = row_of(h);
        row_kv_range(vp, it, r, rows, row0 + r, group, qo_len, kv_len, &r_lo[h], &r_hi[h]);  // never custom: whole
        if (r < rows) max_lo = max(max_lo, r_lo[h]), min_hi = min(min_hi, r_hi[h]);
        if (r_lo[h] < r_hi[h]) range_lo = min(range_lo, r_lo[h]), range_hi = max(range_hi, r_hi[h]);
      }
      warp_kv_bounds(range_lo, range_hi, max_lo, min_hi);
    }
    const int num_tiles = range_hi > range_lo ? (range_hi - range_lo + Tr::kTileTokens - 1) / Tr::kTileTokens : 0;

    ATTNFORGE_TL(if (tl_one) tl_pro[1] = cycles() - tl_t;)
    Loader loader(kv, page_list, kv_head, range_lo, range_hi);
    auto load_tile = [&](int t, int s) {
      loader.load(t, sK + s * Tr::kTileBytes, sV + s * Tr::kTileBytes);
    };
    auto fetch_pages = [&](int t) { loader.fetch_pages(t); };
    // The pipeline's first kStages - 1 tiles (a commit group each, empty past the last tile) and the next tile's page
    // ids: now, then the rows' fields; with kRowsFirst after the accumulators' zeros (the order fp8 was measured in).
    // Written out at both places: one lambda called at either kept the 16-bit code but moved the fp8 kernels' code.
    if constexpr (!kRowsFirst) {
      for (int s = 0; s < Tr::kStages - 1; ++s) {
        if (s < num_tiles) {
          fetch_pages(s);
          load_tile(s, s);
        }
        ATTNFORGE_TL(if (tl_one && s == 0) tl_pro[2] = cycles() - tl_t;)
        cp_async_commit();
      }
      if (Tr::kStages - 1 < num_tiles) fetch_pages(Tr::kStages - 1);
      for (int h = 0; h < kThreadRows; ++h) {
        const int r = row_of(h);
        const QueryRow q = query_row(it, row0 + r, group, kv_head);
        r_tok[h] = q.tok;
        r_head[h] = q.head;
        r_pos[h] = query_position(q.tok, qo_len, kv_len);
        if constexpr (kTrans) {  // lanes 0-3 of a warp hold every row; read after the main loop's first barrier
          if (warp == 0 && lane < 4) {
            s_row_info[0][r] = r_tok[h], s_row_info[1][r] = r_head[h], s_row_info[2][r] = r_pos[h];
            s_row_info[3][r] = r_lo[h], s_row_info[4][r] = r_hi[h];
          }
        }
      }
    }

    float o_acc[D / 8][4];
    for (int n = 0; n < D / 8; ++n) o_acc[n][0] = o_acc[n][1] = o_acc[n][2] = o_acc[n][3] = 0.f;
    // Without softmax the running maximum stays 0, so the warps' sums meet unscaled.
    const float m_init = kSoftmax ? -ATTNFORGE_INFINITY : 0.f;
    float m_run[kThreadRows], l_run[kThreadRows];
    for (int h = 0; h < kThreadRows; ++h) m_run[h] = m_init, l_run[h] = 0.f;

    if constexpr (kRowsFirst) {
      for (int s = 0; s < Tr::kStages - 1; ++s) {
        if (s < num_tiles) {
          fetch_pages(s);
          load_tile(s, s);
        }
        ATTNFORGE_TL(if (tl_one && s == 0) tl_pro[2] = cycles() - tl_t;)
        cp_async_commit();
      }
      if (Tr::kStages - 1 < num_tiles) fetch_pages(Tr::kStages - 1);
    }
    ATTNFORGE_TL(if (tl_one) tl_pro[3] = cycles() - tl_t; tl_one = false; tl_lap(0); tl_tiles += num_tiles;)
    // fp8: Q through registers, its global latency behind the K/V copies already in flight; the main loop's first
    // barrier publishes the stores.
    if constexpr (kFp8)
      load_query_rows_permuted<D, Tr::kRows, Tr::kThreads, Elem>(p, it, qo_start, row0, rows, group, kv_head, sQ,
                                                                 s_qscale);
    float q_scale[kThreadRows];  // this thread's rows' (row_of), read once Q is published
    for (int h = 0; h < kThreadRows; ++h) q_scale[h] = 1.f;
    bool q_scaled = false;          // warp-uniform: some row of this warp's has a scale
    const int rope_offset = rope && vp.rope.pos_offset ? vp.rope.pos_offset[b] : 0;
    if constexpr (!kFp8) {
      if (rope) {  // Q rotated in place once it has landed (this drains the prologue's copies: RoPE only)
        cp_async_wait<0>();
        __syncthreads();
        rope_rows<D, Tr::kThreads, Elem>(sQ, Tr::kRows, vp.rope, s_freqs, [&](int r) {
          return r < rows ? query_position(query_row(it, row0 + r, group, kv_head).tok, qo_len, kv_len) + rope_offset
                          : kRopeSkipRow;
        });
      }
    }
    if constexpr (kCustom && !kFp8) {
      if constexpr (OverriddenHooks<V>::kQuery) {  // Q rows in fp32 through the variant, once they have landed
        cp_async_wait<0>();
        __syncthreads();
        transform_rows<D, Tr::kThreads, Elem>(sQ, rows, [&](int r, float* x) {
          const QueryRow q = query_row(it, row0 + r, group, kv_head);
          const LogitIndex li{b, q.tok, query_position(q.tok, qo_len, kv_len), 0, kv_len, q.head, kv_head};
          V::query_transform(va, li, x, D);
          return true;
        });
      }
    }
    for (int t = 0; t < num_tiles; ++t) {
      cp_async_wait<Tr::kStages - 2>();
      __syncthreads();  // tile t has landed for every thread, and every warp is done with tile t - 1
      ATTNFORGE_TL(if (t == 0) {
        tl_lap(1);
        if (tl_first == 0) tl_first = global_ns();
      })
      if constexpr (kQScaled) {
        if (t == 0) {
          bool any = false;
          for (int h = 0; h < kThreadRows; ++h) q_scale[h] = s_qscale[row_of(h)], any = any || q_scale[h] != 1.f;
          q_scaled = __any_sync(0xffffffffu, any);
        }
      }
      const int next = t + Tr::kStages - 1;
      if (next < num_tiles) {
        load_tile(next, next % Tr::kStages);
        if (next + 1 < num_tiles) fetch_pages(next + 1);
      }
      cp_async_commit();
      uint8_t* k_tile = sK + (t % Tr::kStages) * Tr::kTileBytes;
      const uint8_t* v_tile = sV + (t % Tr::kStages) * Tr::kTileBytes;
      if constexpr (!kFp8) {
        if (rope) {  // K of this tile rotated in place; a second barrier before any warp reads it
          const int first = range_lo + t * Tr::kTileTokens;
          rope_rows<D, Tr::kThreads, Elem>(reinterpret_cast<uint16_t*>(k_tile), Tr::kTileTokens, vp.rope, s_freqs,
                                           [&](int r) {
                                             return first + r < range_hi ? first + r + rope_offset : kRopeSkipRow;
                                           });
          __syncthreads();
        }
      }
      if constexpr (kCustom && !kFp8) {
        if constexpr (OverriddenHooks<V>::kKey) {  // K rows of this tile through the variant (query fields: -1)
          const int first = range_lo + t * Tr::kTileTokens;
          transform_rows<D, Tr::kThreads, Elem>(reinterpret_cast<uint16_t*>(k_tile), Tr::kTileTokens,
                                                [&](int r, float* x) {
                                                  if (first + r >= range_hi) return false;
                                                  const LogitIndex li{b, -1, -1, first + r, kv_len, -1, kv_head};
                                                  V::key_transform(va, li, x, D);
                                                  return true;
                                                });
          __syncthreads();
        }
      }
      const int tok0 = warp * 16;  // this warp's 16 tokens of the tile

      // S = Q K^T for 16 rows x 16 tokens.
      float s_acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      if constexpr (kFp8) {
        // S^T = K Q^T: the warp's 16 tokens are the M rows, so the converted K codes are the A operand, and the
        // query rows are N, an n8 tile per 8 rows (s_acc[nt]: tokens lane / 4 and lane / 4 + 8, rows 8 nt +
        // 2 (lane % 4) + {0, 1}). A decode CTA's 4 or 8 rows then take one n8 tile, where an m16 tile of rows
        // spent half its mma, exp2 and softmax work on empty rows. One K ldmatrix covers two 16-dim blocks:
        // matrices (tokens 0-7, block kk), (8-15, kk), (0-7, kk+1), (8-15, kk+1); a register converts to 4
        // consecutive dims of one token, (4q, 4q+1) and (4q+2, 4q+3) with q = lane % 4, which are A's k pairs 2q
        // and 2q + 8 in Q's permuted dims (load_query_rows_permuted). One Q ldmatrix gives an n8 tile's B
        // fragments of the same two blocks.
        for (int kk = 0; kk < D / 16; kk += 2) {
          uint32_t kb[4], qb[2][4];
          ldmatrix_x4(kb, k_tile + swizzle_bytes<Tr::kKVRowBytes>(tok0 + (lane % 8) + 8 * ((lane / 8) % 2),
                                                                  kk + lane / 16));
          for (int nt = 0; nt < 2; ++nt)
            if (nt < kNT) ldmatrix_x4(qb[nt], sQ + swizzle<D>(8 * nt + lane % 8, 2 * kk + lane / 8));
          for (int h = 0; h < 2; ++h) {
            uint32_t lo[2], hi[2];  // tokens 0-7 and 8-15 of block kk + h
            fp8x4_to_pairs<typename Tr::KV>(kb[2 * h], lo, MmaElem{});
            fp8x4_to_pairs<typename Tr::KV>(kb[2 * h + 1], hi, MmaElem{});
            const uint32_t a[4] = {lo[0], hi[0], lo[1], hi[1]};
            for (int nt = 0; nt < 2; ++nt)
              if (nt < kNT) mma_16816(s_acc[nt], a, qb[nt][2 * h], qb[nt][2 * h + 1], MmaElem{});
          }
        }
        if constexpr (kQScaled) {
          if (q_scaled)
            for (int nt = 0; nt < 2; ++nt)
              for (int e = 0; e < 4; ++e) s_acc[nt][e] *= q_scale[2 * nt + e % 2];
        }
      } else if constexpr (kTrans) {
        // 16-bit K/V, S^T = K Q^T: the warp's 16 tokens are M. K's matrices (tokens 0-7, dim chunk c), (8-15, c),
        // (0-7, c + 1), (8-15, c + 1) of 16-dim block kk + h are the A fragment as they land; one Q ldmatrix gives
        // an n8 tile's B fragments of blocks kk and kk + 1 (Q's rows 8 nt .. 8 nt + 7 in their natural dims).
        const uint16_t* k16 = reinterpret_cast<const uint16_t*>(k_tile);
        for (int kk = 0; kk < D / 16; kk += 2) {
          uint32_t qb[2][4];
          for (int nt = 0; nt < 2; ++nt)
            if (nt < kNT) ldmatrix_x4(qb[nt], sQ + swizzle<D>(8 * nt + lane % 8, 2 * kk + lane / 8));
          for (int h = 0; h < 2; ++h) {
            uint32_t a[4];
            ldmatrix_x4(a, k16 + swizzle<D>(tok0 + (lane % 8) + 8 * ((lane / 8) % 2), 2 * (kk + h) + lane / 16));
            for (int nt = 0; nt < 2; ++nt)
              if (nt < kNT) mma_16816(s_acc[nt], a, qb[nt][2 * h], qb[nt][2 * h + 1], Elem{});
          }
        }
      } else {
        const uint16_t* k16 = reinterpret_cast<const uint16_t*>(k_tile);
        for (int kk = 0; kk < D / 16; ++kk) {
          uint32_t a[4], bk[4];
          ldmatrix_x4(a, sQ + swizzle<D>(lane % 16, 2 * kk + lane / 16));
          ldmatrix_x4(bk, k16 + swizzle<D>(tok0 + (lane % 8) + 8 * (lane / 16), 2 * kk + (lane / 8) % 2));
          mma_16816(s_acc[0], a, bk[0], bk[1], Elem{});
          mma_16816(s_acc[1], a, bk[2], bk[3], Elem{});
        }
      }

      // Scale, transform and mask; then the online softmax update per row (kThreadRows rows per thread).
      const int tile_start = range_lo + t * Tr::kTileTokens + tok0;
      float tile_max[kThreadRows];
      for (int h = 0; h < kThreadRows; ++h) tile_max[h] = -ATTNFORGE_INFINITY;
      // Element e of n8 tile nt: its row among this thread's (row_of) and its token in the warp's 16.
      auto elem_row = [&](int nt, int e) { return kTrans ? 2 * nt + e % 2 : e / 2; };
      auto elem_token = [&](int nt, int e) {
        return kTrans ? lane / 4 + 8 * (e / 2) : nt * 8 + 2 * (lane % 4) + e % 2;
      };
      auto live = [&](int nt) { return nt < kNT; };
      // The row's fields (transposed: from shared memory, s_row_info).
      auto row_tok = [&](int h) { return kTrans ? s_row_info[0][row_of(h)] : r_tok[h]; };
      auto row_head = [&](int h) { return kTrans ? s_row_info[1][row_of(h)] : r_head[h]; };
      auto row_pos = [&](int h) { return kTrans ? s_row_info[2][row_of(h)] : r_pos[h]; };
      auto row_lo = [&](int h) { return kTrans ? s_row_info[3][row_of(h)] : r_lo[h]; };
      auto row_hi = [&](int h) { return kTrans ? s_row_info[4][row_of(h)] : r_hi[h]; };
      // Interior tiles (every row allows all 16 tokens, no per-element transform or custom mask) skip the
      // per-element masking; the test is warp-uniform.
      const bool plain =
          !kCustom && !transform && !vp.custom_mask && tile_start >= max_lo && tile_start + 16 <= min_hi;
      // Plain tiles keep raw logits: the scale (positive: run() validates sm_scale and k_scale) commutes with the
      // maximum and folds into the exponent's FMA below; masked tiles hold logits in log2 units already.
      const float s_mul = plain ? scale_log2 : 1.f;
      if (plain) {
        for (int nt = 0; nt < 2; ++nt)
          if (live(nt))
            for (int e = 0; e < 4; ++e) tile_max[elem_row(nt, e)] = fmaxf(tile_max[elem_row(nt, e)], s_acc[nt][e]);
        for (int h = 0; h < kThreadRows; ++h) tile_max[h] *= scale_log2;
      } else {
        for (int nt = 0; nt < 2; ++nt)
          for (int e = 0; e < 4; ++e) {
            if (!live(nt)) continue;
            const int h = elem_row(nt, e);
            const int j = tile_start + elem_token(nt, e);
            float x = s_acc[nt][e];
            bool allowed = j >= row_lo(h) && j < row_hi(h);
            if constexpr (kCustom) {
              if (allowed) {
                const LogitIndex li{b, row_tok(h), row_pos(h), j, kv_len, row_head(h), kv_head};
                allowed = V::logits_mask(va, li);
                if (allowed) x = V::logits_transform(va, li, x * vp.sm_scale * kv.k_scale);
              }
              // Without softmax, p = the transformed logit and a left-out key adds nothing.
              x = kSoftmax ? (allowed ? x * kLog2e : -ATTNFORGE_INFINITY) : (allowed ? x : 0.f);
            } else {
              if (allowed && transform)
                x = transform_logit(vp, x * vp.sm_scale * kv.k_scale, row_head(h), row_pos(h), j) * kLog2e;
              else
                x *= scale_log2;
              if (allowed && vp.custom_mask) allowed = custom_mask_allows(vp, b, row_tok(h), j, kv_len);
              x = allowed ? x : -ATTNFORGE_INFINITY;
            }
            s_acc[nt][e] = x;
            tile_max[h] = fmaxf(tile_max[h], x);
          }
      }
      if constexpr (kSoftmax) {
        // fast_exp2 (one MUFU.EX2; exp2f's subnormal range fix-ups were about 60 instructions of every warp's tile).
        // A row that has seen no allowed key keeps m = -inf and subtracts 0 instead: its logits (-inf) give p = 0,
        // and its correction stays 1 so that rows with no key at all (past `rows` in a masked tile) never ask for
        // the rescale below.
        float corr[kThreadRows], m_sub[kThreadRows];
        for (int h = 0; h < kThreadRows; ++h) {
          if (!live(h / 2)) {  // transposed: rows of an n8 tile not computed (kThreadRows = 4 only there)
            corr[h] = 1.f, m_sub[h] = 0.f;
            continue;
          }
          const float m_new = fmaxf(m_run[h], kTrans ? warp_max_column(tile_max[h]) : warp_max_quad(tile_max[h]));
          m_sub[h] = m_new == -ATTNFORGE_INFINITY ? 0.f : m_new;
          corr[h] = m_new == -ATTNFORGE_INFINITY ? 1.f : fast_exp2(m_run[h] - m_new);
          m_run[h] = m_new;
          l_run[h] *= corr[h];
        }
        for (int nt = 0; nt < 2; ++nt)
          for (int e = 0; e < 4; ++e) {
            if (!live(nt)) continue;
            const int h = elem_row(nt, e);
            const float pr = fast_exp2(fmaf(s_acc[nt][e], s_mul, -m_sub[h]));
            s_acc[nt][e] = pr;
            l_run[h] += pr;
          }
        // Once the running maxima settle, most tiles move none of them: skip the rescale then.
        bool moved = false;
        for (int h = 0; h < kThreadRows; ++h) moved = moved || corr[h] != 1.f;
        if (__any_sync(0xffffffffu, moved)) {
          if constexpr (kTrans) {  // o_acc[2 b + nt]: dims of 16-dim block b, the rows of n8 tile nt (as s_acc's)
            for (int n = 0; n < D / 8; ++n)
              if (live(n % 2))
                for (int e = 0; e < 4; ++e) o_acc[n][e] *= corr[2 * (n % 2) + e % 2];
          } else {
            for (int n = 0; n < D / 8; ++n) {
              o_acc[n][0] *= corr[0], o_acc[n][1] *= corr[0];
              o_acc[n][2] *= corr[1], o_acc[n][3] *= corr[1];
            }
          }
        }
      }

      if constexpr (kTrans) {
        // O^T += V^T P^T: head dims are M, the warp's 16 tokens K, the rows N. P^T's B fragments are s_acc's
        // pairs transposed (movmatrix): tokens 2q, 2q+1 (then 2q+8, 2q+9) of row lane / 4 of the n8 tile.
        uint32_t pb[2][2];
        for (int nt = 0; nt < 2; ++nt)
          if (nt < kNT) {
            pb[nt][0] = movmatrix_trans(pack2(s_acc[nt][0], s_acc[nt][1], MmaElem{}));
            pb[nt][1] = movmatrix_trans(pack2(s_acc[nt][2], s_acc[nt][3], MmaElem{}));
          }
        if constexpr (kFp8) {
          // V's matrices (tokens 0-7, block nd), (8-15, nd), (0-7, nd+1), (8-15, nd+1), transposed: a register
          // holds bytes V[2q][2c], V[2q][2c+1], V[2q+1][2c], V[2q+1][2c+1] (q = lane % 4, c = lane / 4); the
          // permute 0x3120 pairs the tokens of dim 2c and of dim 2c+1, A's rows c and c + 8 when block b's M rows
          // are its dims in the order 0, 2, .., 14, 1, 3, .., 15 (o_acc[2 b + nt]; the finish writes them back in
          // order).
          for (int nd = 0; nd < D / 16; nd += 2) {
            uint32_t vb[4];
            ldmatrix_x4_trans(vb, v_tile + swizzle_bytes<Tr::kKVRowBytes>(tok0 + (lane % 8) + 8 * ((lane / 8) % 2),
                                                                          nd + lane / 16));
            for (int h = 0; h < 2; ++h) {
              uint32_t lo[2], hi[2];  // tokens 2q, 2q+1 and 2q+8, 2q+9: (dim 2c, dim 2c+1)
              fp8x4_to_pairs<typename Tr::KV>(byte_perm(vb[2 * h], 0u, 0x3120u), lo, MmaElem{});
              fp8x4_to_pairs<typename Tr::KV>(byte_perm(vb[2 * h + 1], 0u, 0x3120u), hi, MmaElem{});
              const uint32_t a[4] = {lo[0], lo[1], hi[0], hi[1]};
              for (int nt = 0; nt < 2; ++nt)
                if (nt < kNT) mma_16816(o_acc[2 * (nd + h) + nt], a, pb[nt][0], pb[nt][1], MmaElem{});
            }
          }
        } else {
          // 16-bit K/V: V's matrices (tokens 0-7, dims 16 nd + 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15), each
          // transposed, give A's (dim, token pair) quarters in the order 0, 2, 1, 3; o_acc[2 nd + nt] holds dims
          // 16 nd + lane / 4 (+ 8) of the rows of n8 tile nt.
          const uint16_t* v16 = reinterpret_cast<const uint16_t*>(v_tile);
          for (int nd = 0; nd < D / 16; ++nd) {
            uint32_t vb[4];
            ldmatrix_x4_trans(vb, v16 + swizzle<D>(tok0 + (lane % 8) + 8 * ((lane / 8) % 2), 2 * nd + lane / 16));
            const uint32_t a[4] = {vb[0], vb[2], vb[1], vb[3]};
            for (int nt = 0; nt < 2; ++nt)
              if (nt < kNT) mma_16816(o_acc[2 * nd + nt], a, pb[nt][0], pb[nt][1], Elem{});
          }
        }
      } else {
        // O += P V: the S accumulator layout of two n8 tiles is exactly the A layout of one k16 step.
        uint32_t a_p[4];
        a_p[0] = pack2(s_acc[0][0], s_acc[0][1], MmaElem{});
        a_p[1] = pack2(s_acc[0][2], s_acc[0][3], MmaElem{});
        a_p[2] = pack2(s_acc[1][0], s_acc[1][1], MmaElem{});
        a_p[3] = pack2(s_acc[1][2], s_acc[1][3], MmaElem{});
        const uint16_t* v16 = reinterpret_cast<const uint16_t*>(v_tile);
        for (int nd = 0; nd < D / 16; ++nd) {
          uint32_t bv[4];
          ldmatrix_x4_trans(bv, v16 + swizzle<D>(tok0 + (lane % 8) + 8 * ((lane / 8) % 2), 2 * nd + lane / 16));
          mma_16816(o_acc[2 * nd], a_p, bv[0], bv[1], Elem{});
          mma_16816(o_acc[2 * nd + 1], a_p, bv[2], bv[3], Elem{});
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // all warps are done with the stages: reuse them for the merge
    ATTNFORGE_TL(tl_lap(2);)
    // The merge kernel may be scheduled once every CTA got here (it waits for this grid's end before reading).
    grid_launch_dependents();
    // Merges in this kernel: this CTA learns after its rows whether it merges.
    const bool in_kernel_merge = !kCustom && p.merge_counters != nullptr && it.merge >= 0;

    // Merge the four warps' states. Row sums are per-thread partials until here.
    const DecodeMergeSmem<Tr> ms(sK);
    if constexpr (kTrans) {
      // Rows 2 (lane % 4) + {0, 1} (+ 8): their sums run down the fragment's columns; lanes 0-3 hold every row.
      for (int h = 0; h < kThreadRows; ++h) {
        const float l = warp_sum_column(l_run[h]);
        if (lane < 4) ms.m[warp * Tr::kRows + row_of(h)] = m_run[h], ms.l[warp * Tr::kRows + row_of(h)] = l;
      }
    } else {
      float m_row[2], l_row[2];
      for (int h = 0; h < 2; ++h) {
        m_row[h] = m_run[h];
        l_row[h] = warp_sum_quad(l_run[h]);
      }
      ms.stash_rows(warp, lane / 4, m_row, l_row, lane % 4 == 0);
    }
    __syncthreads();
    ATTNFORGE_TL(tl_lap(3);)
    for (int h = 0; h < kThreadRows; ++h) {
      if constexpr (kTrans) {
        if (h / 2 >= kNT) continue;  // rows 8-15 of a CTA of 8 rows or fewer: never read
      }
      const int r = row_of(h);
      const float f = m_run[h] == -ATTNFORGE_INFINITY ? 0.f : fast_exp2(m_run[h] - ms.row_max(r));
      if constexpr (kTrans) {
        // o_acc[2 b + nt][2 i + h % 2] of row r: dim 16 b + lane / 4 + 8 i, or for fp8 (M rows 0, 2, .., 14, 1, ..,
        // 15) dim 16 b + 2 (lane / 4) + i.
        for (int b = 0; b < D / 16; ++b)
          for (int i = 0; i < 2; ++i) {
            const int dim = kFp8 ? 16 * b + 2 * (lane / 4) + i : 16 * b + lane / 4 + 8 * i;
            *ms.o_at(warp, r, dim) = o_acc[2 * b + h / 2][2 * i + h % 2] * f;
          }
      } else {
        for (int n = 0; n < D / 8; ++n)
          for (int e = 0; e < 2; ++e) *ms.o_at(warp, r, n * 8 + 2 * (lane % 4) + e) = o_acc[n][2 * h + e] * f;
      }
    }
    __syncthreads();
    ATTNFORGE_TL(tl_lap(4);)
    if constexpr (kCustom) {
      finish_rows_variant<Tr, V>(p, va, it, ms, row0, rows, group, kv_head, qo_start, qo_len, kv_len);
    } else {
      finish_rows<Tr>(p, it, ms, row0, rows, group, kv_head, qo_start, kv.v_scale, it.partial_row >= 0);
      // Merges in this kernel (AttentionParams::merge_counters): the last CTA to count its written state combines
      // the states (merge_count_written).
      ATTNFORGE_TL(tl_merge[5] = global_ns();)
      if (in_kernel_merge && merge_count_written<Tr>(p, it, kv_head))
        merge_split_rows<Tr>(p, it, reinterpret_cast<uint8_t*>(smem), row0, rows, group, kv_head,
                             qo_start ATTNFORGE_TL(, tl_merge));
      else if (!kFp8 && p.merge_flags != nullptr && it.merge >= 0)
        publish_state(p, item_index, kv_head);
    }
    ATTNFORGE_TL(tl_lap(5);)

    __syncthreads();  // shared memory is reused by the next item
    ATTNFORGE_TL(tl_lap(6);)
  }
  ATTNFORGE_TL(if (long long* f = timeline_slot(); f && tid == 0 && !(kRowPass == 1 && left)) {
    f[0] = tl_start, f[1] = global_ns();
    for (int i = 0; i < 7; ++i) f[2 + i] = tl_ph[i];
    f[9] = tl_first, f[10] = (sm_id() << 32) | tl_tiles;
    for (int i = 0; i < 4; ++i) f[11 + i] = tl_pro[i];
    f[15] = tl_merge[5];  // the rows (or partial rows) written, before the merge's count
    for (int i = 0; i < 5; ++i) f[16 + i] = tl_merge[i];
  })
  return left;
}

// Every item through decode_body: fp8 and 16-bit head_dim 256 in two row passes (the transposed form for CTAs of 8
// rows or fewer, then, only where the first pass left items, the others); 16-bit head_dim 64 and 128 in one pass of
// the m16 form. Measured (H200, perf-notes v25): the transposed pass made the 16-bit head_dim 256 split steps 3%
// faster and left head_dim 64 and 128 level (bus-bound), where its second pass made decode.cu's nvcc time 4x.
template <class Tr, class V>
__device__ __forceinline__ void decode_items(const AttentionParams& p, const VariantArgs& va) {
  if constexpr (Tr::kFp8 || Tr::kHeadDim == 256) {
    if (decode_body<Tr, V, 1>(p, va)) decode_body<Tr, V, 2>(p, va);
  } else {
    decode_body<Tr, V>(p, va);
  }
}

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, Tr::kMinBlocksPerSM) decode_kernel(const AttentionParams p) {
  decode_items<Tr, BuiltinOptions>(p, VariantArgs{});
}

// A custom variant V's decode kernel (NVRTC only: jit/kernel_key.h renders it with V's source). VariantArgs'
// options point at this launch's built-in options. No register cap: hooks on fp32 rows need room, and the grid
// loops over the items whatever the occupancy.
template <class Tr, class V>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    decode_variant_kernel(const AttentionParams p, const VariantArgs args) {
  VariantArgs a = args;
  a.options = &p.variant;
  decode_items<Tr, V>(p, a);
}

}  // namespace attnforge::cuda
