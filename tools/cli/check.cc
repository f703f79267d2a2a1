// `attnforge check`: batch attention on the CPU against the float64 reference, over the case registry the unit
// tests run (src/testing/registry.h: decode and prefill; paged CSR, block table and ragged KV; NHD and HND; page
// sizes 1 to 64; group sizes 1, 3, 4, 7, 8; fp16, fp32 and fp8 K/V; every option) on adversarial paged data.
// --quick takes the registry's representative dozen; the full run adds random batches (random_spec, as the fuzz
// test draws them).
#include <fmt/format.h>

#include <cstdio>
#include <exception>
#include <vector>

#include "commands.h"
#include "testing/compare.h"
#include "testing/registry.h"

namespace attnforge::cli {

namespace {
constexpr uint64_t kRandomBatches = 200;
}  // namespace

int run_check(const CheckOptions& options) {
  std::vector<testing::CaseSpec> cases = testing::registry_cases(options.quick);
  for (testing::CaseSpec& s : cases) s.seed += options.seed;
  // Seeds from 1, as the fuzz test's default, so a failure here reproduces with ATTNFORGE_FUZZ_SEED=<its seed>.
  if (!options.quick)
    for (uint64_t i = 0; i < kRandomBatches; ++i) cases.push_back(testing::random_spec(1 + options.seed + i));
  int32_t failed = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const testing::CaseSpec& s = cases[i];
    testing::Verdict v;
    try {
      testing::Case c = testing::make_case(s);
      testing::plan_and_run(c);
      v = testing::check_case(c);
    } catch (const std::exception& e) {
      v = {false, fmt::format("error: {}", e.what())};
    }
    if (!v.ok) ++failed;
    fmt::print("{} {:>3} {} | {}\n", v.ok ? "PASS" : "FAIL", i, v.message, s.describe());
    std::fflush(stdout);  // one line per case as it finishes, also when piped
  }
  fmt::print("{} of {} cases passed (seed offset {})\n", cases.size() - failed, cases.size(), options.seed);
  return failed == 0 ? 0 : 1;
}

}  // namespace attnforge::cli
