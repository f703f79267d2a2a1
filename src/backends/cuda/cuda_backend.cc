// The CUDA backend: batch decode and batch prefill/append on paged and ragged KV (sm_80 and newer), with the
// nvcc-compiled kernels or, with ATTNFORGE_KERNELS=nvrtc, the same kernels compiled at run time. One instance per
// device.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "attnforge/jit.h"
#include "backends/backend.h"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/decode/decode.h"
#include "backends/cuda/decode/decode_defaults.cuh"
#include "backends/cuda/jit_kernels.h"
#include "backends/cuda/merge/merge.h"
#include "backends/cuda/prefill/prefill.h"
#include "core/check.h"
#include "core/env.h"
#include "core/shape.h"

namespace attnforge::detail {

namespace {

// Restores the calling thread's current device when it goes out of scope.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    ATTNFORGE_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) ATTNFORGE_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    int now = previous_;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
};

void expect_aligned(const void* ptr, const char* name) {
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
    fail_arg("{}: address {} is not 16-byte aligned; the CUDA kernels read rows in 16-byte vectors", name, ptr);
}
void expect_stride(int64_t stride, int32_t elem_bytes, const char* name) {
  if (stride * elem_bytes % 16 != 0)
    fail_arg("{}: stride {} elements of {} bytes; the CUDA kernels need strides that are multiples of 16 bytes", name,
             stride, elem_bytes);
}

// The K/V tile loader keeps page and token strides as unsigned 32-bit byte counts (device/tiles.cuh).
void expect_narrow_stride(int64_t stride, int32_t elem_bytes, const char* name) {
  const int64_t bytes = stride * elem_bytes;
  if (bytes < 0 || bytes >= (int64_t{1} << 31))
    fail(ErrorKind::kUnsupported, "{}: stride {} elements of {} bytes ({} bytes); the CUDA kernels take K/V page and "
         "token strides from 0 to 2 GiB - 1 bytes", name, stride, elem_bytes, bytes);
}

// The alignment and strides every CUDA attention kernel (built-in or custom variant) needs.
void expect_kernel_layout(const AttentionParams& p) {
  expect_aligned(p.q, "q");
  const int32_t qb = dtype_bytes(p.q_dtype), kvb = dtype_bytes(p.kv.dtype);
  expect_stride(p.q_stride_token, qb, "q (token)");
  expect_stride(p.q_stride_head, qb, "q (head)");
  expect_aligned(p.kv.k, "kv.k");
  expect_aligned(p.kv.v, "kv.v");
  expect_stride(p.kv.k_stride_page, kvb, "kv.k (page)");
  expect_stride(p.kv.k_stride_head, kvb, "kv.k (head)");
  expect_stride(p.kv.v_stride_page, kvb, "kv.v (page)");
  expect_stride(p.kv.v_stride_head, kvb, "kv.v (head)");
  if (p.kv.format != KVFormat::kRagged) {
    expect_stride(p.kv.k_stride_token, kvb, "kv.k (token)");
    expect_stride(p.kv.v_stride_token, kvb, "kv.v (token)");
  }
  expect_narrow_stride(p.kv.k_stride_page, kvb, "kv.k (page)");
  expect_narrow_stride(p.kv.v_stride_page, kvb, "kv.v (page)");
  expect_narrow_stride(p.kv.k_stride_token, kvb, "kv.k (token)");
  expect_narrow_stride(p.kv.v_stride_token, kvb, "kv.v (token)");
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    cudaDeviceProp prop{};
    ATTNFORGE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    sms_ = prop.multiProcessorCount;
    major_ = prop.major;
    minor_ = prop.minor;
    smem_optin_ = static_cast<int>(prop.sharedMemPerBlockOptin);
  }

  const char* name() const override { return "cuda"; }

