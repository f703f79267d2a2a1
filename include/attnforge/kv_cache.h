// KV caches: paged (CSR page table or dense block table; any page size; NHD or HND) and ragged.
#pragma once

#include "attnforge/tensor.h"

namespace attnforge {

// Which pages hold each request's tokens, and how many tokens the request has.
//   CSR:         indptr int32 [batch + 1], indices int32 [>= indptr[batch]], last_page_len int32 [batch].
//                kv_len = (pages - 1) * page_size + last_page_len, with last_page_len in [1, page_size]
//                for a request with pages and 0 for a request without.
//   block table: block_table int32 [batch, max_pages] (row stride free), seq_lens int32 [batch];
//                request b uses the first ceil(seq_lens[b] / page_size) entries of its row.
struct PageTable {
  KVFormat format = KVFormat::kPagedCSR;
  TensorView indptr, indices, last_page_len;  // CSR
  TensorView block_table, seq_lens;           // block table

  static PageTable csr(TensorView indptr, TensorView indices, TensorView last_page_len);
  static PageTable blocks(TensorView block_table, TensorView seq_lens);
  int64_t batch_size() const;
};

// A paged cache. K and V are separate views with their own strides, so a combined [pages, 2, ...] cache or one
// interleaved across layers is passed as two views into the same memory.
//   NHD: k, v [num_pages, page_size, num_kv_heads, head_dim]
//   HND: k, v [num_pages, num_kv_heads, page_size, head_dim]
// head_dim of V may differ from that of K. fp8 caches are dequantized as value * scale.
struct PagedKVCache {
  TensorView k, v;
  KVLayout layout = KVLayout::kNHD;
  PageTable table;
  float k_scale = 1.f, v_scale = 1.f;
};

// Ragged KV: the tokens of all requests packed one after another.
//   k, v [total_kv, num_kv_heads, head_dim]; indptr int32 [batch + 1] (request b: rows indptr[b] .. indptr[b+1]).
struct RaggedKV {
  TensorView k, v;
  TensorView indptr;
  float k_scale = 1.f, v_scale = 1.f;
};

}  // namespace attnforge
