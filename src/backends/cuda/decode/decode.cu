// Instantiations and launch of the nvcc-compiled decode kernels with 16-bit K/V (fp8 K/V: decode_fp8.cu), and the
// launch configuration both builds of the kernels share. Split-KV items are merged by the shared merge kernel
// (backends/cuda/merge).
#include <cuda_runtime.h>

#include "backends/cuda/decode/decode_instances.h"
#include "backends/cuda/merge/merge.h"
#include "core/env.h"

namespace attnforge::cuda {

namespace {

// bf16 and fp16 instantiations use the same threads and shared memory; so do e4m3 and e5m2.
template <int D, typename KV>
KernelAttributes attributes_for(int stages) {
  switch (stages) {
    case 2: return attributes_of<DecodeTraits<D, Bf16, 2, KV>>();
    case 3: return attributes_of<DecodeTraits<D, Bf16, 3, KV>>();
    default: return attributes_of<DecodeTraits<D, Bf16, 4, KV>>();
  }
}

template <int D>
KernelAttributes attributes_for(DType kv_dtype, int stages) {
  return is_fp8(kv_dtype) ? attributes_for<D, E4M3>(stages) : attributes_for<D, Bf16>(stages);
}

template <int D, int kStages = kDefaultDecodeStages>
void launch_16bit(const AttentionParams& p, const KernelDims& dims, cudaStream_t stream) {
  if (p.q_dtype == DType::kBFloat16)
    launch_decode<DecodeTraits<D, Bf16, kStages>>(p, dims, stream);
  else
    launch_decode<DecodeTraits<D, F16, kStages>>(p, dims, stream);
}

// The stages run_decode launches for a plan: its kv_stages where the planner chose the small-batch pipeline (the
// build instantiates it where small_batch_decode_stages names it; CudaBackend::attention checks the plan's value),
// else the default.
int plan_stages(const AttentionParams& p) {
  return p.kv_stages > 0 ? p.kv_stages : default_decode_stages(p.kv.dtype);
}

}  // namespace

KernelAttributes decode_attributes(int head_dim, DType kv_dtype, int stages) {
  switch (head_dim) {
    case 64: return attributes_for<64>(kv_dtype, stages);
    case 128: return attributes_for<128>(kv_dtype, stages);
    default: return attributes_for<256>(kv_dtype, stages);
  }
}

LaunchConfig decode_launch_config(const AttentionParams& p, int stages) {
  constexpr int kRows = DecodeTraits<64, Bf16>::kRows;  // one mma M tile, the same for every instantiation
  return attention_launch_config(p, kRows, decode_attributes(p.head_dim_qk, p.kv.dtype, stages));
}

bool decode_programmatic_launch() {
  static const bool allowed = detail::env_choice("ATTNFORGE_DECODE_PDL", {"0", "1"}, "1") == "1";
  return allowed && compute_capability() >= 90;
}

int decode_small_batch_ctas_per_sm(int head_dim, DType q_dtype, DType kv_dtype) {
  if (small_batch_decode_stages(head_dim, q_dtype, kv_dtype) != kSmallBatchDecodeStages) return 0;
  switch (head_dim) {  // fp16 Q: the same attributes
    case 128: return configure_decode<DecodeTraits<128, Bf16, kSmallBatchDecodeStages>>();
    case 256: return configure_decode<DecodeTraits<256, Bf16, kSmallBatchDecodeStages>>();
    default: return 0;
  }
}

int decode_ctas_per_sm(int head_dim, DType kv_dtype) {
  if (is_fp8(kv_dtype)) return decode_fp8_ctas_per_sm(head_dim, kv_dtype);
  switch (head_dim) {
    case 64: return configure_decode<DecodeTraits<64, Bf16>>();
    case 128: return configure_decode<DecodeTraits<128, Bf16>>();
    case 256: return configure_decode<DecodeTraits<256, Bf16>>();
    default: return 1;
  }
}

void run_decode(const AttentionParams& p, cudaStream_t stream) {
  const int stages = plan_stages(p);
  const LaunchConfig c = decode_launch_config(p, stages);
  if (stages == kSmallBatchDecodeStages && !is_fp8(p.kv.dtype)) {
    switch (p.head_dim_qk) {
      case 128: launch_16bit<128, kSmallBatchDecodeStages>(p, c.attention, stream); break;
      case 256: launch_16bit<256, kSmallBatchDecodeStages>(p, c.attention, stream); break;
      default: break;  // rejected by CudaBackend::check before any launch
    }
  } else if (is_fp8(p.kv.dtype)) {
    launch_decode_fp8(p, c.attention, stream);
  } else {
    switch (p.head_dim_qk) {
      case 64: launch_16bit<64>(p, c.attention, stream); break;
      case 128: launch_16bit<128>(p, c.attention, stream); break;
      case 256: launch_16bit<256>(p, c.attention, stream); break;
      default: break;  // rejected by CudaBackend::check before any launch
    }
  }
  run_merge(p, stream);
  ATTNFORGE_TL(if (!is_fp8(p.kv.dtype)) print_timeline("decode", stream);)  // trace builds: 16-bit K/V only
}

}  // namespace attnforge::cuda
