// The nvcc-compiled decode kernels with fp8 K/V (e4m3fn, e5m2; Q and the mma operands bf16 or fp16), at the default
// fp8 tile configuration (kDefaultDecodeStagesFp8). A translation unit of its own: twelve instantiations.
#include "backends/cuda/decode/decode_instances.h"

namespace attnforge::cuda {

namespace {

template <int D, typename KV>
using Fp8Traits = DecodeTraits<D, Bf16, kDefaultDecodeStagesFp8, KV>;

template <int D, typename KV>
void launch_kv(const AttentionParams& p, const KernelDims& dims, cudaStream_t stream) {
  if (p.q_dtype == DType::kBFloat16)
    launch_decode<Fp8Traits<D, KV>>(p, dims, stream);
  else
    launch_decode<DecodeTraits<D, F16, kDefaultDecodeStagesFp8, KV>>(p, dims, stream);
}

template <int D>
void launch_for(const AttentionParams& p, const KernelDims& dims, cudaStream_t stream) {
  if (p.kv.dtype == DType::kFloat8E4M3)
    launch_kv<D, E4M3>(p, dims, stream);
  else
    launch_kv<D, E5M2>(p, dims, stream);
}

}  // namespace

// Both fp8 formats and both operand types use the same threads and shared memory; one instantiation answers.
int decode_fp8_ctas_per_sm(int head_dim, DType) {
  switch (head_dim) {
    case 64: return configure_decode<Fp8Traits<64, E4M3>>();
    case 128: return configure_decode<Fp8Traits<128, E4M3>>();
    case 256: return configure_decode<Fp8Traits<256, E4M3>>();
    default: return 1;
  }
}

void launch_decode_fp8(const AttentionParams& p, const KernelDims& dims, cudaStream_t stream) {
  switch (p.head_dim_qk) {
    case 64: launch_for<64>(p, dims, stream); break;
    case 128: launch_for<128>(p, dims, stream); break;
    case 256: launch_for<256>(p, dims, stream); break;
    default: break;  // rejected by CudaBackend::check before any launch
  }
}

}  // namespace attnforge::cuda
