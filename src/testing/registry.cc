#include "testing/registry.h"

#include <random>

namespace attnforge::testing {

namespace {

CaseSpec decode(std::vector<int32_t> kv, int32_t page_size = 16) {
  CaseSpec s;
  s.kind = PlanKind::kDecode;
  s.kv_lens = std::move(kv);
  s.qo_lens.assign(s.kv_lens.size(), 1);
  s.page_size = page_size;
  return s;
}

CaseSpec prefill(std::vector<int32_t> qo, std::vector<int32_t> kv, KVFormat format = KVFormat::kPagedCSR) {
  CaseSpec s;
  s.kind = PlanKind::kPrefill;
  s.qo_lens = std::move(qo);
  s.kv_lens = std::move(kv);
  s.format = format;
  return s;
}

template <typename F>
CaseSpec with(CaseSpec s, F&& f) {
  f(s);
  return s;
}

}  // namespace

std::vector<CaseSpec> registry_cases(bool quick) {
  std::vector<CaseSpec> v;
  const std::vector<int32_t> odd_kv = {1, 17, 0, 97, 513};
  // Decode: page sizes, formats, layouts, group sizes, dtypes.
  for (int32_t ps : {1, 3, 16, 64}) v.push_back(decode(odd_kv, ps));
  v.push_back(with(decode(odd_kv, 16), [](CaseSpec& s) { s.format = KVFormat::kBlockTable; }));
  v.push_back(with(decode(odd_kv, 3), [](CaseSpec& s) { s.format = KVFormat::kBlockTable, s.layout = KVLayout::kHND; }));
  v.push_back(with(decode(odd_kv, 16), [](CaseSpec& s) { s.layout = KVLayout::kHND; }));
  v.push_back(with(decode(odd_kv), [](CaseSpec& s) { s.format = KVFormat::kRagged; }));
  for (int32_t group : {1, 3, 4, 8})
    v.push_back(with(decode({33, 200, 5}), [group](CaseSpec& s) { s.num_kv_heads = 2, s.num_qo_heads = 2 * group; }));
  v.push_back(with(decode({40, 7}), [](CaseSpec& s) { s.num_kv_heads = 1, s.num_qo_heads = 7; }));  // MQA, group 7
  v.push_back(with(decode({65, 300}), [](CaseSpec& s) { s.q_dtype = s.o_dtype = s.kv_dtype = DType::kFloat16; }));
  v.push_back(with(decode({65, 300}), [](CaseSpec& s) { s.q_dtype = s.o_dtype = s.kv_dtype = DType::kFloat32; }));
  v.push_back(with(decode({65, 300}), [](CaseSpec& s) { s.kv_dtype = DType::kFloat8E4M3, s.k_scale = 0.5f, s.v_scale = 0.25f; }));
  v.push_back(with(decode({65, 300}), [](CaseSpec& s) { s.kv_dtype = DType::kFloat8E5M2, s.k_scale = 2.f; }));
  v.push_back(with(decode({65, 300}), [](CaseSpec& s) { s.q_dtype = DType::kFloat16, s.o_dtype = DType::kFloat32; }));
  v.push_back(with(decode({300, 17}), [](CaseSpec& s) { s.combined_kv = true, s.padded_strides = true; }));
  v.push_back(with(decode({300, 17}), [](CaseSpec& s) { s.padded_strides = true, s.layout = KVLayout::kHND; }));
  // K and V with different strides (V padded, K not): the CUDA loader's whole-tile path takes V's own address then.
  v.push_back(with(decode({300, 17}), [](CaseSpec& s) { s.padded_v_only = true; }));
  v.push_back(with(decode({300, 17}), [](CaseSpec& s) { s.padded_v_only = true, s.layout = KVLayout::kHND; }));
  v.push_back(with(decode({130, 9}), [](CaseSpec& s) { s.head_dim_qk = 96, s.head_dim_vo = 64; }));
  v.push_back(with(decode({70}), [](CaseSpec& s) { s.head_dim_qk = 256; }));
  // Head_dim 256 over whole tiles (the CUDA loader's whole-tile path, its rows 4 apart in the swizzle): K and V with
  // their own strides, and HND pages.
  v.push_back(with(decode({300, 17}), [](CaseSpec& s) { s.head_dim_qk = 256, s.padded_v_only = true; }));
  v.push_back(with(decode({300, 17}), [](CaseSpec& s) { s.head_dim_qk = 256, s.layout = KVLayout::kHND; }));
  v.push_back(with(decode({40}), [](CaseSpec& s) { s.head_dim_qk = 512, s.num_qo_heads = 4; }));
  v.push_back(with(decode({40, 5}), [](CaseSpec& s) { s.head_dim_qk = 8; }));
  // Split KV (forced by asking for many workers) with merges, and deterministic fixed splits.
  v.push_back(with(decode({2000, 1, 0, 777}), [](CaseSpec& s) { s.plan.num_workers = 64; }));
  v.push_back(with(decode({2000, 1, 777}), [](CaseSpec& s) { s.plan.deterministic = true, s.plan.fixed_split_size = 128; }));
  // Several query tokens per request (speculative verification), causal inside the request.
  v.push_back(with(decode({40, 97, 8}), [](CaseSpec& s) { s.qo_lens = {2, 4, 8}, s.options.causal = true; }));
  v.push_back(with(decode({40, 97, 8}), [](CaseSpec& s) { s.qo_lens = {3, 1, 8}, s.options.custom_mask = true; }));
  // Prefill and append.
  v.push_back(prefill({1, 7, 37}, {1, 17, 97}));
  v.push_back(prefill({7, 37, 0}, {97, 513, 20}));
  v.push_back(with(prefill({7, 37, 37}, {97, 513, 37}), [](CaseSpec& s) { s.options.causal = true; }));
  v.push_back(with(prefill({7, 37, 37}, {97, 513, 37}, KVFormat::kRagged), [](CaseSpec& s) { s.options.causal = true; }));
  v.push_back(with(prefill({37, 100}, {37, 300}, KVFormat::kBlockTable), [](CaseSpec& s) {
    s.options.causal = true, s.layout = KVLayout::kHND, s.page_size = 1;
  }));
  v.push_back(with(prefill({150, 5}, {400, 5}), [](CaseSpec& s) { s.options.causal = true, s.num_qo_heads = s.num_kv_heads = 4; }));
  v.push_back(with(prefill({150, 33}, {600, 33}), [](CaseSpec& s) { s.options.causal = true, s.plan.num_workers = 64; }));
  v.push_back(with(prefill({37, 9}, {97, 30}), [](CaseSpec& s) { s.num_kv_heads = 1, s.num_qo_heads = 5; }));
  v.push_back(with(prefill({37, 9}, {97, 30}), [](CaseSpec& s) { s.head_dim_qk = 96, s.head_dim_vo = 64, s.options.causal = true; }));
  // Each option, in prefill (several rows per request) and decode.
  auto each_option = [&](const CaseSpec& base) {
    v.push_back(with(base, [](CaseSpec& s) { s.options.window_left = 16; }));
    v.push_back(with(base, [](CaseSpec& s) { s.options.window_left = 8, s.options.window_right = 4; }));
    v.push_back(with(base, [](CaseSpec& s) { s.options.soft_cap = 5.f, s.options.sm_scale = 0.5f; }));
    v.push_back(with(base, [](CaseSpec& s) { s.options.alibi = true; }));
    v.push_back(with(base, [](CaseSpec& s) { s.options.sinks = true; }));
    v.push_back(with(base, [](CaseSpec& s) { s.options.custom_mask = true; }));
    v.push_back(with(base, [](CaseSpec& s) { s.options.rope = true; }));
    v.push_back(with(base, [](CaseSpec& s) { s.options.rope = s.options.rope_interleave = s.options.rope_offsets = true; }));
    v.push_back(with(base, [](CaseSpec& s) { s.options.rope = s.options.rope_llama31 = true, s.options.rotary_dim = 32; }));
  };
  each_option(with(prefill({7, 37, 0}, {97, 130, 3}), [](CaseSpec& s) { s.options.causal = true; }));
  each_option(with(decode({97, 0, 300}), [](CaseSpec& s) { s.plan.num_workers = 32; }));
  v.push_back(with(prefill({20, 30}, {200, 90}), [](CaseSpec& s) {
    s.options.causal = true, s.options.window_left = 24, s.options.soft_cap = 3.f, s.options.alibi = true;
    s.options.sinks = true, s.options.rope = true, s.options.rope_offsets = true, s.plan.num_workers = 64;
  }));

  uint64_t seed = 1000;
  for (CaseSpec& s : v) s.seed = seed++;
  if (quick) {
    std::vector<CaseSpec> q;
    for (size_t i = 0; i < v.size(); i += 5) q.push_back(v[i]);
    return q;
  }
  return v;
}

std::vector<CaseSpec> fp8_decode_cases() {
  auto fp8 = [](DType kv, DType q, int32_t head_dim, int32_t qo_heads, int32_t kv_heads, std::vector<int32_t> kv_lens,
                int32_t page_size) {
    CaseSpec s = decode(std::move(kv_lens), page_size);
    s.kv_dtype = kv;
    s.q_dtype = s.o_dtype = q;
    s.head_dim_qk = head_dim;
    s.num_qo_heads = qo_heads, s.num_kv_heads = kv_heads;
    s.k_scale = kv == DType::kFloat8E4M3 ? 0.5f : 2.f;
    s.v_scale = kv == DType::kFloat8E4M3 ? 0.25f : 0.5f;
    return s;
  };
  constexpr DType kE4M3 = DType::kFloat8E4M3, kE5M2 = DType::kFloat8E5M2;
  constexpr DType kBf16 = DType::kBFloat16, kF16 = DType::kFloat16;
  std::vector<CaseSpec> v;
  v.push_back(fp8(kE4M3, kBf16, 128, 16, 4, {1, 17, 0, 97, 513, 1000}, 16));
  v.push_back(with(fp8(kE5M2, kBf16, 128, 16, 4, {300, 5, 0, 64}, 1), [](CaseSpec& s) { s.layout = KVLayout::kHND; }));
  v.push_back(with(fp8(kE4M3, kF16, 64, 6, 2, {33, 200, 5}, 16), [](CaseSpec& s) {
    s.layout = KVLayout::kHND, s.format = KVFormat::kBlockTable;
  }));
  v.push_back(with(fp8(kE5M2, kF16, 256, 7, 1, {40, 129}, 16), [](CaseSpec& s) { s.o_dtype = DType::kFloat32; }));
  v.push_back(with(fp8(kE4M3, kBf16, 128, 16, 4, {40, 97, 130}, 16), [](CaseSpec& s) {
    s.qo_lens = {2, 4, 8}, s.options.causal = true;
  }));
  v.push_back(with(fp8(kE5M2, kBf16, 64, 8, 8, {65, 0, 300}, 1), [](CaseSpec& s) { s.format = KVFormat::kRagged; }));
  v.push_back(with(fp8(kE4M3, kBf16, 128, 12, 4, {2000, 1, 0, 777}, 3), [](CaseSpec& s) { s.plan.num_workers = 64; }));
  v.push_back(with(fp8(kE4M3, kF16, 128, 16, 4, {300, 90}, 16), [](CaseSpec& s) {
    s.options.sinks = s.options.alibi = true, s.options.soft_cap = 5.f, s.options.window_left = 64;
  }));
  v.push_back(with(fp8(kE5M2, kF16, 128, 8, 2, {130, 41}, 1), [](CaseSpec& s) {
    s.qo_lens = {3, 1}, s.options.custom_mask = true;
  }));
  v.push_back(with(fp8(kE4M3, kBf16, 256, 8, 2, {1500, 33}, 16), [](CaseSpec& s) {
    s.plan.deterministic = true, s.plan.fixed_split_size = 256, s.combined_kv = true;
  }));
  uint64_t seed = 5000;
  for (CaseSpec& s : v) s.seed = seed++;
  return v;
}

CaseSpec random_spec(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&rng](auto... xs) {
    const std::vector<std::common_type_t<decltype(xs)...>> v = {xs...};
    return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)];
  };
  auto chance = [&rng](double p) { return std::bernoulli_distribution(p)(rng); };
  CaseSpec s;
  s.seed = seed;
  s.kind = chance(0.5) ? PlanKind::kDecode : PlanKind::kPrefill;
  s.format = pick(KVFormat::kPagedCSR, KVFormat::kBlockTable, KVFormat::kRagged);
  s.layout = pick(KVLayout::kNHD, KVLayout::kHND);
  s.page_size = pick(1, 2, 5, 16, 32);
  s.num_kv_heads = pick(1, 2, 3);
  s.num_qo_heads = s.num_kv_heads * pick(1, 2, 3, 4, 5, 8);
  s.head_dim_qk = pick(16, 64, 128);
  s.head_dim_vo = chance(0.2) ? pick(32, 64) : 0;
  s.q_dtype = pick(DType::kBFloat16, DType::kFloat16, DType::kFloat32);
  s.o_dtype = chance(0.7) ? s.q_dtype : DType::kFloat32;
  s.kv_dtype = pick(DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat8E4M3, DType::kFloat8E5M2);
  if (s.kv_dtype == DType::kFloat8E4M3 || s.kv_dtype == DType::kFloat8E5M2) s.k_scale = 0.5f, s.v_scale = 0.25f;
  s.padded_strides = chance(0.3);
  s.combined_kv = chance(0.3);
  s.spare_pages = pick(0, 1, 7);
  const int32_t batch = pick(1, 2, 3, 5, 9);
  const bool causal = chance(0.5);
  for (int32_t b = 0; b < batch; ++b) {
    const int32_t qo = s.kind == PlanKind::kDecode ? pick(1, 1, 1, 2, 4, 8) : pick(0, 1, 3, 17, 64);
    int32_t kv = pick(0, 1, 2, 31, 100, 257, 700);
    if (causal && kv < qo) kv = qo;
    s.qo_lens.push_back(qo);
    s.kv_lens.push_back(kv);
  }
  OptionSpec& o = s.options;
  o.causal = causal;
  if (chance(0.2)) o.window_left = pick(0, 5, 40);
  if (chance(0.1)) o.window_right = pick(0, 3);
  if (chance(0.2)) o.soft_cap = 4.f;
  o.alibi = chance(0.15);
  o.sinks = chance(0.15);
  o.custom_mask = chance(0.15);
  o.rope = chance(0.2);
  o.rope_interleave = o.rope && chance(0.5);
  o.rope_offsets = o.rope && chance(0.5);
  o.rope_llama31 = o.rope && chance(0.3);
  if (chance(0.4)) s.plan.num_workers = pick(8, 64);
  if (chance(0.15)) s.plan.deterministic = true, s.plan.fixed_split_size = pick(16, 100);
  return s;
}

}  // namespace attnforge::testing
