// Shared-memory barriers with phases (mbarrier), the copies that arrive on them, named barriers and the warpgroup
// register reallocation: the synchronization of warp-specialized kernels, where a producer warpgroup fills pipeline
// stages that consumer warpgroups drain without a CTA-wide barrier per stage. sm_90 (setmaxnreg: sm_90a).
// Self-contained for NVRTC.
#pragma once

#include "attnforge/kernel/types.h"
#include "backends/cuda/device/ptx.cuh"

namespace attnforge::cuda::mbar {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// One thread initializes each barrier (expected arrivals per phase); a CTA barrier must follow before any use.
__device__ __forceinline__ void init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(count) : "memory");
}
// One arrival of this thread (release: its earlier shared-memory reads and writes happen before the phase ends).
__device__ __forceinline__ void arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(bar)) : "memory");
}
// One arrival when every cp.async this thread issued before it has completed; `noinc`: the arrival is one of the
// barrier's expected count (the producer threads), not an extra one.
__device__ __forceinline__ void arrive_on_copies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_address(bar)) : "memory");
}
// Waits until the phase of parity `parity` has completed (acquire: the arrivals' writes are visible after it).
__device__ __forceinline__ void wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_AGAIN:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_AGAIN;\n}\n" ::"r"(smem_address(bar)),
      "r"(parity)
      : "memory");
}
// A barrier among `threads` threads (a multiple of 32) of the CTA, id 1..15 (0 is __syncthreads).
__device__ __forceinline__ void named_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The warpgroup's registers per thread after this point (every thread of the warpgroup executes it).
template <int kRegs>
__device__ __forceinline__ void grow_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void shrink_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
#endif

}  // namespace attnforge::cuda::mbar
