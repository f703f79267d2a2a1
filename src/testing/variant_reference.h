// Custom variants the tests share (CPU in tests/test_variants.cc, CUDA in tests/cuda/test_cuda.cc, NVRTC compile
// checks in tests/test_jit.cc): each struct is compiled into the test ahead of time, for its float64 reference,
// and kept as text for the run-time compilers.
#pragma once

#include <math.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attnforge/kernel/variant.h"
#include "attnforge/kernel/variant_hooks.h"
#include "attnforge/variant.h"
#include "testing/cases.h"

namespace attnforge::testing {

// Defines a variant struct in this test and the same text as a CustomVariant for the run-time compiler.
#define ATTNFORGE_TEST_VARIANT(name, ...) \
  __VA_ARGS__                             \
  inline const CustomVariant name##_variant{#name, #__VA_ARGS__};

ATTNFORGE_TEST_VARIANT(Sigmoid, struct Sigmoid : attnforge::VariantBase {
  static constexpr bool kSoftmax = false;
  static float logits_transform(const attnforge::VariantArgs& a, const attnforge::LogitIndex&, float s) {
    return 1.f / (1.f + expf(-(s + a.scalars[0])));
  }
};)

ATTNFORGE_TEST_VARIANT(HeadBias, struct HeadBias : attnforge::VariantBase {
  static bool logits_mask(const attnforge::VariantArgs&, const attnforge::LogitIndex& i) {
    return i.kv_pos <= i.q_pos;
  }
  static float logits_transform(const attnforge::VariantArgs& a, const attnforge::LogitIndex& i, float s) {
    return s + static_cast<const float*>(a.tensors[0])[i.qo_head];
  }
};)

// Logits land in tensor 0, laid out [batch][max_qo][heads][max_kv] with the sizes in scalars 0..2.
ATTNFORGE_TEST_VARIANT(LogitsOut, struct LogitsOut : attnforge::VariantBase {
  static float logits_transform(const attnforge::VariantArgs& a, const attnforge::LogitIndex& i, float s) {
    const int max_qo = static_cast<int>(a.scalars[0]), heads = static_cast<int>(a.scalars[1]);
    const int max_kv = static_cast<int>(a.scalars[2]);
    float* out = static_cast<float*>(a.tensors[0]);
    out[((static_cast<long>(i.request) * max_qo + i.q_token) * heads + i.qo_head) * max_kv + i.kv_pos] = s;
    return s;
  }
};)

// Query, key and output transforms on fp32 rows: Q scaled by scalar 0, K rows shifted by an amount that depends on
// the key's position and the dim, a causal window of 100 keys as the mask, and each output row normalized to unit
// RMS times a per-head gain from tensor 0 (the transform needs the whole row).
ATTNFORGE_TEST_VARIANT(Shaped, struct Shaped : attnforge::VariantBase {
  static void query_transform(const attnforge::VariantArgs& a, const attnforge::LogitIndex&, float* q, int32_t n) {
    for (int32_t d = 0; d < n; ++d) q[d] *= a.scalars[0];
  }
  static void key_transform(const attnforge::VariantArgs&, const attnforge::LogitIndex& i, float* k, int32_t n) {
    for (int32_t d = 0; d < n; ++d) k[d] += 0.125f * static_cast<float>((i.kv_pos + d) % 5 - 2);
  }
  static bool logits_mask(const attnforge::VariantArgs&, const attnforge::LogitIndex& i) {
    return i.kv_pos <= i.q_pos && i.kv_pos > i.q_pos - 100;
  }
  static void output_transform(const attnforge::VariantArgs& a, const attnforge::LogitIndex& i, float* o, int32_t n) {
    float ss = 0.f;
    for (int32_t d = 0; d < n; ++d) ss += o[d] * o[d];
    const float g = static_cast<const float*>(a.tensors[0])[i.qo_head] / sqrtf(ss / static_cast<float>(n) + 1e-6f);
    for (int32_t d = 0; d < n; ++d) o[d] *= g;
  }
};)

// x rounded to the nearest bfloat16 (ties to even), as a double.
inline double round_to_bf16(double x) {
  float f = static_cast<float>(x);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &u, 4);
  return f;
}

