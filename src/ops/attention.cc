// run() and the single-request operators: validate the arguments, turn them into AttentionParams, launch.
// Every check happens before anything is written.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attnforge/ops.h"
#include "backends/backend.h"
#include "core/check.h"
#include "core/shape.h"
#include "ops/prepare.h"

namespace attnforge {

namespace {

using detail::expect_defined;
using detail::expect_device;
using detail::expect_dim;
using detail::expect_dtype;
using detail::expect_int32_vector;
using detail::expect_last_dim_contiguous;
using detail::expect_ndim;
using detail::fail;
using detail::fail_arg;

bool on_host(const TensorView& t) { return t.device.type == DeviceType::kCPU; }

void expect_head_vector(const TensorView& t, const char* name, int32_t heads, Device dev) {
  expect_device(t, name, dev);
  expect_dtype(t, name, {DType::kFloat32});
  expect_ndim(t, name, 1, "[num_qo_heads]");
  expect_dim(t, name, 0, heads, "num_qo_heads");
  if (heads > 1 && t.strides[0] != 1) fail_arg("{}: stride {}; expected a contiguous float32 vector", name, t.strides[0]);
  if (on_host(t))
    for (int32_t h = 0; h < heads; ++h)
      if (!std::isfinite(t.ptr<const float>()[h])) fail_arg("{}[{}]: {}; expected a finite value", name, h, t.ptr<const float>()[h]);
}

// KV length of request b as the run-time page table states it; checks the table's own invariants.
void check_lengths_match(const AttentionPlan& plan, int64_t b, int64_t len, const char* what) {
  if (len != plan.kv_len[b])
    fail(ErrorKind::kPlanMismatch,
         "{}: request {} has {} KV tokens, but the plan was made for {}; the page table describes another batch "
         "than the plan (plan again for this batch)",
         what, b, len, plan.kv_len[b]);
}

void check_page_id(int32_t id, int64_t num_pages, const char* name, int64_t index) {
  if (id < 0 || id >= num_pages)
    fail_arg("{}[{}]: page id {} is out of range; expected a value in [0, num_pages={})", name, index, id, num_pages);
}

KVParams paged_params(const AttentionPlan& plan, const PagedKVCache& kv) {
  const Device dev = plan.device;
  const AttentionShape& s = plan.shape;
  const bool nhd = kv.layout == KVLayout::kNHD;
  if (kv.layout != KVLayout::kNHD && kv.layout != KVLayout::kHND)
    fail_arg("kv.layout: {}; expected one of {{NHD, HND}}", static_cast<int>(kv.layout));
  const char* layout_doc = nhd ? "NHD [num_pages, page_size, num_kv_heads, head_dim]"
                               : "HND [num_pages, num_kv_heads, page_size, head_dim]";
  for (auto [t, name, dim] : {std::tuple{&kv.k, "kv.k", s.head_dim_qk}, std::tuple{&kv.v, "kv.v", s.head_dim_vo}}) {
    expect_defined(*t, name);
    expect_device(*t, name, dev);
    if (t->dtype != s.kv_dtype)
      fail_arg("{}: dtype {}; the plan was made for kv_dtype {}", name, to_string(t->dtype), to_string(s.kv_dtype));
    expect_ndim(*t, name, 4, layout_doc);
    expect_dim(*t, name, nhd ? 2 : 1, s.num_kv_heads, "num_kv_heads");
    expect_dim(*t, name, nhd ? 1 : 2, plan.page_size, "page_size of the plan");
    expect_dim(*t, name, 3, dim, name == std::string("kv.k") ? "head_dim_qk" : "head_dim_vo");
    expect_last_dim_contiguous(*t, name);
  }
  if (kv.k.shape[0] != kv.v.shape[0])
    fail_arg("kv.v: has {} pages but kv.k has {}; expected the same number", kv.v.shape[0], kv.k.shape[0]);
  for (auto [scale, name] : {std::pair{kv.k_scale, "kv.k_scale"}, std::pair{kv.v_scale, "kv.v_scale"}})
    if (!std::isfinite(scale) || scale <= 0.f) fail_arg("{}: {}; expected a finite value > 0", name, scale);
  const int64_t num_pages = kv.k.shape[0];

  const PageTable& t = kv.table;
  if (t.format != plan.kv_format)
    fail(ErrorKind::kPlanMismatch, "kv.table: format {}; the plan was made for {}", to_string(t.format),
         to_string(plan.kv_format));
  const int64_t batch = plan.batch_size;
  KVParams p = detail::paged_kv_params(kv);  // dims were checked against the plan above

  if (t.format == KVFormat::kPagedCSR) {
    if (t.indptr.defined() && t.indptr.ndim == 1 && t.indptr.shape[0] != batch + 1)
      fail(ErrorKind::kPlanMismatch, "kv.table.indptr: has {} elements; the plan was made for a batch of {} (expected {})",
           t.indptr.shape[0], batch, batch + 1);
    expect_int32_vector(t.indptr, "kv.table.indptr", batch + 1, dev);
    expect_int32_vector(t.indices, "kv.table.indices", -1, dev);
    expect_int32_vector(t.last_page_len, "kv.table.last_page_len", batch, dev);
    p.page_ids = t.indices.ptr<const int32_t>();
    p.page_list_indptr = t.indptr.ptr<const int32_t>();
    if (on_host(t.indptr) && on_host(t.indices) && on_host(t.last_page_len)) {
      const int32_t* indptr = t.indptr.ptr<const int32_t>();
      const int32_t* last = t.last_page_len.ptr<const int32_t>();
      detail::check_indptr({indptr, static_cast<size_t>(batch + 1)}, "kv.table.indptr");
      if (indptr[batch] > t.indices.shape[0])
        fail_arg("kv.table.indices: has {} elements; kv.table.indptr[{}] = {} needs at least that many",
                 t.indices.shape[0], batch, indptr[batch]);
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t pages = indptr[b + 1] - indptr[b];
        if (pages > 0 && (last[b] < 1 || last[b] > plan.page_size))
          fail_arg("kv.table.last_page_len[{}]: {}; expected a value in [1, page_size={}]", b, last[b], plan.page_size);
        if (pages == 0 && last[b] != 0)
          fail_arg("kv.table.last_page_len[{}]: {} for a request with no pages; expected 0", b, last[b]);
        check_lengths_match(plan, b, pages == 0 ? 0 : (pages - 1) * plan.page_size + last[b], "kv.table");
        for (int64_t i = indptr[b]; i < indptr[b + 1]; ++i)
          check_page_id(p.page_ids[i], num_pages, "kv.table.indices", i);
      }
    }
  } else {
    expect_defined(t.block_table, "kv.table.block_table");
    expect_device(t.block_table, "kv.table.block_table", dev);
    expect_dtype(t.block_table, "kv.table.block_table", {DType::kInt32});
    expect_ndim(t.block_table, "kv.table.block_table", 2, "[batch, max_pages]");
    if (t.block_table.shape[0] != batch)
      fail(ErrorKind::kPlanMismatch, "kv.table.block_table: has {} rows; the plan was made for a batch of {}",
           t.block_table.shape[0], batch);
    if (t.block_table.shape[1] > 1 && t.block_table.strides[1] != 1)
      fail_arg("kv.table.block_table: column stride {}; expected 1", t.block_table.strides[1]);
    expect_int32_vector(t.seq_lens, "kv.table.seq_lens", batch, dev);
    p.page_ids = t.block_table.ptr<const int32_t>();
    p.page_list_stride = t.block_table.strides[0];
    if (on_host(t.block_table) && on_host(t.seq_lens)) {
      const int32_t* seq = t.seq_lens.ptr<const int32_t>();
      for (int64_t b = 0; b < batch; ++b) {
        if (seq[b] < 0) fail_arg("kv.table.seq_lens[{}]: {}; expected a value >= 0", b, seq[b]);
        check_lengths_match(plan, b, seq[b], "kv.table.seq_lens");
        const int64_t pages = (static_cast<int64_t>(seq[b]) + plan.page_size - 1) / plan.page_size;
        if (pages > t.block_table.shape[1])
          fail_arg("kv.table.seq_lens[{}]: {} tokens need {} pages; kv.table.block_table has {} columns", b, seq[b],
                   pages, t.block_table.shape[1]);
        for (int64_t j = 0; j < pages; ++j)
          check_page_id(p.page_ids[b * p.page_list_stride + j], num_pages, "kv.table.block_table", b * t.block_table.shape[1] + j);
      }
    }
  }
  return p;
}

KVParams ragged_params(const AttentionPlan& plan, const RaggedKV& kv) {
  const Device dev = plan.device;
  const AttentionShape& s = plan.shape;
  if (plan.kv_format != KVFormat::kRagged)
    fail(ErrorKind::kPlanMismatch, "kv: ragged KV given, but the plan was made for {} KV", to_string(plan.kv_format));
  for (auto [t, name, dim] : {std::tuple{&kv.k, "kv.k", s.head_dim_qk}, std::tuple{&kv.v, "kv.v", s.head_dim_vo}}) {
    expect_defined(*t, name);
    expect_device(*t, name, dev);
    if (t->dtype != s.kv_dtype)
      fail_arg("{}: dtype {}; the plan was made for kv_dtype {}", name, to_string(t->dtype), to_string(s.kv_dtype));
    expect_ndim(*t, name, 3, "[total_kv, num_kv_heads, head_dim]");
    expect_dim(*t, name, 1, s.num_kv_heads, "num_kv_heads");
    expect_dim(*t, name, 2, dim, name == std::string("kv.k") ? "head_dim_qk" : "head_dim_vo");
    expect_last_dim_contiguous(*t, name);
  }
  if (kv.k.shape[0] != kv.v.shape[0])
    fail_arg("kv.v: has {} rows but kv.k has {}; expected the same number", kv.v.shape[0], kv.k.shape[0]);
  for (auto [scale, name] : {std::pair{kv.k_scale, "kv.k_scale"}, std::pair{kv.v_scale, "kv.v_scale"}})
    if (!std::isfinite(scale) || scale <= 0.f) fail_arg("{}: {}; expected a finite value > 0", name, scale);
  const int64_t batch = plan.batch_size;
  if (kv.indptr.defined() && kv.indptr.ndim == 1 && kv.indptr.shape[0] != batch + 1)
    fail(ErrorKind::kPlanMismatch, "kv.indptr: has {} elements; the plan was made for a batch of {} (expected {})",
         kv.indptr.shape[0], batch, batch + 1);
  expect_int32_vector(kv.indptr, "kv.indptr", batch + 1, dev);
  if (on_host(kv.indptr)) {
    const int32_t* indptr = kv.indptr.ptr<const int32_t>();
    detail::check_indptr({indptr, static_cast<size_t>(batch + 1)}, "kv.indptr");
    for (int64_t b = 0; b < batch; ++b) check_lengths_match(plan, b, indptr[b + 1] - indptr[b], "kv.indptr");
    if (indptr[batch] > kv.k.shape[0])
      fail_arg("kv.indptr[{}]: {}; kv.k has only {} rows", batch, indptr[batch], kv.k.shape[0]);
  }
  KVParams p{};
  p.k = kv.k.data;
  p.v = kv.v.data;
  p.dtype = s.kv_dtype;
  p.format = KVFormat::kRagged;
  p.page_size = 1;
  p.num_kv_heads = s.num_kv_heads;
  p.k_stride_page = kv.k.strides[0];
  p.k_stride_head = kv.k.strides[1];
  p.v_stride_page = kv.v.strides[0];
  p.v_stride_head = kv.v.strides[1];
  p.page_list_indptr = kv.indptr.ptr<const int32_t>();
  p.k_scale = kv.k_scale;
  p.v_scale = kv.v_scale;
  p.num_pages = std::min(kv.k.shape[0], kv.v.shape[0]);
  return p;
}

RopeParams fused_rope_params(const RopeOptions& r, int32_t head_dim, int64_t batch, Device dev) {
  if (!r.enabled) return RopeParams{};
  RopeParams p = detail::rope_params(r, head_dim);
  if (r.pos_offset.defined()) {
    expect_int32_vector(r.pos_offset, "rope.pos_offset", batch, dev);
    p.pos_offset = r.pos_offset.ptr<const int32_t>();
  }
  return p;
}

VariantParams variant_params(const AttentionPlan& plan, const AttentionOptions& o) {
  const Device dev = plan.device;
  const AttentionShape& s = plan.shape;
  VariantParams v{};
  if (!std::isfinite(o.sm_scale) || o.sm_scale < 0.f)
    fail_arg("options.sm_scale: {}; expected a finite value > 0, or 0 for 1/sqrt(head_dim_qk)", o.sm_scale);
  v.sm_scale = o.sm_scale > 0.f ? o.sm_scale : 1.f / std::sqrt(static_cast<float>(s.head_dim_qk));
  if (plan.causal && !o.causal)
    fail(ErrorKind::kPlanMismatch,
         "options.causal: false, but the plan was made with PlanOptions::causal = true and covers only the KV that "
         "causal attention sees; plan again with causal = false");
  if (o.causal && !plan.causal)
    for (int32_t b = 0; b < plan.batch_size; ++b) {
      const int32_t qo_len = plan.qo_indptr[b + 1] - plan.qo_indptr[b];
      if (qo_len > plan.kv_len[b])
        fail_arg("options.causal: request {} has qo_len {} > kv_len {}; causal attention needs qo_len <= kv_len", b,
                 qo_len, plan.kv_len[b]);
    }
  v.causal = o.causal ? 1 : 0;
  if (o.window_left < -1) fail_arg("options.window_left: {}; expected -1 (unbounded) or a value >= 0", o.window_left);
  if (o.window_right < -1) fail_arg("options.window_right: {}; expected -1 (unbounded) or a value >= 0", o.window_right);
  v.window_left = o.window_left;
  v.window_right = o.window_right;
  if (!std::isfinite(o.logits_soft_cap) || o.logits_soft_cap < 0.f)
    fail_arg("options.logits_soft_cap: {}; expected 0 (off) or a finite value > 0", o.logits_soft_cap);
  v.soft_cap = o.logits_soft_cap;
  if (o.alibi_slopes.defined()) {
    expect_head_vector(o.alibi_slopes, "options.alibi_slopes", s.num_qo_heads, dev);
    v.alibi_slopes = o.alibi_slopes.ptr<const float>();
  }
  if (o.sinks.defined()) {
    expect_head_vector(o.sinks, "options.sinks", s.num_qo_heads, dev);
    v.sinks = o.sinks.ptr<const float>();
  }
  const CustomMask& m = o.custom_mask;
  if (m.bits.defined() || m.indptr.defined()) {
    expect_defined(m.bits, "options.custom_mask.bits");
    expect_device(m.bits, "options.custom_mask.bits", dev);
    expect_dtype(m.bits, "options.custom_mask.bits", {DType::kUInt8});
    expect_ndim(m.bits, "options.custom_mask.bits", 1, "[total_bytes]");
    if (m.bits.shape[0] > 1 && m.bits.strides[0] != 1)
      fail_arg("options.custom_mask.bits: stride {}; expected contiguous bytes", m.bits.strides[0]);
    expect_int32_vector(m.indptr, "options.custom_mask.indptr", plan.batch_size + 1, dev);
    if (on_host(m.indptr)) {
      const int32_t* ip = m.indptr.ptr<const int32_t>();
      detail::check_indptr({ip, static_cast<size_t>(plan.batch_size + 1)}, "options.custom_mask.indptr");
      for (int32_t b = 0; b < plan.batch_size; ++b) {
        const int64_t bits = static_cast<int64_t>(plan.qo_indptr[b + 1] - plan.qo_indptr[b]) * plan.kv_len[b];
        if (ip[b + 1] - ip[b] < (bits + 7) / 8)
          fail_arg("options.custom_mask.indptr: request {} has {} bytes; its [qo_len, kv_len] mask needs {}", b,
                   ip[b + 1] - ip[b], (bits + 7) / 8);
      }
      if (ip[plan.batch_size] > m.bits.shape[0])
        fail_arg("options.custom_mask.bits: has {} bytes; options.custom_mask.indptr[{}] = {}", m.bits.shape[0],
                 plan.batch_size, ip[plan.batch_size]);
    }
    v.custom_mask = m.bits.ptr<const uint8_t>();
    v.mask_byte_indptr = m.indptr.ptr<const int32_t>();
  }
  v.rope = fused_rope_params(o.rope, s.head_dim_qk, plan.batch_size, dev);
  return v;
}

void check_workspace(const AttentionPlan& plan, const Workspace& ws) {
  if (plan.workspace_bytes == 0) return;
  if (ws.bytes < plan.workspace_bytes)
    fail(ErrorKind::kWorkspace, "workspace: {} bytes; the plan needs {} (AttentionPlan::workspace_bytes)", ws.bytes,
         plan.workspace_bytes);
  if (ws.data == nullptr) fail(ErrorKind::kWorkspace, "workspace: data is null; the plan needs {} bytes", plan.workspace_bytes);
  if (reinterpret_cast<uintptr_t>(ws.data) % 256 != 0)
    fail(ErrorKind::kWorkspace, "workspace: address {} is not 256-byte aligned", ws.data);
}

// The kernels' view of a plan whose workspace starts at `base`: counts and the partial-state regions, which
// follow the metadata. Metadata pointers are filled by the caller (host or device addresses).
PlanView plan_view(const AttentionPlan& plan, void* base) {
  PlanView v{};
  v.num_items = static_cast<int32_t>(plan.items.size());
  v.num_merges = static_cast<int32_t>(plan.merges.size());
  if (plan.partial_row_capacity > 0) {
    char* partial = static_cast<char*>(base) + plan.metadata_bytes;
    v.partial_o = reinterpret_cast<float*>(partial);
    v.partial_lse = reinterpret_cast<float*>(
        partial + detail::align256(plan.partial_row_capacity * plan.shape.num_qo_heads * plan.shape.head_dim_vo * sizeof(float)));
  }
  return v;
}

}  // namespace

