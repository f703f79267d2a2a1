#include "backends/cuda/jit_kernels.h"

#include <cstdlib>
#include <future>
#include <utility>
#include <vector>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/decode/decode.h"
#include "backends/cuda/decode/decode_defaults.cuh"
#include "backends/cuda/driver_api.h"
#include "backends/cuda/merge/merge.h"
#include "backends/cuda/prefill/prefill.h"
#include "core/check.h"
#include "core/env.h"
#include "jit/kernel_cache.h"

namespace attnforge::cuda {

namespace {

KernelAttributes attributes(const jit::KernelKey& key) {
  if (key.family == jit::KernelFamily::kPrefill)
    return prefill_attributes(key.head_dim_qk, key.prefill_stage_tokens(), key.prefill_rows());
  return decode_attributes(key.head_dim_qk, key.kv_dtype, key.decode_tile.stages);
}

}  // namespace

LaunchConfig launch_config(const jit::KernelKey& key, const AttentionParams& p) {
  if (key.family == jit::KernelFamily::kPrefill)
    return prefill_launch_config(p, key.prefill_stage_tokens(), key.prefill_rows());
  return decode_launch_config(p, key.decode_tile.stages);
}

JitKernels::JitKernels(int device, int major, int minor)
    : device_(device), arch_(jit::arch_for_device(major, minor)) {}

jit::KernelKey JitKernels::key_for(PlanKind kind, const AttentionShape& shape, bool rope, int32_t rows,
                                   int32_t stages) const {
  if (kind == PlanKind::kPrefill) {
    jit::PrefillTile tile;
    tile.rows = rows;
    return jit::prefill_key(shape, arch_, rope, tile);
  }
  // ATTNFORGE_DECODE_STAGES: the decode tile's cp.async stages for tuning runs (README); the key validates it. A
  // plan's own stages (the small-batch pipeline: AttentionPlan::kv_stages) are never made under it.
  if (stages == 0) stages = detail::env_int("ATTNFORGE_DECODE_STAGES", 1, 16, 0);
  if (stages == 0) return jit::decode_key(shape, arch_);
  return jit::decode_key(shape, arch_, jit::DecodeTile{stages});
}

const JitKernels::Kernels& JitKernels::kernels(const jit::KernelKey& key) {
  const std::string name = key.name();
  // Built-in keys launch the merge kernel after theirs (where ATTNFORGE_DECODE_KERNEL_MERGE=stream, the streamed one
  // beside the decode kernel too: its own module, loaded only then); a custom variant's plans never split KV.
  const bool builtin = key.variant == "builtin";
  bool need_merge = false, need_stream = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = loaded_.find(name); it != loaded_.end()) return it->second;
    need_merge = builtin && merge_ == nullptr;
    need_stream = builtin && merge_stream_ == nullptr && decode_merges_streamed();
  }
  // Outside the lock: a compile takes seconds and other keys need not wait for it (the cache compiles each key
  // once however many threads ask). The merge modules, the first time, compile on threads of their own meanwhile.
  using Module = std::shared_ptr<const jit::CompiledModule>;
  auto merge_module = [this](bool streamed) {
    return jit::process_cache().get(jit::merge_source(arch_, streamed), jit::current_settings()).module;
  };
  std::future<Module> merge_lookup, stream_lookup;
  if (need_merge) merge_lookup = std::async(std::launch::async, merge_module, false);
  if (need_stream) stream_lookup = std::async(std::launch::async, merge_module, true);
  const jit::Lookup l = jit::process_cache().get(key.render(), jit::current_settings());
  const Module merge = need_merge ? merge_lookup.get() : nullptr;
  const Module stream = need_stream ? stream_lookup.get() : nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  if (auto it = loaded_.find(name); it != loaded_.end()) return it->second;
  // The modules go into the device's primary context, the one the runtime API launches the nvcc kernels in
  // (cudaSetDevice creates it if nothing has yet). The caller restores its current device.
  ATTNFORGE_CUDA_CHECK(cudaSetDevice(device_));
  const DriverApi& d = driver();
  auto load_merge = [&](const Module& m, CUfunction& f) {
    if (m == nullptr || f != nullptr) return;  // not asked for, or loaded by another key meanwhile
    CUmodule module;
    ATTNFORGE_CU_CHECK(d.cuModuleLoadData(&module, m->binary.data()));
    CUfunction fn;
    ATTNFORGE_CU_CHECK(d.cuModuleGetFunction(&fn, module, m->lowered_names[jit::kMergeEntry].c_str()));
    f = fn;
  };
  load_merge(merge, merge_);
  load_merge(stream, merge_stream_);
  CUmodule module;
  ATTNFORGE_CU_CHECK(d.cuModuleLoadData(&module, l.module->binary.data()));
  Kernels k;
  k.key = key;
  ATTNFORGE_CU_CHECK(d.cuModuleGetFunction(&k.attention, module, l.module->lowered_names[jit::kAttentionEntry].c_str()));
  if (key.variant == "builtin") k.merge = merge_, k.merge_stream = merge_stream_;
  // The attributes configure_kernel() gives the nvcc instantiations.
  const KernelAttributes a = attributes(key);
  ATTNFORGE_CU_CHECK(
      d.cuFuncSetAttribute(k.attention, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, a.max_dynamic_smem));
  ATTNFORGE_CU_CHECK(
      d.cuFuncSetAttribute(k.attention, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, a.carveout_percent));
  ATTNFORGE_CU_CHECK(
      d.cuOccupancyMaxActiveBlocksPerMultiprocessor(&k.ctas_per_sm, k.attention, a.threads, a.max_dynamic_smem));
  return loaded_.emplace(name, k).first->second;  // modules stay loaded for the life of the process
}

