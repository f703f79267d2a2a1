#include "planner/heuristics.h"

#include <algorithm>
#include <cstdint>
#include <limits>

namespace attnforge::planner {

int32_t choose_qo_tile(int32_t group_size, int32_t max_qo_len, int32_t target_rows) {
  const int32_t by_rows = std::max(1, target_rows / std::max(1, group_size));
  return std::max(1, std::min(by_rows, max_qo_len));
}

int64_t split_target_items(const SplitInput& in) {
  const int64_t wanted = static_cast<int64_t>(in.waves) * in.num_workers;
  return (wanted + in.num_kv_heads - 1) / in.num_kv_heads;
}

int32_t choose_kv_chunk(const SplitInput& in) {
  const int64_t units = in.num_tiles * in.num_kv_heads;
  const int64_t wanted = static_cast<int64_t>(in.waves) * in.num_workers;
  if (units >= wanted || in.total_kv == 0) return 0;
  // Items wanted per KV head, spread over all tokens of the batch.
  const int64_t items_per_head = split_target_items(in);
  int64_t chunk = (in.total_kv + items_per_head - 1) / items_per_head;
  chunk = std::max<int64_t>(chunk, in.min_chunk);
  const int64_t align = std::max(1, in.align);
  chunk = (chunk + align - 1) / align * align;
  if (chunk >= in.max_kv) return 0;  // nothing would be cut
  return static_cast<int32_t>(chunk);
}

bool decode_merges_in_kernel(const SplitInput& in, int32_t cta_rows, int32_t head_dim_vo, int64_t smem_bytes,
                             int32_t passes) {
  if (cta_rows <= 0 || smem_bytes <= 0 || passes <= 0) return false;
  const int64_t states = split_target_items(in) + 1;
  const int64_t acc_bytes = static_cast<int64_t>(cta_rows) * head_dim_vo * static_cast<int64_t>(sizeof(float));
  const int64_t state_bytes = acc_bytes + cta_rows * static_cast<int64_t>(sizeof(float));
  const int64_t per_pass = (smem_bytes - acc_bytes - 16) / state_bytes;  // as the kernel counts (merge_split_rows)
  return per_pass > 0 && states <= per_pass * passes;
}

void schedule_pairs(std::span<const int64_t> item_work, int32_t num_kv_heads, int32_t ctas,
                    std::vector<int32_t>& out) {
  const int64_t items = static_cast<int64_t>(item_work.size()), pairs = items * num_kv_heads;
  out.assign(static_cast<size_t>(ctas + 1 + pairs), 0);
  if (ctas <= 0 || pairs == 0) return;
  // The least loaded CTA by a tournament over keys (work so far << 16 | CTA), so the lesser key is the lesser work
  // and, on a tie, the lower CTA: node n holds the least key under it, leaves at leaves + c, padding leaves the
  // largest key. A pair's update replays one leaf's path to the root: ~8 minimums for 132 CTAs. (13 ns a pair on
  // the dev machine, 5x a binary heap of (work, CTA): 0.12 ms for the 9,272 pairs of ragged 16 x [512, 4096].)
  // CTA counts (SMs) stay far below 2^16, work sums below 2^48 tokens.
  constexpr int kCtaBits = 16;
  int32_t leaves = 1;
  while (leaves < ctas) leaves *= 2;
  std::vector<uint64_t> tree(2 * static_cast<size_t>(leaves), std::numeric_limits<uint64_t>::max());
  for (int32_t c = 0; c < ctas; ++c) tree[static_cast<size_t>(leaves + c)] = static_cast<uint64_t>(c);
  for (int32_t n = leaves - 1; n >= 1; --n) tree[static_cast<size_t>(n)] = std::min(tree[2 * n], tree[2 * n + 1]);
  int32_t* owner = out.data() + ctas + 1;  // each pair's CTA, until the lists replace them below
  int32_t* count = out.data() + 1;
  for (int64_t w = 0, i = 0; w < pairs; ++w, i = i + 1 == items ? 0 : i + 1) {
    const auto c = static_cast<int32_t>(tree[1] & ((1u << kCtaBits) - 1));
    owner[w] = c;
    ++count[c];
    size_t n = static_cast<size_t>(leaves + c);
    uint64_t key = tree[n] + (static_cast<uint64_t>(item_work[static_cast<size_t>(i)]) << kCtaBits);
    tree[n] = key;
    for (; n > 1; n /= 2) tree[n / 2] = key = std::min(key, tree[n ^ 1]);
  }
  for (int32_t c = 0; c < ctas; ++c) out[static_cast<size_t>(c) + 1] += out[static_cast<size_t>(c)];
  // Each CTA's pairs in order: a counting sort of the owners, in place through a copy of them.
  const std::vector<int32_t> owners(owner, owner + pairs);
  std::vector<int32_t> next(out.begin(), out.begin() + ctas);
  for (int64_t w = 0; w < pairs; ++w)
    owner[next[static_cast<size_t>(owners[static_cast<size_t>(w)])]++] = static_cast<int32_t>(w);
}

}  // namespace attnforge::planner
