// Probe kernels for the wgmma building blocks (src/backends/cuda/device/wgmma.cuh), compiled at run time for
// sm_90a: test_jit.cc compiles them (any machine with NVRTC), tests/cuda/test_cuda.cc runs them on a Hopper GPU
// against a float64 product. One warpgroup, one product each (kWgmmaProbes):
//   wgmma_probe_ss*: c[m][n] = sum_k a[m][k] b[n][k]   (A and B from shared memory, both K-major: S = Q K^T)
//   wgmma_probe_rs*: c[m][n] = sum_t a[m][t] v[t][n]   (A from registers, V MN-major in shared memory: O = P V)
// at N = K = 64 (one 64-element panel), at N = 128 (two panels: K = 128 for S, N = 128 for O, as head_dim 128), and
// with the 32-token K/V tiles of head_dim 256 (S: N = 32; O: K = 32 tokens in panels of 32 rows).
// Inputs are bf16 bits; c is float.
#pragma once

#include <string>

#include "jit/nvrtc_compiler.h"

namespace attnforge::testing {

// Shapes of the probes, in entry-point order: c [M][N] from a [M][K] and b ([N][K] for the K-major "ss" probes,
// [K][N] for the register-A "rs" ones). Every matrix is row-major with kProbeLd elements a row.
constexpr int kProbeLd = 128;
struct WgmmaProbe {
  const char* name;
  int m, n, k;
  bool b_k_major;  // b is [N][K] (c = a b^T); else [K][N] (c = a b)
};
constexpr WgmmaProbe kWgmmaProbes[] = {{"wgmma_probe_ss64", 64, 64, 64, true},
                                       {"wgmma_probe_rs64", 64, 64, 64, false},
                                       {"wgmma_probe_ss128", 64, 128, 128, true},
                                       {"wgmma_probe_rs128", 64, 128, 64, false},
                                       {"wgmma_probe_ss32", 64, 32, 128, true},
                                       {"wgmma_probe_rs128_k32", 64, 128, 32, false}};

inline jit::KernelSource wgmma_probe_source() {
  jit::KernelSource s;
  s.name = "wgmma_probe_sm90a";
  s.arch = "sm_90a";
  for (const WgmmaProbe& p : kWgmmaProbes) s.entry_points.push_back(std::string("&") + p.name);
  s.source = R"(#include "backends/cuda/device/ptx.cuh"
#include "backends/cuda/device/wgmma.cuh"
using namespace attnforge;
using namespace attnforge::cuda;
constexpr int kLd = 128;  // elements a row of every global matrix

// Rows [0, rows) and columns [col0, col0 + 64) of a row-major 16-bit matrix into a 64-column panel in the
// 128-byte swizzle.
__device__ void to_panel(const uint16_t* src, int rows, int col0, uint16_t* panel) {
  for (int i = threadIdx.x; i < rows * 64; i += 128)
    panel[wgmma::swizzled_offset(i / 64, i % 64) / 2] = src[(i / 64) * kLd + col0 + i % 64];
}

// This thread's accumulator fragment (N / 8 blocks of four, see wgmma.cuh) to c.
template <int N>
__device__ void store_d(const float* d, float* c) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = 0; j < N / 8; ++j)
    for (int e = 0; e < 4; ++e)
      c[(16 * warp + lane / 4 + 8 * (e / 2)) * kLd + 8 * j + 2 * (lane % 4) + e % 2] = d[4 * j + e];
}

// A fragments of k16 step k, mma.m16n8k16 layout: warp w's rows 16 w + lane / 4 (+ 8), columns 16 k + 2 (lane %
// 4) (+ 8), two elements a register.
__device__ void a_fragment(const uint16_t* a, int k, uint32_t f[4]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t* a32 = reinterpret_cast<const uint32_t*>(a);
  const int r0 = 16 * warp + lane / 4, c0 = 16 * k + 2 * (lane % 4);
  f[0] = a32[(r0 * kLd + c0) / 2];
  f[1] = a32[((r0 + 8) * kLd + c0) / 2];
  f[2] = a32[(r0 * kLd + c0 + 8) / 2];
  f[3] = a32[((r0 + 8) * kLd + c0 + 8) / 2];
}

// c = a b^T, M = N = K = 64: one panel each.
__global__ void __launch_bounds__(128) wgmma_probe_ss64(const uint16_t* a, const uint16_t* b, float* c) {
  __shared__ __align__(1024) uint16_t sa[64 * 64];
  __shared__ __align__(1024) uint16_t sb[64 * 64];
  to_panel(a, 64, 0, sa);
  to_panel(b, 64, 0, sb);
  wgmma::fence_operands();
  __syncthreads();
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  wgmma::fence();
  for (int k = 0; k < 4; ++k)
    wgmma::m64n64k16_ss(d, wgmma::k_major(smem_address(sa), k), wgmma::k_major(smem_address(sb), k), k > 0,
                        Bf16{});
  wgmma::commit();
  wgmma::wait<0>();
  store_d<64>(d, c);
}

