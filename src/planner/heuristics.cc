#include "planner/heuristics.h"

#include <algorithm>
#include <functional>
#include <queue>
#include <utility>

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

void schedule_pairs(std::span<const int64_t> item_work, int32_t num_kv_heads, int32_t ctas,
                    std::vector<int32_t>& out) {
  const int64_t items = static_cast<int64_t>(item_work.size()), pairs = items * num_kv_heads;
  out.assign(static_cast<size_t>(ctas + 1 + pairs), 0);
  if (ctas <= 0) return;
  std::vector<int32_t> owner(static_cast<size_t>(pairs));
  // (work so far, CTA), least first.
  std::priority_queue<std::pair<int64_t, int32_t>, std::vector<std::pair<int64_t, int32_t>>, std::greater<>> free;
  for (int32_t c = 0; c < ctas; ++c) free.push({0, c});
  for (int64_t w = 0; w < pairs; ++w) {
    auto [work, c] = free.top();
    free.pop();
    owner[static_cast<size_t>(w)] = c;
    ++out[static_cast<size_t>(c) + 1];
    free.push({work + item_work[static_cast<size_t>(w % items)], c});
  }
  for (int32_t c = 0; c < ctas; ++c) out[static_cast<size_t>(c) + 1] += out[static_cast<size_t>(c)];
  std::vector<int32_t> next(out.begin(), out.begin() + ctas);
  for (int64_t w = 0; w < pairs; ++w)
    out[static_cast<size_t>(ctas + 1 + next[static_cast<size_t>(owner[static_cast<size_t>(w)])]++)] = static_cast<int32_t>(w);
}

}  // namespace attnforge::planner
