// What the GPU probes (bench/*_probe.cu, standalone nvcc programs run by scripts/device-check probe) share: an error
// check that ends the program, the global timer, and a kernel's span (its first CTA's start to its last CTA's end)
// kept in two words, stamps[0] the minimum start and stamps[1] the maximum end, reset by the host before each launch.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                       \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::printf("%s failed: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void stamp_start(unsigned long long* stamps, unsigned long long t) {
  if (threadIdx.x == 0) atomicMin(stamps, t);
}
// After every thread of the CTA is done.
__device__ __forceinline__ void stamp_end(unsigned long long* stamps) {
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(stamps + 1, now_ns());
}
