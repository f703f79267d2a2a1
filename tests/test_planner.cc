// The planner on the CPU: its heuristics on chosen inputs (expected numbers derived in the comments), the plan's
// invariants on random batches, deterministic mode (a request is cut the same way whatever else is in the
// batch, and its results are bit-identical) and the split of one long request.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/shape.h"
#include "planner/heuristics.h"
#include "testing/cases.h"

namespace attnforge {
namespace {

using planner::choose_kv_chunk;
using planner::choose_qo_tile;
using planner::SplitInput;

// ---- heuristics ----

TEST(PlannerHeuristics, QoTile) {
  // Rows per item = tokens x group; the CPU aims at 128 rows.
  EXPECT_EQ(choose_qo_tile(4, 1000, 128), 32);  // 128 / 4 = 32 tokens, below the longest request
  EXPECT_EQ(choose_qo_tile(3, 1000, 128), 42);  // 128 / 3 = 42 (rounded down: never more than 128 rows)
  EXPECT_EQ(choose_qo_tile(1, 5, 128), 5);      // 128 tokens wanted, but no request is longer than 5
  EXPECT_EQ(choose_qo_tile(8, 16, 128), 16);    // 128 / 8 = 16 = the longest request
  EXPECT_EQ(choose_qo_tile(256, 100, 128), 1);  // a group larger than the target: one token per item
  EXPECT_EQ(choose_qo_tile(0, 50, 128), 50);    // group 0 is treated as 1: 128 tokens, capped at 50
  EXPECT_EQ(choose_qo_tile(4, 0, 128), 1);      // empty batch: still a positive tile
}

SplitInput split_input(int64_t tiles, int32_t kv_heads, int64_t total_kv, int64_t max_kv, int32_t workers,
                       int32_t align = 16) {
  SplitInput in;  // waves 2, min_chunk 256
  in.num_tiles = tiles;
  in.num_kv_heads = kv_heads;
  in.total_kv = total_kv;
  in.max_kv = max_kv;
  in.num_workers = workers;
  in.align = align;
  return in;
}

TEST(PlannerHeuristics, KvChunkNoSplitWhenTilesFillTheWorkers) {
  // 16 tiles x 2 KV heads = 32 units = waves 2 x 16 workers: nothing to gain.
  EXPECT_EQ(choose_kv_chunk(split_input(16, 2, 100000, 20000, 16)), 0);
  // 15 tiles: 30 units < 32, so it splits; 32 / 2 = 16 items per head, ceil(100000 / 16) = 6250 -> 6256
  // (a multiple of 16).
  EXPECT_EQ(choose_kv_chunk(split_input(15, 2, 100000, 20000, 16)), 6256);
}

TEST(PlannerHeuristics, KvChunkNoSplitWithoutKv) { EXPECT_EQ(choose_kv_chunk(split_input(1, 1, 0, 0, 16)), 0); }

TEST(PlannerHeuristics, KvChunkLongDecode) {
  // One 32768-token request, 8 KV heads, 16 workers: 8 units < 32 wanted; 32 / 8 = 4 items per head;
  // 32768 / 4 = 8192, a multiple of 16.
  EXPECT_EQ(choose_kv_chunk(split_input(1, 8, 32768, 32768, 16)), 8192);
}

TEST(PlannerHeuristics, DecodeMergesInTheKernelWhileTheStatesFitItsPasses) {
  // One request, 8 KV heads, 264 workers, one wave: up to 264 / 8 + 1 = 34 states of 4 rows x 129 floats (head_dim
  // 128 and the LSE; 2064 bytes) beside 4 x 128 accumulators (2048 bytes): 48 states a pass of a 100 KB CTA.
  SplitInput in = split_input(1, 8, 32768, 32768, 264);
  in.waves = 1;
  EXPECT_TRUE(planner::decode_merges_in_kernel(in, 4, 128, 100 * 1024, 1));
  // The bound is the batch size's, not these lengths': no KV at all gives the same answer.
  SplitInput no_kv = in;
  no_kv.total_kv = no_kv.max_kv = 0;
  EXPECT_TRUE(planner::decode_merges_in_kernel(no_kv, 4, 128, 100 * 1024, 1));
  // Two waves (a batch of a wave or more, cut toward two): 67 states, more than a pass holds.
  SplitInput two_waves = in;
  two_waves.waves = 2;
  EXPECT_FALSE(planner::decode_merges_in_kernel(two_waves, 4, 128, 100 * 1024, 1));
  // One KV head (a group of 32: 16-row CTAs): up to 265 states, 11 a pass: the merge kernel's job.
  in.num_kv_heads = 1;
  EXPECT_FALSE(planner::decode_merges_in_kernel(in, 16, 128, 100 * 1024, 1));
  EXPECT_FALSE(planner::decode_merges_in_kernel(in, 16, 128, 100 * 1024, 4));
  // At the edge: 34 states a pass need 34 x 2064 + 2048 + 16 = 72240 bytes; 17 a pass in two passes, 37152.
  in.num_kv_heads = 8;
  EXPECT_TRUE(planner::decode_merges_in_kernel(in, 4, 128, 72240, 1));
  EXPECT_FALSE(planner::decode_merges_in_kernel(in, 4, 128, 72239, 1));
  EXPECT_TRUE(planner::decode_merges_in_kernel(in, 4, 128, 37152, 2));
  EXPECT_FALSE(planner::decode_merges_in_kernel(in, 4, 128, 37151, 2));
  // A backend without the kernel merge.
  EXPECT_FALSE(planner::decode_merges_in_kernel(in, 0, 128, 0, 0));
}

TEST(PlannerHeuristics, KvChunkAtLeastMinChunk) {
  // 1000 tokens over 32 items would be 32-token chunks; min_chunk raises them to 256.
  EXPECT_EQ(choose_kv_chunk(split_input(1, 1, 1000, 1000, 16)), 256);
  // 200 tokens: a 256-token chunk would not cut anything.
  EXPECT_EQ(choose_kv_chunk(split_input(1, 1, 200, 200, 16)), 0);
}

TEST(PlannerHeuristics, KvChunkAligned) {
  // 10000 tokens, 32 items per head: ceil(10000 / 32) = 313, rounded up to a multiple of 48 (the page size):
  // 7 x 48 = 336.
  EXPECT_EQ(choose_kv_chunk(split_input(1, 1, 10000, 10000, 16, 48)), 336);
  // 3 KV heads: ceil(32 / 3) = 11 items per head; ceil(11000 / 11) = 1000 -> 1008 (multiple of 16).
  EXPECT_EQ(choose_kv_chunk(split_input(1, 3, 11000, 11000, 16)), 1008);
}

TEST(PlannerHeuristics, SchedulePairsHandWorked) {
  // Pairs 0-7 (2 heads of items of work 5, 3, 3, 1) over 3 CTAs, each to the least loaded (ties: the lowest CTA):
  // 0 -> c0 (5, 0, 0), 1 -> c1 (5, 3, 0), 2 -> c2 (5, 3, 3), 3 -> c1 (5, 4, 3), 4 -> c2 (5, 4, 8), 5 -> c1 (5, 7, 8),
  // 6 -> c0 (8, 7, 8), 7 -> c1 (8, 8, 8).
  const std::vector<int64_t> work = {5, 3, 3, 1};
  std::vector<int32_t> out;
  planner::schedule_pairs(work, 2, 3, out);
  EXPECT_EQ(out, (std::vector<int32_t>{0, 2, 6, 8, 0, 6, 1, 3, 5, 7, 2, 4})) << fmt::format("{}", out);
}

// The same lists as list scheduling written plainly (each pair to the least loaded CTA by a scan, ties to the lowest),
// on random batches: item counts from 0, CTA counts that are and are not powers of two, equal works (ties).
TEST(PlannerHeuristics, SchedulePairsIsListScheduling) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int32_t items = static_cast<int32_t>(rng() % 400), heads = 1 + static_cast<int32_t>(rng() % 8);
    const int32_t ctas = 1 + static_cast<int32_t>(rng() % 150);
    std::vector<int64_t> work(static_cast<size_t>(items));
    for (int64_t& x : work) x = rng() % 4 == 0 ? 256 : 256 + static_cast<int64_t>(rng() % 5000);
    std::vector<int64_t> load(static_cast<size_t>(ctas), 0);
    std::vector<std::vector<int32_t>> lists(static_cast<size_t>(ctas));
    for (int32_t w = 0; w < items * heads; ++w) {
      const auto c = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      lists[c].push_back(w);
      load[c] += work[static_cast<size_t>(w % items)];
    }
    std::vector<int32_t> expected(1, 0), pairs;
    for (const auto& l : lists) {
      pairs.insert(pairs.end(), l.begin(), l.end());
      expected.push_back(static_cast<int32_t>(pairs.size()));
    }
    expected.insert(expected.end(), pairs.begin(), pairs.end());
    std::vector<int32_t> out;
    planner::schedule_pairs(work, heads, ctas, out);
    ASSERT_EQ(out, expected) << "trial " << trial << ": " << items << " items, " << heads << " heads, " << ctas
                             << " CTAs";
  }
}

