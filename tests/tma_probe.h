// Probe kernel for the tensor memory accelerator's K/V boxes (src/backends/cuda/device/tma.cuh, tensor maps from
// src/backends/cuda/tma.h), compiled at run time for sm_90a: test_jit.cc compiles it (any machine with NVRTC),
// tests/cuda/test_cuda.cc runs it on a Hopper GPU and checks that every box lands in the tile exactly where the
// Hopper prefill kernel's panels expect each row's 16-byte chunks (panel_bytes, device/tiles.cuh).
//   tma_probe_tile: one CTA of 128 threads poisons a tile of `rows` rows x `panels` 64-element panels in shared
//   memory, copies the listed boxes of KV head `head` into it (every panel of each), and writes the tile's bytes
//   as they lie to `out`. boxes: 3 ints a box (token slot, page, first row of the tile); heads_inner: the map's
//   coordinates are (dim, head, slot, page), else (dim, slot, head, page) (kv_heads_inner). If the barrier does not
//   complete (the boxes' bytes fall short of the count expected), `out` gets 0xee bytes instead.
#pragma once

#include <string>

#include "jit/nvrtc_compiler.h"

namespace attnforge::testing {

constexpr int kTmaProbeTileBytes = 32768;

inline jit::KernelSource tma_probe_source() {
  jit::KernelSource s;
  s.name = "tma_probe_sm90a";
  s.arch = "sm_90a";
  s.entry_points.push_back("&tma_probe_tile");
  s.source = R"(#include "backends/cuda/device/mbarrier.cuh"
#include "backends/cuda/device/tma.cuh"
#include "backends/cuda/device/wgmma.cuh"
using namespace attnforge;
using namespace attnforge::cuda;

__global__ void __launch_bounds__(128) tma_probe_tile(const __grid_constant__ TensorMap map, const int* boxes,
                                                      int num_boxes, int box_rows, int panels, int rows, int head,
                                                      int heads_inner, unsigned char* out) {
  __shared__ __align__(1024) unsigned char tile[32768];
  __shared__ __align__(8) uint64_t bar;
  const int bytes = panels * rows * 128;
  for (int i = threadIdx.x; i < bytes / 16; i += 128)
    reinterpret_cast<uint4*>(tile)[i] = make_uint4(~0u, ~0u, ~0u, ~0u);
  if (threadIdx.x == 0) mbar::init(&bar, 1);
  wgmma::fence_operands();  // the poison before the async proxy's writes
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    tma::prefetch_map(&map);
    tma::arrive_expect_tx(&bar, static_cast<uint32_t>(num_boxes * panels * box_rows * 128));
    for (int b = 0; b < num_boxes; ++b)
      for (int p = 0; p < panels; ++p)
        tma::load_4d(tile + p * rows * 128 + boxes[3 * b + 2] * 128, &map, 64 * p,
                     heads_inner ? head : boxes[3 * b], heads_inner ? boxes[3 * b] : head, boxes[3 * b + 1], &bar);
  }
  uint32_t done = 0;
  for (int i = 0; i < (1 << 20) && !done; ++i)
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_address(&bar))
        : "memory");
  for (int i = threadIdx.x; i < bytes; i += 128) out[i] = done ? tile[i] : 0xee;
}
)";
  return s;
}

}  // namespace attnforge::testing
