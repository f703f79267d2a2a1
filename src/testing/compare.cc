#include "testing/compare.h"

#include <fmt/format.h>

#include <cmath>

#include "backends/cpu/convert.h"

namespace attnforge::testing {

double rounding_step(DType t) {
  switch (t) {
    case DType::kFloat32: return std::ldexp(1.0, -23);
    case DType::kFloat16: return std::ldexp(1.0, -10);
    case DType::kBFloat16: return std::ldexp(1.0, -7);
    case DType::kFloat8E4M3: return std::ldexp(1.0, -3);
    case DType::kFloat8E5M2: return std::ldexp(1.0, -2);
    default: return 0;
  }
}

Verdict compare_values(const char* what, const std::vector<double>& got, const std::vector<double>& ref,
                       const std::vector<double>& naive, DType out_dtype, int32_t inner_dims[2]) {
  Verdict v;
  double max_ref = 0;
  for (double x : ref)
    if (std::isfinite(x)) max_ref = std::max(max_ref, std::fabs(x));
  auto index_string = [&](size_t i) {
    if (inner_dims[1] > 0)
      return fmt::format("(row {}, head {}, dim {})", i / (inner_dims[0] * inner_dims[1]), (i / inner_dims[1]) % inner_dims[0],
                         i % inner_dims[1]);
    return fmt::format("(row {}, head {})", i / inner_dims[0], i % inner_dims[0]);
  };
  size_t worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(ref[i])) continue;  // row not computed by the reference
    const bool ref_inf = std::isinf(ref[i]);
    if (std::isnan(got[i]) || std::isinf(got[i]) != ref_inf || (ref_inf && got[i] != ref[i])) {
      v.ok = false;
      v.message = fmt::format("{}: element {} is {} where the reference has {} (non-finite values must match exactly)",
                              what, index_string(i), got[i], ref[i]);
      return v;
    }
    if (ref_inf) continue;
    const double e = std::fabs(got[i] - ref[i]);
    if (e > v.max_err) v.max_err = e, worst = i;
    v.naive_err = std::max(v.naive_err, std::fabs(naive[i] - ref[i]));
  }
  // The floor covers outputs the naive computation happens to get exactly right (fp32 outputs): a few fp32
  // rounding steps at the largest magnitude, the noise of a different accumulation order.
  v.tolerance = 2 * v.naive_err + 4 * rounding_step(DType::kFloat32) * std::max(max_ref, 1e-3);
  if (v.max_err > v.tolerance) {
    v.ok = false;
    v.message = fmt::format("{}: max error {:.3g} at {} (got {:.9g}, reference {:.9g}) exceeds the tolerance {:.3g} "
                            "(2 x naive same-precision error {:.3g} + 4 fp32 rounding steps at |ref| max {:.3g}; output {})",
                            what, v.max_err, index_string(worst), got[worst], ref[worst], v.tolerance, v.naive_err,
                            max_ref, to_string(out_dtype));
  } else {
    v.message = fmt::format("{}: max error {:.3g} within {:.3g}", what, v.max_err, v.tolerance);
  }
  return v;
}

Verdict check_case(const Case& c, const std::vector<int64_t>& rows) {
  const Reference ref = reference_f64(c, rows);
  const Reference naive = naive_f32(c, rows);
  const int32_t Hq = c.spec.num_qo_heads, dvo = c.head_dim_vo();
  std::vector<double> out(ref.o.size()), lse(ref.lse.size());
  const float* l = c.lse_view.ptr<const float>();
  for (size_t i = 0; i < out.size(); ++i) out[i] = cpu::load_one(c.out_view.data, c.spec.o_dtype, static_cast<int64_t>(i));
  for (size_t i = 0; i < lse.size(); ++i) lse[i] = l[i];
  int32_t o_dims[2] = {Hq, dvo}, l_dims[2] = {Hq, 0};
  Verdict vo = compare_values("out", out, ref.o, naive.o, c.spec.o_dtype, o_dims);
  if (!vo.ok) return vo;
  Verdict vl = compare_values("lse", lse, ref.lse, naive.lse, DType::kFloat32, l_dims);
  if (!vl.ok) return vl;
  if (!c.guards_intact()) return {false, "out/lse: memory just outside the outputs was written", vo.max_err, vo.tolerance, vo.naive_err};
  vo.message += "; " + vl.message;
  return vo;
}

}  // namespace attnforge::testing
