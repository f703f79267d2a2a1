// The operators other than batch attention, each against a float64 computation written here: merge_state and
// merge_states (and the algebra of attention states), append_paged_kv_cache, apply_rope and
// apply_rope_pos_ids, single_decode and single_prefill; then DLPack conversion and TensorView's queries.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "attnforge/dlpack.h"
#include "backends/cpu/convert.h"
#include "testing/cases.h"

namespace attnforge {
namespace {

using testing::Buffer;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr float kInfF = std::numeric_limits<float>::infinity();

// A contiguous host tensor of any float dtype, with the values it holds decoded to float.
struct HostTensor {
  Buffer buf;
  TensorView view;
  std::vector<float> vals;

  HostTensor(DType dtype, std::initializer_list<int64_t> shape) : view(nullptr, dtype, shape) {
    buf = Buffer::make(dtype, static_cast<size_t>(view.numel()));
    view.data = buf.data();
    vals.assign(static_cast<size_t>(view.numel()), 0.f);
  }
  size_t size() const { return vals.size(); }
  // Stores x at element i; vals[i] becomes what the dtype holds.
  void set(size_t i, float x) {
    cpu::store_row(buf.data(), view.dtype, static_cast<int64_t>(i), 1, &x);
    vals[i] = get(i);
  }
  float get(size_t i) const { return cpu::load_one(buf.data(), view.dtype, static_cast<int64_t>(i)); }
  // Re-reads vals after an operator wrote the tensor.
  HostTensor& refresh() {
    for (size_t i = 0; i < size(); ++i) vals[i] = get(i);
    return *this;
  }
  HostTensor& random(std::mt19937& rng, float lo = -1.f, float hi = 1.f) {
    std::uniform_real_distribution<float> u(lo, hi);
    for (size_t i = 0; i < size(); ++i) set(i, u(rng));
    return *this;
  }
  HostTensor& fill(float x) {
    for (size_t i = 0; i < size(); ++i) set(i, x);
    return *this;
  }
  std::vector<uint8_t> bytes() const {
    const uint8_t* p = static_cast<const uint8_t*>(buf.data());
    return {p, p + buf.bytes()};
  }
};

// ---- attention states ----

// The float64 merge of states (v_k, s_k), s in log2 units; an empty set is (0, -inf).
struct State {
  std::vector<double> v;
  double lse = -kInf;
};
State merge_f64(const std::vector<std::vector<double>>& v, const std::vector<double>& s) {
  State r;
  r.v.assign(v[0].size(), 0.0);
  double m = -kInf;
  for (double x : s) m = std::max(m, x);
  if (m == -kInf) return r;
  double den = 0;
  for (size_t k = 0; k < s.size(); ++k) den += std::exp2(s[k] - m);
  for (size_t k = 0; k < s.size(); ++k)
    for (size_t d = 0; d < r.v.size(); ++d) r.v[d] += std::exp2(s[k] - m) / den * v[k][d];
  r.lse = m + std::log2(den);
  return r;
}

// Compares merged outputs out [n, heads, dim] and lse [n, heads] with ref(i, h); "" when they agree: -inf lse
// exactly, values within v_tol, lse within lse_tol.
template <typename Ref>
std::string state_mismatch(const HostTensor& out, const HostTensor& lse, int64_t n, int32_t heads, int32_t dim,
                           double v_tol, double lse_tol, Ref&& ref) {
  for (int64_t i = 0; i < n; ++i)
    for (int32_t h = 0; h < heads; ++h) {
      const State r = ref(i, h);
      const double got_lse = lse.get(static_cast<size_t>(i * heads + h));
      if (std::isinf(r.lse) ? got_lse != r.lse : !(std::fabs(got_lse - r.lse) <= lse_tol))
        return fmt::format("lse (row {}, head {}): got {}, expected {}", i, h, got_lse, r.lse);
      for (int32_t d = 0; d < dim; ++d) {
        const double got = out.get(static_cast<size_t>((i * heads + h) * dim + d));
        if (!(std::fabs(got - r.v[d]) <= v_tol))
          return fmt::format("out (row {}, head {}, dim {}): got {}, expected {}", i, h, d, got, r.v[d]);
      }
    }
  return "";
}

// One state [n, heads, dim] with log2 LSE [n, heads], random, in values of `dtype`.
struct StateTensors {
  HostTensor v, s;
  StateTensors(DType dtype, int64_t n, int32_t heads, int32_t dim, std::mt19937& rng)
      : v(dtype, {n, heads, dim}), s(DType::kFloat32, {n, heads}) {
    v.random(rng);
    s.random(rng, -10.f, 10.f);
  }
  std::vector<double> row(int64_t i, int32_t h) const {
    const size_t dim = static_cast<size_t>(v.view.shape[2]), at = static_cast<size_t>(i * v.view.shape[1] + h) * dim;
    return {v.vals.begin() + at, v.vals.begin() + at + dim};
  }
  double lse(int64_t i, int32_t h) const { return s.vals[static_cast<size_t>(i * s.view.shape[1] + h)]; }
};

constexpr int64_t kN = 8;
constexpr int32_t kHeads = 3, kDim = 16;

TEST(MergeState, TwoStatesAgainstFloat64) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    std::mt19937 rng(11);
    StateTensors a(dtype, kN, kHeads, kDim, rng), b(dtype, kN, kHeads, kDim, rng);
    for (int32_t h = 0; h < kHeads; ++h) {
      a.s.set(0 * kHeads + h, -kInfF);  // row 0: a is empty
      b.s.set(1 * kHeads + h, -kInfF);  // row 1: b is empty
      a.s.set(2 * kHeads + h, -kInfF);  // row 2: both are empty
      b.s.set(2 * kHeads + h, -kInfF);
      b.s.set(3 * kHeads + h, a.lse(3, h));  // row 3: equal lse, weights 1/2
    }
    HostTensor out(dtype, {kN, kHeads, kDim}), lse(DType::kFloat32, {kN, kHeads});
    out.fill(NAN);
    lse.fill(NAN);
    merge_state(a.v.view, a.s.view, b.v.view, b.s.view, {out.view, lse.view});
    // fp32: a few roundings of values <= 1; bf16: one output rounding (2^-8 relative) dominates.
    const double v_tol = dtype == DType::kFloat32 ? 1e-6 : 4e-3;
    EXPECT_EQ(state_mismatch(out, lse, kN, kHeads, kDim, v_tol, 1e-5,
                             [&](int64_t i, int32_t h) {
                               return merge_f64({a.row(i, h), b.row(i, h)}, {a.lse(i, h), b.lse(i, h)});
                             }),
              "")
        << to_string(dtype);
    // Equal lse: the merged lse is one more (log2 of two equal weights).
    EXPECT_NEAR(lse.get(3 * kHeads), a.lse(3, 0) + 1.0, 1e-5);
  }
}

