// The CPU loop of a custom variant, compiled at run time by the host compiler together with the variant's source
// (src/jit/variant.cc): one shared object per variant, cached like the GPU kernels. Plain fp32 loops over the
// plan's work items, one query row at a time: its purpose is to run any variant exactly, without a GPU, not speed.
// Rows are converted by the library's own converters (HostServices), so every element type the CPU backend reads
// is read here the same way.
#pragma once

#include <math.h>

#include <vector>

#include "attnforge/kernel/params.h"
#include "attnforge/kernel/state.h"
#include "attnforge/kernel/variant_hooks.h"

namespace attnforge::cpu {

// Conversions the library lends the compiled variant (backends/cpu/convert.h).
struct HostServices {
  void (*load_row)(const void* base, DType type, int64_t offset, int32_t n, float scale, float* dst);
  void (*store_row)(void* base, DType type, int64_t offset, int32_t n, const float* src, float scale);
};

// Runs every work item of the plan (which has no KV splits: partial states would need the variant's merge).
template <class V>
void variant_attention(const AttentionParams& p, const VariantArgs& a, const HostServices& h) {
  const PlanView& plan = *p.plan;
  const KVParams& kv = p.kv;
  const int32_t group = p.num_qo_heads / p.num_kv_heads;
  const int32_t dqk = p.head_dim_qk, dvo = p.head_dim_vo;
  const float scale = p.variant.sm_scale * kv.k_scale;
  std::vector<float> q(dqk), k(dqk), v(dvo), o(dvo);
  for (int32_t item = 0; item < plan.num_items; ++item) {
    const WorkItem& it = plan.items[item];
    const int32_t b = it.request;
    const int32_t qo_start = plan.qo_indptr[b];
    const int32_t qo_len = plan.qo_indptr[b + 1] - qo_start;
    const int32_t kv_len = plan.kv_len[b];
    for (int32_t t = it.qo_begin; t < it.qo_end; ++t)
      for (int32_t head = 0; head < p.num_qo_heads; ++head) {
        LogitIndex i{b, t, query_position(t, qo_len, kv_len), 0, kv_len, head, head / group};
        h.load_row(p.q, p.q_dtype, (qo_start + t) * p.q_stride_token + head * p.q_stride_head, dqk, 1.f, q.data());
        V::query_transform(a, i, q.data(), dqk);
        float m = -ATTNFORGE_INFINITY, l = 0.f;
        for (float& x : o) x = 0.f;
        for (int32_t j = it.kv_begin; j < it.kv_end; ++j) {
          i.kv_pos = j;
          if (!V::logits_mask(a, i)) continue;
          h.load_row(kv.k, kv.dtype, kv_k_offset(kv, b, j, i.kv_head), dqk, 1.f, k.data());
          V::key_transform(a, i, k.data(), dqk);
          float s = 0.f;
          for (int32_t d = 0; d < dqk; ++d) s += q[d] * k[d];
          s = V::logits_transform(a, i, s * scale);
          h.load_row(kv.v, kv.dtype, kv_v_offset(kv, b, j, i.kv_head), dvo, kv.v_scale, v.data());
          if constexpr (V::kSoftmax) {
            // Online softmax in natural-log units; m is the running maximum.
            if (s == -ATTNFORGE_INFINITY) continue;
            const float m_new = s > m ? s : m;
            const float corr = m == -ATTNFORGE_INFINITY ? 0.f : expf(m - m_new);
            const float w = expf(s - m_new);
            l = l * corr + w;
            for (int32_t d = 0; d < dvo; ++d) o[d] = o[d] * corr + w * v[d];
            m = m_new;
          } else {
            for (int32_t d = 0; d < dvo; ++d) o[d] += s * v[d];
          }
        }
        float lse = nanf("");  // no LSE without softmax
        if constexpr (V::kSoftmax) {
          if (a.options->sinks) {  // the built-in sink joins the denominator with a zero value
            const float sink = a.options->sinks[head];
            const float m_new = sink > m ? sink : m;
            const float corr = m == -ATTNFORGE_INFINITY ? 0.f : expf(m - m_new);
            l = l * corr + expf(sink - m_new);
            for (float& x : o) x *= corr;
            m = m_new;
          }
          for (float& x : o) x = l > 0.f ? x / l : 0.f;
          lse = l > 0.f ? (m + logf(l)) * kLog2e : -ATTNFORGE_INFINITY;
        }
        V::output_transform(a, i, o.data(), dvo);
        h.store_row(p.o, p.o_dtype, (qo_start + t) * p.o_stride_token + head * p.o_stride_head, dvo, o.data(), 1.f);
        if (p.lse) p.lse[(qo_start + t) * p.lse_stride_token + head] = lse;
      }
  }
}

}  // namespace attnforge::cpu

// Defines the shared object's entry points for variant V (the last line of every generated source).
// Compiled with -fvisibility=hidden: only these two are exported.
#define ATTNFORGE_VARIANT_ENTRY(V)                                                                       \
  extern "C" __attribute__((visibility("default"))) int attnforge_variant_softmax() {                    \
    return V::kSoftmax ? 1 : 0;                                                                          \
  }                                                                                                      \
  extern "C" __attribute__((visibility("default"))) void attnforge_variant_attention(                    \
                                              const attnforge::AttentionParams* p,                       \
                                              const attnforge::VariantArgs* a,                           \
                                              const attnforge::cpu::HostServices* h) {                  \
    attnforge::cpu::variant_attention<V>(*p, *a, *h);                                                    \
  }
