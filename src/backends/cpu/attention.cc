// CPU batch attention: one task = (work item, KV head, block of rows). The rows of a task are the query tokens
// of the item times the query heads of the KV head's group, so every K/V row is converted to fp32 once and
// used by all of them. Scores and the online softmax stay in fp32.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attnforge/kernel/state.h"
#include "attnforge/kernel/variant.h"
#include "backends/cpu/convert.h"
#include "backends/cpu/kernels.h"
#include "backends/cpu/thread_pool.h"

namespace attnforge::cpu {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float dot(const float* __restrict a, const float* __restrict b, int32_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int32_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int32_t n) {
#pragma omp simd
  for (int32_t i = 0; i < n; ++i) y[i] += a * x[i];
}

inline void scale_row(float* __restrict y, float a, int32_t n) {
#pragma omp simd
  for (int32_t i = 0; i < n; ++i) y[i] *= a;
}

// Writes a finished row: to the output (applying the head's sink) or to the partial-state buffers.
void write_row(const AttentionParams& p, const WorkItem& it, int32_t tok, int32_t h, float* o_row, float lse_nat) {
  const int32_t qo_start = p.plan->qo_indptr[it.request];
  if (it.partial_row < 0) {
    if (p.variant.sinks) {
      const float sink = p.variant.sinks[h];
      const float mx = std::max(lse_nat, sink);
      const float total = mx + std::log(std::exp(lse_nat - mx) + std::exp(sink - mx));
      scale_row(o_row, std::exp(lse_nat - total), p.head_dim_vo);
      lse_nat = total;
    }
    store_row(p.o, p.o_dtype, (qo_start + tok) * p.o_stride_token + h * p.o_stride_head, p.head_dim_vo, o_row);
    if (p.lse) p.lse[(qo_start + tok) * p.lse_stride_token + h] = lse_nat * kLog2e;
  } else {
    const int64_t row = static_cast<int64_t>(it.partial_row) + (tok - it.qo_begin);
    std::memcpy(p.plan->partial_o + (row * p.num_qo_heads + h) * p.head_dim_vo, o_row, sizeof(float) * p.head_dim_vo);
    p.plan->partial_lse[row * p.num_qo_heads + h] = lse_nat * kLog2e;
  }
}

void attend(const AttentionParams& p, const WorkItem& it, int32_t kv_head, int32_t row0, int32_t row1,
            float* scratch) {
  const KVParams& kv = p.kv;
  const VariantParams& vp = p.variant;
  const int32_t b = it.request;
  const int32_t qo_start = p.plan->qo_indptr[b], qo_len = p.plan->qo_indptr[b + 1] - qo_start;
  const int32_t kv_len = p.plan->kv_len[b];
  const int32_t group = p.num_qo_heads / p.num_kv_heads;
  const int32_t dqk = p.head_dim_qk, dvo = p.head_dim_vo;
  const int32_t rows = row1 - row0;

  float* q = scratch;
  float* acc = q + kMaxRows * kMaxHeadDim;
  float* kb = acc + kMaxRows * kMaxHeadDim;
  float* vb = kb + kKVBlock * kMaxHeadDim;
  float* s = vb + kKVBlock * kMaxHeadDim;
  float* freqs = s + kMaxRows * kKVBlock;
  float m[kMaxRows], l[kMaxRows];
  int32_t lo[kMaxRows], hi[kMaxRows], tok[kMaxRows], head[kMaxRows], qpos[kMaxRows];
  bool active[kMaxRows];

  const bool rope = vp.rope.enabled != 0;
  if (rope)
    for (int32_t i = 0; i < vp.rope.rotary_dim / 2; ++i) freqs[i] = rope_frequency(vp.rope, i);
  const int32_t pos_offset = rope && vp.rope.pos_offset ? vp.rope.pos_offset[b] : 0;
  const float q_scale = vp.sm_scale * kv.k_scale;

  int32_t range_lo = kv_len, range_hi = 0;
  for (int32_t r = 0; r < rows; ++r) {
    const int32_t rr = row0 + r;
    tok[r] = it.qo_begin + rr / group;
    head[r] = kv_head * group + rr % group;
    qpos[r] = query_position(tok[r], qo_len, kv_len);
    float* qr = q + r * dqk;
    load_row(p.q, p.q_dtype, (qo_start + tok[r]) * p.q_stride_token + head[r] * p.q_stride_head, dqk, 1.f, qr);
    if (rope) rope_rotate(vp.rope, freqs, qr, qpos[r] + pos_offset);
    scale_row(qr, q_scale, dqk);
    allowed_kv_range(vp, qpos[r], kv_len, &lo[r], &hi[r]);
    lo[r] = std::max(lo[r], it.kv_begin);
    hi[r] = std::max(lo[r], std::min(hi[r], it.kv_end));
    if (lo[r] < hi[r]) {
      range_lo = std::min(range_lo, lo[r]);
      range_hi = std::max(range_hi, hi[r]);
    }
    m[r] = kNegInf;
    l[r] = 0.f;
    std::fill(acc + r * dvo, acc + (r + 1) * dvo, 0.f);
  }

  const bool transform = vp.soft_cap > 0.f || vp.alibi_slopes != nullptr;
  for (int32_t j0 = range_lo; j0 < range_hi; j0 += kKVBlock) {
    const int32_t n = std::min(kKVBlock, range_hi - j0);
    for (int32_t t = 0; t < n; ++t) {
      load_row(kv.k, kv.dtype, kv_k_offset(kv, b, j0 + t, kv_head), dqk, 1.f, kb + t * dqk);
      if (rope) rope_rotate(vp.rope, freqs, kb + t * dqk, j0 + t + pos_offset);
    }
    bool any = false;
    for (int32_t r = 0; r < rows; ++r) {
      float* sr = s + r * kKVBlock;
      const int32_t t_lo = std::max(lo[r] - j0, 0), t_hi = std::min(hi[r] - j0, n);
      active[r] = t_lo < t_hi;
      if (!active[r]) continue;
      const float* qr = q + r * dqk;
      float block_max = kNegInf;
      for (int32_t t = 0; t < n; ++t) {
        float x = kNegInf;
        if (t >= t_lo && t < t_hi) {
          x = dot(qr, kb + t * dqk, dqk);
          if (transform) x = transform_logit(vp, x, head[r], qpos[r], j0 + t);
          if (vp.custom_mask && !custom_mask_allows(vp, b, tok[r], j0 + t, kv_len)) x = kNegInf;
        }
        sr[t] = x;
        block_max = std::max(block_max, x);
      }
      if (block_max == kNegInf) {
        active[r] = false;
        continue;
      }
      const float m_new = std::max(m[r], block_max);
      const float corr = std::exp(m[r] - m_new);  // 0 when m[r] is -inf
      if (corr != 1.f) {
        l[r] *= corr;
        scale_row(acc + r * dvo, corr, dvo);
      }
      float sum = 0.f;
      for (int32_t t = 0; t < n; ++t) {
        sr[t] = std::exp(sr[t] - m_new);
        sum += sr[t];
      }
      l[r] += sum;
      m[r] = m_new;
      any = true;
    }
    if (!any) continue;
    for (int32_t t = 0; t < n; ++t) load_row(kv.v, kv.dtype, kv_v_offset(kv, b, j0 + t, kv_head), dvo, 1.f, vb + t * dvo);
    for (int32_t r = 0; r < rows; ++r) {
      if (!active[r]) continue;
      const float* sr = s + r * kKVBlock;
      float* ar = acc + r * dvo;
      for (int32_t t = 0; t < n; ++t)
        if (sr[t] != 0.f) axpy(ar, sr[t], vb + t * dvo, dvo);
    }
  }

  for (int32_t r = 0; r < rows; ++r) {
    float* ar = acc + r * dvo;
    scale_row(ar, l[r] > 0.f ? kv.v_scale / l[r] : 0.f, dvo);
    const float lse_nat = l[r] > 0.f ? m[r] + std::log(l[r]) : kNegInf;
    write_row(p, it, tok[r], head[r], ar, lse_nat);
  }
}

// Combines the partial states of one merge item for one head into the output.
void merge_item(const AttentionParams& p, const MergeItem& mi, int32_t h, float* o) {
  const int32_t dvo = p.head_dim_vo;
  const PlanView& plan = *p.plan;
  const int32_t qo_start = plan.qo_indptr[mi.request];
  for (int32_t tok = mi.qo_begin; tok < mi.qo_end; ++tok) {
    std::fill(o, o + dvo, 0.f);
    float lse = kNegInf;
    for (int32_t k = 0; k < mi.num_items; ++k) {
      const int64_t row = static_cast<int64_t>(plan.items[mi.first_item + k].partial_row) + (tok - mi.qo_begin);
      const float lse_k = plan.partial_lse[row * p.num_qo_heads + h];
      float wa, wb;
      lse = merge_weights(lse, lse_k, &wa, &wb);
      const float* part = plan.partial_o + (row * p.num_qo_heads + h) * dvo;
#pragma omp simd
      for (int32_t d = 0; d < dvo; ++d) o[d] = wa * o[d] + wb * part[d];
    }
    if (p.variant.sinks) {
      const float sink2 = p.variant.sinks[h] * kLog2e;
      const float mx = std::max(lse, sink2);
      const float total = mx + std::log2(std::exp2(lse - mx) + std::exp2(sink2 - mx));
      scale_row(o, std::exp2(lse - total), dvo);
      lse = total;
    }
    store_row(p.o, p.o_dtype, (qo_start + tok) * p.o_stride_token + h * p.o_stride_head, dvo, o);
    if (p.lse) p.lse[(qo_start + tok) * p.lse_stride_token + h] = lse;
  }
}

}  // namespace