// The bench's ragged batch (16 causal requests of 512-4096 tokens, 32-token query tiles, 8 KV heads) over 132 CTAs:
// every pair once, each CTA's pairs in the kernel's order, and the most loaded CTA within one item of the mean
// (list scheduling's bound), where every 132nd pair from the CTA's index is 8% over it.
TEST(PlannerHeuristics, SchedulePairsBalancesARaggedBatch) {
  std::vector<int64_t> work;  // the kernels' order: the last request's last query tile first
  for (int32_t i = 15; i >= 0; --i) {
    const int32_t len = 512 + (3584 * ((i * 7) % 16)) / 15;
    for (int32_t q1 = (len + 31) / 32 * 32; q1 > 0; q1 -= 32)
      work.push_back(std::min(q1, len) + planner::kItemWorkTokens);
  }
  const int32_t heads = 8, ctas = 132;
  const int64_t items = static_cast<int64_t>(work.size()), pairs = items * heads;
  std::vector<int32_t> out;
  planner::schedule_pairs(work, heads, ctas, out);
  ASSERT_EQ(static_cast<int64_t>(out.size()), ctas + 1 + pairs);
  ASSERT_EQ(out[0], 0);
  ASSERT_EQ(out[ctas], pairs);
  std::vector<int32_t> seen(static_cast<size_t>(pairs), 0);
  int64_t total = 0, most = 0, most_strided = 0;
  for (int32_t c = 0; c < ctas; ++c) {
    ASSERT_LE(out[c], out[c + 1]);
    int64_t load = 0, strided = 0;
    for (int32_t k = out[c]; k < out[c + 1]; ++k) {
      const int32_t w = out[ctas + 1 + k];
      ASSERT_TRUE(w >= 0 && w < pairs) << w;
      if (k > out[c]) ASSERT_LT(out[ctas + k], w) << "CTA " << c << ": pairs out of order";
      ++seen[static_cast<size_t>(w)];
      load += work[static_cast<size_t>(w % items)];
    }
    for (int64_t w = c; w < pairs; w += ctas) strided += work[static_cast<size_t>(w % items)];
    total += load, most = std::max(most, load), most_strided = std::max(most_strided, strided);
  }
  for (int64_t w = 0; w < pairs; ++w) ASSERT_EQ(seen[static_cast<size_t>(w)], 1) << "pair " << w;
  const int64_t longest = *std::max_element(work.begin(), work.end());
  EXPECT_LE(most, total / ctas + longest);
  EXPECT_GT(static_cast<double>(most_strided), 1.05 * static_cast<double>(total) / ctas);
  EXPECT_LT(static_cast<double>(most), 1.02 * static_cast<double>(total) / ctas);
}

