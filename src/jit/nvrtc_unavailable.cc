// The NVRTC half of the run-time compiler in a build without the CUDA toolkit. There are no GPU kernels to
// compile, and every call that would need NVRTC says so; the disk cache, the host compiler and custom variants on
// the CPU (host_compiler.cc, variant.cc) work the same as in a CUDA build.
#include "core/check.h"
#include "jit/nvrtc_compiler.h"

namespace attnforge::jit {

namespace {

[[noreturn]] void no_nvrtc(const std::string& what) {
  detail::fail(ErrorKind::kUnsupported,
               "{}: this build has no NVRTC (configured without the CUDA toolkit); GPU kernels cannot be compiled "
               "at run time. Rebuild with nvcc on the PATH", what);
}

}  // namespace

NvrtcVersion nvrtc_version() { return {}; }
std::vector<std::string> nvrtc_archs() { return {}; }
std::string arch_for_device(int major, int minor) { no_nvrtc("compute capability " + std::to_string(major) + "." + std::to_string(minor)); }
std::vector<std::string> compile_options(const std::string&, bool) { return {}; }
CompiledModule compile(const KernelSource& source, std::span<const EmbeddedHeader>) { no_nvrtc("kernel " + source.name); }

}  // namespace attnforge::jit