void attention(const AttentionParams& p) {
  ThreadPool& pool = ThreadPool::instance();
  const int32_t group = p.num_qo_heads / p.num_kv_heads;
  int32_t max_rows = 0;
  const PlanView& plan = *p.plan;
  const int32_t num_items = plan.num_items, num_merges = plan.num_merges;
  for (int32_t i = 0; i < num_items; ++i)
    max_rows = std::max(max_rows, (plan.items[i].qo_end - plan.items[i].qo_begin) * group);
  const int32_t row_blocks = (max_rows + kMaxRows - 1) / kMaxRows;
  const int64_t per_item = static_cast<int64_t>(p.num_kv_heads) * row_blocks;
  pool.parallel_for(num_items * per_item, [&](int64_t task, int32_t worker) {
    const WorkItem& it = plan.items[task / per_item];
    const int32_t kv_head = static_cast<int32_t>((task % per_item) / row_blocks);
    const int32_t rb = static_cast<int32_t>(task % row_blocks);
    const int32_t rows = (it.qo_end - it.qo_begin) * group;
    const int32_t row0 = rb * kMaxRows, row1 = std::min(rows, row0 + kMaxRows);
    if (row0 < row1) attend(p, it, kv_head, row0, row1, pool.scratch(worker));
  });
  if (num_merges > 0) {
    pool.parallel_for(static_cast<int64_t>(num_merges) * p.num_qo_heads, [&](int64_t task, int32_t worker) {
      merge_item(p, plan.merges[task / p.num_qo_heads], static_cast<int32_t>(task % p.num_qo_heads),
                 pool.scratch(worker));
    });
  }
}

}  // namespace attnforge::cpu
