// The backend interface and the selector. One function, select(), turns a configuration into a backend and a
// verdict; supports(), plan() and run() all go through it.
#pragma once

#include "attnforge/config.h"
#include "attnforge/kernel/op_params.h"
#include "attnforge/kernel/variant_hooks.h"
#include "attnforge/ops.h"
#include "attnforge/plan.h"
#include "planner/heuristics.h"

namespace attnforge::detail {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  // Whether this backend runs `config`, and if not, why.
  virtual Support check(const AttentionConfig& config) const = 0;
  // Parallel workers plan() balances over for this shape and kind of plan (CPU threads; SMs x resident CTAs of
  // the kernel that runs it). `tile_rows`: the prefill plan's packed query rows per tile (0 for decode plans).
  virtual int32_t num_workers(const AttentionShape& shape, PlanKind kind, int32_t tile_rows) const = 0;
  // A deeper K/V pipeline for decode batches too small to fill the device: a batch of fewer (request, KV head)
  // pairs than `workers` is planned for that many workers and run with `stages` (AttentionPlan::kv_stages). Called
  // by plan() only for batches under num_workers(). {0, 0}: one pipeline serves every batch.
  struct Pipeline {
    int32_t stages = 0, workers = 0;
  };
  virtual Pipeline small_batch_pipeline(const AttentionShape& shape) const {
    (void)shape;
    return {};
  }
  // A decode kernel that merges split KV itself (AttentionPlan::merge_counters): the query rows one of its CTAs
  // holds (a merge's counters are kept per block of them) and the shared memory its last CTA combines states in;
  // and the passes over it a merge may take in batches of a wave of CTAs or more (their merges hold two or three
  // states but for a skewed batch's longest request) and in smaller batches (one long request: dozens of states);
  // {0, 0, 0, 0}: merges run as a kernel of their own. `kv_stages`: the plan's (0: the default pipeline).
  struct DecodeMerge {
    int32_t cta_rows = 0;
    int64_t smem_bytes = 0;
    int32_t passes = 0, small_batch_passes = 0;
    // Merges streamed instead (AttentionPlan::merge_flags: the merge kernel runs beside the decode kernel, which
    // releases a flag per CTA state) in batches of at most this many (request, KV head) pairs; 0: never.
    int64_t stream_max_pairs = 0;
  };
  virtual DecodeMerge decode_merge(const AttentionShape& shape, int32_t kv_stages) const {
    (void)shape, (void)kv_stages;
    return {};
  }
  // Shortest KV piece worth splitting off: below it a split's partial-state write and merge cost more than the
  // parallelism gains.
  virtual int32_t min_split_tokens() const { return 256; }
  // Parallel units a split aims at per worker: 2 (CPU threads take uneven tasks from a queue), or 1 for a
  // device whose under-filled batches should become exactly one wave of work (a GPU's resident CTAs).
  virtual int32_t split_waves() const { return 2; }
  // Rows (query tokens x heads of a group) a prefill item should hold, for a batch whose requests pack
  // `avg_packed_rows` rows on average (query tokens x group): a device with a short tile takes it for batches of
  // short queries (speculative verification, chunked prefill among decodes).
  virtual int32_t target_tile_rows(const AttentionShape& shape, double avg_packed_rows) const = 0;
  // The values PlanOptions::tile_rows may take for this shape; empty: any positive number (the CPU tiles any size).
  virtual std::vector<int32_t> tile_rows_choices(const AttentionShape& shape) const {
    (void)shape;
    return {};
  }
  // CTAs of the persistent kernel that runs prefill plans of this shape and tile rows, whose walk over (KV head,
  // item) pairs the planner lays out (AttentionPlan::schedule); 0: no persistent kernel runs them.
  virtual int32_t persistent_ctas(const AttentionShape& shape, int32_t tile_rows) const {
    (void)shape, (void)tile_rows;
    return 0;
  }
  // The fixed cost of a persistent kernel's item besides its KV tokens, in KV tokens, as schedule_pairs weighs it.
  virtual int64_t item_work_tokens() const { return planner::kItemWorkTokens; }
  // Whether kernels read the plan from the workspace (device memory) rather than from the plan object.
  virtual bool plan_in_device_memory() const { return false; }
  // Copies host bytes to device memory, asynchronously on `stream` (device backends only).
  virtual void copy_to_device(void* dst, const void* src, size_t bytes, Stream stream) {
    (void)dst, (void)src, (void)bytes, (void)stream;
  }
  // Runs a planned batch; `kind` picks the kernel family (decode or prefill) the plan was cut for.
  virtual void attention(const AttentionParams& params, PlanKind kind, Stream stream) = 0;
  // A custom variant (attnforge/variant.h) over a planned batch; `args.options` is filled by the backend. Device
  // backends only: the CPU runs variants through the host compiler (jit/variant.cc).
  virtual void attention_variant(const AttentionParams& params, PlanKind kind, const std::string& name,
                                 const std::string& source, const VariantArgs& args, Stream stream);
  virtual void merge_states(const MergeStatesParams& params, Stream stream) = 0;
  virtual void append_kv(const AppendKVParams& params, Stream stream) = 0;
  virtual void rope(const RopeApplyParams& params, Stream stream) = 0;
};

// The backend for a device; throws kUnsupported naming the device and the devices this build serves.
Backend& backend_for(Device device);

struct Selection {
  Backend* backend = nullptr;
  Support support;
  bool invalid = false;  // the configuration itself is wrong (e.g. heads that do not divide), for every backend
};
Selection select(const AttentionConfig& config);

// select(), throwing kUnsupported with the reason when the configuration cannot run.
Backend& require(const AttentionConfig& config);

}  // namespace attnforge::detail
