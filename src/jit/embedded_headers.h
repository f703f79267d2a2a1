// The kernel headers the run-time compiler needs, embedded in the library at build time (cmake/EmbedSources.cmake
// writes embedded_headers.cc): include/attnforge/kernel/*.h and the CUDA kernel headers under
// src/backends/cuda/. NVRTC gets them as in-memory headers, so no toolkit header and no source tree is read at
// run time, and the cache key hashes exactly the text the kernels were compiled from.
#pragma once

#include <span>

namespace attnforge::jit {

struct EmbeddedHeader {
  const char* name;  // the include name, e.g. "attnforge/kernel/params.h", "backends/cuda/decode/decode_kernel.cuh"
  const char* text;
};

std::span<const EmbeddedHeader> embedded_headers();

}  // namespace attnforge::jit
