#include "backends/cuda/driver_api.h"

#include <dlfcn.h>

#include <string>

#include "core/check.h"

namespace attnforge::cuda {

namespace {

template <typename Fn>
void resolve(void* lib, const char* name, Fn* fn) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (!*fn) detail::fail(ErrorKind::kBackend, "the CUDA driver (libcuda.so.1) has no function {}", name);
}

DriverApi load() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib)
    detail::fail(ErrorKind::kBackend, "cannot load the CUDA driver libcuda.so.1 ({}); run-time compiled kernels "
                 "need it to run", dlerror());
  DriverApi d{};
  resolve(lib, "cuModuleLoadData", &d.cuModuleLoadData);
  resolve(lib, "cuModuleGetFunction", &d.cuModuleGetFunction);
  resolve(lib, "cuModuleUnload", &d.cuModuleUnload);
  resolve(lib, "cuFuncSetAttribute", &d.cuFuncSetAttribute);
  resolve(lib, "cuOccupancyMaxActiveBlocksPerMultiprocessor", &d.cuOccupancyMaxActiveBlocksPerMultiprocessor);
  resolve(lib, "cuLaunchKernel", &d.cuLaunchKernel);
  resolve(lib, "cuLaunchKernelEx", &d.cuLaunchKernelEx);
  resolve(lib, "cuGetErrorName", &d.cuGetErrorName);
  resolve(lib, "cuTensorMapEncodeTiled", &d.cuTensorMapEncodeTiled);
  return d;  // the library stays loaded for the life of the process, like the modules loaded through it
}

}  // namespace

const DriverApi& driver() {
  static const DriverApi api = load();
  return api;
}

void check_driver(CUresult result, const char* call) {
  if (result == CUDA_SUCCESS) return;
  const char* name = nullptr;
  if (driver().cuGetErrorName(result, &name) != CUDA_SUCCESS) name = nullptr;
  detail::fail(ErrorKind::kBackend, "{}: {} ({})", call, name ? name : "unknown CUDA driver error",
               static_cast<int>(result));
}

}  // namespace attnforge::cuda
