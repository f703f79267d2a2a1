// Context parallelism: one batch's paged KV cache split over `world_size` ranks (GPUs). Each rank plans and runs
// the ordinary batch decode or prefill on its share of the pages, with LSE, and the ranks' attention states
// (o, lse) are merged exactly by merge_states. Queries are replicated: every rank holds all of q.
//
// What is built: the host-side partition of a page table (partition_pages), the check of which options a split
// can honour (check_context_parallel_options), the packed per-rank state layout (RankStateLayout) and the merge
// of gathered states (merge_gathered_states, on the CPU or a CUDA device). Tests simulate the ranks in one process:
// on the CPU (tests/test_context_parallel.cc) and on one GPU (CudaContextParallel in tests/cuda/test_cuda.cc); with
// several GPUs, CudaContextParallel.NcclRanksOnSeparateGpus runs one thread per GPU over NCCL.
//
// The NCCL transport (run_context_parallel, CUDA builds): every rank runs into its own slot of one buffer holding
// all ranks' packed states (RankStateLayout below: o, then lse, per rank), then one in-place
// ncclAllGather(slot, buffer, rank_bytes, ncclChar, comm, stream) per call fills the other ranks' slots, and
// merge_gathered_states reads the buffer in place. The caller owns the communicator. run, the all-gather and
// the merge are all stream-ordered and allocate nothing, so the three are captured together in a CUDA graph.
// Every launcher and test sets NCCL_NVLS_ENABLE=0 (NVLink multicast stays off on the machines we run on).
//
// Positions. Causal masks, sliding windows, ALiBi, RoPE and custom masks all depend on a KV token's absolute
// position in its request; a rank's plan only sees its own share and numbers its tokens from 0. This first
// version therefore accepts only options that do not depend on positions (sm_scale, logits soft-cap) and
// rejects the rest, naming the option and the reason, for both partitions. Decode with one query token per
// request needs no causal mask, so it runs with causal = false. Attention sinks are rejected too: every rank's
// softmax would include the sink logit, so the merge would count it world_size times. With kContiguous a rank's
// positions are one interval, so positions could later be handled by per-rank offsets; with kRoundRobinPages
// they are not an interval, and position-dependent options stay rejected.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "attnforge/ops.h"

namespace attnforge {

enum class KVPartition : int32_t {
  // Rank r holds pages [floor(r * P / W), floor((r + 1) * P / W)) of each request of P pages: one interval of
  // positions per rank.
  kContiguous = 0,
  // Rank r holds pages r, r + W, r + 2W, ... of each request: balanced for any length, positions interleaved.
  kRoundRobinPages = 1,
};

std::string to_string(KVPartition p);

// One rank's share of a batch, as a CSR page table in host memory (owned here; table() views it). Requests keep
// their batch index; a request with no page on this rank has no pages and last_page_len 0 (kv_len 0), and its
// state from run() is the identity of the merge (o = 0, lse = -inf).
struct RankPageTable {
  std::vector<int32_t> indptr;         // [batch + 1]
  std::vector<int32_t> indices;        // [indptr[batch]] page ids into the same K/V cache as the whole table
  std::vector<int32_t> last_page_len;  // [batch]; page_size for a share whose last page is not the request's
  std::vector<int32_t> kv_len;         // [batch] tokens of each request on this rank

  // Host views of the vectors, for BatchPlanArgs::set_paged; copy them to the device for a CUDA run().
  PageTable table() const;
};

// The share of `rank` of the batch whose page table is `host_table` (CSR or block table, in host memory).
// Every token of every request is on exactly one rank. Only a request's last page may be partly filled, and
// it goes to one rank, so every other share is made of whole pages.
RankPageTable partition_pages(const PageTable& host_table, int32_t page_size, int32_t world_size, int32_t rank,
                              KVPartition partition);

// Throws Error(kUnsupported) naming the first option a context-parallel run cannot honour, and why.
void check_context_parallel_options(const AttentionOptions& options, KVPartition partition);

// The layout of the packed states of all ranks in one buffer: rank r's slot starts at r * rank_bytes() and
// holds o [n, heads, dim] of o_dtype, then (at a 256-byte aligned offset) lse float32 [n, heads]. n is the
// batch's query tokens.
struct RankStateLayout {
  int64_t n = 0;
  int32_t num_heads = 0;
  int32_t head_dim = 0;
  DType o_dtype = DType::kFloat32;  // float32 keeps the partial states exact to fp32 until the merge

  size_t lse_offset() const;  // bytes from a slot's start to its lse
  size_t rank_bytes() const;  // one slot, 256-byte aligned
  // Outputs for rank r's run() (o and lse inside its slot of `buffer`).
  Outputs rank_outputs(void* buffer, int32_t rank, Device device = Device::cpu()) const;
};

// Merges the states of `world_size` ranks packed in `buffer` as `layout` says into outputs (out [n, heads, dim],
// lse optional [n, heads]). The slots are read in place through strided [n, world_size, heads, dim] views.
void merge_gathered_states(const RankStateLayout& layout, const void* buffer, int32_t world_size,
                           const Outputs& outputs, Device device = Device::cpu(), Stream stream = nullptr);

// One rank's context-parallel step on CUDA, all on `stream`: run() of its share (rank_plan made from its
// RankPageTable, uploaded to `workspace`; rank_kv's table is its share, in device memory) into its slot of
// `gathered` (world_size x layout.rank_bytes() bytes of device memory, the same on every rank), an in-place
// ncclAllGather of the slots over `nccl_comm` (an ncclComm_t of world_size ranks, one GPU each, owned by the
// caller), then merge_gathered_states into `outputs`. Allocates nothing and never synchronizes, so a CUDA graph
// captures the three (NCCL calls are capturable). NCCL is opened at run time (libnccl.so.2, or
// ATTNFORGE_NCCL_LIBRARY); keep NCCL_NVLS_ENABLE=0 in the environment on machines where NVLink multicast is off.
// Builds without CUDA throw Error(kUnsupported).
void run_context_parallel(const AttentionPlan& rank_plan, const TensorView& q, const PagedKVCache& rank_kv,
                          const Outputs& outputs, const AttentionOptions& options, const Workspace& workspace,
                          const RankStateLayout& layout, void* gathered, int32_t rank, int32_t world_size,
                          void* nccl_comm, Stream stream = nullptr);

// NCCL communicators for callers that have no ncclComm_t of their own (the Python bindings). The caller shares
// the 128 bytes of nccl_unique_id() from one rank with the others (any channel), then every rank calls
// nccl_comm_init_rank with them, collectively. CUDA builds only; others throw Error(kUnsupported).
constexpr size_t kNcclUniqueIdBytes = 128;
std::string nccl_unique_id();  // ncclGetUniqueId's ncclUniqueId, as its bytes
// An ncclComm_t of `world_size` ranks on CUDA device `cuda_device` (made current for the call, then restored);
// the caller destroys it with nccl_comm_destroy. Blocks until every rank has called it.
void* nccl_comm_init_rank(int32_t world_size, int32_t rank, const std::string& unique_id, int32_t cuda_device);
void nccl_comm_destroy(void* comm);
// What NCCL says about a communicator (ncclCommCount, ncclCommUserRank, ncclCommCuDevice): how a communicator
// made elsewhere (cupy, torch's ProcessGroupNCCL) is checked against the world size and rank it is used with.
struct NcclCommInfo {
  int32_t world_size = 0;
  int32_t rank = 0;
  int32_t cuda_device = 0;
};
NcclCommInfo nccl_comm_info(void* comm);

}  // namespace attnforge