TEST(MergeStates, OneTwoAndFiveStatesAgainstFloat64) {
  for (int32_t states : {1, 2, 5}) {
    std::mt19937 rng(100 + states);
    HostTensor v(DType::kFloat32, {kN, states, kHeads, kDim}), s(DType::kFloat32, {kN, states, kHeads});
    v.random(rng);
    s.random(rng, -10.f, 10.f);
    for (int32_t k = 0; k < states; ++k)
      for (int32_t h = 0; h < kHeads; ++h) {
        s.set((0 * states + k) * kHeads + h, -kInfF);                  // row 0: every state empty
        if (k > 0) s.set((1 * states + k) * kHeads + h, -kInfF);       // row 1: only state 0
        if (k == states - 1) s.set((2 * states + k) * kHeads + h, 30.f);  // row 2: one state dominates
      }
    HostTensor out(DType::kFloat32, {kN, kHeads, kDim}), lse(DType::kFloat32, {kN, kHeads});
    out.fill(NAN);
    lse.fill(NAN);
    merge_states(v.view, s.view, {out.view, lse.view});
    auto ref = [&](int64_t i, int32_t h) {
      std::vector<std::vector<double>> vs;
      std::vector<double> ss;
      for (int32_t k = 0; k < states; ++k) {
        const size_t at = static_cast<size_t>(((i * states + k) * kHeads + h) * kDim);
        vs.emplace_back(v.vals.begin() + at, v.vals.begin() + at + kDim);
        ss.push_back(s.vals[static_cast<size_t>((i * states + k) * kHeads + h)]);
      }
      return merge_f64(vs, ss);
    };
    // One state merges to itself exactly; more states within fp32 rounding.
    const double tol = states == 1 ? 0.0 : 1e-6;
    EXPECT_EQ(state_mismatch(out, lse, kN, kHeads, kDim, tol, states == 1 ? 0.0 : 1e-5, ref), "")
        << states << " states";
  }
}

// merge_state of two states into fresh fp32 outputs.
struct Merged {
  HostTensor v, s;
  Merged(const TensorView& va, const TensorView& sa, const TensorView& vb, const TensorView& sb)
      : v(DType::kFloat32, {va.shape[0], va.shape[1], va.shape[2]}), s(DType::kFloat32, {va.shape[0], va.shape[1]}) {
    merge_state(va, sa, vb, sb, {v.view, s.view});
    v.refresh();
    s.refresh();
  }
  Merged(const StateTensors& a, const StateTensors& b) : Merged(a.v.view, a.s.view, b.v.view, b.s.view) {}
};

