// CUDA device discovery (host code; built only when nvcc is present).
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "backends/cuda/device_info.h"

namespace attnforge::detail {

std::vector<CudaDeviceInfo> cuda_devices() {
  std::vector<CudaDeviceInfo> out;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: clear the sticky error and report none
    return out;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    out.push_back({i, prop.name, prop.major, prop.minor, prop.multiProcessorCount, prop.totalGlobalMem,
                   static_cast<size_t>(prop.l2CacheSize)});
  }
  return out;
}

}  // namespace attnforge::detail
