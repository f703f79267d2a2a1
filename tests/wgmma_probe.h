// Probe kernels for the wgmma building blocks (src/backends/cuda/device/wgmma.cuh), compiled at run time for
// sm_90a: test_jit.cc compiles them (any machine with NVRTC), tests/cuda/test_cuda.cc runs them on a Hopper GPU
// against a float64 product. One warpgroup, one 64 x 64 x 64 product each:
//   wgmma_probe_ss: c[m][n] = sum_k a[m][k] b[n][k]   (A and B from shared memory, both K-major: S = Q K^T)
//   wgmma_probe_rs: c[m][n] = sum_t a[m][t] v[t][n]   (A from registers, V MN-major in shared memory: O = P V)
// Inputs are bf16 bits, row-major [64][64]; c is float, row-major [64][64].
#pragma once

#include <string>

#include "jit/nvrtc_compiler.h"

namespace attnforge::testing {

inline jit::KernelSource wgmma_probe_source() {
  jit::KernelSource s;
  s.name = "wgmma_probe_sm90a";
  s.arch = "sm_90a";
  s.entry_points = {"&wgmma_probe_ss", "&wgmma_probe_rs"};
  s.source = R"(#include "backends/cuda/device/ptx.cuh"
#include "backends/cuda/device/wgmma.cuh"
using namespace attnforge;
using namespace attnforge::cuda;

// Writes a [64][64] 16-bit row-major matrix into a 64-column panel in the 128-byte swizzle.
__device__ void to_panel(const uint16_t* src, uint16_t* panel) {
  for (int i = threadIdx.x; i < 64 * 64; i += 128)
    panel[wgmma::swizzled_offset(i / 64, i % 64) / 2] = src[i];
}

// The accumulator fragment of this thread to c (see wgmma.cuh).
__device__ void store_d(const float d[32], float* c) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = 0; j < 8; ++j)
    for (int e = 0; e < 4; ++e)
      c[(16 * warp + lane / 4 + 8 * (e / 2)) * 64 + 8 * j + 2 * (lane % 4) + e % 2] = d[4 * j + e];
}

__global__ void __launch_bounds__(128) wgmma_probe_ss(const uint16_t* a, const uint16_t* b, float* c) {
  __shared__ __align__(1024) uint16_t sa[64 * 64];
  __shared__ __align__(1024) uint16_t sb[64 * 64];
  to_panel(a, sa);
  to_panel(b, sb);
  wgmma::fence_operands();
  __syncthreads();
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  wgmma::fence();
  for (int k = 0; k < 4; ++k)
    wgmma::m64n64k16_ss(d, wgmma::k_major(smem_address(sa), k), wgmma::k_major(smem_address(sb), k), k > 0,
                        wgmma::Bf16Tag{});
  wgmma::commit();
  wgmma::wait<0>();
  store_d(d, c);
}

__global__ void __launch_bounds__(128) wgmma_probe_rs(const uint16_t* a, const uint16_t* v, float* c) {
  __shared__ __align__(1024) uint16_t sv[64 * 64];
  to_panel(v, sv);  // row = token (the product's K), 64 dims (N) along it
  wgmma::fence_operands();
  __syncthreads();
  // A fragments of the four k16 steps, mma.m16n8k16 layout: warp w's rows 16 w + lane / 4 (+ 8), columns
  // 16 k + 2 (lane % 4) (+ 8), two elements a register.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t* a32 = reinterpret_cast<const uint32_t*>(a);
  uint32_t frag[4][4];
  for (int k = 0; k < 4; ++k) {
    const int r0 = 16 * warp + lane / 4, c0 = 16 * k + 2 * (lane % 4);
    frag[k][0] = a32[(r0 * 64 + c0) / 2];
    frag[k][1] = a32[((r0 + 8) * 64 + c0) / 2];
    frag[k][2] = a32[(r0 * 64 + c0 + 8) / 2];
    frag[k][3] = a32[((r0 + 8) * 64 + c0 + 8) / 2];
  }
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  wgmma::fence();
  for (int k = 0; k < 4; ++k)
    wgmma::m64n64k16_rs_tb(d, frag[k], wgmma::mn_major(smem_address(sv), k, 64 * 128), k > 0, wgmma::Bf16Tag{});
  wgmma::commit();
  wgmma::wait<0>();
  store_d(d, c);
}
)";
  return s;
}

}  // namespace attnforge::testing
