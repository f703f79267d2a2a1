// The device headers compile under NVRTC, with no toolkit header and only the project's include folders: the
// decode, prefill and merge kernels for sm_80 and sm_90a, as the run-time compiler will build them. Needs NVRTC, not a
// GPU, so it runs in CI.
#include <gtest/gtest.h>
#include <nvrtc.h>

#include <string>
#include <vector>

namespace {

struct Compiled {
  bool ok;
  std::string log;
};

Compiled compile(const std::string& arch, const std::vector<std::string>& kernels) {
  const std::string source =
      "#include \"backends/cuda/decode/decode_kernel.cuh\"\n#include \"backends/cuda/merge/merge_kernel.cuh\"\n"
      "#include \"backends/cuda/prefill/prefill_kernel.cuh\"\n";
  nvrtcProgram prog;
  if (nvrtcCreateProgram(&prog, source.c_str(), "decode.cu", 0, nullptr, nullptr) != NVRTC_SUCCESS)
    return {false, "nvrtcCreateProgram failed"};
  for (const std::string& k : kernels) nvrtcAddNameExpression(prog, k.c_str());
  const std::string arch_opt = "--gpu-architecture=" + arch;
  const std::string inc_src = std::string("-I") + ATTNFORGE_SOURCE_DIR + "/src";
  const std::string inc_api = std::string("-I") + ATTNFORGE_SOURCE_DIR + "/include";
  const char* opts[] = {arch_opt.c_str(), inc_src.c_str(), inc_api.c_str(), "-std=c++17"};
  const nvrtcResult r = nvrtcCompileProgram(prog, 4, opts);
  size_t log_size = 0;
  nvrtcGetProgramLogSize(prog, &log_size);
  std::string log(log_size, '\0');
  nvrtcGetProgramLog(prog, log.data());
  bool named = true;
  for (const std::string& k : kernels) {
    const char* lowered = nullptr;
    if (r == NVRTC_SUCCESS && nvrtcGetLoweredName(prog, k.c_str(), &lowered) != NVRTC_SUCCESS) named = false;
  }
  nvrtcDestroyProgram(&prog);
  return {r == NVRTC_SUCCESS && named, std::string(nvrtcGetErrorString(r)) + "\n" + log};
}

TEST(Nvrtc, DecodePrefillAndMergeKernelsCompile) {
  const std::vector<std::string> kernels = {
      "&attnforge::cuda::decode_kernel<attnforge::cuda::DecodeTraits<64, attnforge::cuda::F16>>",
      "&attnforge::cuda::decode_kernel<attnforge::cuda::DecodeTraits<128, attnforge::cuda::Bf16>>",
      "&attnforge::cuda::decode_kernel<attnforge::cuda::DecodeTraits<256, attnforge::cuda::Bf16>>",
      "&attnforge::cuda::merge_kernel",
      "&attnforge::cuda::prefill_kernel<attnforge::cuda::PrefillTraits<64, attnforge::cuda::Bf16>>",
      "&attnforge::cuda::prefill_kernel<attnforge::cuda::PrefillTraits<128, attnforge::cuda::F16>>",
      "&attnforge::cuda::prefill_kernel<attnforge::cuda::PrefillTraits<256, attnforge::cuda::Bf16>>",
  };
  for (const char* arch : {"sm_80", "sm_90a"}) {
    const Compiled c = compile(arch, kernels);
    EXPECT_TRUE(c.ok) << arch << ": " << c.log;
  }
}

}  // namespace