TEST(MergeState, EmptyStateIsTheIdentityBitwise) {
  std::mt19937 rng(5);
  StateTensors a(DType::kFloat32, kN, kHeads, kDim, rng), empty(DType::kFloat32, kN, kHeads, kDim, rng);
  empty.s.fill(-kInfF);  // its values stay random: with weight 0 they must not matter
  const Merged left(empty, a), right(a, empty);
  EXPECT_EQ(left.v.bytes(), a.v.bytes()) << "merge(empty, a) changed a's values";
  EXPECT_EQ(left.s.bytes(), a.s.bytes()) << "merge(empty, a) changed a's lse";
  EXPECT_EQ(right.v.bytes(), a.v.bytes()) << "merge(a, empty) changed a's values";
  EXPECT_EQ(right.s.bytes(), a.s.bytes()) << "merge(a, empty) changed a's lse";
}

TEST(MergeState, CommutativeAndAssociative) {
  std::mt19937 rng(9);
  StateTensors a(DType::kFloat32, kN, kHeads, kDim, rng), b(DType::kFloat32, kN, kHeads, kDim, rng),
      c(DType::kFloat32, kN, kHeads, kDim, rng);
  auto as_state = [](const Merged& m) {
    return [&m](int64_t i, int32_t h) {
      State r;
      const size_t at = static_cast<size_t>((i * kHeads + h) * kDim);
      r.v.assign(m.v.vals.begin() + at, m.v.vals.begin() + at + kDim);
      r.lse = m.s.vals[static_cast<size_t>(i * kHeads + h)];
      return r;
    };
  };
  const Merged ab(a, b), ba(b, a);
  EXPECT_EQ(ab.s.bytes(), ba.s.bytes()) << "the merged lse depends on the order";
  EXPECT_EQ(state_mismatch(ab.v, ab.s, kN, kHeads, kDim, 3e-7, 0.0, as_state(ba)), "") << "merge(a, b) vs merge(b, a)";

  const Merged bc(b, c);
  const Merged ab_c(ab.v.view, ab.s.view, c.v.view, c.s.view), a_bc(a.v.view, a.s.view, bc.v.view, bc.s.view);
  // About 8 fp32 ulps of values <= 1 and of lse <= 11.
  EXPECT_EQ(state_mismatch(ab_c.v, ab_c.s, kN, kHeads, kDim, 1e-6, 8e-6, as_state(a_bc)), "")
      << "merge(merge(a, b), c) vs merge(a, merge(b, c))";
}

// ---- single-request attention ----

// The float64 attention of one request: q [qo][Hq][D], k and v [kv][Hk][D] (NHD order), bottom-right causal.
// Returns out [qo][Hq][D] followed by lse [qo][Hq] (log2).
std::vector<double> attention_f64(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                                  int32_t qo, int32_t kv, int32_t hq, int32_t hk, int32_t dim, bool causal, double scale) {
  std::vector<double> r(static_cast<size_t>(qo) * hq * (dim + 1), 0.0);
  double* lse = r.data() + static_cast<size_t>(qo) * hq * dim;
  for (int32_t i = 0; i < qo; ++i)
    for (int32_t h = 0; h < hq; ++h) {
      const int32_t kh = h / (hq / hk), visible = causal ? kv - qo + i + 1 : kv;
      std::vector<double> logit(static_cast<size_t>(std::max(visible, 0)));
      double m = -kInf;
      for (int32_t j = 0; j < visible; ++j) {
        double dot = 0;
        for (int32_t d = 0; d < dim; ++d)
          dot += double(q[(static_cast<size_t>(i) * hq + h) * dim + d]) * k[(static_cast<size_t>(j) * hk + kh) * dim + d];
        logit[j] = scale * dot;
        m = std::max(m, logit[j]);
      }
      double den = 0;
      double* o = r.data() + (static_cast<size_t>(i) * hq + h) * dim;
      for (int32_t j = 0; j < visible; ++j) {
        const double p = std::exp(logit[j] - m);
        den += p;
        for (int32_t d = 0; d < dim; ++d) o[d] += p * v[(static_cast<size_t>(j) * hk + kh) * dim + d];
      }
      for (int32_t d = 0; d < dim && den > 0; ++d) o[d] /= den;
      lse[static_cast<size_t>(i) * hq + h] = den > 0 ? (m + std::log(den)) / std::log(2.0) : -kInf;
    }
  return r;
}

// "" when out and lse (fp32) match the float64 result of attention_f64 within tol.
std::string attention_mismatch(const HostTensor& out, const HostTensor& lse, const std::vector<double>& ref, double tol) {
  for (size_t i = 0; i < out.size(); ++i)
    if (!(std::fabs(out.vals[i] - ref[i]) <= tol)) return fmt::format("out[{}]: got {}, expected {}", i, out.vals[i], ref[i]);
  for (size_t i = 0; i < lse.size(); ++i)
    if (!(std::fabs(lse.vals[i] - ref[out.size() + i]) <= tol))
      return fmt::format("lse[{}]: got {}, expected {}", i, lse.vals[i], ref[out.size() + i]);
  return "";
}