void detail::prepare_run(detail::PreparedRun& prepared, const AttentionPlan& plan, const TensorView& q,
                         const KVParams& kv, const TensorView& k_view, const TensorView& v_view, KVLayout layout,
                         const Outputs& out, const AttentionOptions& options, const Workspace& ws) {
  if (plan.version != AttentionPlan::kVersion)
    fail(ErrorKind::kPlanMismatch, "plan: version {}; this library runs plans of version {}", plan.version,
         AttentionPlan::kVersion);
  const Device dev = plan.device;
  const AttentionShape& s = plan.shape;
  expect_defined(q, "q");
  expect_device(q, "q", dev);
  if (q.dtype != s.q_dtype)
    fail_arg("q: dtype {}; the plan was made for q_dtype {}", to_string(q.dtype), to_string(s.q_dtype));
  expect_ndim(q, "q", 3, "[total_qo, num_qo_heads, head_dim_qk]");
  if (q.shape[0] != plan.total_qo)
    fail(ErrorKind::kPlanMismatch, "q: has {} rows; the plan was made for {} query tokens", q.shape[0], plan.total_qo);
  expect_dim(q, "q", 1, s.num_qo_heads, "num_qo_heads");
  expect_dim(q, "q", 2, s.head_dim_qk, "head_dim_qk");
  expect_last_dim_contiguous(q, "q");

  expect_defined(out.out, "out");
  expect_device(out.out, "out", dev);
  if (out.out.dtype != s.o_dtype)
    fail_arg("out: dtype {}; the plan was made for o_dtype {}", to_string(out.out.dtype), to_string(s.o_dtype));
  expect_ndim(out.out, "out", 3, "[total_qo, num_qo_heads, head_dim_vo]");
  expect_dim(out.out, "out", 0, plan.total_qo, "total_qo");
  expect_dim(out.out, "out", 1, s.num_qo_heads, "num_qo_heads");
  expect_dim(out.out, "out", 2, s.head_dim_vo, "head_dim_vo");
  expect_last_dim_contiguous(out.out, "out");
  if (out.lse.defined()) {
    expect_device(out.lse, "lse", dev);
    expect_dtype(out.lse, "lse", {DType::kFloat32});
    expect_ndim(out.lse, "lse", 2, "[total_qo, num_qo_heads]");
    expect_dim(out.lse, "lse", 0, plan.total_qo, "total_qo");
    expect_dim(out.lse, "lse", 1, s.num_qo_heads, "num_qo_heads");
    expect_last_dim_contiguous(out.lse, "lse");
  }
  for (auto [in, name] : {std::pair{&q, "q"}, std::pair{&k_view, "kv.k"}, std::pair{&v_view, "kv.v"}}) {
    detail::expect_no_overlap(out.out, "out", *in, name);
    detail::expect_no_overlap(out.lse, "lse", *in, name);
  }
  detail::expect_no_overlap(out.lse, "lse", out.out, "out");

  AttentionParams& p = prepared.params;
  p = AttentionParams{};
  p.variant = variant_params(plan, options);
  check_workspace(plan, ws);

  AttentionConfig config;
  config.device = dev;
  config.kind = plan.kind;
  config.kv_format = plan.kv_format;
  config.kv_layout = layout;
  config.shape = s;
  config.page_size = plan.page_size;
  config.custom_mask = p.variant.custom_mask != nullptr;
  config.rope = p.variant.rope.enabled != 0;
  detail::Backend& backend = detail::require(config);
  prepared.backend = &backend;

  p.q = q.data;
  p.q_dtype = q.dtype;
  p.q_stride_token = q.strides[0];
  p.q_stride_head = q.strides[1];
  p.o = out.out.data;
  p.o_dtype = out.out.dtype;
  p.o_stride_token = out.out.strides[0];
  p.o_stride_head = out.out.strides[1];
  p.lse = out.lse.defined() ? out.lse.ptr<float>() : nullptr;
  p.lse_stride_token = out.lse.defined() ? out.lse.strides[0] : 0;
  p.kv = kv;
  p.batch_size = plan.batch_size;
  p.num_qo_heads = s.num_qo_heads;
  p.num_kv_heads = s.num_kv_heads;
  p.head_dim_qk = s.head_dim_qk;
  p.head_dim_vo = s.head_dim_vo;
  p.num_qo_tokens = q.shape[0];
  p.item_capacity = plan.item_capacity;
  p.merge_capacity = plan.merge_capacity;
  p.qo_tile = plan.qo_tile;
  p.tile_rows = plan.tile_rows;
  // The merge kernel's shape follows the plan's largest merge; a deterministic plan takes the shape of the largest
  // merges for all of them, or a request's merge would be summed in another order once a batch held a larger one.
  p.max_merge_states = plan.deterministic ? std::numeric_limits<int32_t>::max() : plan.max_merge_states;
  p.kv_stages = plan.kv_stages;
  p.schedule_ctas = plan.schedule_ctas;
  p.programmatic_launch = options.programmatic_launch ? 1 : 0;
  PlanView& host_view = prepared.host_view;
  host_view = plan_view(plan, ws.data);
  p.partial_o = host_view.partial_o;
  p.partial_lse = host_view.partial_lse;
  if (backend.plan_in_device_memory()) {
    if (plan.uploaded_to == nullptr || plan.uploaded_to != ws.data)
      fail(ErrorKind::kPlanMismatch, "plan: not uploaded to this workspace ({}); call upload_plan(plan, workspace, "
           "staging, ...) after planning and before run()", ws.data);
    char* const base = static_cast<char*>(ws.data);
    const detail::PlanLayout l = detail::plan_layout(plan);
    p.plan = reinterpret_cast<const PlanView*>(base);
    p.items = reinterpret_cast<const WorkItem*>(base + l.items);
    if (plan.schedule_ctas > 0) p.schedule = reinterpret_cast<const int32_t*>(base + l.schedule);
    if (plan.merge_counters > 0) p.merge_counters = reinterpret_cast<int32_t*>(base + l.merge_counters);
    if (plan.merge_flags > 0) p.merge_flags = reinterpret_cast<int32_t*>(base + l.merge_flags);
  } else {
    host_view.qo_indptr = plan.qo_indptr.data();
    host_view.kv_len = plan.kv_len.data();
    host_view.items = plan.items.data();
    host_view.merges = plan.merges.data();
    p.plan = &host_view;
    p.items = host_view.items;
  }
}

