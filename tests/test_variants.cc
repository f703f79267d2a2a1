// Custom attention variants on the CPU, compiled at run time by the host compiler (no GPU): sigmoid attention
// with softmax off, a per-head logit bias from an extra tensor, a variant that writes its logits to an extra
// tensor, each against a float64 reference that runs the same variant struct (compiled into this test ahead of
// time); the built-in options written as a variant against the library's reference; errors.
#include <gtest/gtest.h>
#include <math.h>
#include <stdlib.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "attnforge/attnforge.h"
#include "attnforge/jit.h"
#include "attnforge/kernel/variant_hooks.h"
#include "attnforge/variant.h"
#include "testing/compare.h"
#include "testing/variant_reference.h"
#include "testing/registry.h"

using namespace attnforge;
using namespace attnforge::testing;

namespace {

class Variants : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char tmpl[] = "/tmp/attnforge-variants-XXXXXX";
    dir_ = mkdtemp(tmpl);
    jit::set_cache_dir(dir_);
  }
  static void TearDownTestSuite() {
    jit::set_cache_dir("");
    std::filesystem::remove_all(dir_);
  }
  static std::string dir_;
};
std::string Variants::dir_;

// fp32 throughout, so the comparison with float64 is tight: 2 requests of several query tokens, GQA.
CaseSpec fp32_spec() {
  CaseSpec s;
  s.kind = PlanKind::kPrefill;
  s.qo_lens = {3, 5};
  s.kv_lens = {40, 70};
  s.num_qo_heads = 4, s.num_kv_heads = 2, s.head_dim_qk = 64;
  s.q_dtype = s.kv_dtype = s.o_dtype = DType::kFloat32;
  s.seed = 21;
  return s;
}

AttentionPlan plan_without_splits(const Case& c) {
  BatchPlanArgs args = c.plan_args();
  args.options.disable_split = true;
  return c.spec.kind == PlanKind::kDecode ? plan_batch_decode(args) : plan_batch_prefill(args);
}

void run_case(Case& c, const CustomVariant& v, const VariantInputs& inputs) {
  const AttentionPlan plan = plan_without_splits(c);
  std::vector<char> ws(plan.workspace_bytes + 256);
  c.poison_outputs();
  run_variant(plan, c.q_view, c.paged, Outputs{c.out_view, c.lse_view}, c.options, v, inputs,
              Workspace{ws.data(), plan.workspace_bytes});
}


TEST_F(Variants, SigmoidAttentionWithSoftmaxOff) {
  Case c = make_case(fp32_spec());
  const VariantInputs in{{-2.5f}, {}};
  run_case(c, Sigmoid_variant, in);
  const VariantParams none{};
  EXPECT_LT(worst_error(c, reference<Sigmoid>(c, args_for(in, none))), 1e-5);
  const float* lse = static_cast<const float*>(c.lse_view.data);
  EXPECT_TRUE(std::isnan(lse[0])) << "no LSE without softmax";
}

TEST_F(Variants, PerHeadLogitBiasFromAnExtraTensor) {
  Case c = make_case(fp32_spec());
  std::vector<float> bias = {0.5f, -1.f, 2.f, 0.f};
  const VariantInputs in{{}, {bias.data()}};
  run_case(c, HeadBias_variant, in);
  const VariantParams none{};
  EXPECT_LT(worst_error(c, reference<HeadBias>(c, args_for(in, none))), 1e-5);
}

// Query, key and output transforms (fp32 rows) and a windowed causal mask; the second request is longer than the
// window. A loop that skipped any transform would miss the reference by far more than the tolerance.
TEST_F(Variants, QueryKeyAndOutputTransforms) {
  CaseSpec s = fp32_spec();
  s.kv_lens = {40, 170};
  Case c = make_case(s);
  std::vector<float> gain = {0.5f, 1.f, 1.5f, 2.f};
  const VariantInputs in{{0.8f}, {gain.data()}};
  run_case(c, Shaped_variant, in);
  const VariantParams none{};
  EXPECT_LT(worst_error(c, reference<Shaped>(c, args_for(in, none))), 1e-5);
  EXPECT_GT(worst_error(c, reference<HeadBias>(c, args_for(VariantInputs{{}, {gain.data()}}, none))), 0.1)
      << "the transforms must change the result";
}

