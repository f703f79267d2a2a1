// The tensor memory accelerator (sm_90): tiles of a global tensor described by a tensor map (made on the host:
// backends/cuda/tma.h) copied into shared memory by one thread's instruction, completing on an mbarrier by byte
// count. With the 128-byte swizzle, a box whose rows are 64 16-bit elements lands exactly as a wgmma panel
// (device/wgmma.cuh, panel_bytes in device/tiles.cuh): chunk c of row r at r * 128 + ((c ^ (r % 8)) * 16) from a
// 1024-byte aligned panel, so K/V tiles can be copied without the copying warpgroup's per-row work.
// Self-contained for NVRTC (no cuda.h: TensorMap, kernel/params.h, stands in for CUtensorMap).
#pragma once

#include "attnforge/kernel/types.h"
#include "backends/cuda/device/ptx.cuh"
#include "attnforge/kernel/params.h"

namespace attnforge::cuda::tma {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// An arrival on `bar` that also raises the bytes the current phase waits for by `bytes` (the copies to come).
__device__ __forceinline__ void arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}

// Box at coordinates (c0, c1, c2, c3) of the 4-dimensional tensor `map` (a __grid_constant__ parameter: the
// instruction reads it through its generic address) into `dst` (aligned as the map's swizzle
// needs: 1024 bytes for 128-byte rows, or a multiple of 8 rows past such an address); the copy's bytes count
// against the current phase of `bar`.
__device__ __forceinline__ void load_4d(void* dst, const TensorMap* map, int c0, int c1, int c2, int c3,
                                        uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];\n" ::"r"(smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_address(bar))
      : "memory");
}

// Brings the descriptor into the cache ahead of the first copy that reads it.
__device__ __forceinline__ void prefetch_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
#endif

}  // namespace attnforge::cuda::tma
