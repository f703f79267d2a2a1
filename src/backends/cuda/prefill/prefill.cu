// Instantiations and launch of the prefill kernels; split-KV items are merged by the shared merge kernel.
#include <cuda_runtime.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernel_config.h"
#include "backends/cuda/merge/merge.h"
#include "backends/cuda/prefill/prefill.h"
#include "backends/cuda/prefill/prefill_kernel.cuh"

namespace attnforge::cuda {

namespace {

// The CTAs one SM holds, after the one-time set-up of the instantiation.
template <class Tr>
int configure() {
  static const int ctas_per_sm = configure_kernel(prefill_kernel<Tr>, Tr::kThreads, Tr::kSmemBytes);
  return ctas_per_sm;
}

template <int D, typename Elem, bool kRope>
void launch(const AttentionParams& p, cudaStream_t stream) {
  using Tr = PrefillTraits<D, Elem, kRope>;
  configure<Tr>();
  const int group = p.num_qo_heads / p.num_kv_heads;
  const int row_blocks = (p.qo_tile * group + Tr::kRows - 1) / Tr::kRows;
  const dim3 grid(p.item_capacity > 0 ? p.item_capacity : 1, p.num_kv_heads, row_blocks);
  prefill_kernel<Tr><<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
  ATTNFORGE_CUDA_CHECK(cudaGetLastError());
}

template <int D, bool kRope>
void launch_dtype(const AttentionParams& p, cudaStream_t stream) {
  p.q_dtype == DType::kBFloat16 ? launch<D, Bf16, kRope>(p, stream) : launch<D, F16, kRope>(p, stream);
}

template <int D>
void launch_variant(const AttentionParams& p, cudaStream_t stream) {
  p.variant.rope.enabled ? launch_dtype<D, true>(p, stream) : launch_dtype<D, false>(p, stream);
}

}  // namespace

int prefill_ctas_per_sm(int head_dim) {
  switch (head_dim) {  // bf16 and fp16 instantiations use the same registers and shared memory
    case 64: return configure<PrefillTraits<64, Bf16>>();
    case 128: return configure<PrefillTraits<128, Bf16>>();
    case 256: return configure<PrefillTraits<256, Bf16>>();
    default: return 1;
  }
}

void run_prefill(const AttentionParams& p, cudaStream_t stream) {
  switch (p.head_dim_qk) {
    case 64: launch_variant<64>(p, stream); break;
    case 128: launch_variant<128>(p, stream); break;
    case 256: launch_variant<256>(p, stream); break;
    default: break;  // rejected by CudaBackend::check before any launch
  }
  run_merge(p, stream);
}

}  // namespace attnforge::cuda
