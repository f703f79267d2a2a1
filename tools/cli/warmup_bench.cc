// `attnforge warmup --bench`: the run-time compiler's figures, each next to its target (issue 5):
//   cold compile of one decode specialization (<= 3 s) and of one prefill specialization (<= 8 s), and of the
//   split-KV merge module both launch (one per architecture, compiled beside the first kernel a process loads;
//   held to the decode target), load from the disk cache (<= 10 ms), warm-up of the default set for one model shape (<= 20 s on every core), and on a GPU the
//   NVRTC-compiled kernels' speed against the nvcc-compiled ones on the GPU suite's decode and prefill shapes
//   (within 3%).
// Every compile goes to a fresh temporary cache (and a fresh memory cache), so nothing is warm by accident and the
// user's cache is untouched.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "attnforge/devices.h"
#include "attnforge/jit.h"
#include "backends/cuda/device_info.h"
#include "backends/cuda/driver_api.h"
#include "bench_common.h"
#include "commands.h"
#include "jit/kernel_cache.h"
#include "jit/kernel_key.h"
#include "jit/warmup.h"

namespace attnforge::cli {

namespace {

namespace fs = std::filesystem;

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

const char* verdict(bool ok) { return ok ? "meets the target" : "MISSES the target"; }

}  // namespace

int run_warmup_bench(const WarmupCommandOptions& o) {
  // NVRTC 12.9 and newer keep compile results of their own in the driver's compute cache (~/.nv/ComputeCache)
  // whenever a driver is present: a second "cold" compile of the same source on a GPU machine took 0.04 s instead
  // of about 1 s (H200, c4a3fbf). That cache reads CUDA_CACHE_DISABLE once, when NVRTC or the driver first starts,
  // so it is turned off here, before either does, and every compile below is a compile.
  setenv("CUDA_CACHE_DISABLE", "1", 1);
  const std::vector<detail::CudaDeviceInfo> gpus = detail::cuda_devices();
  const std::string arch = !o.archs.empty() ? o.archs[0]
                           : !gpus.empty()  ? jit::arch_for_device(gpus[0].major, gpus[0].minor)
                                            : "sm_90a";
  // Modules load, and NVRTC kernels race nvcc's, only for the GPU's own architecture (an sm_80 cubin does not
  // load on an sm_90 GPU): `--arch sm_80` on a Hopper machine measures compile and cache times alone.
  const bool on_gpu = !gpus.empty() && arch == jit::arch_for_device(gpus[0].major, gpus[0].minor);
  std::string tmpl = (fs::temp_directory_path() / "attnforge-warmup-bench-XXXXXX").string();
  if (!mkdtemp(tmpl.data())) throw std::runtime_error("cannot create a temporary directory");
  const fs::path root = tmpl;
  jit::CacheSettings settings;
  settings.quiet = true;
  const int32_t threads = o.threads > 0 ? o.threads : static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
  nlohmann::json json;
  json["commit"] = git_commit(), json["arch"] = arch, json["threads"] = threads;
  json["device"] = gpus.empty() ? "none" : gpus[0].name;
  json["nvrtc_own_cache"] = "off (CUDA_CACHE_DISABLE=1)";
  fmt::print("attnforge warmup --bench: {}\nNVRTC {}.{} (its own compile cache off), arch {}, {} threads, "
             "device {}\n\n",
             build_info(), jit::nvrtc_version().major, jit::nvrtc_version().minor, arch, threads,
             gpus.empty() ? "none (compile figures only)" : gpus[0].name);

  // 1. Cold compile of one decode and one prefill specialization (head_dim 128, bf16, the default tiles, no RoPE):
  // three times each (once with --compile-check), each in a fresh cache.
  const int cold_runs = o.compile_check ? 1 : 3;
  auto cold_compile = [&](const jit::KernelSource& src, double target_s, const char* json_key) {
    std::vector<double> cold;
    for (int i = 0; i < cold_runs; ++i) {
      settings.dir = (root / fmt::format("{}-{}", src.name, i)).string();
      jit::KernelCache cache;
      cold.push_back(cache.get(src, settings).seconds);
    }
    const double median = median_of(cold);
    fmt::print("cold compile of {}: {:.2f} s (median of {}: {:.2f} s; the process's first compile also loads "
               "NVRTC's builtins); target <= {:.0f} s: {}\n",
               src.name, median, cold_runs, fmt::join(cold, " s, "), target_s, verdict(median <= target_s));
    json[json_key] = cold;
  };
  const AttentionShape shape{32, 8, 128, 128, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16};
  const jit::KernelSource source = jit::decode_key(shape, arch).render();
  const jit::KernelSource prefill_source = jit::prefill_key(shape, arch, /*rope=*/false).render();
  const jit::KernelSource merge_source = jit::merge_source(arch);
  cold_compile(source, 3, "cold_compile_s");
  cold_compile(prefill_source, 8, "cold_compile_prefill_s");
  cold_compile(merge_source, 3, "cold_compile_merge_s");

  // 2. Load from the disk cache: a fresh memory cache each time (read, check header and payload hash), then, on a
  // GPU, the module load and function lookups that make it launchable.
  auto disk_load = [&](const jit::KernelSource& src, const char* json_prefix) {
    settings.dir = (root / fmt::format("{}-0", src.name)).string();
    std::vector<double> disk_ms, module_ms;
    for (int i = 0; i < 21; ++i) {
      jit::KernelCache cache;
      const jit::Lookup l = cache.get(src, settings);
      if (l.origin != jit::Origin::kDisk) throw std::runtime_error("the warm lookup did not come from the disk cache");
      disk_ms.push_back(l.seconds * 1e3);
      if (on_gpu) {
        const cuda::DriverApi& d = cuda::driver();
        if (i == 0 && (cudaSetDevice(gpus[0].id) != cudaSuccess || cudaFree(nullptr) != cudaSuccess))
          throw std::runtime_error("cannot initialize the GPU");
        const auto t0 = std::chrono::steady_clock::now();
        CUmodule module;
        CUfunction f;
        ATTNFORGE_CU_CHECK(d.cuModuleLoadData(&module, l.module->binary.data()));
        for (const std::string& name : l.module->lowered_names)
          ATTNFORGE_CU_CHECK(d.cuModuleGetFunction(&f, module, name.c_str()));
        module_ms.push_back(seconds_since(t0) * 1e3);
        ATTNFORGE_CU_CHECK(d.cuModuleUnload(module));
      }
    }
    const double disk = median_of(disk_ms);
    const double load = module_ms.empty() ? 0 : median_of(module_ms);
    const std::string module_part =
        module_ms.empty() ? fmt::format(" (no GPU of arch {}: module load not measured)", arch)
                          : fmt::format(" + {:.3f} ms cuModuleLoadData and lookups = {:.3f} ms", load, disk + load);
    fmt::print("warm load of {} from the disk cache: {:.3f} ms read and verified{}; target <= 10 ms: {}\n", src.name,
               disk, module_part, verdict(disk + load <= 10));
    json[fmt::format("{}disk_load_ms", json_prefix)] = disk, json[fmt::format("{}module_load_ms", json_prefix)] = load;
  };
  disk_load(source, "");
  disk_load(prefill_source, "prefill_");
  disk_load(merge_source, "merge_");

  // 3. Warm-up, cold: the default set for one model shape (Llama 3 8B: 32/8 heads, head_dim 128; decode, prefill
  // with and without RoPE), then the whole default set, each into a fresh cache with every core.
  jit::WarmupOptions wo;
  wo.archs = {arch};
  wo.threads = threads;
  auto cold_warmup = [&](const char* what, const std::vector<AttentionConfig>& configs, const char* dir) {
    settings.dir = (root / dir).string();
    jit::KernelCache cache;
    const jit::WarmupReport r = jit::warmup_with(cache, settings, configs, wo);
    if (!r.ok()) throw std::runtime_error(fmt::format("warm-up of {} failed", what));
    // Compile time summed over kernels / wall time: how many compiles really ran at once (NVRTC's own locking
    // would show here as a figure near 1 whatever the thread count).
    double compile_sum = 0;
    for (const jit::WarmupReport::Kernel& k : r.kernels) compile_sum += k.seconds;
    fmt::print("warm-up of {}: {} configurations, {} kernels, {:.2f} s on {} threads ({:.1f} compiles at once)", what,
               configs.size(), r.kernels.size(), r.seconds, r.threads, compile_sum / r.seconds);
    return r;
  };
  std::vector<AttentionConfig> llama;
  for (const AttentionConfig& c : jit::default_warmup_configs())
    if (c.shape.num_qo_heads == 32 && c.shape.num_kv_heads == 8 && c.shape.head_dim_qk == 128) llama.push_back(c);
  const jit::WarmupReport one =
      cold_warmup("the default set for Llama 3 8B (decode with K/V 16-bit, e4m3, e5m2; prefill with and without RoPE; "
                  "fp16/bf16; pages 1/16)",
                  llama, "llama");
  fmt::print("; target <= 20 s: {}\n", verdict(one.seconds <= 20));
  json["warmup_one_model_s"] = one.seconds, json["warmup_one_model_kernels"] = one.kernels.size();
  if (o.compile_check) {
    fmt::print("warm-up of the whole default set: not run (--compile-check)\n");
  } else {
    const jit::WarmupReport all = cold_warmup("the whole default set", jit::default_warmup_configs(), "all");
    fmt::print("\n");
    json["warmup_default_set_s"] = all.seconds, json["warmup_default_set_kernels"] = all.kernels.size();
  }

  // 4. NVRTC-compiled against nvcc-compiled kernels, same shapes, buffers and plans.
  if (on_gpu) {
    DeviceInfo device;
    device.device = Device::cuda(gpus[0].id);
    device.name = gpus[0].name;
    jit::set_cache_dir((root / "speed").string());
    const int32_t iters = o.iters > 0 ? o.iters : (o.quick ? 20 : 100);
    const std::vector<CompilerComparison> rows = compare_kernel_builds(device, o.quick, iters);
    fmt::print("\nNVRTC vs nvcc kernels ({} timed runs per build per round, two rounds each, alternating):\n", iters);
    fmt::print("{:<30} {:>10} {:>10} {:>12} {:>16}\n", "case", "nvcc_us", "nvrtc_us", "nvrtc/nvcc", "NVRTC rate");
    double worst = 0;
    nlohmann::json speed = nlohmann::json::array();
    for (const CompilerComparison& r : rows) {
      const double ratio = r.nvrtc_us / r.nvcc_us;
      worst = std::max(worst, ratio);
      // Decode is memory-bound (TB/s of K/V), prefill compute-bound (TFLOP/s), as in `attnforge bench`.
      const std::string rate = r.prefill ? fmt::format("{:.1f} TFLOP/s", r.flops / (r.nvrtc_us * 1e6))
                                         : fmt::format("{:.2f} TB/s", r.bytes / (r.nvrtc_us * 1e6));
      fmt::print("{:<30} {:>10.1f} {:>10.1f} {:>12.3f} {:>16}\n", r.name, r.nvcc_us, r.nvrtc_us, ratio, rate);
      speed.push_back({{"case", r.name}, {"nvcc_us", r.nvcc_us}, {"nvrtc_us", r.nvrtc_us}, {"ratio", ratio}});
    }
    fmt::print("slowest NVRTC/nvcc ratio: {:.3f}; target <= 1.03: {}\n", worst, verdict(worst <= 1.03));
    json["speed"] = speed;
    jit::set_cache_dir("");
  } else {
    fmt::print("NVRTC vs nvcc kernel speed: no GPU visible, not measured\n");
  }
  if (!o.json_path.empty()) {
    std::ofstream out(o.json_path);
    if (!out) throw std::runtime_error(fmt::format("--json {}: cannot open the file for writing", o.json_path));
    out << json.dump(1) << "\n";
  }
  std::error_code ec;
  fs::remove_all(root, ec);
  return 0;
}

}  // namespace attnforge::cli