  Support check(const AttentionConfig& c) const override {
    const AttentionShape s = normalized(c.shape);
    auto no = [](std::string why) { return Support{false, std::move(why)}; };
    if (major_ < 8)
      return no(fmt::format("device cuda:{}: compute capability {}.{}; the CUDA backend needs 8.0 or newer", device_,
                            major_, minor_));
    const char* kernels = c.kind == PlanKind::kDecode ? "decode" : "prefill";
    if (s.q_dtype != DType::kBFloat16 && s.q_dtype != DType::kFloat16)
      return no(fmt::format("q_dtype {}: the CUDA {} kernels take {{bfloat16, float16}}", to_string(s.q_dtype), kernels));
    // fp8 K/V (per-tensor k_scale / v_scale) is built for decode: K/V tiles stay fp8 in shared memory and are
    // converted next to the tensor cores. Prefill takes K/V in the dtype of Q.
    const bool fp8_kv = cuda::is_fp8(s.kv_dtype);
    if (c.kind == PlanKind::kDecode && s.kv_dtype != s.q_dtype && !fp8_kv)
      return no(fmt::format("kv_dtype {} with q_dtype {}: the CUDA decode kernels take K/V in {{{}, float8_e4m3, "
                            "float8_e5m2}}",
                            to_string(s.kv_dtype), to_string(s.q_dtype), to_string(s.q_dtype)));
    if (c.kind == PlanKind::kPrefill && s.kv_dtype != s.q_dtype)
      return no(fmt::format("kv_dtype {} with q_dtype {}: the CUDA prefill kernels take K/V in {{{}}} (fp8 K/V runs "
                            "in CUDA decode and on the CPU backend)",
                            to_string(s.kv_dtype), to_string(s.q_dtype), to_string(s.q_dtype)));
    if (fp8_kv && c.rope)
      return no(fmt::format("kv_dtype {} with fused RoPE: the CUDA decode kernels do not rotate fp8 K (apply RoPE "
                            "before K is quantized, or run on the CPU backend)",
                            to_string(s.kv_dtype)));
    if (s.o_dtype != s.q_dtype && s.o_dtype != DType::kFloat32)
      return no(fmt::format("o_dtype {}: the CUDA {} kernels write {{{}, float32}}", to_string(s.o_dtype), kernels,
                            to_string(s.q_dtype)));
    if (s.head_dim_qk != s.head_dim_vo || (s.head_dim_qk != 64 && s.head_dim_qk != 128 && s.head_dim_qk != 256))
      return no(fmt::format("head_dim {}/{}: the CUDA {} kernels take equal Q/K and V head dims in {{64, 128, 256}}",
                            s.head_dim_qk, s.head_dim_vo, kernels));
    return {};
  }

