// The CUDA backend against the float64 reference, on the same adversarial cases as the CPU backend. Needs a
// GPU: built with CUDA but not registered with ctest; scripts/device-check runs it.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <barrier>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <tuple>

#include "attnforge/context_parallel.h"
#include "attnforge/jit.h"
#include "attnforge/variant.h"
#include "backends/cuda/driver_api.h"
#include "backends/cuda/nccl_api.h"
#include "backends/cuda/prefill/prefill.h"
#include "backends/cuda/tma.h"
#include "core/shape.h"
#include "jit/nvrtc_compiler.h"
#include "testing/compare.h"
#include "testing/device_case.h"
#include "testing/registry.h"
#include "testing/variant_reference.h"
#include "../tma_probe.h"
#include "../wgmma_probe.h"

using namespace attnforge;
using namespace attnforge::testing;

namespace {

AttentionConfig cuda_config(const CaseSpec& s) {
  AttentionConfig c;
  c.device = Device::cuda(0);
  c.kind = s.kind;
  c.kv_format = s.format;
  c.kv_layout = s.layout;
  c.shape = {s.num_qo_heads, s.num_kv_heads, s.head_dim_qk, s.head_dim_vo, s.q_dtype, s.kv_dtype, s.o_dtype};
  c.page_size = s.page_size;
  c.custom_mask = s.options.custom_mask;
  c.rope = s.options.rope;
  return c;
}

// Rows to check against the reference: all, or a fixed sample for large batches (the reference is float64).
std::vector<int64_t> sample_rows(const Case& c, int64_t max_rows) {
  const int64_t total = c.total_qo();
  if (total <= max_rows) return {};
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < max_rows; ++i) rows.push_back(i * total / max_rows);
  rows.push_back(total - 1);
  return rows;
}

// A plan's device workspace and page-locked staging, the plan uploaded into them; freed with the object.
// The case's decode plan on cuda:0 (its own plan options).
AttentionPlan cuda_decode_plan(const Case& c) {
  BatchPlanArgs args = c.plan_args();
  args.device = Device::cuda(0);
  return plan_batch_decode(args);
}

struct UploadedPlan {
  void* ws = nullptr;
  void* staging = nullptr;
  Workspace w;
  explicit UploadedPlan(AttentionPlan& plan) {
    EXPECT_EQ(cudaSuccess, cudaMalloc(&ws, plan.workspace_bytes));
    EXPECT_EQ(cudaSuccess, cudaMallocHost(&staging, plan.staging_bytes));
    w = {ws, plan.workspace_bytes};
    upload_plan(plan, w, staging, plan.staging_bytes, nullptr);
  }
  ~UploadedPlan() {
    cudaFree(ws);
    cudaFreeHost(staging);
  }
  UploadedPlan(const UploadedPlan&) = delete;
  UploadedPlan& operator=(const UploadedPlan&) = delete;
};

// Runs an uploaded plan once on poisoned outputs and brings them back: the verdict against the float64 reference and
// the output's bytes.
struct CheckedRun {
  Verdict verdict;
  std::vector<uint8_t> bytes;
};
CheckedRun run_checked(Case& c, DeviceCase& dev, const AttentionPlan& plan, const Workspace& w) {
  c.poison_outputs();
  dev.upload_outputs(c);
  run(plan, dev.q, dev.paged, Outputs{dev.out, dev.lse}, dev.options, w, nullptr);
  EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
  dev.download_outputs(c);
  const uint8_t* o = static_cast<const uint8_t*>(c.out_view.data);
  return {check_case(c, {}), std::vector<uint8_t>(o, o + c.out_view.numel() * 2)};
}

std::string run_and_check(const CaseSpec& spec, int64_t max_rows = 1 << 30) {
  Case c = make_case(spec);
  DeviceCase dev(c);
  const AttentionPlan plan = plan_and_run_cuda(c, dev);
  const Verdict v = check_case(c, sample_rows(c, max_rows));
  return v.ok ? "" : v.message + "\n  case: " + spec.describe() + "\n  plan: " + plan.describe();
}

std::vector<CaseSpec> supported(const std::vector<CaseSpec>& all, std::map<std::string, int>* excluded) {
  std::vector<CaseSpec> out;
  for (const CaseSpec& s : all) {
    const Support sup = supports(cuda_config(s));
    if (sup.ok)
      out.push_back(s);
    else if (excluded)
      ++(*excluded)[sup.reason];
  }
  return out;
}

class CudaRegistry : public ::testing::TestWithParam<CaseSpec> {};
TEST_P(CudaRegistry, MatchesFloat64Reference) {
  const std::string error = run_and_check(GetParam());
  EXPECT_TRUE(error.empty()) << error;
}
INSTANTIATE_TEST_SUITE_P(Cases, CudaRegistry, ::testing::ValuesIn(supported(registry_cases(), nullptr)),
                         [](const ::testing::TestParamInfo<CaseSpec>& info) { return "case" + std::to_string(info.index); });

// States which registry cases the CUDA backend does not run yet, and why (they run on the CPU backend).
TEST(CudaCoverage, ListsExcludedCases) {
  std::map<std::string, int> excluded;
  const auto cases = registry_cases();
  const size_t n = supported(cases, &excluded).size();
  std::printf("CUDA runs %zu of %zu registry cases; excluded:\n", n, cases.size());
  for (const auto& [reason, count] : excluded) std::printf("  %3d  %s\n", count, reason.c_str());
  EXPECT_GT(n, cases.size() / 3);
}

// A serving-sized decode batch: 32 query heads over 8 KV heads, head_dim 128, bf16.
CaseSpec serving_decode(int32_t batch, int32_t kv, int32_t page) {
  CaseSpec s;
  s.kind = PlanKind::kDecode;
  s.num_qo_heads = 32, s.num_kv_heads = 8, s.head_dim_qk = 128, s.page_size = page;
  s.qo_lens.assign(batch, 1);
  s.kv_lens.assign(batch, kv);
  s.spare_pages = 17;
  return s;
}

// Runs each spec (seeds from `seed` on) with rows sampled for the float64 reference.
void run_sampled(std::vector<CaseSpec> specs, uint64_t seed) {
  for (CaseSpec& s : specs) {
    s.seed = seed++;
    const std::string error = run_and_check(s, 24);
    EXPECT_TRUE(error.empty()) << error;
  }
}

// Serving-sized batches; rows sampled for the float64 reference.
TEST(CudaLarge, ServingShapes) {
  const auto base = serving_decode;
  std::vector<CaseSpec> specs = {base(1, 32768, 16), base(16, 4096, 16), base(8, 3001, 1), base(4, 5000, 64)};
  CaseSpec zipf = base(16, 0, 16);
  std::mt19937 rng(7);
  for (int32_t& l : zipf.kv_lens) l = 16 + static_cast<int32_t>(30000.0 / (1 + rng() % 64));
  specs.push_back(zipf);
  CaseSpec spec4 = base(32, 2048, 16);
  spec4.qo_lens.assign(32, 4);
  spec4.options.causal = true;
  specs.push_back(spec4);
  CaseSpec hnd = base(8, 4000, 16);
  hnd.layout = KVLayout::kHND;
  hnd.format = KVFormat::kBlockTable;
  specs.push_back(hnd);
  // Split KV merged in the kernel: MQA (one KV head: hundreds of pieces per merge, 32 rows in two CTAs),
  // GQA group 7 with 3 query tokens (21 rows), head dims 64 and 256 (other merge chunkings).
  CaseSpec mqa = base(1, 20011, 16);
  mqa.num_kv_heads = 1;
  specs.push_back(mqa);
  CaseSpec g7 = base(2, 9000, 16);
  g7.num_qo_heads = 28, g7.num_kv_heads = 4;
  g7.qo_lens.assign(2, 3);
  specs.push_back(g7);
  CaseSpec d64 = base(2, 12000, 16), d256 = base(2, 12000, 16);
  d64.head_dim_qk = 64, d256.head_dim_qk = 256;
  specs.push_back(d64);
  specs.push_back(d256);
  run_sampled(specs, 77);
}

// fp8 K/V decode (e4m3fn, e5m2) against the float64 reference: every path of the fp8 kernel (testing/registry.h),
// then serving-sized batches with sampled rows. Fp8Cases.ToleranceRejectsWronglyDecodedKV (CPU tests) shows that
// these tolerances reject the ways an fp8 decode can go wrong.
TEST(CudaFp8, DecodeCases) {
  for (const CaseSpec& s : fp8_decode_cases()) {
    const Support sup = supports(cuda_config(s));
    ASSERT_TRUE(sup.ok) << sup.reason << "\n  case: " << s.describe();
    const std::string error = run_and_check(s);
    EXPECT_TRUE(error.empty()) << error;
  }
}

TEST(CudaFp8, ServingShapes) {
  auto base = [](DType kv, int32_t batch, int32_t len, int32_t page) {
    CaseSpec s = serving_decode(batch, len, page);
    s.kv_dtype = kv;
    s.k_scale = 0.5f, s.v_scale = 0.25f;
    return s;
  };
  std::vector<CaseSpec> specs = {base(DType::kFloat8E4M3, 16, 4096, 16), base(DType::kFloat8E5M2, 1, 32768, 16),
                                 base(DType::kFloat8E4M3, 8, 3001, 1)};
  CaseSpec hnd = base(DType::kFloat8E5M2, 8, 4000, 16);
  hnd.layout = KVLayout::kHND;
  hnd.format = KVFormat::kBlockTable;
  hnd.q_dtype = hnd.o_dtype = DType::kFloat16;
  specs.push_back(hnd);
  CaseSpec spec4 = base(DType::kFloat8E4M3, 32, 2048, 16);
  spec4.qo_lens.assign(32, 4);
  spec4.options.causal = true;
  specs.push_back(spec4);
  run_sampled(specs, 91);
}

// The fp8 kernels multiply in fp16: bf16 query rows beyond fp16's range are scaled into it by a power of two per
// row, which the logits take back (load_query_rows_permuted). Half the rows (token + head even) hold values 2^17
// times the usual, so every CTA (one token x the 4 heads of a group) mixes scaled and ordinary rows; sm_scale is
// the default over 2^17, so the big rows' logits are the usual ones (a lost row scale, 2^3 or 2^4 here, would flatten
// their softmax and fail the check) and the ordinary rows' are near 0.
TEST(CudaFp8, QueryRowsBeyondFp16Range) {
  for (DType kv : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    CaseSpec s = serving_decode(6, 1500, 16);
    s.kv_dtype = kv;
    s.k_scale = 0.5f, s.v_scale = 0.25f;
    s.seed = 4242 + static_cast<int>(kv);
    Case c = make_case(s);
    ASSERT_EQ(c.q_view.dtype, DType::kBFloat16);
    uint16_t* q = static_cast<uint16_t*>(c.q_view.data);
    int scaled = 0;
    for (int64_t tok = 0; tok < 6; ++tok)
      for (int64_t h = 0; h < s.num_qo_heads; ++h) {
        if ((tok + h) % 2 != 0) continue;
        ++scaled;
        for (int64_t d = 0; d < s.head_dim_qk; ++d) {
          uint16_t& bits = q[tok * c.q_view.strides[0] + h * c.q_view.strides[1] + d];
          const uint32_t e = bits & 0x7f80u;
          ASSERT_TRUE(e != 0 && e + (17u << 7) < 0x7f80u) << "a query value too small or too large to move";
          bits = static_cast<uint16_t>(bits + (17u << 7));  // x 2^17, exact: the exponent moves
          c.q_vals[(tok * s.num_qo_heads + h) * s.head_dim_qk + d] *= 131072.f;
        }
      }
    ASSERT_EQ(scaled, 6 * 32 / 2);
    c.options.sm_scale = 1.f / std::sqrt(128.f) / 131072.f;
    c.spec.options.sm_scale = c.options.sm_scale;
    DeviceCase dev(c);
    const AttentionPlan plan = plan_and_run_cuda(c, dev);
    const Verdict v = check_case(c, {});
    EXPECT_TRUE(v.ok) << v.message << "\n  case: " << s.describe() << "\n  plan: " << plan.describe();
  }
}

// Small fp8 batches through every part of the fp8 kernel (split KV with merges over page size 3 and an empty
// request; ragged e5m2 at head_dim 64, whose 64-byte rows take the other swizzle); compute-sanitizer runs these.
TEST(CudaFp8Small, SplitPagedAndRagged) {
  const std::vector<CaseSpec> cases = fp8_decode_cases();
  for (const CaseSpec& s : {cases[6], cases[5]}) {
    ASSERT_TRUE(s.plan.num_workers == 64 || s.format == KVFormat::kRagged) << "fp8_decode_cases() changed order";
    const std::string error = run_and_check(s);
    EXPECT_TRUE(error.empty()) << error;
  }
}

// fp8 K/V is built for decode only, without fused RoPE: both refusals name the value and what is accepted.
TEST(CudaFp8, PrefillAndFusedRopeAreRefused) {
  CaseSpec s = fp8_decode_cases()[0];
  s.kind = PlanKind::kPrefill;
  Support sup = supports(cuda_config(s));
  EXPECT_FALSE(sup.ok);
  EXPECT_NE(sup.reason.find("kv_dtype float8_e4m3"), std::string::npos) << sup.reason;
  EXPECT_NE(sup.reason.find("prefill kernels take K/V in {bfloat16}"), std::string::npos) << sup.reason;
  s = fp8_decode_cases()[0];
  s.options.rope = true;
  sup = supports(cuda_config(s));
  EXPECT_FALSE(sup.ok);
  EXPECT_NE(sup.reason.find("fused RoPE"), std::string::npos) << sup.reason;
  s = fp8_decode_cases()[0];
  s.kv_dtype = DType::kFloat16;  // bf16 Q with fp16 K/V
  sup = supports(cuda_config(s));
  EXPECT_FALSE(sup.ok);
  EXPECT_NE(sup.reason.find("{bfloat16, float8_e4m3, float8_e5m2}"), std::string::npos) << sup.reason;
}