TEST_F(Variants, VariantWritesItsLogitsToAnExtraTensor) {
  Case c = make_case(fp32_spec());
  const int32_t max_qo = 5, heads = 4, max_kv = 70;
  std::vector<float> logits(static_cast<size_t>(c.batch) * max_qo * heads * max_kv, NAN);
  std::vector<float> again = logits;
  const VariantInputs in{{float(max_qo), float(heads), float(max_kv)}, {logits.data()}};
  run_case(c, LogitsOut_variant, in);
  const VariantParams none{};
  const VariantInputs ref_in{in.scalars, {again.data()}};
  EXPECT_LT(worst_error(c, reference<LogitsOut>(c, args_for(ref_in, none))), 1e-5);
  int64_t written = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isnan(again[i])) continue;  // positions the reference never visited stay NaN in both
    ++written;
    EXPECT_NEAR(logits[i], again[i], 1e-4 * (1 + std::abs(again[i]))) << "logit " << i;
  }
  EXPECT_EQ(written, int64_t{3 * 40 + 5 * 70} * heads) << "every (query, head, kv) logit once";
}

// Two compiled variants in one process each run their own code (ctest runs every test in its own process, so this
// is the only place that sees a second variant loaded).
TEST_F(Variants, TwoVariantsInOneProcess) {
  Case c = make_case(fp32_spec());
  const VariantParams none{};
  const VariantInputs sig{{-1.f}, {}};
  run_case(c, Sigmoid_variant, sig);
  EXPECT_LT(worst_error(c, reference<Sigmoid>(c, args_for(sig, none))), 1e-5);
  std::vector<float> bias = {1.f, 0.f, -0.5f, 0.25f};
  const VariantInputs hb{{}, {bias.data()}};
  run_case(c, HeadBias_variant, hb);
  EXPECT_LT(worst_error(c, reference<HeadBias>(c, args_for(hb, none))), 1e-5);
}

// The built-in options through the hooks match the library's own float64 reference for run().
TEST_F(Variants, BuiltinOptionsAsAVariantMatchTheReference) {
  CaseSpec s = fp32_spec();
  s.q_dtype = s.kv_dtype = s.o_dtype = DType::kBFloat16;
  s.options.causal = true;
  s.options.window_left = 30;
  s.options.soft_cap = 20.f;
  s.options.alibi = true;
  s.options.sinks = true;
  s.options.custom_mask = true;
  s.options.rope = true;
  s.options.rope_offsets = true;
  Case c = make_case(s);
  run_case(c, builtin_variant(), {});
  const Verdict v = check_case(c);
  EXPECT_TRUE(v.ok) << v.message;
}

TEST_F(Variants, ErrorsNameTheProblem) {
  Case c = make_case(fp32_spec());
  auto error_of = [&](const CustomVariant& v, const VariantInputs& in) -> std::string {
    try {
      run_case(c, v, in);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error_of({"not an identifier", "struct X : attnforge::VariantBase {};"}, {}).find("expected a C++ identifier"),
            std::string::npos);
  EXPECT_NE(error_of(Sigmoid_variant, {std::vector<float>(9, 0.f), {}}).find("at most 8"), std::string::npos);
  const std::string compile_error = error_of({"Broken", "struct Broken : attnforge::VariantBase { int x = ; };"}, {});
  EXPECT_NE(compile_error.find("compiling variant_Broken_host failed"), std::string::npos) << compile_error;
  EXPECT_NE(compile_error.find("expected primary-expression"), std::string::npos) << compile_error;

  // With splits allowed, a long request and more workers than tiles, the plan splits KV: refused.
  CaseSpec long_spec = fp32_spec();
  long_spec.kv_lens = {4000, 70};
  Case long_case = make_case(long_spec);
  BatchPlanArgs args = long_case.plan_args();
  args.options.num_workers = 8;
  const AttentionPlan split = plan_batch_prefill(args);
  ASSERT_FALSE(split.merges.empty());
  std::vector<char> ws(split.workspace_bytes + 256);
  try {
    run_variant(split, long_case.q_view, long_case.paged, Outputs{long_case.out_view, long_case.lse_view},
                long_case.options, Sigmoid_variant, {{0.f}, {}}, Workspace{ws.data(), split.workspace_bytes});
    ADD_FAILURE() << "a plan with KV splits was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("PlanOptions::disable_split"), std::string::npos) << e.what();
  }
}

}  // namespace