KVParams detail::paged_run_params(const AttentionPlan& plan, const PagedKVCache& kv) {
  if (plan.kv_format == KVFormat::kRagged)
    fail(ErrorKind::kPlanMismatch, "kv: a paged cache given, but the plan was made for ragged KV");
  return paged_params(plan, kv);
}

namespace {

void launch(const AttentionPlan& plan, const TensorView& q, const KVParams& kv, const TensorView& k_view,
            const TensorView& v_view, KVLayout layout, const Outputs& out, const AttentionOptions& options,
            const Workspace& ws, Stream stream) {
  detail::PreparedRun prepared;
  detail::prepare_run(prepared, plan, q, kv, k_view, v_view, layout, out, options, ws);
  prepared.backend->attention(prepared.params, plan.kind, stream);
}

// A [kv_len, heads, dim] view of a single request's K or V given in either layout.
TensorView as_nhd(const TensorView& t, KVLayout layout, const char* name) {
  expect_defined(t, name);
  expect_ndim(t, name, 3, layout == KVLayout::kNHD ? "NHD [kv_len, num_kv_heads, head_dim]" : "HND [num_kv_heads, kv_len, head_dim]");
  if (layout == KVLayout::kNHD) return t;
  TensorView r = t;
  r.shape[0] = t.shape[1];
  r.shape[1] = t.shape[0];
  r.strides[0] = t.strides[1];
  r.strides[1] = t.strides[0];
  return r;
}

// The one-request plan of single_decode / single_prefill.
AttentionPlan single_plan(PlanKind kind, const AttentionShape& shape, int32_t qo_len, int32_t kv_len, Device device,
                          bool causal) {
  int32_t qo_indptr[2] = {0, qo_len};
  int32_t kv_indptr[2] = {0, kv_len};
  BatchPlanArgs args;
  args.device = device;
  args.shape = shape;
  args.qo_indptr = TensorView(qo_indptr, DType::kInt32, {2});
  args.set_ragged(TensorView(kv_indptr, DType::kInt32, {2}));
  // The CPU runs one request on its thread pool's queue without splits; a GPU needs them to fill its SMs.
  args.options.disable_split = device.type == DeviceType::kCPU;
  args.options.causal = causal;
  return kind == PlanKind::kDecode ? plan_batch_decode(args) : plan_batch_prefill(args);
}

// Bytes past the plan's workspace where a device run keeps the KV offsets {0, kv_len}.
constexpr size_t kSingleIndptrBytes = 256;

void single(PlanKind kind, const TensorView& q3, const TensorView& k, const TensorView& v, KVLayout layout,
            const Outputs& outputs, const AttentionOptions& options, float k_scale, float v_scale, Stream stream,
            const Workspace& workspace) {
  if (layout != KVLayout::kNHD && layout != KVLayout::kHND)
    fail_arg("layout: {}; expected one of {{NHD, HND}}", static_cast<int>(layout));
  RaggedKV kv;
  kv.k = as_nhd(k, layout, "k");
  kv.v = as_nhd(v, layout, "v");
  kv.k_scale = k_scale;
  kv.v_scale = v_scale;
  expect_defined(q3, "q");
  const AttentionShape shape{static_cast<int32_t>(q3.shape[1]), static_cast<int32_t>(kv.k.shape[1]),
                             static_cast<int32_t>(q3.shape[2]), static_cast<int32_t>(kv.v.shape[2]), q3.dtype,
                             kv.k.dtype, outputs.out.defined() ? outputs.out.dtype : q3.dtype};
  const int32_t kv_len = static_cast<int32_t>(kv.k.shape[0]);
  AttentionPlan plan = single_plan(kind, shape, static_cast<int32_t>(q3.shape[0]), kv_len, q3.device, options.causal);
  int32_t kv_indptr[2] = {0, kv_len};
  if (q3.device.type == DeviceType::kCPU) {
    kv.indptr = TensorView(kv_indptr, DType::kInt32, {2});
    run(plan, q3, kv, outputs, options, Workspace{}, stream);
    return;
  }
  const size_t needed = plan.workspace_bytes + kSingleIndptrBytes;
  if (workspace.data == nullptr || workspace.bytes < needed)
    fail(ErrorKind::kWorkspace, "workspace: {} bytes at {}; single_{} on {} needs {} bytes of device memory "
         "(single_workspace_bytes)", workspace.bytes, workspace.data, kind == PlanKind::kDecode ? "decode" : "prefill",
         to_string(q3.device), needed);
  // Pageable staging: the copies wait for the stream and have read the host bytes when they return.
  std::vector<char> staging(plan.staging_bytes);
  const Workspace plan_ws{workspace.data, plan.workspace_bytes};
  upload_plan(plan, plan_ws, staging.data(), staging.size(), stream);
  void* indptr_device = static_cast<char*>(workspace.data) + plan.workspace_bytes;
  detail::backend_for(q3.device).copy_to_device(indptr_device, kv_indptr, sizeof(kv_indptr), stream);
  kv.indptr = TensorView(indptr_device, DType::kInt32, {2}, q3.device);
  run(plan, q3, kv, outputs, options, plan_ws, stream);
}

}  // namespace