// The device metadata's regions in order without overlap, and the schedule at the same place whatever the
// capacities: kernels reach it through launch parameters, which a captured graph keeps across re-plans.
TEST(PlanLayout, ScheduleFirstAndFixed) {
  auto layout = [](int32_t items, int32_t merges, int32_t ctas) {
    AttentionPlan p;
    p.batch_size = 7, p.shape.num_kv_heads = 8, p.item_capacity = items, p.merge_capacity = merges;
    p.schedule_ctas = ctas;
    return detail::plan_layout(p);
  };
  const detail::PlanLayout a = layout(100, 10, 132), b = layout(5000, 300, 132), c = layout(100, 10, 0);
  EXPECT_EQ(a.schedule, b.schedule);
  EXPECT_EQ(a.schedule, c.schedule);
  for (const detail::PlanLayout& l : {a, b, c}) {
    EXPECT_EQ(l.schedule % 256, 0u);
    EXPECT_GE(l.schedule, sizeof(PlanView));
    EXPECT_LE(l.schedule, l.qo_indptr);
    EXPECT_LT(l.qo_indptr, l.kv_len);
    EXPECT_LT(l.kv_len, l.items);
    EXPECT_LE(l.items, l.merges);
    EXPECT_LE(l.merges, l.end);
  }
  // 133 offsets and 100 x 8 pairs of int32.
  EXPECT_GE(a.qo_indptr - a.schedule, (133u + 800u) * sizeof(int32_t));
  EXPECT_EQ(c.qo_indptr, c.schedule);  // no schedule, no bytes
}

// ---- plan invariants ----

// Host metadata of a batch in any KV format, owning the arrays its BatchPlanArgs views.
struct Batch {
  KVFormat format = KVFormat::kPagedCSR;
  int32_t page_size = 16;
  std::vector<int32_t> qo_lens, kv_lens;
  std::vector<int32_t> qo_indptr, kv_indptr, last_page_len, seq_lens;

