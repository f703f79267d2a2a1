// One test per error path of the public API. Each builds valid inputs (testing::make_case), breaks exactly one
// thing and checks that attnforge::Error is thrown with the right ErrorKind and a message naming the argument
// and the offending value. run() error tests also check that nothing was written: the outputs are poisoned
// with NaN before the call and must still be all NaN after it.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <list>
#include <string>
#include <utility>
#include <vector>

#include "attnforge/context_parallel.h"
#include "attnforge/devices.h"
#include "attnforge/dlpack.h"
#include "backends/cpu/convert.h"
#include "core/env.h"
#include "testing/compare.h"

namespace attnforge {
namespace {

using testing::Buffer;
using testing::Case;
using testing::CaseSpec;
using testing::make_case;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

const char* kind_name(ErrorKind k) {
  switch (k) {
    case ErrorKind::kInvalidArgument: return "kInvalidArgument";
    case ErrorKind::kUnsupported: return "kUnsupported";
    case ErrorKind::kWorkspace: return "kWorkspace";
    case ErrorKind::kPlanMismatch: return "kPlanMismatch";
    case ErrorKind::kBackend: return "kBackend";
  }
  return "unknown ErrorKind";
}

// fn must throw attnforge::Error of `kind` whose message contains every string of `parts`.
void expect_error(const std::function<void()>& fn, ErrorKind kind, std::initializer_list<std::string> parts) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_STREQ(kind_name(e.kind()), kind_name(kind)) << "message: " << msg;
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "the message lacks \"" << p << "\": " << msg;
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a std::exception that is not attnforge::Error: " << e.what();
    return;
  }
  ADD_FAILURE() << "no attnforge::Error was thrown; expected " << kind_name(kind);
}

// Owns edited copies of int32 host tensors (page tables, indptrs), so a test can break one entry of a valid
// one; the views it returns stay valid as long as it lives.
class Edits {
 public:
  // A copy of t (contiguous) with element i set to value.
  TensorView set(const TensorView& t, int64_t i, int32_t value) {
    copies_.emplace_back(t.ptr<const int32_t>(), t.ptr<const int32_t>() + t.numel());
    copies_.back()[static_cast<size_t>(i)] = value;
    TensorView r = t;
    r.data = copies_.back().data();
    return r;
  }

 private:
  std::list<std::vector<int32_t>> copies_;  // a list: adding a copy never moves the others
};

// The bytes of a memory range at construction, to prove later that a failed call wrote nothing there.
struct Snapshot {
  const uint8_t* p;
  std::vector<uint8_t> bytes;
  Snapshot(const void* data, size_t n) : p(static_cast<const uint8_t*>(data)), bytes(p, p + n) {}
  bool unchanged() const { return std::memcmp(p, bytes.data(), bytes.size()) == 0; }
};

bool all_nan(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isnan(x); });
}

bool all_nan(const Buffer& b) {
  for (size_t i = 0; i < b.count; ++i)
    if (!std::isnan(cpu::load_one(b.data(), b.dtype, static_cast<int64_t>(i)))) return false;
  return true;
}

// ---- plan ----

// Three requests, the middle one without KV: kv_lens {40, 0, 33} with page size 16 gives the CSR table
// indptr {0, 3, 3, 6} and last_page_len {8, 0, 1}; prefill qo_indptr is {0, 3, 4, 8}.
CaseSpec plan_spec(PlanKind kind, KVFormat format = KVFormat::kPagedCSR) {
  CaseSpec s;
  s.kind = kind;
  s.format = format;
  s.qo_lens = kind == PlanKind::kDecode ? std::vector<int32_t>{1, 1, 1} : std::vector<int32_t>{3, 1, 4};
  s.kv_lens = {40, 0, 33};
  s.num_qo_heads = 4;
  s.num_kv_heads = 2;
  s.head_dim_qk = 32;
  return s;
}

AttentionPlan plan(PlanKind kind, const BatchPlanArgs& a) {
  return kind == PlanKind::kDecode ? plan_batch_decode(a) : plan_batch_prefill(a);
}

// Plans plan_spec(kind, format) after `brk` broke one of its arguments; the plan must fail as described.
void expect_broken_plan(PlanKind kind, const std::function<void(BatchPlanArgs&, Edits&)>& brk, ErrorKind error,
                        std::initializer_list<std::string> parts, KVFormat format = KVFormat::kPagedCSR) {
  const Case c = make_case(plan_spec(kind, format));
  BatchPlanArgs a = c.plan_args();
  Edits edits;
  brk(a, edits);
  expect_error([&] { plan(kind, a); }, error, parts);
}

constexpr PlanKind kDecode = PlanKind::kDecode, kPrefill = PlanKind::kPrefill;
constexpr ErrorKind kInvalid = ErrorKind::kInvalidArgument;

