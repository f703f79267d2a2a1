// Instantiations and launch of the decode kernels; split-KV items are merged by the shared merge kernel.
#include <cuda_runtime.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernel_config.h"
#include "backends/cuda/decode/decode.h"
#include "backends/cuda/decode/decode_kernel.cuh"
#include "backends/cuda/merge/merge.h"

namespace attnforge::cuda {

namespace {

// The CTAs one SM holds, after the one-time set-up of the instantiation.
template <class Tr>
int configure() {
  static const int ctas_per_sm = configure_kernel(decode_kernel<Tr>, Tr::kThreads, Tr::kSmemBytes);
  return ctas_per_sm;
}

template <int D, typename Elem>
void launch_decode(const AttentionParams& p, int grid_items, int row_blocks, cudaStream_t stream) {
  using Tr = DecodeTraits<D, Elem>;
  auto kernel = decode_kernel<Tr>;
  configure<Tr>();
  const dim3 grid(grid_items, p.num_kv_heads, row_blocks);
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
  ATTNFORGE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

int decode_ctas_per_sm(int head_dim) {
  // bf16 and fp16 instantiations use the same registers and shared memory.
  switch (head_dim) {
    case 64: return configure<DecodeTraits<64, Bf16>>();
    case 128: return configure<DecodeTraits<128, Bf16>>();
    case 256: return configure<DecodeTraits<256, Bf16>>();
    default: return 1;
  }
}

void run_decode(const AttentionParams& p, const DecodeLaunch& launch, cudaStream_t stream) {
  const bool bf16 = p.q_dtype == DType::kBFloat16;
  const int grid_items = launch.item_capacity > 0 ? launch.item_capacity : 1;
  switch (p.head_dim_qk) {
    case 64:
      bf16 ? launch_decode<64, Bf16>(p, grid_items, launch.row_blocks, stream)
           : launch_decode<64, F16>(p, grid_items, launch.row_blocks, stream);
      break;
    case 128:
      bf16 ? launch_decode<128, Bf16>(p, grid_items, launch.row_blocks, stream)
           : launch_decode<128, F16>(p, grid_items, launch.row_blocks, stream);
      break;
    case 256:
      bf16 ? launch_decode<256, Bf16>(p, grid_items, launch.row_blocks, stream)
           : launch_decode<256, F16>(p, grid_items, launch.row_blocks, stream);
      break;
    default: break;  // rejected by CudaBackend::check before any launch
  }
  run_merge(p, launch.merge_capacity, stream);
}

}  // namespace attnforge::cuda
