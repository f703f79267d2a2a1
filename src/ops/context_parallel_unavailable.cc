// run_context_parallel in builds without CUDA (the CUDA build's is backends/cuda/context_parallel_nccl.cc).
#include "attnforge/context_parallel.h"
#include "core/check.h"

namespace attnforge {

void run_context_parallel(const AttentionPlan&, const TensorView&, const PagedKVCache&, const Outputs&,
                          const AttentionOptions&, const Workspace&, const RankStateLayout&, void*, int32_t, int32_t,
                          void*, Stream) {
  detail::fail(ErrorKind::kUnsupported, "run_context_parallel: this build has no CUDA backend (NCCL runs on GPUs); "
               "rebuild with the CUDA toolkit");
}

}  // namespace attnforge
