// Pieces the decode and prefill kernels share: the swizzled shared-memory row layout, the packed query rows of a
// work item (query tokens x the query heads of one KV group), and the K/V tile loader that walks a request's
// pages. Self-contained for NVRTC.
#pragma once

#include "attnforge/kernel/params.h"
#include "attnforge/kernel/variant.h"
#include "backends/cuda/device/ptx.cuh"

namespace attnforge::cuda {

// Rows are kHeadDim 16-bit elements; chunk c of row r lives at chunk c ^ (r & 7). ldmatrix reads 8 rows at one
// logical chunk; the XOR spreads them over 8 different 16-byte bank groups, so the reads are conflict-free.
template <int kHeadDim>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}

// The same layout in bytes, for rows of any element size: 16-byte chunk c of a row of kRowBytes lives at chunk
// c ^ (row & 7) when a row spans whole 128-byte bank lines (16-bit rows; fp8 rows of head_dim 128 and 256). An fp8
// row of head_dim 64 is half a line: two rows share a line, so the XOR takes (row >> 1) & 3 and the 8 rows of an
// ldmatrix land in 2 halves x 4 chunks, again 8 different 16-byte bank groups.
template <int kRowBytes>
__device__ __forceinline__ int swizzle_bytes(int row, int chunk) {
  static_assert(kRowBytes == 64 || kRowBytes % 128 == 0, "rows of 64 bytes or whole 128-byte lines");
  if constexpr (kRowBytes == 64)
    return row * 64 + ((chunk ^ ((row >> 1) & 3)) << 4);
  else
    return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
}

