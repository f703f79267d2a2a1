// append_paged_kv_cache and apply_rope on the CPU.
#include <algorithm>

#include "attnforge/kernel/variant.h"
#include "backends/cpu/convert.h"
#include "backends/cpu/kernels.h"
#include "backends/cpu/thread_pool.h"

namespace attnforge::cpu {

void append_kv(const AppendKVParams& p) {
  ThreadPool& pool = ThreadPool::instance();
  const KVParams& c = p.cache;
  pool.parallel_for(p.nnz, [&](int64_t r, int32_t worker) {
    float* row = pool.scratch(worker);
    const int32_t b = p.batch_indices[r], t = p.positions[r];
    for (int32_t h = 0; h < p.num_kv_heads; ++h) {
      load_row(p.k, p.src_dtype, r * p.k_stride_n + h * p.k_stride_head, p.head_dim_qk, 1.f, row);
      store_row(const_cast<void*>(c.k), c.dtype, kv_k_offset(c, b, t, h), p.head_dim_qk, row, c.k_scale);
      load_row(p.v, p.src_dtype, r * p.v_stride_n + h * p.v_stride_head, p.head_dim_vo, 1.f, row);
      store_row(const_cast<void*>(c.v), c.dtype, kv_v_offset(c, b, t, h), p.head_dim_vo, row, c.v_scale);
    }
  });
}

void rope(const RopeApplyParams& p) {
  ThreadPool& pool = ThreadPool::instance();
  pool.parallel_for(p.nnz, [&](int64_t r, int32_t worker) {
    float* freqs = pool.scratch(worker);
    float* row = freqs + p.head_dim;
    for (int32_t i = 0; i < p.rope.rotary_dim / 2; ++i) freqs[i] = rope_frequency(p.rope, i);
    int32_t pos;
    if (p.pos_ids) {
      pos = p.pos_ids[r];
    } else {
      // The request holding row r: the last b with indptr[b] <= r.
      const int32_t* end = p.indptr + p.batch_size + 1;
      const int32_t b = static_cast<int32_t>(std::upper_bound(p.indptr, end, static_cast<int32_t>(r)) - p.indptr) - 1;
      pos = static_cast<int32_t>(r) - p.indptr[b] + p.offsets[b];
    }
    for (int32_t h = 0; h < p.num_qo_heads; ++h) {
      load_row(p.q, p.dtype, r * p.q_stride_n + h * p.q_stride_head, p.head_dim, 1.f, row);
      rope_rotate(p.rope, freqs, row, pos);
      store_row(p.q_out, p.dtype, r * p.q_out_stride_n + h * p.q_out_stride_head, p.head_dim, row);
    }
    for (int32_t h = 0; h < p.num_kv_heads; ++h) {
      load_row(p.k, p.dtype, r * p.k_stride_n + h * p.k_stride_head, p.head_dim, 1.f, row);
      rope_rotate(p.rope, freqs, row, pos);
      store_row(p.k_out, p.dtype, r * p.k_out_stride_n + h * p.k_out_stride_head, p.head_dim, row);
    }
  });
}

}  // namespace attnforge::cpu
