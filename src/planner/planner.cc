// plan_batch_decode / plan_batch_prefill: validate host metadata, cut the batch into work items, size the
// workspace. Runs on the host only; never touches device memory.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <vector>

#include "attnforge/ops.h"
#include "backends/backend.h"
#include "core/check.h"
#include "core/shape.h"
#include "planner/heuristics.h"

namespace attnforge {

namespace {

using detail::fail_arg;

// Per-request KV lengths from the host metadata, validated.
std::vector<int32_t> kv_lengths(const BatchPlanArgs& a, int64_t batch) {
  std::vector<int32_t> lens(static_cast<size_t>(batch));
  switch (a.kv_format) {
    case KVFormat::kPagedCSR: {
      if (a.page_size < 1) fail_arg("page_size: {}; expected an integer >= 1", a.page_size);
      auto indptr = detail::host_int32(a.kv_indptr, "kv_indptr", batch + 1);
      auto last = detail::host_int32(a.last_page_len, "last_page_len", batch);
      detail::check_indptr(indptr, "kv_indptr");
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t pages = indptr[b + 1] - indptr[b];
        if (pages == 0) {
          if (last[b] != 0)
            fail_arg("last_page_len[{}]: {} for a request with no pages; expected 0", b, last[b]);
          lens[b] = 0;
          continue;
        }
        if (last[b] < 1 || last[b] > a.page_size)
          fail_arg("last_page_len[{}]: {}; expected a value in [1, page_size={}]", b, last[b], a.page_size);
        const int64_t len = (pages - 1) * a.page_size + last[b];
        if (len > INT32_MAX) fail_arg("request {}: {} KV tokens; at most {} are supported", b, len, INT32_MAX);
        lens[b] = static_cast<int32_t>(len);
      }
      break;
    }
    case KVFormat::kBlockTable: {
      if (a.page_size < 1) fail_arg("page_size: {}; expected an integer >= 1", a.page_size);
      auto seq = detail::host_int32(a.seq_lens, "seq_lens", batch);
      for (int64_t b = 0; b < batch; ++b) {
        if (seq[b] < 0) fail_arg("seq_lens[{}]: {}; expected a value >= 0", b, seq[b]);
        lens[b] = seq[b];
      }
      break;
    }
    case KVFormat::kRagged: {
      auto indptr = detail::host_int32(a.kv_indptr, "kv_indptr", batch + 1);
      detail::check_indptr(indptr, "kv_indptr");
      for (int64_t b = 0; b < batch; ++b) lens[b] = indptr[b + 1] - indptr[b];
      break;
    }
  }
  return lens;
}

int64_t batch_of(const BatchPlanArgs& a) {
  switch (a.kv_format) {
    case KVFormat::kPagedCSR:
    case KVFormat::kRagged:
      detail::expect_defined(a.kv_indptr, "kv_indptr");
      detail::expect_ndim(a.kv_indptr, "kv_indptr", 1, "[batch + 1]");
      if (a.kv_indptr.shape[0] < 1) fail_arg("kv_indptr: has 0 elements; expected batch + 1 >= 1");
      return a.kv_indptr.shape[0] - 1;
    case KVFormat::kBlockTable:
      detail::expect_defined(a.seq_lens, "seq_lens");
      detail::expect_ndim(a.seq_lens, "seq_lens", 1, "[batch]");
      return a.seq_lens.shape[0];
  }
  fail_arg("kv_format: {}; expected one of {{paged-csr, block-table, ragged}}", static_cast<int>(a.kv_format));
}

// Longest work first: devices start items in plan order (a GPU launches an item's CTAs, one per KV head, in that
// order; the CPU's pool takes tasks in it), so heavy items start first and light ones fill the tail of the last
// wave, as in list scheduling by longest processing time. Decode plans only: the prefill kernel walks a request's
// query tiles from its last (heaviest) one, one KV head at a time, and the sorted order with heads together cost
// the ragged prefill case 6% on the H200 (189.7 -> 178.6 TFLOP/s at 548c3f2: tiles of one head share its K/V in
// L2). Work is the item's query rows x the KV it reads (causal tiles: up to their diagonal). A merge's pieces move
// together and stay consecutive, ranked by their longest piece; partial rows keep their (disjoint) assignment.
// Ties keep request order. (A model of the decode bench's Zipf batch, 64 requests totalling 256K tokens in 396 CTA
// slots: 7.9% slower than uniform lengths in request order, 3.5% sorted; measured on the H200: 11.2% at 3354b9e,
// level with uniform at 8f1b143.)
void order_longest_first(AttentionPlan& plan) {
  const int32_t n = static_cast<int32_t>(plan.items.size());
  std::vector<int32_t> merge_of(static_cast<size_t>(n), -1);
  for (size_t m = 0; m < plan.merges.size(); ++m)
    for (int32_t k = 0; k < plan.merges[m].num_items; ++k) merge_of[plan.merges[m].first_item + k] = static_cast<int32_t>(m);
  struct Unit {
    int64_t work;
    int32_t first, count, merge;
  };
  std::vector<Unit> units;
  auto work_of = [&](const WorkItem& it) {
    return static_cast<int64_t>(it.qo_end - it.qo_begin) * (it.kv_end - it.kv_begin);
  };
  for (int32_t i = 0; i < n;) {
    const int32_t m = merge_of[i];
    const int32_t count = m >= 0 ? plan.merges[m].num_items : 1;
    int64_t work = 0;
    for (int32_t k = i; k < i + count; ++k) work = std::max(work, work_of(plan.items[k]));
    units.push_back({work, i, count, m});
    i += count;
  }
  std::stable_sort(units.begin(), units.end(), [](const Unit& x, const Unit& y) { return x.work > y.work; });
  std::vector<WorkItem> items;
  items.reserve(static_cast<size_t>(n));
  for (const Unit& u : units) {
    if (u.merge >= 0) plan.merges[u.merge].first_item = static_cast<int32_t>(items.size());
    items.insert(items.end(), plan.items.begin() + u.first, plan.items.begin() + u.first + u.count);
  }
  plan.items = std::move(items);
}

AttentionPlan make_plan(const BatchPlanArgs& a, PlanKind kind) {
  AttentionShape shape = detail::normalized(a.shape);
  AttentionConfig config;
  config.device = a.device;
  config.kind = kind;
  config.kv_format = a.kv_format;
  config.shape = shape;
  config.page_size = a.page_size;
  detail::Backend& backend = detail::require(config);

  const int64_t batch = batch_of(a);
  AttentionPlan plan;
  plan.kind = kind;
  plan.device = a.device;
  plan.shape = shape;
  plan.kv_format = a.kv_format;
  plan.page_size = a.kv_format == KVFormat::kRagged ? 1 : a.page_size;
  plan.batch_size = static_cast<int32_t>(batch);
  plan.kv_len = kv_lengths(a, batch);

  // Query rows per request.
  if (a.qo_indptr.defined()) {
    auto qo = detail::host_int32(a.qo_indptr, "qo_indptr", batch + 1);
    detail::check_indptr(qo, "qo_indptr");
    plan.qo_indptr.assign(qo.begin(), qo.end());
  } else if (kind == PlanKind::kDecode) {
    plan.qo_indptr.resize(static_cast<size_t>(batch + 1));
    for (int64_t b = 0; b <= batch; ++b) plan.qo_indptr[b] = static_cast<int32_t>(b);
  } else {
    fail_arg("qo_indptr: required by plan_batch_prefill but not given");
  }
  plan.total_qo = plan.qo_indptr[batch];

  int32_t max_qo = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t qo_len = plan.qo_indptr[b + 1] - plan.qo_indptr[b];
    if (kind == PlanKind::kDecode && qo_len > planner::kMaxDecodeQueries)
      fail_arg("qo_indptr: request {} has {} query tokens; batch decode takes at most {} per request "
               "(use plan_batch_prefill)", b, qo_len, planner::kMaxDecodeQueries);
    if (a.options.causal && qo_len > plan.kv_len[b])
      fail_arg("request {}: qo_len {} > kv_len {} with causal; causal attention needs qo_len <= kv_len", b, qo_len,
               plan.kv_len[b]);
    max_qo = std::max(max_qo, qo_len);
  }
  plan.causal = a.options.causal;
  plan.deterministic = a.options.deterministic;

