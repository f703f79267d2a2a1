#pragma once

#include <cuda_runtime.h>

#include "attnforge/kernel/params.h"

namespace attnforge::cuda {

// Grid sizes come from the plan's capacities (fixed for a batch size), never from its counts, so a captured
// graph stays valid across re-plans; kernels loop over the counts they read from the workspace.
struct DecodeLaunch {
  int item_capacity;
  int merge_capacity;
  int row_blocks;  // ceil(query rows per item / 16)
};

int decode_ctas_per_sm(int head_dim);
void run_decode(const AttentionParams& p, const DecodeLaunch& launch, cudaStream_t stream);

}  // namespace attnforge::cuda