const JitKernels::Kernels& JitKernels::kernels_for(PlanKind kind, const AttentionShape& shape, bool rope,
                                                    int32_t rows, int32_t stages) {
  const int dim_index = shape.head_dim_qk == 64 ? 0 : shape.head_dim_qk == 128 ? 1 : shape.head_dim_qk == 256 ? 2 : -1;
  // The kernel variant: decode with K/V in Q's dtype, e4m3 or e5m2 (0-2); prefill without or with RoPE (3, 4),
  // and the same with the short row tile (5, 6); decode with K/V in Q's dtype in the small-batch pipeline (7). Other
  // decode stages (tuning runs) go through the map.
  const bool same_kv = shape.kv_dtype == shape.q_dtype;
  const bool small_batch =
      stages != 0 && stages == small_batch_decode_stages(shape.head_dim_qk, shape.q_dtype, shape.kv_dtype);
  if (kind != PlanKind::kPrefill && stages != 0 && !small_batch)
    return kernels(key_for(kind, shape, rope, rows, stages));
  if (kind == PlanKind::kPrefill && rows == cuda::prefill_rows(shape.head_dim_qk)) rows = 0;
  int variant = -1;
  if (kind == PlanKind::kPrefill)
    variant = same_kv ? 3 + rope + (rows == 0 ? 0 : 2) : -1;
  else
    variant = small_batch                              ? 7
              : same_kv                              ? 0
              : shape.kv_dtype == DType::kFloat8E4M3 ? 1
              : shape.kv_dtype == DType::kFloat8E5M2 ? 2
                                                     : -1;
  const bool indexed = dim_index >= 0 && variant >= 0 &&
                       (shape.q_dtype == DType::kFloat16 || shape.q_dtype == DType::kBFloat16);
  // Not indexed: kernels() throws kUnsupported naming what no kernel serves.
  if (!indexed) return kernels(key_for(kind, shape, rope, rows, stages));
  std::atomic<const Kernels*>& slot = by_shape_[(variant * 3 + dim_index) * 2 + (shape.q_dtype == DType::kBFloat16)];
  if (const Kernels* k = slot.load(std::memory_order_acquire)) return *k;
  const Kernels& k = kernels(key_for(kind, shape, rope, rows, stages));
  slot.store(&k, std::memory_order_release);
  return k;
}