// K or V [kv, heads, dim] stored in `layout` (HND: [heads, kv, dim]) with the same logical values.
HostTensor in_layout(const HostTensor& nhd, KVLayout layout) {
  const int64_t kv = nhd.view.shape[0], heads = nhd.view.shape[1], dim = nhd.view.shape[2];
  HostTensor t = layout == KVLayout::kNHD ? HostTensor(DType::kFloat32, {kv, heads, dim})
                                          : HostTensor(DType::kFloat32, {heads, kv, dim});
  for (int64_t j = 0; j < kv; ++j)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < dim; ++d)
        t.set(static_cast<size_t>(layout == KVLayout::kNHD ? (j * heads + h) * dim + d : (h * kv + j) * dim + d),
              nhd.vals[static_cast<size_t>((j * heads + h) * dim + d)]);
  return t;
}

// Random float32 inputs of one request: q [qo, hq, d] in [-2, 2], k and v [kv, hk, d] (NHD) in [-1, 1].
struct SingleInputs {
  HostTensor q, k, v;
  SingleInputs(int64_t qo, int64_t kv, int64_t hq, int64_t hk, int64_t d, uint32_t seed)
      : q(DType::kFloat32, {qo, hq, d}), k(DType::kFloat32, {kv, hk, d}), v(DType::kFloat32, {kv, hk, d}) {
    std::mt19937 rng(seed);
    q.random(rng, -2.f, 2.f);
    k.random(rng);
    v.random(rng);
  }
};

// For both NHD and HND, and for each option set: a float32 single_prefill (or single_decode, when `decode`)
// against attention_f64.
TEST(SingleAttention, DecodeAndPrefillAgainstFloat64) {
  constexpr int32_t kQo = 6, kKv = 37, kHq = 4, kHk = 2, kD = 32;
  const SingleInputs in(kQo, kKv, kHq, kHk, kD, 3);
  const HostTensor &q = in.q, &k = in.k, &v = in.v;
  struct Variant {
    bool decode, causal;
    float sm_scale;
  };
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
    for (const Variant& var : {Variant{true, false, 0.f}, Variant{true, false, 0.3f}, Variant{false, false, 0.f},
                               Variant{false, true, 0.f}, Variant{false, true, 0.7f}}) {
      const HostTensor ks = in_layout(k, layout), vs = in_layout(v, layout);
      const int32_t qo = var.decode ? 1 : kQo;
      HostTensor out(DType::kFloat32, {qo, kHq, kD}), lse(DType::kFloat32, {qo, kHq});
      AttentionOptions opt;
      opt.causal = var.causal;
      opt.sm_scale = var.sm_scale;
      if (var.decode) {
        // The last query row as a [heads, dim] decode query.
        TensorView q2(q.view.ptr<float>() + (kQo - 1) * kHq * kD, DType::kFloat32, {kHq, kD});
        single_decode(q2, ks.view, vs.view, layout,
                      {TensorView(out.view.data, DType::kFloat32, {kHq, kD}), TensorView(lse.view.data, DType::kFloat32, {kHq})},
                      opt);
      } else {
        single_prefill(q.view, ks.view, vs.view, layout, {out.view, lse.view}, opt);
      }
      out.refresh();
      lse.refresh();
      const std::vector<float> q_rows(q.vals.begin() + (kQo - qo) * kHq * kD, q.vals.end());
      const double scale = var.sm_scale > 0 ? var.sm_scale : 1.0 / std::sqrt(double(kD));
      const std::vector<double> ref = attention_f64(q_rows, k.vals, v.vals, qo, kKv, kHq, kHk, kD, var.causal, scale);
      EXPECT_EQ(attention_mismatch(out, lse, ref, 2e-5), "")
          << to_string(layout) << (var.decode ? " decode" : " prefill") << (var.causal ? " causal" : "")
          << " sm_scale " << var.sm_scale;
    }
}

