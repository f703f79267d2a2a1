// plan(): host metadata in, a typed plan out. The plan says how a batch's work is cut into items, how many
// bytes of workspace run() needs (exactly), and what batch it was made for, so run() can refuse another one.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "attnforge/kernel/params.h"
#include "attnforge/kv_cache.h"

namespace attnforge {

enum class PlanKind : int32_t {
  kDecode = 0,   // one or a few (<= 8) query tokens per request; query tiles are whole requests
  kPrefill = 1,  // any query lengths; query tiles of a planner-chosen size
};

// The shapes and element types of one attention layer.
struct AttentionShape {
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim_qk = 0;
  int32_t head_dim_vo = 0;  // 0: same as head_dim_qk
  DType q_dtype = DType::kBFloat16;
  DType kv_dtype = DType::kBFloat16;
  DType o_dtype = DType::kBFloat16;
};

struct PlanOptions {
  int32_t num_workers = 0;       // 0: the device's (CPU threads, or SMs)
  // Prefill plans: packed query rows (query tokens x heads of a group) per query tile. 0: the backend picks from
  // the batch shape (CUDA: 64-row tiles when the requests pack at most 64 rows on average, else the head dim's
  // tile). Otherwise one of the backend's tiles (CUDA: 64 or the head dim's, 128 up to head_dim 128); a tuning
  // and measuring knob, like num_workers.
  int32_t tile_rows = 0;
  bool deterministic = false;    // true: KV split at fixed positions (fixed_split_size) whatever the batch
  int32_t fixed_split_size = 0;  // KV tokens per split in deterministic mode; 0: 2048
  bool disable_split = false;    // never split KV (no workspace needed)
  // The plan covers only the KV that causal attention sees (each query tile up to its diagonal), and balances
  // work for it; run() with causal = false on such a plan is refused. Other masks (window, custom) never need
  // a re-plan: they only narrow what a plan covers.
  bool causal = false;
};

// Host-side metadata of a batch. The arrays are int32 views in host memory, with the same contents run() gets.
struct BatchPlanArgs {
  Device device = Device::cpu();  // where run() executes
  AttentionShape shape;
  TensorView qo_indptr;  // [batch + 1]; for kDecode it may be left out (one query per request)
  KVFormat kv_format = KVFormat::kPagedCSR;
  int32_t page_size = 1;     // paged formats
  TensorView kv_indptr;      // CSR: page indptr; ragged: token indptr
  TensorView last_page_len;  // CSR
  TensorView seq_lens;       // block table
  PlanOptions options;

  // Fill the KV fields from a page table or ragged indptr whose views are in host memory.
  void set_paged(const PageTable& host_table, int32_t page_size);
  void set_ragged(const TensorView& host_kv_indptr);
};

struct AttentionPlan {
  // 2: the persistent kernel's schedule; 3: kv_stages; 4: WorkItem context; 5: merges in the decode kernel; 6: streamed
  // merges (merge_flags)
  static constexpr int32_t kVersion = 6;
  int32_t version = kVersion;
  PlanKind kind = PlanKind::kDecode;
  Device device{};
  AttentionShape shape;
  KVFormat kv_format = KVFormat::kPagedCSR;
  int32_t page_size = 1;
  int32_t batch_size = 0;
  int64_t total_qo = 0;
  bool causal = false;        // made with PlanOptions::causal
  // Made with PlanOptions::deterministic: run() then launches every merge in one fixed shape (CUDA: the merge
  // kernel's block shape), so a request's states are summed in the same order whatever else the batch holds.
  bool deterministic = false;
  int32_t qo_tile = 0;        // query tokens per item (decode: a whole request)
  int32_t tile_rows = 0;      // prefill: the packed rows per tile the plan was cut for (a device's CTA rows); decode 0
  // Decode: the K/V pipeline stages the plan was cut for, where the device runs batches too small to fill it with
  // a deeper pipeline than the others (CUDA: 3 stages with 16-bit K/V at head_dim 128, for batch x KV heads under
  // SMs x 2, and 256, under SMs); 0: the kernel's default. Set from the batch size alone, so every re-plan of a batch
  // size agrees.
  int32_t kv_stages = 0;
  int32_t max_merge_states = 0;  // the most partial states one merge combines (0: no merges)
  // Decode on a device whose decode kernel merges split KV itself (CUDA): the arrival counters in the workspace, one
  // for each (merge, KV head, block of the kernel's CTA rows) at capacity; the last CTA of a merge to finish combines
  // its states, and no merge kernel is launched. 0: merges run as a kernel of their own (other devices, prefill,
  // deterministic plans, and batch shapes whose merges could hold more states than one CTA combines quickly).
  // Set from the batch size and shape alone, so every re-plan of a batch size agrees.
  int64_t merge_counters = 0;
  // Decode on a device that streams merges (CUDA, ATTNFORGE_DECODE_KERNEL_MERGE=stream): the flags in the workspace,
  // one for each (KV head, block of the decode kernel's CTA rows, item) at capacity; the merge kernel runs beside the
  // decode kernel and folds each merge's states as their flags appear. Set from the batch size and shape alone.
  int64_t merge_flags = 0;
  int32_t kv_chunk = 0;       // the longest KV piece of a split item (at least the planned chunk); 0: not split
  std::vector<int32_t> qo_indptr;  // [batch + 1]
  std::vector<int32_t> kv_len;     // [batch]
  std::vector<WorkItem> items;
  std::vector<MergeItem> merges;
  // Prefill plans on a device with a persistent kernel (CUDA: the Hopper kernel's pipelined forms, one CTA per SM,
  // schedule_ctas of them whatever the batch): which (KV head, item) pairs each CTA walks, balanced by the planner
  // (a CTA may have none). schedule holds
  // schedule_ctas + 1 offsets, then CTA c's pairs at [schedule[c], schedule[c + 1]) of the rest, each pair as the
  // kernels number them (KV head h, item i in reverse plan order: h x items + i). Empty elsewhere (schedule_ctas 0).
  int32_t schedule_ctas = 0;
  std::vector<int32_t> schedule;
  int64_t partial_rows = 0;   // rows of partial (o, lse) state in use
  uint64_t fingerprint = 0;   // hash of the KV lengths, checked by run() where it can see the metadata

  // Capacities: the most items, merges and partial rows any plan of this batch size, shape and device can have.
  // On CUDA they size the grids and the workspace, so a graph captured with one plan replays any re-plan of the
  // same batch size (upload_plan then refreshes the metadata the kernels read). On the CPU they equal the counts.
  int32_t item_capacity = 0;
  int32_t merge_capacity = 0;
  int64_t partial_row_capacity = 0;
  size_t metadata_bytes = 0;   // CUDA: the plan's metadata at the start of the workspace (0 on the CPU)
  size_t workspace_bytes = 0;  // exact: metadata + partial states at capacity
  size_t staging_bytes = 0;    // CUDA: page-locked host bytes upload_plan stages the metadata through

  // Set by upload_plan: the workspace whose metadata matches this plan (run() checks it).
  const void* uploaded_to = nullptr;

  std::string describe() const;
};

// Caller-provided scratch memory on the run device (at least plan.workspace_bytes; 256-byte aligned).
struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
};

}  // namespace attnforge
