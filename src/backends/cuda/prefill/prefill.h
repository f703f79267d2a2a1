#pragma once

#include <cuda_runtime.h>

#include "attnforge/kernel/params.h"
#include "backends/cuda/prefill/tile_config.cuh"

namespace attnforge::cuda {

int prefill_ctas_per_sm(int head_dim);
// Grid sizes come from the plan's capacities, never its counts (see decode.h), so graphs survive re-plans.
void run_prefill(const AttentionParams& p, cudaStream_t stream);

}  // namespace attnforge::cuda
