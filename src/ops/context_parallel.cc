// Context parallelism on the host: page-table partition, option checks, the packed state layout and the merge.
#include "attnforge/context_parallel.h"

#include "core/check.h"

namespace attnforge {

namespace {

using namespace detail;

constexpr size_t kAlign = 256;

size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Appends the pages of one request (page ids `pages`, kv_len tokens) that belong to `rank` to `share`.
void take_share(const std::vector<int32_t>& pages, int32_t kv_len, int32_t page_size, int32_t world, int32_t rank,
                KVPartition partition, RankPageTable& share) {
  const int64_t count = static_cast<int64_t>(pages.size());
  int32_t tokens = 0;
  int32_t last = 0;
  auto take = [&](int64_t j) {
    share.indices.push_back(pages[static_cast<size_t>(j)]);
    // Only the request's last page may be partly filled.
    last = j == count - 1 ? kv_len - static_cast<int32_t>(j) * page_size : page_size;
    tokens += last;
  };
  if (partition == KVPartition::kContiguous) {
    for (int64_t j = rank * count / world; j < (rank + 1) * count / world; ++j) take(j);
  } else {
    for (int64_t j = rank; j < count; j += world) take(j);
  }
  share.indptr.push_back(static_cast<int32_t>(share.indices.size()));
  share.last_page_len.push_back(last);
  share.kv_len.push_back(tokens);
}

}  // namespace

std::string to_string(KVPartition p) {
  switch (p) {
    case KVPartition::kContiguous:
      return "contiguous";
    case KVPartition::kRoundRobinPages:
      return "round_robin_pages";
  }
  return fmt::format("KVPartition({})", static_cast<int32_t>(p));
}

PageTable RankPageTable::table() const {
  auto view = [](const std::vector<int32_t>& v) {
    return TensorView(const_cast<int32_t*>(v.data()), DType::kInt32, {static_cast<int64_t>(v.size())});
  };
  return PageTable::csr(view(indptr), view(indices), view(last_page_len));
}

RankPageTable partition_pages(const PageTable& host_table, int32_t page_size, int32_t world_size, int32_t rank,
                              KVPartition partition) {
  if (world_size < 1) fail_arg("world_size: {}; expected >= 1", world_size);
  if (rank < 0 || rank >= world_size) fail_arg("rank: {}; expected in [0, {})", rank, world_size);
  if (page_size < 1) fail_arg("page_size: {}; expected >= 1", page_size);
  if (partition != KVPartition::kContiguous && partition != KVPartition::kRoundRobinPages)
    fail_arg("partition: {}; expected one of {{contiguous, round_robin_pages}}", to_string(partition));

  RankPageTable share;
  share.indptr.push_back(0);
  std::vector<int32_t> pages;
  if (host_table.format == KVFormat::kPagedCSR) {
    const auto indptr = host_int32(host_table.indptr, "indptr", -1);
    if (indptr.empty()) fail_arg("indptr: has 0 elements; expected [batch + 1]");
    const int64_t batch = static_cast<int64_t>(indptr.size()) - 1;
    const auto last = host_int32(host_table.last_page_len, "last_page_len", batch);
    const auto indices = host_int32(host_table.indices, "indices", -1);
    for (int64_t b = 0; b < batch; ++b) {
      const int32_t lo = indptr[b], hi = indptr[b + 1];
      if (lo < 0 || hi < lo || hi > static_cast<int64_t>(indices.size()))
        fail_arg("indptr: [{}, {}) for request {}; expected 0 <= indptr[b] <= indptr[b + 1] <= {} (indices)", lo, hi,
                 b, indices.size());
      if (hi > lo ? (last[b] < 1 || last[b] > page_size) : last[b] != 0)
        fail_arg("last_page_len[{}]: {} with {} pages; expected [1, {}] for a request with pages, 0 without", b,
                 last[b], hi - lo, page_size);
      pages.assign(indices.begin() + lo, indices.begin() + hi);
      const int32_t kv_len = hi > lo ? (hi - lo - 1) * page_size + last[b] : 0;
      take_share(pages, kv_len, page_size, world_size, rank, partition, share);
    }
  } else if (host_table.format == KVFormat::kBlockTable) {
    const TensorView& bt = host_table.block_table;
    expect_defined(bt, "block_table");
    expect_host(bt, "block_table");
    expect_dtype(bt, "block_table", {DType::kInt32});
    expect_ndim(bt, "block_table", 2, "[batch, max_pages]");
    const int64_t batch = bt.shape[0];
    const auto seq_lens = host_int32(host_table.seq_lens, "seq_lens", batch);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t count = (static_cast<int64_t>(seq_lens[b]) + page_size - 1) / page_size;
      if (seq_lens[b] < 0 || count > bt.shape[1])
        fail_arg("seq_lens[{}]: {}; expected 0 .. {} (max_pages {} x page_size {})", b, seq_lens[b],
                 bt.shape[1] * page_size, bt.shape[1], page_size);
      pages.clear();
      const int32_t* row = bt.ptr<const int32_t>() + b * bt.strides[0];
      for (int64_t j = 0; j < count; ++j) pages.push_back(row[j * bt.strides[1]]);
      take_share(pages, seq_lens[b], page_size, world_size, rank, partition, share);
    }
  } else {
    fail_arg("host_table: format {}; expected {} or {}", to_string(host_table.format),
             to_string(KVFormat::kPagedCSR), to_string(KVFormat::kBlockTable));
  }
  return share;
}

