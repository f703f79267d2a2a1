// The few CUDA driver API calls that load and launch run-time compiled kernels, and the encoder of tensor maps
// (tma.h). libcuda is opened with dlopen on first use rather than linked, so the library still loads on machines
// without a driver (CI compiles kernels there, it launches none). cuda.h supplies the types only.
#pragma once

#include <cuda.h>

namespace attnforge::cuda {

struct DriverApi {
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuModuleUnload)(CUmodule);
  CUresult (*cuFuncSetAttribute)(CUfunction, CUfunction_attribute, int);
  CUresult (*cuOccupancyMaxActiveBlocksPerMultiprocessor)(int*, CUfunction, int, size_t);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);
  CUresult (*cuLaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuTensorMapEncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                     const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                     CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
};

// Throws Error(kBackend) when libcuda or one of the functions is missing.
const DriverApi& driver();

// Throws Error(kBackend) naming the call and the driver's error.
void check_driver(CUresult result, const char* call);

}  // namespace attnforge::cuda

#define ATTNFORGE_CU_CHECK(expr) ::attnforge::cuda::check_driver((expr), #expr)
