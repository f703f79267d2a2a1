// Run-time compiled CUDA kernels (NVRTC): the kernel cache, its settings and warm-up.
//
// Kernels are compiled in process by NVRTC from headers embedded in the library, for the device's architecture
// (sm_90a on Hopper, sm_80 and newer otherwise), and cached on disk by a hash of everything that went into them.
// Settings come from the environment and can be changed through this API at any time:
//   ATTNFORGE_CACHE_DIR   where the cache lives (default $XDG_CACHE_HOME/attnforge/kernels, else
//                         ~/.cache/attnforge/kernels); created with mode 0700
//   ATTNFORGE_CACHE_MODE  on (default) | read-only | off
//   ATTNFORGE_JIT_LOG     stderr (default) | quiet
//   ATTNFORGE_KERNELS     nvcc (default) | nvrtc: which build of the CUDA kernels run() launches (read once)
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "attnforge/config.h"

namespace attnforge::jit {

enum class CacheMode {
  kOn,        // load from disk; compile what is missing and publish it
  kReadOnly,  // load from disk; compile what is missing in memory, never write
  kOff,       // no run-time compilation: load from disk or memory only; a missing kernel is an error that names
              // its key and the `attnforge warmup` command that builds it
};

void set_cache_dir(const std::string& dir);  // empty: back to the environment / default
std::string cache_dir();
void set_cache_mode(CacheMode mode);
CacheMode cache_mode();
CacheMode parse_cache_mode(const std::string& text);  // "on", "read-only", "off"; throws kInvalidArgument

// One line per event: before each compile (naming the kernel and its key) and after it (with the duration),
// damaged or refused cache entries. Default: stderr.
using LogSink = std::function<void(const std::string& line)>;
void set_log_sink(LogSink sink);  // null: stderr
void set_quiet(bool quiet);       // no log lines at all

// Which build of the CUDA kernels run() launches: the nvcc-compiled ones linked into the library, or the same
// kernel source compiled at run time by NVRTC. Both read the same params and use the same launch configuration.
enum class CudaKernels { kNvcc, kNvrtc };
void set_cuda_kernels(CudaKernels kernels);
CudaKernels cuda_kernels();

struct WarmupOptions {
  std::vector<std::string> archs;  // e.g. {"sm_90a"}; empty: the architectures of the visible CUDA devices
  int32_t threads = 0;             // 0: every core
};

struct WarmupReport {
  struct Kernel {
    std::string name;     // readable, e.g. "decode_d128_bf16_st2_sm90a"
    std::string key;      // the cache key (32 hex digits)
    std::string origin;   // "compiled", "disk" or "memory"
    double seconds = 0;   // time to get it (compile, or load and verify)
    std::string error;    // empty unless it failed
  };
  // One per distinct kernel the configurations need, and the split-KV merge module ("merge_sm90a") of each
  // architecture they need any for.
  std::vector<Kernel> kernels;
  std::vector<std::string> skipped;     // configurations no run-time kernel serves, with the reason
  double seconds = 0;                   // wall time of the whole warm-up
  int32_t threads = 0;
  bool ok() const;
};

// Compiles (or loads) every kernel the configurations need, in parallel. Configurations that differ only in
// run-time values (page size, number of heads; RoPE for decode) share kernels; configurations the run-time kernels
// do not serve (fp8 K/V, other head dims) are listed in `skipped`. Throws kUnsupported in a build without NVRTC.
WarmupReport warmup(const std::vector<AttentionConfig>& configs, const WarmupOptions& options = {});

// The common Llama, Qwen and Mistral shapes, decode and prefill: head_dim 64/128/256, fp16/bf16, page sizes 1 and
// 16, prefill with and without RoPE fused (a kernel each). fp8 K/V is left out: the CUDA kernels do not take it yet.
std::vector<AttentionConfig> default_warmup_configs();

}  // namespace attnforge::jit
