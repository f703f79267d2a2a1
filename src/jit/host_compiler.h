// The host side of the run-time compiler: a translation unit compiled by the C++ compiler attnforge was built
// with (or ATTNFORGE_HOST_CXX) into a shared object, from the same embedded headers NVRTC gets. It is how the CPU
// runs custom variants (src/jit/variant.cc); its results are cached like cubins (kernel_cache.h).
#pragma once

#include <string>
#include <vector>

#include "jit/nvrtc_compiler.h"

namespace attnforge::jit {

// The `arch` of a KernelSource built for the host.
inline constexpr const char* kHostArch = "host";

// The compiler's path and its `--version` text (part of the cache key).
std::string host_compiler();
std::string host_compiler_identity();

std::vector<std::string> host_compile_options();

// Compiles `source` into a shared object (CompiledModule::binary); throws Error(kBackend) with the compiler's
// output on failure. The entry points are plain extern "C" names, returned as the lowered names.
CompiledModule compile_host(const KernelSource& source, std::span<const EmbeddedHeader> headers = embedded_headers());

}  // namespace attnforge::jit