  const int32_t group = shape.num_qo_heads / shape.num_kv_heads;
  const int32_t tile_rows = a.options.tile_rows;
  if (tile_rows != 0) {
    const std::vector<int32_t> choices = backend.tile_rows_choices(shape);
    if (tile_rows < 0 || (!choices.empty() && std::find(choices.begin(), choices.end(), tile_rows) == choices.end()))
      fail_arg("options.tile_rows: {}; expected 0 (the backend's choice) or {} for head_dim {} on {}", tile_rows,
               choices.empty() ? std::string("a positive number") : fmt::format("one of {{{}}}", fmt::join(choices, ", ")),
               shape.head_dim_qk, to_string(a.device));
  }
  auto target_rows = [&](double packed_rows) {
    return tile_rows > 0 ? tile_rows : backend.target_tile_rows(shape, packed_rows);
  };
  const double avg_packed_rows = batch > 0 ? static_cast<double>(plan.total_qo) * group / batch : 0.0;
  plan.tile_rows = kind == PlanKind::kDecode ? 0 : target_rows(avg_packed_rows);
  plan.qo_tile = kind == PlanKind::kDecode ? std::max(1, max_qo)
                                           : planner::choose_qo_tile(group, std::max(1, max_qo), plan.tile_rows);
  // The query tile of a batch of long queries with these lengths: partial states are sized for it, so a plan cut
  // in short tiles does not shrink the workspace below what the same batch size needed before.
  const double longest_rows = static_cast<double>(max_qo) * group;
  const int32_t long_qo_tile =
      kind == PlanKind::kDecode ? plan.qo_tile
                                : planner::choose_qo_tile(group, std::max(1, max_qo), target_rows(longest_rows));