// The float64 reference of a variant V on a case: V's own hooks (query and key transforms on fp32 rows, as the
// kernels run them; key_transform sees the key's fields only, query fields -1), logits and sums in double, then
// output_transform on the fp32 row.
// round_p: the weights that multiply V, and transformed Q and K rows, rounded to bfloat16 (after exp, before
// normalizing), as a tensor-core kernel feeds them to its products: the same-precision naive computation GPU
// tolerances derive from.
template <class V>
std::vector<double> reference(const Case& c, const VariantArgs& args, bool round_p = false) {
  const CaseSpec& s = c.spec;
  const int32_t H = s.num_qo_heads, KVH = s.num_kv_heads, D = s.head_dim_qk, group = H / KVH;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> out(static_cast<size_t>(c.total_qo()) * H * D, 0.0);
  auto rounded = [&](std::vector<float>& x) {
    if (round_p)
      for (float& v : x) v = static_cast<float>(round_to_bf16(v));
  };
  for (int32_t b = 0; b < c.batch; ++b) {
    const int32_t qo_len = s.qo_lens[b], kv_len = s.kv_lens[b], start = c.qo_indptr[b];
    std::vector<float> keys(static_cast<size_t>(kv_len) * KVH * D);  // K rows after key_transform
    for (int32_t j = 0; j < kv_len; ++j)
      for (int32_t kh = 0; kh < KVH; ++kh) {
        std::vector<float> k(c.k_vals[b].begin() + (static_cast<size_t>(j) * KVH + kh) * D,
                             c.k_vals[b].begin() + (static_cast<size_t>(j) * KVH + kh + 1) * D);
        V::key_transform(args, LogitIndex{b, -1, -1, j, kv_len, -1, kh}, k.data(), D);
        rounded(k);
        std::copy(k.begin(), k.end(), keys.begin() + (static_cast<size_t>(j) * KVH + kh) * D);
      }
    for (int32_t t = 0; t < qo_len; ++t)
      for (int32_t h = 0; h < H; ++h) {
        LogitIndex i{b, t, query_position(t, qo_len, kv_len), 0, kv_len, h, h / group};
        const auto q_row = c.q_vals.begin() + ((start + t) * H + h) * D;
        std::vector<float> q(q_row, q_row + D);
        V::query_transform(args, i, q.data(), D);
        rounded(q);
        std::vector<double> w(kv_len, 0.0);
        double m = -INFINITY;
        for (int32_t j = 0; j < kv_len; ++j) {
          i.kv_pos = j;
          if (!V::logits_mask(args, i)) {
            w[j] = NAN;
            continue;
          }
          double dot = 0;
          for (int32_t d = 0; d < D; ++d)
            dot += double(q[d]) * keys[(static_cast<size_t>(j) * KVH + h / group) * D + d];
          w[j] = V::logits_transform(args, i, static_cast<float>(dot * scale));
          if (V::kSoftmax) m = std::max(m, w[j]);
        }
        double sum = 0;
        for (double& x : w) {
          if (std::isnan(x)) {
            x = 0;
          } else if (V::kSoftmax) {
            x = std::exp(x - m);
          }
          sum += x;
        }
        // A softmax over no key leaves the row at zero (the empty state), as the kernels do.
        const double norm = V::kSoftmax ? (sum > 0 ? 1 / sum : 0.0) : 1.0;
        for (int32_t j = 0; j < kv_len; ++j) {
          const double p = round_p ? round_to_bf16(w[j]) : w[j];
          for (int32_t d = 0; d < D; ++d)
            out[((start + t) * H + h) * D + d] += p * norm * c.v_vals[b][(j * KVH + h / group) * D + d];
        }
        double* row = &out[((start + t) * H + h) * D];
        std::vector<float> o(row, row + D);
        V::output_transform(args, i, o.data(), D);
        for (int32_t d = 0; d < D; ++d) row[d] = o[d];
      }
  }
  return out;
}

inline VariantArgs args_for(const VariantInputs& in, const VariantParams& options) {
  VariantArgs a{};
  a.options = &options;
  a.num_scalars = static_cast<int32_t>(in.scalars.size());
  for (size_t i = 0; i < in.scalars.size(); ++i) a.scalars[i] = in.scalars[i];
  a.num_tensors = static_cast<int32_t>(in.tensors.size());
  for (size_t i = 0; i < in.tensors.size(); ++i) a.tensors[i] = in.tensors[i];
  return a;
}

// Worst |out - ref| / (1 + |ref|) over the fp32 output (relative), or worst |out - ref|; NaN or inf on either side
// counts as inf.
inline double worst_error(const Case& c, const std::vector<double>& ref, bool relative = true) {
  const int32_t H = c.spec.num_qo_heads, D = c.spec.head_dim_qk;
  const float* o = static_cast<const float*>(c.out_view.data);
  double worst = 0;
  for (int64_t t = 0; t < c.total_qo(); ++t)
    for (int32_t h = 0; h < H; ++h)
      for (int32_t d = 0; d < D; ++d) {
        const double got = o[t * c.out_view.strides[0] + h * c.out_view.strides[1] + d];
        const double want = ref[(t * H + h) * D + d];
        const bool finite = std::isfinite(got) && std::isfinite(want);
        worst = std::max(worst, finite ? std::abs(got - want) / (relative ? 1 + std::abs(want) : 1.0) : INFINITY);
      }
  return worst;
}

}  // namespace attnforge::testing