// Prefill at serving sizes: a 32K causal prefill, a batch of 64 ragged requests, append to a paged prefix with
// page size 1, head dims 64 and 256, GQA group 3 (tiles of 42 tokens); rows sampled for the float64 reference.
TEST(CudaLarge, PrefillShapes) {
  auto base = [](std::vector<int32_t> qo, std::vector<int32_t> kv, int32_t d = 128) {
    CaseSpec s;
    s.kind = PlanKind::kPrefill;
    s.num_qo_heads = 32, s.num_kv_heads = 8, s.head_dim_qk = d;
    s.qo_lens = std::move(qo);
    s.kv_lens = std::move(kv);
    s.options.causal = true;
    s.spare_pages = 9;
    return s;
  };
  std::vector<CaseSpec> specs = {base({32768}, {32768})};
  std::mt19937 rng(3);
  std::vector<int32_t> ragged(64);
  for (int32_t& l : ragged) l = 1 + static_cast<int32_t>(rng() % 1500);
  CaseSpec r = base(ragged, ragged);
  r.format = KVFormat::kRagged;
  specs.push_back(r);
  CaseSpec append = base(std::vector<int32_t>(8, 300), std::vector<int32_t>(8, 2300));
  append.page_size = 1;
  specs.push_back(append);
  specs.push_back(base({700, 2000}, {900, 2000}, 64));
  specs.push_back(base({700, 2000}, {900, 2000}, 256));
  CaseSpec g3 = base({999, 130}, {1500, 130});
  g3.num_qo_heads = 24;
  g3.options.causal = false;
  g3.layout = KVLayout::kHND;
  specs.push_back(g3);
  uint64_t seed = 177;
  for (CaseSpec& s : specs) {
    s.seed = seed++;
    const std::string error = run_and_check(s, 24);
    EXPECT_TRUE(error.empty()) << error;
  }
}

// Small causal prefill batches for compute-sanitizer: 6 query heads over 2 KV heads (a group of 3), split KV with
// merges (64 workers), an empty request, a partial last page, spare pages poisoned (paged K/V).
std::string run_small_causal_prefill(int32_t head_dim, int32_t page_size, std::vector<int32_t> qo,
                                     std::vector<int32_t> kv, uint64_t seed,
                                     KVFormat format = KVFormat::kPagedCSR, int32_t group = 3) {
  CaseSpec s;
  s.kind = PlanKind::kPrefill;
  s.format = format;
  s.num_qo_heads = 2 * group, s.num_kv_heads = 2, s.head_dim_qk = head_dim, s.page_size = page_size;
  s.qo_lens = std::move(qo);
  s.kv_lens = std::move(kv);
  s.options.causal = true;
  s.plan.num_workers = 64;
  s.spare_pages = 5;
  s.seed = seed;
  return run_and_check(s);
}

// Every path of the prefill kernel (several row blocks and items, split KV with merges, causal diagonal tiles, a
// partial last page, an empty request); compute-sanitizer runs this one.
TEST(CudaPrefillSmall, SplitCausalPaged) {
  const std::string error = run_small_causal_prefill(64, 3, {45, 0, 130}, {300, 9, 130}, 41);
  EXPECT_TRUE(error.empty()) << error;
}

// The same at head_dim 256 (the Hopper kernel's 128-row tiles there, one Q buffer), under the sanitizers too.
TEST(CudaPrefillSmall, HeadDim256CausalPaged) {
  const std::string error = run_small_causal_prefill(256, 5, {200, 0, 131}, {410, 7, 131}, 43);
  EXPECT_TRUE(error.empty()) << error;
}

// Ragged K/V, whose whole tiles the Hopper kernel's copier takes as tensor-map boxes by default (prefill.h:
// prefill_tma) and whose partial ones by cp.async: requests of 300, 131 and 50 rows, both kinds of tile, sanitized.
// A group of 4: final rows whose warpgroup holds 64 of them are written as boxes of O (prefill_tma_store), the
// others by the threads.
TEST(CudaPrefillSmall, RaggedCausal) {
  const std::string error =
      run_small_causal_prefill(128, 1, {300, 0, 131, 50}, {300, 0, 131, 50}, 47, KVFormat::kRagged, 4);
  EXPECT_TRUE(error.empty()) << error;
}

// Paged K/V whose whole tiles the Hopper kernel's copier takes as tensor-map boxes by default (a box per page, from
// four lanes; prefill.h: prefill_tma): pages of 16 tokens (CSR) and of 256 (a block table; a box is then a tile),
// shuffled, spare ones poisoned, partial last pages and tiles (cp.async), an empty request, a group of 4; sanitized.
TEST(CudaPrefillSmall, PagedBoxesCausal) {
  for (const auto& [page, format] : {std::pair{16, KVFormat::kPagedCSR}, std::pair{256, KVFormat::kBlockTable}}) {
    const std::string error =
        run_small_causal_prefill(128, page, {300, 0, 131, 50}, {300, 7, 397, 50}, 53 + page, format, 4);
    EXPECT_TRUE(error.empty()) << "page size " << page << ": " << error;
  }
}

// Batches of short queries (speculative verification: a few tokens per request onto long caches) plan query tiles
// of at most 64 packed rows, so run() launches the short-tile prefill kernel (one m16 tile per warp): every head
// dim, groups of 4 and 7, page sizes 1 and 16, causal and not, with RoPE and sinks, split KV included. Each plan is
// checked to have picked the short tile, and the result against the float64 reference.
TEST(CudaPrefillShortTiles, SpeculativeVerificationBatches) {
  for (int32_t d : {64, 128, 256})
    for (int32_t group : {4, 7})
      for (int32_t page : {1, 16})
        for (bool causal : {false, true}) {
          CaseSpec s;
          s.kind = PlanKind::kPrefill;
          s.num_kv_heads = 2, s.num_qo_heads = 2 * group, s.head_dim_qk = d, s.page_size = page;
          s.qo_lens = {4, 8, 1, 9, 5, 2};
          s.kv_lens = {300, 2049, 17, 4100, 9, 700};
          s.options.causal = causal;
          s.options.rope = causal && d == 128;
          s.options.sinks = !causal;
          s.seed = 900 + d + 10 * group + page + causal;
          Case c = make_case(s);
          DeviceCase dev(c);
          const AttentionPlan plan = plan_and_run_cuda(c, dev);
          EXPECT_LE(plan.qo_tile * group, 64) << "the plan did not pick the short tile: " << plan.describe();
          EXPECT_EQ(plan.tile_rows, 64) << plan.describe();
          const Verdict v = check_case(c, {});
          EXPECT_TRUE(v.ok) << v.message << "\n  case: " << s.describe() << "\n  plan: " << plan.describe();
        }
}

