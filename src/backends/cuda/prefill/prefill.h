#pragma once

#include <cuda_runtime.h>

#include "attnforge/kernel/params.h"
#include "backends/cuda/prefill/tile_config.h"

namespace attnforge::cuda {

// Grid sizes come from the plan's capacities, never its counts (see DecodeLaunch).
struct PrefillLaunch {
  int item_capacity;
  int merge_capacity;
  int row_blocks;  // ceil(query rows per item / prefill_rows(head_dim))
};

int prefill_ctas_per_sm(int head_dim);
void run_prefill(const AttentionParams& p, const PrefillLaunch& launch, cudaStream_t stream);

}  // namespace attnforge::cuda