  Batch(KVFormat f, int32_t ps, std::vector<int32_t> qo, std::vector<int32_t> kv)
      : format(f), page_size(f == KVFormat::kRagged ? 1 : ps), qo_lens(std::move(qo)), kv_lens(std::move(kv)) {
    const size_t n = qo_lens.size();
    qo_indptr.assign(n + 1, 0);
    kv_indptr.assign(n + 1, 0);
    for (size_t b = 0; b < n; ++b) {
      const int32_t pages = (kv_lens[b] + page_size - 1) / page_size;
      qo_indptr[b + 1] = qo_indptr[b] + qo_lens[b];
      kv_indptr[b + 1] = kv_indptr[b] + (format == KVFormat::kRagged ? kv_lens[b] : pages);
      last_page_len.push_back(pages == 0 ? 0 : kv_lens[b] - (pages - 1) * page_size);
    }
    seq_lens = kv_lens;
  }
  int64_t size() const { return static_cast<int64_t>(qo_lens.size()); }
  BatchPlanArgs args(const AttentionShape& shape, const PlanOptions& options) {
    BatchPlanArgs a;
    a.shape = shape;
    a.options = options;
    a.qo_indptr = TensorView(qo_indptr.data(), DType::kInt32, {size() + 1});
    a.kv_format = format;
    a.page_size = page_size;
    a.kv_indptr = TensorView(kv_indptr.data(), DType::kInt32, {size() + 1});
    a.last_page_len = TensorView(last_page_len.data(), DType::kInt32, {size()});
    a.seq_lens = TensorView(seq_lens.data(), DType::kInt32, {size()});
    return a;
  }
  std::string describe() const {
    return fmt::format("{} page {} qo [{}] kv [{}]", to_string(format), page_size, fmt::join(qo_lens, ","),
                       fmt::join(kv_lens, ","));
  }
};

size_t round256(size_t n) { return (n + 255) / 256 * 256; }