void check_context_parallel_options(const AttentionOptions& o, KVPartition partition) {
  const std::string mode = to_string(partition);
  auto reject = [&](const char* option, const char* why) {
    fail(ErrorKind::kUnsupported, "{}: not supported with context parallelism ({} partition): {}", option, mode, why);
  };
  constexpr const char* kPositions =
      "it depends on absolute KV positions, and a rank's share is numbered from 0 (decode with one query token "
      "needs no causal mask: pass causal = false)";
  if (o.causal) reject("causal", kPositions);
  if (o.window_left >= 0 || o.window_right >= 0) reject("window_left/window_right", kPositions);
  if (o.alibi_slopes.defined()) reject("alibi_slopes", kPositions);
  if (o.rope.enabled) reject("rope", kPositions);
  if (o.custom_mask.bits.defined() || o.custom_mask.indptr.defined())
    reject("custom_mask", "its bits are indexed by the KV position in the whole request");
  if (o.sinks.defined())
    reject("sinks", "every rank's softmax would include the sink logit, so the merge would count it once per rank");
}

size_t RankStateLayout::lse_offset() const {
  return align_up(static_cast<size_t>(n) * num_heads * head_dim * dtype_bytes(o_dtype));
}

size_t RankStateLayout::rank_bytes() const {
  return lse_offset() + align_up(static_cast<size_t>(n) * num_heads * sizeof(float));
}

Outputs RankStateLayout::rank_outputs(void* buffer, int32_t rank, Device device) const {
  uint8_t* slot = static_cast<uint8_t*>(buffer) + static_cast<size_t>(rank) * rank_bytes();
  return {TensorView(slot, o_dtype, {n, num_heads, head_dim}, device),
          TensorView(slot + lse_offset(), DType::kFloat32, {n, num_heads}, device)};
}

void merge_gathered_states(const RankStateLayout& layout, const void* buffer, int32_t world_size,
                           const Outputs& outputs, Device device, Stream stream) {
  if (world_size < 1) fail_arg("world_size: {}; expected >= 1", world_size);
  if (buffer == nullptr) fail_arg("buffer: null; expected the gathered states of {} ranks", world_size);
  // Slot r holds rank r's o and lse; element strides between ranks are the slot size in elements, which the
  // 256-byte alignment of slots makes whole.
  const int64_t o_rank = static_cast<int64_t>(layout.rank_bytes() / dtype_bytes(layout.o_dtype));
  const int64_t lse_rank = static_cast<int64_t>(layout.rank_bytes() / sizeof(float));
  const int64_t h = layout.num_heads, d = layout.head_dim;
  auto* base = static_cast<uint8_t*>(const_cast<void*>(buffer));
  const TensorView v(base, layout.o_dtype, {layout.n, world_size, h, d}, {h * d, o_rank, d, 1}, device);
  const TensorView s(base + layout.lse_offset(), DType::kFloat32, {layout.n, world_size, h}, {h, lse_rank, 1}, device);
  merge_states(v, s, outputs, stream);
}

}  // namespace attnforge
