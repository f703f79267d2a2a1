// CUtensorMap's storage for code that sees no cuda.h (NVRTC, device headers): 128 opaque bytes, 128-byte aligned (as cuda.h has it),
// encoded on the host (backends/cuda/tma.h) and read by the tensor memory accelerator (device/tma.cuh). Kernels
// take it by value as a __grid_constant__ parameter. Plain C++: host code includes it too.
#pragma once

namespace attnforge::cuda {

struct alignas(128) TensorMap {
  unsigned long long opaque[16];
};

}  // namespace attnforge::cuda