// The first invariant the plan breaks, or "" when it keeps them all.
std::string plan_violation(const AttentionPlan& p, const Batch& b, bool causal) {
  const int64_t B = b.size();
  if (p.batch_size != B) return fmt::format("batch_size {} for {} requests", p.batch_size, B);
  if (p.qo_indptr != b.qo_indptr) return "qo_indptr differs from the batch's";
  if (p.kv_len != b.kv_lens) return "kv_len differs from the batch's";
  if (p.total_qo != b.qo_indptr.back()) return fmt::format("total_qo {}", p.total_qo);
  const int64_t num_items = static_cast<int64_t>(p.items.size());

  // Every item carries its request's context (WorkItem), as the batch's arrays give it.
  for (int64_t i = 0; i < num_items; ++i) {
    const WorkItem& it = p.items[i];
    if (it.request < 0 || it.request >= B) return fmt::format("item {}: request {}", i, it.request);
    const size_t r = static_cast<size_t>(it.request);
    const int32_t page_list = b.format == KVFormat::kBlockTable ? 0 : b.kv_indptr[r];
    if (it.qo_start != b.qo_indptr[r] || it.qo_len != b.qo_lens[r] || it.kv_len != b.kv_lens[r] ||
        it.page_list != page_list)
      return fmt::format("item {} of request {}: context qo_start {} qo_len {} kv_len {} page_list {}, expected {} {} "
                         "{} {}", i, r, it.qo_start, it.qo_len, it.kv_len, it.page_list, b.qo_indptr[r],
                         b.qo_lens[r], b.kv_lens[r], page_list);
  }

  // A tile is an unsplit item or a merge with its items; every split item must belong to exactly one merge,
  // and a merge's items must be consecutive and cover the merge's rows.
  std::vector<int32_t> owner(p.items.size(), -1);
  for (size_t m = 0; m < p.merges.size(); ++m) {
    const MergeItem& mi = p.merges[m];
    if (mi.num_items < 2 || mi.first_item < 0 || mi.first_item + mi.num_items > num_items)
      return fmt::format("merge {}: items [{}, +{}) of {}", m, mi.first_item, mi.num_items, num_items);
    for (int32_t k = mi.first_item; k < mi.first_item + mi.num_items; ++k) {
      const WorkItem& it = p.items[k];
      if (owner[k] != -1) return fmt::format("item {} is in merges {} and {}", k, owner[k], m);
      if (it.partial_row < 0) return fmt::format("item {} of merge {} writes the final output", k, m);
      if (it.request != mi.request || it.qo_begin != mi.qo_begin || it.qo_end != mi.qo_end)
        return fmt::format("item {} covers other rows than merge {}", k, m);
      // The merge fields a kernel that merges itself reads: its states' rows are consecutive blocks, in KV order.
      const int32_t first_row = p.items[mi.first_item].partial_row;
      if (it.merge != static_cast<int32_t>(m) || it.merge_states != mi.num_items || it.merge_row0 != first_row ||
          it.partial_row != first_row + (k - mi.first_item) * (mi.qo_end - mi.qo_begin))
        return fmt::format("item {} of merge {}: merge {}, merge_states {}, merge_row0 {}, partial_row {}; expected {}, "
                           "{}, {}, {}", k, m, it.merge, it.merge_states, it.merge_row0, it.partial_row, m,
                           mi.num_items, first_row, first_row + (k - mi.first_item) * (mi.qo_end - mi.qo_begin));
      owner[k] = static_cast<int32_t>(m);
    }
  }
  struct Tile {
    int32_t request, qo_begin, qo_end, first, count;
  };
  std::vector<Tile> tiles;
  for (int64_t i = 0; i < num_items; ++i) {
    const WorkItem& it = p.items[i];
    if (it.partial_row >= 0 && owner[i] < 0) return fmt::format("item {} has partial state but no merge", i);
    if (it.partial_row < 0 && it.merge != -1) return fmt::format("item {} writes the output but names merge {}", i, it.merge);
    if (it.partial_row < 0) tiles.push_back({it.request, it.qo_begin, it.qo_end, static_cast<int32_t>(i), 1});
  }
  for (const MergeItem& mi : p.merges) tiles.push_back({mi.request, mi.qo_begin, mi.qo_end, mi.first_item, mi.num_items});

  std::vector<std::vector<int32_t>> covered(B);
  for (int64_t r = 0; r < B; ++r) covered[r].assign(b.qo_lens[r], 0);
  for (const Tile& t : tiles) {
    if (t.request < 0 || t.request >= B) return fmt::format("tile of request {}", t.request);
    const int32_t qo_len = b.qo_lens[t.request], kv_len = b.kv_lens[t.request];
    if (t.qo_begin < 0 || t.qo_begin >= t.qo_end || t.qo_end > qo_len)
      return fmt::format("request {}: tile rows [{}, {}) of {}", t.request, t.qo_begin, t.qo_end, qo_len);
    if (t.qo_end - t.qo_begin > p.qo_tile)
      return fmt::format("request {}: tile [{}, {}) longer than qo_tile {}", t.request, t.qo_begin, t.qo_end, p.qo_tile);
    if (p.kind == PlanKind::kDecode && (t.qo_begin != 0 || t.qo_end != qo_len))
      return fmt::format("decode request {}: tile [{}, {}) is not the whole request", t.request, t.qo_begin, t.qo_end);
    for (int32_t q = t.qo_begin; q < t.qo_end; ++q) ++covered[t.request][q];
    // Causal tiles read up to the diagonal of their last row.
    const int32_t kv_end = causal ? kv_len - qo_len + t.qo_end : kv_len;
    int32_t next = 0;
    for (int32_t k = t.first; k < t.first + t.count; ++k) {
      const WorkItem& it = p.items[k];
      if (it.kv_begin != next) return fmt::format("item {}: kv_begin {}, expected {} (gap or overlap)", k, it.kv_begin, next);
      if (t.count > 1 && (it.kv_end <= it.kv_begin || it.kv_end - it.kv_begin > p.kv_chunk))
        return fmt::format("item {}: piece [{}, {}) with kv_chunk {}", k, it.kv_begin, it.kv_end, p.kv_chunk);
      next = it.kv_end;
    }
    if (next != kv_end)
      return fmt::format("request {} rows [{}, {}): items end at {}, expected {}", t.request, t.qo_begin, t.qo_end, next, kv_end);
  }
  for (int64_t r = 0; r < B; ++r)
    for (int32_t q = 0; q < b.qo_lens[r]; ++q)
      if (covered[r][q] != 1) return fmt::format("request {} row {} is covered by {} tiles", r, q, covered[r][q]);

  // Decode plans, longest work first: units (an unsplit item, or a merge's consecutive pieces ranked by its longest
  // piece) in non-increasing order of query rows x KV. (Prefill plans keep request order; see order_longest_first.)
  if (p.kind == PlanKind::kDecode) {
    std::vector<int32_t> merge_at(p.items.size(), -1);
    for (const MergeItem& m : p.merges) merge_at[m.first_item] = m.num_items;
    int64_t previous = std::numeric_limits<int64_t>::max();
    for (int64_t i = 0; i < num_items;) {
      const int32_t count = merge_at[i] > 0 ? merge_at[i] : 1;
      int64_t work = 0;
      for (int64_t k = i; k < i + count; ++k)
        work = std::max<int64_t>(work, static_cast<int64_t>(p.items[k].qo_end - p.items[k].qo_begin) *
                                           (p.items[k].kv_end - p.items[k].kv_begin));
      if (work > previous) return fmt::format("item {}: work {} after a unit of {} (not longest first)", i, work, previous);
      previous = work;
      i += count;
    }
  }

  int32_t max_states = 0;
  for (const MergeItem& m : p.merges) max_states = std::max(max_states, m.num_items);
  if (p.max_merge_states != max_states)
    return fmt::format("max_merge_states {}, but the largest merge combines {} states", p.max_merge_states, max_states);

  // Partial rows: disjoint, inside [0, partial_rows), and all of them used (the workspace is exact).
  std::vector<int32_t> rows(static_cast<size_t>(p.partial_rows), 0);
  for (int64_t i = 0; i < num_items; ++i) {
    const WorkItem& it = p.items[i];
    if (it.partial_row < 0) continue;
    if (it.partial_row + (it.qo_end - it.qo_begin) > p.partial_rows)
      return fmt::format("item {}: partial rows from {} beyond partial_rows {}", i, it.partial_row, p.partial_rows);
    for (int32_t q = 0; q < it.qo_end - it.qo_begin; ++q)
      if (rows[it.partial_row + q]++ != 0) return fmt::format("partial row {} used twice", it.partial_row + q);
  }
  if (std::count(rows.begin(), rows.end(), 0) != 0) return "some partial rows are never used";

  // Workspace: partial o [rows, heads, dim_vo] and lse [rows, heads] in float32, each 256-byte aligned.
  const size_t heads = static_cast<size_t>(p.shape.num_qo_heads), dvo = static_cast<size_t>(p.shape.head_dim_vo);
  const size_t r = static_cast<size_t>(p.partial_rows);
  const size_t expected_ws = r == 0 ? 0 : round256(r * heads * dvo * 4) + round256(r * heads * 4);
  if (p.workspace_bytes != expected_ws)
    return fmt::format("workspace_bytes {}, expected {} for {} partial rows", p.workspace_bytes, expected_ws, r);
  return "";
}

