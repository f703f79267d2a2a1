// The NVRTC-compiled kernels of one device, both families (decode, prefill) and the merge kernels (one module per
// architecture, jit::merge_source; launched after or beside either where the plan splits KV): keys from params,
// modules from the kernel cache, loaded through the driver API once per key, given the attributes and launched
// with the launch configuration the nvcc build uses (decode.h, prefill.h).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <string>

#include "attnforge/config.h"
#include "attnforge/kernel/params.h"
#include "attnforge/kernel/variant_hooks.h"
#include "backends/cuda/kernel_config.h"
#include "jit/kernel_key.h"

namespace attnforge::cuda {

class JitKernels {
 public:
  JitKernels(int device, int major, int minor);

  struct Kernels {
    CUfunction attention = nullptr;  // the decode or prefill kernel
    CUfunction merge = nullptr;         // from the merge module (built-in keys; null for a custom variant's)
    // Streamed merges (AttentionParams::merge_flags), from the streamed merge's module, loaded only under
    // ATTNFORGE_DECODE_KERNEL_MERGE=stream (the one mode that launches it).
    CUfunction merge_stream = nullptr;
    int ctas_per_sm = 0;
    jit::KernelKey key;
  };
  // Compiles or loads the module of `key` and loads it on the device (once; later calls return the functions); the
  // first built-in key also loads the merge module, compiled beside it.
  const Kernels& kernels(const jit::KernelKey& key);
  // The key run() uses: the family of the plan, the default tiles (what the nvcc build instantiates); a prefill
  // key with `rows` packed query rows per CTA (0: the head dim's; see prefill_plan_rows).
  // A decode key with `stages` K/V stages (0: ATTNFORGE_DECODE_STAGES where set, else the default).
  jit::KernelKey key_for(PlanKind kind, const AttentionShape& shape, bool rope = false, int32_t rows = 0,
                         int32_t stages = 0) const;
  const std::string& arch() const { return arch_; }

  // For plan(): loads the kernels run() may launch for the shape and returns the CTAs of one per SM. A prefill plan
  // does not know whether run() fuses RoPE (an option of run()), and a graph captured with it may replay a re-plan
  // of other query lengths, so every prefill kernel of the shape is loaded (with and without RoPE, both row tiles),
  // and neither run() nor a graph capture ever compiles; the count is the plain kernel's, as in the nvcc build.
  int ctas_per_sm(const AttentionShape& shape, PlanKind kind);
  // The same for the decode kernel of the small-batch pipeline (`stages`: small_batch_decode_stages of the shape),
  // which plan() then loads for run().
  int small_batch_ctas_per_sm(const AttentionShape& shape, int32_t stages);
  void run(const AttentionParams& p, PlanKind kind, cudaStream_t stream);
  // A custom variant's decode kernel (`key` from key_for and KernelKey::set_variant), compiled or loaded on first
  // use. Plans with split KV are refused by run_variant before this.
  void run_variant(const AttentionParams& p, const jit::KernelKey& key, const VariantArgs& args, cudaStream_t stream);

 private:
  // run() finds the kernels of the shapes run() accepts (decode with K/V in Q's dtype, e4m3 or e5m2, prefill,
  // prefill with RoPE, each prefill with the short row tile, decode in the small-batch pipeline x 3 head dims x 2 Q
  // dtypes) without a lock or a string.
  const Kernels& kernels_for(PlanKind kind, const AttentionShape& shape, bool rope, int32_t rows = 0,
                             int32_t stages = 0);

  int device_;
  std::string arch_;
  std::mutex mutex_;
  std::map<std::string, Kernels> loaded_;  // by kernel name (unique per key)
  CUfunction merge_ = nullptr, merge_stream_ = nullptr;  // the merge modules', once a built-in key has loaded them
  std::array<std::atomic<const Kernels*>, 48> by_shape_{};  // 8 variants x 3 head dims x 2 Q dtypes
};

// The launch configuration of a key's attention kernel for a batch (decode_launch_config, prefill_launch_config).
LaunchConfig launch_config(const jit::KernelKey& key, const AttentionParams& p);

}  // namespace attnforge::cuda