void upload_plan(AttentionPlan& plan, const Workspace& workspace, void* host_staging, size_t host_staging_bytes,
                 Stream stream) {
  if (plan.version != AttentionPlan::kVersion)
    fail(ErrorKind::kPlanMismatch, "plan: version {}; this library runs plans of version {}", plan.version,
         AttentionPlan::kVersion);
  check_workspace(plan, workspace);
  detail::Backend& backend = detail::backend_for(plan.device);
  if (backend.plan_in_device_memory()) {
    if (host_staging == nullptr || host_staging_bytes < plan.staging_bytes)
      fail_arg("host_staging: {} bytes at {}; the plan needs {} bytes of page-locked host memory "
               "(AttentionPlan::staging_bytes)", host_staging_bytes, host_staging, plan.staging_bytes);
    char* stage = static_cast<char*>(host_staging);
    char* base = static_cast<char*>(workspace.data);
    PlanView v = plan_view(plan, workspace.data);
    const detail::PlanLayout l = detail::plan_layout(plan);
    auto place = [&](const auto& values, size_t off) {
      std::memcpy(stage + off, values.data(), values.size() * sizeof(values[0]));
      return reinterpret_cast<decltype(values.data())>(base + off);
    };
    v.qo_indptr = place(plan.qo_indptr, l.qo_indptr);
    v.kv_len = place(plan.kv_len, l.kv_len);
    v.items = place(plan.items, l.items);
    v.merges = place(plan.merges, l.merges);
    place(plan.schedule, l.schedule);  // AttentionParams::schedule points there (prepare_run)
    // The decode kernel's merge counters start at zero; its merging CTAs leave them at zero (AttentionParams).
    std::memset(stage + l.merge_counters, 0, static_cast<size_t>(plan.merge_counters) * sizeof(int32_t));
    // So do the streamed merges' flags; the merge kernel leaves them at zero.
    std::memset(stage + l.merge_flags, 0, static_cast<size_t>(plan.merge_flags) * sizeof(int32_t));
    std::memcpy(stage, &v, sizeof(v));
    backend.copy_to_device(workspace.data, stage, plan.metadata_bytes, stream);
  }
  plan.uploaded_to = workspace.data;
}