int JitKernels::ctas_per_sm(const AttentionShape& shape, PlanKind kind) {
  if (kind != PlanKind::kPrefill) return kernels_for(kind, shape, false).ctas_per_sm;
  // The other prefill kernels (with RoPE, with the short row tile) compile on other threads meanwhile (the kernel
  // cache lets lookups of different keys run at once); their failures are reported like the plain kernel's.
  std::vector<std::pair<int32_t, bool>> tiles = {{0, true}};  // (rows, RoPE) besides the plain kernel's (0, false)
  if (prefill_rows(shape.head_dim_qk) != kPrefillShortRows)
    tiles.insert(tiles.end(), {{kPrefillShortRows, false}, {kPrefillShortRows, true}});
  std::vector<std::future<void>> others;
  for (const std::pair<int32_t, bool>& t : tiles)
    others.push_back(std::async(std::launch::async, [&, t] { kernels_for(kind, shape, t.second, t.first); }));
  const int n = kernels_for(kind, shape, false).ctas_per_sm;
  for (std::future<void>& f : others) f.get();
  return n;
}

int JitKernels::small_batch_ctas_per_sm(const AttentionShape& shape, int32_t stages) {
  return kernels_for(PlanKind::kDecode, shape, false, 0, stages).ctas_per_sm;
}

void JitKernels::run(const AttentionParams& p, PlanKind kind, cudaStream_t stream) {
  const AttentionShape shape{p.num_qo_heads, p.num_kv_heads, p.head_dim_qk, p.head_dim_vo,
                             p.q_dtype,      p.kv.dtype,     p.o_dtype};
  const bool prefill = kind == PlanKind::kPrefill;
  const Kernels& k = kernels_for(kind, shape, prefill && p.variant.rope.enabled, prefill ? prefill_plan_rows(p) : 0,
                                 prefill ? 0 : p.kv_stages);
  const LaunchConfig c = launch_config(k.key, p);
  AttentionParams params = p;
  void* args[] = {&params};
  const DriverApi& d = driver();
  // Programmatic dependents where the GPU has them, as the nvcc build's launches: decode on the kernel before it
  // (decode_programmatic_launch), the merge on the attention kernel.
  auto launch = [&](CUfunction f, const KernelDims& dims, bool programmatic) {
    CUlaunchAttribute attribute{};
    attribute.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attribute.value.programmaticStreamSerializationAllowed = 1;
    CUlaunchConfig config{};
    config.gridDimX = dims.grid.x, config.gridDimY = dims.grid.y, config.gridDimZ = dims.grid.z;
    config.blockDimX = dims.block.x, config.blockDimY = dims.block.y, config.blockDimZ = dims.block.z;
    config.sharedMemBytes = dims.smem_bytes, config.hStream = static_cast<CUstream>(stream);
    config.attrs = &attribute;
    config.numAttrs = programmatic ? 1 : 0;
    ATTNFORGE_CU_CHECK(d.cuLaunchKernelEx(&config, f, args, nullptr));
  };
  launch(k.attention, c.attention, !prefill && p.programmatic_launch && decode_programmatic_launch());
  if (c.run_merge) {
    const CUfunction merge = p.merge_flags != nullptr ? k.merge_stream : k.merge;
    if (merge == nullptr)  // a plan made under another ATTNFORGE_DECODE_KERNEL_MERGE than the kernels were loaded under
      detail::fail(ErrorKind::kBackend, "run-time compiled {} merge kernel for {} not loaded (it is loaded with the "
                   "attention kernel when plan() runs; ATTNFORGE_DECODE_KERNEL_MERGE={})",
                   p.merge_flags != nullptr ? "streamed" : "plain", k.key.name(), decode_kernel_merge_mode());
    launch(merge, c.merge, merge_programmatic_launch());
  }
}

void JitKernels::run_variant(const AttentionParams& p, const jit::KernelKey& key, const VariantArgs& args,
                             cudaStream_t stream) {
  const Kernels& k = kernels(key);
  const LaunchConfig c = launch_config(k.key, p);
  AttentionParams params = p;
  VariantArgs variant_args = args;
  void* kernel_args[] = {&params, &variant_args};
  const KernelDims& dims = c.attention;
  ATTNFORGE_CU_CHECK(driver().cuLaunchKernel(k.attention, dims.grid.x, dims.grid.y, dims.grid.z, dims.block.x,
                                             dims.block.y, dims.block.z, dims.smem_bytes,
                                             static_cast<CUstream>(stream), kernel_args, nullptr));
}

}  // namespace attnforge::cuda
