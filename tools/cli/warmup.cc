// `attnforge warmup`: compiles the run-time (NVRTC) kernels of a set of decode and prefill configurations into the
// kernel cache, in parallel, so that no request waits for a compile. `--bench` measures the compiler and the cache
// instead (warmup_bench.cc).
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "attnforge/jit.h"
#include "bench_common.h"
#include "commands.h"

namespace attnforge::cli {

namespace {

template <typename T>
bool wanted(const std::vector<T>& list, const T& value) {
  return list.empty() || std::find(list.begin(), list.end(), value) != list.end();
}

}  // namespace

std::vector<AttentionConfig> warmup_configs(const WarmupCommandOptions& o) {
  auto kv_name = [](const AttentionShape& s) {
    return s.kv_dtype == s.q_dtype ? "same" : s.kv_dtype == DType::kFloat8E4M3 ? "e4m3" : "e5m2";
  };
  auto selected = [&](const AttentionConfig& c) {
    const std::string dtype = c.shape.q_dtype == DType::kFloat16 ? "fp16" : "bf16";
    return wanted(o.dtypes, dtype) && wanted(o.kv_dtypes, std::string(kv_name(c.shape))) &&
           wanted(o.page_sizes, c.page_size);
  };
  std::vector<AttentionConfig> out;
  for (const AttentionConfig& c : jit::default_warmup_configs())
    if (wanted(o.head_dims, c.shape.head_dim_qk) && selected(c)) out.push_back(c);
  // Head dims outside the default set (a model of its own): the configurations of one model of the default set
  // (Llama 3 8B: decode with each K/V dtype, prefill with and without RoPE) with this head dim.
  for (int32_t d : o.head_dims)
    if (std::none_of(out.begin(), out.end(), [&](const AttentionConfig& c) { return c.shape.head_dim_qk == d; }))
      for (AttentionConfig c : jit::default_warmup_configs())
        if (c.shape.num_qo_heads == 32 && c.shape.num_kv_heads == 8 && c.shape.head_dim_qk == 128 && selected(c)) {
          c.shape.head_dim_qk = c.shape.head_dim_vo = d;
          out.push_back(c);
        }
  return out;
}

int run_warmup(const WarmupCommandOptions& o) {
  if (!o.cache_dir.empty()) jit::set_cache_dir(o.cache_dir);
  if (o.quiet) jit::set_quiet(true);
  if (o.bench) {
#if ATTNFORGE_WITH_CUDA
    return run_warmup_bench(o);
#else
    throw std::runtime_error("--bench: this build has no run-time compiler (configured without the CUDA toolkit)");
#endif
  }
  const std::vector<AttentionConfig> configs = warmup_configs(o);
  if (configs.empty())
    throw std::runtime_error("no configuration matches --head-dim, --dtype, --kv-dtype and --page-size");
  jit::WarmupOptions options;
  options.archs = o.archs;
  options.threads = o.threads;
  const jit::WarmupReport r = jit::warmup(configs, options);
  fmt::print("attnforge warmup: {} configurations -> {} kernels, {:.2f} s on {} threads; cache {}\n", configs.size(),
             r.kernels.size(), r.seconds, r.threads, jit::cache_dir().empty() ? "(none: memory only)" : jit::cache_dir());
  fmt::print("(page size and head counts are run-time values of the kernels, so configurations that differ only in "
             "them share a kernel; prefill has a kernel with RoPE fused and one without, and takes K/V in the dtype "
             "of Q)\n");
  fmt::print("{:<34} {:>9} {:>10}  {}\n", "kernel", "from", "ms", "cache key");
  for (const jit::WarmupReport::Kernel& k : r.kernels)
    fmt::print("{:<34} {:>9} {:>10.2f}  {}\n", k.name, k.error.empty() ? k.origin : "FAILED", k.seconds * 1e3,
               k.error.empty() ? k.key : k.error);
  for (const std::string& s : r.skipped) fmt::print("skipped: {}\n", s);
  return r.ok() ? 0 : 1;
}

}  // namespace attnforge::cli