void run(const AttentionPlan& plan, const TensorView& q, const PagedKVCache& kv, const Outputs& outputs,
         const AttentionOptions& options, const Workspace& workspace, Stream stream) {
  const KVParams p = detail::paged_run_params(plan, kv);
  launch(plan, q, p, kv.k, kv.v, kv.layout, outputs, options, workspace, stream);
}

void run(const AttentionPlan& plan, const TensorView& q, const RaggedKV& kv, const Outputs& outputs,
         const AttentionOptions& options, const Workspace& workspace, Stream stream) {
  const KVParams p = ragged_params(plan, kv);
  launch(plan, q, p, kv.k, kv.v, KVLayout::kNHD, outputs, options, workspace, stream);
}

void single_decode(const TensorView& q, const TensorView& k, const TensorView& v, KVLayout layout,
                   const Outputs& outputs, const AttentionOptions& options, float k_scale, float v_scale,
                   Stream stream, const Workspace& workspace) {
  expect_defined(q, "q");
  expect_ndim(q, "q", 2, "[num_qo_heads, head_dim]");
  TensorView q3 = q;
  q3.ndim = 3;
  q3.shape[0] = 1, q3.shape[1] = q.shape[0], q3.shape[2] = q.shape[1];
  q3.strides[0] = q.shape[0] * q.strides[0], q3.strides[1] = q.strides[0], q3.strides[2] = q.strides[1];
  Outputs o3 = outputs;
  if (outputs.out.defined()) {
    expect_ndim(outputs.out, "out", 2, "[num_qo_heads, head_dim_vo]");
    const TensorView& t = outputs.out;
    o3.out.ndim = 3;
    o3.out.shape[0] = 1, o3.out.shape[1] = t.shape[0], o3.out.shape[2] = t.shape[1];
    o3.out.strides[0] = t.shape[0] * t.strides[0], o3.out.strides[1] = t.strides[0], o3.out.strides[2] = t.strides[1];
  }
  if (outputs.lse.defined()) {
    expect_ndim(outputs.lse, "lse", 1, "[num_qo_heads]");
    const TensorView& t = outputs.lse;
    o3.lse.ndim = 2;
    o3.lse.shape[0] = 1, o3.lse.shape[1] = t.shape[0];
    o3.lse.strides[0] = t.shape[0] * t.strides[0], o3.lse.strides[1] = t.strides[0];
  }
  single(PlanKind::kDecode, q3, k, v, layout, o3, options, k_scale, v_scale, stream, workspace);
}

void single_prefill(const TensorView& q, const TensorView& k, const TensorView& v, KVLayout layout,
                    const Outputs& outputs, const AttentionOptions& options, float k_scale, float v_scale,
                    Stream stream, const Workspace& workspace) {
  expect_defined(q, "q");
  expect_ndim(q, "q", 3, "[qo_len, num_qo_heads, head_dim]");
  single(PlanKind::kPrefill, q, k, v, layout, outputs, options, k_scale, v_scale, stream, workspace);
}

size_t single_workspace_bytes(PlanKind kind, const AttentionShape& shape, int32_t qo_len, int32_t kv_len,
                              Device device, bool causal) {
  if (device.type == DeviceType::kCPU) return 0;
  return single_plan(kind, shape, qo_len, kv_len, device, causal).workspace_bytes + kSingleIndptrBytes;
}

}  // namespace attnforge
