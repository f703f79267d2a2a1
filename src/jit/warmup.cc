// jit::warmup: every kernel a list of configurations needs, compiled (or loaded) in parallel.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "attnforge/jit.h"
#include "attnforge/variant.h"
#include "core/check.h"
#if ATTNFORGE_WITH_CUDA
#include "backends/cuda/device_info.h"
#include "backends/cuda/merge/merge.h"
#include "backends/cuda/prefill/tile_config.cuh"
#include "jit/kernel_key.h"
#include "jit/warmup.h"
#endif

namespace attnforge::jit {

bool WarmupReport::ok() const {
  return std::all_of(kernels.begin(), kernels.end(), [](const Kernel& k) { return k.error.empty(); });
}

std::vector<AttentionConfig> default_warmup_configs() {
  // Heads per model only fix the query-head group, a run-time value of both kernels; they are listed so the
  // configurations read as the models they come from.
  struct Model {
    int32_t qo_heads, kv_heads, head_dim;
  };
  constexpr Model kModels[] = {
      {32, 8, 128},  // Llama 3 8B, Mistral 7B
      {64, 8, 128},  // Llama 3 70B
      {28, 4, 128},  // Qwen2.5 7B
      {16, 8, 64},   // Llama 3.2 1B (head_dim 64)
      {14, 2, 64},   // Qwen2.5 0.5B
      {16, 8, 256},  // Gemma-style head_dim 256
  };
  // K/V in the dtype of Q or, for decode, an fp8 cache (e4m3fn or e5m2, with per-tensor scales). RoPE fused or not
  // is a key of the prefill kernel (a template switch) and a run-time value of decode's.
  std::vector<AttentionConfig> out;
  auto add = [&](const Model& m, PlanKind kind, DType t, DType kv, bool rope) {
    for (int32_t page : {1, 16}) {
      AttentionConfig c;
      c.device = Device::cuda(0);
      c.kind = kind;
      c.shape = {m.qo_heads, m.kv_heads, m.head_dim, m.head_dim, t, kv, t};
      c.page_size = page;
      c.rope = rope;
      out.push_back(c);
    }
  };
  for (const Model& m : kModels)
    for (DType t : {DType::kBFloat16, DType::kFloat16}) {
      for (DType kv : {t, DType::kFloat8E4M3, DType::kFloat8E5M2}) add(m, PlanKind::kDecode, t, kv, false);
      for (bool rope : {false, true}) add(m, PlanKind::kPrefill, t, t, rope);
    }
  return out;
}

#if !ATTNFORGE_WITH_CUDA
WarmupReport warmup(const std::vector<AttentionConfig>&, const WarmupOptions&) {
  detail::fail(ErrorKind::kUnsupported,
               "warmup: this build has no run-time compiler (it was configured without the CUDA toolkit, so without "
               "NVRTC); nothing to warm");
}
#else
WarmupReport warmup(const std::vector<AttentionConfig>& configs, const WarmupOptions& options) {
  return warmup_with(process_cache(), current_settings(), configs, options);
}

WarmupReport warmup_with(KernelCache& cache, const CacheSettings& settings, const std::vector<AttentionConfig>& configs,
                         const WarmupOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> archs = options.archs;
  if (archs.empty()) {
    for (const detail::CudaDeviceInfo& d : detail::cuda_devices()) {
      const std::string a = arch_for_device(d.major, d.minor);
      if (std::find(archs.begin(), archs.end(), a) == archs.end()) archs.push_back(a);
    }
    if (archs.empty())
      detail::fail(ErrorKind::kUnsupported,
                   "warmup: no CUDA device is visible, so no architecture to compile for; name one or more "
                   "(WarmupOptions::archs, `attnforge warmup --arch sm_90a`)");
  }
  WarmupReport report;
  std::vector<KernelKey> keys;
  for (const AttentionConfig& c : configs) {
    const std::string what = fmt::format("{}{} {} heads {}/{} head_dim {} q {} kv {} page {}",
                                         c.kind == PlanKind::kDecode ? "decode" : "prefill", c.rope ? " rope" : "",
                                         to_string(c.device), c.shape.num_qo_heads, c.shape.num_kv_heads,
                                         c.shape.head_dim_qk, to_string(c.shape.q_dtype), to_string(c.shape.kv_dtype),
                                         c.page_size);
    for (const std::string& arch : archs) {
      try {
        std::vector<KernelKey> ks;
        if (c.kind == PlanKind::kDecode) {
          ks.push_back(decode_key(c.shape, arch));
          // The small-batch pipeline's kernel, which plan() loads for batches too small to fill the GPU (compiled for
          // every architecture named; where a GPU's shared memory cannot hold it, sm_8x at head_dim 256, plan()
          // keeps the default kernel and this one goes unused).
          const AttentionShape& s = c.shape;
          if (const int stages = cuda::small_batch_decode_stages(s.head_dim_qk, s.q_dtype, s.kv_dtype))
            ks.push_back(decode_key(s, arch, DecodeTile{stages}));
        } else {
          // Both row tiles: run() picks one per plan (prefill_plan_rows), and neither may compile at run time.
          ks.push_back(prefill_key(c.shape, arch, c.rope));
          if (cuda::prefill_rows(c.shape.head_dim_qk) != cuda::kPrefillShortRows)
            ks.push_back(prefill_key(c.shape, arch, c.rope, PrefillTile{1, cuda::kPrefillShortRows}));
        }
        for (const KernelKey& k : ks)
          if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
      } catch (const Error& e) {
        report.skipped.push_back(what + ": " + e.what());
        break;
      }
    }
  }

  // Prefill compiles take the longest: they start first, then the merge module of each architecture with a kernel
  // to warm (every decode and prefill kernel launches its split-KV merge kernel; under
  // ATTNFORGE_DECODE_KERNEL_MERGE=stream the streamed merge's module too), and the short decode ones fill the tail,
  // so the wall time stays near the sum over threads.
  std::stable_partition(keys.begin(), keys.end(),
                        [](const KernelKey& k) { return k.family == KernelFamily::kPrefill; });
  std::vector<KernelSource> sources;
  for (const KernelKey& k : keys) sources.push_back(k.render());
  const auto first_decode = std::find_if(keys.begin(), keys.end(),
                                         [](const KernelKey& k) { return k.family != KernelFamily::kPrefill; });
  std::vector<KernelSource> merges;
  for (const std::string& arch : archs)
    if (std::any_of(keys.begin(), keys.end(), [&](const KernelKey& k) { return k.arch == arch; })) {
      merges.push_back(merge_source(arch));
      if (cuda::decode_merges_streamed()) merges.push_back(merge_source(arch, /*streamed=*/true));
    }
  sources.insert(sources.begin() + (first_decode - keys.begin()), merges.begin(), merges.end());

  const int32_t hw = static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
  report.threads = std::min<int32_t>(options.threads > 0 ? options.threads : hw,
                                     static_cast<int32_t>(std::max<size_t>(1, sources.size())));
  report.kernels.resize(sources.size());
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next++; i < sources.size(); i = next++) {
      WarmupReport::Kernel& k = report.kernels[i];
      k.name = sources[i].name;
      try {
        const Lookup l = cache.get(sources[i], settings);
        k.key = l.key.hex();
        k.origin = to_string(l.origin);
        k.seconds = l.seconds;
      } catch (const std::exception& e) {
        k.error = e.what();
      }
    }
  };
  std::vector<std::thread> threads;
  for (int32_t i = 0; i < report.threads; ++i) threads.emplace_back(worker);
  for (std::thread& t : threads) t.join();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return report;
}
#endif

}  // namespace attnforge::jit
