// The state behind one FlashInfer-style wrapper: the caller's workspace, the current AttentionPlan, the page table
// where run() reads it, and the per-layer defaults given to plan(). plan() may stage metadata to the GPU; run()
// converts arrays to views and calls attnforge::run, nothing else.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "attnforge/attnforge.h"
#include "attnforge/context_parallel.h"
#include "staging.h"

namespace attnforge::python {

// One metadata array of the batch: its name (kv_indptr, kv_indices, last_page_len, block_table, seq_lens, mask,
// mask_indptr, alibi_slopes), a host copy (numpy, what plan() reads) and, for CUDA with fixed buffers (CUDA graphs),
// the device buffer to copy it into (None: a region after the plan's workspace).
using MetadataArray = std::tuple<std::string, nanobind::object, nanobind::object>;

struct PlanRequest {
  PlanKind kind = PlanKind::kDecode;
  KVFormat kv_format = KVFormat::kPagedCSR;
  int32_t page_size = 1;
  AttentionShape shape;
  PlanOptions options;
};

class BatchAttention {
 public:
  BatchAttention(nanobind::handle float_workspace, KVLayout layout);

  void plan(const PlanRequest& request, nanobind::handle qo_indptr, const std::vector<MetadataArray>& metadata,
            const AttentionOptions& defaults, uintptr_t stream);

  // run() arguments that override the plan's defaults for one call (one layer); unset: the plan's value.
  struct Overrides {
    std::optional<float> sm_scale, logits_soft_cap, q_scale, k_scale, v_scale;
    std::optional<int32_t> window_left;
    nanobind::handle sinks;  // None or float32 [num_qo_heads]
    std::optional<bool> enable_pdl;  // AttentionOptions::programmatic_launch (FlashInfer's run(enable_pdl=))
  };

  // kv_a, kv_b: paged: (k_cache, v_cache), or one [num_pages, 2, ...] tensor and None; ragged: (k, v).
  void run(nanobind::handle q, nanobind::handle kv_a, nanobind::handle kv_b, nanobind::handle out,
           nanobind::handle lse, uintptr_t stream, const Overrides& overrides);
  // run() with a custom variant (attnforge/variant.h): the paged cache only, on plans without KV splits; the
  // variant's extra tensors are arrays whose data pointers the hooks receive.
  void run_variant(nanobind::handle q, nanobind::handle kv_a, nanobind::handle kv_b, nanobind::handle out,
                   nanobind::handle lse, uintptr_t stream, const Overrides& overrides, const CustomVariant& variant,
                   const std::vector<float>& scalars, const std::vector<nanobind::handle>& tensors);
  // Context parallelism (attnforge/context_parallel.h), on a plan of this rank's share of the pages. Throws
  // Error(kUnsupported) naming the first default option (given to plan()) a split cannot honour.
  void check_context_parallel(KVPartition partition) const;
  // This rank's run() into its slot of `gathered` (the packed states of all ranks as `layout` says, checked by
  // gathered_states()); then, with a communicator (an ncclComm_t; 0: none), the all-gather and the merge into out
  // and lse (attnforge::run_context_parallel). Without one, only the slot is written: ranks simulated in one
  // process, or states the caller moves itself, merged by merge_gathered_states.
  void run_context_parallel(nanobind::handle q, nanobind::handle kv_a, nanobind::handle kv_b, nanobind::handle out,
                            nanobind::handle lse, uintptr_t stream, const Overrides& overrides,
                            const RankStateLayout& layout, KVPartition partition, nanobind::handle gathered,
                            int32_t rank, int32_t world_size, uintptr_t communicator);
  // The benchmark's baseline: the same call made `iterations` times from C++ with the arrays converted once.
  // Returns host seconds for all of them (GPU work is queued, not waited for).
  double time_repeated_run(nanobind::handle q, nanobind::handle kv_a, nanobind::handle kv_b, nanobind::handle out,
                           nanobind::handle lse, uintptr_t stream, int iterations);

  const AttentionPlan& attention_plan() const;
  // Bytes of the workspace this plan uses: the plan's own (AttentionPlan::workspace_bytes) plus, on CUDA, the
  // page table copied after it.
  size_t used_workspace_bytes() const { return used_bytes_; }
  size_t workspace_bytes() const { return ws_usable_; }
  Device device() const { return device_; }

 private:
  struct Tables {
    TensorView kv_indptr, kv_indices, last_page_len, block_table, seq_lens, mask, mask_indptr, alibi_slopes;
    TensorView* find(const std::string& name);
  };

  struct Call {
    TensorView q;
    PagedKVCache paged;
    RaggedKV ragged;
    Outputs outputs;
    AttentionOptions options;
    Stream stream = nullptr;
  };
  Call prepare(nanobind::handle q, nanobind::handle kv_a, nanobind::handle kv_b, nanobind::handle out,
               nanobind::handle lse, uintptr_t stream, const Overrides& overrides) const;
  void execute(const Call& call) const;
  void place_on_device(const std::vector<MetadataArray>& metadata, Tables& host, Stream stream);

  Device device_;
  KVLayout layout_;
  void* ws_ = nullptr;      // 256-byte aligned start inside the caller's buffer
  size_t ws_usable_ = 0;    // bytes from ws_ to the end of the buffer
  size_t used_bytes_ = 0;
  bool planned_ = false;
  AttentionPlan plan_;
  Tables tables_;           // where run() reads them (host views on the CPU; device memory on CUDA)
  AttentionOptions defaults_;
  PinnedStaging staging_;
};

// The start of the packed states of `world_size` ranks in `buffer` (the first 256-byte aligned address in it, as
// for the workspace), checking its device, contiguity and size (world_size x layout.rank_bytes() from there).
void* gathered_states(nanobind::handle buffer, const RankStateLayout& layout, int32_t world_size, Device* device);

}  // namespace attnforge::python
