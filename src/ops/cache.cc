// append_paged_kv_cache and apply_rope: validation and launch.
#include <cmath>

#include "attnforge/ops.h"
#include "backends/backend.h"
#include "core/check.h"
#include "core/shape.h"

namespace attnforge {

namespace {

using namespace detail;

void expect_rows(const TensorView& t, const char* name, Device dev, int64_t n, int64_t heads, int64_t dim,
                 std::initializer_list<DType> types) {
  expect_defined(t, name);
  expect_device(t, name, dev);
  expect_dtype(t, name, types);
  expect_ndim(t, name, 3, "[nnz, num_heads, head_dim]");
  if (n >= 0) expect_dim(t, name, 0, n, "nnz");
  if (heads >= 0) expect_dim(t, name, 1, heads, "num_heads");
  if (dim >= 0) expect_dim(t, name, 2, dim, "head_dim");
  expect_last_dim_contiguous(t, name);
}

RopeApplyParams rope_common(const TensorView& q, const TensorView& k, const TensorView& q_out, const TensorView& k_out,
                            const RopeOptions& rope) {
  expect_defined(q, "q");
  const Device dev = q.device;
  const auto types = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  expect_rows(q, "q", dev, -1, -1, -1, types);
  const int64_t nnz = q.shape[0];
  const int32_t dim = static_cast<int32_t>(q.shape[2]);
  expect_rows(k, "k", dev, nnz, -1, dim, {q.dtype});
  expect_rows(q_out, "q_out", dev, nnz, q.shape[1], dim, {q.dtype});
  expect_rows(k_out, "k_out", dev, nnz, k.shape[1], dim, {q.dtype});
  RopeApplyParams p{};
  p.q = q.data;
  p.k = k.data;
  p.q_out = q_out.data;
  p.k_out = k_out.data;
  p.dtype = q.dtype;
  p.q_stride_n = q.strides[0], p.q_stride_head = q.strides[1];
  p.k_stride_n = k.strides[0], p.k_stride_head = k.strides[1];
  p.q_out_stride_n = q_out.strides[0], p.q_out_stride_head = q_out.strides[1];
  p.k_out_stride_n = k_out.strides[0], p.k_out_stride_head = k_out.strides[1];
  p.nnz = nnz;
  p.num_qo_heads = static_cast<int32_t>(q.shape[1]);
  p.num_kv_heads = static_cast<int32_t>(k.shape[1]);
  p.head_dim = dim;
  p.rope = rope_params(rope, dim);
  return p;
}

}  // namespace

void append_paged_kv_cache(const TensorView& append_k, const TensorView& append_v, const TensorView& batch_indices,
                           const TensorView& positions, const PagedKVCache& cache, Stream stream) {
  expect_defined(cache.k, "cache.k");
  const Device dev = cache.k.device;
  const bool nhd = cache.layout == KVLayout::kNHD;
  if (cache.layout != KVLayout::kNHD && cache.layout != KVLayout::kHND)
    fail_arg("cache.layout: {}; expected one of {{NHD, HND}}", static_cast<int>(cache.layout));
  const char* layout_doc = nhd ? "NHD [num_pages, page_size, num_kv_heads, head_dim]"
                               : "HND [num_pages, num_kv_heads, page_size, head_dim]";
  for (auto [t, name] : {std::pair{&cache.k, "cache.k"}, std::pair{&cache.v, "cache.v"}}) {
    expect_defined(*t, name);
    expect_device(*t, name, dev);
    expect_dtype(*t, name, {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3, DType::kFloat8E5M2});
    expect_ndim(*t, name, 4, layout_doc);
    expect_last_dim_contiguous(*t, name);
  }
  if (cache.v.dtype != cache.k.dtype)
    fail_arg("cache.v: dtype {}; expected the dtype of cache.k, {}", to_string(cache.v.dtype), to_string(cache.k.dtype));
  const int64_t num_pages = cache.k.shape[0];
  const int32_t page_size = static_cast<int32_t>(cache.k.shape[nhd ? 1 : 2]);
  const int32_t heads = static_cast<int32_t>(cache.k.shape[nhd ? 2 : 1]);
  expect_dim(cache.v, "cache.v", 0, num_pages, "num_pages of cache.k");
  expect_dim(cache.v, "cache.v", nhd ? 1 : 2, page_size, "page_size of cache.k");
  expect_dim(cache.v, "cache.v", nhd ? 2 : 1, heads, "num_kv_heads of cache.k");
  const auto src_types = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, cache.k.dtype};
  expect_rows(append_k, "append_k", dev, -1, heads, cache.k.shape[3], src_types);
  const int64_t nnz = append_k.shape[0];
  expect_rows(append_v, "append_v", dev, nnz, heads, cache.v.shape[3], {append_k.dtype});
  expect_int32_vector(batch_indices, "batch_indices", nnz, dev);
  expect_int32_vector(positions, "positions", nnz, dev);
  for (auto [scale, name] : {std::pair{cache.k_scale, "cache.k_scale"}, std::pair{cache.v_scale, "cache.v_scale"}})
    if (!std::isfinite(scale) || scale <= 0.f) fail_arg("{}: {}; expected a finite value > 0", name, scale);
  for (auto [out, name] : {std::pair{&cache.k, "cache.k"}, std::pair{&cache.v, "cache.v"}}) {
    expect_no_overlap(*out, name, append_k, "append_k");
    expect_no_overlap(*out, name, append_v, "append_v");
  }