  // With the NVRTC-compiled kernels this compiles (or loads) the shape's kernels of this kind of plan: plan() pays
  // for it, run() and graph capture find them loaded.
  int32_t num_workers(const AttentionShape& shape, PlanKind kind, int32_t tile_rows) const override {
    const AttentionShape s = normalized(shape);
    if (jit::cuda_kernels() == jit::CudaKernels::kNvrtc) {
      DeviceGuard guard(device_);
      return sms_ * jit_kernels().ctas_per_sm(s, kind);
    }
    if (kind == PlanKind::kPrefill)
      return sms_ * cuda::prefill_ctas_per_sm(s.head_dim_qk, tile_rows);
    return sms_ * cuda::decode_ctas_per_sm(s.head_dim_qk, s.kv_dtype);
  }
  // Decode batches too small to fill the SMs run three stages where small_batch_decode_stages names them (two tiles
  // in flight a CTA) and the GPU's shared memory takes them. Off under ATTNFORGE_DECODE_STAGES (a tuning run's stages
  // serve every batch) and with ATTNFORGE_DECODE_SMALL_BATCH=0 (A/B runs; README).
  Pipeline small_batch_pipeline(const AttentionShape& shape) const override {
    static const bool enabled = detail::env_choice("ATTNFORGE_DECODE_SMALL_BATCH", {"0", "1"}, "1") == "1" &&
                                detail::env_int("ATTNFORGE_DECODE_STAGES", 1, 16, 0) == 0;
    const AttentionShape s = normalized(shape);
    const int32_t stages = cuda::small_batch_decode_stages(s.head_dim_qk, s.q_dtype, s.kv_dtype);
    if (!enabled || stages == 0) return {};
    // A GPU whose CTAs cannot have the deeper pipeline's shared memory (sm_80 at head_dim 256) keeps the default.
    if (cuda::decode_attributes(s.head_dim_qk, s.kv_dtype, stages).max_dynamic_smem > smem_optin_) return {};
    DeviceGuard guard(device_);
    const int32_t ctas = jit::cuda_kernels() == jit::CudaKernels::kNvrtc
                             ? jit_kernels().small_batch_ctas_per_sm(s, stages)
                             : cuda::decode_small_batch_ctas_per_sm(s.head_dim_qk, s.q_dtype, s.kv_dtype);
    return ctas > 0 ? Pipeline{stages, sms_ * ctas} : Pipeline{};
  }
  // The decode kernel merges split KV itself (decode_kernel.cuh, merge_split_rows): its CTAs hold 16 rows and its
  // last CTA of a merge combines states in the kernel's shared memory: in up to four passes in batches of a wave or
  // more, in one in smaller batches (a second pass made 1 x 32768 at head_dim 64, 49 states, 2 us slower than the
  // merge kernel: H200, 93fa9ce). ATTNFORGE_DECODE_KERNEL_MERGE=0 leaves every merge to the merge kernel after the
  // decode kernel (A/B runs); =1 and =kernel (the default) merge in the decode kernel where it fits; =several lets
  // small batches take four passes too (the tests of that path); =stream streams every decode merge of 16-bit K/V
  // instead: the merge kernel runs beside the decode kernel and folds the states as their CTAs finish
  // (merge_kernel.cuh, merge_streamed). Streaming was the default for small head_dim 128 batches from session 27 to
  // 32, on figures that a bug made too fast (its merge grid could fold the call before's states: perf-notes v27);
  // measured right (H200, session 32), merges in the decode kernel are as fast as plain calls and 1-1.2 us faster in
  // graphs at 1 x 32768 (46.1-46.4 / 43.1-43.5 / 39.7 us against 46.2-46.6 / 43.9-44.6 / 40.8-40.9), level at 1 x 2048
  // in graphs of many (10.4 against 10.6-10.7 us).
  DecodeMerge decode_merge(const AttentionShape& shape, int32_t kv_stages) const override {
    const std::string& mode = cuda::decode_kernel_merge_mode();
    if (mode == "0") return {};
    const AttentionShape s = normalized(shape);
    const int stages = kv_stages > 0 ? kv_stages : cuda::default_decode_stages(s.kv_dtype);
    DecodeMerge m{cuda::kDecodeCtaRows, cuda::decode_attributes(s.head_dim_qk, s.kv_dtype, stages).max_dynamic_smem,
                  4, mode == "several" ? 4 : 1};
    if (cuda::decode_merges_streamed() && !cuda::is_fp8(s.kv_dtype))  // fp8 kernels do not stream (decode_kernel.cuh)
      m.stream_max_pairs = std::numeric_limits<int64_t>::max();
    return m;
  }
  // The prefill kernel's CTA rows (decode items hold all of a request's query tokens).
  // The short tile (64 rows) when the batch's requests pack at most that many rows on average, else the head dim's
  // (prefill_tile_rows: 128 up to head_dim 128, and at 256 where the Hopper kernel serves it); run() launches the
  // kernel of the plan's tile_rows.
  int32_t target_tile_rows(const AttentionShape& shape, double avg_packed_rows) const override {
    const int32_t rows = cuda::prefill_tile_rows(normalized(shape).head_dim_qk);
    return avg_packed_rows <= cuda::kPrefillShortRows ? std::min(rows, cuda::kPrefillShortRows) : rows;
  }
  std::vector<int32_t> tile_rows_choices(const AttentionShape& shape) const override {
    const int32_t rows = cuda::prefill_tile_rows(normalized(shape).head_dim_qk);
    if (rows <= cuda::kPrefillShortRows) return {rows};
    return {cuda::kPrefillShortRows, rows};
  }
  bool plan_in_device_memory() const override { return true; }
  // Two 64-token tiles: one CTA's pipeline still overlaps a load with a compute. ATTNFORGE_MIN_SPLIT_TOKENS (16 to
  // 65536) overrides it for tuning runs (README).
  int32_t min_split_tokens() const override {
    static const int32_t tokens = detail::env_int("ATTNFORGE_MIN_SPLIT_TOKENS", 16, 65536, 128);
    return tokens;
  }
  int32_t split_waves() const override { return 1; }
  // The Hopper kernel's pipelined forms: one CTA per SM (the run-time compiled kernels are all portable).
  int32_t persistent_ctas(const AttentionShape& shape, int32_t tile_rows) const override {
    if (jit::cuda_kernels() == jit::CudaKernels::kNvrtc) return 0;
    DeviceGuard guard(device_);
    return cuda::prefill_persistent(normalized(shape).head_dim_qk, tile_rows) ? sms_ : 0;
  }
  // ATTNFORGE_PREFILL_ITEM_WORK (0 to 65536 KV tokens) overrides the planner's estimate for tuning runs (README).
  int64_t item_work_tokens() const override {
    static const int64_t tokens =
        detail::env_int("ATTNFORGE_PREFILL_ITEM_WORK", 0, 65536, static_cast<int32_t>(planner::kItemWorkTokens));
    return tokens;
  }

