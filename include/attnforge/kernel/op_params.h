// Parameters of the operators other than attention. NVRTC-clean; strides in elements.
#pragma once

#include "attnforge/kernel/params.h"

namespace attnforge {

// One attention state source: values [n, heads, dim] and log2 LSE [n, heads].
struct StateView {
  const void* v;
  DType v_dtype;
  int64_t v_stride_n, v_stride_head;
  const float* s;
  int64_t s_stride_n, s_stride_head;
};

// Merges num_states states per (row, head). States come either from `sources` (merge_state: two separate
// tensors) or from one tensor with a state axis (merge_states: v [n, num_states, heads, dim]).
struct MergeStatesParams {
  StateView sources[2];    // used when num_sources > 0
  int32_t num_sources;
  StateView stacked;       // used when num_sources == 0; state k of row i at row i, offset k * state strides
  int64_t v_stride_state, s_stride_state;
  int32_t num_states;
  int64_t n;
  int32_t num_heads, head_dim;
  void* o;
  DType o_dtype;
  int64_t o_stride_n, o_stride_head;
  float* lse;  // may be null
  int64_t lse_stride_n, lse_stride_head;
};

// append_paged_kv_cache: row r of append_k/v goes to request batch_indices[r], position positions[r].
struct AppendKVParams {
  const void* k;
  const void* v;
  DType src_dtype;
  int64_t k_stride_n, k_stride_head, v_stride_n, v_stride_head;
  const int32_t* batch_indices;
  const int32_t* positions;
  int64_t nnz;
  int32_t num_kv_heads, head_dim_qk, head_dim_vo;
  KVParams cache;  // its k and v are written through (const removed by the backend)
};

// apply_rope: q [nnz, num_qo_heads, dim] and k [nnz, num_kv_heads, dim], positions per row.
struct RopeApplyParams {
  const void* q;
  const void* k;
  void* q_out;
  void* k_out;
  DType dtype;
  int64_t q_stride_n, q_stride_head, k_stride_n, k_stride_head;
  int64_t q_out_stride_n, q_out_stride_head, k_out_stride_n, k_out_stride_head;
  int64_t nnz;
  int32_t num_qo_heads, num_kv_heads, head_dim;
  const int32_t* pos_ids;   // [nnz], or null: position from indptr/offsets
  const int32_t* indptr;    // [batch + 1]
  const int32_t* offsets;   // [batch]
  int32_t batch_size;
  RopeParams rope;
};

}  // namespace attnforge
