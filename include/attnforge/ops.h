// The operators. Every tensor must live on one device; the backend is chosen by that device.
// `stream` is a cudaStream_t for CUDA tensors and ignored on the CPU.
#pragma once

#include "attnforge/config.h"
#include "attnforge/kv_cache.h"
#include "attnforge/options.h"
#include "attnforge/plan.h"

namespace attnforge {

using Stream = void*;

// Attention outputs: out [tokens, num_qo_heads, head_dim_vo] and, optionally, lse float32 [tokens, num_qo_heads]
// in log2 units: lse = log2(sum_j exp(logit_j)), sinks included. An empty KV set gives out 0 and lse -inf.
struct Outputs {
  TensorView out;
  TensorView lse;
};

// ---- plan / run ----
AttentionPlan plan_batch_decode(const BatchPlanArgs& args);
AttentionPlan plan_batch_prefill(const BatchPlanArgs& args);

// Makes the plan's metadata visible to run(). On CUDA: writes it to the start of the workspace with one
// cudaMemcpyAsync on `stream`, staged through `host_staging` (page-locked memory of plan.staging_bytes bytes,
// which must stay untouched until that copy has run). It never synchronizes and never allocates. Call it after
// every plan_*; re-planning a batch of the same size and uploading into the same workspace is how a captured
// CUDA graph is pointed at new lengths. On the CPU it only records the workspace.
void upload_plan(AttentionPlan& plan, const Workspace& workspace, void* host_staging = nullptr,
                 size_t host_staging_bytes = 0, Stream stream = nullptr);

// q [total_qo, num_qo_heads, head_dim_qk]. Allocates nothing, never synchronizes; the workspace must hold
// plan.workspace_bytes (and, on CUDA, the uploaded plan). The page table and K/V must describe the batch the
// plan was made for.
void run(const AttentionPlan& plan, const TensorView& q, const PagedKVCache& kv, const Outputs& outputs,
         const AttentionOptions& options, const Workspace& workspace, Stream stream = nullptr);
void run(const AttentionPlan& plan, const TensorView& q, const RaggedKV& kv, const Outputs& outputs,
         const AttentionOptions& options, const Workspace& workspace, Stream stream = nullptr);

// ---- single request, contiguous KV ----
// k, v: NHD [kv_len, num_kv_heads, head_dim] or HND [num_kv_heads, kv_len, head_dim].
// single_decode: q [num_qo_heads, head_dim]; out [num_qo_heads, head_dim_vo]; lse [num_qo_heads].
// They plan and run in one call. On the CPU they need nothing else. On CUDA they need `workspace`: device memory
// of at least single_workspace_bytes(...) bytes (256-byte aligned), where the plan (with its KV splits, so a long
// request uses every SM) and the KV offsets are copied from pageable host memory: the call waits for `stream` to
// reach it, so it cannot be captured in a CUDA graph (the batch API can).
void single_decode(const TensorView& q, const TensorView& k, const TensorView& v, KVLayout layout,
                   const Outputs& outputs, const AttentionOptions& options = {}, float k_scale = 1.f,
                   float v_scale = 1.f, Stream stream = nullptr, const Workspace& workspace = {});
// single_prefill: q [qo_len, num_qo_heads, head_dim]; out [qo_len, num_qo_heads, head_dim_vo].
void single_prefill(const TensorView& q, const TensorView& k, const TensorView& v, KVLayout layout,
                    const Outputs& outputs, const AttentionOptions& options = {}, float k_scale = 1.f,
                    float v_scale = 1.f, Stream stream = nullptr, const Workspace& workspace = {});
// The workspace single_decode (kind kDecode, qo_len 1) or single_prefill needs on `device` (0 on the CPU).
size_t single_workspace_bytes(PlanKind kind, const AttentionShape& shape, int32_t qo_len, int32_t kv_len,
                              Device device, bool causal = false);

// ---- attention states ----
// merge_state: v_a, v_b [n, heads, dim] (fp32/fp16/bf16), s_a, s_b float32 [n, heads] (log2);
// writes outputs.out [n, heads, dim] and outputs.lse [n, heads] (optional).
void merge_state(const TensorView& v_a, const TensorView& s_a, const TensorView& v_b, const TensorView& s_b,
                 const Outputs& outputs, Stream stream = nullptr);
// merge_states: v [n, num_states, heads, dim], s float32 [n, num_states, heads].
void merge_states(const TensorView& v, const TensorView& s, const Outputs& outputs, Stream stream = nullptr);

// ---- cache and position utilities ----
// Scatters append_k/append_v [nnz, num_kv_heads, head_dim] into the paged cache: row r goes to request
// batch_indices[r] at token position positions[r] (both int32 [nnz]). Values are converted to the cache dtype
// (divided by the cache scale for fp8).
void append_paged_kv_cache(const TensorView& append_k, const TensorView& append_v, const TensorView& batch_indices,
                           const TensorView& positions, const PagedKVCache& cache, Stream stream = nullptr);

// Rotates q [nnz, num_qo_heads, head_dim] and k [nnz, num_kv_heads, head_dim] into q_out and k_out (which may
// alias q and k). Row r of request b (indptr int32 [batch + 1]) is at position r - indptr[b] + offsets[b].
void apply_rope(const TensorView& q, const TensorView& k, const TensorView& q_out, const TensorView& k_out,
                const TensorView& indptr, const TensorView& offsets, const RopeOptions& rope,
                Stream stream = nullptr);
// Same with an explicit int32 position per row: pos_ids [nnz].
void apply_rope_pos_ids(const TensorView& q, const TensorView& k, const TensorView& q_out, const TensorView& k_out,
                        const TensorView& pos_ids, const RopeOptions& rope, Stream stream = nullptr);

}  // namespace attnforge
