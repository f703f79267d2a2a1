#include "backends/cuda/jit_decode.h"

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/decode/decode.h"
#include "backends/cuda/decode/decode_defaults.cuh"
#include "backends/cuda/driver_api.h"
#include "jit/kernel_cache.h"

namespace attnforge::cuda {

JitDecode::JitDecode(int device, int major, int minor) : device_(device), arch_(jit::arch_for_device(major, minor)) {}

jit::KernelKey JitDecode::key_for(const AttentionShape& shape) const { return jit::decode_key(shape, arch_); }

const JitDecode::Kernels& JitDecode::kernels(const jit::KernelKey& key) {
  const std::string name = key.name();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = loaded_.find(name); it != loaded_.end()) return it->second;
  }
  // Outside the lock: a compile takes seconds and other keys need not wait for it (the cache compiles each key
  // once however many threads ask).
  const jit::Lookup l = jit::process_cache().get(key.render(), jit::current_settings());
  std::lock_guard<std::mutex> lock(mutex_);
  if (auto it = loaded_.find(name); it != loaded_.end()) return it->second;
  // The module goes into the device's primary context, the one the runtime API launches the nvcc kernels in
  // (cudaSetDevice creates it if nothing has yet). The caller restores its current device.
  ATTNFORGE_CUDA_CHECK(cudaSetDevice(device_));
  const DriverApi& d = driver();
  CUmodule module;
  ATTNFORGE_CU_CHECK(d.cuModuleLoadData(&module, l.module->binary.data()));
  Kernels k;
  ATTNFORGE_CU_CHECK(d.cuModuleGetFunction(&k.decode, module, l.module->lowered_names[jit::kDecodeEntry].c_str()));
  ATTNFORGE_CU_CHECK(d.cuModuleGetFunction(&k.merge, module, l.module->lowered_names[jit::kMergeEntry].c_str()));
  const DecodeAttributes a = decode_attributes(key.head_dim_qk, key.kv_dtype, key.tile.stages);
  ATTNFORGE_CU_CHECK(d.cuFuncSetAttribute(k.decode, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, a.max_dynamic_smem));
  ATTNFORGE_CU_CHECK(d.cuFuncSetAttribute(k.decode, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, a.carveout_percent));
  ATTNFORGE_CU_CHECK(d.cuOccupancyMaxActiveBlocksPerMultiprocessor(&k.ctas_per_sm, k.decode, a.threads, a.max_dynamic_smem));
  return loaded_.emplace(name, k).first->second;  // modules stay loaded for the life of the process
}

const JitDecode::Kernels& JitDecode::kernels_for(const AttentionShape& shape) {
  const int dim_index = shape.head_dim_qk == 64 ? 0 : shape.head_dim_qk == 128 ? 1 : shape.head_dim_qk == 256 ? 2 : -1;
  const int kv_index = shape.kv_dtype == shape.q_dtype            ? 0
                       : shape.kv_dtype == DType::kFloat8E4M3 ? 1
                       : shape.kv_dtype == DType::kFloat8E5M2 ? 2
                                                              : -1;
  const bool indexed = dim_index >= 0 && kv_index >= 0 &&
                       (shape.q_dtype == DType::kFloat16 || shape.q_dtype == DType::kBFloat16);
  if (!indexed) return kernels(key_for(shape));  // throws kUnsupported naming what no kernel serves
  std::atomic<const Kernels*>& slot = by_shape_[(dim_index * 3 + kv_index) * 2 + (shape.q_dtype == DType::kBFloat16)];
  if (const Kernels* k = slot.load(std::memory_order_acquire)) return *k;
  const Kernels& k = kernels(key_for(shape));
  slot.store(&k, std::memory_order_release);
  return k;
}

void JitDecode::run(const AttentionParams& p, cudaStream_t stream) {
  const AttentionShape shape{p.num_qo_heads, p.num_kv_heads, p.head_dim_qk, p.head_dim_vo,
                             p.q_dtype,      p.kv.dtype,     p.o_dtype};
  const Kernels& k = kernels_for(shape);
  const DecodeLaunchConfig c = decode_launch_config(p, default_decode_stages(p.kv.dtype));
  AttentionParams params = p;
  void* args[] = {&params};
  const DriverApi& d = driver();
  auto launch = [&](CUfunction f, const KernelDims& dims) {
    ATTNFORGE_CU_CHECK(d.cuLaunchKernel(f, dims.grid.x, dims.grid.y, dims.grid.z, dims.block.x, dims.block.y,
                                        dims.block.z, dims.smem_bytes, static_cast<CUstream>(stream), args, nullptr));
  };
  launch(k.decode, c.decode);  // split KV is merged inside the decode kernel
}

}  // namespace attnforge::cuda