AttentionPlan make_plan(PlanKind kind, const BatchPlanArgs& a) {
  return kind == PlanKind::kDecode ? plan_batch_decode(a) : plan_batch_prefill(a);
}

TEST(PlanInvariants, RandomBatches) {
  std::mt19937 rng(20240611);
  auto pick = [&](auto values) { return values[std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng)]; };
  auto uniform = [&](int32_t lo, int32_t hi) { return std::uniform_int_distribution<int32_t>(lo, hi)(rng); };
  const std::vector<AttentionShape> shapes = {
      {8, 8, 64, 64, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16},
      {32, 8, 128, 128, DType::kFloat16, DType::kFloat8E4M3, DType::kFloat16},
      {16, 2, 192, 128, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16},
      {4, 1, 64, 0, DType::kFloat32, DType::kFloat32, DType::kFloat32},
  };
  int split_plans = 0, causal_plans = 0;
  for (int iter = 0; iter < 400; ++iter) {
    const PlanKind kind = uniform(0, 1) ? PlanKind::kDecode : PlanKind::kPrefill;
    PlanOptions o;
    o.causal = uniform(0, 3) == 0;
    o.num_workers = pick(std::vector<int32_t>{1, 2, 16, 132});
    o.deterministic = uniform(0, 3) == 0;
    o.fixed_split_size = pick(std::vector<int32_t>{0, 64, 100, 1000});
    o.disable_split = uniform(0, 6) == 0;
    o.tile_rows = uniform(0, 3) == 0 ? pick(std::vector<int32_t>{1, 16, 64, 200}) : 0;
    const int32_t batch = uniform(1, 12);
    std::vector<int32_t> qo(batch), kv(batch);
    for (int32_t b = 0; b < batch; ++b) {
      // About one request in five has no queries and one in five (of those with none) no KV either.
      qo[b] = uniform(0, 4) == 0 ? 0 : kind == PlanKind::kDecode ? uniform(1, 8) : uniform(1, 300);
      kv[b] = uniform(0, 4) == 0 ? 0 : uniform(1, 5000);
      if (o.causal) kv[b] += qo[b];
    }
    Batch bt(pick(std::vector<KVFormat>{KVFormat::kPagedCSR, KVFormat::kBlockTable, KVFormat::kRagged}),
             pick(std::vector<int32_t>{1, 3, 16, 64}), qo, kv);
    const AttentionShape shape = pick(shapes);
    const AttentionPlan plan = make_plan(kind, bt.args(shape, o));
    EXPECT_EQ(plan_violation(plan, bt, o.causal), "")
        << "iteration " << iter << ": " << bt.describe() << "\n" << plan.describe();
    if (o.disable_split) EXPECT_TRUE(plan.merges.empty()) << "disable_split, yet " << plan.describe();
    split_plans += !plan.merges.empty();
    causal_plans += o.causal;
  }
  // The random batches must reach split plans and causal plans, or the loop above checked little.
  EXPECT_GT(split_plans, 50);
  EXPECT_GT(causal_plans, 50);
}

