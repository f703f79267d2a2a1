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

// As load_4d, from a 3-dimensional tensor.
__device__ __forceinline__ void load_3d(void* dst, const TensorMap* map, int c0, int c1, int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_address(bar))
      : "memory");
}

// Box at coordinates (c0, c1, c2) of the 3-dimensional tensor `map` written from `src` (aligned as for load_4d), a
// bulk copy of this thread's current bulk group (store_commit closes it). The writes this CTA's threads made to
// `src` must be made visible to the accelerator first: each writer's proxy fence (fence.proxy.async.shared::cta,
// wgmma::fence_operands), then a barrier.
__device__ __forceinline__ void store_3d(const TensorMap* map, int c0, int c1, int c2, const void* src) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(smem_address(src))
               : "memory");
}
__device__ __forceinline__ void store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until this thread's committed bulk groups have read their shared memory (it may be written again).
__device__ __forceinline__ void store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Until they have completed (their global writes done).
__device__ __forceinline__ void store_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Brings the descriptor into the cache ahead of the first copy that reads it.
__device__ __forceinline__ void prefetch_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
#endif

}  // namespace attnforge::cuda::tma
