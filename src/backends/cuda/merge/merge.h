#pragma once

#include <cuda_runtime.h>

#include <string>

#include "attnforge/kernel/op_params.h"
#include "attnforge/kernel/params.h"
#include "backends/cuda/kernel_config.h"

namespace attnforge::cuda {

// The merge of split-KV partial states: one CTA per (merge item, query head), grid-stride over the plan's
// merges. The grid comes from the plan's merge capacity, so a captured graph survives re-plans. Shared by the
// nvcc-compiled launch below and the NVRTC-compiled one (backends/cuda/jit_kernels.h).
KernelDims merge_dims(const AttentionParams& p);

// Launches the nvcc-compiled merge kernel; a no-op when the plan has no merge capacity.
void run_merge(const AttentionParams& p, cudaStream_t stream);

// Whether the merge kernel is launched as a programmatic dependent of the attention kernel on the current device:
// compute capability 9.0 or newer, unless ATTNFORGE_MERGE_PDL=0 (a measuring knob: the plain launch for A/B runs).
bool merge_programmatic_launch();

// ATTNFORGE_DECODE_KERNEL_MERGE, read once: "1" (unset) or "kernel", "0", "several" or "stream" (CudaBackend::
// decode_merge says what each does).
const std::string& decode_kernel_merge_mode();
// Whether that mode is "stream", the one that launches the streamed merge kernel: CudaBackend::decode_merge plans
// for it, and the run-time compiled kernels load and warm its module only then.
bool decode_merges_streamed();

// The merge_state / merge_states operators on `stream`.
void run_merge_states(const MergeStatesParams& p, cudaStream_t stream);

}  // namespace attnforge::cuda
