// run_context_parallel and the NCCL communicators in builds without CUDA (the CUDA build's are
// backends/cuda/context_parallel_nccl.cc).
#include "attnforge/context_parallel.h"
#include "core/check.h"

namespace attnforge {

namespace {

[[noreturn]] void no_nccl(const char* what) {
  detail::fail(ErrorKind::kUnsupported, "{}: this build has no CUDA backend (NCCL runs on GPUs); rebuild with the "
               "CUDA toolkit", what);
}

}  // namespace

void run_context_parallel(const AttentionPlan&, const TensorView&, const PagedKVCache&, const Outputs&,
                          const AttentionOptions&, const Workspace&, const RankStateLayout&, void*, int32_t, int32_t,
                          void*, Stream) {
  no_nccl("run_context_parallel");
}

std::string nccl_unique_id() { no_nccl("nccl_unique_id"); }
void* nccl_comm_init_rank(int32_t, int32_t, const std::string&, int32_t) { no_nccl("nccl_comm_init_rank"); }
void nccl_comm_destroy(void*) { no_nccl("nccl_comm_destroy"); }
NcclCommInfo nccl_comm_info(void*) { no_nccl("nccl_comm_info"); }

}  // namespace attnforge
