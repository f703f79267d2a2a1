#include "attnforge/devices.h"

#include <fmt/format.h>

#include <thread>

#include "attnforge/config.h"
#if ATTNFORGE_WITH_CUDA
#include "backends/cuda/device_info.h"
#endif

namespace attnforge {

namespace {
std::string cpu_features() {
  std::string f;
#if defined(__AVX512F__)
  f += " avx512f";
#endif
#if defined(__AVX512BF16__)
  f += " avx512bf16";
#endif
#if defined(__AVX2__)
  f += " avx2";
#endif
#if defined(__FMA__)
  f += " fma";
#endif
#if defined(__F16C__)
  f += " f16c";
#endif
  return f.empty() ? " (baseline x86-64 or other)" : f;
}
}  // namespace

std::vector<DeviceInfo> available_devices() {
  std::vector<DeviceInfo> out;
  const unsigned threads = std::thread::hardware_concurrency();
  out.push_back({Device::cpu(), "cpu", fmt::format("{} hardware threads; compiled for{}", threads, cpu_features()), true});
#if ATTNFORGE_WITH_CUDA
  for (const auto& d : detail::cuda_devices())
    out.push_back({Device::cuda(d.id), d.name,
                   fmt::format("sm_{}{}, {} SMs, {:.1f} GiB, L2 {:.1f} MiB", d.major, d.minor, d.sms,
                               d.memory_bytes / 1073741824.0, d.l2_bytes / 1048576.0),
                   d.major >= 8});
#endif
  return out;
}

std::string build_info() {
  return fmt::format("attnforge {} (commit {}), {} {}, C++{}, CUDA {}", version(), git_commit(),
#if defined(__clang__)
                     "clang", __clang_version__,
#else
                     "g++", __VERSION__,
#endif
                     __cplusplus / 100 % 100,
#if ATTNFORGE_WITH_CUDA
                     "on (" ATTNFORGE_CUDA_ARCHS_TEXT "; batch decode and prefill)"
#else
                     "off"
#endif
  );
}

}  // namespace attnforge
