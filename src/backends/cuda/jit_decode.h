// The NVRTC-compiled decode and merge kernels of one device: keys from params, modules from the kernel cache,
// loaded through the driver API once per key and launched with the launch configuration the nvcc build uses.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <string>

#include "attnforge/config.h"
#include "attnforge/kernel/params.h"
#include "jit/kernel_key.h"

namespace attnforge::cuda {

class JitDecode {
 public:
  JitDecode(int device, int major, int minor);

  struct Kernels {
    CUfunction decode = nullptr;
    CUfunction merge = nullptr;
    int ctas_per_sm = 0;
  };
  // Compiles or loads the module of `key` and loads it on the device (once; later calls return the functions).
  const Kernels& kernels(const jit::KernelKey& key);
  jit::KernelKey key_for(const AttentionShape& shape) const;
  const std::string& arch() const { return arch_; }

  int ctas_per_sm(const AttentionShape& shape) { return kernels_for(shape).ctas_per_sm; }
  void run(const AttentionParams& p, cudaStream_t stream);

 private:
  // run() finds the kernels of the shapes run() accepts (3 head dims x 2 Q dtypes x K/V in Q's dtype, e4m3 or
  // e5m2) without a lock or a string.
  const Kernels& kernels_for(const AttentionShape& shape);

  int device_;
  std::string arch_;
  std::mutex mutex_;
  std::map<std::string, Kernels> loaded_;  // by kernel name (unique per key)
  std::array<std::atomic<const Kernels*>, 18> by_shape_{};
};

}  // namespace attnforge::cuda
