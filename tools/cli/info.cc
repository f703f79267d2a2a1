// `attnforge info`: build, devices, supported configurations.
#include <fmt/format.h>

#include <string>
#include <utility>
#include <vector>

#include "attnforge/attnforge.h"
#include "attnforge/devices.h"
#include "attnforge/jit.h"
#include "commands.h"
#if ATTNFORGE_WITH_CUDA
#include "jit/nvrtc_compiler.h"
#endif

namespace attnforge::cli {

namespace {

const char* dtype_short(DType t) {
  switch (t) {
    case DType::kFloat32: return "fp32";
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat8E4M3: return "e4m3";
    case DType::kFloat8E5M2: return "e5m2";
    default: return "?";
  }
}

// One row per (kind, head_dim, heads), one column per (q dtype, kv dtype). A cell is "ok" or a footnote number;
// the footnotes hold supports()'s reasons, each once, since one reason usually covers a whole row.
void print_support_table(Device device) {
  constexpr DType kQTypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
  constexpr DType kKVTypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E5M2};
  constexpr int32_t kHeadDims[] = {64, 128, 256, 512, 520};
  constexpr std::pair<int32_t, int32_t> kHeads[] = {{32, 32}, {32, 8}};
  std::vector<std::string> reasons;

  fmt::print("\nsupported configurations on {} (attnforge::supports; paged CSR, NHD, page size 16; "
             "columns: q dtype / kv dtype; output dtype = q dtype)\n",
             to_string(device));
  fmt::print("{:<8} {:>8} {:>6} ", "kind", "head_dim", "heads");
  for (DType q : kQTypes)
    for (DType kv : kKVTypes) fmt::print(" {:>9}", fmt::format("{}/{}", dtype_short(q), dtype_short(kv)));
  fmt::print("\n");
  for (PlanKind kind : {PlanKind::kDecode, PlanKind::kPrefill})
    for (int32_t head_dim : kHeadDims)
      for (const auto& [qo_heads, kv_heads] : kHeads) {
        fmt::print("{:<8} {:>8} {:>6} ", kind == PlanKind::kDecode ? "decode" : "prefill", head_dim,
                   fmt::format("{}/{}", qo_heads, kv_heads));
        for (DType q : kQTypes)
          for (DType kv : kKVTypes) {
            AttentionConfig config;
            config.device = device;
            config.kind = kind;
            config.shape = {qo_heads, kv_heads, head_dim, head_dim, q, kv, q};
            const Support s = supports(config);
            std::string cell = "ok";
            if (!s) {
              size_t i = 0;
              while (i < reasons.size() && reasons[i] != s.reason) ++i;
              if (i == reasons.size()) reasons.push_back(s.reason);
              cell = fmt::format("[{}]", i + 1);
            }
            fmt::print(" {:>9}", cell);
          }
        fmt::print("\n");
      }
  for (size_t i = 0; i < reasons.size(); ++i) fmt::print("[{}] {}\n", i + 1, reasons[i]);
}

}  // namespace

int run_info() {
  fmt::print("{}\n", build_info());
#if ATTNFORGE_WITH_CUDA
  const char* modes[] = {"on", "read-only", "off"};
  fmt::print("run-time compiler: NVRTC {}.{}; CUDA kernels launched: {}; kernel cache {} (mode {})\n",
             jit::nvrtc_version().major, jit::nvrtc_version().minor,
             jit::cuda_kernels() == jit::CudaKernels::kNvrtc ? "NVRTC-compiled" : "nvcc-compiled",
             jit::cache_dir().empty() ? "(none)" : jit::cache_dir(), modes[static_cast<int>(jit::cache_mode())]);
#endif
  fmt::print("\ndevices:\n");
  const std::vector<DeviceInfo> devices = available_devices();
  for (const DeviceInfo& d : devices)
    fmt::print("  {:<8} {:<24} {}; attention: {}\n", to_string(d.device), d.name, d.description,
               d.attention ? "yes" : "no");
  for (const DeviceInfo& d : devices)
    if (d.attention) print_support_table(d.device);
  return 0;
}

}  // namespace attnforge::cli
