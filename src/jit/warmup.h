// jit::warmup on a given cache and settings (the public warmup() uses the process cache and the current
// settings); the benchmark times cold warm-ups with fresh caches through it.
#pragma once

#include "attnforge/jit.h"
#include "jit/kernel_cache.h"

namespace attnforge::jit {

WarmupReport warmup_with(KernelCache& cache, const CacheSettings& settings, const std::vector<AttentionConfig>& configs,
                         const WarmupOptions& options);

}  // namespace attnforge::jit