// The wgmma operand layout (device/wgmma.cuh): a tile of kRows rows of 16-bit elements as 64-element panels of
// kRows x 128 bytes, one after another, each in the 128-byte swizzle. Byte offset of 16-byte chunk c of row r. At
// head_dim 64 (one panel) it is swizzle_bytes<128>.
template <int kRows>
__device__ __forceinline__ int panel_bytes(int row, int chunk) {
  return (chunk >> 3) * (kRows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

// ldmatrix addresses into swizzled rows, kept to four registers per operand. A lane reads row r (r & 7 fixed for
// the whole loop, other rows differ by multiples of 8) at logical chunk 2k + sub. Since the XOR only touches
// the low three bits, that chunk sits at base[k % 4] + 64 (k / 4) elements, and row + 8 i adds 8 i kHeadDim:
// with k and i unrolled, every address is a base register plus an immediate. (Left to itself, the compiler
// kept one register per unrolled (row, chunk) pair and spilled.)
template <int kHeadDim>
struct SwizzledLane {
  int base[4];
  __device__ __forceinline__ SwizzledLane(int row, int sub) {
#pragma unroll
    for (int c = 0; c < 4; ++c) base[c] = row * kHeadDim + (((2 * c + sub) ^ (row & 7)) << 3);
  }
  __device__ __forceinline__ int at(int k) const { return base[k & 3] + ((k >> 2) << 6); }
};

// RoPE inside attention (kernel/variant.h semantics, as the CPU backend applies it): rotary frequencies once per
// CTA into shared memory, then rows of a swizzled 16-bit tile rotated in place. Each thread takes (row, pair)
// elements; the pair is rotated in fp32 and rounded back to the element type, the precision the tensor cores
// read. pos_of(row) gives a row's position (negative for queries before the first key when qo_len > kv_len), or
// kRopeSkipRow for rows to leave alone (padding). sincosf, not
// __sincosf: positions reach 10^5-10^6 radians, where the fast version's error is large.
constexpr int kRopeSkipRow = -0x7fffffff - 1;

template <int kThreads>
__device__ __forceinline__ void rope_frequencies(const RopeParams& r, float* freqs) {
  for (int p = threadIdx.x; p < r.rotary_dim / 2; p += kThreads) freqs[p] = rope_frequency(r, p);
}

template <int D, int kThreads, typename Elem, typename PosOf>
__device__ __forceinline__ void rope_rows(uint16_t* tile, int num_rows, const RopeParams& r, const float* freqs,
                                          PosOf pos_of) {
  const int half = r.rotary_dim / 2;
  for (int i = threadIdx.x; i < num_rows * half; i += kThreads) {
    const int row = i / half, pair = i % half;
    const int pos = pos_of(row);
    if (pos == kRopeSkipRow) continue;
    int a, b;
    rope_pair(r, pair, &a, &b);
    float s, c;
    sincosf(static_cast<float>(pos) * r.rcp_scale * freqs[pair], &s, &c);
    uint16_t* pa = tile + swizzle<D>(row, a >> 3) + (a & 7);
    uint16_t* pb = tile + swizzle<D>(row, b >> 3) + (b & 7);
    const float xa = elem_to_float(*pa, Elem{}), xb = elem_to_float(*pb, Elem{});
    *pa = float_to_elem(xa * c - xb * s, Elem{});
    *pb = float_to_elem(xb * c + xa * s, Elem{});
  }
}

// A custom variant's row hook (query or key transform) on rows of a swizzled 16-bit tile: one thread per row,
// the row in fp32 in local memory, rounded back to the element type. hook(row, x) does nothing for rows it skips.
template <int D, int kThreads, typename Elem, typename Hook>
__device__ __forceinline__ void transform_rows(uint16_t* tile, int num_rows, Hook hook) {
  for (int row = threadIdx.x; row < num_rows; row += kThreads) {
    float x[D];
    for (int d = 0; d < D; ++d) x[d] = elem_to_float(tile[swizzle<D>(row, d >> 3) + (d & 7)], Elem{});
    if (!hook(row, x)) continue;
    for (int d = 0; d < D; ++d) tile[swizzle<D>(row, d >> 3) + (d & 7)] = float_to_elem(x[d], Elem{});
  }
}

// Packed query row rr of a work item: rows run over the item's query tokens, and within a token over the
// query heads of KV head `kv_head`'s group, so every K/V element loaded serves all of them.
struct QueryRow {
  int32_t tok;   // token index within the request
  int32_t head;  // query head
};
__device__ __forceinline__ QueryRow query_row(const WorkItem& it, int rr, int group, int kv_head) {
  return {it.qo_begin + rr / group, kv_head * group + rr % group};
}

// A CTA's share of a work item: its packed rows (row0 .. row0 + rows - 1, at most kRows), the request's first
// query token in Q and O, and its query and KV lengths (the item's copy of the request's: no memory trip). False
// when the item has no row from row0 on.
struct ItemRows {
  int b, rows, qo_start, qo_len, kv_len;
};
template <int kRows>
__device__ __forceinline__ bool item_rows(const WorkItem& it, int group, int row0, ItemRows& m) {
  const int rows_total = (it.qo_end - it.qo_begin) * group;
  if (row0 >= rows_total) return false;
  m.b = it.request;
  m.rows = min(kRows, rows_total - row0);
  m.qo_start = it.qo_start;
  m.qo_len = it.qo_len;
  m.kv_len = it.kv_len;
  return true;
}

// Copies kRows packed query rows starting at row0 into swizzled shared memory with cp.async (zeros past `rows`):
// swizzle<D> rows, or wgmma panels (panel_bytes) with kPanels. The caller commits the group. Threads kFirstThread
// .. kFirstThread + kThreads - 1 copy. Panels hold kPanelRows rows (sQ may point at a later row that is a multiple
// of 8: the pipelined Hopper kernel's warpgroups copy their own halves).
template <int D, int kRows, int kThreads, bool kPanels = false, int kFirstThread = 0, int kPanelRows = kRows>
__device__ __forceinline__ void load_query_rows(const AttentionParams& p, const WorkItem& it, int qo_start, int row0,
                                                int rows, int group, int kv_head, uint16_t* sQ) {
  constexpr int kChunks = D / 8;
  for (int i = static_cast<int>(threadIdx.x) - kFirstThread; i < kRows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const QueryRow q = query_row(it, row0 + min(r, rows - 1), group, kv_head);
    const uint16_t* src =
        static_cast<const uint16_t*>(p.q) + (qo_start + q.tok) * p.q_stride_token + q.head * p.q_stride_head + c * 8;
    uint16_t* dst = kPanels ? sQ + panel_bytes<kPanelRows>(r, c) / 2 : sQ + swizzle<D>(r, c);
    cp_async_16(dst, src, r < rows ? 16 : 0);
  }
}

// load_query_rows for kernels that read fp8 K with ldmatrix (decode_kernel.cuh): an 8x8 b16 ldmatrix of fp8 rows
// hands each thread 4 consecutive head-dim values d..d+3 of a 16-wide block, which the B fragment takes as the
// k slots (2q, 2q+1) and (2q+8, 2q+9). Q's head dims are permuted to match within every 16-wide block, so
// the dot product is unchanged: slot pair p (slots 2p, 2p+1) holds dim pair (2p, 2p+1) of [0, 2, 4, 6, 1, 3, 5, 7],
// i.e. the even dim pairs, then the odd ones. Loaded through registers (16-byte loads; the permutation moves
// whole 4-byte pairs across the two 16-byte chunks of a block), zeros past `rows`; the stores are complete
// before the caller's next barrier.
// The fp8 kernels multiply in fp16 whatever Q's type (fp8 codes widen to fp16 in one instruction a pair; to bf16
// they took four), so bf16 Q rows are stored as fp16: each row is scaled by 2^-s, s >= 0 the least power that
// brings the row's largest |q| under 2^15 (s = 0 for any row under 32768, the usual case), which is exact for every
// element fp16 holds at full precision; row_scale[r] gets 2^s for the logits. fp16 Q is stored as it is (scale 1).
struct alignas(16) Words4 {
  uint32_t x, y, z, w;
};
template <typename T>
struct IsBf16 {
  static constexpr bool value = false;
};
template <>
struct IsBf16<Bf16> {
  static constexpr bool value = true;
};
template <int D, int kRows, int kThreads, typename Elem>
__device__ __forceinline__ void load_query_rows_permuted(const AttentionParams& p, const WorkItem& it, int qo_start,
                                                         int row0, int rows, int group, int kv_head, uint16_t* sQ,
                                                         float* row_scale) {
  constexpr int kBlocks = D / 16;
  static_assert(32 % kBlocks == 0 && (kRows * kBlocks) % 32 == 0, "a row's blocks are whole lane groups of a warp");
  for (int i = threadIdx.x; i < kRows * kBlocks; i += kThreads) {
    const int r = i / kBlocks, j = i % kBlocks;
    Words4 lo = {0u, 0u, 0u, 0u}, hi = {0u, 0u, 0u, 0u};  // dim pairs 0-3 and 4-7 of block j
    if (r < rows) {
      const QueryRow q = query_row(it, row0 + r, group, kv_head);
      const auto* src = reinterpret_cast<const Words4*>(static_cast<const uint16_t*>(p.q) +
                                                        (qo_start + q.tok) * p.q_stride_token +
                                                        q.head * p.q_stride_head + j * 16);
      lo = src[0];
      hi = src[1];
    }
    if constexpr (IsBf16<Elem>::value) {
      uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      uint32_t m = 0;  // the largest magnitude's bits: bf16 magnitudes order as their bits do
#pragma unroll
      for (int k = 0; k < 8; ++k) m = max(m, max(w[k] & 0x7fffu, (w[k] >> 16) & 0x7fffu));
      for (int o = 1; o < kBlocks; o <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
      const int e = static_cast<int>(m >> 7) - 127;  // exponent of the row's largest |q| (inf, NaN: 128)
      const int s = e > 14 ? e - 14 : 0;
      const float down = __int_as_float((127 - s) << 23);  // 2^-s, exact
#pragma unroll
      for (int k = 0; k < 8; ++k)
        w[k] = pack2(__uint_as_float(w[k] << 16) * down, __uint_as_float(w[k] & 0xffff0000u) * down, F16{});
      lo = Words4{w[0], w[1], w[2], w[3]};
      hi = Words4{w[4], w[5], w[6], w[7]};
      if (j == 0) row_scale[r] = __int_as_float((127 + s) << 23);  // 2^s
    } else {
      if (j == 0) row_scale[r] = 1.f;
    }
    *reinterpret_cast<Words4*>(sQ + swizzle<D>(r, 2 * j)) = Words4{lo.x, lo.z, hi.x, hi.z};
    *reinterpret_cast<Words4*>(sQ + swizzle<D>(r, 2 * j + 1)) = Words4{lo.y, lo.w, hi.y, hi.w};
  }
}

// The KV positions a packed row may attend within the item: [*lo, *hi), empty for rows past `rows`.
__device__ __forceinline__ void row_kv_range(const VariantParams& vp, const WorkItem& it, int r, int rows, int rr,
                                             int group, int qo_len, int kv_len, int* lo, int* hi) {
  allowed_kv_range(vp, query_position(it.qo_begin + rr / group, qo_len, kv_len), kv_len, lo, hi);
  *lo = max(*lo, it.kv_begin);
  *hi = max(*lo, min(*hi, it.kv_end));
  if (r >= rows) *hi = *lo;
}

// Over the lanes of a warp: the union [lo, hi) of the rows' KV ranges and their intersection [max_lo, min_hi).
__device__ __forceinline__ void warp_kv_bounds(int& lo, int& hi, int& max_lo, int& min_hi) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    max_lo = max(max_lo, __shfl_xor_sync(0xffffffffu, max_lo, o));
    min_hi = min(min_hi, __shfl_xor_sync(0xffffffffu, min_hi, o));
  }
}

// A logit x = q.k of the built-in options at key j, in log2 units: soft-cap and ALiBi when `transform`, the
// custom mask; -inf where the key is not allowed.
__device__ __forceinline__ float builtin_logit(const VariantParams& vp, const KVParams& kv, float x, bool allowed,
                                               bool transform, float scale_log2, int request, int q_tok, int q_head,
                                               int q_pos, int j, int kv_len) {
  if (allowed && transform)
    x = transform_logit(vp, x * vp.sm_scale * kv.k_scale, q_head, q_pos, j) * kLog2e;
  else
    x *= scale_log2;
  if (allowed && vp.custom_mask) allowed = custom_mask_allows(vp, request, q_tok, j, kv_len);
  return allowed ? x : -ATTNFORGE_INFINITY;
}

// Streams K/V tiles of kTileTokens tokens of one request and KV head, starting at token `first` and ending
// before `last`, into swizzled shared memory (swizzle_bytes) with cp.async. Elements are kElemBytes wide (2, or 1
// for fp8 K/V, copied as raw codes). Each thread copies kLoadRows rows of one 16-byte chunk column. Page lookups
// are the only dependent global loads of the stream: fetch_pages(t) loads the page
// ids of tile t into registers, one tile before load(t) issues the copies, so their latency hides behind the
// compute of a tile. Tokens past `last` are zero-filled and never read.
// kPageSlots = 0 keeps the fetched ids in registers (kLoadRows per thread); kPageSlots = S > 0 keeps them in a
// shared array of S x kTileTokens ints (`slots`), one id fetched per token, which frees those registers for
// kernels that need them. With shared slots, a barrier must separate fetch_pages(t) from load(t) (the main
// loop's barrier does; the prologue needs one), and S must be the number of pipeline stages.
// kPanels: 16-bit rows land in wgmma panels (panel_bytes<kTileTokens>) instead of swizzled rows.
template <int D, int kTileTokens, int kThreads, int kPageSlots = 0, int kElemBytes = 2, bool kPanels = false>
struct KVTileLoader {
  static constexpr int kRowBytes = D * kElemBytes;
  static constexpr int kChunks = kRowBytes / 16;
  static constexpr int kRowGroups = kThreads / kChunks;
  static constexpr int kLoadRows = kTileTokens / kRowGroups;
  static_assert(kThreads % kChunks == 0 && kTileTokens % kRowGroups == 0, "tile copy must divide evenly");

  const KVParams& kv;
  int64_t page_list;
  int first, last, kv_head, page_shift;
  bool page_pow2;
  int32_t pages[kPageSlots > 0 ? 1 : kLoadRows];  // page ids (ragged: packed rows) of the rows copied next
  int32_t* slots;                                   // shared page-id slots (kPageSlots > 0)

  // Where a request's page ids (ragged: rows) start in kv.page_ids: a load for CSR tables, which a kernel may issue
  // early (the constructor below that takes it) so that it shares a memory trip with the request's other offsets.
  static __device__ __forceinline__ int64_t page_list_of(const KVParams& kv, int request) {
    return kv.format == KVFormat::kBlockTable ? static_cast<int64_t>(request) * kv.page_list_stride
                                              : static_cast<int64_t>(kv.page_list_indptr[request]);
  }
  // The same from the item's copy of the request's context (WorkItem::page_list): no memory trip.
  static __device__ __forceinline__ int64_t page_list_of(const KVParams& kv, const WorkItem& it) {
    return kv.format == KVFormat::kBlockTable ? static_cast<int64_t>(it.request) * kv.page_list_stride
                                              : static_cast<int64_t>(it.page_list);
  }
  __device__ __forceinline__ KVTileLoader(const KVParams& kv_, int request, int kv_head_, int first_, int last_,
                                          int32_t* slots_ = nullptr)
      : KVTileLoader(kv_, page_list_of(kv_, request), kv_head_, first_, last_, slots_) {}
  __device__ __forceinline__ KVTileLoader(const KVParams& kv_, int64_t page_list_, int kv_head_, int first_, int last_,
                                          int32_t* slots_ = nullptr)
      : kv(kv_), page_list(page_list_), first(first_), last(last_), kv_head(kv_head_), slots(slots_) {
    // Page sizes are almost always powers of two; shifts then replace two integer divisions per row and tile.
    page_pow2 = (kv.page_size & (kv.page_size - 1)) == 0;
    page_shift = __ffs(kv.page_size) - 1;
  }
  __device__ __forceinline__ int row(int k) const { return threadIdx.x / kChunks + k * kRowGroups; }

  __device__ __forceinline__ int32_t page_of(int token) const {
    const int index = page_pow2 ? token >> page_shift : token / kv.page_size;
    return kv.format == KVFormat::kRagged ? static_cast<int32_t>(page_list + token) : kv.page_ids[page_list + index];
  }
  // Prefetches into L1 the page-table lines of tile 0 of tokens [first_, last_) of a paged request (threads 0, 1 and
  // 2: its first, middle and last token's ids, which cover every line of the tile at page sizes from 1 up), before
  // the loader is made: fetch_pages(0) then finds them in L1. No registers stay live.
  static __device__ __forceinline__ void prefetch_first_pages(const KVParams& kv, int64_t page_list, int first_,
                                                              int last_) {
    if (kv.format == KVFormat::kRagged || threadIdx.x >= 3 || last_ <= first_) return;
    const int token =
        min(first_ + static_cast<int>(threadIdx.x) * (kTileTokens / 2), min(first_ + kTileTokens, last_) - 1);
    prefetch_l1(kv.page_ids + page_list + token / kv.page_size);
  }
  // The token's slot in its page (ragged: 0, page_of gives its packed row).
  __device__ __forceinline__ int32_t slot_of(int token) const {
    return kv.format == KVFormat::kRagged ? 0 : (page_pow2 ? token & (kv.page_size - 1) : token % kv.page_size);
  }

  __device__ __forceinline__ void fetch_pages(int t) {
    if constexpr (kPageSlots > 0) {
      for (int i = threadIdx.x; i < kTileTokens; i += kThreads)
        slots[(t % kPageSlots) * kTileTokens + i] = page_of(min(first + t * kTileTokens + i, last - 1));
    } else {
      #pragma unroll
      for (int k = 0; k < kLoadRows; ++k) pages[k] = page_of(min(first + t * kTileTokens + row(k), last - 1));
    }
  }

  // Copies tile t of K and V into sK / sV (one stage each) from the pages fetched for it.
  // Register-held page ids (the decode kernel): the thread's chunk of the KV head is found once per tile and a row's
  // address is two unsigned 32 x 32 -> 64-bit multiply-adds on byte strides (run() takes K/V page and token strides
  // from 0 to 2 GiB - 1 bytes), one IMAD.WIDE.U32 each; the 64-bit stride products per row were about 60
  // instructions of every row's copy (sm_90a SASS, 3354b9e).
  // Shared slots (the prefill kernel) keep the 64-bit products (on the same per-tile base): there the narrow form
  // raised ptxas's spills at head_dim 128 from 36 to 60 bytes.
  __device__ __forceinline__ void load(int t, void* sK, void* sV) const {
    const int chunk = threadIdx.x % kChunks;
    const uint8_t* k_base = static_cast<const uint8_t*>(kv.k) + kv_head * kv.k_stride_head * kElemBytes + chunk * 16;
    const uint8_t* v_base = static_cast<const uint8_t*>(kv.v) + kv_head * kv.v_stride_head * kElemBytes + chunk * 16;
    const uint32_t k_page_bytes = static_cast<uint32_t>(kv.k_stride_page * kElemBytes);
    const uint32_t k_token_bytes = static_cast<uint32_t>(kv.k_stride_token * kElemBytes);
    const uint32_t v_page_bytes = static_cast<uint32_t>(kv.v_stride_page * kElemBytes);
    const uint32_t v_token_bytes = static_cast<uint32_t>(kv.v_stride_token * kElemBytes);
    // Rows r0 + i kRowGroups (r0 < kRowGroups) of a power-of-two kRowGroups have swizzle rows (r0 + i kRowGroups) & 7
    // = r0 ^ ((i kRowGroups) & 7): the first row's destination with its chunk field XORed by a constant. Every
    // 16-bit and fp8 decode loader has such rows (kRowGroups 4 at head_dim 256, 8 or more elsewhere).
    constexpr bool kRowsBySwizzleConstant =
        kRowGroups % 8 == 0 || (kRowBytes % 128 == 0 && (kRowGroups & (kRowGroups - 1)) == 0);
    if constexpr (kPageSlots == 0 && !kPanels && kRowsBySwizzleConstant) {
      // A whole tile of a paged cache with power-of-two pages (the common case; the decode kernel's every tile but
      // an item's last): no row is past `last`, a row's slot is a mask, and a row's destination is the first one's
      // plus an immediate (rows 8 or more apart keep r0's swizzle; at head_dim 256, 4 apart, every other row XORs
      // the chunk field with 4). A row costs its slot, two multiply-adds a copy and the copies: about 17
      // instructions (sm_90a SASS), where the general path below took about 35 (validity, the slot's modulo branch,
      // the invalid row's fallback address). Where K and V have the same strides (the usual cache), V's address is
      // K's plus the distance between the two bases. (Until session 38 head_dim 256 took the general path: half of
      // its tile loop's instructions, by ncu's counts on an H100.)
      if (first + (t + 1) * kTileTokens <= last && page_pow2 && kv.format != KVFormat::kRagged) {
        const int r0 = static_cast<int>(threadIdx.x) / kChunks;
        const int dst0 = swizzle_bytes<kRowBytes>(r0, chunk);
        const uint32_t token0 = static_cast<uint32_t>(first + t * kTileTokens + r0);
        const uint32_t slot_mask = static_cast<uint32_t>(kv.page_size - 1);
        const bool same = k_page_bytes == v_page_bytes && k_token_bytes == v_token_bytes;  // K and V alike
        const int64_t v_minus_k = v_base - k_base;
        #pragma unroll
        for (int k = 0; k < kLoadRows; ++k) {
          const uint32_t slot = (token0 + k * kRowGroups) & slot_mask, page = static_cast<uint32_t>(pages[k]);
          const uint8_t* ksrc =
              k_base + (static_cast<uint64_t>(page) * k_page_bytes + static_cast<uint64_t>(slot) * k_token_bytes);
          const uint8_t* vsrc =
              same ? ksrc + v_minus_k
                   : v_base + (static_cast<uint64_t>(page) * v_page_bytes + static_cast<uint64_t>(slot) * v_token_bytes);
          const int flip = ((k * kRowGroups) & 7) << 4;  // a constant once unrolled; 0 for rows 8 apart
          const int dst = (dst0 ^ flip) + k * kRowGroups * kRowBytes;
          cp_async_16(static_cast<uint8_t*>(sK) + dst, ksrc, 16);
          cp_async_16(static_cast<uint8_t*>(sV) + dst, vsrc, 16);
        }
        return;
      }
    }
    #pragma unroll
    for (int k = 0; k < kLoadRows; ++k) {
      const int r = row(k);
      const int token = first + t * kTileTokens + r;
      const bool valid = token < last;
      const int32_t slot = slot_of(token);
      const uint8_t* ksrc = static_cast<const uint8_t*>(kv.k);  // an invalid row copies nothing from a valid address
      const uint8_t* vsrc = static_cast<const uint8_t*>(kv.v);
      if (valid) {
        const int32_t page = kPageSlots > 0 ? slots[(t % kPageSlots) * kTileTokens + r] : pages[k];
        if constexpr (kPageSlots == 0) {
          const uint32_t page_u = static_cast<uint32_t>(page), slot_u = static_cast<uint32_t>(slot);  // both >= 0
          ksrc = k_base +
                 (static_cast<uint64_t>(page_u) * k_page_bytes + static_cast<uint64_t>(slot_u) * k_token_bytes);
          vsrc = v_base +
                 (static_cast<uint64_t>(page_u) * v_page_bytes + static_cast<uint64_t>(slot_u) * v_token_bytes);
        } else {
          const int64_t page64 = page, slot64 = slot;
          ksrc = k_base + (page64 * kv.k_stride_page + slot64 * kv.k_stride_token) * kElemBytes;
          vsrc = v_base + (page64 * kv.v_stride_page + slot64 * kv.v_stride_token) * kElemBytes;
        }
      }
      const int dst = kPanels ? panel_bytes<kTileTokens>(r, chunk) : swizzle_bytes<kRowBytes>(r, chunk);
      cp_async_16(static_cast<uint8_t*>(sK) + dst, ksrc, valid ? 16 : 0);
      cp_async_16(static_cast<uint8_t*>(sV) + dst, vsrc, valid ? 16 : 0);
    }
  }
  // The copying warpgroup of prefill_wgmma_ws_body (a token a thread, few registers). fetch_offsets(t) finds the
  // byte offsets of tile t's rows once per token (K and V: KV head, page and slot through this layout's strides)
  // into shared slot t % kPageSlots, where load() has each of a row's chunk threads redo that arithmetic;
  // load_offsets(t) then costs a row one 16-byte shared load, two adds and its two copies. Tokens past `last` keep
  // the last token's offsets (a valid address) and are zero-filled. A barrier among the copying threads separates
  // the two, as with fetch_pages.
  __device__ __forceinline__ void fetch_offsets(int t, longlong2* offsets) const {
    static_assert(kThreads >= kTileTokens && kPageSlots > 0, "a token a thread at most, kPageSlots shared slots");
    if (kThreads > kTileTokens && threadIdx.x >= kTileTokens) return;
    const int token = min(first + t * kTileTokens + static_cast<int>(threadIdx.x), last - 1);
    const int64_t page = page_of(token), slot = slot_of(token);
    offsets[(t % kPageSlots) * kTileTokens + threadIdx.x] =
        make_longlong2((kv_head * kv.k_stride_head + page * kv.k_stride_page + slot * kv.k_stride_token) * kElemBytes,
                       (kv_head * kv.v_stride_head + page * kv.v_stride_page + slot * kv.v_stride_token) * kElemBytes);
  }
  // kK / kV: copy K's rows, V's, or both (the overlapped form's K and V stages have barriers of their own).
  template <bool kK = true, bool kV = true>
  __device__ __forceinline__ void load_offsets(int t, void* sK, void* sV, const longlong2* offsets) const {
    const int chunk = threadIdx.x % kChunks;
    const uint8_t* k = static_cast<const uint8_t*>(kv.k) + chunk * 16;
    const uint8_t* v = static_cast<const uint8_t*>(kv.v) + chunk * 16;
    const longlong2* tile = offsets + (t % kPageSlots) * kTileTokens;
    const int valid_rows = last - first - t * kTileTokens;
    if constexpr (kPanels && kRowGroups % 8 == 0) {
      // This thread's rows r0 + i kRowGroups share r0 % 8, so in the panels a row's destination is the first one's
      // plus 128 i kRowGroups bytes (an immediate once unrolled), and its offsets slot the first one's plus
      // i kRowGroups: a row costs a shared load, a 64-bit add and its copies. (At the copier's 24 registers ptxas
      // otherwise rebuilt the swizzle from threadIdx for every row.)
      const int r0 = threadIdx.x / kChunks;
      const longlong2* slot = tile + r0;
      const int dst0 = panel_bytes<kTileTokens>(r0, chunk), valid = valid_rows - r0;
      uint8_t* dk = static_cast<uint8_t*>(sK) + dst0;
      uint8_t* dv = static_cast<uint8_t*>(sV) + dst0;
      #pragma unroll 4
      for (int i = 0; i < kLoadRows; ++i) {
        const longlong2 o = slot[i * kRowGroups];
        const int bytes = i * kRowGroups < valid ? 16 : 0;
        if constexpr (kK) cp_async_16(dk + i * kRowGroups * 128, k + o.x, bytes);
        if constexpr (kV) cp_async_16(dv + i * kRowGroups * 128, v + o.y, bytes);
      }
    } else {
      #pragma unroll 4
      for (int i = 0; i < kLoadRows; ++i) {
        const int r = row(i);
        const longlong2 o = tile[r];
        const int dst = kPanels ? panel_bytes<kTileTokens>(r, chunk) : swizzle_bytes<kRowBytes>(r, chunk);
        if constexpr (kK) cp_async_16(static_cast<uint8_t*>(sK) + dst, k + o.x, r < valid_rows ? 16 : 0);
        if constexpr (kV) cp_async_16(static_cast<uint8_t*>(sV) + dst, v + o.y, r < valid_rows ? 16 : 0);
      }
    }
  }
};

}  // namespace attnforge::cuda
