#include <gtest/gtest.h>

#include "testing/compare.h"

using namespace attnforge;
using namespace attnforge::testing;

TEST(Smoke, DecodePaged) {
  CaseSpec s;
  s.qo_lens = {1, 1, 1};
  s.kv_lens = {17, 0, 97};
  Case c = make_case(s);
  plan_and_run(c);
  Verdict v = check_case(c);
  EXPECT_TRUE(v.ok) << v.message << "\n" << s.describe();
}