TEST(PlanInvariants, ViolationsAreDetected) {
  // The checker itself: plans broken by hand must be reported.
  Batch bt(KVFormat::kPagedCSR, 16, {40, 3}, {4000, 100});
  PlanOptions o;
  o.deterministic = true;
  o.fixed_split_size = 512;
  const AttentionShape shape{8, 2, 64, 64, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16};
  const AttentionPlan good = plan_batch_prefill(bt.args(shape, o));
  ASSERT_EQ(plan_violation(good, bt, false), "");
  ASSERT_FALSE(good.merges.empty());
  AttentionPlan gap = good;
  gap.items[good.merges[0].first_item + 1].kv_begin += 1;
  EXPECT_NE(plan_violation(gap, bt, false), "");
  AttentionPlan shared_rows = good;
  shared_rows.items[good.merges[0].first_item + 1].partial_row = good.items[good.merges[0].first_item].partial_row;
  EXPECT_NE(plan_violation(shared_rows, bt, false), "");
  AttentionPlan lost_tile = good;
  lost_tile.items.pop_back();
  EXPECT_NE(plan_violation(lost_tile, bt, false), "");
  // Longest first (decode plans): request 0's pieces (512 tokens each) come before request 1's unsplit item (100
  // tokens); moving that item to the front breaks the order.
  Batch bd(KVFormat::kPagedCSR, 16, {1, 1}, {4000, 100});
  const AttentionPlan decode = plan_batch_decode(bd.args(shape, o));
  ASSERT_EQ(plan_violation(decode, bd, false), "");
  ASSERT_FALSE(decode.merges.empty());
  ASSERT_EQ(decode.items.back().request, 1);
  AttentionPlan light_first = decode;
  std::rotate(light_first.items.begin(), light_first.items.end() - 1, light_first.items.end());
  for (MergeItem& m : light_first.merges) m.first_item += 1;
  EXPECT_NE(plan_violation(light_first, bd, false).find("not longest first"), std::string::npos)
      << plan_violation(light_first, bd, false);
  AttentionPlan stale_context = good;
  stale_context.items.back().page_list += 1;
  EXPECT_NE(plan_violation(stale_context, bt, false).find("context"), std::string::npos);
  AttentionPlan wrong_merge = good;
  wrong_merge.items[good.merges[0].first_item + 1].merge_row0 += 1;
  EXPECT_NE(plan_violation(wrong_merge, bt, false).find("merge_row0"), std::string::npos);
  AttentionPlan big_ws = good;
  big_ws.workspace_bytes += 256;
  EXPECT_NE(plan_violation(big_ws, bt, false), "");
}

// ---- deterministic mode ----

// The items of one request, without partial row numbers (those depend on what comes before in the batch).
std::vector<std::string> request_items(const AttentionPlan& p, int32_t request) {
  std::vector<std::string> r;
  for (const WorkItem& it : p.items)
    if (it.request == request)
      r.push_back(fmt::format("rows [{}, {}) kv [{}, {}){}", it.qo_begin, it.qo_end, it.kv_begin, it.kv_end,
                              it.partial_row >= 0 ? " partial" : ""));
  return r;
}

TEST(DeterministicPlan, RequestSplitIgnoresTheRestOfTheBatch) {
  std::mt19937 rng(7);
  auto uniform = [&](int32_t lo, int32_t hi) { return std::uniform_int_distribution<int32_t>(lo, hi)(rng); };
  const AttentionShape shape{16, 4, 128, 128, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16};
  for (int iter = 0; iter < 40; ++iter) {
    PlanOptions o;
    o.deterministic = true;
    o.fixed_split_size = iter % 2 ? 256 : 0;  // 0: the default 2048
    o.causal = iter % 4 >= 2;
    o.num_workers = uniform(1, 132);
    const int32_t batch = uniform(2, 10);
    std::vector<int32_t> qo(batch), kv(batch);
    for (int32_t b = 0; b < batch; ++b) {
      qo[b] = uniform(0, 100);
      kv[b] = qo[b] + uniform(0, 6000);
    }
    Batch whole(KVFormat::kPagedCSR, 16, qo, kv);
    const AttentionPlan plan = plan_batch_prefill(whole.args(shape, o));
    for (int32_t b = 0; b < batch; ++b) {
      Batch alone(KVFormat::kPagedCSR, 16, {qo[b]}, {kv[b]});
      o.num_workers = uniform(1, 132);  // also independent of the worker count
      const AttentionPlan single = plan_batch_prefill(alone.args(shape, o));
      EXPECT_EQ(request_items(plan, b), request_items(single, 0))
          << "request " << b << " of " << whole.describe() << " is cut differently when planned alone";
    }
  }
}

// Request 0 of a case planned as a batch of its own, through prefix views of the case's (CSR) metadata.
AttentionPlan plan_and_run_first_request(testing::Case& c) {
  const int64_t qo = c.spec.qo_lens[0];
  BatchPlanArgs a = c.plan_args();
  a.qo_indptr.shape[0] = 2;
  a.kv_indptr.shape[0] = 2;
  a.last_page_len.shape[0] = 1;
  const AttentionPlan plan = plan_batch_prefill(a);
  PagedKVCache kv = c.paged;
  kv.table.indptr.shape[0] = 2;
  kv.table.last_page_len.shape[0] = 1;
  TensorView q = c.q_view, out = c.out_view, lse = c.lse_view;
  q.shape[0] = out.shape[0] = lse.shape[0] = qo;
  testing::Buffer ws = testing::Buffer::make(DType::kUInt8, plan.workspace_bytes);
  run(plan, q, kv, {out, lse}, c.options, {ws.data(), plan.workspace_bytes});
  return plan;
}

