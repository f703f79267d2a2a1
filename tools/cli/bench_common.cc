// Shapes and counts shared by the CPU and GPU benchmarks.
#include "bench_common.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace attnforge::cli {

// Serving defaults: Llama-3-8B-like attention (32 query heads over 8 KV heads, head_dim 128), bf16 everywhere,
// pages of 16 tokens shuffled among spare pages as a running server's allocator leaves them.
testing::CaseSpec serving_spec(PlanKind kind, KVFormat format, std::vector<int32_t> qo_lens, std::vector<int32_t> kv_lens) {
  testing::CaseSpec s;
  s.kind = kind;
  s.format = format;
  s.qo_lens = std::move(qo_lens);
  s.kv_lens = std::move(kv_lens);
  s.num_qo_heads = 32;
  s.num_kv_heads = 8;
  s.head_dim_qk = 128;
  s.page_size = 16;
  s.spare_pages = 64;
  s.options.causal = kind == PlanKind::kPrefill;
  return s;
}

testing::CaseSpec decode_spec(std::vector<int32_t> kv_lens) {
  std::vector<int32_t> qo(kv_lens.size(), 1);
  return serving_spec(PlanKind::kDecode, KVFormat::kPagedCSR, std::move(qo), std::move(kv_lens));
}

// `batch` lengths with the given total, each >= kMinLen, shaped like a Zipf law: weights are Pareto draws
// (tail index 1.1, a fixed seed), so a few requests hold most of the tokens, as in real serving traffic.
std::vector<int32_t> zipf_lengths(int32_t batch, int64_t total) {
  constexpr int32_t kMinLen = 16;
  std::mt19937_64 rng(20240607);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  std::vector<double> w(static_cast<size_t>(batch));
  for (double& x : w) x = std::pow(1.0 - uni(rng), -1.0 / 1.1);
  double sum = 0;
  for (double x : w) sum += x;
  const int64_t spread = total - static_cast<int64_t>(kMinLen) * batch;
  std::vector<int32_t> lens(static_cast<size_t>(batch));
  int64_t assigned = 0;
  for (int32_t b = 0; b < batch; ++b) {
    lens[b] = kMinLen + static_cast<int32_t>(std::floor(spread * w[b] / sum));
    assigned += lens[b];
  }
  // Rounding down leaves a few tokens; the longest request takes them so the total is exact.
  *std::max_element(lens.begin(), lens.end()) += static_cast<int32_t>(total - assigned);
  return lens;
}

// Bytes a step must move at least: K and V of every token read once, Q read, O written.
double bytes_moved(const testing::CaseSpec& s) {
  const int32_t dvo = s.head_dim_vo ? s.head_dim_vo : s.head_dim_qk;
  int64_t kv_tokens = 0, qo_tokens = 0;
  for (int32_t len : s.kv_lens) kv_tokens += len;
  for (int32_t len : s.qo_lens) qo_tokens += len;
  const double kv = static_cast<double>(kv_tokens) * s.num_kv_heads * (s.head_dim_qk + dvo) * dtype_bytes(s.kv_dtype);
  const double q = static_cast<double>(qo_tokens) * s.num_qo_heads * s.head_dim_qk * dtype_bytes(s.q_dtype);
  const double o = static_cast<double>(qo_tokens) * s.num_qo_heads * dvo * dtype_bytes(s.o_dtype);
  return kv + q + o;
}

// Floating-point operations of attention: 2 x (head_dim_qk + head_dim_vo) per head per attended (query, key) pair
// (QK^T and PV). Causal is bottom-right aligned: query i of qo_len sees keys [0, kv_len - qo_len + i].
double attention_flops(const testing::CaseSpec& s) {
  const int32_t dvo = s.head_dim_vo ? s.head_dim_vo : s.head_dim_qk;
  double pairs = 0;
  for (size_t b = 0; b < s.qo_lens.size(); ++b)
    for (int32_t i = 0; i < s.qo_lens[b]; ++i)
      pairs += s.options.causal ? std::min(s.kv_lens[b], s.kv_lens[b] - s.qo_lens[b] + i + 1) : s.kv_lens[b];
  return 2.0 * (s.head_dim_qk + dvo) * s.num_qo_heads * pairs;
}

std::vector<int64_t> sampled_rows(int64_t total) {
  if (total <= kCheckedRows) return {};  // all
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < kCheckedRows; ++i) rows.push_back(i * (total - 1) / (kCheckedRows - 1));
  return rows;
}

bool case_selected(const std::string& name, const std::string& filter) {
  if (filter.empty()) return true;
  for (size_t begin = 0;;) {
    const size_t end = filter.find('|', begin);
    std::string text = filter.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    const bool at_end = !text.empty() && text.back() == '$';
    if (at_end) text.pop_back();
    if (!text.empty() && (at_end ? name.ends_with(text) : name.find(text) != std::string::npos)) return true;
    if (end == std::string::npos) return false;
    begin = end + 1;
  }
}

double kv_bytes_read(const testing::CaseSpec& s) {
  const int32_t dvo = s.head_dim_vo ? s.head_dim_vo : s.head_dim_qk;
  int64_t kv_tokens = 0;
  for (int32_t len : s.kv_lens) kv_tokens += len;
  return static_cast<double>(kv_tokens) * s.num_kv_heads * (s.head_dim_qk + dvo) * dtype_bytes(s.kv_dtype);
}

}  // namespace attnforge::cli