TEST(SingleAttention, SplitKvMergedEqualsWholeKv) {
  // The state of attention over KV [0, kv) is the merge of the states over [0, split) and [split, kv).
  constexpr int32_t kQo = 5, kKv = 50, kHq = 4, kHk = 2, kD = 32;
  const SingleInputs in(kQo, kKv, kHq, kHk, kD, 4);
  const HostTensor &q = in.q, &k = in.k, &v = in.v;
  HostTensor out(DType::kFloat32, {kQo, kHq, kD}), lse(DType::kFloat32, {kQo, kHq});
  single_prefill(q.view, k.view, v.view, KVLayout::kNHD, {out.view, lse.view});
  for (int64_t split : {17, 25, 49}) {
    HostTensor o1(DType::kFloat32, {kQo, kHq, kD}), l1(DType::kFloat32, {kQo, kHq});
    HostTensor o2(DType::kFloat32, {kQo, kHq, kD}), l2(DType::kFloat32, {kQo, kHq});
    auto rows = [&](const HostTensor& t, int64_t from, int64_t to) {
      return TensorView(t.view.ptr<float>() + from * kHk * kD, DType::kFloat32, {to - from, kHk, kD});
    };
    single_prefill(q.view, rows(k, 0, split), rows(v, 0, split), KVLayout::kNHD, {o1.view, l1.view});
    single_prefill(q.view, rows(k, split, kKv), rows(v, split, kKv), KVLayout::kNHD, {o2.view, l2.view});
    const Merged merged(o1.view, l1.view, o2.view, l2.view);
    // Tens of fp32 ulps at the magnitudes here (values <= 1, lse < 8); a wrong weight is off by far more.
    for (size_t i = 0; i < out.size(); ++i)
      ASSERT_NEAR(merged.v.get(i), out.get(i), 5e-6) << "split at " << split << ", out element " << i;
    for (size_t i = 0; i < lse.size(); ++i)
      ASSERT_NEAR(merged.s.get(i), lse.get(i), 5e-6) << "split at " << split << ", lse element " << i;
  }
}

// ---- fp8 decoding ----

// The vector decoder (16 codes by bit arithmetic) gives the table's value for every code of both formats,
// subnormals, infinities and NaN included, and load_row's vector body and scalar tail agree.
TEST(Fp8Decode, VectorBitArithmeticMatchesTheTablesForEveryCode) {
  for (DType t : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    const float* table = t == DType::kFloat8E4M3 ? cpu::e4m3_table() : cpu::e5m2_table();
    std::vector<uint8_t> codes(256 + 7);
    for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i * 37 % 256);  // tail of 7 too
    std::vector<float> out(codes.size());
    cpu::load_row(codes.data(), t, 0, static_cast<int32_t>(codes.size()), 0.5f, out.data());
    for (size_t i = 0; i < codes.size(); ++i) {
      const float want = 0.5f * table[codes[i]];
      if (std::isnan(want))
        EXPECT_TRUE(std::isnan(out[i])) << to_string(t) << " code " << int(codes[i]);
      else
        EXPECT_EQ(want, out[i]) << to_string(t) << " code " << int(codes[i]);
    }
  }
}

// ---- append_paged_kv_cache ----

