// The run-time compiler: NVRTC, in process, on sources that include only the embedded kernel headers.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "jit/embedded_headers.h"

namespace attnforge::jit {

// A translation unit to compile, rendered from a specialization key (kernel_key.h).
struct KernelSource {
  std::string name;                       // readable, from the key's fields: "decode_d128_bf16_st2_sm90a"
  std::string source;                     // includes embedded headers and names the kernels to instantiate
  std::vector<std::string> entry_points;  // NVRTC name expressions, e.g. "&attnforge::cuda::merge_kernel"
  std::string arch;                       // "sm_80", "sm_86", "sm_89", "sm_90a", ...
  std::string warmup_command;             // how a user builds it ahead of time (for the cache's off mode)
  // Unannotated functions compile as device functions (NVRTC's -default-device): custom variants, whose plain
  // C++ hooks also compile for the CPU, get it; the library's own kernels, annotated throughout, do not.
  bool default_device = false;
};

// A compiled cubin and the lowered (mangled) names cuModuleGetFunction needs, one per entry point, in order.
struct CompiledModule {
  std::string name;
  std::vector<std::string> lowered_names;
  std::string binary;  // a cubin, or a shared object for the host (host_compiler.h)
  std::string log;  // NVRTC's log of a successful compile (warnings), usually empty
};

struct NvrtcVersion {
  int major = 0, minor = 0;
};
NvrtcVersion nvrtc_version();

// The architectures this NVRTC compiles for, as "sm_XY".
std::vector<std::string> nvrtc_archs();

// The architecture kernels are compiled for on a device of compute capability major.minor: sm_90a on Hopper
// (its wgmma/TMA instructions need the "a" target), sm_XY otherwise. Throws kUnsupported when NVRTC cannot
// target it.
std::string arch_for_device(int major, int minor);

// The NVRTC options for `arch`: the same code generation as the nvcc build (-O3 device code, FMA contraction on,
// no fast math), line info for profilers, and ptxas spill warnings in the log.
std::vector<std::string> compile_options(const std::string& arch, bool default_device = false);

// Compiles to a cubin; throws Error(kBackend) with NVRTC's log on failure.
CompiledModule compile(const KernelSource& source, std::span<const EmbeddedHeader> headers = embedded_headers());

}  // namespace attnforge::jit
