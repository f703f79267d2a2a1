// Shape rules shared by plan() and run().
#pragma once

#include <span>
#include <vector>

#include "attnforge/config.h"
#include "attnforge/kv_cache.h"
#include "attnforge/options.h"
#include "attnforge/plan.h"

namespace attnforge::detail {

// head_dim_vo = 0 means "same as head_dim_qk".
AttentionShape normalized(const AttentionShape& s);
// Checks that apply to every backend: positive head counts that divide, head dims multiples of 8, dtype sets.
Support check_common(const AttentionConfig& c);
// indptr[0] == 0 and non-decreasing.
void check_indptr(std::span<const int32_t> indptr, const char* name);
// Identifies a batch's KV lengths; run() compares it against the plan's.
uint64_t batch_fingerprint(KVFormat format, int32_t page_size, std::span<const int32_t> kv_len);
// Bytes of partial (o, lse) state for `rows` rows, each 256-byte aligned region.
size_t partial_state_bytes(int64_t rows, const AttentionShape& s);
// Where a device backend keeps the plan metadata at the start of the workspace: byte offsets of the regions after
// the PlanView (at 0), each 256-byte aligned and sized by the plan's batch size and capacities (the schedule: its
// offsets and a pair for every item at capacity and KV head; the decode kernel's merge counters, uploaded as zeros),
// and their end (the metadata's bytes). The schedule comes first, at the same place for every plan: kernels reach it
// through their launch parameters, which a captured graph keeps, and the rest through the PlanView, which each
// upload rewrites.
struct PlanLayout {
  size_t schedule, qo_indptr, kv_len, items, merges, merge_counters, merge_flags, end;
};
PlanLayout plan_layout(const AttentionPlan& plan);

// K/V pointers, dtype, format, page size, heads, strides (by layout) and scales of a paged cache whose views
// were validated; page ids and indptr are left to the caller.
KVParams paged_kv_params(const PagedKVCache& kv);

// Validated RoPE parameters (rotary_dim resolved against head_dim); pos_offset is left to the caller.
RopeParams rope_params(const RopeOptions& r, int32_t head_dim);
inline size_t align256(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace attnforge::detail
