// Batch attention on the CPU backend against the float64 reference: the case registry and a seeded fuzz test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "backends/cpu/convert.h"
#include "testing/compare.h"
#include "testing/reference.h"
#include "testing/registry.h"

using namespace attnforge;
using namespace attnforge::testing;

namespace {

void check_spec(const CaseSpec& spec) {
  Case c = make_case(spec);
  const AttentionPlan plan = plan_and_run(c);
  const Verdict v = check_case(c);
  EXPECT_TRUE(v.ok) << v.message << "\n  case: " << spec.describe() << "\n  plan: " << plan.describe();
}

class Registry : public ::testing::TestWithParam<CaseSpec> {};

TEST_P(Registry, MatchesFloat64Reference) { check_spec(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, Registry, ::testing::ValuesIn(registry_cases()),
                         [](const ::testing::TestParamInfo<CaseSpec>& info) { return "case" + std::to_string(info.index); });

// The fp8 K/V decode cases the CUDA tests run (testing/registry.h), on the CPU backend.
TEST(Fp8Cases, MatchFloat64Reference) {
  for (const CaseSpec& spec : fp8_decode_cases()) check_spec(spec);
}

// The tolerance of the fp8 cases is tight enough to catch a wrong fp8 decode on the GPU: outputs computed (in
// float64) from K/V decoded the ways a kernel can get it wrong all fail the check, while the correct float64
// outputs pass it.
TEST(Fp8Cases, ToleranceRejectsWronglyDecodedKV) {
  using Values = std::vector<std::vector<float>>;
  struct Mistake {
    const char* what;
    std::function<void(Case&)> apply;
  };
  auto each = [](Values& vals, int32_t dim, auto&& f) {  // f(row of `dim` values)
    for (auto& request : vals)
      for (size_t i = 0; i + dim <= request.size(); i += dim) f(&request[i]);
  };
  const std::vector<Mistake> mistakes = {
      {"K decoded as zeros", [](Case& c) { for (auto& r : c.k_vals) std::fill(r.begin(), r.end(), 0.f); }},
      {"V decoded as zeros", [](Case& c) { for (auto& r : c.v_vals) std::fill(r.begin(), r.end(), 0.f); }},
      {"K exponent bias off by one", [](Case& c) { for (auto& r : c.k_vals) for (float& x : r) x *= 2.f; }},
      {"V exponent bias off by one", [](Case& c) { for (auto& r : c.v_vals) for (float& x : r) x *= 0.5f; }},
      {"K head dims not in Q's permuted order",
       [&](Case& c) {
         each(c.k_vals, c.spec.head_dim_qk, [&](float* row) {
           for (int32_t b = 0; b < c.spec.head_dim_qk; b += 16) {
             float block[16];
             for (int32_t slot = 0; slot < 16; ++slot)  // slot pair p holds dim pair [0,2,4,6,1,3,5,7][p]
               block[slot] = row[b + 2 * ((slot / 2) % 4 * 2 + slot / 8) + slot % 2];
             std::copy(block, block + 16, row + b);
           }
         });
       }},
      {"output dims of the even and odd V tiles swapped",
       [&](Case& c) {
         each(c.v_vals, c.head_dim_vo(), [&](float* row) {
           for (int32_t d = 0; d < c.head_dim_vo(); d += 2) std::swap(row[d], row[d + 1]);
         });
       }},
      {"V tokens paired wrongly",
       [&](Case& c) {
         const int64_t row = static_cast<int64_t>(c.spec.num_kv_heads) * c.head_dim_vo();
         for (auto& r : c.v_vals)
           for (size_t t = 0; t + 2 * row <= r.size(); t += 2 * row)
             std::swap_ranges(r.begin() + t, r.begin() + t + row, r.begin() + t + row);
       }},
  };
  for (const CaseSpec& spec : fp8_decode_cases()) {
    Case c = make_case(spec);
    auto check_outputs_of = [&](const Case& source) {
      const Reference r = reference_f64(source);
      for (size_t i = 0; i < r.o.size(); ++i) {
        const float x = static_cast<float>(r.o[i]);
        cpu::store_row(c.out_view.data, spec.o_dtype, static_cast<int64_t>(i), 1, &x);
      }
      for (size_t i = 0; i < r.lse.size(); ++i) c.lse_view.ptr<float>()[i] = static_cast<float>(r.lse[i]);
      return check_case(c);
    };
    const Verdict right = check_outputs_of(c);
    EXPECT_TRUE(right.ok) << "the correct outputs: " << right.message << "\n  case: " << spec.describe();
    for (const Mistake& m : mistakes) {
      Case wrong = c;
      m.apply(wrong);
      const Verdict v = check_outputs_of(wrong);
      EXPECT_FALSE(v.ok) << m.what << " passes: " << v.message << "\n  case: " << spec.describe();
    }
  }
}

// The raw K/V paths of the CPU backend (attention.cc: AVX-512 BF16 or AVX2 + FMA, by build target) take a KV head's
// rows in groups of up to four and the head dims in chunks of 16 or 32, in passes of several chunks: every group
// size (rows per head 1 to 8 in decode; prefill rows per head that leave a short last group), head dims 64, 128
// and 256, V dims that end in a short pass, and the Q and K/V types they accept.
TEST(RawKVPaths, EveryRowGroupAndHeadDim) {
  auto spec = [](PlanKind kind, std::vector<int32_t> qo, std::vector<int32_t> kv, int32_t group, int32_t dqk,
                 int32_t dvo) {
    CaseSpec s;
    s.kind = kind;
    s.qo_lens = std::move(qo), s.kv_lens = std::move(kv);
    s.num_kv_heads = 2, s.num_qo_heads = 2 * group;
    s.head_dim_qk = dqk, s.head_dim_vo = dvo;
    return s;
  };
  std::vector<CaseSpec> specs;
  for (int32_t group : {1, 2, 3, 5, 6, 7, 8})
    for (int32_t d : {64, 128, 256}) specs.push_back(spec(PlanKind::kDecode, {1, 1, 1}, {31, 100, 257}, group, d, 0));
  for (int32_t group : {1, 2, 3})
    for (int32_t dvo : {16, 48, 80, 112}) {
      specs.push_back(spec(PlanKind::kDecode, {1, 1}, {70, 33}, group, 64, dvo));
      specs.push_back(spec(PlanKind::kPrefill, {37, 5}, {97, 40}, group, 128, dvo));
    }
  for (int32_t group : {1, 2, 3, 4}) {  // rows past one 128-row task
    CaseSpec s = spec(PlanKind::kPrefill, {37, 130}, {97, 300}, group, 128, 0);
    s.options.causal = true;
    specs.push_back(s);
  }
  for (DType kv : {DType::kFloat8E4M3, DType::kFloat8E5M2})
    for (DType q : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      CaseSpec s = spec(PlanKind::kPrefill, {7, 33}, {90, 33}, 3, 128, 0);
      s.kv_dtype = kv, s.q_dtype = q, s.k_scale = 0.5f, s.v_scale = 0.25f;
      s.options.causal = true;
      specs.push_back(s);
    }
  for (DType q : {DType::kFloat16, DType::kFloat32}) {
    CaseSpec s = spec(PlanKind::kDecode, {1, 2}, {65, 300}, 4, 128, 0);
    s.q_dtype = s.o_dtype = q;
    specs.push_back(s);
  }
  uint64_t seed = 7000;
  for (CaseSpec& s : specs) {
    s.seed = seed++;
    check_spec(s);
  }
}

uint64_t env_or(const char* name, uint64_t fallback) {
  const char* s = std::getenv(name);
  return s ? std::strtoull(s, nullptr, 10) : fallback;
}

// Random batches; ATTNFORGE_FUZZ_SEED and ATTNFORGE_FUZZ_ITERS choose which. A failure prints the command that
// reproduces it alone.
TEST(Fuzz, RandomBatches) {
  const uint64_t first = env_or("ATTNFORGE_FUZZ_SEED", 1);
  const uint64_t iters = env_or("ATTNFORGE_FUZZ_ITERS", 150);
  for (uint64_t seed = first; seed < first + iters; ++seed) {
    const CaseSpec spec = random_spec(seed);
    Case c = make_case(spec);
    std::string error;
    try {
      plan_and_run(c);
      const Verdict v = check_case(c);
      if (!v.ok) error = v.message;
    } catch (const Error& e) {
      error = std::string("threw: ") + e.what();
    }
    if (!error.empty()) {
      ADD_FAILURE() << error << "\n  case: " << spec.describe()
                    << "\n  reproduce: ATTNFORGE_FUZZ_SEED=" << seed
                    << " ATTNFORGE_FUZZ_ITERS=1 tests/attnforge_tests --gtest_filter=Fuzz.RandomBatches";
      return;
    }
  }
}

// Outputs are fully written: a second run over poisoned outputs gives bit-identical results.
TEST(Determinism, RepeatedRunsAreBitIdentical) {
  CaseSpec spec = registry_cases()[0];
  spec.plan.num_workers = 64;
  Case c = make_case(spec);
  plan_and_run(c);
  const std::vector<uint8_t> first(static_cast<uint8_t*>(c.out.data()), static_cast<uint8_t*>(c.out.data()) + c.out.bytes());
  c.poison_outputs();
  plan_and_run(c);
  const std::vector<uint8_t> second(static_cast<uint8_t*>(c.out.data()), static_cast<uint8_t*>(c.out.data()) + c.out.bytes());
  EXPECT_EQ(first, second);
}

}  // namespace