// The ATTNFORGE_* knobs (core/env.h): unset or empty gives the default; anything outside the accepted set is an
// error naming the variable, the value and the set.
TEST(EnvSettings, ValuesOutsideTheSetAreRefusedByName) {
  const char* name = "ATTNFORGE_TEST_KNOB";
  auto refused = [&](const char* value, auto read, const std::string& words) {
    setenv(name, value, 1);
    try {
      read();
      ADD_FAILURE() << name << "=" << value << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  auto choice = [&] { return detail::env_choice(name, {"auto", "0", "1"}, "auto"); };
  auto number = [&] { return detail::env_int(name, 1, 4096, 7); };
  unsetenv(name);
  EXPECT_EQ(choice(), "auto");
  EXPECT_EQ(number(), 7);
  setenv(name, "", 1);
  EXPECT_EQ(choice(), "auto");
  EXPECT_EQ(number(), 7);
  setenv(name, "0", 1);
  EXPECT_EQ(choice(), "0");
  setenv(name, "12", 1);
  EXPECT_EQ(number(), 12);
  refused("2", choice, "ATTNFORGE_TEST_KNOB '2': expected one of {auto, 0, 1}");
  refused("on", choice, "ATTNFORGE_TEST_KNOB 'on': expected one of {auto, 0, 1}");
  refused("0", number, "ATTNFORGE_TEST_KNOB '0': expected an integer in [1, 4096]");
  refused("4097", number, "'4097'");
  refused("8x", number, "'8x'");
  refused("99999999999999999999", number, "expected an integer in [1, 4096]");
  unsetenv(name);
}

TEST(PlanErrors, ValidArgsPlan) {
  for (KVFormat format : {KVFormat::kPagedCSR, KVFormat::kBlockTable, KVFormat::kRagged})
    for (PlanKind kind : {kDecode, kPrefill}) {
      const Case c = make_case(plan_spec(kind, format));
      EXPECT_NO_THROW(plan(kind, c.plan_args())) << to_string(format);
    }
}

TEST(PlanErrors, KvIndptrNotMonotone) {
  expect_broken_plan(kDecode, [](BatchPlanArgs& a, Edits& e) { a.kv_indptr = e.set(a.kv_indptr, 2, 2); },  // {0, 3, 2, 6}
                     kInvalid, {"kv_indptr", "kv_indptr[2] = 2 < kv_indptr[1] = 3"});
}

TEST(PlanErrors, QoIndptrNotMonotone) {
  expect_broken_plan(kPrefill, [](BatchPlanArgs& a, Edits& e) { a.qo_indptr = e.set(a.qo_indptr, 1, 5); },  // {0, 5, 4, 8}
                     kInvalid, {"qo_indptr", "qo_indptr[2] = 4 < qo_indptr[1] = 5"});
}

TEST(PlanErrors, KvIndptrNotStartingAtZero) {
  expect_broken_plan(kDecode, [](BatchPlanArgs& a, Edits& e) { a.kv_indptr = e.set(a.kv_indptr, 0, 1); }, kInvalid,
                     {"kv_indptr[0]: 1", "expected 0"});
}

TEST(PlanErrors, QoIndptrNotStartingAtZero) {
  expect_broken_plan(kPrefill, [](BatchPlanArgs& a, Edits& e) { a.qo_indptr = e.set(a.qo_indptr, 0, 1); }, kInvalid,
                     {"qo_indptr[0]: 1", "expected 0"});
}

TEST(PlanErrors, LastPageLenOutOfRange) {
  for (int32_t bad : {0, 17})  // request 0 has 3 pages of 16
    expect_broken_plan(kDecode, [bad](BatchPlanArgs& a, Edits& e) { a.last_page_len = e.set(a.last_page_len, 0, bad); },
                       kInvalid, {"last_page_len[0]: " + std::to_string(bad), "[1, page_size=16]"});
}

TEST(PlanErrors, LastPageLenOfRequestWithoutPages) {
  expect_broken_plan(kDecode, [](BatchPlanArgs& a, Edits& e) { a.last_page_len = e.set(a.last_page_len, 1, 5); },
                     kInvalid, {"last_page_len[1]: 5", "no pages", "expected 0"});
}

TEST(PlanErrors, NegativeSeqLens) {
  expect_broken_plan(kDecode, [](BatchPlanArgs& a, Edits& e) { a.seq_lens = e.set(a.seq_lens, 2, -3); }, kInvalid,
                     {"seq_lens[2]: -3", ">= 0"}, KVFormat::kBlockTable);
}

TEST(PlanErrors, QoHeadsNotMultipleOfKvHeads) {
  expect_broken_plan(kDecode, [](BatchPlanArgs& a, Edits&) { a.shape.num_qo_heads = 5; }, kInvalid,
                     {"num_qo_heads 5 is not a multiple of num_kv_heads 2"});
}

TEST(PlanErrors, HeadDimNotMultipleOf8) {
  expect_broken_plan(kDecode, [](BatchPlanArgs& a, Edits&) { a.shape.head_dim_qk = a.shape.head_dim_vo = 60; },
                     kInvalid, {"head_dim_qk: 60", "multiple of 8"});
}

TEST(PlanErrors, HeadDimAboveCpuLimit) {
  expect_broken_plan(kDecode, [](BatchPlanArgs& a, Edits&) { a.shape.head_dim_qk = a.shape.head_dim_vo = 520; },
                     ErrorKind::kUnsupported, {"head_dim 520", "512"});
}

TEST(PlanErrors, UnsupportedQDtype) {
  expect_broken_plan(kDecode, [](BatchPlanArgs& a, Edits&) { a.shape.q_dtype = DType::kInt32; }, kInvalid,
                     {"q_dtype: int32", "bfloat16"});
}

TEST(PlanErrors, UnsupportedKvDtype) {
  expect_broken_plan(kDecode, [](BatchPlanArgs& a, Edits&) { a.shape.kv_dtype = DType::kInt64; }, kInvalid,
                     {"kv_dtype: int64", "float8_e4m3"});
}

TEST(PlanErrors, PageSizeZero) {
  expect_broken_plan(kDecode, [](BatchPlanArgs& a, Edits&) { a.page_size = 0; }, kInvalid, {"page_size: 0", ">= 1"});
}

TEST(PlanErrors, DecodeWithMoreThanEightQueries) {
  CaseSpec s = plan_spec(kDecode);
  s.qo_lens = {1, 9, 1};
  const Case c = make_case(s);
  expect_error([&] { plan_batch_decode(c.plan_args()); }, kInvalid,
               {"qo_indptr", "request 1 has 9 query tokens", "at most 8"});
}

TEST(PlanErrors, CausalWithQoLongerThanKv) {
  expect_broken_plan(kPrefill, [](BatchPlanArgs& a, Edits&) { a.options.causal = true; },  // request 1: 1 query, no KV
                     kInvalid, {"request 1", "qo_len 1 > kv_len 0"});
}

TEST(PlanErrors, PrefillWithoutQoIndptr) {
  expect_broken_plan(kPrefill, [](BatchPlanArgs& a, Edits&) { a.qo_indptr = TensorView{}; }, kInvalid,
                     {"qo_indptr", "required"});
}

TEST(PlanErrors, NegativeFixedSplitSize) {
  expect_broken_plan(
      kDecode,
      [](BatchPlanArgs& a, Edits&) {
        a.options.deterministic = true;
        a.options.fixed_split_size = -5;
      },
      kInvalid, {"fixed_split_size: -5"});
}

TEST(PlanErrors, CudaDeviceNotServed) {
  // No machine has a CUDA device 999: unsupported in a CPU-only build and in a CUDA build alike.
  expect_broken_plan(kDecode, [](BatchPlanArgs& a, Edits&) { a.device = Device::cuda(999); }, ErrorKind::kUnsupported,
                     {"cuda:999"});
  // cuda:0 is refused the same way wherever no CUDA device is listed (always in a CPU-only build).
  const std::vector<DeviceInfo> devices = available_devices();
  const bool has_cuda = std::any_of(devices.begin(), devices.end(),
                                    [](const DeviceInfo& d) { return d.device.type == DeviceType::kCUDA; });
  if (!has_cuda)
    expect_broken_plan(kDecode, [](BatchPlanArgs& a, Edits&) { a.device = Device::cuda(0); }, ErrorKind::kUnsupported,
                       {"cuda:0"});
}

// ---- run ----

// Every argument of one run() call, copied from a valid case so a test can break one of them.
struct RunArgs {
  TensorView q;
  PagedKVCache paged;
  RaggedKV ragged;
  bool use_ragged = false;
  Outputs outputs;
  AttentionOptions options;
  Workspace workspace;
};

// A planned valid batch. The default spec is a prefill batch, paged CSR, split in deterministic mode at 16
// tokens so that the plan needs a workspace: qo_lens {3, 1, 4}, kv_lens {40, 17, 33} (pages 3, 2, 3),
// 4 query heads over 2 KV heads, head dim 32, bf16 everywhere.
struct Runnable {
  Case c;
  AttentionPlan plan;
  Buffer ws;

  explicit Runnable(const CaseSpec& s) : c(make_case(s)) {
    plan = s.kind == PlanKind::kDecode ? plan_batch_decode(c.plan_args()) : plan_batch_prefill(c.plan_args());
    ws = Buffer::make(DType::kUInt8, plan.workspace_bytes);
  }
  static CaseSpec spec(KVFormat format = KVFormat::kPagedCSR) {
    CaseSpec s;
    s.kind = PlanKind::kPrefill;
    s.format = format;
    s.qo_lens = {3, 1, 4};
    s.kv_lens = {40, 17, 33};
    s.num_qo_heads = 4;
    s.num_kv_heads = 2;
    s.head_dim_qk = 32;
    s.plan.deterministic = true;
    s.plan.fixed_split_size = 16;
    return s;
  }
  RunArgs args() const {
    return {c.q_view, c.paged, c.ragged, c.spec.format == KVFormat::kRagged, {c.out_view, c.lse_view}, c.options,
            {ws.data(), plan.workspace_bytes}};
  }
  void run(const RunArgs& a) const {
    if (a.use_ragged)
      attnforge::run(plan, a.q, a.ragged, a.outputs, a.options, a.workspace);
    else
      attnforge::run(plan, a.q, a.paged, a.outputs, a.options, a.workspace);
  }
  bool outputs_poisoned() const { return all_nan(c.out) && all_nan(c.lse); }
};

// Plans `spec`, lets `brk` break one argument of the run() call, and checks that run() fails as described and
// writes nothing: the poisoned outputs stay NaN and the inputs (q, K/V) keep their bytes.
void expect_broken_run(const std::function<void(RunArgs&, Edits&)>& brk, ErrorKind kind,
                       std::initializer_list<std::string> parts, const CaseSpec& spec = Runnable::spec()) {
  Runnable r(spec);
  RunArgs a = r.args();
  Edits edits;
  brk(a, edits);
  r.c.poison_outputs();
  const Snapshot q(r.c.q.data(), r.c.q.bytes()), kv(r.c.kv.data(), r.c.kv.bytes());
  expect_error([&] { r.run(a); }, kind, parts);
  EXPECT_TRUE(r.outputs_poisoned()) << "run() wrote to out or lse before failing";
  EXPECT_TRUE(q.unchanged()) << "run() wrote to q before failing";
  EXPECT_TRUE(kv.unchanged()) << "run() wrote to K/V before failing";
}

CaseSpec with_options(const CaseSpec& s, const std::function<void(testing::OptionSpec&)>& set) {
  CaseSpec r = s;
  set(r.options);
  return r;
}

TEST(RunErrors, ValidArgsRunAndWrite) {
  // The control for every test below: unbroken arguments run, pass the reference check and overwrite the
  // poison, so "still all NaN" after a failed call means that nothing was written.
  for (KVFormat f : {KVFormat::kPagedCSR, KVFormat::kBlockTable, KVFormat::kRagged}) {
    Runnable r(Runnable::spec(f));
    ASSERT_GT(r.plan.workspace_bytes, 0u) << r.plan.describe();
    r.c.poison_outputs();
    ASSERT_NO_THROW(r.run(r.args()));
    EXPECT_FALSE(all_nan(r.c.out));
    const testing::Verdict v = testing::check_case(r.c);
    EXPECT_TRUE(v.ok) << v.message;
  }
}

TEST(RunErrors, QWrongDtype) {
  expect_broken_run([](RunArgs& a, Edits&) { a.q.dtype = DType::kFloat16; }, kInvalid,
                    {"q: dtype float16", "q_dtype bfloat16"});
}

TEST(RunErrors, QWrongHeadCount) {
  expect_broken_run([](RunArgs& a, Edits&) { a.q.shape[1] = 2; }, kInvalid,
                    {"q: dimension 1 is 2", "expected 4", "num_qo_heads"});
}

TEST(RunErrors, QWrongRows) {
  expect_broken_run([](RunArgs& a, Edits&) { a.q.shape[0] = 7; }, ErrorKind::kPlanMismatch,
                    {"q: has 7 rows", "8 query tokens"});
}

TEST(RunErrors, KWrongPageSize) {
  expect_broken_run([](RunArgs& a, Edits&) { a.paged.k.shape[1] = 8; },  // NHD: [pages, page_size, heads, dim]
                    kInvalid, {"kv.k: dimension 1 is 8", "expected 16", "page_size"});
}

TEST(RunErrors, VWrongHeadDim) {
  expect_broken_run([](RunArgs& a, Edits&) { a.paged.v.shape[3] = 16; }, kInvalid,
                    {"kv.v: dimension 3 is 16", "expected 32", "head_dim_vo"});
}

TEST(RunErrors, KWrongDtype) {
  expect_broken_run([](RunArgs& a, Edits&) { a.paged.k.dtype = DType::kFloat16; }, kInvalid,
                    {"kv.k: dtype float16", "kv_dtype bfloat16"});
}

TEST(RunErrors, KScaleNotPositive) {
  expect_broken_run([](RunArgs& a, Edits&) { a.paged.k_scale = 0.f; }, kInvalid, {"kv.k_scale: 0", "> 0"});
}

TEST(RunErrors, CsrPageIdOutOfRange) {
  const int64_t num_pages = 3 + 2 + 3 + 3;  // pages of kv_lens {40, 17, 33} and 3 spare pages
  expect_broken_run(
      [&](RunArgs& a, Edits& e) {
        EXPECT_EQ(a.paged.k.shape[0], num_pages);
        a.paged.table.indices = e.set(a.paged.table.indices, 4, static_cast<int32_t>(num_pages));  // request 1, page 1
      },
      kInvalid, {"kv.table.indices[4]: page id 11", "num_pages=11"});
}

TEST(RunErrors, BlockTablePageIdOutOfRange) {
  // The table has max_pages + 1 = 4 columns; request 1 (17 tokens) uses two, so entry [1, 1] is element 5.
  expect_broken_run([](RunArgs& a, Edits& e) { a.paged.table.block_table = e.set(a.paged.table.block_table, 5, -7); },
                    kInvalid, {"kv.table.block_table[5]: page id -7", "out of range"},
                    Runnable::spec(KVFormat::kBlockTable));
}

TEST(RunErrors, PageTableOfAnotherBatch) {
  expect_broken_run(
      [](RunArgs& a, Edits& e) {
        EXPECT_EQ(a.paged.table.last_page_len.ptr<int32_t>()[0], 8);  // 40 tokens in pages of 16
        a.paged.table.last_page_len = e.set(a.paged.table.last_page_len, 0, 7);
      },
      ErrorKind::kPlanMismatch, {"kv.table", "request 0 has 39 KV tokens", "made for 40"});
}

TEST(RunErrors, BlockTableWithAnotherRowCount) {
  expect_broken_run([](RunArgs& a, Edits&) { a.paged.table.block_table.shape[0] = 2; }, ErrorKind::kPlanMismatch,
                    {"kv.table.block_table: has 2 rows", "batch of 3"}, Runnable::spec(KVFormat::kBlockTable));
}

TEST(RunErrors, RaggedKvForPagedPlan) {
  const Case ragged = make_case(Runnable::spec(KVFormat::kRagged));
  expect_broken_run(
      [&](RunArgs& a, Edits&) {
        a.ragged = ragged.ragged;
        a.use_ragged = true;
      },
      ErrorKind::kPlanMismatch, {"kv: ragged KV given", "paged-csr"});
}

TEST(RunErrors, PagedKvForRaggedPlan) {
  const Case paged = make_case(Runnable::spec());
  expect_broken_run(
      [&](RunArgs& a, Edits&) {
        a.paged = paged.paged;
        a.use_ragged = false;
      },
      ErrorKind::kPlanMismatch, {"kv: a paged cache given", "ragged"}, Runnable::spec(KVFormat::kRagged));
}

TEST(RunErrors, WorkspaceTooSmall) {
  const size_t needed = Runnable(Runnable::spec()).plan.workspace_bytes;
  expect_broken_run([](RunArgs& a, Edits&) { a.workspace.bytes -= 1; }, ErrorKind::kWorkspace,
                    {fmt::format("workspace: {} bytes", needed - 1), fmt::format("needs {}", needed)});
}

TEST(RunErrors, WorkspaceNull) {
  expect_broken_run([](RunArgs& a, Edits&) { a.workspace.data = nullptr; }, ErrorKind::kWorkspace,
                    {"workspace: data is null"});
}

TEST(RunErrors, WorkspaceMisaligned) {
  Buffer big = Buffer::make(DType::kUInt8, 1 << 20);
  expect_broken_run([&](RunArgs& a, Edits&) { a.workspace.data = static_cast<uint8_t*>(big.data()) + 8; },
                    ErrorKind::kWorkspace, {"workspace: address", "256-byte aligned"});
}

TEST(RunErrors, OutWrongDtype) {
  expect_broken_run([](RunArgs& a, Edits&) { a.outputs.out.dtype = DType::kFloat16; }, kInvalid,
                    {"out: dtype float16", "o_dtype bfloat16"});
}

TEST(RunErrors, OutWrongShape) {
  expect_broken_run([](RunArgs& a, Edits&) { a.outputs.out.shape[2] = 16; }, kInvalid,
                    {"out: dimension 2 is 16", "expected 32", "head_dim_vo"});
}

TEST(RunErrors, OutAliasesQ) {
  expect_broken_run(
      [](RunArgs& a, Edits&) {
        EXPECT_EQ(a.q.dtype, a.outputs.out.dtype);
        a.outputs.out.data = a.q.data;  // same shape and strides: out would overwrite q
      },
      kInvalid, {"out: overlaps the memory of q"});
}

TEST(RunErrors, LseWrongDtype) {
  expect_broken_run([](RunArgs& a, Edits&) { a.outputs.lse.dtype = DType::kFloat16; }, kInvalid,
                    {"lse: dtype float16", "float32"});
}

TEST(RunErrors, NegativeSmScale) {
  expect_broken_run([](RunArgs& a, Edits&) { a.options.sm_scale = -1.f; }, kInvalid, {"options.sm_scale: -1"});
}

TEST(RunErrors, NanSoftCap) {
  expect_broken_run([](RunArgs& a, Edits&) { a.options.logits_soft_cap = kNaN; }, kInvalid,
                    {"options.logits_soft_cap: nan"});
}

TEST(RunErrors, WindowLeftBelowMinusOne) {
  expect_broken_run([](RunArgs& a, Edits&) { a.options.window_left = -2; }, kInvalid,
                    {"options.window_left: -2", "-1 (unbounded)"});
}

TEST(RunErrors, AlibiSlopesWrongLength) {
  std::vector<float> slopes(3, 0.5f);  // the batch has 4 query heads
  expect_broken_run([&](RunArgs& a, Edits&) { a.options.alibi_slopes = TensorView(slopes.data(), DType::kFloat32, {3}); },
                    kInvalid, {"options.alibi_slopes: dimension 0 is 3", "expected 4"});
}

TEST(RunErrors, SinksWithNan) {
  std::vector<float> sinks = {0.5f, 1.f, kNaN, 0.f};
  expect_broken_run([&](RunArgs& a, Edits&) { a.options.sinks = TensorView(sinks.data(), DType::kFloat32, {4}); },
                    kInvalid, {"options.sinks[2]: nan", "finite"});
}

TEST(RunErrors, CustomMaskSegmentTooShort) {
  // Segments of ceil(3*40/8) = 15, ceil(1*17/8) = 3 and ceil(4*33/8) = 17 bytes: indptr {0, 15, 18, 35}.
  // Moving indptr[2] to 17 leaves request 1 two bytes.
  expect_broken_run(
      [](RunArgs& a, Edits& e) {
        TensorView& ip = a.options.custom_mask.indptr;
        EXPECT_EQ(ip.ptr<int32_t>()[2], 18);
        ip = e.set(ip, 2, 17);
      },
      kInvalid, {"options.custom_mask.indptr: request 1 has 2 bytes", "needs 3"},
      with_options(Runnable::spec(), [](testing::OptionSpec& o) { o.custom_mask = true; }));
}

// run() with fused RoPE whose options `set` makes invalid.
void expect_broken_rope(const std::function<void(RopeOptions&)>& set, std::initializer_list<std::string> parts) {
  expect_broken_run(
      [&](RunArgs& a, Edits&) {
        a.options.rope.enabled = true;
        set(a.options.rope);
      },
      kInvalid, parts);
}

TEST(RunErrors, RopeRotaryDimOdd) {
  expect_broken_rope([](RopeOptions& r) { r.rotary_dim = 7; }, {"rope.rotary_dim: 7", "even"});
}

TEST(RunErrors, RopeRotaryDimAboveHeadDim) {
  expect_broken_rope([](RopeOptions& r) { r.rotary_dim = 48; }, {"rope.rotary_dim: 48", "head_dim=32"});
}

TEST(RunErrors, RopeThetaZero) {
  expect_broken_rope([](RopeOptions& r) { r.theta = 0.f; }, {"rope.theta: 0", "> 0"});
}

TEST(RunErrors, NonCausalRunOnCausalPlan) {
  expect_broken_run([](RunArgs& a, Edits&) { a.options.causal = false; }, ErrorKind::kPlanMismatch,
                    {"options.causal: false", "PlanOptions::causal = true"},
                    with_options(Runnable::spec(), [](testing::OptionSpec& o) { o.causal = true; }));
}

TEST(RunErrors, CausalRunWithQoLongerThanKv) {
  CaseSpec s = Runnable::spec();
  s.kv_lens = {40, 0, 33};  // request 1: one query, no KV; the plan is not causal
  expect_broken_run([](RunArgs& a, Edits&) { a.options.causal = true; }, kInvalid,
                    {"options.causal", "request 1 has qo_len 1 > kv_len 0"}, s);
}

// ---- merge_state / merge_states ----

// Float32 tensors for the state operators, filled with one value.
struct F32 {
  std::vector<float> v;
  TensorView view;
  F32(std::initializer_list<int64_t> shape, float fill) : view(nullptr, DType::kFloat32, shape) {
    v.assign(static_cast<size_t>(view.numel()), fill);
    view.data = v.data();
  }
  F32(F32&&) = default;  // moving keeps the vector's storage, so the view stays valid; a copy would not
  F32& operator=(F32&&) = default;
};

TEST(StateErrors, MergeStateShapeMismatch) {
  F32 va({2, 3, 8}, 1.f), sa({2, 3}, 0.f), vb({2, 3, 16}, 1.f), sb({2, 3}, 0.f), out({2, 3, 8}, kNaN);
  expect_error([&] { merge_state(va.view, sa.view, vb.view, sb.view, {out.view, {}}); }, ErrorKind::kInvalidArgument,
               {"v_b: dimension 2 is 16", "expected 8", "head_dim of v_a"});
  EXPECT_TRUE(all_nan(out.v)) << "out was written before the error";
}

TEST(StateErrors, MergeStateLseNotFloat32) {
  F32 va({2, 3, 8}, 1.f), sa({2, 3}, 0.f), vb({2, 3, 8}, 1.f), sb({2, 3}, 0.f), out({2, 3, 8}, kNaN);
  sa.view.dtype = DType::kBFloat16;
  expect_error([&] { merge_state(va.view, sa.view, vb.view, sb.view, {out.view, {}}); }, ErrorKind::kInvalidArgument,
               {"s_a: dtype bfloat16", "float32"});
  EXPECT_TRUE(all_nan(out.v)) << "out was written before the error";
}

TEST(StateErrors, MergeStatesShapeMismatch) {
  F32 v({2, 5, 3, 8}, 1.f), s({2, 4, 3}, 0.f), out({2, 3, 8}, kNaN);
  expect_error([&] { merge_states(v.view, s.view, {out.view, {}}); }, ErrorKind::kInvalidArgument,
               {"s: dimension 1 is 4", "expected 5", "num_states"});
  EXPECT_TRUE(all_nan(out.v)) << "out was written before the error";
}

TEST(StateErrors, MergeStatesLseNotFloat32) {
  F32 v({2, 5, 3, 8}, 1.f), s({2, 5, 3}, 0.f), out({2, 3, 8}, kNaN);
  s.view.dtype = DType::kFloat16;
  expect_error([&] { merge_states(v.view, s.view, {out.view, {}}); }, ErrorKind::kInvalidArgument,
               {"s: dtype float16", "float32"});
  EXPECT_TRUE(all_nan(out.v)) << "out was written before the error";
}

// ---- append_paged_kv_cache ----

// Two rows to append (2 KV heads, head dim 32) into the cache of a decode case with kv_lens {40, 17, 33}.
struct AppendSetup {
  Case c = make_case([] {
    CaseSpec s = Runnable::spec();
    s.kind = PlanKind::kDecode;
    s.qo_lens = {1, 1, 1};
    return s;
  }());
  F32 k{{2, 2, 32}, 0.25f}, v{{2, 2, 32}, -0.25f};
  std::vector<int32_t> batch_indices = {0, 2}, positions = {39, 5};

  void call() {
    append_paged_kv_cache(k.view, v.view, TensorView(batch_indices.data(), DType::kInt32, {2}),
                          TensorView(positions.data(), DType::kInt32, {2}), c.paged);
  }
  Snapshot cache() const { return {c.kv.data(), c.kv.bytes()}; }
  void expect_append_error(ErrorKind kind, std::initializer_list<std::string> parts) {
    const Snapshot before = cache();
    expect_error([&] { call(); }, kind, parts);
    EXPECT_TRUE(before.unchanged()) << "the cache was written before the error";
  }
};

TEST(AppendErrors, ValidArgsAppend) {
  // The control: a valid append changes the cache, so "unchanged" after a failed call means nothing was written.
  AppendSetup s;
  const Snapshot before = s.cache();
  ASSERT_NO_THROW(s.call());
  EXPECT_FALSE(before.unchanged());
}

TEST(AppendErrors, BatchIndexOutOfRange) {
  AppendSetup s;
  s.batch_indices[1] = 3;
  s.expect_append_error(ErrorKind::kInvalidArgument, {"batch_indices[1]: 3", "batch=3"});
}

TEST(AppendErrors, PositionBeyondRequestLength) {
  AppendSetup s;
  s.positions[0] = 40;  // request 0 holds 40 tokens
  s.expect_append_error(ErrorKind::kInvalidArgument, {"positions[0]: 40", "request 0 has 40 tokens"});
}

TEST(AppendErrors, HeadCountMismatch) {
  AppendSetup s;
  s.k = F32({2, 3, 32}, 0.25f);
  s.expect_append_error(ErrorKind::kInvalidArgument, {"append_k: dimension 1 is 3", "expected 2", "num_heads"});
}

// ---- apply_rope ----

// q [4, 2, 16], k [4, 1, 16] in two requests; the outputs start as NaN.
struct RopeSetup {
  F32 q{{4, 2, 16}, 0.5f}, k{{4, 1, 16}, 0.5f}, q_out{{4, 2, 16}, kNaN}, k_out{{4, 1, 16}, kNaN};
  std::vector<int32_t> indptr = {0, 2, 4}, offsets = {0, 3};
  RopeOptions rope;

  void call() {
    apply_rope(q.view, k.view, q_out.view, k_out.view, TensorView(indptr.data(), DType::kInt32, {3}),
               TensorView(offsets.data(), DType::kInt32, {2}), rope);
  }
  bool outputs_untouched() const { return all_nan(q_out.v) && all_nan(k_out.v); }
};

TEST(RopeErrors, ValidArgsRotate) {
  RopeSetup s;
  ASSERT_NO_THROW(s.call());
  EXPECT_FALSE(s.outputs_untouched());
}

TEST(RopeErrors, IndptrEndIsNotNnz) {
  RopeSetup s;
  s.indptr = {0, 2, 5};
  expect_error([&] { s.call(); }, ErrorKind::kInvalidArgument, {"indptr[2]: 5", "nnz = 4"});
  EXPECT_TRUE(s.outputs_untouched());
}

TEST(RopeErrors, RotaryDimOdd) {
  RopeSetup s;
  s.rope.rotary_dim = 5;
  expect_error([&] { s.call(); }, ErrorKind::kInvalidArgument, {"rope.rotary_dim: 5", "even"});
  EXPECT_TRUE(s.outputs_untouched());
}

// ---- DLPack ----

// A valid 1-D float32 CPU DLTensor of 2 elements, for breaking one field.
struct DLInput {
  float storage[2] = {1.f, 2.f};
  int64_t shape[1] = {2};
  DLTensor t{storage, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, shape, nullptr, 0};
};

TEST(DLPackErrors, ValidTensorConverts) {
  DLInput in;
  EXPECT_NO_THROW(from_dlpack(in.t, "my_tensor"));
}

TEST(DLPackErrors, ComplexDtypeNamesTheTensor) {
  DLInput in;
  in.t.dtype = {kDLComplex, 64, 1};
  expect_error([&] { from_dlpack(in.t, "my_tensor"); }, ErrorKind::kInvalidArgument,
               {"my_tensor", "code 5, 64 bits", "not accepted"});
}

TEST(DLPackErrors, VectorLanes) {
  DLInput in;
  in.t.dtype.lanes = 4;
  expect_error([&] { from_dlpack(in.t, "my_tensor"); }, ErrorKind::kInvalidArgument, {"my_tensor", "4 lanes"});
}

TEST(DLPackErrors, UnsupportedDevice) {
  DLInput in;
  in.t.device = {kDLOpenCL, 0};
  expect_error([&] { from_dlpack(in.t, "my_tensor"); }, ErrorKind::kInvalidArgument,
               {"my_tensor", "device type 4", "not accepted"});
}

// ---- context parallelism ----

TEST(ContextParallelErrors, PositionDependentOptionsAndSinksAreRejected) {
  float one = 1.f;
  uint8_t bits = 0;
  int32_t zero = 0;
  const TensorView per_head(&one, DType::kFloat32, {1});
  const std::vector<std::pair<std::function<void(AttentionOptions&)>, std::string>> rejected = {
      {[](AttentionOptions& o) { o.causal = true; }, "causal"},
      {[](AttentionOptions& o) { o.window_left = 8; }, "window_left/window_right"},
      {[](AttentionOptions& o) { o.window_right = 0; }, "window_left/window_right"},
      {[&](AttentionOptions& o) { o.alibi_slopes = per_head; }, "alibi_slopes"},
      {[](AttentionOptions& o) { o.rope.enabled = true; }, "rope"},
      {[&](AttentionOptions& o) {
         o.custom_mask = {TensorView(&bits, DType::kUInt8, {1}), TensorView(&zero, DType::kInt32, {1})};
       },
       "custom_mask"},
      {[&](AttentionOptions& o) { o.sinks = per_head; }, "sinks"},
  };
  for (KVPartition partition : {KVPartition::kContiguous, KVPartition::kRoundRobinPages})
    for (const auto& [edit, name] : rejected) {
      AttentionOptions o;
      edit(o);
      expect_error([&] { check_context_parallel_options(o, partition); }, ErrorKind::kUnsupported,
                   {name + ": not supported with context parallelism", to_string(partition)});
    }
  AttentionOptions ok;
  ok.sm_scale = 0.1f;
  ok.logits_soft_cap = 30.f;
  EXPECT_NO_THROW(check_context_parallel_options(ok, KVPartition::kRoundRobinPages));
}

TEST(ContextParallelErrors, BadPartitionArguments) {
  CaseSpec spec;
  spec.kv_lens = {20};
  spec.qo_lens = {1};
  const Case c = make_case(spec);
  const KVPartition kC = KVPartition::kContiguous;
  expect_error([&] { partition_pages(c.paged.table, 16, 0, 0, kC); }, ErrorKind::kInvalidArgument,
               {"world_size: 0", ">= 1"});
  expect_error([&] { partition_pages(c.paged.table, 16, 4, 4, kC); }, ErrorKind::kInvalidArgument,
               {"rank: 4", "[0, 4)"});
  expect_error([&] { partition_pages(c.paged.table, 0, 2, 0, kC); }, ErrorKind::kInvalidArgument, {"page_size: 0"});
  expect_error([&] { partition_pages(c.paged.table, 16, 2, 0, static_cast<KVPartition>(7)); },
               ErrorKind::kInvalidArgument, {"partition: KVPartition(7)", "contiguous, round_robin_pages"});
  // The table says 2 pages with 4 tokens in the last: with page_size 2 that last page would be overfull.
  expect_error([&] { partition_pages(c.paged.table, 2, 2, 0, kC); }, ErrorKind::kInvalidArgument,
               {"last_page_len[0]: 4", "[1, 2]"});
  PageTable ragged = c.paged.table;
  ragged.format = KVFormat::kRagged;
  expect_error([&] { partition_pages(ragged, 16, 2, 0, kC); }, ErrorKind::kInvalidArgument, {"host_table: format"});
  const RankStateLayout layout{1, 1, 4, DType::kFloat32};
  float out[4], state[64];
  const Outputs outs{TensorView(out, DType::kFloat32, {1, 1, 4}), {}};
  expect_error([&] { merge_gathered_states(layout, state, 0, outs); }, ErrorKind::kInvalidArgument,
               {"world_size: 0"});
  expect_error([&] { merge_gathered_states(layout, nullptr, 2, outs); }, ErrorKind::kInvalidArgument,
               {"buffer: null"});
}

}  // namespace
}  // namespace attnforge
