#include "core/shape.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"

namespace attnforge::detail {

AttentionShape normalized(const AttentionShape& s) {
  AttentionShape r = s;
  if (r.head_dim_vo == 0) r.head_dim_vo = r.head_dim_qk;
  return r;
}

namespace {
bool one_of(DType t, std::initializer_list<DType> set) {
  for (DType d : set)
    if (d == t) return true;
  return false;
}
Support no(std::string reason) { return {false, std::move(reason)}; }
}  // namespace

Support check_common(const AttentionConfig& c) {
  const AttentionShape s = normalized(c.shape);
  if (s.num_qo_heads < 1) return no(fmt::format("num_qo_heads: {}; expected >= 1", s.num_qo_heads));
  if (s.num_kv_heads < 1) return no(fmt::format("num_kv_heads: {}; expected >= 1", s.num_kv_heads));
  if (s.num_qo_heads % s.num_kv_heads != 0)
    return no(fmt::format("num_qo_heads {} is not a multiple of num_kv_heads {}; expected num_qo_heads = "
                          "group_size x num_kv_heads",
                          s.num_qo_heads, s.num_kv_heads));
  if (s.head_dim_qk < 8 || s.head_dim_qk % 8 != 0)
    return no(fmt::format("head_dim_qk: {}; expected a positive multiple of 8", s.head_dim_qk));
  if (s.head_dim_vo < 8 || s.head_dim_vo % 8 != 0)
    return no(fmt::format("head_dim_vo: {}; expected a positive multiple of 8", s.head_dim_vo));
  const auto qo_types = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  if (!one_of(s.q_dtype, qo_types))
    return no(fmt::format("q_dtype: {}; expected one of {}", to_string(s.q_dtype), dtype_set_string(qo_types)));
  if (!one_of(s.o_dtype, qo_types))
    return no(fmt::format("o_dtype: {}; expected one of {}", to_string(s.o_dtype), dtype_set_string(qo_types)));
  const auto kv_types = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3, DType::kFloat8E5M2};
  if (!one_of(s.kv_dtype, kv_types))
    return no(fmt::format("kv_dtype: {}; expected one of {}", to_string(s.kv_dtype), dtype_set_string(kv_types)));
  if (c.kv_format != KVFormat::kRagged && c.page_size < 1)
    return no(fmt::format("page_size: {}; expected an integer >= 1", c.page_size));
  return {};
}

void check_indptr(std::span<const int32_t> indptr, const char* name) {
  if (indptr.empty()) fail_arg("{}: empty; expected batch + 1 >= 1 elements", name);
  if (indptr[0] != 0) fail_arg("{}[0]: {}; expected 0", name, indptr[0]);
  for (size_t i = 1; i < indptr.size(); ++i)
    if (indptr[i] < indptr[i - 1])
      fail_arg("{}: not monotone: {}[{}] = {} < {}[{}] = {}; expected a non-decreasing sequence", name, name, i,
               indptr[i], name, i - 1, indptr[i - 1]);
}

uint64_t batch_fingerprint(KVFormat format, int32_t page_size, std::span<const int32_t> kv_len) {
  // FNV-1a over the values; collisions only weaken an error check, never correctness.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t x) {
    for (int i = 0; i < 8; ++i) {
      h ^= (x >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<uint64_t>(format));
  mix(static_cast<uint64_t>(page_size));
  mix(kv_len.size());
  for (int32_t v : kv_len) mix(static_cast<uint32_t>(v));
  return h;
}

size_t partial_state_bytes(int64_t rows, const AttentionShape& s) {
  if (rows == 0) return 0;
  const size_t o = static_cast<size_t>(rows) * s.num_qo_heads * s.head_dim_vo * sizeof(float);
  const size_t lse = static_cast<size_t>(rows) * s.num_qo_heads * sizeof(float);
  return align256(o) + align256(lse);
}

KVParams paged_kv_params(const PagedKVCache& kv) {
  const bool nhd = kv.layout == KVLayout::kNHD;
  KVParams p{};
  p.k = kv.k.data;
  p.v = kv.v.data;
  p.dtype = kv.k.dtype;
  p.format = kv.table.format;
  p.page_size = static_cast<int32_t>(kv.k.shape[nhd ? 1 : 2]);
  p.num_kv_heads = static_cast<int32_t>(kv.k.shape[nhd ? 2 : 1]);
  p.k_stride_page = kv.k.strides[0];
  p.k_stride_token = kv.k.strides[nhd ? 1 : 2];
  p.k_stride_head = kv.k.strides[nhd ? 2 : 1];
  p.v_stride_page = kv.v.strides[0];
  p.v_stride_token = kv.v.strides[nhd ? 1 : 2];
  p.v_stride_head = kv.v.strides[nhd ? 2 : 1];
  p.k_scale = kv.k_scale;
  p.v_scale = kv.v_scale;
  p.num_pages = std::min(kv.k.shape[0], kv.v.shape[0]);
  return p;
}

PlanLayout plan_layout(const AttentionPlan& plan) {
  const int64_t batch = plan.batch_size;
  const int64_t pairs = static_cast<int64_t>(plan.item_capacity) * plan.shape.num_kv_heads;
  const int64_t schedule = plan.schedule_ctas > 0 ? plan.schedule_ctas + 1 + pairs : 0;
  PlanLayout l{};
  // The schedule first: its place does not depend on the capacities, which AttentionParams::schedule relies on.
  l.schedule = align256(sizeof(PlanView));
  l.qo_indptr = l.schedule + align256(schedule * sizeof(int32_t));
  l.kv_len = l.qo_indptr + align256((batch + 1) * sizeof(int32_t));
  l.items = l.kv_len + align256(batch * sizeof(int32_t));
  l.merges = l.items + align256(plan.item_capacity * sizeof(WorkItem));
  l.merge_counters = l.merges + align256(plan.merge_capacity * sizeof(MergeItem));
  l.merge_flags = l.merge_counters + align256(plan.merge_counters * sizeof(int32_t));
  l.end = l.merge_flags + align256(plan.merge_flags * sizeof(int32_t));
  return l;
}

}  // namespace attnforge::detail
