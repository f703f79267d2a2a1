// run_context_parallel on CUDA: the rank's run, the in-place all-gather over NCCL, the merge; and the communicators
// made for callers without one (attnforge/context_parallel.h).
#include <cstring>

#include "attnforge/context_parallel.h"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/nccl_api.h"
#include "core/check.h"

namespace attnforge {

std::string nccl_unique_id() {
  cuda::NcclUniqueId id{};
  ATTNFORGE_NCCL_CHECK(cuda::nccl().ncclGetUniqueId(&id));
  static_assert(sizeof(id.internal) == kNcclUniqueIdBytes);
  return std::string(id.internal, sizeof(id.internal));
}

void* nccl_comm_init_rank(int32_t world_size, int32_t rank, const std::string& unique_id, int32_t cuda_device) {
  if (world_size < 1) detail::fail_arg("world_size: {}; expected >= 1", world_size);
  if (rank < 0 || rank >= world_size) detail::fail_arg("rank: {}; expected in [0, {})", rank, world_size);
  if (unique_id.size() != kNcclUniqueIdBytes)
    detail::fail_arg("unique_id: {} bytes; expected the {} bytes of nccl_unique_id() from one rank", unique_id.size(),
                     kNcclUniqueIdBytes);
  int count = 0;
  ATTNFORGE_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (cuda_device < 0 || cuda_device >= count)
    detail::fail_arg("device: cuda:{}; expected one of cuda:0 .. cuda:{} ({} visible)", cuda_device, count - 1, count);
  cuda::NcclUniqueId id{};
  std::memcpy(id.internal, unique_id.data(), kNcclUniqueIdBytes);
  int previous = 0;
  ATTNFORGE_CUDA_CHECK(cudaGetDevice(&previous));
  ATTNFORGE_CUDA_CHECK(cudaSetDevice(cuda_device));
  cuda::NcclComm comm = nullptr;
  const int result = cuda::nccl().ncclCommInitRank(&comm, world_size, id, rank);
  cudaSetDevice(previous);
  cuda::check_nccl(result, "ncclCommInitRank");
  return comm;
}

void nccl_comm_destroy(void* comm) {
  if (comm != nullptr) ATTNFORGE_NCCL_CHECK(cuda::nccl().ncclCommDestroy(comm));
}

NcclCommInfo nccl_comm_info(void* comm) {
  if (comm == nullptr) detail::fail_arg("communicator: null; expected an initialized ncclComm_t");
  const cuda::NcclApi& n = cuda::nccl();
  int count = 0, rank = 0, device = 0;
  ATTNFORGE_NCCL_CHECK(n.ncclCommCount(comm, &count));
  ATTNFORGE_NCCL_CHECK(n.ncclCommUserRank(comm, &rank));
  ATTNFORGE_NCCL_CHECK(n.ncclCommCuDevice(comm, &device));
  return {count, rank, device};
}

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
