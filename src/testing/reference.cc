#include "testing/reference.h"

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "backends/cpu/convert.h"
#include "testing/parallel.h"

namespace attnforge::testing {

namespace {

// f rounded to what dtype t stores.
float round_to(DType t, float f) {
  uint8_t buf[4];
  cpu::store_row(buf, t, 0, 1, &f);
  return cpu::load_one(buf, t, 0);
}

// RoPE at position pos on x (head_dim values), in Real arithmetic.
template <typename Real>
void rotate(std::vector<Real>& x, const CaseSpec& s, int64_t pos) {
  const int32_t dim = static_cast<int32_t>(x.size());
  const int32_t rd = s.options.rotary_dim ? s.options.rotary_dim : dim;
  const bool llama31 = s.options.rope_llama31;
  const Real theta = llama31 ? Real(5e5) : Real(1e4);
  for (int32_t i = 0; i < rd / 2; ++i) {
    Real freq = std::pow(theta, Real(-2) * i / rd);
    if (llama31) {  // factor 8, low 1, high 4, old context 64 (see make_case)
      const Real wavelen = Real(2 * M_PI) / freq, low_wl = Real(64) / 1, high_wl = Real(64) / 4;
      if (wavelen > low_wl) {
        freq = freq / 8;
      } else if (wavelen >= high_wl) {
        const Real smooth = (Real(64) / wavelen - 1) / (4 - 1);
        freq = (1 - smooth) * freq / 8 + smooth * freq;
      }
    }
    const int32_t a = s.options.rope_interleave ? 2 * i : i;
    const int32_t b = s.options.rope_interleave ? 2 * i + 1 : i + rd / 2;
    const Real ang = static_cast<Real>(pos) * freq;
    const Real c = std::cos(ang), sn = std::sin(ang);
    const Real xa = x[a], xb = x[b];
    x[a] = xa * c - xb * sn;
    x[b] = xb * c + xa * sn;
  }
}

template <typename Real>
Reference compute(const Case& c, const std::vector<int64_t>& rows_wanted, bool round_output) {
  const CaseSpec& s = c.spec;
  const OptionSpec& o = s.options;
  const int32_t Hq = s.num_qo_heads, Hk = s.num_kv_heads, dqk = s.head_dim_qk, dvo = c.head_dim_vo();
  const int32_t group = Hq / Hk;
  const int64_t total = c.total_qo();
  Reference r;
  r.o.assign(static_cast<size_t>(total) * Hq * dvo, std::numeric_limits<double>::quiet_NaN());
  r.lse.assign(static_cast<size_t>(total) * Hq, std::numeric_limits<double>::quiet_NaN());
  std::vector<char> want(static_cast<size_t>(total), rows_wanted.empty() ? 1 : 0);
  for (int64_t t : rows_wanted) want[t] = 1;
  const Real sm_scale = o.sm_scale > 0 ? Real(o.sm_scale) : Real(1) / std::sqrt(Real(dqk));
  const Real kNegInf = -std::numeric_limits<Real>::infinity();

  // (row, head) pairs are independent: each task writes one pair's outputs only, so a single long row (decode of
  // one request of 1M tokens) still spreads over every core.
  std::vector<std::pair<int32_t, int32_t>> rows;  // (request, query index) of every wanted row
  for (int32_t b = 0; b < c.batch; ++b)
    for (int32_t i = 0; i < s.qo_lens[b]; ++i)
      if (want[c.qo_indptr[b] + i]) rows.emplace_back(b, i);
  parallel_for(static_cast<int64_t>(rows.size()) * Hq, [&](int64_t task) {
    const auto [b, i] = rows[static_cast<size_t>(task / Hq)];
    const int32_t h = static_cast<int32_t>(task % Hq);
    const int32_t qo_len = s.qo_lens[b], kv_len = s.kv_lens[b];
    const int64_t offset = o.rope && o.rope_offsets ? c.pos_offset[b] : 0;
    const int64_t row = c.qo_indptr[b] + i;
    const int64_t qpos = kv_len - qo_len + i;
    const int32_t kh = h / group;
    std::vector<Real> q(dqk), k(dqk);
    for (int32_t d = 0; d < dqk; ++d) q[d] = c.q_vals[(row * Hq + h) * dqk + d];
    if (o.rope) rotate(q, s, qpos + offset);
    // Tensor-core kernels hold the rotated rows in the 16-bit operand type; so does the same-precision run.
    const bool round_rotated = o.rope && round_output && s.q_dtype != DType::kFloat32;
    if (round_rotated)
      for (Real& x : q) x = Real(round_to(s.q_dtype, float(x)));
    std::vector<Real> logits(kv_len, kNegInf);
    for (int32_t j = 0; j < kv_len; ++j) {
      bool allowed = true;
      if (o.causal && j > qpos) allowed = false;
      if (o.window_left >= 0 && j < qpos - o.window_left) allowed = false;
      if (o.window_right >= 0 && j > qpos + o.window_right) allowed = false;
      if (o.custom_mask) {
        const int64_t bit = static_cast<int64_t>(i) * kv_len + j;
        if (!((c.mask_bits[c.mask_indptr[b] + bit / 8] >> (bit % 8)) & 1)) allowed = false;
      }
      if (!allowed) continue;
      for (int32_t d = 0; d < dqk; ++d)
        k[d] = Real(c.k_vals[b][(static_cast<size_t>(j) * Hk + kh) * dqk + d]) * Real(s.k_scale);
      if (o.rope) rotate(k, s, j + offset);
      if (round_rotated)
        for (Real& x : k) x = Real(round_to(s.q_dtype, float(x)));
      Real dot = 0;
      for (int32_t d = 0; d < dqk; ++d) dot += q[d] * k[d];
      Real x = sm_scale * dot;
      if (o.soft_cap > 0) x = Real(o.soft_cap) * std::tanh(x / Real(o.soft_cap));
      if (o.alibi) x += Real(c.alibi[h]) * Real(j - qpos);
      logits[j] = x;
    }
    Real m = o.sinks ? Real(c.sinks[h]) : kNegInf;
    for (Real x : logits) m = std::max(m, x);
    double* out = &r.o[(row * Hq + h) * dvo];
    if (m == kNegInf) {  // nothing to attend and no sink: the empty state
      for (int32_t d = 0; d < dvo; ++d) out[d] = 0;
      r.lse[row * Hq + h] = -std::numeric_limits<double>::infinity();
      return;
    }
    Real den = o.sinks ? std::exp(Real(c.sinks[h]) - m) : Real(0);
    std::vector<Real> acc(dvo, 0);
    for (int32_t j = 0; j < kv_len; ++j) {
      if (logits[j] == kNegInf) continue;
      const Real p = std::exp(logits[j] - m);
      den += p;
      // A same-precision computation multiplies V by probabilities held in the 16-bit input type (as
      // tensor-core kernels do); the denominator keeps the unrounded sum.
      const Real pv = round_output && s.q_dtype != DType::kFloat32 ? Real(round_to(s.q_dtype, float(p))) : p;
      for (int32_t d = 0; d < dvo; ++d)
        acc[d] += pv * Real(c.v_vals[b][(static_cast<size_t>(j) * Hk + kh) * dvo + d]) * Real(s.v_scale);
    }
    for (int32_t d = 0; d < dvo; ++d) {
      Real v = acc[d] / den;
      if (round_output) v = Real(round_to(s.o_dtype, static_cast<float>(v)));
      out[d] = static_cast<double>(v);
    }
    const Real lse = (m + std::log(den)) / std::log(Real(2));
    r.lse[row * Hq + h] = static_cast<double>(round_output ? Real(static_cast<float>(lse)) : lse);
  });
  return r;
}

}  // namespace

Reference reference_f64(const Case& c, const std::vector<int64_t>& rows) { return compute<double>(c, rows, false); }
Reference naive_f32(const Case& c, const std::vector<int64_t>& rows) { return compute<float>(c, rows, true); }

void reference_merge(const std::vector<double>& v, const std::vector<double>& s, int64_t n, int32_t states,
                     int32_t heads, int32_t dim, std::vector<double>* v_out, std::vector<double>* s_out) {
  v_out->assign(static_cast<size_t>(n) * heads * dim, 0.0);
  s_out->assign(static_cast<size_t>(n) * heads, -std::numeric_limits<double>::infinity());
  for (int64_t i = 0; i < n; ++i)
    for (int32_t h = 0; h < heads; ++h) {
      double m = -std::numeric_limits<double>::infinity();
      for (int32_t k = 0; k < states; ++k) m = std::max(m, s[(i * states + k) * heads + h]);
      if (m == -std::numeric_limits<double>::infinity()) continue;
      double den = 0;
      for (int32_t k = 0; k < states; ++k) {
        const double w = std::exp2(s[(i * states + k) * heads + h] - m);
        den += w;
        for (int32_t d = 0; d < dim; ++d) (*v_out)[(i * heads + h) * dim + d] += w * v[((i * states + k) * heads + h) * dim + d];
      }
      for (int32_t d = 0; d < dim; ++d) (*v_out)[(i * heads + h) * dim + d] /= den;
      (*s_out)[i * heads + h] = m + std::log2(den);
    }
}

}  // namespace attnforge::testing