// float value of an e4m3fn code, from the format's definition (sign, 4 exponent bits with bias 7, 3 mantissa
// bits; exponent 0 is subnormal; S.1111.111 is NaN).
double e4m3_value(uint8_t code) {
  const int e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return NAN;
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return code & 0x80 ? -mag : mag;
}
double bf16_value(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Whether the element stored at p (of dtype t) is a representable value nearest to x: no other finite code
// of the format (e4m3: all of them; bf16: the codes next to it and its negation) is closer.
bool stored_nearest(DType t, const uint8_t* p, double x) {
  if (t == DType::kFloat8E4M3) {
    const double err = std::fabs(e4m3_value(*p) - x);
    for (int c = 0; c < 256; ++c)
      if (std::fabs(e4m3_value(static_cast<uint8_t>(c)) - x) < err) return false;
    return !std::isnan(err);
  }
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  const double err = std::fabs(bf16_value(bits) - x);
  for (uint16_t c : {uint16_t(bits - 1), uint16_t(bits + 1), uint16_t(bits ^ 0x8000)})
    if (std::isfinite(bf16_value(c)) && std::fabs(bf16_value(c) - x) < err) return false;
  return !std::isnan(err);
}

TEST(AppendPagedKvCache, EveryLayoutFormatPageSizeAndDtype) {
  constexpr uint8_t kSentinel = 0x5a;
  constexpr int32_t kHk = 2, kDqk = 32, kDvo = 16;
  // (request, position) of the appended rows; kv_lens {20, 0, 35} already count them.
  const std::vector<int32_t> batch_indices = {0, 0, 2, 2, 2}, positions = {0, 19, 0, 16, 34};
  const int64_t nnz = static_cast<int64_t>(positions.size());
  int configs = 0;
  for (KVFormat format : {KVFormat::kPagedCSR, KVFormat::kBlockTable})
    for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
      for (int32_t page_size : {1, 16})
        for (DType dtype : {DType::kBFloat16, DType::kFloat8E4M3}) {
          testing::CaseSpec s;
          s.format = format;
          s.layout = layout;
          s.page_size = page_size;
          s.kv_dtype = dtype;
          s.qo_lens = {1, 1, 1};
          s.kv_lens = {20, 0, 35};
          s.num_qo_heads = 4;
          s.num_kv_heads = kHk;
          s.head_dim_qk = kDqk;
          s.head_dim_vo = kDvo;
          const float scale = dtype == DType::kFloat8E4M3 ? 0.5f : 1.f;  // fp8 stores round(x / scale)
          s.k_scale = s.v_scale = scale;
          testing::Case c = testing::make_case(s);
          std::memset(c.kv.data(), kSentinel, c.kv.bytes());
          std::mt19937 rng(configs);
          HostTensor k(DType::kFloat32, {nnz, kHk, kDqk}), v(DType::kFloat32, {nnz, kHk, kDvo});
          k.random(rng, -1.5f, 1.5f);
          v.random(rng, -1.5f, 1.5f);
          append_paged_kv_cache(k.view, v.view, TensorView(const_cast<int32_t*>(batch_indices.data()), DType::kInt32, {nnz}),
                                TensorView(const_cast<int32_t*>(positions.data()), DType::kInt32, {nnz}), c.paged);

          // Where each appended element must be, from the page table: element index into c.kv -> value.
          const PageTable& t = c.paged.table;
          auto page_of = [&](int32_t b, int32_t pos) {
            return format == KVFormat::kPagedCSR
                       ? t.indices.ptr<int32_t>()[t.indptr.ptr<int32_t>()[b] + pos / page_size]
                       : t.block_table.ptr<int32_t>()[b * t.block_table.strides[0] + pos / page_size];
          };
          const int32_t tok_axis = layout == KVLayout::kNHD ? 1 : 2, head_axis = layout == KVLayout::kNHD ? 2 : 1;
          const int64_t elem = dtype_bytes(dtype);
          std::vector<double> expected(c.kv.count, NAN);
          std::vector<char> written(c.kv.count, 0);
          for (auto [view, src, dim] : {std::tuple{&c.paged.k, &k, kDqk}, std::tuple{&c.paged.v, &v, kDvo}}) {
            const int64_t base = (static_cast<uint8_t*>(view->data) - static_cast<uint8_t*>(c.kv.data())) / elem;
            for (int64_t r = 0; r < nnz; ++r)
              for (int32_t h = 0; h < kHk; ++h)
                for (int32_t d = 0; d < dim; ++d) {
                  const int64_t at = base + page_of(batch_indices[r], positions[r]) * view->strides[0] +
                                     (positions[r] % page_size) * view->strides[tok_axis] + h * view->strides[head_axis] + d;
                  written[at] = 1;
                  expected[at] = double(src->vals[static_cast<size_t>((r * kHk + h) * dim + d)]) / scale;
                }
          }
          const uint8_t* bytes = static_cast<const uint8_t*>(c.kv.data());
          const std::string config = fmt::format("{} {} page {} {}", to_string(format), to_string(layout), page_size,
                                                 to_string(dtype));
          for (size_t i = 0; i < c.kv.count; ++i) {
            const uint8_t* p = bytes + i * elem;
            if (written[i]) {
              ASSERT_TRUE(stored_nearest(dtype, p, expected[i]))
                  << config << ": element " << i << " holds " << cpu::load_one(bytes, dtype, static_cast<int64_t>(i))
                  << ", not the nearest value to " << expected[i];
            } else {
              ASSERT_TRUE(std::all_of(p, p + elem, [](uint8_t x) { return x == kSentinel; }))
                  << config << ": element " << i << " was not appended to, but changed";
            }
          }
          ++configs;
        }
  EXPECT_EQ(configs, 16);
}

// ---- RoPE ----

struct RopeVariant {
  const char* name;
  RopeOptions rope;
};

std::vector<RopeVariant> rope_variants() {
  std::vector<RopeVariant> r;
  RopeOptions o;
  r.push_back({"halves", o});
  o.interleave = true;
  r.push_back({"interleave", o});
  o.rotary_dim = 16;  // of 32: dims 16..31 pass through
  r.push_back({"interleave rotary_dim 16", o});
  o.interleave = false;
  r.push_back({"halves rotary_dim 16", o});
  o = RopeOptions{};
  o.scale = 2.f;
  o.theta = 5e5f;
  r.push_back({"theta 5e5, scale 2", o});
  // Llama 3.1 scaling with an old context of 64, so that the pairs of a 32-dim head reach every branch (see
  // rope_frequency_f64).
  o = RopeOptions{};
  o.llama31_factor = 8.f;
  o.llama31_low_freq_factor = 1.f;
  o.llama31_high_freq_factor = 4.f;
  o.llama31_old_context_len = 64.f;
  r.push_back({"llama 3.1", o});
  return r;
}

// Frequency of rotary pair p. Llama 3.1: wavelengths 2 pi / f above old_context_len / low (64) are slowed by
// the factor, those below old_context_len / high (16) are kept, and those between are interpolated. With
// theta 1e4 and rotary_dim 32, f_p = 1e4^(-p/16), so pair 0 (wavelength 6.3) is kept, pairs 2..4 (19.9 to
// 62.8) are interpolated and pairs 5.. (111.7 and up) are divided by 8.
double rope_frequency_f64(const RopeOptions& o, int32_t rotary_dim, int32_t p) {
  const double f = std::pow(double(o.theta), -2.0 * p / rotary_dim);
  if (o.llama31_factor <= 0) return f;
  const double wavelen = 2 * std::numbers::pi / f;
  if (wavelen < o.llama31_old_context_len / o.llama31_high_freq_factor) return f;
  if (wavelen > o.llama31_old_context_len / o.llama31_low_freq_factor) return f / o.llama31_factor;
  const double smooth = (o.llama31_old_context_len / wavelen - o.llama31_low_freq_factor) /
                        (o.llama31_high_freq_factor - o.llama31_low_freq_factor);
  return smooth * f + (1 - smooth) * f / o.llama31_factor;
}

// x (one head) rotated to position pos, in float64.
std::vector<double> rope_f64(const float* x, int32_t dim, const RopeOptions& o, int64_t pos) {
  std::vector<double> y(x, x + dim);
  const int32_t rd = o.rotary_dim ? o.rotary_dim : dim, half = rd / 2;
  for (int32_t p = 0; p < half; ++p) {
    const int32_t i = o.interleave ? 2 * p : p, j = o.interleave ? 2 * p + 1 : p + half;
    const double angle = double(pos) / o.scale * rope_frequency_f64(o, rd, p);
    y[i] = x[i] * std::cos(angle) - x[j] * std::sin(angle);
    y[j] = x[j] * std::cos(angle) + x[i] * std::sin(angle);
  }
  return y;
}

// "" when rotated (rows x heads x dim, values of `out`) matches rope_f64 of `in` at positions pos[row]
// within tol, with the unrotated tail bit-identical.
std::string rope_mismatch(const HostTensor& in, const HostTensor& out, const std::vector<int32_t>& pos,
                          const RopeOptions& o, double tol) {
  const int32_t heads = static_cast<int32_t>(in.view.shape[1]), dim = static_cast<int32_t>(in.view.shape[2]);
  const int32_t rd = o.rotary_dim ? o.rotary_dim : dim;
  for (size_t r = 0; r < pos.size(); ++r)
    for (int32_t h = 0; h < heads; ++h) {
      const size_t at = (r * heads + h) * dim;
      const std::vector<double> ref = rope_f64(&in.vals[at], dim, o, pos[r]);
      for (int32_t d = 0; d < dim; ++d) {
        const double got = out.get(at + d);
        if (d < rd ? !(std::fabs(got - ref[d]) <= tol) : got != in.vals[at + d])
          return fmt::format("row {} (position {}), head {}, dim {}: got {}, expected {}", r, pos[r], h, d, got, ref[d]);
      }
    }
  return "";
}

TEST(Rope, ApplyRopeAndPosIdsAgainstFloat64) {
  constexpr int32_t kHq = 3, kHk = 2, kD = 32;
  const std::vector<int32_t> indptr = {0, 3, 3, 7}, offsets = {5, 9, 100};  // request 1 is empty
  const std::vector<int32_t> by_request = {5, 6, 7, 100, 101, 102, 103};      // r - indptr[b] + offsets[b]
  const int64_t nnz = 7;
  std::mt19937 rng(21);
  std::vector<int32_t> pos_ids(nnz);
  for (int32_t& p : pos_ids) p = std::uniform_int_distribution<int32_t>(0, 200)(rng);

  for (DType dtype : {DType::kFloat32, DType::kBFloat16})
    for (const RopeVariant& var : rope_variants())
      for (bool in_place : {false, true})
        for (bool explicit_pos : {false, true}) {
          HostTensor q(dtype, {nnz, kHq, kD}), k(dtype, {nnz, kHk, kD});
          q.random(rng);
          k.random(rng);
          const HostTensor q_in = q, k_in = k;  // shares the storage, but vals keeps the values before the call
          HostTensor q_out(dtype, {nnz, kHq, kD}), k_out(dtype, {nnz, kHk, kD});
          const TensorView& qo = in_place ? q.view : q_out.view;
          const TensorView& ko = in_place ? k.view : k_out.view;
          if (explicit_pos)
            apply_rope_pos_ids(q.view, k.view, qo, ko, TensorView(pos_ids.data(), DType::kInt32, {nnz}), var.rope);
          else
            apply_rope(q.view, k.view, qo, ko, TensorView(const_cast<int32_t*>(indptr.data()), DType::kInt32, {4}),
                       TensorView(const_cast<int32_t*>(offsets.data()), DType::kInt32, {3}), var.rope);
          // fp32: angles up to 200 rad, computed in float, carry a few 1e-5 of rounding; bf16 adds one output
          // rounding (2^-8 at |x| < 2).
          const double tol = dtype == DType::kFloat32 ? 2e-4 : 6e-3;
          const std::string what = fmt::format("{} {} {} {}", to_string(dtype), var.name, in_place ? "in place" : "out of place",
                                               explicit_pos ? "pos_ids" : "indptr/offsets");
          const std::vector<int32_t>& pos = explicit_pos ? pos_ids : by_request;
          EXPECT_EQ(rope_mismatch(q_in, in_place ? q : q_out, pos, var.rope, tol), "") << "q, " << what;
          EXPECT_EQ(rope_mismatch(k_in, in_place ? k : k_out, pos, var.rope, tol), "") << "k, " << what;
          if (!in_place) {
            for (size_t i = 0; i < q.size(); ++i) ASSERT_EQ(q.get(i), q_in.vals[i]) << "q input changed, " << what;
            for (size_t i = 0; i < k.size(); ++i) ASSERT_EQ(k.get(i), k_in.vals[i]) << "k input changed, " << what;
          }
        }
}

// ---- DLPack and TensorView ----

TEST(DLPack, RoundTripPreservesEverything) {
  alignas(64) static uint8_t storage[4096];
  for (size_t i = 0; i < sizeof(storage); ++i) storage[i] = static_cast<uint8_t>(i * 7);
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3, DType::kFloat8E5M2,
                      DType::kInt32, DType::kInt64, DType::kUInt8})
    for (Device device : {Device::cpu(), Device::cuda(1)}) {
      TensorView t(storage + 64, dtype, {3, 4, 5}, {40, 10, 2}, device);
      const DLTensor d = to_dlpack(t);
      EXPECT_EQ(d.dtype.bits, 8 * dtype_bytes(dtype));
      EXPECT_EQ(d.dtype.lanes, 1);
      const TensorView back = from_dlpack(d, "t");
      const std::string what = to_string(dtype) + " on " + to_string(device);
      EXPECT_EQ(back.data, t.data) << what;
      EXPECT_EQ(back.dtype, dtype) << what;
      EXPECT_EQ(back.device, device) << what;
      ASSERT_EQ(back.ndim, 3) << what;
      for (int i = 0; i < 3; ++i) {
        EXPECT_EQ(back.shape[i], t.shape[i]) << what << ", dimension " << i;
        EXPECT_EQ(back.strides[i], t.strides[i]) << what << ", dimension " << i;
      }
      // The last element read through both views is the same memory.
      const int64_t last = 2 * 40 + 3 * 10 + 4 * 2;
      EXPECT_EQ(std::memcmp(static_cast<uint8_t*>(back.data) + last * dtype_bytes(dtype),
                            storage + 64 + last * dtype_bytes(dtype), dtype_bytes(dtype)),
                0)
          << what;
    }
}

