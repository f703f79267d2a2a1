// run_context_parallel on CUDA: the rank's run, the in-place all-gather over NCCL, the merge (attnforge/context_parallel.h).
#include "attnforge/context_parallel.h"
#include "backends/cuda/nccl_api.h"
#include "core/check.h"

namespace attnforge {

void run_context_parallel(const AttentionPlan& rank_plan, const TensorView& q, const PagedKVCache& rank_kv,
                          const Outputs& outputs, const AttentionOptions& options, const Workspace& workspace,
                          const RankStateLayout& layout, void* gathered, int32_t rank, int32_t world_size,
                          void* nccl_comm, Stream stream) {
  if (rank_plan.device.type != DeviceType::kCUDA)
    detail::fail(ErrorKind::kUnsupported, "run_context_parallel on {}: NCCL moves states between GPUs; simulate ranks "
                 "on the CPU with run and merge_gathered_states", to_string(rank_plan.device));
  if (world_size < 1 || rank < 0 || rank >= world_size)
    detail::fail_arg("rank {} of world_size {}: expected 0 <= rank < world_size", rank, world_size);
  if (gathered == nullptr) detail::fail_arg("gathered: null; expected {} bytes of device memory", world_size * layout.rank_bytes());
  if (nccl_comm == nullptr) detail::fail_arg("nccl_comm: null; expected the caller's ncclComm_t of {} ranks", world_size);
  check_context_parallel_options(options, KVPartition::kRoundRobinPages);
  run(rank_plan, q, rank_kv, layout.rank_outputs(gathered, rank, rank_plan.device), options, workspace, stream);
  const size_t bytes = layout.rank_bytes();
  auto* base = static_cast<char*>(gathered);
  ATTNFORGE_NCCL_CHECK(cuda::nccl().ncclAllGather(base + rank * bytes, base, bytes, cuda::kNcclInt8, nccl_comm,
                                                  static_cast<cudaStream_t>(stream)));
  merge_gathered_states(layout, gathered, world_size, outputs, rank_plan.device, stream);
}

}  // namespace attnforge
