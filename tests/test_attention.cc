// Batch attention on the CPU backend against the float64 reference: the case registry and a seeded fuzz test.
#include <gtest/gtest.h>

#include <cstdlib>
#include <ostream>
#include <string>

#include "testing/compare.h"
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
