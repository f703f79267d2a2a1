// Launch of the decode kernel and of the merge of its split KV. The launch configuration (grid, block, shared
// memory, attributes) is computed here once for both builds of the kernels: the nvcc-compiled instantiations
// (run_decode) and the NVRTC compiled ones (backends/cuda/jit_kernels.h).
#pragma once

#include <cuda_runtime.h>

#include "attnforge/kernel/params.h"
#include "backends/cuda/kernel_config.h"

namespace attnforge::cuda {

KernelAttributes decode_attributes(int head_dim, DType kv_dtype, int stages);
LaunchConfig decode_launch_config(const AttentionParams& p, int stages);
// Whether the decode kernel is launched as a programmatic dependent of the kernel before it on the stream (sm_90+,
// unless ATTNFORGE_DECODE_PDL=0; AttentionParams::programmatic_launch decides per call): its CTAs may be scheduled
// during that kernel's tail and read the plan's metadata (written only by upload_plan's copy) before
// griddepcontrol.wait; Q, the page table, K/V and every option tensor are read after it, and nothing is written
// before it.
bool decode_programmatic_launch();

// The nvcc-compiled kernels (the default tile configuration, default_decode_stages(kv_dtype)).
int decode_ctas_per_sm(int head_dim, DType kv_dtype);
// The CTAs per SM of the small-batch pipeline's kernel for the shape (small_batch_decode_stages), 0 where none is
// built. run_decode launches it for plans whose kv_stages name it.
int decode_small_batch_ctas_per_sm(int head_dim, DType q_dtype, DType kv_dtype);
void run_decode(const AttentionParams& p, cudaStream_t stream);

}  // namespace attnforge::cuda
