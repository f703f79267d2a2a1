// Instantiations and launch of the nvcc-compiled decode kernels, and the launch configuration both builds of the
// kernels share. Split-KV items are merged inside the decode kernel, by the CTA that finishes a merge's last piece.
#include <cuda_runtime.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/decode/decode.h"
#include "backends/cuda/decode/decode_kernel.cuh"
#include "backends/cuda/kernel_config.h"

namespace attnforge::cuda {

namespace {

// bf16 and fp16 instantiations use the same threads and shared memory.
template <int D>
KernelAttributes attributes_of(int stages) {
  auto make = [](auto traits) {
    using Tr = decltype(traits);
    return KernelAttributes{Tr::kThreads, Tr::kSmemBytes, 100};
  };
  return stages == 3 ? make(DecodeTraits<D, Bf16, 3>{}) : make(DecodeTraits<D, Bf16, 2>{});
}

// Sets the attributes once per instantiation; returns the CTAs one SM holds.
template <class Tr>
int configure() {
  static const int ctas_per_sm = [] {
    const KernelAttributes a = decode_attributes(Tr::kHeadDim, Tr::kStages);
    return configure_kernel(decode_kernel<Tr>, a.threads, a.max_dynamic_smem, a.carveout_percent);
  }();
  return ctas_per_sm;
}

template <int D, typename Elem>
void launch_decode(const AttentionParams& p, const KernelDims& dims, cudaStream_t stream) {
  using Tr = DecodeTraits<D, Elem>;
  configure<Tr>();
  decode_kernel<Tr><<<dims.grid, dims.block, dims.smem_bytes, stream>>>(p);
  ATTNFORGE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

KernelAttributes decode_attributes(int head_dim, int stages) {
  switch (head_dim) {
    case 64: return attributes_of<64>(stages);
    case 128: return attributes_of<128>(stages);
    default: return attributes_of<256>(stages);
  }
}

LaunchConfig decode_launch_config(const AttentionParams& p, int stages) {
  constexpr int kRows = DecodeTraits<64, Bf16>::kRows;  // one mma M tile, the same for every instantiation
  LaunchConfig c = attention_launch_config(p, kRows, decode_attributes(p.head_dim_qk, stages));
  c.run_merge = false;  // split KV is merged inside the decode kernel, by the CTA that finishes a merge's last piece
  return c;
}

int decode_ctas_per_sm(int head_dim) {
  switch (head_dim) {
    case 64: return configure<DecodeTraits<64, Bf16>>();
    case 128: return configure<DecodeTraits<128, Bf16>>();
    case 256: return configure<DecodeTraits<256, Bf16>>();
    default: return 1;
  }
}

void run_decode(const AttentionParams& p, cudaStream_t stream) {
  const LaunchConfig c = decode_launch_config(p, kDefaultDecodeStages);
  const bool bf16 = p.q_dtype == DType::kBFloat16;
  const KernelDims& d = c.attention;
  switch (p.head_dim_qk) {
    case 64: bf16 ? launch_decode<64, Bf16>(p, d, stream) : launch_decode<64, F16>(p, d, stream); break;
    case 128: bf16 ? launch_decode<128, Bf16>(p, d, stream) : launch_decode<128, F16>(p, d, stream); break;
    case 256: bf16 ? launch_decode<256, Bf16>(p, d, stream) : launch_decode<256, F16>(p, d, stream); break;
    default: break;  // rejected by CudaBackend::check before any launch
  }
}

}  // namespace attnforge::cuda
