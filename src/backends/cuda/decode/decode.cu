// Instantiations and launch of the decode and merge kernels.
#include <cuda_runtime.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/decode/decode.h"
#include "backends/cuda/decode/decode_kernel.cuh"

namespace attnforge::cuda {

namespace {

template <int D, typename Elem>
void launch_decode(const AttentionParams& p, int grid_items, int row_blocks, cudaStream_t stream) {
  using Tr = DecodeTraits<D, Elem>;
  auto kernel = decode_kernel<Tr>;
  static const bool configured = [&] {
    ATTNFORGE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
    return true;
  }();
  (void)configured;
  const dim3 grid(grid_items, p.num_kv_heads, row_blocks);
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
  ATTNFORGE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

int decode_ctas_per_sm(int head_dim) {
  // Shared memory per CTA bounds residency: 50 KB (d 64), 100 KB (d 128), 200 KB (d 256) of 227 KB.
  return head_dim <= 64 ? 4 : head_dim <= 128 ? 2 : 1;
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
  if (launch.merge_capacity > 0) {
    const dim3 grid(launch.merge_capacity, p.num_qo_heads);
    merge_kernel<<<grid, 128, 0, stream>>>(p);
    ATTNFORGE_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace attnforge::cuda
