// Planner heuristics: plain functions of the batch shape, unit-tested on the CPU (tests/test_planner.cc).
#pragma once

#include <span>
#include <vector>

#include "attnforge/kernel/types.h"
#include "attnforge/tensor.h"

namespace attnforge::planner {

// Batch decode takes at most this many query tokens per request; longer requests belong to prefill.
constexpr int32_t kMaxDecodeQueries = 8;
// Deterministic mode's default split: long enough that a 128K request makes 64 items.
constexpr int32_t kDefaultFixedSplit = 2048;

// Query tokens per prefill item. A tile holds tokens x group rows (the heads of a KV group share each K/V
// load); aim at target_rows rows so short requests do not pay for a large tile and long ones amortize K/V.
int32_t choose_qo_tile(int32_t group_size, int32_t max_qo_len, int32_t target_rows);

// Rows the CPU backend aims at per item (its scratch holds 128 rows of up to 512 dims).
constexpr int32_t kCpuTargetRows = 128;

struct SplitInput {
  int64_t num_tiles = 0;        // query tiles in the batch
  int32_t num_kv_heads = 1;     // each tile runs once per KV head, in parallel
  int64_t total_kv = 0;         // sum over tiles of the KV tokens each reads
  int64_t max_kv = 0;           // the longest of those
  int32_t num_workers = 1;      // CPU threads or SMs
  int32_t waves = 2;            // parallel units wanted per worker
  int32_t min_chunk = 256;      // below this a split costs more (merge, partial writes) than it gains
  int32_t align = 16;           // chunks are a multiple of this (the page size where pages are large)
};

// Items per KV head the split aims at: waves x workers spread over the KV heads.
int64_t split_target_items(const SplitInput& in);

// KV tokens per item, or 0 for "do not split". Splits only when the tiles alone leave workers idle, and then
// cuts so that about waves x workers units exist, none shorter than min_chunk.
int32_t choose_kv_chunk(const SplitInput& in);

// Whether a decode kernel should merge a batch's split KV itself (Backend::decode_merge): its last CTA of a merge
// combines every state of its rows, `cta_rows` rows of head_dim_vo floats and an LSE each, through `smem_bytes` of
// shared memory a pass, beside one state's worth of accumulators. Yes while the most states a merge of this batch
// size can have (split_target_items + 1) take at most `passes` passes: a merge kernel spreads bigger merges over
// many CTAs.
bool decode_merges_in_kernel(const SplitInput& in, int32_t cta_rows, int32_t head_dim_vo, int64_t smem_bytes,
                             int32_t passes);

// A persistent kernel's pairs (KV head h, item i: h x items + i, the kernel's order) laid out over `ctas` CTAs:
// in that order, each pair goes to the CTA with the least work so far (ties: the lowest), as CTAs taking pairs from
// a shared queue would, so a CTA's list is in the kernel's order and pairs near each other in it run at about the
// same time (a KV head's K/V stays in L2). Work of a pair: its item's item_work (the same for every head). Out:
// ctas + 1 offsets into the pairs, then each CTA's pairs. A CTA that takes every ctas-th pair instead finishes
// last by up to a long item a round: 8% of ragged 16 x [512, 4096]'s time in this model, 2% of one request's.
void schedule_pairs(std::span<const int64_t> item_work, int32_t num_kv_heads, int32_t ctas,
                    std::vector<int32_t>& out);
// The fixed work of a prefill item besides its KV tokens, in KV tokens: the Hopper kernel's item setup, first
// tile's wait and row write take about two 128-token tiles' time (H200 traces, perf-notes).
constexpr int64_t kItemWorkTokens = 256;

}  // namespace attnforge::planner
