// Launch of the decode kernel (which merges its own split KV). The launch configuration (grid, block, shared memory, attributes) is
// computed here once for both builds of the kernels: the nvcc-compiled instantiations (run_decode) and the NVRTC
// compiled ones (backends/cuda/jit_decode.h).
#pragma once

#include <cuda_runtime.h>

#include "attnforge/kernel/params.h"
#include "backends/cuda/kernel_config.h"

namespace attnforge::cuda {

// Attributes a decode kernel gets once before its first launch: its dynamic shared memory limit, and a
// preference for shared memory over L1 so the CTAs the occupancy calculation counts on fit.
struct DecodeAttributes {
  int threads;
  int max_dynamic_smem;
  int carveout_percent;
};
DecodeAttributes decode_attributes(int head_dim, DType kv_dtype, int stages);

// Grid sizes come from the plan's capacities (fixed for a batch size), never from its counts, so a captured
// graph stays valid across re-plans; kernels loop over the counts they read from the workspace.
struct DecodeLaunchConfig {
  KernelDims decode;
};
DecodeLaunchConfig decode_launch_config(const AttentionParams& p, int stages);

// The nvcc-compiled kernels (the default tile configuration, default_decode_stages(kv_dtype)).
int decode_ctas_per_sm(int head_dim, DType kv_dtype);
void run_decode(const AttentionParams& p, cudaStream_t stream);

}  // namespace attnforge::cuda
