#include "batch.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <utility>

#include "arrays.h"
#include "core/check.h"

namespace nb = nanobind;

namespace attnforge::python {

namespace {

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

size_t bytes_of(const TensorView& t) { return static_cast<size_t>(t.numel()) * dtype_bytes(t.dtype); }

// Views one [num_pages, 2, ...] tensor (K and V of a page side by side) as two 4-D views.
void split_combined(const TensorView& kv, KVLayout layout, TensorView& k, TensorView& v) {
  if (kv.ndim != 5 || kv.shape[1] != 2)
    detail::fail_arg("paged_kv_cache: shape {}; expected a (k_cache, v_cache) pair or one tensor {}", shape_string(kv),
                     layout == KVLayout::kNHD ? "[num_pages, 2, page_size, num_kv_heads, head_dim] (NHD)"
                                              : "[num_pages, 2, num_kv_heads, page_size, head_dim] (HND)");
  k = kv;
  k.ndim = 4;
  for (int i = 1; i < 4; ++i) k.shape[i] = kv.shape[i + 1], k.strides[i] = kv.strides[i + 1];
  v = k;
  v.data = static_cast<char*>(kv.data) + kv.strides[1] * dtype_bytes(kv.dtype);
}

}  // namespace

TensorView* BatchAttention::Tables::find(const std::string& name) {
  if (name == "kv_indptr") return &kv_indptr;
  if (name == "kv_indices") return &kv_indices;
  if (name == "last_page_len") return &last_page_len;
  if (name == "block_table") return &block_table;
  if (name == "seq_lens") return &seq_lens;
  if (name == "mask") return &mask;
  if (name == "mask_indptr") return &mask_indptr;
  if (name == "alibi_slopes") return &alibi_slopes;
  detail::fail_arg("metadata: {} is not a metadata array name", name);
}

BatchAttention::BatchAttention(nb::handle float_workspace, KVLayout layout) : layout_(layout) {
  const TensorView ws = view_of(float_workspace, "float_workspace_buffer");
  if (!ws.is_contiguous())
    detail::fail_arg("float_workspace_buffer: strides {}; expected a contiguous buffer", strides_string(ws));
  device_ = ws.device;
  // attnforge needs a 256-byte aligned workspace; numpy allocations are only 64-byte aligned, so start inside.
  const auto address = reinterpret_cast<uintptr_t>(ws.data);
  const size_t bytes = bytes_of(ws), skip = (256 - address % 256) % 256;
  ws_ = reinterpret_cast<void*>(address + skip);
  ws_usable_ = bytes > skip ? bytes - skip : 0;
}

const AttentionPlan& BatchAttention::attention_plan() const {
  if (!planned_) detail::fail_arg("plan: run() or a plan query before plan(); call plan() first");
  return plan_;
}

void BatchAttention::plan(const PlanRequest& r, nb::handle qo_indptr, const std::vector<MetadataArray>& metadata,
                          const AttentionOptions& defaults, uintptr_t stream) {
  planned_ = false;
  Tables host;
  for (const auto& [name, array, destination] : metadata) {
    TensorView& t = *host.find(name);
    t = view_of(array, name.c_str());
    detail::expect_host(t, name.c_str());
    if (!t.is_contiguous()) detail::fail_arg("{}: strides {}; expected a contiguous host array", name, strides_string(t));
  }
  BatchPlanArgs args;
  args.device = device_;
  args.shape = r.shape;
  args.qo_indptr = optional_view(qo_indptr, "qo_indptr");
  args.kv_format = r.kv_format;
  args.page_size = r.page_size;
  args.kv_indptr = host.kv_indptr;
  args.last_page_len = host.last_page_len;
  args.seq_lens = host.seq_lens;
  args.options = r.options;
  plan_ = r.kind == PlanKind::kDecode ? plan_batch_decode(args) : plan_batch_prefill(args);

  if (device_.type == DeviceType::kCPU) {
    used_bytes_ = plan_.workspace_bytes;
    if (ws_usable_ < used_bytes_)
      detail::fail(ErrorKind::kWorkspace,
                   "float_workspace_buffer: {} usable bytes (from its first 256-byte aligned address); this plan needs "
                   "{} (AttentionPlan::workspace_bytes); allocate a larger buffer",
                   ws_usable_, used_bytes_);
    upload_plan(plan_, Workspace{ws_, ws_usable_});
    tables_ = host;  // run() reads the caller's host arrays, which the Python wrapper keeps
  } else {
    place_on_device(metadata, host, reinterpret_cast<Stream>(stream));
  }
  defaults_ = defaults;
  defaults_.alibi_slopes = tables_.alibi_slopes;
  defaults_.custom_mask = CustomMask{tables_.mask, tables_.mask_indptr};
  planned_ = true;
}

// CUDA: the plan's metadata goes to the start of the workspace (upload_plan) and each metadata array either to the
// fixed buffer given for it or to a region after the plan's bytes; all of it through one pinned staging slot and
// asynchronous copies on `stream`. Same batch size, same shape: same addresses, so a captured graph replays a re-plan.
void BatchAttention::place_on_device(const std::vector<MetadataArray>& metadata, Tables& host, Stream stream) {
  struct Copy {
    const TensorView* host_view;
    char* dst;
  };
  std::vector<Copy> copies;
  size_t ws_offset = align256(plan_.workspace_bytes), staging_bytes = align256(plan_.staging_bytes);
  for (const auto& [name, array, destination] : metadata) {
    const TensorView& h = *host.find(name);
    TensorView& run_view = *tables_.find(name);
    run_view = h;
    run_view.device = device_;
    char* dst;
    if (destination.is_none()) {
      dst = static_cast<char*>(ws_) + ws_offset;
      ws_offset += align256(bytes_of(h));
    } else {
      const std::string buffer_name = name + " buffer";
      const TensorView d = view_of(destination, buffer_name.c_str());
      detail::expect_device(d, buffer_name.c_str(), device_);
      detail::expect_dtype(d, buffer_name.c_str(), {h.dtype});
      if (!d.is_contiguous() || d.numel() < h.numel())
        detail::fail_arg("{}: {} contiguous elements of shape {}; {} needs {}", buffer_name, d.numel(), shape_string(d),
                         name, h.numel());
      dst = static_cast<char*>(d.data);
    }
    int64_t stride = 1;  // the device copy is dense
    for (int i = h.ndim - 1; i >= 0; --i) run_view.strides[i] = stride, stride *= h.shape[i];
    run_view.data = dst;
    copies.push_back({&h, dst});
    staging_bytes += align256(bytes_of(h));
  }
  used_bytes_ = ws_offset;
  if (ws_usable_ < used_bytes_)
    detail::fail(ErrorKind::kWorkspace,
                 "float_workspace_buffer: {} usable bytes (from its first 256-byte aligned address); this plan needs {}: "
                 "{} for the plan (AttentionPlan::workspace_bytes) and {} for the page table and masks on the device; "
                 "allocate a larger buffer",
                 ws_usable_, used_bytes_, plan_.workspace_bytes, used_bytes_ - align256(plan_.workspace_bytes));

  char* slot = static_cast<char*>(staging_.acquire(staging_bytes, device_.id));
  upload_plan(plan_, Workspace{ws_, ws_usable_}, slot, plan_.staging_bytes, stream);
  size_t offset = align256(plan_.staging_bytes);
  for (const Copy& c : copies) {
    const size_t n = bytes_of(*c.host_view);
    if (n == 0) continue;
    std::memcpy(slot + offset, c.host_view->data, n);
    copy_to_device_async(c.dst, slot + offset, n, device_.id, stream);
    offset += align256(n);
  }
  staging_.release(stream);
}

BatchAttention::Call BatchAttention::prepare(nb::handle q, nb::handle kv_a, nb::handle kv_b, nb::handle out,
                                             nb::handle lse, uintptr_t stream, const Overrides& o) const {
  const AttentionPlan& plan = attention_plan();
  Call c;
  c.q = view_of(q, "q");
  c.outputs = Outputs{optional_view(out, "out"), optional_view(lse, "lse")};  // out: None for context-parallel slots
  c.options = defaults_;
  if (o.sm_scale) c.options.sm_scale = *o.sm_scale;
  if (o.q_scale) {
    // FlashInfer folds the query's dequantization scale into the softmax scale.
    const float base = c.options.sm_scale > 0.f ? c.options.sm_scale
                                                : 1.f / std::sqrt(static_cast<float>(plan.shape.head_dim_qk));
    c.options.sm_scale = base * *o.q_scale;
  }
  if (o.window_left) c.options.window_left = *o.window_left;
  if (o.logits_soft_cap) c.options.logits_soft_cap = *o.logits_soft_cap;
  if (o.enable_pdl) c.options.programmatic_launch = *o.enable_pdl;
  c.options.sinks = optional_view(o.sinks, "sinks");
  c.stream = reinterpret_cast<Stream>(stream);
  if (plan.kv_format == KVFormat::kRagged) {
    c.ragged.k = view_of(kv_a, "k");
    c.ragged.v = view_of(kv_b, "v");
    if (layout_ == KVLayout::kHND) {  // [num_kv_heads, total_kv, head_dim]: the same rows with swapped strides
      for (TensorView* t : {&c.ragged.k, &c.ragged.v}) {
        if (t->ndim != 3) break;  // run() reports the rank
        std::swap(t->shape[0], t->shape[1]);
        std::swap(t->strides[0], t->strides[1]);
      }
    }
    c.ragged.indptr = tables_.kv_indptr;
    c.ragged.k_scale = o.k_scale.value_or(1.f);
    c.ragged.v_scale = o.v_scale.value_or(1.f);
    return c;
  }
  PagedKVCache& cache = c.paged;
  if (kv_b.is_none()) {
    split_combined(view_of(kv_a, "paged_kv_cache"), layout_, cache.k, cache.v);
  } else {
    cache.k = view_of(kv_a, "paged_kv_cache[0]");
    cache.v = view_of(kv_b, "paged_kv_cache[1]");
  }
  cache.layout = layout_;
  cache.table = plan.kv_format == KVFormat::kPagedCSR
                    ? PageTable::csr(tables_.kv_indptr, tables_.kv_indices, tables_.last_page_len)
                    : PageTable::blocks(tables_.block_table, tables_.seq_lens);
  cache.k_scale = o.k_scale.value_or(1.f);
  cache.v_scale = o.v_scale.value_or(1.f);
  return c;
}

void BatchAttention::execute(const Call& c) const {
  const Workspace ws{ws_, ws_usable_};
  if (plan_.kv_format == KVFormat::kRagged)
    attnforge::run(plan_, c.q, c.ragged, c.outputs, c.options, ws, c.stream);
  else
    attnforge::run(plan_, c.q, c.paged, c.outputs, c.options, ws, c.stream);
}

void BatchAttention::run(nb::handle q, nb::handle kv_a, nb::handle kv_b, nb::handle out, nb::handle lse,
                         uintptr_t stream, const Overrides& overrides) {
  const Call c = prepare(q, kv_a, kv_b, out, lse, stream, overrides);
  nb::gil_scoped_release release;
  execute(c);
}

void BatchAttention::run_variant(nb::handle q, nb::handle kv_a, nb::handle kv_b, nb::handle out, nb::handle lse,
                                 uintptr_t stream, const Overrides& overrides, const CustomVariant& variant,
                                 const std::vector<float>& scalars, const std::vector<nb::handle>& tensors) {
  if (plan_.kv_format == KVFormat::kRagged)
    detail::fail(ErrorKind::kUnsupported,
                 "variant {}: custom variants run on a paged KV cache; this plan is for ragged KV", variant.name);
  const Call c = prepare(q, kv_a, kv_b, out, lse, stream, overrides);
  VariantInputs inputs;
  inputs.scalars = scalars;
  for (size_t i = 0; i < tensors.size(); ++i)
    inputs.tensors.push_back(view_of(tensors[i], fmt::format("variant_tensors[{}]", i).c_str()).data);
  nb::gil_scoped_release release;  // the first call compiles the variant (seconds); other threads may run
  attnforge::run_variant(plan_, c.q, c.paged, c.outputs, c.options, variant, inputs, Workspace{ws_, ws_usable_},
                         c.stream);
}

void* gathered_states(nb::handle buffer, const RankStateLayout& layout, int32_t world_size, Device* device) {
  const TensorView g = view_of(buffer, "gathered_buffer");
  if (!g.is_contiguous())
    detail::fail_arg("gathered_buffer: strides {}; expected a contiguous buffer", strides_string(g));
  if (world_size < 1) detail::fail_arg("world_size: {}; expected >= 1", world_size);
  const auto address = reinterpret_cast<uintptr_t>(g.data);
  const size_t bytes = bytes_of(g), skip = (256 - address % 256) % 256;
  const size_t needed = static_cast<size_t>(world_size) * layout.rank_bytes();
  if (bytes < skip + needed)
    detail::fail(ErrorKind::kWorkspace,
                 "gathered_buffer: {} bytes ({} usable from its first 256-byte aligned address); {} ranks' states need "
                 "{} ({} x RankStateLayout::rank_bytes {})",
                 bytes, bytes > skip ? bytes - skip : 0, world_size, needed, world_size, layout.rank_bytes());
  *device = g.device;
  return reinterpret_cast<void*>(address + skip);
}

void BatchAttention::check_context_parallel(KVPartition partition) const {
  if (attention_plan().kv_format == KVFormat::kRagged)
    detail::fail(ErrorKind::kUnsupported, "context parallelism: this plan is for ragged KV; it splits paged KV caches");
  check_context_parallel_options(defaults_, partition);
}

void BatchAttention::run_context_parallel(nb::handle q, nb::handle kv_a, nb::handle kv_b, nb::handle out,
                                          nb::handle lse, uintptr_t stream, const Overrides& overrides,
                                          const RankStateLayout& layout, KVPartition partition, nb::handle gathered,
                                          int32_t rank, int32_t world_size, uintptr_t communicator) {
  check_context_parallel(partition);
  Device buffer_device;
  void* states = gathered_states(gathered, layout, world_size, &buffer_device);
  detail::expect_device(TensorView(states, DType::kUInt8, {1}, buffer_device), "gathered_buffer", device_);
  const Call c = prepare(q, kv_a, kv_b, out, lse, stream, overrides);
  check_context_parallel_options(c.options, partition);  // the per-layer options too
  const Workspace ws{ws_, ws_usable_};
  nb::gil_scoped_release release;
  if (communicator != 0) {
    attnforge::run_context_parallel(plan_, c.q, c.paged, c.outputs, c.options, ws, layout, states, rank, world_size,
                                    reinterpret_cast<void*>(communicator), c.stream);
    return;
  }
  if (rank < 0 || rank >= world_size) detail::fail_arg("rank: {}; expected in [0, {})", rank, world_size);
  attnforge::run(plan_, c.q, c.paged, layout.rank_outputs(states, rank, device_), c.options, ws, c.stream);
}

double BatchAttention::time_repeated_run(nb::handle q, nb::handle kv_a, nb::handle kv_b, nb::handle out,
                                         nb::handle lse, uintptr_t stream, int iterations) {
  const Call c = prepare(q, kv_a, kv_b, out, lse, stream, Overrides{});
  nb::gil_scoped_release release;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) execute(c);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace attnforge::python
