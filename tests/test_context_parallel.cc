// Context parallelism with the ranks simulated in one process on the CPU: each rank plans and runs on its share
// of the pages (partition_pages) into its slot of one packed buffer, as the NCCL all-gather would leave it, and
// merge_gathered_states merges the slots. The result must match the single-process run and the float64
// reference. Rejected options are tested in test_errors.cc.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attnforge/context_parallel.h"
#include "backends/cpu/convert.h"
#include "testing/compare.h"

namespace attnforge {
namespace {

using testing::Buffer;
using testing::Case;
using testing::CaseSpec;

constexpr KVPartition kPartitions[] = {KVPartition::kContiguous, KVPartition::kRoundRobinPages};
constexpr int32_t kWorldSizes[] = {1, 2, 3, 4, 8};

// Odd lengths; requests of 0, 1 and 3 tokens are shorter than most world sizes, so some ranks hold nothing of
// them. GQA group 3 (6 query heads over 2 KV heads).
CaseSpec decode_spec(int32_t page_size, KVFormat format = KVFormat::kPagedCSR) {
  CaseSpec s;
  s.kind = PlanKind::kDecode;
  s.format = format;
  s.kv_lens = {37, 1, 0, 3, 129, 250};
  s.qo_lens.assign(s.kv_lens.size(), 1);
  s.num_qo_heads = 6;
  s.num_kv_heads = 2;
  s.head_dim_qk = 64;
  s.page_size = page_size;
  s.seed = 7 + static_cast<uint64_t>(page_size);
  return s;
}

// Runs c over `world` simulated ranks and merges their states into c's outputs.
void run_context_parallel(Case& c, int32_t world, KVPartition partition) {
  const RankStateLayout layout{c.total_qo(), c.spec.num_qo_heads, c.head_dim_vo(), DType::kFloat32};
  Buffer gathered = Buffer::make(DType::kUInt8, static_cast<size_t>(world) * layout.rank_bytes());
  std::memset(gathered.data(), 0xff, gathered.bytes());  // NaN in every float: slots must be fully written
  for (int32_t r = 0; r < world; ++r) {
    const RankPageTable share = partition_pages(c.paged.table, c.spec.page_size, world, r, partition);
    BatchPlanArgs args = c.plan_args();
    args.set_paged(share.table(), c.spec.page_size);
    args.shape.o_dtype = layout.o_dtype;
    const AttentionPlan plan = c.spec.kind == PlanKind::kDecode ? plan_batch_decode(args) : plan_batch_prefill(args);
    Buffer ws = Buffer::make(DType::kUInt8, plan.workspace_bytes);
    PagedKVCache kv = c.paged;
    kv.table = share.table();
    run(plan, c.q_view, kv, layout.rank_outputs(gathered.data(), r), c.options,
        {plan.workspace_bytes ? ws.data() : nullptr, plan.workspace_bytes});
  }
  merge_gathered_states(layout, gathered.data(), world, {c.out_view, c.lse_view});
}

// The first element where a and b (outputs of two runs of the same case) differ in out by more than out_tol or
// in lse by more than a few fp32 steps, or "".
std::string mismatch(const Case& a, const Case& b, double out_tol) {
  const int64_t rows = a.total_qo() * a.spec.num_qo_heads;
  const int64_t dim = a.head_dim_vo();
  for (int64_t i = 0; i < rows * dim; ++i) {
    const double x = cpu::load_one(a.out_view.data, a.spec.o_dtype, i);
    const double y = cpu::load_one(b.out_view.data, b.spec.o_dtype, i);
    if (!(std::fabs(x - y) <= out_tol))
      return fmt::format("out row {} dim {}: {} vs {} (tolerance {})", i / dim, i % dim, x, y, out_tol);
  }
  for (int64_t i = 0; i < rows; ++i) {
    const double x = a.lse_view.ptr<float>()[i], y = b.lse_view.ptr<float>()[i];
    if (x == y) continue;  // both -inf for an empty request
    if (!(std::fabs(x - y) <= 1e-5 * std::max(1.0, std::fabs(x))))
      return fmt::format("lse row {}: {} vs {}", i, x, y);
  }
  return "";
}

// The split run must pass the float64 check on its own, and stay within the sum of both runs' tolerances of the
// single-process run: the single run multiplies V by bf16 probabilities over the whole KV, the ranks over their
// shares, so the two round differently and agree only as closely as each agrees with the reference.
void expect_matches_single_and_reference(const CaseSpec& spec, int32_t world, KVPartition partition) {
  const std::string what = fmt::format("world {} {} | {}", world, to_string(partition), spec.describe());
  Case single = testing::make_case(spec);
  testing::plan_and_run(single);
  Case split = testing::make_case(spec);
  run_context_parallel(split, world, partition);
  EXPECT_TRUE(split.guards_intact()) << what;
  const testing::Verdict v = testing::check_case(split);
  EXPECT_TRUE(v.ok) << v.message << "\n  " << what;
  const testing::Verdict v_single = testing::check_case(single);
  ASSERT_TRUE(v_single.ok) << v_single.message << "\n  " << what;
  EXPECT_EQ(mismatch(split, single, v.tolerance + v_single.tolerance), "") << what;
}

TEST(ContextParallel, DecodeMatchesSingleProcessAndFloat64) {
  for (int32_t page_size : {1, 16})
    for (KVPartition partition : kPartitions)
      for (int32_t world : kWorldSizes) expect_matches_single_and_reference(decode_spec(page_size), world, partition);
}

// A block-table input, HND pages and a non-causal prefill (every query sees the whole KV, so positions do not
// matter) go through the same partition.
TEST(ContextParallel, BlockTableHndAndNonCausalPrefill) {
  CaseSpec blocks = decode_spec(16, KVFormat::kBlockTable);
  blocks.layout = KVLayout::kHND;
  CaseSpec prefill = decode_spec(16);
  prefill.kind = PlanKind::kPrefill;
  prefill.qo_lens = {5, 1, 2, 3, 17, 4};
  for (KVPartition partition : kPartitions)
    for (int32_t world : {3, 4}) {
      expect_matches_single_and_reference(blocks, world, partition);
      expect_matches_single_and_reference(prefill, world, partition);
    }
}

// The shares cover every page of a request exactly once, in order within a share; only the share holding the
// request's last page may end in a partial page; contiguous shares are consecutive runs of the page list.
TEST(ContextParallel, SharesCoverEveryTokenOnce) {
  for (int32_t page_size : {1, 16}) {
    const Case c = testing::make_case(decode_spec(page_size));
    const int32_t* indptr = static_cast<const int32_t*>(c.indptr.data());
    const int32_t* ids = static_cast<const int32_t*>(c.page_ids.data());
    for (KVPartition partition : kPartitions)
      for (int32_t world : kWorldSizes) {
        std::vector<RankPageTable> shares;
        for (int32_t r = 0; r < world; ++r)
          shares.push_back(partition_pages(c.paged.table, page_size, world, r, partition));
        for (int32_t b = 0; b < c.batch; ++b) {
          const std::string what =
              fmt::format("page {} {} world {} request {}", page_size, to_string(partition), world, b);
          const std::vector<int32_t> pages(ids + indptr[b], ids + indptr[b + 1]);
          std::vector<int32_t> seen(pages.size(), -1);  // rank of each page of the request
          int32_t tokens = 0;
          for (int32_t r = 0; r < world; ++r) {
            const RankPageTable& s = shares[static_cast<size_t>(r)];
            const int32_t lo = s.indptr[b], hi = s.indptr[b + 1];
            int64_t prev = -1;
            for (int32_t k = lo; k < hi; ++k) {
              const auto at = std::find(pages.begin(), pages.end(), s.indices[k]) - pages.begin();
              ASSERT_LT(at, static_cast<int64_t>(pages.size())) << what;
              EXPECT_GT(at, prev) << what;
              if (partition == KVPartition::kContiguous && prev >= 0) EXPECT_EQ(at, prev + 1) << what;
              EXPECT_EQ(seen[static_cast<size_t>(at)], -1) << what;
              seen[static_cast<size_t>(at)] = r;
              prev = at;
            }
            const int32_t n = hi - lo;
            EXPECT_EQ(s.kv_len[b], n ? (n - 1) * page_size + s.last_page_len[b] : 0) << what;
            if (n && prev != static_cast<int64_t>(pages.size()) - 1) EXPECT_EQ(s.last_page_len[b], page_size) << what;
            tokens += s.kv_len[b];
          }
          EXPECT_EQ(std::count(seen.begin(), seen.end(), -1), 0) << what;
          EXPECT_EQ(tokens, c.spec.kv_lens[static_cast<size_t>(b)]) << what;
        }
      }
  }
}

// A rank holding nothing of a request must contribute the identity of the merge: run() gives o = 0 and
// lse = -inf for a request of kv_len 0, exactly.
TEST(ContextParallel, EmptyShareGivesTheIdentityState) {
  CaseSpec spec = decode_spec(16);
  spec.kv_lens = {0, 5, 0};
  spec.qo_lens = {1, 1, 1};
  Case c = testing::make_case(spec);
  testing::plan_and_run(c);
  const int32_t heads = spec.num_qo_heads, dim = c.head_dim_vo();
  for (int64_t row : {0, 2})
    for (int32_t h = 0; h < heads; ++h) {
      EXPECT_EQ(c.lse_view.ptr<float>()[row * heads + h], -std::numeric_limits<float>::infinity()) << row;
      for (int32_t d = 0; d < dim; ++d)
        EXPECT_EQ(cpu::load_one(c.out_view.data, spec.o_dtype, (row * heads + h) * dim + d), 0.f) << row;
    }
}

}  // namespace
}  // namespace attnforge
