// Instantiations and launch of the decode and merge kernels.
#include <cuda_runtime.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/decode/decode.h"
#include "backends/cuda/decode/decode_kernel.cuh"

namespace attnforge::cuda {

namespace {

// Raises the kernel's dynamic shared memory limit once per instantiation (and prefers shared memory over L1,
// so the CTAs the occupancy calculation counts on fit); returns the CTAs one SM holds.
template <class Tr>
int configure() {
  static const int ctas_per_sm = [] {
    auto kernel = decode_kernel<Tr>;
    ATTNFORGE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
    ATTNFORGE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    int n = 0;
    ATTNFORGE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Tr::kThreads, Tr::kSmemBytes));
    return n;
  }();
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
  if (launch.merge_capacity > 0) {
    const dim3 grid(launch.merge_capacity, p.num_qo_heads);
    merge_kernel<<<grid, kMergeThreads, 0, stream>>>(p);
    ATTNFORGE_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace attnforge::cuda