TEST(DLPack, ByteOffsetAndImplicitStrides) {
  alignas(64) static float storage[64];
  int64_t shape[2] = {3, 5};
  DLTensor d{};
  d.data = storage;
  d.device = {kDLCUDAHost, 0};  // pinned host memory is host memory
  d.ndim = 2;
  d.dtype = {kDLFloat, 32, 1};
  d.shape = shape;
  d.strides = nullptr;  // compact row-major
  d.byte_offset = 8;
  const TensorView t = from_dlpack(d, "pinned");
  EXPECT_EQ(t.data, static_cast<void*>(storage + 2));
  EXPECT_EQ(t.device, Device::cpu());
  EXPECT_EQ(t.strides[0], 5);
  EXPECT_EQ(t.strides[1], 1);
  EXPECT_TRUE(t.is_contiguous());
}

TEST(TensorViewTest, NumelAndIsContiguous) {
  const TensorView empty;
  EXPECT_FALSE(empty.defined());
  EXPECT_EQ(empty.numel(), 0);
  const TensorView dense(nullptr, DType::kFloat32, {3, 4, 5});
  EXPECT_EQ(dense.numel(), 60);
  EXPECT_TRUE(dense.is_contiguous());
  EXPECT_EQ(dense.strides[0], 20);
  const TensorView strided(nullptr, DType::kFloat32, {3, 4, 5}, {40, 10, 2});
  EXPECT_EQ(strided.numel(), 60);
  EXPECT_FALSE(strided.is_contiguous());
  const TensorView padded_rows(nullptr, DType::kFloat32, {3, 4, 5}, {24, 6, 1});
  EXPECT_FALSE(padded_rows.is_contiguous());
  const TensorView transposed(nullptr, DType::kFloat32, {4, 3}, {1, 4});
  EXPECT_FALSE(transposed.is_contiguous());
  // The stride of a size-1 dimension never moves the address, so it does not matter.
  const TensorView unit_dim(nullptr, DType::kFloat32, {3, 1, 5}, {5, 999, 1});
  EXPECT_TRUE(unit_dim.is_contiguous());
  const TensorView zero(nullptr, DType::kFloat32, {3, 0, 5});
  EXPECT_EQ(zero.numel(), 0);
  EXPECT_EQ(TensorView(nullptr, DType::kInt32, {7}).numel(), 7);
}

}  // namespace
}  // namespace attnforge
