#include "jit/nvrtc_compiler.h"

#include <fmt/format.h>
#include <nvrtc.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "core/check.h"

namespace attnforge::jit {

namespace {

void check_nvrtc(nvrtcResult r, const char* call, const std::string& name) {
  if (r != NVRTC_SUCCESS)
    detail::fail(ErrorKind::kBackend, "NVRTC: {} for kernel {}: {}", call, name, nvrtcGetErrorString(r));
}

// Destroys the program on every exit path.
struct Program {
  nvrtcProgram prog = nullptr;
  ~Program() {
    if (prog) nvrtcDestroyProgram(&prog);
  }
};

}  // namespace

NvrtcVersion nvrtc_version() {
  NvrtcVersion v;
  nvrtcVersion(&v.major, &v.minor);
  return v;
}

std::vector<std::string> nvrtc_archs() {
  int n = 0;
  nvrtcGetNumSupportedArchs(&n);
  std::vector<int> archs(n);
  nvrtcGetSupportedArchs(archs.data());
  std::vector<std::string> out;
  for (int a : archs) out.push_back(fmt::format("sm_{}", a));
  return out;
}

std::string arch_for_device(int major, int minor) {
  const std::string base = fmt::format("sm_{}{}", major, minor);
  const std::vector<std::string> archs = nvrtc_archs();
  if (major < 8 || std::find(archs.begin(), archs.end(), base) == archs.end())
    detail::fail(ErrorKind::kUnsupported,
                 "compute capability {}.{}: the run-time compiled kernels need 8.0 or newer and an architecture "
                 "NVRTC {}.{} targets ({})",
                 major, minor, nvrtc_version().major, nvrtc_version().minor, fmt::join(archs, ", "));
  return major == 9 && minor == 0 ? "sm_90a" : base;
}

std::vector<std::string> compile_options(const std::string& arch, bool default_device) {
  std::vector<std::string> o = {"--gpu-architecture=" + arch, "-std=c++17", "-lineinfo", "--ptxas-options=--warn-on-spills"};
  if (default_device) o.push_back("-default-device");
  // Kernel work: ptxas's registers, stack and spills of every kernel in the compile log (and in the cache key, so
  // these modules never mix with the plain ones).
  if (const char* v = std::getenv("ATTNFORGE_PTXAS_VERBOSE"); v && std::string(v) == "1")
    o.push_back("--ptxas-options=-v");
  return o;
}

CompiledModule compile(const KernelSource& src, std::span<const EmbeddedHeader> headers) {
  std::vector<const char*> header_texts, header_names;
  for (const EmbeddedHeader& h : headers) {
    header_texts.push_back(h.text);
    header_names.push_back(h.name);
  }
  Program p;
  check_nvrtc(nvrtcCreateProgram(&p.prog, src.source.c_str(), (src.name + ".cu").c_str(),
                                 static_cast<int>(headers.size()), header_texts.data(), header_names.data()),
              "nvrtcCreateProgram", src.name);
  for (const std::string& e : src.entry_points)
    check_nvrtc(nvrtcAddNameExpression(p.prog, e.c_str()), "nvrtcAddNameExpression", src.name);
  const std::vector<std::string> options = compile_options(src.arch, src.default_device);
  std::vector<const char*> opts;
  for (const std::string& o : options) opts.push_back(o.c_str());
  const nvrtcResult r = nvrtcCompileProgram(p.prog, static_cast<int>(opts.size()), opts.data());
  size_t log_size = 0;
  nvrtcGetProgramLogSize(p.prog, &log_size);
  std::string log(log_size, '\0');
  if (log_size > 0) nvrtcGetProgramLog(p.prog, log.data());
  while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
  if (r != NVRTC_SUCCESS)
    detail::fail(ErrorKind::kBackend, "NVRTC: compiling kernel {} for {} failed: {}\n{}", src.name, src.arch,
                 nvrtcGetErrorString(r), log);

  CompiledModule m;
  m.name = src.name;
  m.log = std::move(log);
  for (const std::string& e : src.entry_points) {
    const char* lowered = nullptr;
    check_nvrtc(nvrtcGetLoweredName(p.prog, e.c_str(), &lowered), "nvrtcGetLoweredName", src.name);
    m.lowered_names.push_back(lowered);
  }
  size_t cubin_size = 0;
  check_nvrtc(nvrtcGetCUBINSize(p.prog, &cubin_size), "nvrtcGetCUBINSize", src.name);
  m.binary.resize(cubin_size);
  check_nvrtc(nvrtcGetCUBIN(p.prog, m.binary.data()), "nvrtcGetCUBIN", src.name);
  return m;
}

}  // namespace attnforge::jit