  // Query tiles and the KV each one reads (causal: up to the last row's diagonal).
  struct Tile {
    int32_t request, qo_begin, qo_end, kv_end;
  };
  std::vector<Tile> tiles;
  int64_t total_kv = 0, max_kv = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t qo_len = plan.qo_indptr[b + 1] - plan.qo_indptr[b];
    const int32_t kv_len = plan.kv_len[b];
    for (int32_t q0 = 0; q0 < qo_len; q0 += plan.qo_tile) {
      const int32_t q1 = std::min(qo_len, q0 + plan.qo_tile);
      const int32_t kv_end = a.options.causal ? kv_len - qo_len + q1 : kv_len;
      tiles.push_back({static_cast<int32_t>(b), q0, q1, kv_end});
      total_kv += kv_end;
      max_kv = std::max<int64_t>(max_kv, kv_end);
    }
  }

  int32_t workers =
      a.options.num_workers > 0 ? a.options.num_workers : backend.num_workers(shape, kind, plan.tile_rows);
  // A decode batch too small to fill the device may run with a deeper K/V pipeline (fewer CTAs, more bytes in flight
  // each): decided by the batch size, not the tiles (an empty request has none), so that a graph captured with one
  // plan launches the kernel every re-plan of the batch size wants. Not with a caller's worker count.
  if (kind == PlanKind::kDecode && a.options.num_workers == 0 && batch * shape.num_kv_heads < workers) {
    const detail::Backend::Pipeline deep = backend.small_batch_pipeline(shape);
    if (deep.stages > 0 && batch * shape.num_kv_heads < deep.workers) {
      workers = deep.workers;
      plan.kv_stages = deep.stages;
    }
  }
  planner::SplitInput in;
  in.num_tiles = static_cast<int64_t>(tiles.size());
  in.num_kv_heads = shape.num_kv_heads;
  in.total_kv = total_kv;
  in.max_kv = max_kv;
  in.num_workers = workers;
  in.align = std::max(16, plan.page_size);
  in.min_chunk = backend.min_split_tokens();
  // A GPU batch that leaves SMs idle is cut into exactly one wave of CTAs (piece counts rounded down); a batch
  // of a wave or more is cut toward two waves of shorter pieces (rounded up), which evens out the tail.
  const bool one_wave = backend.split_waves() == 1 &&
                        static_cast<int64_t>(tiles.size()) * shape.num_kv_heads < static_cast<int64_t>(workers);
  in.waves = one_wave ? 1 : 2;
  int32_t chunk = 0;
  if (a.options.deterministic) {
    if (a.options.fixed_split_size < 0)
      fail_arg("fixed_split_size: {}; expected 0 (default {}) or a positive token count", a.options.fixed_split_size,
               planner::kDefaultFixedSplit);
    chunk = a.options.fixed_split_size > 0 ? a.options.fixed_split_size : planner::kDefaultFixedSplit;
  } else if (!a.options.disable_split) {
    chunk = planner::choose_kv_chunk(in);
  }
  if (a.options.disable_split) chunk = 0;
  plan.kv_chunk = chunk;

  for (const Tile& t : tiles) {
    // Deterministic mode cuts at multiples of the fixed size; otherwise the pieces are balanced, aligned up to
    // the page or 16 tokens, so no item is a short remainder.
    int32_t piece = t.kv_end;
    if (chunk > 0 && t.kv_end > chunk) {
      piece = chunk;
      if (!a.options.deterministic) {
        const int32_t pieces = one_wave ? std::max(1, t.kv_end / chunk) : (t.kv_end + chunk - 1) / chunk;
        piece = ((t.kv_end + pieces - 1) / pieces + in.align - 1) / in.align * in.align;
      }
    }
    const int32_t pieces = piece > 0 ? (t.kv_end + piece - 1) / piece : 1;
    if (pieces <= 1) {
      plan.items.push_back({t.request, t.qo_begin, t.qo_end, 0, t.kv_end, -1, 0, 0, 0, 0, -1, 0, 0});
      continue;
    }
    plan.kv_chunk = std::max(plan.kv_chunk, piece);  // the longest piece, which rounding down can stretch
    plan.merges.push_back({t.request, t.qo_begin, t.qo_end, static_cast<int32_t>(plan.items.size()), pieces});
    plan.max_merge_states = std::max(plan.max_merge_states, pieces);
    for (int32_t p = 0; p < pieces; ++p) {
      const int32_t k0 = p * piece, k1 = std::min(t.kv_end, k0 + piece);
      plan.items.push_back(
          {t.request, t.qo_begin, t.qo_end, k0, k1, static_cast<int32_t>(plan.partial_rows), 0, 0, 0, 0, -1, 0, 0});
      plan.partial_rows += t.qo_end - t.qo_begin;
    }
  }

  if (kind == PlanKind::kDecode) order_longest_first(plan);

  plan.fingerprint = detail::batch_fingerprint(plan.kv_format, plan.page_size, plan.kv_len);
  // Each item carries its request's context (WorkItem): the kernels need no trip to the request arrays.
  std::vector<int32_t> page_lists(static_cast<size_t>(batch), 0);
  if (a.kv_format != KVFormat::kBlockTable) {
    auto indptr = detail::host_int32(a.kv_indptr, "kv_indptr", batch + 1);
    for (int64_t b = 0; b < batch; ++b) page_lists[static_cast<size_t>(b)] = indptr[b];
  }
  for (WorkItem& it : plan.items) {
    const size_t b = static_cast<size_t>(it.request);
    it.qo_start = plan.qo_indptr[b];
    it.qo_len = plan.qo_indptr[b + 1] - it.qo_start;
    it.kv_len = plan.kv_len[b];
    it.page_list = page_lists[b];
  }
  // A split item names its merge (WorkItem): its states' partial rows are consecutive from the first piece's.
  for (size_t m = 0; m < plan.merges.size(); ++m) {
    const MergeItem& mi = plan.merges[m];
    for (int32_t k = 0; k < mi.num_items; ++k) {
      WorkItem& it = plan.items[static_cast<size_t>(mi.first_item + k)];
      it.merge = static_cast<int32_t>(m);
      it.merge_states = mi.num_items;
      it.merge_row0 = plan.items[static_cast<size_t>(mi.first_item)].partial_row;
    }
  }
  const int32_t num_items = static_cast<int32_t>(plan.items.size());
  if (backend.plan_in_device_memory()) {
    // Any split of this batch size has at most tiles + target items (pieces = ceil(kv / chunk) and chunk >=
    // total_kv / target), so sizing by that bound lets a re-plan with other lengths reuse the workspace.
    int64_t bound = num_items;
    if (!a.options.deterministic && !a.options.disable_split)
      bound = std::max<int64_t>(bound, static_cast<int64_t>(tiles.size()) + planner::split_target_items(in));
    plan.item_capacity = static_cast<int32_t>(bound);
    plan.merge_capacity = static_cast<int32_t>(tiles.size());
    plan.partial_row_capacity =
        std::max<int64_t>(plan.partial_rows, static_cast<int64_t>(bound) * std::max(plan.qo_tile, long_qo_tile));
    // Merges in the decode kernel: decided by the batch size and shape (the split bound, not this plan's pieces),
    // so every re-plan of the batch size keeps the workspace layout and launches a captured graph holds.
    if (kind == PlanKind::kDecode && !a.options.deterministic && !a.options.disable_split) {
      const detail::Backend::DecodeMerge dm = backend.decode_merge(shape, plan.kv_stages);
      const int64_t row_blocks =
          dm.cta_rows > 0 ? (static_cast<int64_t>(plan.qo_tile) * group + dm.cta_rows - 1) / dm.cta_rows : 0;
      if (dm.cta_rows > 0 && static_cast<int64_t>(plan.batch_size) * shape.num_kv_heads <= dm.stream_max_pairs) {
        plan.merge_flags = static_cast<int64_t>(plan.item_capacity) * shape.num_kv_heads * row_blocks;
      } else if (planner::decode_merges_in_kernel(in, std::min(dm.cta_rows, plan.qo_tile * group), shape.head_dim_vo,
                                           dm.smem_bytes, in.waves == 1 ? dm.small_batch_passes : dm.passes)) {
        plan.merge_counters = static_cast<int64_t>(plan.merge_capacity) * shape.num_kv_heads * row_blocks;
      }
    }
    // A persistent prefill kernel's CTAs walk lists the planner balances (schedule_pairs): one list for each of
    // its CTAs whatever the batch (a CTA may have none), so that the grid and the lists' offsets are the same for
    // every re-plan a captured graph may replay.
    const int32_t ctas = kind == PlanKind::kPrefill ? backend.persistent_ctas(shape, plan.tile_rows) : 0;
    if (ctas > 0 && plan.item_capacity > 0) {
      plan.schedule_ctas = ctas;
      std::vector<int64_t> work(static_cast<size_t>(num_items));
      const int64_t item_work = backend.item_work_tokens();
      for (int32_t i = 0; i < num_items; ++i) {
        const WorkItem& it = plan.items[static_cast<size_t>(num_items - 1 - i)];  // the kernels' order
        work[static_cast<size_t>(i)] = static_cast<int64_t>(it.kv_end - it.kv_begin) + item_work;
      }
      planner::schedule_pairs(work, shape.num_kv_heads, plan.schedule_ctas, plan.schedule);
    }
    plan.metadata_bytes = detail::plan_layout(plan).end;
  } else {
    plan.item_capacity = num_items;
    plan.merge_capacity = static_cast<int32_t>(plan.merges.size());
    plan.partial_row_capacity = plan.partial_rows;
  }
  plan.staging_bytes = plan.metadata_bytes;
  plan.workspace_bytes = plan.metadata_bytes + detail::partial_state_bytes(plan.partial_row_capacity, shape);
  return plan;
}

}  // namespace

AttentionPlan plan_batch_decode(const BatchPlanArgs& args) { return make_plan(args, PlanKind::kDecode); }
AttentionPlan plan_batch_prefill(const BatchPlanArgs& args) { return make_plan(args, PlanKind::kPrefill); }

std::string AttentionPlan::describe() const {
  return fmt::format("AttentionPlan v{} {}{} on {}: batch {}, {} query rows, {} KV with page size {}, qo_tile {}{}, "
                     "{}kv_chunk {}, {} items, {} merges{}, workspace {} bytes",
                     version, kind == PlanKind::kDecode ? "decode" : "prefill", causal ? " (causal)" : "",
                     to_string(device), batch_size, total_qo, to_string(kv_format), page_size, qo_tile,
                     tile_rows > 0 ? fmt::format(" ({} rows)", tile_rows) : std::string(),
                     kv_stages > 0 ? fmt::format("{} K/V stages, ", kv_stages) : std::string(), kv_chunk, items.size(),
                     merges.size(),
                     merge_counters > 0 ? " (in the decode kernel)" : merge_flags > 0 ? " (streamed)" : "",
                     workspace_bytes);
}

}  // namespace attnforge
