// Test cases for batch attention: a spec (what to build) and a materialized case (host buffers and the views the
// API takes). One registry of specs feeds the unit tests, the fuzz test, `attnforge check` and `attnforge bench`.
//
// The data is adversarial on purpose: pages shuffled with spares, every unused page and every last-page tail
// filled with NaN, unused block-table entries set to -1, optional padded (non-contiguous) strides and a combined
// [pages, 2, ...] K/V buffer. The generator also keeps each request's K and V as plain arrays, so the reference
// never uses the page table.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "attnforge/attnforge.h"

namespace attnforge::testing {

struct OptionSpec {
  float sm_scale = 0.f;
  bool causal = false;
  int32_t window_left = -1, window_right = -1;
  float soft_cap = 0.f;
  bool alibi = false;
  bool sinks = false;
  bool custom_mask = false;
  bool rope = false;
  bool rope_interleave = false;
  bool rope_llama31 = false;
  bool rope_offsets = false;
  int32_t rotary_dim = 0;
};

struct CaseSpec {
  PlanKind kind = PlanKind::kDecode;
  KVFormat format = KVFormat::kPagedCSR;
  KVLayout layout = KVLayout::kNHD;
  std::vector<int32_t> qo_lens;  // per request
  std::vector<int32_t> kv_lens;  // per request
  int32_t num_qo_heads = 8, num_kv_heads = 2, head_dim_qk = 64, head_dim_vo = 0;
  int32_t page_size = 16;
  DType q_dtype = DType::kBFloat16, kv_dtype = DType::kBFloat16, o_dtype = DType::kBFloat16;
  float k_scale = 1.f, v_scale = 1.f;
  int32_t spare_pages = 3;
  bool combined_kv = false;   // K and V as two views of one [pages, 2, ...] buffer (needs equal head dims)
  bool padded_strides = false;  // heads and tokens padded apart, so no view is contiguous
  bool padded_v_only = false;  // paged K/V: only V's heads and tokens padded apart, so K and V have different strides
  OptionSpec options;
  PlanOptions plan;
  uint64_t seed = 1;

  std::string describe() const;
};

// A host allocation of `count` elements of `dtype`, 256-byte aligned.
struct Buffer {
  DType dtype = DType::kFloat32;
  size_t count = 0;
  std::shared_ptr<uint8_t[]> storage;
  void* data() const;
  static Buffer make(DType dtype, size_t count);
  size_t bytes() const { return count * dtype_bytes(dtype); }
};

struct Case {
  CaseSpec spec;
  int32_t batch = 0;
  std::vector<int32_t> qo_indptr;
  // Logical values as stored (decoded to float, before k_scale / v_scale), per request:
  // q_vals [total_qo][num_qo_heads][dqk]; k_vals[b] [kv_len][num_kv_heads][dqk]; v_vals[b] likewise with dvo.
  std::vector<float> q_vals;
  std::vector<std::vector<float>> k_vals, v_vals;
  std::vector<uint8_t> mask_bits;     // packed, see CustomMask
  std::vector<int32_t> mask_indptr;   // [batch + 1] bytes
  std::vector<float> alibi, sinks;    // [num_qo_heads]
  std::vector<int32_t> pos_offset;    // [batch]

  // Device-facing buffers (host memory).
  Buffer q, kv, out, lse, page_ids, indptr, last_page_len, block_table, seq_lens, mask_buf, mask_indptr_buf,
      alibi_buf, sinks_buf, pos_offset_buf;
  TensorView q_view, out_view, lse_view;
  PagedKVCache paged;
  RaggedKV ragged;
  AttentionOptions options;
  int64_t out_guard = 0;  // elements of guard before and after out's rows

  int32_t head_dim_vo() const { return spec.head_dim_vo ? spec.head_dim_vo : spec.head_dim_qk; }
  int64_t total_qo() const { return qo_indptr.back(); }
  BatchPlanArgs plan_args() const;
  // Fills out and lse (and their guards) with NaN.
  void poison_outputs();
  // true when every guard element still holds its poison.
  bool guards_intact() const;
};

Case make_case(const CaseSpec& spec);

// gtest prints a test parameter through PrintTo, found by argument-dependent lookup.
void PrintTo(const CaseSpec& spec, std::ostream* os);

// Plans and runs the case on the CPU with an exactly-sized workspace; returns the plan.
AttentionPlan plan_and_run(Case& c);

}  // namespace attnforge::testing