  AppendKVParams p{};
  p.k = append_k.data;
  p.v = append_v.data;
  p.src_dtype = append_k.dtype;
  p.k_stride_n = append_k.strides[0], p.k_stride_head = append_k.strides[1];
  p.v_stride_n = append_v.strides[0], p.v_stride_head = append_v.strides[1];
  p.batch_indices = batch_indices.ptr<const int32_t>();
  p.positions = positions.ptr<const int32_t>();
  p.nnz = nnz;
  p.num_kv_heads = heads;
  p.head_dim_qk = static_cast<int32_t>(cache.k.shape[3]);
  p.head_dim_vo = static_cast<int32_t>(cache.v.shape[3]);
  p.cache = paged_kv_params(cache);
  KVParams& c = p.cache;

  const PageTable& t = cache.table;
  int64_t batch = 0;
  if (t.format == KVFormat::kPagedCSR) {
    expect_int32_vector(t.indptr, "cache.table.indptr", -1, dev);
    batch = t.indptr.shape[0] - 1;
    if (batch < 0) fail_arg("cache.table.indptr: has 0 elements; expected batch + 1 >= 1");
    expect_int32_vector(t.indices, "cache.table.indices", -1, dev);
    expect_int32_vector(t.last_page_len, "cache.table.last_page_len", batch, dev);
    c.page_ids = t.indices.ptr<const int32_t>();
    c.page_list_indptr = t.indptr.ptr<const int32_t>();
  } else if (t.format == KVFormat::kBlockTable) {
    expect_defined(t.block_table, "cache.table.block_table");
    expect_device(t.block_table, "cache.table.block_table", dev);
    expect_dtype(t.block_table, "cache.table.block_table", {DType::kInt32});
    expect_ndim(t.block_table, "cache.table.block_table", 2, "[batch, max_pages]");
    if (t.block_table.shape[1] > 1 && t.block_table.strides[1] != 1)
      fail_arg("cache.table.block_table: column stride {}; expected 1", t.block_table.strides[1]);
    batch = t.block_table.shape[0];
    expect_int32_vector(t.seq_lens, "cache.table.seq_lens", batch, dev);
    c.page_ids = t.block_table.ptr<const int32_t>();
    c.page_list_stride = t.block_table.strides[0];
  } else {
    fail_arg("cache.table.format: {}; expected one of {{paged-csr, block-table}}", to_string(t.format));
  }