// c = a v, M = N = K = 64: A from registers, V (rows = K) MN-major.
__global__ void __launch_bounds__(128) wgmma_probe_rs64(const uint16_t* a, const uint16_t* v, float* c) {
  __shared__ __align__(1024) uint16_t sv[64 * 64];
  to_panel(v, 64, 0, sv);
  wgmma::fence_operands();
  __syncthreads();
  uint32_t f[4][4];
  for (int k = 0; k < 4; ++k) a_fragment(a, k, f[k]);
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  wgmma::fence();
  for (int k = 0; k < 4; ++k)
    wgmma::m64n64k16_rs_tb(d, f[k], wgmma::mn_major(smem_address(sv), k, 64 * 128), k > 0, Bf16{});
  wgmma::commit();
  wgmma::wait<0>();
  store_d<64>(d, c);
}

// c = a b^T, M = 64, N = 128 (128 rows of b: the S tile of 128 tokens), K = 128 (two panels, as head_dim 128).
__global__ void __launch_bounds__(128) wgmma_probe_ss128(const uint16_t* a, const uint16_t* b, float* c) {
  __shared__ __align__(1024) uint16_t sa[2][64 * 64];
  __shared__ __align__(1024) uint16_t sb[2][128 * 64];
  for (int p = 0; p < 2; ++p) to_panel(a, 64, 64 * p, sa[p]), to_panel(b, 128, 64 * p, sb[p]);
  wgmma::fence_operands();
  __syncthreads();
  float d[64];
  for (int i = 0; i < 64; ++i) d[i] = 0.f;
  wgmma::fence();
  for (int k = 0; k < 8; ++k)
    wgmma::m64n128k16_ss(d, wgmma::k_major(smem_address(sa[k / 4]), k % 4),
                         wgmma::k_major(smem_address(sb[k / 4]), k % 4), k > 0, Bf16{});
  wgmma::commit();
  wgmma::wait<0>();
  store_d<128>(d, c);
}

// c = a v, M = 64, N = 128 (two panels of V's 128 dims, as O = P V at head_dim 128), K = 64 tokens.
__global__ void __launch_bounds__(128) wgmma_probe_rs128(const uint16_t* a, const uint16_t* v, float* c) {
  __shared__ __align__(1024) uint16_t sv[2][64 * 64];
  for (int p = 0; p < 2; ++p) to_panel(v, 64, 64 * p, sv[p]);
  wgmma::fence_operands();
  __syncthreads();
  uint32_t f[4][4];
  for (int k = 0; k < 4; ++k) a_fragment(a, k, f[k]);
  float d[64];
  for (int i = 0; i < 64; ++i) d[i] = 0.f;
  wgmma::fence();
  for (int k = 0; k < 4; ++k)
    wgmma::m64n128k16_rs_tb(d, f[k], wgmma::mn_major(smem_address(sv[0]), k, 64 * 128), k > 0, Bf16{});
  wgmma::commit();
  wgmma::wait<0>();
  store_d<128>(d, c);
}

// c = a b^T, M = 64, N = 32 (32 rows of b: the S tile of 32 tokens at head_dim 256), K = 128 (two panels).
__global__ void __launch_bounds__(128) wgmma_probe_ss32(const uint16_t* a, const uint16_t* b, float* c) {
  __shared__ __align__(1024) uint16_t sa[2][64 * 64];
  __shared__ __align__(1024) uint16_t sb[2][32 * 64];
  for (int p = 0; p < 2; ++p) to_panel(a, 64, 64 * p, sa[p]), to_panel(b, 32, 64 * p, sb[p]);
  wgmma::fence_operands();
  __syncthreads();
  float d[16];
  for (int i = 0; i < 16; ++i) d[i] = 0.f;
  wgmma::fence();
  for (int k = 0; k < 8; ++k)
    wgmma::m64n32k16_ss(d, wgmma::k_major(smem_address(sa[k / 4]), k % 4),
                        wgmma::k_major(smem_address(sb[k / 4]), k % 4), k > 0, Bf16{});
  wgmma::commit();
  wgmma::wait<0>();
  store_d<32>(d, c);
}

// c = a v, M = 64, N = 128, K = 32 tokens: V in panels of 32 rows (4096 bytes apart), as a head_dim 256 stage
// holds them.
__global__ void __launch_bounds__(128) wgmma_probe_rs128_k32(const uint16_t* a, const uint16_t* v, float* c) {
  __shared__ __align__(1024) uint16_t sv[2][32 * 64];
  for (int p = 0; p < 2; ++p) to_panel(v, 32, 64 * p, sv[p]);
  wgmma::fence_operands();
  __syncthreads();
  uint32_t f[2][4];
  for (int k = 0; k < 2; ++k) a_fragment(a, k, f[k]);
  float d[64];
  for (int i = 0; i < 64; ++i) d[i] = 0.f;
  wgmma::fence();
  for (int k = 0; k < 2; ++k)
    wgmma::m64n128k16_rs_tb(d, f[k], wgmma::mn_major(smem_address(sv[0]), k, 32 * 128), k > 0, Bf16{});
  wgmma::commit();
  wgmma::wait<0>();
  store_d<128>(d, c);
}
)";
  return s;
}

}  // namespace attnforge::testing
