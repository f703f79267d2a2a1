// Launch set-up the kernel families share (host side).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <utility>

#include "attnforge/kernel/params.h"
#include "backends/cuda/cuda_check.h"

namespace attnforge::cuda {

// Grid, block and dynamic shared memory of one launch.
struct KernelDims {
  dim3 grid, block;
  unsigned smem_bytes;
};

// Attributes an attention kernel (decode or prefill) gets once before its first launch: its threads, its dynamic
// shared memory limit, and a preference for shared memory over L1 so the CTAs the occupancy calculation counts on
// fit. Computed from the kernel's traits (decode_attributes, prefill_attributes) for both builds of the kernels.
struct KernelAttributes {
  int threads;
  int max_dynamic_smem;
  int carveout_percent;
};

// The launches of one planned batch: the family's attention kernel over (work items, KV heads, blocks of rows),
// then, where the plan has merges, the split-KV merge kernel. Grid sizes come from the plan's capacities (fixed for a batch
// size), never from its counts, so a captured graph stays valid across re-plans; kernels loop over the counts they
// read from the workspace. The nvcc-compiled launches (run_decode, run_prefill) and the NVRTC ones (jit_kernels.h)
// both use it.
struct LaunchConfig {
  KernelDims attention;
  KernelDims merge;
  bool run_merge;  // the plan has merge capacity
};
// `rows_per_cta`: packed query rows (tokens x heads of a group) one CTA of the kernel holds. Defined with the merge
// grid it includes (merge/merge.cu).
LaunchConfig attention_launch_config(const AttentionParams& p, int rows_per_cta, const KernelAttributes& attributes);

// A kernel's function attributes are per device: a process that drives several GPUs (one thread per rank, say)
// must set them on each. get(configure) runs `configure` (which sets them on the current device and returns the
// CTAs one SM holds) once per device and keeps its result; two threads racing on a device both configure it, which
// is harmless (the same attributes twice).
class PerDevice {
 public:
  template <typename Configure>
  int get(Configure&& configure) {
    int device = 0;
    ATTNFORGE_CUDA_CHECK(cudaGetDevice(&device));
    if (device < 0 || device >= static_cast<int>(values_.size())) return configure();
    int v = values_[device].load(std::memory_order_acquire);
    if (v == 0) {
      v = configure();
      values_[device].store(v, std::memory_order_release);
    }
    return v;
  }

 private:
  std::array<std::atomic<int>, 64> values_{};
};

// Launches `kernel` over `dims` on `stream`, as a programmatic dependent of the kernel before it on the stream where
// `programmatic` (sm_90+: its CTAs may be scheduled during that kernel's tail and must griddepcontrol.wait before
// reading what it writes), plainly otherwise.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), const KernelDims& dims, cudaStream_t stream, bool programmatic,
                   Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dims.grid, config.blockDim = dims.block, config.dynamicSmemBytes = dims.smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = programmatic ? 1 : 0;
  ATTNFORGE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// The current device's compute capability as 10 x major + minor (90: Hopper), asked once per device.
inline int compute_capability() {
  static PerDevice cc;
  return cc.get([] {
    int device = 0, major = 0, minor = 0;
    ATTNFORGE_CUDA_CHECK(cudaGetDevice(&device));
    ATTNFORGE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    ATTNFORGE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    return 10 * major + minor;
  });
}

// The current device's SM count, asked once per device.
inline int sm_count() {
  static PerDevice sms;
  return sms.get([] {
    int device = 0, count = 0;
    ATTNFORGE_CUDA_CHECK(cudaGetDevice(&device));
    ATTNFORGE_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    return count;
  });
}

// Raises the kernel's dynamic shared memory limit to smem_bytes and sets its shared-memory carveout (100: prefer
// shared memory over L1, so the CTAs the occupancy calculation counts on fit); returns the CTAs of `threads`
// threads one SM holds. Callers keep the result in a function-local PerDevice: once per instantiation and device.
template <typename Kernel>
int configure_kernel(Kernel kernel, int threads, int smem_bytes, int carveout_percent = 100) {
  ATTNFORGE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  ATTNFORGE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, carveout_percent));
  int n = 0;
  ATTNFORGE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem_bytes));
  return n;
}

}  // namespace attnforge::cuda
