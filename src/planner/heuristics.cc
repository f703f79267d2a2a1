#include "planner/heuristics.h"

#include <algorithm>

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

}  // namespace attnforge::planner
