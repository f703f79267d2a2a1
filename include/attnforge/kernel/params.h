// The plain parameter structs every backend consumes (CPU, nvcc-compiled CUDA, NVRTC-compiled CUDA).
// They are built once from the user-facing arguments (src/core/params.cc) and hold only pointers, sizes and
// strides in elements. NVRTC-clean.
#pragma once

#include "attnforge/kernel/types.h"

namespace attnforge {

// KV cache addressing. All strides are in elements; the head_dim axis is contiguous (stride 1).
struct KVParams {
  const void* k;  // element (page 0, token 0, head 0, dim 0) of K
  const void* v;  // same for V; K and V have their own strides (combined [pages, 2, ...] caches work)
  DType dtype;
  KVFormat format;
  int32_t page_size;  // 1 for ragged KV
  int32_t num_kv_heads;
  int64_t k_stride_page, k_stride_token, k_stride_head;
  int64_t v_stride_page, v_stride_token, v_stride_head;
  const int32_t* page_ids;          // CSR: [nnz_pages]; block table: [batch, page_list_stride]; ragged: null
  const int32_t* page_list_indptr;  // CSR: [batch + 1] into page_ids; ragged: [batch + 1] token offsets; table: null
  int64_t page_list_stride;         // block table: row stride of the table; otherwise 0
  float k_scale;                    // K is multiplied by this after loading (fp8 scales; 1 otherwise)
  float v_scale;
  int64_t num_pages;                // pages in K and V (ragged: rows): the extent of tensor maps over them
};

// CUtensorMap's storage for code that sees no cuda.h (NVRTC, device headers): 128 opaque bytes, encoded on the
// host (backends/cuda/tma.h) and read by the CUDA tensor memory accelerator (backends/cuda/device/tma.cuh), which
// needs it 64-byte aligned in the kernel's parameters.
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

// Index of the page (or packed row, for ragged KV) that holds token t of request b.
ATTNFORGE_HOST_DEVICE int64_t kv_page_of(const KVParams& p, int32_t b, int32_t t) {
  if (p.format == KVFormat::kRagged) return static_cast<int64_t>(p.page_list_indptr[b]) + t;
  const int64_t list = p.format == KVFormat::kPagedCSR ? static_cast<int64_t>(p.page_list_indptr[b])
                                                       : static_cast<int64_t>(b) * p.page_list_stride;
  return p.page_ids[list + t / p.page_size];
}

// Element offsets of (request b, token t, kv head h, dim 0) in K and V.
ATTNFORGE_HOST_DEVICE int64_t kv_k_offset(const KVParams& p, int32_t b, int32_t t, int32_t h) {
  const int64_t page = kv_page_of(p, b, t);
  const int32_t slot = p.format == KVFormat::kRagged ? 0 : t % p.page_size;
  return page * p.k_stride_page + static_cast<int64_t>(slot) * p.k_stride_token + h * p.k_stride_head;
}
ATTNFORGE_HOST_DEVICE int64_t kv_v_offset(const KVParams& p, int32_t b, int32_t t, int32_t h) {
  const int64_t page = kv_page_of(p, b, t);
  const int32_t slot = p.format == KVFormat::kRagged ? 0 : t % p.page_size;
  return page * p.v_stride_page + static_cast<int64_t>(slot) * p.v_stride_token + h * p.v_stride_head;
}

// Rotary position embedding applied inside attention (to Q and K) or by apply_rope.
struct RopeParams {
  int32_t enabled;        // 0: no RoPE
  int32_t rotary_dim;     // leading dims rotated; the rest pass through
  int32_t interleave;     // 0: rotate halves (Llama/NeoX, x[i] with x[i + rotary_dim/2]); 1: pairs (2i, 2i+1)
  float theta;            // base of the frequencies, 1e4 for Llama 2, 5e5 for Llama 3
  float rcp_scale;        // positions are multiplied by this (1 / linear scale)
  // Llama 3.1 frequency scaling; active when llama31_factor > 0.
  float llama31_factor, llama31_low_freq_factor, llama31_high_freq_factor, llama31_old_context_len;
  const int32_t* pos_offset;  // [batch] added to every position of the request, or null
};

// Per-run (per-layer) options, turned into numbers and pointers. Order in which they act on a logit:
//   s = sm_scale * k_scale * dot(rope(q), rope(k));  s = soft_cap * tanh(s / soft_cap) if soft_cap > 0;
//   s += alibi_slope[h] * (kv_pos - q_pos);  s = -inf where causal, window or custom mask forbids.
// Softmax then runs over the allowed s plus, when sinks is set, one extra logit sinks[h] with a zero value.
struct VariantParams {
  float sm_scale;
  int32_t causal;
  int32_t window_left;   // kv_pos >= q_pos - window_left; -1: unbounded
  int32_t window_right;  // kv_pos <= q_pos + window_right; -1: unbounded (causal implies 0)
  float soft_cap;        // 0: off
  const float* alibi_slopes;  // [num_qo_heads] or null
  const float* sinks;         // [num_qo_heads] natural-log sink logits, or null
  const uint8_t* custom_mask;       // bit-packed rows of each request's [qo_len, kv_len] mask, little bit order
  const int32_t* mask_byte_indptr;  // [batch + 1]: request b's mask starts at byte mask_byte_indptr[b]
  RopeParams rope;
};

// One unit of planned work: rows [qo_begin, qo_end) of request `request` (token indices within the request)
// against KV positions [kv_begin, kv_end), for every head. partial_row < 0 writes the final output; otherwise
// the attention state goes to rows partial_row .. partial_row + (qo_end - qo_begin) of the partial buffers and
// a MergeItem combines it.
// The request's context rides along, copied from the batch metadata plan() was given: its first query token in Q
// and O (qo_indptr[request]), its query and KV lengths, and where its page list starts (paged CSR: kv_indptr
// [request]; ragged: its first row; block table: 0, the kernels take request x the table's row stride). A CUDA CTA
// that loads its item can then issue its first page-table reads at once, without a trip to the request arrays
// first (each trip is most of a microsecond at the start of a decode step). plan()'s host arrays hold what run()
// gets (BatchPlanArgs), so these equal what the device arrays would give.
// A split item also names its merge: the MergeItem's index, its state count and the partial row of its first state
// (a merge's states take consecutive blocks of qo_end - qo_begin partial rows, in KV order), so a kernel that merges
// where the last of them finishes (AttentionParams::merge_counters) finds every state without reading the merge.
struct alignas(8) WorkItem {
  int32_t request;
  int32_t qo_begin, qo_end;
  int32_t kv_begin, kv_end;
  int32_t partial_row;
  int32_t qo_start;   // qo_indptr[request]
  int32_t qo_len;     // qo_indptr[request + 1] - qo_start
  int32_t kv_len;     // the request's KV tokens
  int32_t page_list;  // the request's first entry in the page list (CSR) or first row (ragged); 0 for a block table
  int32_t merge;         // index of the MergeItem this item's state belongs to; -1 when it writes the output
  int32_t merge_states;  // that merge's items (0 when unsplit)
  int32_t merge_row0;    // the partial row of the merge's first state (0 when unsplit)
};

// Combines the partial states of items [first_item, first_item + num_items), which all cover the same rows.
struct MergeItem {
  int32_t request;
  int32_t qo_begin, qo_end;
  int32_t first_item, num_items;
};

// The plan as kernels read it. It lives in memory, never in kernel arguments: on the CPU in host memory for the
// duration of run(); on CUDA at the start of the workspace, written by upload_plan. A CUDA graph captured once
// therefore replays correctly after a re-plan and upload: every count and pointer is read afresh. Kernels walk
// the items with a grid-stride loop, so the grid size never limits what a plan may contain.
struct PlanView {
  int32_t num_items;
  int32_t num_merges;
  const int32_t* qo_indptr;  // [batch + 1]
  const int32_t* kv_len;     // [batch]
  const WorkItem* items;     // [num_items]
  const MergeItem* merges;   // [num_merges]
  float* partial_o;          // [partial rows, num_qo_heads, head_dim_vo]
  float* partial_lse;        // [partial rows, num_qo_heads]
};

// Everything one batch-attention launch needs.
struct AttentionParams {
  const void* q;  // [total_qo, num_qo_heads, head_dim_qk]
  DType q_dtype;
  int64_t q_stride_token, q_stride_head;
  void* o;  // [total_qo, num_qo_heads, head_dim_vo]
  DType o_dtype;
  int64_t o_stride_token, o_stride_head;
  float* lse;  // [total_qo, num_qo_heads] in log2 units, or null
  int64_t lse_stride_token;
  KVParams kv;
  VariantParams variant;
  int32_t batch_size, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo;
  int64_t num_qo_tokens;  // Q's and O's tokens (total_qo)
  const PlanView* plan;
  // The plan's items (PlanView::items), where the CUDA kernels reach them without a trip to the PlanView: their place
  // in the workspace is the same for every plan of the shape (plan_layout), so a captured graph's copy stays valid
  // across re-plans. Entries past PlanView::num_items, up to item_capacity, are stale: never used.
  const WorkItem* items;
  // Launch sizes, from the plan's capacities (fixed for a batch size, so graphs survive re-plans).
  int32_t item_capacity, merge_capacity, qo_tile;
  int32_t tile_rows;  // the plan's tile_rows: which prefill kernel (CTA rows) serves it
  int32_t max_merge_states;  // the plan's: which shape of merge kernel launch serves it
  int32_t kv_stages;         // the plan's: the decode kernel's K/V stages (0: the default instantiation's)
  // The plan's schedule_ctas: the persistent prefill kernel's grid, whose CTAs walk `schedule` (AttentionPlan::
  // schedule in the workspace: schedule_ctas + 1 offsets, then the (KV head, item) pairs); 0: each CTA walks every
  // gridDim.x-th pair (set to 0 by the CUDA backend under ATTNFORGE_PREFILL_SCHEDULE=0). A launch parameter rather
  // than a PlanView field: the kernel reaches it without a trip to memory and keeps no pointer in registers. Its
  // place in the workspace and schedule_ctas are the same for every plan of the shape (plan_layout), so a captured
  // graph's copy of both stays valid across re-plans.
  int32_t schedule_ctas;
  const int32_t* schedule;
  // The partial states' buffers (PlanView::partial_o / partial_lse) as launch parameters: the decode kernel's split
  // CTAs write and merge them without a trip to the PlanView. Their place in the workspace is the same for every plan
  // of the batch size (plan_layout), so a captured graph's copy stays valid across re-plans.
  float* partial_o;
  float* partial_lse;
  // Decode plans whose merges the attention kernel does itself (AttentionPlan::merge_counters > 0): one arrival
  // counter for each (merge, KV head, block of the kernel's CTA rows), zero between launches. Each split CTA counts
  // itself in once its state is written; the CTA that arrives last merges the rows' states and writes the output,
  // and no merge kernel runs. Null: the merge kernel combines the states.
  int32_t* merge_counters;
  // Decode plans whose merges are streamed (AttentionPlan::merge_flags > 0): one flag for each (KV head, block of the
  // decode kernel's CTA rows, item) at capacity, indexed ((kv_head x row blocks) + block) x item_capacity + item, zero
  // between launches. A split CTA releases its flag once its partial rows are written; the merge kernel, launched
  // beside the decode grid, folds each merge's states in KV order as their flags appear and puts the flags back to
  // zero (merge_kernel.cuh, merge_streamed). Null: not streamed.
  int32_t* merge_flags;
  int32_t programmatic_launch;  // AttentionOptions::programmatic_launch (host side: how the CUDA backend launches)
  // CUDA, Hopper prefill kernel (ATTNFORGE_PREFILL_TMA): K/V tiles copied by the tensor memory accelerator through
  // these maps (backends/cuda/tma.h) in boxes of tma_box_slots tokens of a page (ragged KV: a tile's rows in one
  // box); 0: by cp.async. Set by the CUDA backend at launch, never by the caller.
  int32_t tma_box_slots;
  int32_t tma_heads_inner;  // bit 0: K's map has the KV-head axis before the slot axis (tma.h); bit 1: V's
  TensorMap tma_k, tma_v;
  // Set with tma_o (ATTNFORGE_PREFILL_TMA_STORE): a computing warpgroup's 64 final rows, staged in shared memory,
  // are written as boxes of O (64 head dims x group heads x 64 / group tokens) by the accelerator.
  int32_t tma_store;
  TensorMap tma_o;
  // Set with tma_q (ATTNFORGE_PREFILL_TMA_Q): the copier copies an item's 128 packed rows of Q as boxes (64 head dims
  // x group heads x 128 / group tokens).
  int32_t tma_q_rows;
  TensorMap tma_q;
  // CUDA, Hopper prefill kernel (ATTNFORGE_PREFILL_NARROW, default on): a computing warpgroup's tile whose last keys
  // none of its rows sees takes products over the first 32, 64 or 96 tokens only. Set by the backend at launch.
  int32_t narrow_tiles;
};

}  // namespace attnforge
