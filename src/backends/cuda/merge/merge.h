#pragma once

#include <cuda_runtime.h>

#include "attnforge/kernel/params.h"

namespace attnforge::cuda {

// Launches the merge of split-KV partial states: one CTA per (merge item, query head), grid-stride over the
// plan's merges. merge_capacity comes from the plan, so a captured graph survives re-plans. No-op when 0.
void run_merge(const AttentionParams& p, int merge_capacity, cudaStream_t stream);

}  // namespace attnforge::cuda