  // Where the metadata is readable here, every destination is checked before anything is written.
  if (dev.type == DeviceType::kCPU) {
    const int32_t* bi = p.batch_indices;
    const int32_t* pos = p.positions;
    for (int64_t r = 0; r < nnz; ++r) {
      if (bi[r] < 0 || bi[r] >= batch)
        fail_arg("batch_indices[{}]: {}; expected a request index in [0, batch={})", r, bi[r], batch);
      int64_t kv_len = 0, pages = 0;
      if (t.format == KVFormat::kPagedCSR) {
        const int32_t* ip = t.indptr.ptr<const int32_t>();
        pages = ip[bi[r] + 1] - ip[bi[r]];
        if (pages < 0 || ip[bi[r] + 1] > t.indices.shape[0])
          fail_arg("cache.table.indptr: entries {}..{} ({}, {}) are not a valid range of cache.table.indices ({} elements)",
                   bi[r], bi[r] + 1, ip[bi[r]], ip[bi[r] + 1], t.indices.shape[0]);
        const int32_t last = t.last_page_len.ptr<const int32_t>()[bi[r]];
        if (pages > 0 && (last < 1 || last > page_size))
          fail_arg("cache.table.last_page_len[{}]: {}; expected a value in [1, page_size={}]", bi[r], last, page_size);
        kv_len = pages == 0 ? 0 : (pages - 1) * page_size + last;
        for (int64_t i = ip[bi[r]]; i < ip[bi[r] + 1]; ++i)
          if (c.page_ids[i] < 0 || c.page_ids[i] >= num_pages)
            fail_arg("cache.table.indices[{}]: page id {} is out of range; expected a value in [0, num_pages={})", i,
                     c.page_ids[i], num_pages);
      } else {
        kv_len = t.seq_lens.ptr<const int32_t>()[bi[r]];
        pages = (kv_len + page_size - 1) / page_size;
        if (kv_len < 0 || pages > t.block_table.shape[1])
          fail_arg("cache.table.seq_lens[{}]: {}; expected a value in [0, page_size x max_pages = {}]", bi[r], kv_len,
                   page_size * t.block_table.shape[1]);
        for (int64_t j = 0; j < pages; ++j) {
          const int32_t id = c.page_ids[bi[r] * c.page_list_stride + j];
          if (id < 0 || id >= num_pages)
            fail_arg("cache.table.block_table[{}, {}]: page id {} is out of range; expected a value in [0, num_pages={})",
                     bi[r], j, id, num_pages);
        }
      }
      if (pos[r] < 0 || pos[r] >= kv_len)
        fail_arg("positions[{}]: {}; request {} has {} tokens in its page table (the table must already count the "
                 "appended tokens), expected a position in [0, {})",
                 r, pos[r], bi[r], kv_len, kv_len);
    }
  }
  backend_for(dev).append_kv(p, stream);
}

void apply_rope(const TensorView& q, const TensorView& k, const TensorView& q_out, const TensorView& k_out,
                const TensorView& indptr, const TensorView& offsets, const RopeOptions& rope, Stream stream) {
  RopeApplyParams p = rope_common(q, k, q_out, k_out, rope);
  const Device dev = q.device;
  expect_int32_vector(indptr, "indptr", -1, dev);
  const int64_t batch = indptr.shape[0] - 1;
  if (batch < 0) fail_arg("indptr: has 0 elements; expected batch + 1 >= 1");
  expect_int32_vector(offsets, "offsets", batch, dev);
  if (dev.type == DeviceType::kCPU) {
    const int32_t* ip = indptr.ptr<const int32_t>();
    check_indptr({ip, static_cast<size_t>(batch + 1)}, "indptr");
    if (ip[batch] != p.nnz) fail_arg("indptr[{}]: {}; expected nnz = {} (the rows of q)", batch, ip[batch], p.nnz);
  }
  p.indptr = indptr.ptr<const int32_t>();
  p.offsets = offsets.ptr<const int32_t>();
  p.batch_size = static_cast<int32_t>(batch);
  backend_for(dev).rope(p, stream);
}

void apply_rope_pos_ids(const TensorView& q, const TensorView& k, const TensorView& q_out, const TensorView& k_out,
                        const TensorView& pos_ids, const RopeOptions& rope, Stream stream) {
  RopeApplyParams p = rope_common(q, k, q_out, k_out, rope);
  expect_int32_vector(pos_ids, "pos_ids", p.nnz, q.device);
  p.pos_ids = pos_ids.ptr<const int32_t>();
  backend_for(q.device).rope(p, stream);
}

}  // namespace attnforge