TEST(DeterministicPlan, RequestResultsBitIdenticalAloneAndInABatch) {
  for (bool causal : {false, true}) {
    testing::CaseSpec s;
    s.kind = PlanKind::kPrefill;
    s.qo_lens = {21, 70, 5};
    s.kv_lens = {1500, 3000, 700};
    s.num_qo_heads = 8;
    s.num_kv_heads = 2;
    s.options.causal = causal;
    s.plan.deterministic = true;
    s.plan.fixed_split_size = 256;
    s.plan.num_workers = 16;
    testing::Case c = testing::make_case(s);
    const AttentionPlan batch_plan = testing::plan_and_run(c);
    const int64_t qo = s.qo_lens[0];
    const size_t out_bytes = static_cast<size_t>(qo * s.num_qo_heads * s.head_dim_qk) * dtype_bytes(s.o_dtype);
    const size_t lse_bytes = static_cast<size_t>(qo * s.num_qo_heads) * sizeof(float);
    const std::vector<uint8_t> out_batch(c.out_view.ptr<uint8_t>(), c.out_view.ptr<uint8_t>() + out_bytes);
    const std::vector<uint8_t> lse_batch(c.lse_view.ptr<uint8_t>(), c.lse_view.ptr<uint8_t>() + lse_bytes);

    c.poison_outputs();
    const AttentionPlan alone_plan = plan_and_run_first_request(c);
    ASSERT_GT(alone_plan.merges.size(), 0u) << "request 0 should be split: " << alone_plan.describe();
    ASSERT_EQ(request_items(batch_plan, 0), request_items(alone_plan, 0));
    EXPECT_EQ(std::memcmp(c.out_view.data, out_batch.data(), out_bytes), 0)
        << "out of request 0 differs alone vs in the batch; " << s.describe();
    EXPECT_EQ(std::memcmp(c.lse_view.data, lse_batch.data(), lse_bytes), 0)
        << "lse of request 0 differs alone vs in the batch; " << s.describe();
  }
}

// ---- one long request ----

TEST(PlanSplit, LongDecodeIsSplitWhenWorkersAreIdle) {
  // 1 x 32768 decode, 2 KV heads, 16 workers: 2 units < 2 waves x 16 = 32; 32 / 2 = 16 items per head;
  // 32768 / 16 = 2048 tokens per item: 16 items and one merge.
  Batch bt(KVFormat::kPagedCSR, 16, {1}, {32768});
  const AttentionShape shape{8, 2, 128, 128, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16};
  PlanOptions o;
  o.num_workers = 16;
  const AttentionPlan plan = plan_batch_decode(bt.args(shape, o));
  EXPECT_EQ(plan_violation(plan, bt, false), "");
  EXPECT_EQ(plan.kv_chunk, 2048);
  EXPECT_EQ(plan.items.size(), 16u);
  ASSERT_EQ(plan.merges.size(), 1u);
  EXPECT_EQ(plan.merges[0].num_items, 16);
  EXPECT_GT(plan.workspace_bytes, 0u);
  const std::string d = plan.describe();
  EXPECT_NE(d.find("16 items"), std::string::npos) << d;
  EXPECT_NE(d.find("1 merges"), std::string::npos) << d;

  // One worker: the two KV heads already give 2 units = 2 waves x 1 worker, so nothing is split.
  o.num_workers = 1;
  const AttentionPlan serial = plan_batch_decode(bt.args(shape, o));
  EXPECT_EQ(serial.items.size(), 1u) << serial.describe();
  EXPECT_EQ(serial.workspace_bytes, 0u);
  EXPECT_NE(serial.describe().find("1 items"), std::string::npos) << serial.describe();
}

// ---- query tiles ----

TEST(PlanTiles, TileRowsOptionSetsTheQueryTile) {
  // Group 4: 128 packed rows are 32 query tokens, 16 rows are 4; the CPU tiles any positive size.
  Batch bt(KVFormat::kPagedCSR, 16, {300, 7}, {1000, 500});
  const AttentionShape shape{32, 8, 128, 128, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16};
  PlanOptions o;
  EXPECT_EQ(plan_batch_prefill(bt.args(shape, o)).qo_tile, planner::kCpuTargetRows / 4);
  o.tile_rows = 16;
  const AttentionPlan small = plan_batch_prefill(bt.args(shape, o));
  EXPECT_EQ(small.qo_tile, 4);
  EXPECT_EQ(plan_violation(small, bt, false), "");
  o.tile_rows = 2;  // fewer rows than the group: one query token per tile
  EXPECT_EQ(plan_batch_prefill(bt.args(shape, o)).qo_tile, 1);
  o.tile_rows = -64;
  try {
    plan_batch_prefill(bt.args(shape, o));
    ADD_FAILURE() << "tile_rows -64 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("options.tile_rows: -64; expected 0 (the backend's choice) or a positive "
                                         "number"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace attnforge