// PlanOptions::tile_rows picks the kernel whatever the batch: the head dim's 128-row tile for short queries, the
// 64-row tile for long ones (its query tiles are then cut at 64 rows); other values are refused, naming the set.
// Head_dim 256 has the 128-row tile where the Hopper kernel serves it (prefill_tile_rows).
TEST(CudaPrefillShortTiles, TileRowsOption) {
  const bool d256_tiles = cuda::prefill_tile_rows(256) == 128;
  std::vector<int32_t> dims = {64, 128};
  if (d256_tiles) dims.push_back(256);
  for (int32_t d : dims)
    for (int32_t rows : {64, 128})
      for (bool long_queries : {false, true}) {
        CaseSpec s;
        s.kind = PlanKind::kPrefill;
        s.num_kv_heads = 2, s.num_qo_heads = 10, s.head_dim_qk = d, s.page_size = 16;
        s.qo_lens = long_queries ? std::vector<int32_t>{300, 77} : std::vector<int32_t>{4, 8, 3};
        s.kv_lens = long_queries ? std::vector<int32_t>{900, 77} : std::vector<int32_t>{1000, 2049, 40};
        s.options.causal = true;
        s.plan.tile_rows = rows;
        s.seed = 950 + d + rows + long_queries;
        Case c = make_case(s);
        DeviceCase dev(c);
        const AttentionPlan plan = plan_and_run_cuda(c, dev);
        EXPECT_EQ(plan.tile_rows, rows) << plan.describe();
        EXPECT_LE(plan.qo_tile * 5, rows) << plan.describe();
        const Verdict v = check_case(c, {});
        EXPECT_TRUE(v.ok) << v.message << "\n  case: " << s.describe() << "\n  plan: " << plan.describe();
      }
  CaseSpec s;
  s.kind = PlanKind::kPrefill;
  s.num_kv_heads = 2, s.num_qo_heads = 8, s.head_dim_qk = 256;
  s.qo_lens = {5}, s.kv_lens = {50};
  s.plan.tile_rows = d256_tiles ? 96 : 128;  // without the Hopper kernel head_dim 256 has only the 64-row tile
  Case c = make_case(s);
  BatchPlanArgs args = c.plan_args();
  args.device = Device::cuda(0);
  const std::string expected = d256_tiles ? "options.tile_rows: 96; expected 0 (the backend's choice) or one of "
                                            "{64, 128} for head_dim 256"
                                          : "options.tile_rows: 128; expected 0 (the backend's choice) or one of {64} "
                                            "for head_dim 256";
  try {
    plan_batch_prefill(args);
    ADD_FAILURE() << "tile_rows " << s.plan.tile_rows << " at head_dim 256 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  }
}

// The K/V tile loader keeps page and token strides as unsigned 32-bit byte counts: a stride of 2 GiB is refused
// before any launch, naming the stride and the range, and one of 2 GiB - 16 bytes runs. (Negative strides are the
// front end's to refuse, for every backend.)
TEST(CudaErrors, KVStridesOutsideTheLoaderRange) {
  CaseSpec s;
  s.kind = PlanKind::kDecode;
  // One page in the pool: a page stride then moves no byte of K, so the aliasing check (which runs first and
  // measures K's extent from its strides) cannot meet the output's memory whatever the stride.
  s.num_kv_heads = 2, s.num_qo_heads = 8, s.head_dim_qk = 128, s.page_size = 128;
  s.qo_lens = {1}, s.kv_lens = {70};
  s.spare_pages = 0;
  Case c = make_case(s);
  DeviceCase dev(c);
  plan_and_run_cuda(c, dev);  // the case itself runs
  AttentionPlan plan = cuda_decode_plan(c);
  void* ws = nullptr;
  void* staging = nullptr;
  ASSERT_EQ(cudaSuccess, cudaMalloc(&ws, std::max<size_t>(256, plan.workspace_bytes)));
  ASSERT_EQ(cudaSuccess, cudaMallocHost(&staging, std::max<size_t>(1, plan.staging_bytes)));
  const Workspace w{ws, plan.workspace_bytes};
  upload_plan(plan, w, staging, plan.staging_bytes, nullptr);
  const int64_t stride = int64_t{1} << 30;  // 2 GiB of bf16
  PagedKVCache bad = dev.paged;
  bad.k.strides[0] = stride;
  try {
    run(plan, dev.q, bad, Outputs{dev.out, dev.lse}, dev.options, w, nullptr);
    ADD_FAILURE() << "K page stride " << stride << " was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("kv.k (page): stride " + std::to_string(stride)), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("from 0 to 2 GiB - 1 bytes"), std::string::npos) << e.what();
  }
  // The largest stride the loader takes, on a pool of one page, gives the reference's result.
  PagedKVCache widest = dev.paged;
  widest.k.strides[0] = widest.v.strides[0] = stride - 8;  // 2 GiB - 16 bytes: rows stay 16-byte aligned
  c.poison_outputs();
  dev.upload_outputs(c);
  run(plan, dev.q, widest, Outputs{dev.out, dev.lse}, dev.options, w, nullptr);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  dev.download_outputs(c);
  const Verdict v = check_case(c);
  EXPECT_TRUE(v.ok) << v.message;
  cudaFree(ws);
  cudaFreeHost(staging);
}

// Random batches restricted to what the CUDA backend runs; a failure prints the reproducing command.
TEST(CudaFuzz, RandomBatches) {
  const uint64_t first = std::getenv("ATTNFORGE_FUZZ_SEED") ? std::strtoull(std::getenv("ATTNFORGE_FUZZ_SEED"), nullptr, 10) : 1;
  const uint64_t iters = std::getenv("ATTNFORGE_FUZZ_ITERS") ? std::strtoull(std::getenv("ATTNFORGE_FUZZ_ITERS"), nullptr, 10) : 300;
  int ran = 0;
  for (uint64_t seed = first; seed < first + iters; ++seed) {
    CaseSpec s = random_spec(seed);
    // Fold the draw onto the CUDA subset: decode or prefill, 16-bit Q, K/V in Q's dtype (decode without fused
    // RoPE: fp8 K/V too, with 16-byte aligned strides), head dims 64/128/256.
    std::mt19937 rng(seed);
    if (s.kind == PlanKind::kDecode)
      for (int32_t& q : s.qo_lens) q = std::min(q, 8);
    if (s.options.causal)
      for (size_t i = 0; i < s.qo_lens.size(); ++i) s.kv_lens[i] = std::max(s.kv_lens[i], s.qo_lens[i]);
    if (s.q_dtype == DType::kFloat32) s.q_dtype = DType::kBFloat16;
    const bool fp8 = s.kind == PlanKind::kDecode && !s.options.rope &&
                     (s.kv_dtype == DType::kFloat8E4M3 || s.kv_dtype == DType::kFloat8E5M2);
    if (fp8) {
      s.padded_strides = false;  // 8-element padding is 8 bytes of fp8
    } else {
      s.kv_dtype = s.q_dtype;
      s.k_scale = s.v_scale = 1.f;
    }
    if (s.o_dtype != DType::kFloat32) s.o_dtype = s.q_dtype;
    s.head_dim_qk = std::vector<int32_t>{64, 128, 256}[rng() % 3];
    s.head_dim_vo = 0;
    if (!supports(cuda_config(s)).ok) continue;
    ++ran;
    std::string error;
    try {
      error = run_and_check(s);
    } catch (const std::exception& e) {
      error = std::string("threw: ") + e.what() + "\n  case: " + s.describe();
    }
    if (!error.empty()) {
      ADD_FAILURE() << error << "\n  reproduce: ATTNFORGE_FUZZ_SEED=" << seed
                    << " ATTNFORGE_FUZZ_ITERS=1 attnforge_cuda_tests --gtest_filter=CudaFuzz.*";
      return;
    }
  }
  EXPECT_GT(ran, static_cast<int>(iters / 2));
}

// The wgmma building blocks (backends/cuda/device/wgmma.cuh: the 128-byte swizzle, the K-major and MN-major
// descriptors over one and two 64-element panels, the register-A form, N = 64 and 128) on a Hopper GPU: the probe
// kernels' products (tests/wgmma_probe.h) against float64 on fresh random bf16 inputs, outputs poisoned with NaN
// first. The bound is fp32 accumulation's, n u sum |a b| with n = K and u = 2^-22 (tensor cores add with less than
// IEEE fp32's rounding); a wrong layout or descriptor is off by the size of the products themselves.
TEST(CudaWgmma, ProbeProductsMatchFloat64) {
  using attnforge::testing::kProbeLd;
  using attnforge::testing::kWgmmaProbes;
  int device = 0, major = 0;
  ASSERT_EQ(cudaSuccess, cudaGetDevice(&device));
  ASSERT_EQ(cudaSuccess, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major != 9) GTEST_SKIP() << "wgmma runs on sm_90 only";
  ASSERT_EQ(cudaSuccess, cudaFree(nullptr));  // the primary context, current for the driver calls below
  const jit::CompiledModule m = jit::compile(attnforge::testing::wgmma_probe_source());
  ASSERT_EQ(m.lowered_names.size(), std::size(kWgmmaProbes));
  const cuda::DriverApi& d = cuda::driver();
  CUmodule module;
  ATTNFORGE_CU_CHECK(d.cuModuleLoadData(&module, m.binary.data()));

  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  auto to_bf16 = [](float x) {  // round to nearest even
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  };
  auto value = [](uint16_t bits) {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return static_cast<double>(x);
  };
  const size_t elems = 128 * kProbeLd;  // every operand and the output fit [128][kProbeLd]
  std::vector<uint16_t> a(elems), b(elems);
  for (uint16_t& x : a) x = to_bf16(normal(rng));
  for (uint16_t& x : b) x = to_bf16(normal(rng));
  void *da = nullptr, *db = nullptr, *dc = nullptr;
  ASSERT_EQ(cudaSuccess, cudaMalloc(&da, elems * 2));
  ASSERT_EQ(cudaSuccess, cudaMalloc(&db, elems * 2));
  ASSERT_EQ(cudaSuccess, cudaMalloc(&dc, elems * sizeof(float)));
  ASSERT_EQ(cudaSuccess, cudaMemcpy(da, a.data(), elems * 2, cudaMemcpyHostToDevice));
  ASSERT_EQ(cudaSuccess, cudaMemcpy(db, b.data(), elems * 2, cudaMemcpyHostToDevice));
  for (size_t probe = 0; probe < std::size(kWgmmaProbes); ++probe) {
    const attnforge::testing::WgmmaProbe& pr = kWgmmaProbes[probe];
    SCOPED_TRACE(pr.name);
    CUfunction f;
    ATTNFORGE_CU_CHECK(d.cuModuleGetFunction(&f, module, m.lowered_names[probe].c_str()));
    ASSERT_EQ(cudaSuccess, cudaMemset(dc, 0xff, elems * sizeof(float)));  // NaN
    void* args[] = {&da, &db, &dc};
    ATTNFORGE_CU_CHECK(d.cuLaunchKernel(f, 1, 1, 1, 128, 1, 1, 0, nullptr, args, nullptr));
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    std::vector<float> c(elems);
    ASSERT_EQ(cudaSuccess, cudaMemcpy(c.data(), dc, elems * sizeof(float), cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int i = 0; i < pr.m; ++i)
      for (int j = 0; j < pr.n; ++j) {
        double ref = 0, mag = 0;
        for (int k = 0; k < pr.k; ++k) {
          const uint16_t bk = pr.b_k_major ? b[j * kProbeLd + k] : b[k * kProbeLd + j];
          const double x = value(a[i * kProbeLd + k]) * value(bk);
          ref += x, mag += std::fabs(x);
        }
        const double got = c[i * kProbeLd + j];
        if (!(std::fabs(got - ref) <= pr.k * std::ldexp(mag, -22)) && ++bad <= 5)
          ADD_FAILURE() << "c[" << i << "][" << j << "] = " << got << ", float64 " << ref << " (sum |ab| " << mag << ")";
      }
    EXPECT_EQ(bad, 0) << bad << " of " << pr.m * pr.n << " elements outside the bound";
  }
  cudaFree(da), cudaFree(db), cudaFree(dc);
  ATTNFORGE_CU_CHECK(d.cuModuleUnload(module));
}

// K/V tiles by the tensor memory accelerator (backends/cuda/tma.h, device/tma.cuh), the groundwork of a copier
// without per-row work: on a Hopper GPU the probe (tests/tma_probe.h) copies boxes of a random bf16 cache (NHD and
// HND pages of 4 to 64 tokens with shuffled page ids, half-page boxes, ragged rows from an odd start) into a
// poisoned tile, and every 16-byte chunk must land where the prefill kernel's wgmma panels hold it: row r's chunk c
// of panel p at p rows 128 + r 128 + ((c ^ (r % 8)) 16) (panel_bytes).
TEST(CudaTma, KVBoxesLandAsWgmmaPanels) {
  int device = 0, major = 0;
  ASSERT_EQ(cudaSuccess, cudaGetDevice(&device));
  ASSERT_EQ(cudaSuccess, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major != 9) GTEST_SKIP() << "the probe is built for sm_90a";
  ASSERT_EQ(cudaSuccess, cudaFree(nullptr));  // the primary context, current for the driver calls below
  const jit::CompiledModule m = jit::compile(tma_probe_source());
  const cuda::DriverApi& d = cuda::driver();
  CUmodule module;
  ATTNFORGE_CU_CHECK(d.cuModuleLoadData(&module, m.binary.data()));
  CUfunction f;
  ATTNFORGE_CU_CHECK(d.cuModuleGetFunction(&f, module, m.lowered_names[0].c_str()));

  struct Layout {
    const char* name;
    bool ragged, hnd;
    int page_size, head_dim, rows, box_slots, start;  // start: the tile's first token of the request
  };
  const Layout layouts[] = {{"NHD page 16, d128", false, false, 16, 128, 128, 16, 0},
                            {"HND page 16, d64", false, true, 16, 64, 128, 16, 32},
                            {"NHD page 8, d256", false, false, 8, 256, 64, 8, 8},
                            {"NHD page 4, d128 (boxes 4 rows apart)", false, false, 4, 128, 128, 4, 12},
                            {"HND page 64, d128", false, true, 64, 128, 128, 64, 64},
                            {"NHD page 32, half-page boxes, d128", false, false, 32, 128, 128, 16, 48},
                            {"ragged, d128, odd start", true, false, 1, 128, 128, 1, 37}};
  constexpr int kHeads = 8, kHead = 5, kPages = 48;
  std::mt19937 rng(11);
  for (const Layout& l : layouts) {
    SCOPED_TRACE(l.name);
    const int64_t page_tokens = l.ragged ? 1 : l.page_size;
    const int64_t num_pages = l.ragged ? 400 : kPages;
    const int64_t elems = num_pages * page_tokens * kHeads * l.head_dim;
    std::vector<uint16_t> cache(elems);
    for (uint16_t& x : cache) x = static_cast<uint16_t>(rng());
    std::vector<int> perm(kPages);
    for (int i = 0; i < kPages; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);  // the request's pages, in order
    KVParams kv{};
    kv.dtype = DType::kBFloat16;
    kv.format = l.ragged ? KVFormat::kRagged : KVFormat::kPagedCSR;
    kv.page_size = static_cast<int32_t>(page_tokens);
    kv.num_kv_heads = kHeads;
    const int64_t hd = l.head_dim;
    kv.k_stride_head = l.hnd ? page_tokens * hd : hd;
    kv.k_stride_token = l.hnd ? hd : kHeads * hd;
    kv.k_stride_page = page_tokens * kHeads * hd;
    // Element (page, slot, head, dim) of the cache; where token r of the tile lives.
    auto at = [&](int64_t page, int64_t slot, int64_t h, int64_t dim) {
      return page * kv.k_stride_page + slot * kv.k_stride_token + h * kv.k_stride_head + dim;
    };
    auto page_slot = [&](int r) -> std::pair<int64_t, int64_t> {
      const int t = l.start + r;
      return l.ragged ? std::pair<int64_t, int64_t>{t, 0} : std::pair<int64_t, int64_t>{perm[t / l.page_size], t % l.page_size};
    };
    void* dcache = nullptr;
    ASSERT_EQ(cudaSuccess, cudaMalloc(&dcache, elems * 2));
    ASSERT_EQ(cudaSuccess, cudaMemcpy(dcache, cache.data(), elems * 2, cudaMemcpyHostToDevice));
    kv.k = kv.v = dcache;
    const cuda::KVBox box = l.ragged ? cuda::KVBox{1, l.rows} : cuda::KVBox{l.box_slots, 1};
    kv.num_pages = num_pages;
    const TensorMap map = cuda::kv_tensor_map(kv, false, l.head_dim, box);
    std::vector<int> boxes;  // slot, page, first row
    const int box_rows = box.slots * box.pages;
    for (int r = 0; r < l.rows; r += box_rows) {
      const auto [page, slot] = page_slot(r);
      boxes.insert(boxes.end(), {static_cast<int>(slot), static_cast<int>(page), r});
    }
    const int panels = l.head_dim / 64, bytes = panels * l.rows * 128;
    ASSERT_LE(bytes, kTmaProbeTileBytes);
    int* dboxes = nullptr;
    unsigned char* dout = nullptr;
    ASSERT_EQ(cudaSuccess, cudaMalloc(&dboxes, boxes.size() * sizeof(int)));
    ASSERT_EQ(cudaSuccess, cudaMalloc(&dout, bytes));
    ASSERT_EQ(cudaSuccess, cudaMemcpy(dboxes, boxes.data(), boxes.size() * sizeof(int), cudaMemcpyHostToDevice));
    ASSERT_EQ(cudaSuccess, cudaMemset(dout, 0x5a, bytes));
    int num_boxes = static_cast<int>(boxes.size() / 3), rows = l.rows, head = kHead;
    TensorMap map_arg = map;
    int box_rows_arg = box_rows, panels_arg = panels, heads_inner = cuda::kv_heads_inner(kv, false) ? 1 : 0;
    EXPECT_EQ(heads_inner, l.ragged || !l.hnd);  // the axis with the smaller stride first
    void* args[] = {&map_arg, &dboxes, &num_boxes, &box_rows_arg, &panels_arg, &rows, &head, &heads_inner, &dout};
    ATTNFORGE_CU_CHECK(d.cuLaunchKernel(f, 1, 1, 1, 128, 1, 1, 0, nullptr, args, nullptr));
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    std::vector<unsigned char> out(bytes);
    ASSERT_EQ(cudaSuccess, cudaMemcpy(out.data(), dout, bytes, cudaMemcpyDeviceToHost));
    ASSERT_FALSE(std::all_of(out.begin(), out.end(), [](unsigned char b) { return b == 0xee; }))
        << "the barrier did not complete: the boxes brought fewer bytes than expected";
    int bad = 0;
    for (int p = 0; p < panels; ++p)
      for (int r = 0; r < l.rows; ++r)
        for (int c = 0; c < 8; ++c) {
          const auto [page, slot] = page_slot(r);
          const unsigned char* got = out.data() + p * l.rows * 128 + r * 128 + ((c ^ (r % 8)) * 16);
          const uint16_t* want = cache.data() + at(page, slot, kHead, 64 * p + 8 * c);
          if (std::memcmp(got, want, 16) != 0 && bad++ < 5)
            ADD_FAILURE() << "panel " << p << ", row " << r << " (page " << page << ", slot " << slot << "), chunk "
                          << c << ": not the cache's bytes";
        }
    EXPECT_EQ(bad, 0);
    cudaFree(dcache), cudaFree(dboxes), cudaFree(dout);
  }
  ATTNFORGE_CU_CHECK(d.cuModuleUnload(module));
}

// Which plans the Hopper prefill kernel takes under each setting: by default (and forced on) the head dim's own
// tiles (128 rows at head_dim 64 and 128, 64 at 256) on compute capability 9.0 only, none when off; never the short
// 64-row tiles of head_dim 64 and 128.
TEST(CudaWgmma, PrefillKernelSelectionFollowsTheSetting) {
  int device = 0, major = 0, minor = 0;
  ASSERT_EQ(cudaSuccess, cudaGetDevice(&device));
  ASSERT_EQ(cudaSuccess, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  ASSERT_EQ(cudaSuccess, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  const bool sm90 = major == 9 && minor == 0;
  const cuda::PrefillWgmma before = cuda::prefill_wgmma();
  for (const cuda::PrefillWgmma mode : {cuda::PrefillWgmma::kAuto, cuda::PrefillWgmma::kOn}) {
    cuda::set_prefill_wgmma(mode);
    EXPECT_EQ(sm90, cuda::prefill_wgmma_serves(64, 128));
    EXPECT_EQ(sm90, cuda::prefill_wgmma_serves(128, 128));
    EXPECT_EQ(sm90, cuda::prefill_wgmma_serves(256, 128));  // the portable kernel runs those in two row blocks
    EXPECT_EQ(sm90 ? 128 : 64, cuda::prefill_tile_rows(256));
    EXPECT_EQ(128, cuda::prefill_tile_rows(128));
    EXPECT_FALSE(cuda::prefill_wgmma_serves(128, 64));
    EXPECT_FALSE(cuda::prefill_wgmma_serves(64, 64));
    EXPECT_FALSE(cuda::prefill_wgmma_serves(256, 64));
    EXPECT_FALSE(cuda::prefill_wgmma_serves(96, 128));
  }
  cuda::set_prefill_wgmma(cuda::PrefillWgmma::kOff);
  EXPECT_FALSE(cuda::prefill_wgmma_serves(128, 128));
  EXPECT_EQ(64, cuda::prefill_tile_rows(256));
  // Plans of 128-row tiles the Hopper kernel takes are balanced over its one CTA per SM.
  if (sm90) {
    const int portable = cuda::prefill_ctas_per_sm(128, 128);
    cuda::set_prefill_wgmma(cuda::PrefillWgmma::kAuto);
    EXPECT_EQ(1, cuda::prefill_ctas_per_sm(128, 128));
    EXPECT_EQ(portable, cuda::prefill_ctas_per_sm(128, 64));
  }
  cuda::set_prefill_wgmma(before);
}

// The planner balances a prefill plan over the CTAs per SM of the kernel that runs its tiles: plans of 64-row
// tiles run the portable kernel whatever the setting and are split alike (with the setting on they were once
// balanced over the Hopper kernel's one CTA per SM: verify 64 x 8 + 4096 ran 383 -> 444 us); plans of 128-row
// tiles on sm_90 are balanced over one CTA per SM, so they split less than for the portable kernel's two.
TEST(CudaWgmma, PlansBalanceOverTheKernelThatRunsTheirTiles) {
  int device = 0, major = 0, minor = 0;
  ASSERT_EQ(cudaSuccess, cudaGetDevice(&device));
  ASSERT_EQ(cudaSuccess, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  ASSERT_EQ(cudaSuccess, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  const cuda::PrefillWgmma before = cuda::prefill_wgmma();
  auto plan_with = [](cuda::PrefillWgmma mode, const CaseSpec& s) {
    cuda::set_prefill_wgmma(mode);
    const Case c = make_case(s);  // plan_args() views the case's metadata
    BatchPlanArgs args = c.plan_args();
    args.device = Device::cuda(0);
    return plan_batch_prefill(args);
  };
  CaseSpec verify;  // 8 draft tokens x 4 heads of a group: 32 rows, the 64-row tile
  verify.kind = PlanKind::kPrefill;
  verify.num_qo_heads = 32, verify.num_kv_heads = 8, verify.head_dim_qk = 128, verify.page_size = 16;
  verify.qo_lens = std::vector<int32_t>(16, 8);
  verify.kv_lens = std::vector<int32_t>(16, 1024);
  verify.options.causal = true;
  const AttentionPlan on = plan_with(cuda::PrefillWgmma::kAuto, verify);
  const AttentionPlan off = plan_with(cuda::PrefillWgmma::kOff, verify);
  EXPECT_EQ(on.tile_rows, 64) << on.describe();
  EXPECT_EQ(on.describe(), off.describe());
  CaseSpec long_kv = verify;  // one 128-row tile per request over long KV: split to fill the SMs
  long_kv.qo_lens = {32, 32};
  long_kv.kv_lens = {8192, 8192};
  const AttentionPlan on_long = plan_with(cuda::PrefillWgmma::kAuto, long_kv);
  const AttentionPlan off_long = plan_with(cuda::PrefillWgmma::kOff, long_kv);
  EXPECT_EQ(on_long.tile_rows, 128) << on_long.describe();
  // The pipelined (persistent) form is nvcc's only: under ATTNFORGE_KERNELS=nvrtc every prefill kernel is the
  // portable one, so the planner has nothing else to balance over and both plans must be the same.
  if (major == 9 && minor == 0 && jit::cuda_kernels() != jit::CudaKernels::kNvrtc)
    EXPECT_GT(on_long.kv_chunk, off_long.kv_chunk) << on_long.describe() << "\n" << off_long.describe();
  else
    EXPECT_EQ(on_long.describe(), off_long.describe());
  cuda::set_prefill_wgmma(before);
}

// Programmatic launch (sm_90+, decode_programmatic_launch): the decode kernel's CTAs may be scheduled while the
// kernel before it on the stream runs, and must read what the caller gives only after griddepcontrol.wait. The kernel
// before it here lets its dependents launch at once, spins for 100 us, then writes Q and the page table; until
// then Q is NaN and every page id names a NaN-filled spare page, so a read before the wait reaches the output.
// Split KV (merges) and a request with one page cover both kernels.
TEST(CudaProgrammaticLaunch, DecodeReadsInputsAfterTheKernelBefore) {
  int device = 0, major = 0;
  ASSERT_EQ(cudaSuccess, cudaGetDevice(&device));
  ASSERT_EQ(cudaSuccess, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 9) GTEST_SKIP() << "programmatic dependent launch needs sm_90";
  ASSERT_EQ(cudaSuccess, cudaFree(nullptr));  // the primary context, current for the driver calls below
  jit::KernelSource src;
  src.name = "delayed_copy_sm90a";
  src.arch = "sm_90a";
  src.entry_points = {"&delayed_copy"};
  src.source = R"(#include "backends/cuda/device/ptx.cuh"
// Lets the next kernel launch, waits `ns` of global time, then copies two byte ranges.
__global__ void delayed_copy(unsigned char* d0, const unsigned char* s0, unsigned long long n0, unsigned char* d1,
                             const unsigned char* s1, unsigned long long n1, unsigned long long ns) {
  attnforge::cuda::grid_launch_dependents();
  if (threadIdx.x == 0) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (t - t0 < ns);
  }
  __syncthreads();
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n0; i += gridDim.x * blockDim.x) d0[i] = s0[i];
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n1; i += gridDim.x * blockDim.x) d1[i] = s1[i];
}
)";
  const jit::CompiledModule m = jit::compile(src);
  const cuda::DriverApi& d = cuda::driver();
  CUmodule module;
  ATTNFORGE_CU_CHECK(d.cuModuleLoadData(&module, m.binary.data()));
  CUfunction copy;
  ATTNFORGE_CU_CHECK(d.cuModuleGetFunction(&copy, module, m.lowered_names[0].c_str()));

  CaseSpec s;
  s.kind = PlanKind::kDecode;
  s.num_qo_heads = 28, s.num_kv_heads = 4, s.head_dim_qk = 128, s.page_size = 16;  // group 7
  s.qo_lens.assign(3, 1);
  s.kv_lens = {9000, 11, 2500};
  s.spare_pages = 4;
  s.seed = 17;
  Case c = make_case(s);
  DeviceCase dev(c);
  AttentionPlan plan = cuda_decode_plan(c);
  ASSERT_FALSE(plan.merges.empty()) << plan.describe();
  const UploadedPlan uploaded(plan);

  // A spare page (not in the table: NaN-filled by make_case) for the poisoned table.
  const TensorView& host_ids = c.paged.table.indices;
  const int32_t* ids = host_ids.ptr<const int32_t>();
  const int64_t num_ids = host_ids.shape[0], num_pages = c.paged.k.shape[0];
  std::vector<bool> used(num_pages, false);
  for (int64_t i = 0; i < num_ids; ++i)
    if (ids[i] >= 0) used[ids[i]] = true;  // entries past indptr[batch] are -1
  const int32_t spare = static_cast<int32_t>(std::find(used.begin(), used.end(), false) - used.begin());
  ASSERT_LT(spare, num_pages);
  std::vector<int32_t> poisoned_ids(ids, ids + num_ids);
  for (int32_t& id : poisoned_ids)
    if (id >= 0) id = spare;
  const size_t q_bytes = dev.q.numel() * 2, id_bytes = num_ids * sizeof(int32_t);
  void *real_q = nullptr, *real_ids = nullptr;
  ASSERT_EQ(cudaSuccess, cudaMalloc(&real_q, q_bytes));
  ASSERT_EQ(cudaSuccess, cudaMalloc(&real_ids, id_bytes));
  ASSERT_EQ(cudaSuccess, cudaMemcpy(real_q, dev.q.data, q_bytes, cudaMemcpyDeviceToDevice));
  ASSERT_EQ(cudaSuccess, cudaMemcpy(real_ids, dev.paged.table.indices.data, id_bytes, cudaMemcpyDeviceToDevice));
  cudaStream_t stream;
  ASSERT_EQ(cudaSuccess, cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int run_index = 0; run_index < 4; ++run_index) {
    AttentionOptions options = dev.options;
    options.programmatic_launch = run_index < 3;  // the last run launches plainly
    c.poison_outputs();
    dev.upload_outputs(c);
    ASSERT_EQ(cudaSuccess, cudaMemsetAsync(dev.q.data, 0xff, q_bytes, stream));  // bf16 NaN
    ASSERT_EQ(cudaSuccess, cudaMemcpyAsync(dev.paged.table.indices.data, poisoned_ids.data(), id_bytes,
                                           cudaMemcpyHostToDevice, stream));
    void* q_ptr = dev.q.data;
    void* ids_ptr = dev.paged.table.indices.data;
    unsigned long long n0 = q_bytes, n1 = id_bytes, ns = 100000;
    void* kernel_args[] = {&q_ptr, &real_q, &n0, &ids_ptr, &real_ids, &n1, &ns};
    ATTNFORGE_CU_CHECK(d.cuLaunchKernel(copy, 4, 1, 1, 256, 1, 1, 0, static_cast<CUstream>(stream), kernel_args,
                                        nullptr));
    run(plan, dev.q, dev.paged, Outputs{dev.out, dev.lse}, options, uploaded.w, stream);
    ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(stream));
    dev.download_outputs(c);
    const Verdict v = check_case(c, {});
    EXPECT_TRUE(v.ok) << "run " << run_index << " (programmatic_launch " << options.programmatic_launch
                      << "): " << v.message << "\n  plan: " << plan.describe();
  }
  cudaStreamDestroy(stream);
  cudaFree(real_q), cudaFree(real_ids);
  ATTNFORGE_CU_CHECK(d.cuModuleUnload(module));
}

// Runs of one uploaded plan on one workspace, one after another, must each be right and bit-identical: nothing a
// run leaves in the workspace (partial states, metadata) may leak into the next.
TEST(CudaSplitMerge, RepeatedRunsOnOneWorkspace) {
  CaseSpec s;
  s.kind = PlanKind::kDecode;
  s.num_qo_heads = 32, s.num_kv_heads = 8, s.head_dim_qk = 128, s.page_size = 16;
  s.qo_lens.assign(3, 2);
  s.kv_lens = {15000, 333, 7001};
  s.seed = 91;
  Case c = make_case(s);
  DeviceCase dev(c);
  AttentionPlan plan = cuda_decode_plan(c);
  ASSERT_FALSE(plan.merges.empty()) << plan.describe();
  const UploadedPlan uploaded(plan);
  const Workspace& w = uploaded.w;
  std::vector<uint8_t> first;
  for (int run_index = 0; run_index < 4; ++run_index) {
    const CheckedRun r = run_checked(c, dev, plan, w);
    EXPECT_TRUE(r.verdict.ok) << "run " << run_index << ": " << r.verdict.message;
    if (run_index == 0)
      first = r.bytes;
    else
      EXPECT_TRUE(r.bytes == first) << "run " << run_index << " differs from run 0";
  }

}

// The merge mode the device-check run sets (ATTNFORGE_DECODE_KERNEL_MERGE), "1" when unset.
std::string kernel_merge_mode() {
  const char* mode = std::getenv("ATTNFORGE_DECODE_KERNEL_MERGE");
  return mode != nullptr ? mode : "1";
}

// Decode plans whose merges the decode kernel does (AttentionPlan::merge_counters; its last CTA of a merge combines
// the states): chosen by the batch shape (batches of more than 32 (request, KV head) pairs at head_dim 128, where
// smaller ones stream their merges), never in deterministic mode.
TEST(CudaKernelMerge, ChosenByBatchShape) {
  if (kernel_merge_mode() == "stream") GTEST_SKIP() << "every merge is streamed under ATTNFORGE_DECODE_KERNEL_MERGE=stream";
  auto plan_of = [](CaseSpec s) { return cuda_decode_plan(make_case(s)); };
  if (kernel_merge_mode() == "1") {  // small batches at head_dim 128 too: no streaming by default
    const AttentionPlan small = plan_of(serving_decode(1, 32768, 16));
    EXPECT_GT(small.merge_counters, 0) << small.describe();
    EXPECT_EQ(small.merge_flags, 0) << small.describe();
  }
  const AttentionPlan one = plan_of(serving_decode(5, 9000, 16));
  ASSERT_FALSE(one.merges.empty()) << one.describe();
  EXPECT_GT(one.merge_counters, 0) << one.describe();
  EXPECT_EQ(one.merge_counters, one.merge_capacity * 8) << "one counter per (merge, KV head): 4 rows a CTA";
  CaseSpec det = serving_decode(1, 9000, 16);
  det.plan.deterministic = true;
  EXPECT_EQ(plan_of(det).merge_counters, 0);
  // One KV head for 32 query heads: a merge could hold a state from every SM's CTAs, 16 rows each.
  CaseSpec mqa = serving_decode(1, 9000, 16);
  mqa.num_kv_heads = 1;
  const AttentionPlan wide = plan_of(mqa);
  ASSERT_FALSE(wide.merges.empty()) << wide.describe();
  EXPECT_EQ(wide.merge_counters, 0) << wide.describe();
}

// Runs `c` twice on one workspace: right against the float64 reference, the `count` int32 words at `offset` in the
// workspace (the merges' counters or flags: `what`) back at zero after each run, and the second run gives the
// first run's bits.
void expect_merges_run_twice(Case& c, DeviceCase& dev, AttentionPlan& plan, int64_t count,
                             size_t offset, const char* what) {
  const UploadedPlan uploaded(plan);
  std::vector<uint8_t> first;
  for (int run_index = 0; run_index < 2; ++run_index) {
    const CheckedRun checked = run_checked(c, dev, plan, uploaded.w);
    EXPECT_TRUE(checked.verdict.ok) << "run " << run_index << ": " << checked.verdict.message
                                    << "\n  plan: " << plan.describe();
    if (run_index == 0)
      first = checked.bytes;
    else
      EXPECT_TRUE(checked.bytes == first) << "run 1 differs from run 0";
    std::vector<int32_t> words(static_cast<size_t>(count), -1);
    EXPECT_EQ(cudaSuccess, cudaMemcpy(words.data(), static_cast<char*>(uploaded.ws) + offset,
                                      words.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
    EXPECT_EQ(std::count(words.begin(), words.end(), 0), static_cast<long>(words.size()))
        << "run " << run_index << ": " << what << " left non-zero";
  }
}

// Runs `s` twice on one workspace with the kernel's merge (expect_merges_run_twice: the counters). Returns the plan.
AttentionPlan expect_kernel_merge(CaseSpec s) {
  Case c = make_case(s);
  DeviceCase dev(c);
  AttentionPlan plan = cuda_decode_plan(c);
  EXPECT_GT(plan.merge_counters, 0) << plan.describe();
  if (plan.merge_counters == 0) return plan;
  expect_merges_run_twice(c, dev, plan, plan.merge_counters, detail::plan_layout(plan).merge_counters,
                          "merge counters");
  return plan;
}

// The kernel's merge in one pass (the serving shapes: every state's O rows fit the shared memory at once), with sinks.
TEST(CudaKernelMerge, OnePassMatchesTheReference) {
  if (kernel_merge_mode() == "stream") GTEST_SKIP() << "every merge is streamed under ATTNFORGE_DECODE_KERNEL_MERGE=stream";
  CaseSpec s = serving_decode(5, 9000, 16);
  s.kv_lens = {9000, 2500, 700, 4000, 33};
  s.options.sinks = true;
  s.seed = 77;
  expect_kernel_merge(s);
}

// Several passes in a batch under a wave (ATTNFORGE_DECODE_KERNEL_MERGE=several, which scripts/device-check sets
// for this test; without it only larger batches take several passes, where the planner's bound rarely binds): a
// group of 16 query heads, 16 rows a CTA, over 25 states, 7 a pass in the two-stage kernel's 68 KB, with sinks and a
// window that leaves the first pieces empty.
TEST(CudaKernelMerge, SeveralPassesMatchTheReference) {
  const char* mode = std::getenv("ATTNFORGE_DECODE_KERNEL_MERGE");
  if (mode == nullptr || std::string(mode) != "several")
    GTEST_SKIP() << "needs ATTNFORGE_DECODE_KERNEL_MERGE=several (small batches merge in one pass otherwise)";
  CaseSpec s;
  s.kind = PlanKind::kDecode;
  s.num_qo_heads = 64, s.num_kv_heads = 4, s.head_dim_qk = 128;
  s.qo_lens = {1};
  s.kv_lens = {9000};
  s.options.sinks = true;
  s.options.window_left = 3000;
  s.plan.num_workers = 100;  // at most 26 states a merge: four passes of 7
  s.seed = 78;
  const AttentionPlan plan = expect_kernel_merge(s);
  EXPECT_GT(plan.max_merge_states, 7) << plan.describe();
}

// Streamed merges (the default for small batches at head_dim 128; every decode merge under
// ATTNFORGE_DECODE_KERNEL_MERGE=stream, which scripts/device-check sets for a second run of the decode tests): the
// merge kernel runs beside the decode kernel and folds each merge's states as the decode CTAs release their flags
// (AttentionPlan::merge_flags). Skipped in the other modes.
// Streamed: batches of at most 32 (request, KV head) pairs at head_dim 128 by default, every decode merge with
// ATTNFORGE_DECODE_KERNEL_MERGE=stream.
// Streamed merges are made under ATTNFORGE_DECODE_KERNEL_MERGE=stream only (scripts/device-check runs the decode
// tests in that mode too).
bool streamed_merges(int = 128) { return kernel_merge_mode() == "stream"; }

// Runs `s` twice on one workspace with streamed merges (expect_merges_run_twice: the flags). Returns the plan.
AttentionPlan expect_streamed_merge(CaseSpec s) {
  Case c = make_case(s);
  DeviceCase dev(c);
  AttentionPlan plan = cuda_decode_plan(c);
  EXPECT_FALSE(plan.merges.empty()) << plan.describe();
  EXPECT_GT(plan.merge_flags, 0) << plan.describe();
  EXPECT_EQ(plan.merge_counters, 0) << plan.describe();
  if (plan.merge_flags == 0) return plan;
  expect_merges_run_twice(c, dev, plan, plan.merge_flags, detail::plan_layout(plan).merge_flags, "merge flags");
  return plan;
}

// One flag per (KV head, block of 16 rows, item) at capacity; none in deterministic mode (the merge kernel after the
// decode kernel, in its one fixed shape).
TEST(CudaStreamMerge, FlagsSizedByCapacity) {
  if (!streamed_merges()) GTEST_SKIP() << "merges are not streamed in this mode";
  const AttentionPlan one = cuda_decode_plan(make_case(serving_decode(1, 9000, 16)));
  ASSERT_FALSE(one.merges.empty()) << one.describe();
  EXPECT_EQ(one.merge_flags, static_cast<int64_t>(one.item_capacity) * 8) << "8 KV heads, 4 rows a CTA";
  EXPECT_EQ(one.merge_counters, 0);
  CaseSpec det = serving_decode(1, 9000, 16);
  det.plan.deterministic = true;
  EXPECT_EQ(cuda_decode_plan(make_case(det)).merge_flags, 0);
}

// Two requests of unequal lengths, with sinks: 4 rows a CTA, one pair a thread.
TEST(CudaStreamMerge, MatchesTheReference) {
  if (!streamed_merges()) GTEST_SKIP() << "merges are not streamed in this mode";
  CaseSpec s = serving_decode(2, 9000, 16);
  s.kv_lens = {9000, 2500};
  s.options.sinks = true;
  s.seed = 91;
  expect_streamed_merge(s);
}

// Full row blocks (16 query heads a KV head; and 4 query tokens of a group of 4, causal inside the request) at head
// dims 64, 128 and 256 (two and four pairs a thread), a window that leaves the first pieces empty, page size 1.
TEST(CudaStreamMerge, FullRowBlocksMatchTheReference) {
  if (!streamed_merges()) GTEST_SKIP() << "merges are not streamed in this mode";
  for (int head_dim : {64, 128, 256}) {
    if (!streamed_merges(head_dim)) continue;
    SCOPED_TRACE(head_dim);
    CaseSpec s;
    s.kind = PlanKind::kDecode;
    s.num_qo_heads = 64, s.num_kv_heads = 4, s.head_dim_qk = head_dim;
    s.qo_lens = {1};
    s.kv_lens = {9000};
    s.options.sinks = true;
    s.options.window_left = 3000;
    s.seed = 92 + head_dim;
    const AttentionPlan plan = expect_streamed_merge(s);
    EXPECT_GT(plan.max_merge_states, 2) << plan.describe();
    CaseSpec v = serving_decode(3, 5000, 1);
    v.qo_lens = {4, 4, 4};
    v.kv_lens = {5000, 1203, 77};
    v.head_dim_qk = head_dim;
    v.options.causal = true;
    v.seed = 93 + head_dim;
    expect_streamed_merge(v);
  }
}

// More states than a warp's window of 32 flags (one KV head: every CTA of the grid holds a piece of the one request),
// and row blocks of several sizes (query tokens 5 and 1 of a group of 4: blocks of 16, 4 and 4 rows; causal inside
// the request).
TEST(CudaStreamMerge, ManyStatesAndUnevenBlocksMatchTheReference) {
  if (!streamed_merges()) GTEST_SKIP() << "merges are not streamed in this mode";
  CaseSpec s = serving_decode(1, 40000, 16);
  s.num_qo_heads = 8, s.num_kv_heads = 1;
  s.seed = 94;
  const AttentionPlan many = expect_streamed_merge(s);
  EXPECT_GT(many.max_merge_states, 64) << many.describe();
  CaseSpec v = serving_decode(2, 6000, 16);
  v.qo_lens = {5, 1};
  v.kv_lens = {6000, 3001};
  v.options.causal = true;
  v.seed = 95;
  expect_streamed_merge(v);
}

// Calls on one stream without a sync between them, as the layers of a serving step make them: each call's merge grid
// may be scheduled while the call before it is still finishing (programmatic launches), so no call may see another
// call's flags or partial states. Four inputs of the same lengths share one plan and workspace; each round runs
// them back to back (eagerly, then as one captured graph replayed), and every output is checked after the round.
void expect_back_to_back_calls(CaseSpec s, bool graph) {
  constexpr int kCalls = 4, kRounds = 6;
  std::vector<std::unique_ptr<Case>> cases;
  std::vector<std::unique_ptr<DeviceCase>> devs;
  for (int i = 0; i < kCalls; ++i) {
    s.seed += 1;
    cases.push_back(std::make_unique<Case>(make_case(s)));
    devs.push_back(std::make_unique<DeviceCase>(*cases.back()));
  }
  AttentionPlan plan = cuda_decode_plan(*cases[0]);
  ASSERT_FALSE(plan.merges.empty()) << plan.describe();
  const UploadedPlan uploaded(plan);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  cudaStream_t stream;
  ASSERT_EQ(cudaSuccess, cudaStreamCreate(&stream));
  auto run_all = [&] {
    for (int i = 0; i < kCalls; ++i)
      run(plan, devs[i]->q, devs[i]->paged, Outputs{devs[i]->out, devs[i]->lse}, devs[i]->options, uploaded.w, stream);
  };
  cudaGraphExec_t exec = nullptr;
  cudaGraph_t g = nullptr;
  if (graph) {
    ASSERT_EQ(cudaSuccess, cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    run_all();
    ASSERT_EQ(cudaSuccess, cudaStreamEndCapture(stream, &g));
    ASSERT_EQ(cudaSuccess, cudaGraphInstantiate(&exec, g, 0));
  }
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < kCalls; ++i) {
      cases[i]->poison_outputs();
      devs[i]->upload_outputs(*cases[i]);
    }
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    if (graph)
      ASSERT_EQ(cudaSuccess, cudaGraphLaunch(exec, stream));
    else
      run_all();
    ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(stream));
    for (int i = 0; i < kCalls; ++i) {
      devs[i]->download_outputs(*cases[i]);
      const Verdict v = check_case(*cases[i], sample_rows(*cases[i], 8));
      EXPECT_TRUE(v.ok) << (graph ? "graph" : "eager") << " round " << round << ", call " << i << ": " << v.message
                        << "\n  plan: " << plan.describe();
    }
  }
  if (graph) {
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
  }
  cudaStreamDestroy(stream);
}

TEST(CudaStreamMerge, BackToBackCallsMatchTheReference) {
  if (!streamed_merges()) GTEST_SKIP() << "merges are not streamed in this mode";
  CaseSpec s = serving_decode(1, 20000, 16);
  s.seed = 96;
  ASSERT_GT(cuda_decode_plan(make_case(s)).merge_flags, 0);
  expect_back_to_back_calls(s, false);
  expect_back_to_back_calls(s, true);
}

// The same for the other merge modes: merges in the decode kernel (its arrival counters; one long request and a
// batch of 12) and the merge kernel (deterministic plans).
TEST(CudaKernelMerge, BackToBackCallsMatchTheReference) {
  for (CaseSpec s : {serving_decode(1, 20000, 16), serving_decode(12, 3000, 16)}) {
    s.seed = 97;
    expect_back_to_back_calls(s, false);
    expect_back_to_back_calls(s, true);
  }
  CaseSpec det = serving_decode(1, 20000, 16);
  det.plan.deterministic = true;
  det.seed = 98;
  expect_back_to_back_calls(det, false);
}

// Decode batches too small to fill the GPU run the small-batch pipeline (AttentionPlan::kv_stages: 3 K/V stages with
// 16-bit K/V at head_dim 128 and 256; two CTAs per SM at head_dim 128 on sm_90), chosen by the batch size alone. Its
// kernel gives the default kernel's bits on the same items (a plan for the same workers without it), and larger
// batches, head_dim 64 and fp8 K/V keep the default.
TEST(CudaSmallBatchPipeline, ChosenByBatchSizeGivesTheDefaultKernelsBits) {
  CaseSpec s = serving_decode(3, 0, 16);
  s.kv_lens = {9001, 17, 3000};
  s.qo_lens = {1, 2, 1};
  s.seed = 93;
  Case c = make_case(s);
  DeviceCase dev(c);
  AttentionPlan deep = cuda_decode_plan(c);
  ASSERT_EQ(deep.kv_stages, 3) << deep.describe();
  ASSERT_FALSE(deep.merges.empty()) << deep.describe();
  int sms = 0;
  ASSERT_EQ(cudaSuccess, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  BatchPlanArgs args = c.plan_args();
  args.device = Device::cuda(0);
  args.options.num_workers = 2 * sms;  // the small-batch pipeline's workers: two of its CTAs fit an SM
  AttentionPlan plain = plan_batch_decode(args);
  EXPECT_EQ(plain.kv_stages, 0) << "a caller's worker count keeps the default pipeline";
  ASSERT_EQ(plain.items.size(), deep.items.size()) << plain.describe() << "\n" << deep.describe();
  for (size_t i = 0; i < deep.items.size(); ++i) {
    const WorkItem &a = deep.items[i], &b = plain.items[i];
    ASSERT_TRUE(a.request == b.request && a.qo_begin == b.qo_begin && a.qo_end == b.qo_end &&
                a.kv_begin == b.kv_begin && a.kv_end == b.kv_end)
        << "item " << i << " differs: the plans do not cut the same pieces";
  }
  auto output_bytes = [&](AttentionPlan& plan) {
    const UploadedPlan uploaded(plan);
    CheckedRun r = run_checked(c, dev, plan, uploaded.w);
    EXPECT_TRUE(r.verdict.ok) << plan.describe() << ": " << r.verdict.message;
    return std::move(r.bytes);
  };
  EXPECT_TRUE(output_bytes(deep) == output_bytes(plain)) << "the small-batch pipeline changed the bits";

  // Which batches take it: (batch, head_dim, K/V dtype, Q dtype).
  struct Shape {
    int32_t batch, head_dim;
    DType kv, q;
  };
  // Batch 64 has 512 (request, KV head) pairs, more than any head dim's CTAs per SM x 132 SMs; batch 32 and 33
  // straddle head_dim 128's two CTAs per SM (sm_90: 228 KB of shared memory an SM for 100 KB CTAs).
  int major = 0;
  ASSERT_EQ(cudaSuccess, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  constexpr DType kB = DType::kBFloat16, kH = DType::kFloat16;
  for (const Shape& t : {Shape{1, 128, kB, kB}, Shape{32, 128, kH, kH}, Shape{33, 128, kB, kB}, Shape{64, 128, kB, kB},
                         Shape{1, 64, kB, kB}, Shape{64, 64, kH, kH}, Shape{1, 256, kB, kB}, Shape{64, 256, kB, kB},
                         Shape{2, 128, DType::kFloat8E4M3, kB}}) {
    if (major != 9 && (t.head_dim == 256 || t.batch == 32 || t.batch == 33)) continue;  // other shared memory sizes
    CaseSpec u = serving_decode(t.batch, 300, 16);
    u.head_dim_qk = t.head_dim, u.kv_dtype = t.kv, u.q_dtype = t.q, u.o_dtype = t.q;
    const Case small = make_case(u);
    const AttentionPlan p = cuda_decode_plan(small);
    const bool wanted = t.kv == t.q && t.head_dim != 64 && t.batch < 64 && (t.head_dim != 128 || t.batch * 8 < 2 * sms);
    EXPECT_EQ(p.kv_stages, wanted ? 3 : 0) << "batch " << t.batch << ", head_dim " << t.head_dim << ", K/V "
                                           << to_string(t.kv) << ": " << p.describe();
  }
}

// Deterministic mode: a request's output is bit-identical alone and inside a larger batch. "Alone" is the
// batch's first request planned and run as a batch of one over the same memory (the CSR arrays' prefixes). Its 5
// states alone and the batch's largest merge of 20 would pick different shapes of the merge kernel in other plans.
TEST(CudaDeterminism, SameBitsWhateverTheBatch) {
  CaseSpec s;
  s.kind = PlanKind::kDecode;
  s.num_qo_heads = 32, s.num_kv_heads = 8, s.head_dim_qk = 128;
  s.qo_lens = {1, 1, 1};
  s.kv_lens = {5000, 300, 20000};
  s.plan.deterministic = true;
  s.plan.fixed_split_size = 1024;
  s.seed = 5;
  Case c = make_case(s);
  DeviceCase dev(c);
  plan_and_run_cuda(c, dev);
  const size_t row_bytes = static_cast<size_t>(32) * 128 * 2;
  const std::vector<uint8_t> in_batch(static_cast<uint8_t*>(c.out_view.data),
                                      static_cast<uint8_t*>(c.out_view.data) + row_bytes);

  BatchPlanArgs args = c.plan_args();
  args.device = Device::cuda(0);
  args.qo_indptr.shape[0] = 2;
  args.kv_indptr.shape[0] = 2;
  args.last_page_len.shape[0] = 1;
  AttentionPlan plan = plan_batch_decode(args);
  PagedKVCache kv = dev.paged;
  kv.table.indptr.shape[0] = 2;
  kv.table.last_page_len.shape[0] = 1;
  TensorView q = dev.q, out = dev.out, lse = dev.lse;
  q.shape[0] = out.shape[0] = lse.shape[0] = 1;
  void* ws = nullptr;
  void* staging = nullptr;
  ASSERT_EQ(cudaSuccess, cudaMalloc(&ws, plan.workspace_bytes));
  ASSERT_EQ(cudaSuccess, cudaMallocHost(&staging, plan.staging_bytes));
  c.poison_outputs();
  dev.upload_outputs(c);
  upload_plan(plan, Workspace{ws, plan.workspace_bytes}, staging, plan.staging_bytes, nullptr);
  run(plan, q, kv, Outputs{out, lse}, dev.options, Workspace{ws, plan.workspace_bytes}, nullptr);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  dev.download_outputs(c);
  cudaFree(ws);
  cudaFreeHost(staging);
  EXPECT_EQ(0, std::memcmp(in_batch.data(), c.out_view.data, row_bytes)) << "request 0 differs alone vs in a batch";
}

// A graph captured once replays correctly after a re-plan for longer sequences of the same batch size
// (decode; prefill with the same query lengths over longer prefixes): captured with `short_lens`, replayed with
// them and then with `long_lens`, each request's short length a prefix of its long one.
void capture_replan_replay(PlanKind kind, std::vector<int32_t> long_lens = {3000, 17, 800, 4096, 1, 2500},
                           std::vector<int32_t> short_lens = {100, 5, 700, 33, 1, 1200}) {
  CaseSpec s;
  s.kind = kind;
  s.format = KVFormat::kBlockTable;
  s.num_qo_heads = 32, s.num_kv_heads = 8, s.head_dim_qk = 128;
  s.qo_lens = kind == PlanKind::kDecode ? std::vector<int32_t>(6, 1) : std::vector<int32_t>{50, 3, 64, 20, 1, 77};
  s.options.causal = kind == PlanKind::kPrefill;
  s.kv_lens = long_lens;
  s.options.sinks = true;
  s.seed = 11;
  Case full = make_case(s);  // the long lengths; the short batch is a prefix of every request
  for (size_t b = 0; b < short_lens.size(); ++b)
    ASSERT_LE(short_lens[b], long_lens.at(b)) << "request " << b << ": the short batch must be a prefix of the long";
  DeviceCase dev(full);
  int32_t* seq = static_cast<int32_t*>(full.seq_lens.data());

  auto plan_for = [&](const std::vector<int32_t>& lens) {
    std::copy(lens.begin(), lens.end(), seq);
    dev.upload(full.seq_lens);
    BatchPlanArgs args = full.plan_args();
    args.device = Device::cuda(0);
    return kind == PlanKind::kDecode ? plan_batch_decode(args) : plan_batch_prefill(args);
  };
  AttentionPlan plan = plan_for(short_lens);
  void* ws = nullptr;
  void* staging = nullptr;
  const size_t ws_bytes = plan.workspace_bytes;
  ASSERT_EQ(cudaSuccess, cudaMalloc(&ws, ws_bytes));
  ASSERT_EQ(cudaSuccess, cudaMallocHost(&staging, plan.staging_bytes));
  cudaStream_t stream;
  ASSERT_EQ(cudaSuccess, cudaStreamCreate(&stream));
  const Workspace w{ws, ws_bytes};
  upload_plan(plan, w, staging, plan.staging_bytes, stream);

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaSuccess, cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  run(plan, dev.q, dev.paged, Outputs{dev.out, dev.lse}, dev.options, w, stream);
  ASSERT_EQ(cudaSuccess, cudaStreamEndCapture(stream, &graph));
  ASSERT_EQ(cudaSuccess, cudaGraphInstantiate(&exec, graph, 0));

  auto replay_and_check = [&](const std::vector<int32_t>& lens, const char* what) {
    full.poison_outputs();
    dev.upload_outputs(full);
    ASSERT_EQ(cudaSuccess, cudaGraphLaunch(exec, stream));
    ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(stream));
    dev.download_outputs(full);
    Case view = full;  // the reference reads the logical prefix of each request
    view.spec.kv_lens = lens;
    for (size_t b = 0; b < lens.size(); ++b) {
      view.k_vals[b].resize(static_cast<size_t>(lens[b]) * 8 * 128);
      view.v_vals[b].resize(static_cast<size_t>(lens[b]) * 8 * 128);
    }
    const Verdict v = check_case(view);
    EXPECT_TRUE(v.ok) << what << ": " << v.message;
  };
  replay_and_check(short_lens, "first replay");

  AttentionPlan longer = plan_for(long_lens);
  ASSERT_LE(longer.workspace_bytes, ws_bytes) << "a re-plan of the same batch size must fit the captured workspace";
  if (long_lens[0] > 20000)  // the captured merge launch (a warp per row) serves a re-plan whose merges want four
    ASSERT_TRUE(plan.max_merge_states <= 8 && longer.max_merge_states > 8)  // kMergeWarpMaxStates
        << "the plans do not straddle the merge shapes: " << plan.max_merge_states << ", " << longer.max_merge_states;
  ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(stream));  // the staging buffer is free again
  upload_plan(longer, w, staging, longer.staging_bytes, stream);
  replay_and_check(long_lens, "replay after re-plan");

  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFree(ws);
  cudaFreeHost(staging);
}

TEST(CudaGraph, CaptureReplanReplayDecode) { capture_replan_replay(PlanKind::kDecode); }
TEST(CudaGraph, CaptureReplanReplayPrefill) { capture_replan_replay(PlanKind::kPrefill); }
TEST(CudaGraph, CaptureReplanReplayAcrossMergeShapes) {
  // Short lengths of at most 800 tokens (cut in 128-token pieces: at most 6 states) against one of 32000.
  capture_replan_replay(PlanKind::kDecode, {32000, 17, 800, 40, 1, 800}, {100, 5, 700, 33, 1, 800});
}

// Runs every case with the nvcc-compiled and with the NVRTC-compiled kernels (plan and run each time): both match
// the float64 reference, and their outputs and LSE are the same bits. Kernels compile into a temporary cache; the
// selected build is restored at the end (the later tests run with it). The nvcc build runs its portable prefill
// kernel, the one NVRTC compiles (the Hopper prefill kernel is nvcc-only; its own cases check it).
void expect_nvrtc_bits_of_nvcc(const std::vector<CaseSpec>& specs) {
  char tmpl[] = "/tmp/attnforge-cuda-jit-XXXXXX";
  ASSERT_NE(nullptr, mkdtemp(tmpl));
  jit::set_cache_dir(tmpl);
  const jit::CudaKernels selected = jit::cuda_kernels();
  const cuda::PrefillWgmma wgmma = cuda::prefill_wgmma();
  cuda::set_prefill_wgmma(cuda::PrefillWgmma::kOff);
  for (const CaseSpec& s : specs) {
    Case c = make_case(s);
    DeviceCase dev(c);
    auto run_with = [&](jit::CudaKernels kernels) {
      jit::set_cuda_kernels(kernels);
      c.poison_outputs();
      dev.upload_outputs(c);
      plan_and_run_cuda(c, dev);
      // The reference checks nvcc's result; NVRTC's must then have the same bits.
      if (kernels == jit::CudaKernels::kNvcc) {
        const Verdict v = check_case(c);
        EXPECT_TRUE(v.ok) << "nvcc: " << v.message << "\n  case: " << s.describe();
      }
      const auto* o = static_cast<const uint8_t*>(c.out.data());
      const auto* l = static_cast<const uint8_t*>(c.lse.data());
      return std::make_pair(std::vector<uint8_t>(o, o + c.out.bytes()), std::vector<uint8_t>(l, l + c.lse.bytes()));
    };
    const auto nvcc = run_with(jit::CudaKernels::kNvcc);
    const auto nvrtc = run_with(jit::CudaKernels::kNvrtc);
    EXPECT_TRUE(nvcc.first == nvrtc.first) << "outputs differ between the nvcc and NVRTC builds; case: " << s.describe();
    EXPECT_TRUE(nvcc.second == nvrtc.second) << "LSE differs between the nvcc and NVRTC builds; case: " << s.describe();
  }
  jit::set_cuda_kernels(selected);
  cuda::set_prefill_wgmma(wgmma);
  jit::set_cache_dir("");
  std::filesystem::remove_all(tmpl);
}

// A case of the NVRTC-vs-nvcc comparison: 16 query heads over 4 KV heads, splits at fixed positions (the plan
// cannot differ between the builds even if their occupancy did). Long requests are split: decode merges the pieces
// in its kernel, prefill with the merge kernel.
CaseSpec jit_case(PlanKind kind, int32_t head_dim, DType t, std::vector<int32_t> qo, std::vector<int32_t> kv,
                  uint64_t seed) {
  CaseSpec s;
  s.kind = kind;
  s.num_qo_heads = 16, s.num_kv_heads = 4, s.head_dim_qk = head_dim;
  s.q_dtype = s.kv_dtype = s.o_dtype = t;
  s.qo_lens = std::move(qo);
  s.kv_lens = std::move(kv);
  s.plan.deterministic = true;
  s.plan.fixed_split_size = 1024;
  s.seed = seed;
  return s;
}

// `s` with page size 1, fp32 output and every per-element option on.
CaseSpec with_every_option(CaseSpec s, uint64_t seed) {
  s.page_size = 1;
  s.options.causal = true;
  s.options.sinks = true;
  s.options.soft_cap = 30.f;
  s.options.window_left = 500;
  s.options.custom_mask = true;
  s.options.alibi = true;
  s.o_dtype = DType::kFloat32;
  s.seed = seed;
  return s;
}

// The NVRTC-compiled kernels against the nvcc-compiled ones: the same source through the same code generator, so
// the same bits, on cases that cover every decode kernel (head_dim 64/128/256, fp16/bf16, K/V 16-bit and fp8),
// split KV merged in the kernel, page size 1, grouped heads with several query tokens, and the per-element options.
TEST(CudaJit, NvrtcKernelsGiveTheBitsOfNvccKernels) {
  std::vector<CaseSpec> specs;
  uint64_t seed = 300;
  for (int32_t d : {64, 128, 256})
    for (DType t : {DType::kFloat16, DType::kBFloat16})
      specs.push_back(jit_case(PlanKind::kDecode, d, t, {1, 1, 1, 1}, {9000, 17, 2048, 300}, seed++));
  // fp8 K/V: both formats, both operand types, every head dim.
  for (const auto& [d, q, kv] : {std::tuple{128, DType::kBFloat16, DType::kFloat8E4M3},
                                 std::tuple{64, DType::kFloat16, DType::kFloat8E5M2},
                                 std::tuple{256, DType::kFloat16, DType::kFloat8E4M3},
                                 std::tuple{128, DType::kBFloat16, DType::kFloat8E5M2}}) {
    CaseSpec s = specs[0];
    s.head_dim_qk = d;
    s.q_dtype = s.o_dtype = q;
    s.kv_dtype = kv;
    s.k_scale = 0.5f, s.v_scale = 2.f;
    s.seed = seed++;
    specs.push_back(s);
  }
  CaseSpec opts = with_every_option(specs[3], seed++);  // head_dim 128 bf16
  opts.qo_lens = {4, 2, 1, 3};
  specs.push_back(opts);
  expect_nvrtc_bits_of_nvcc(specs);
}

// The same for the prefill kernels: every head dim and dtype, with and without RoPE fused (its own kernel), causal
// prefill and append onto prefixes with split KV (the merge kernel runs), page size 1, ragged KV, and the
// per-element options.
TEST(CudaJit, NvrtcPrefillKernelsGiveTheBitsOfNvccKernels) {
  std::vector<CaseSpec> specs;
  uint64_t seed = 400;
  for (int32_t d : {64, 128, 256})
    for (DType t : {DType::kFloat16, DType::kBFloat16})
      for (bool rope : {false, true}) {
        CaseSpec s = jit_case(PlanKind::kPrefill, d, t, {300, 17, 64, 1}, {2500, 17, 700, 90}, seed++);
        s.options.causal = true;
        s.options.rope = rope;
        specs.push_back(s);
      }
  specs.push_back(with_every_option(specs[6], seed++));  // head_dim 128 bf16, no RoPE
  CaseSpec ragged = specs[7];                            // head_dim 128 bf16, RoPE
  ragged.format = KVFormat::kRagged;
  ragged.qo_lens = ragged.kv_lens = {1100, 33, 257};
  ragged.seed = seed++;
  specs.push_back(ragged);
  expect_nvrtc_bits_of_nvcc(specs);
}

// A device float array with the host values (freed at scope exit).
struct DeviceFloats {
  float* ptr = nullptr;
  explicit DeviceFloats(const std::vector<float>& host) {
    EXPECT_EQ(cudaSuccess, cudaMalloc(&ptr, host.size() * sizeof(float)));
    EXPECT_EQ(cudaSuccess, cudaMemcpy(ptr, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  ~DeviceFloats() { cudaFree(ptr); }
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;
};

// Runs custom variant V (NVRTC) on case c with a plan without splits and checks its fp32 output against the float64
// reference running the same struct (testing/variant_reference.h). The tolerance is twice the error of the same
// computation with bf16 operands (the P V weights and transformed Q/K rows rounded, as the tensor cores read them)
// plus fp32 accumulation slack. device_in and host_in hold the same inputs, in device and host memory.
template <class V>
void expect_variant_on_gpu(Case& c, DeviceCase& dev, const CustomVariant& variant, const VariantInputs& device_in,
                           const VariantInputs& host_in) {
  BatchPlanArgs args = c.plan_args();
  args.device = Device::cuda(0);
  args.options.disable_split = true;
  AttentionPlan plan = c.spec.kind == PlanKind::kDecode ? plan_batch_decode(args) : plan_batch_prefill(args);
  const UploadedPlan uploaded(plan);
  c.poison_outputs();
  dev.upload_outputs(c);
  run_variant(plan, dev.q, dev.paged, Outputs{dev.out, dev.lse}, dev.options, variant, device_in, uploaded.w, nullptr);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  dev.download_outputs(c);
  const VariantParams none{};
  const VariantArgs a = args_for(host_in, none);
  const std::vector<double> ref = reference<V>(c, a), naive = reference<V>(c, a, true);
  double naive_err = 0, ref_max = 0;
  for (size_t i = 0; i < ref.size(); ++i)
    naive_err = std::max(naive_err, std::abs(naive[i] - ref[i])), ref_max = std::max(ref_max, std::abs(ref[i]));
  const double tol = 2 * naive_err + 1e-5 * (1 + ref_max);
  const double worst = worst_error(c, ref, /*relative=*/false);
  EXPECT_LE(worst, tol) << variant.name << " on " << c.spec.describe() << ": worst error " << worst << ", tolerance "
                        << tol << " (naive bf16 error " << naive_err << ")";
  EXPECT_GT(naive_err, 0) << "the rounded baseline must differ from the exact one, or the tolerance means nothing";
  EXPECT_TRUE(c.guards_intact()) << variant.name << ": memory just outside the outputs was written";
}

CaseSpec variant_case(PlanKind kind, int32_t head_dim, std::vector<int32_t> qo, std::vector<int32_t> kv, uint64_t seed) {
  CaseSpec s;
  s.kind = kind;
  s.num_qo_heads = 28, s.num_kv_heads = 4, s.head_dim_qk = head_dim, s.page_size = 16;
  s.qo_lens = std::move(qo);
  s.kv_lens = std::move(kv);
  s.o_dtype = DType::kFloat32;
  s.seed = seed;
  return s;
}

std::vector<float> per_head(int32_t heads, float step, float base) {
  std::vector<float> v(heads);
  for (int32_t h = 0; h < heads; ++h) v[h] = step * static_cast<float>(h % 5) + base;
  return v;
}

}  // namespace

// Custom variants in the CUDA decode kernel (NVRTC): sigmoid attention with softmax off (a scalar input) and a
// per-head logit bias read from a device tensor with a causal mask from the variant.
TEST(CudaVariants, CustomVariantsInTheDecodeKernel) {
  Case c = make_case(variant_case(PlanKind::kDecode, 128, {1, 3, 2}, {700, 129, 33}, 404));
  DeviceCase dev(c);
  std::vector<float> bias = per_head(28, 0.25f, -0.5f);
  const DeviceFloats bias_dev(bias);
  expect_variant_on_gpu<Sigmoid>(c, dev, Sigmoid_variant, {{-2.5f}, {}}, {{-2.5f}, {}});
  expect_variant_on_gpu<HeadBias>(c, dev, HeadBias_variant, {{}, {bias_dev.ptr}}, {{}, {bias.data()}});
}

// Custom variants in the CUDA prefill kernel (NVRTC), head_dim 64, 128 and 256: query, key and output transforms
// with a windowed causal mask (Shaped: the output transform runs on whole fp32 rows staged in shared memory), and at
// 128 sigmoid attention without softmax and a per-head bias. The last request has more queries than keys (rows that
// see no key), the second one query.
TEST(CudaVariants, CustomVariantsInThePrefillKernel) {
  for (int32_t d : {64, 128, 256}) {
    Case c = make_case(variant_case(PlanKind::kPrefill, d, {37, 1, 130, 5}, {300, 129, 130, 3}, 405 + d));
    DeviceCase dev(c);
    std::vector<float> gain = per_head(28, 0.3f, 0.6f), bias = per_head(28, 0.25f, -0.5f);
    const DeviceFloats gain_dev(gain), bias_dev(bias);
    expect_variant_on_gpu<Shaped>(c, dev, Shaped_variant, {{0.8f}, {gain_dev.ptr}}, {{0.8f}, {gain.data()}});
    if (d != 128) continue;
    expect_variant_on_gpu<Sigmoid>(c, dev, Sigmoid_variant, {{-2.5f}, {}}, {{-2.5f}, {}});
    expect_variant_on_gpu<HeadBias>(c, dev, HeadBias_variant, {{}, {bias_dev.ptr}}, {{}, {bias.data()}});
  }
}

// The built-in options written as a variant (BuiltinVariant: RoPE as query/key transforms, causal, window, custom
// mask, soft-cap and ALiBi as mask and logit transform, sinks) in the prefill kernel, against the library's
// reference for run() with the same options.
TEST(CudaVariants, BuiltinOptionsAsAVariantInThePrefillKernel) {
  CaseSpec s = variant_case(PlanKind::kPrefill, 128, {37, 1, 130}, {300, 129, 130}, 409);
  s.o_dtype = DType::kBFloat16;
  s.options.causal = true;
  s.options.window_left = 90;
  s.options.soft_cap = 20.f;
  s.options.alibi = true;
  s.options.sinks = true;
  s.options.rope = true;
  s.options.rope_offsets = true;
  Case c = make_case(s);
  DeviceCase dev(c);
  BatchPlanArgs args = c.plan_args();
  args.device = Device::cuda(0);
  args.options.disable_split = true;
  AttentionPlan plan = plan_batch_prefill(args);
  const UploadedPlan uploaded(plan);
  c.poison_outputs();
  dev.upload_outputs(c);
  run_variant(plan, dev.q, dev.paged, Outputs{dev.out, dev.lse}, dev.options, builtin_variant(), {}, uploaded.w, nullptr);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  dev.download_outputs(c);
  const Verdict v = check_case(c);
  EXPECT_TRUE(v.ok) << v.message;
}

// single_decode and single_prefill on CUDA (contiguous K/V: a one-request ragged case, its rows from the case's
// first ragged offset), with the workspace single_workspace_bytes names; checked like the batch cases. The decode
// request is long enough that its plan splits KV over the SMs.
TEST(CudaSingle, DecodeAndPrefillOnContiguousKV) {
  for (PlanKind kind : {PlanKind::kDecode, PlanKind::kPrefill}) {
    CaseSpec s;
    s.kind = kind;
    s.format = KVFormat::kRagged;
    s.num_qo_heads = 32, s.num_kv_heads = 8, s.head_dim_qk = 128;
    s.qo_lens = {kind == PlanKind::kDecode ? 1 : 300};
    s.kv_lens = {kind == PlanKind::kDecode ? 20011 : 1000};
    s.options.causal = kind == PlanKind::kPrefill;
    s.seed = 606;
    Case c = make_case(s);
    DeviceCase dev(c);
    const int32_t first = c.ragged.indptr.ptr<const int32_t>()[0];
    auto rows = [&](TensorView t) {  // the request's K/V rows
      t.data = static_cast<uint8_t*>(t.data) + first * t.strides[0] * dtype_bytes(t.dtype);
      t.shape[0] = s.kv_lens[0];
      return t;
    };
    const TensorView k = rows(dev.ragged.k), v = rows(dev.ragged.v);
    const AttentionShape shape{32, 8, 128, 128, s.q_dtype, s.kv_dtype, s.o_dtype};
    const size_t bytes = single_workspace_bytes(kind, shape, s.qo_lens[0], s.kv_lens[0], Device::cuda(0), s.options.causal);
    void* ws = nullptr;
    ASSERT_EQ(cudaSuccess, cudaMalloc(&ws, bytes));
    c.poison_outputs();
    dev.upload_outputs(c);
    if (kind == PlanKind::kDecode) {
      TensorView q2 = dev.q, o2 = dev.out, l1 = dev.lse;
      q2.ndim = 2, q2.shape[0] = q2.shape[1], q2.shape[1] = q2.shape[2], q2.strides[0] = q2.strides[1], q2.strides[1] = 1;
      o2.ndim = 2, o2.shape[0] = o2.shape[1], o2.shape[1] = o2.shape[2], o2.strides[0] = o2.strides[1], o2.strides[1] = 1;
      l1.ndim = 1, l1.shape[0] = l1.shape[1], l1.strides[0] = l1.strides[1];
      single_decode(q2, k, v, KVLayout::kNHD, Outputs{o2, l1}, dev.options, s.k_scale, s.v_scale, nullptr,
                    Workspace{ws, bytes});
    } else {
      single_prefill(dev.q, k, v, KVLayout::kNHD, Outputs{dev.out, dev.lse}, dev.options, s.k_scale, s.v_scale,
                     nullptr, Workspace{ws, bytes});
    }
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    dev.download_outputs(c);
    const Verdict verdict = check_case(c, {});
    EXPECT_TRUE(verdict.ok) << (kind == PlanKind::kDecode ? "single_decode: " : "single_prefill: ") << verdict.message;
    try {  // too small a workspace is refused with the size it needs
      single_prefill(dev.q, k, v, KVLayout::kNHD, Outputs{dev.out, dev.lse}, dev.options, s.k_scale, s.v_scale,
                     nullptr, Workspace{ws, 256});
      if (kind == PlanKind::kPrefill) ADD_FAILURE() << "a 256-byte workspace was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("single_workspace_bytes"), std::string::npos) << e.what();
    }
    cudaFree(ws);
  }
}

// merge_state and merge_states on CUDA against the CPU backend's result on the same data (itself checked against
// float64 in tests/test_ops.cc): bf16 values, some empty states (lse -inf) and one all-empty row, head_dim 96 (not
// a multiple of 32 lanes), 7 states. fp32 outputs agree to fp32 rounding of a sum of 7 weighted terms.
TEST(CudaStates, MergeStatesMatchesTheCpu) {
  const int64_t n = 37, states = 7, heads = 5, dim = 96;
  std::mt19937 rng(12);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> v(n * states * heads * dim);
  std::vector<float> s(n * states * heads);
  for (uint16_t& x : v) {
    const float f = normal(rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    x = static_cast<uint16_t>(u >> 16);
  }
  for (size_t i = 0; i < s.size(); ++i) s[i] = (i % 11 == 3) ? -INFINITY : 4.f * normal(rng);
  for (int64_t k = 0; k < states; ++k)
    for (int64_t h = 0; h < heads; ++h) s[(5 * states + k) * heads + h] = -INFINITY;  // row 5: every state empty
  auto device_copy = [](const void* host, size_t bytes) {
    void* d = nullptr;
    EXPECT_EQ(cudaSuccess, cudaMalloc(&d, bytes));
    EXPECT_EQ(cudaSuccess, cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
    return d;
  };
  void* v_dev = device_copy(v.data(), v.size() * 2);
  void* s_dev = device_copy(s.data(), s.size() * 4);
  std::vector<float> o_cpu(n * heads * dim), l_cpu(n * heads), o_gpu(o_cpu.size(), NAN), l_gpu(l_cpu.size(), NAN);
  void* o_dev = device_copy(o_gpu.data(), o_gpu.size() * 4);
  void* l_dev = device_copy(l_gpu.data(), l_gpu.size() * 4);
  const Device gpu = Device::cuda(0);
  merge_states(TensorView(v.data(), DType::kBFloat16, {n, states, heads, dim}),
               TensorView(s.data(), DType::kFloat32, {n, states, heads}),
               Outputs{TensorView(o_cpu.data(), DType::kFloat32, {n, heads, dim}),
                       TensorView(l_cpu.data(), DType::kFloat32, {n, heads})});
  merge_states(TensorView(v_dev, DType::kBFloat16, {n, states, heads, dim}, gpu),
               TensorView(s_dev, DType::kFloat32, {n, states, heads}, gpu),
               Outputs{TensorView(o_dev, DType::kFloat32, {n, heads, dim}, gpu),
                       TensorView(l_dev, DType::kFloat32, {n, heads}, gpu)});
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  ASSERT_EQ(cudaSuccess, cudaMemcpy(o_gpu.data(), o_dev, o_gpu.size() * 4, cudaMemcpyDeviceToHost));
  ASSERT_EQ(cudaSuccess, cudaMemcpy(l_gpu.data(), l_dev, l_gpu.size() * 4, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < o_cpu.size(); ++i)
    ASSERT_NEAR(o_gpu[i], o_cpu[i], 1e-5f * (1.f + std::abs(o_cpu[i]))) << "out element " << i;
  for (size_t i = 0; i < l_cpu.size(); ++i) {
    if (std::isinf(l_cpu[i])) {
      EXPECT_TRUE(std::isinf(l_gpu[i]) && l_gpu[i] < 0) << "lse " << i << ": " << l_gpu[i];
      continue;
    }
    ASSERT_NEAR(l_gpu[i], l_cpu[i], 1e-5f * (1.f + std::abs(l_cpu[i]))) << "lse " << i;
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < dim; ++d) EXPECT_EQ(o_gpu[(5 * heads + h) * dim + d], 0.f) << "all-empty row 5";
  // merge_state: the first two states of each row as two separate tensors (strided views of the same data).
  TensorView va(v_dev, DType::kBFloat16, {n, heads, dim}, {states * heads * dim, dim, 1}, gpu);
  TensorView vb = va;
  vb.data = static_cast<uint16_t*>(v_dev) + heads * dim;
  TensorView sa(s_dev, DType::kFloat32, {n, heads}, {states * heads, 1}, gpu);
  TensorView sb = sa;
  sb.data = static_cast<float*>(s_dev) + heads;
  merge_state(va, sa, vb, sb, Outputs{TensorView(o_dev, DType::kFloat32, {n, heads, dim}, gpu), TensorView()});
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  ASSERT_EQ(cudaSuccess, cudaMemcpy(o_gpu.data(), o_dev, o_gpu.size() * 4, cudaMemcpyDeviceToHost));
  TensorView va_h(v.data(), DType::kBFloat16, {n, heads, dim}, {states * heads * dim, dim, 1});
  TensorView vb_h = va_h;
  vb_h.data = v.data() + heads * dim;
  TensorView sa_h(s.data(), DType::kFloat32, {n, heads}, {states * heads, 1});
  TensorView sb_h = sa_h;
  sb_h.data = s.data() + heads;
  merge_state(va_h, sa_h, vb_h, sb_h, Outputs{TensorView(o_cpu.data(), DType::kFloat32, {n, heads, dim}), TensorView()});
  for (size_t i = 0; i < o_cpu.size(); ++i)
    ASSERT_NEAR(o_gpu[i], o_cpu[i], 1e-5f * (1.f + std::abs(o_cpu[i]))) << "merge_state out element " << i;
  for (void* p : {v_dev, s_dev, o_dev, l_dev}) cudaFree(p);
}

// Context parallelism's single-GPU path (issue 7): ranks simulated on one GPU, each running batch decode on its
// share of the pages (partition_pages) into its slot of one device buffer, as an all-gather would leave it, then
// merge_gathered_states on the GPU; checked against the float64 reference like every case. No NCCL here: the
// transport needs GPUs of their own.
TEST(CudaContextParallel, SimulatedRanksMergeOnTheGpu) {
  CaseSpec s;
  s.kind = PlanKind::kDecode;
  s.kv_lens = {37, 1, 0, 3, 129, 2500};
  s.qo_lens.assign(s.kv_lens.size(), 1);
  s.num_qo_heads = 6, s.num_kv_heads = 2, s.head_dim_qk = 64, s.page_size = 16;
  s.seed = 31;
  const Device gpu = Device::cuda(0);
  for (KVPartition partition : {KVPartition::kContiguous, KVPartition::kRoundRobinPages})
    for (int32_t world : {2, 3, 4}) {
      Case c = make_case(s);
      DeviceCase dev(c);
      const RankStateLayout layout{c.total_qo(), s.num_qo_heads, c.head_dim_vo(), DType::kFloat32};
      void* gathered = nullptr;
      ASSERT_EQ(cudaSuccess, cudaMalloc(&gathered, world * layout.rank_bytes()));
      ASSERT_EQ(cudaSuccess, cudaMemset(gathered, 0xff, world * layout.rank_bytes()));  // NaN until written
      std::vector<void*> allocations;
      auto to_device = [&](const std::vector<int32_t>& host) {
        void* d = nullptr;
        EXPECT_EQ(cudaSuccess, cudaMalloc(&d, std::max<size_t>(4, host.size() * 4)));
        if (!host.empty()) EXPECT_EQ(cudaSuccess, cudaMemcpy(d, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
        allocations.push_back(d);
        return TensorView(d, DType::kInt32, {static_cast<int64_t>(host.size())}, gpu);
      };
      for (int32_t r = 0; r < world; ++r) {
        const RankPageTable share = partition_pages(c.paged.table, s.page_size, world, r, partition);
        BatchPlanArgs args = c.plan_args();
        args.device = gpu;
        args.set_paged(share.table(), s.page_size);
        args.shape.o_dtype = layout.o_dtype;
        AttentionPlan plan = plan_batch_decode(args);
        const UploadedPlan uploaded(plan);
        PagedKVCache kv = dev.paged;
        kv.table = PageTable::csr(to_device(share.indptr), to_device(share.indices), to_device(share.last_page_len));
        run(plan, dev.q, kv, layout.rank_outputs(gathered, r, gpu), dev.options, uploaded.w, nullptr);
        ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
      }
      c.poison_outputs();
      dev.upload_outputs(c);
      merge_gathered_states(layout, gathered, world, Outputs{dev.out, dev.lse}, gpu, nullptr);
      ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
      dev.download_outputs(c);
      const Verdict v = check_case(c, {});
      EXPECT_TRUE(v.ok) << "world " << world << " " << to_string(partition) << ": " << v.message;
      cudaFree(gathered);
      for (void* p : allocations) cudaFree(p);
    }
}

// run_context_parallel over a real NCCL communicator of one rank (the lent machine has one GPU; 2 to 8 ranks need
// a multi-GPU machine): the run, the in-place all-gather and the merge, eagerly and replayed from a CUDA graph.
// NCCL comes from libnccl.so.2 or ATTNFORGE_NCCL_LIBRARY (scripts/device-check points it at PyTorch's).
TEST(CudaContextParallel, NcclCommunicatorOfOneRank) {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  const cuda::NcclApi& n = cuda::nccl();
  cuda::NcclUniqueId id{};
  ATTNFORGE_NCCL_CHECK(n.ncclGetUniqueId(&id));
  cuda::NcclComm comm = nullptr;
  ATTNFORGE_NCCL_CHECK(n.ncclCommInitRank(&comm, 1, id, 0));
  CaseSpec s;
  s.kind = PlanKind::kDecode;
  s.kv_lens = {700, 5, 3000};
  s.qo_lens.assign(3, 1);
  s.num_qo_heads = 8, s.num_kv_heads = 2, s.head_dim_qk = 128, s.page_size = 16;
  s.seed = 77;
  Case c = make_case(s);
  DeviceCase dev(c);
  BatchPlanArgs args = c.plan_args();
  args.device = Device::cuda(0);
  args.shape.o_dtype = DType::kFloat32;  // the ranks' states stay fp32 until the merge
  AttentionPlan plan = plan_batch_decode(args);
  const UploadedPlan uploaded(plan);
  const RankStateLayout layout{c.total_qo(), s.num_qo_heads, c.head_dim_vo(), DType::kFloat32};
  void* gathered = nullptr;
  ASSERT_EQ(cudaSuccess, cudaMalloc(&gathered, layout.rank_bytes()));
  cudaStream_t stream;
  ASSERT_EQ(cudaSuccess, cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto step = [&] {
    run_context_parallel(plan, dev.q, dev.paged, Outputs{dev.out, dev.lse}, dev.options, uploaded.w, layout, gathered,
                         0, 1, comm, stream);
  };
  for (int graph = 0; graph < 2; ++graph) {
    c.poison_outputs();
    dev.upload_outputs(c);
    if (graph == 0) {
      step();
    } else {
      cudaGraph_t g;
      cudaGraphExec_t exec;
      ASSERT_EQ(cudaSuccess, cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      step();
      ASSERT_EQ(cudaSuccess, cudaStreamEndCapture(stream, &g));
      ASSERT_EQ(cudaSuccess, cudaGraphInstantiate(&exec, g, 0));
      ASSERT_EQ(cudaSuccess, cudaGraphLaunch(exec, stream));
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(g);
    }
    ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(stream));
    dev.download_outputs(c);
    const Verdict v = check_case(c, {});
    EXPECT_TRUE(v.ok) << (graph ? "graph replay: " : "eager: ") << v.message;
  }
  cudaStreamDestroy(stream);
  cudaFree(gathered);
  n.ncclCommDestroy(comm);
}

// run_context_parallel over NCCL with one thread and one GPU per rank, for every world size from 2 up to the
// visible GPUs (at most 8): decode and prefill, both partitions, a GQA group of 5, soft-cap, an empty request;
// each rank plans and runs only its share, eagerly and replayed from a CUDA graph (the all-gather captured), into
// poisoned outputs, and every rank's merged result is checked against the float64 reference. Skipped with fewer
// than 2 GPUs (scripts/device-check runs it on a two-GPU machine).
TEST(CudaContextParallel, NcclRanksOnSeparateGpus) {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  int count = 0;
  ASSERT_EQ(cudaSuccess, cudaGetDeviceCount(&count));
  if (count < 2) GTEST_SKIP() << "needs 2 or more GPUs; " << count << " visible";
  for (int32_t world = 2; world <= std::min(count, 8); ++world)
    for (PlanKind kind : {PlanKind::kDecode, PlanKind::kPrefill})
      for (KVPartition partition : {KVPartition::kContiguous, KVPartition::kRoundRobinPages}) {
        CaseSpec s;
        s.kind = kind;
        s.kv_lens = {1, 700, 0, 3001, 17, 48, 16};
        for (int32_t n : s.kv_lens) s.qo_lens.push_back(kind == PlanKind::kDecode ? 1 : std::max(1, std::min(7, n)));
        s.num_qo_heads = 10, s.num_kv_heads = 2, s.head_dim_qk = 128, s.page_size = 16;
        s.options.soft_cap = 30.f;
        s.seed = 4242;
        const std::string id = nccl_unique_id();
        std::vector<std::string> failures(world);
        // The ranks meet before every collective and after it: a CUDA call that synchronizes implicitly
        // (cudaMalloc, cudaMallocHost, cudaFree) on one thread while another rank's all-gather waits for it
        // deadlocks. A rank that fails drops out, and the others stop at their next meeting.
        std::barrier<> sync(world);
        std::atomic<bool> any_failed = false;
        auto meet = [&] {
          sync.arrive_and_wait();
          if (any_failed) throw std::runtime_error("stopped: another rank failed");
        };
        auto rank_main = [&](int32_t r) {
          std::string& failure = failures[r];
          void* comm = nullptr;
          std::vector<void*> allocations;
          cudaStream_t stream = nullptr;
          try {
            if (cudaSetDevice(r) != cudaSuccess) throw std::runtime_error("cudaSetDevice");
            comm = nccl_comm_init_rank(world, r, id, r);  // first: a rank that fails later cannot strand the others here
            Case c = make_case(s);  // the same seed on every rank: the same batch
            DeviceCase dev(c, r);
            const Device gpu = Device::cuda(r);
            const RankPageTable share = partition_pages(c.paged.table, s.page_size, world, r, partition);
            BatchPlanArgs args = c.plan_args();
            args.device = gpu;
            args.set_paged(share.table(), s.page_size);
            args.shape.o_dtype = DType::kFloat32;
            AttentionPlan plan = kind == PlanKind::kDecode ? plan_batch_decode(args) : plan_batch_prefill(args);
            const UploadedPlan uploaded(plan);
            auto to_device = [&](const std::vector<int32_t>& host) {
              void* d = nullptr;
              if (cudaMalloc(&d, std::max<size_t>(4, host.size() * 4)) != cudaSuccess) throw std::runtime_error("cudaMalloc");
              allocations.push_back(d);
              if (!host.empty() && cudaMemcpy(d, host.data(), host.size() * 4, cudaMemcpyHostToDevice) != cudaSuccess)
                throw std::runtime_error("cudaMemcpy");
              return TensorView(d, DType::kInt32, {static_cast<int64_t>(host.size())}, gpu);
            };
            PagedKVCache kv = dev.paged;
            kv.table = PageTable::csr(to_device(share.indptr), to_device(share.indices), to_device(share.last_page_len));
            const RankStateLayout layout{c.total_qo(), s.num_qo_heads, c.head_dim_vo(), DType::kFloat32};
            void* gathered = nullptr;
            if (cudaMalloc(&gathered, world * layout.rank_bytes()) != cudaSuccess) throw std::runtime_error("cudaMalloc");
            allocations.push_back(gathered);
            cudaMemset(gathered, 0xff, world * layout.rank_bytes());  // NaN until written
            if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
              throw std::runtime_error("cudaStreamCreate");
            auto step = [&] {
              run_context_parallel(plan, dev.q, kv, Outputs{dev.out, dev.lse}, dev.options, uploaded.w, layout, gathered,
                                   r, world, comm, stream);
            };
            // The run's and the merge's kernels launched once on this GPU before any collective: a launch that
            // fails here (as every launch on a second GPU did while kernel attributes were set once per process)
            // fails before the meeting, not inside an all-gather that the other ranks would wait on forever.
            run(plan, dev.q, kv, layout.rank_outputs(gathered, r, gpu), dev.options, uploaded.w, stream);
            merge_gathered_states(layout, gathered, world, Outputs{dev.out, dev.lse}, gpu, stream);
            if (cudaStreamSynchronize(stream) != cudaSuccess) throw std::runtime_error("warm-up");
            for (int graph = 0; graph < 2; ++graph) {
              c.poison_outputs();
              dev.upload_outputs(c);
              cudaGraphExec_t exec = nullptr;
              if (graph == 1) {
                cudaGraph_t g;
                if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
                  throw std::runtime_error("cudaStreamBeginCapture");
                step();
                if (cudaStreamEndCapture(stream, &g) != cudaSuccess || cudaGraphInstantiate(&exec, g, 0) != cudaSuccess)
                  throw std::runtime_error("CUDA graph capture");
                cudaGraphDestroy(g);
              }
              meet();
              if (graph == 0)
                step();
              else if (cudaGraphLaunch(exec, stream) != cudaSuccess)
                throw std::runtime_error("cudaGraphLaunch");
              if (cudaStreamSynchronize(stream) != cudaSuccess) throw std::runtime_error("cudaStreamSynchronize");
              meet();
              if (exec) cudaGraphExecDestroy(exec);
              dev.download_outputs(c);
              const Verdict v = check_case(c, {});
              if (!v.ok) failure += std::string(graph ? "graph replay: " : "eager: ") + v.message + "; ";
            }
          } catch (const std::exception& e) {
            failure += e.what();
            any_failed = true;
            sync.arrive_and_drop();
          }
          if (stream) cudaStreamDestroy(stream);
          for (void* p : allocations) cudaFree(p);
          if (comm) nccl_comm_destroy(comm);
        };
        std::vector<std::thread> threads;
        for (int32_t r = 0; r < world; ++r) threads.emplace_back(rank_main, r);
        for (std::thread& t : threads) t.join();
        for (int32_t r = 0; r < world; ++r)
          EXPECT_EQ(failures[r], "") << "rank " << r << " of " << world << (kind == PlanKind::kDecode ? ", decode, " : ", prefill, ")
                                     << to_string(partition);
      }
  cudaSetDevice(0);
}

// The communicators made for callers without an ncclComm_t (the Python bindings), and what NCCL says about them.
TEST(CudaContextParallel, CommunicatorForCallersWithoutOne) {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  const std::string id = nccl_unique_id();
  ASSERT_EQ(id.size(), kNcclUniqueIdBytes);
  void* comm = nccl_comm_init_rank(1, 0, id, 0);
  ASSERT_NE(comm, nullptr);
  const NcclCommInfo info = nccl_comm_info(comm);
  EXPECT_EQ(info.world_size, 1);
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.cuda_device, 0);
  nccl_comm_destroy(comm);
  EXPECT_THROW(nccl_comm_init_rank(1, 0, id.substr(1), 0), Error);
  EXPECT_THROW(nccl_comm_init_rank(2, 2, id, 0), Error);
  EXPECT_THROW(nccl_comm_init_rank(1, 0, id, 1 << 20), Error);
}