  void copy_to_device(void* dst, const void* src, size_t bytes, Stream stream) override {
    DeviceGuard guard(device_);
    ATTNFORGE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)));
  }

  void attention(const AttentionParams& p, PlanKind kind, Stream stream) override {
    expect_kernel_layout(p);
    if (p.kv_stages != 0) {  // the small-batch pipeline (small_batch_pipeline), the only stages a plan names
      const int32_t deep = cuda::small_batch_decode_stages(p.head_dim_qk, p.q_dtype, p.kv.dtype);
      if (kind != PlanKind::kDecode || p.kv_stages != deep)
        fail(ErrorKind::kUnsupported,
             "plan.kv_stages {}: the CUDA {} kernels for head_dim {} with {} K/V take {{0 (the default){}}}; plan "
             "again on this backend", p.kv_stages, kind == PlanKind::kDecode ? "decode" : "prefill", p.head_dim_qk,
             to_string(p.kv.dtype), kind == PlanKind::kDecode && deep > 0 ? fmt::format(", {}", deep) : std::string());
    }
    DeviceGuard guard(device_);
    const auto cuda_stream = static_cast<cudaStream_t>(stream);
    if (jit::cuda_kernels() == jit::CudaKernels::kNvrtc)
      jit_kernels().run(p, kind, cuda_stream);
    else if (kind == PlanKind::kPrefill)
      cuda::run_prefill(p, cuda_stream);
    else
      cuda::run_decode(p, cuda_stream);
  }

  // Custom variants compile through NVRTC whatever ATTNFORGE_KERNELS says (nvcc cannot know them).
  void attention_variant(const AttentionParams& p, PlanKind kind, const std::string& name, const std::string& source,
                         const VariantArgs& args, Stream stream) override {
    expect_kernel_layout(p);
    DeviceGuard guard(device_);
    const AttentionShape shape{p.num_qo_heads, p.num_kv_heads, p.head_dim_qk, p.head_dim_vo,
                               p.q_dtype,      p.kv.dtype,     p.o_dtype};
    jit::KernelKey key =
        jit_kernels().key_for(kind, shape, false, kind == PlanKind::kPrefill ? cuda::prefill_plan_rows(p) : 0);
    key.set_variant(name, source);
    jit_kernels().run_variant(p, key, args, static_cast<cudaStream_t>(stream));
  }
  void merge_states(const MergeStatesParams& p, Stream stream) override {
    DeviceGuard guard(device_);
    cuda::run_merge_states(p, static_cast<cudaStream_t>(stream));
  }
  void append_kv(const AppendKVParams&, Stream) override { unsupported("append_paged_kv_cache"); }
  void rope(const RopeApplyParams&, Stream) override { unsupported("apply_rope"); }

 private:
  [[noreturn]] void unsupported(const char* op) const {
    fail(ErrorKind::kUnsupported, "{} on cuda:{}: not built for the CUDA backend yet; run it on the CPU backend", op,
         device_);
  }

  // Created on first use: NVRTC and the driver API are touched only when the NVRTC-compiled kernels are chosen.
  cuda::JitKernels& jit_kernels() const {
    std::call_once(jit_once_, [&] { jit_ = std::make_unique<cuda::JitKernels>(device_, major_, minor_); });
    return *jit_;
  }

  int device_;
  int sms_ = 0, major_ = 0, minor_ = 0;
  int smem_optin_ = 0;  // the most shared memory one CTA may opt in to
  mutable std::once_flag jit_once_;
  mutable std::unique_ptr<cuda::JitKernels> jit_;
};

}  // namespace

Backend* cuda_backend(int32_t device) {
  static std::mutex mutex;
  static std::vector<std::unique_ptr<CudaBackend>> backends;
  std::lock_guard<std::mutex> lock(mutex);
  if (backends.empty()) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();
      count = 0;
    }
    backends.resize(count);
  }
  if (device < 0 || device >= static_cast<int32_t>(backends.size())) return nullptr;
  if (!backends[device]) backends[device] = std::make_unique<CudaBackend>(device);
  return backends[device].get();
}

}  // namespace attnforge::detail
