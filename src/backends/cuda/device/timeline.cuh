// Per-CTA timelines of the decode and merge kernels, for trace builds only (-DATTNFORGE_TIMELINE=1; never by
// default, never under NVRTC). Each CTA's first thread leaves the global timer at its start and end, the clock
// cycles of its phases and its SM in one slot of `timeline`; the launcher prints the slots after the launch
// (print_timeline) and scripts/timeline.py turns them into a picture of the grid: when CTAs start, how long their
// prologue and first tile take, when they end, and when the merge's CTAs pass their wait. Each translation unit that
// includes this has its own `timeline` (no relocatable device code), so each one prints its own kernels.
#pragma once

#if defined(ATTNFORGE_TIMELINE) && ATTNFORGE_TIMELINE && !defined(__CUDACC_RTC__)
#define ATTNFORGE_TIMELINE_ON 1
#define ATTNFORGE_TL(...) __VA_ARGS__
#include <cstdio>

#include <cuda_runtime.h>

namespace attnforge::cuda {

constexpr int kTimelineSlots = 4096, kTimelineFields = 21;
// Fields: 0 global ns at the start, 1 global ns at the end, 2..9 and 11..20 what the kernel says (clock cycles of
// its phases, or global times), 10 (SM << 32) | count (items or tiles).
static __device__ long long timeline[kTimelineSlots][kTimelineFields];

__device__ __forceinline__ long long global_ns() {
  long long t = 0;
#if defined(__CUDA_ARCH__)
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
#endif
  return t;
}
__device__ __forceinline__ long long sm_id() {
  unsigned s = 0;
#if defined(__CUDA_ARCH__)
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
#endif
  return s;
}
__device__ __forceinline__ long long cycles() {
#if defined(__CUDA_ARCH__)
  return clock64();
#else
  return 0;
#endif
}
__device__ __forceinline__ long long* timeline_slot() {
  const unsigned linear = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  return linear < kTimelineSlots ? timeline[linear] : nullptr;
}

// Waits for the stream, prints every used slot as "timeline KERNEL slot f0 .. f15" and clears them. Not while the
// stream is being captured. Per translation unit, like `timeline` (unused in the ones that only record).
[[maybe_unused]] static void print_timeline(const char* kernel, cudaStream_t stream) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess || capturing != cudaStreamCaptureStatusNone) return;
  static long long h[kTimelineSlots][kTimelineFields];
  static const long long zero[kTimelineSlots][kTimelineFields] = {};
  if (cudaStreamSynchronize(stream) != cudaSuccess || cudaMemcpyFromSymbol(h, timeline, sizeof h) != cudaSuccess ||
      cudaMemcpyToSymbol(timeline, zero, sizeof zero) != cudaSuccess) {
    std::printf("timeline %s: could not read the slots\n", kernel);
    return;
  }
  std::printf("timeline-launch %s\n", kernel);
  for (int s = 0; s < kTimelineSlots; ++s) {
    const long long* f = h[s];
    if (f[0] == 0) continue;
    std::printf("timeline %s %d", kernel, s);
    for (int i = 0; i < kTimelineFields; ++i) std::printf(" %lld", f[i]);
    std::printf("\n");
  }
}

}  // namespace attnforge::cuda
#else
#define ATTNFORGE_TL(...)
#endif
