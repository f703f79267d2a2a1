// Instantiations and launch of the nvcc-compiled prefill kernels, and the launch configuration both builds of the
// kernels share. Split-KV items are merged by the shared merge kernel (backends/cuda/merge).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <string>

#include "core/env.h"

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernel_config.h"
#include "backends/cuda/merge/merge.h"
#include "backends/cuda/prefill/prefill.h"
#include "backends/cuda/prefill/prefill_kernel.cuh"
#include "backends/cuda/prefill/prefill_wgmma.cuh"
#include "backends/cuda/tma.h"

namespace attnforge::cuda {

namespace {

// bf16 and fp16 instantiations, with and without RoPE, use the same threads and shared memory.
template <int D, int kRows>
KernelAttributes attributes_of(int stage_tokens) {
  auto make = [](auto traits) {
    using Tr = decltype(traits);
    return KernelAttributes{Tr::kThreads, Tr::kSmemBytes, 100};
  };
  constexpr int kStep = prefill_tile_tokens(D);
  return stage_tokens == 2 * kStep ? make(PrefillTraits<D, Bf16, false, 2 * kStep, kRows>{})
                                   : make(PrefillTraits<D, Bf16, false, kStep, kRows>{});
}

template <int D>
KernelAttributes attributes_of(int stage_tokens, int rows) {
  if constexpr (prefill_rows(D) != kPrefillShortRows)
    if (rows == kPrefillShortRows) return attributes_of<D, kPrefillShortRows>(stage_tokens);
  return attributes_of<D, prefill_rows(D)>(stage_tokens);
}

// Sets the attributes once per instantiation and device; returns the CTAs one SM holds.
template <class Tr>
int configure() {
  static PerDevice ctas_per_sm;
  return ctas_per_sm.get([] {
    const KernelAttributes a = prefill_attributes(Tr::kHeadDim, Tr::kStageTokens, Tr::kRows);
    return configure_kernel(prefill_kernel<Tr>, a.threads, a.max_dynamic_smem, a.carveout_percent);
  });
}

template <int D, typename Elem, bool kRope, int kRows>
void launch(const AttentionParams& p, const KernelDims& dims, cudaStream_t stream) {
  using Tr = PrefillTraits<D, Elem, kRope, prefill_tile_tokens(D), kRows>;
  configure<Tr>();
  prefill_kernel<Tr><<<dims.grid, dims.block, dims.smem_bytes, stream>>>(p);
  ATTNFORGE_CUDA_CHECK(cudaGetLastError());
}

template <int D, bool kRope, int kRows>
void launch_dtype(const AttentionParams& p, const KernelDims& dims, cudaStream_t stream) {
  p.q_dtype == DType::kBFloat16 ? launch<D, Bf16, kRope, kRows>(p, dims, stream)
                                : launch<D, F16, kRope, kRows>(p, dims, stream);
}

template <int D, int kRows>
void launch_rope(const AttentionParams& p, const KernelDims& dims, cudaStream_t stream) {
  p.variant.rope.enabled ? launch_dtype<D, true, kRows>(p, dims, stream)
                         : launch_dtype<D, false, kRows>(p, dims, stream);
}

// The head dim's tile, or the short one for plans of short query tiles (prefill_cta_rows).
template <int D>
void launch_variant(const AttentionParams& p, const KernelDims& dims, cudaStream_t stream) {
  if constexpr (prefill_rows(D) != kPrefillShortRows)
    if (prefill_plan_rows(p) == kPrefillShortRows) return launch_rope<D, kPrefillShortRows>(p, dims, stream);
  launch_rope<D, prefill_rows(D)>(p, dims, stream);
}

// Read on every launch and plan, so an atomic; the environment is read once.
std::atomic<int> wgmma_override{-1};
PrefillWgmma wgmma_from_env() {
  const std::string s = detail::env_choice("ATTNFORGE_PREFILL_WGMMA", {"auto", "0", "1"}, "auto");
  return s == "auto" ? PrefillWgmma::kAuto : s == "0" ? PrefillWgmma::kOff : PrefillWgmma::kOn;
}

// Sets the Hopper kernel's attributes once per instantiation and device; returns the CTAs one SM holds (one).
template <class Tr>
int configure_wgmma() {
  static PerDevice configured;
  return configured.get([] { return configure_kernel(prefill_wgmma_kernel<Tr>, Tr::kThreads, Tr::kSmemBytes); });
}

// Head_dim 256 has neither the barrier form (the warp-specialized one runs instead) nor the overlapped one (the
// pipelined one): with O at 128 registers a thread, holding S and the last tile's P besides made ptxas spill in the
// tile loop and serialize the products.
template <int D>
WgmmaForm form_at(WgmmaForm form) {
  if (D != 256) return form;
  return form == WgmmaForm::kBarrier ? WgmmaForm::kWarpSpecialized
         : form == WgmmaForm::kOverlapped ? WgmmaForm::kPipelined
                                          : form;
}

template <int D>
int configure_wgmma_form(WgmmaForm form) {
  switch (form_at<D>(form)) {
    case WgmmaForm::kBarrier:
      if constexpr (D != 256) return configure_wgmma<PrefillWgmmaTraits<D, Bf16, WgmmaForm::kBarrier>>();
      [[fallthrough]];
    case WgmmaForm::kWarpSpecialized:
      return configure_wgmma<PrefillWgmmaTraits<D, Bf16, WgmmaForm::kWarpSpecialized>>();
    case WgmmaForm::kOverlapped:
      if constexpr (D != 256) return configure_wgmma<PrefillWgmmaTraits<D, Bf16, WgmmaForm::kOverlapped>>();
      [[fallthrough]];
    default: return configure_wgmma<PrefillWgmmaTraits<D, Bf16, WgmmaForm::kPipelined>>();
  }
}

template <int D, typename Elem, WgmmaForm kForm>
void launch_wgmma_form(const AttentionParams& p, KernelDims dims, cudaStream_t stream) {
  using Tr = PrefillWgmmaTraits<D, Elem, kForm>;
  configure_wgmma<Tr>();
  // The pipelined form is persistent: one CTA per SM walks the (KV head, item) pairs (grid x times y of the
  // others), so its copier can run ahead into the next pair; the plan's schedule_ctas (the SM count) where it
  // balanced their walks (AttentionPlan::schedule). From the capacities and the SM count alone, so a captured graph
  // survives re-plans.
  if constexpr (kForm == WgmmaForm::kPipelined || kForm == WgmmaForm::kOverlapped)
    dims.grid = dim3(p.schedule_ctas > 0 ? static_cast<unsigned>(p.schedule_ctas)
                                         : std::min(dims.grid.x * dims.grid.y, static_cast<unsigned>(sm_count())),
                     1, dims.grid.z);
  dims.block = dim3(Tr::kThreads);
  dims.smem_bytes = Tr::kSmemBytes;
  prefill_wgmma_kernel<Tr><<<dims.grid, dims.block, dims.smem_bytes, stream>>>(p);
  ATTNFORGE_CUDA_CHECK(cudaGetLastError());
}

// The persistent forms, their K/V tiles by the tensor memory accelerator where ATTNFORGE_PREFILL_TMA takes the
// format (prefill_tma: ragged K/V, and paged K/V at head_dim 128 and 256, by default) and the layout allows it
// (kv_tma_box_slots), and (the forms whose copier copies Q: two Q buffers) Q copied and final rows written as boxes
// where ATTNFORGE_PREFILL_TMA_Q and ATTNFORGE_PREFILL_TMA_STORE allow and qo_tma_fits: the maps are encoded into a
// copy of the parameters for this launch.
template <int D, typename Elem, WgmmaForm kForm>
void launch_persistent(const AttentionParams& p, const KernelDims& dims, cudaStream_t stream) {
  using Tr = PrefillWgmmaTraits<D, Elem, kForm>;
  const PrefillTma mode = prefill_tma();
  const bool wanted = p.kv.format == KVFormat::kRagged
                          ? mode != PrefillTma::kOff
                          : mode == PrefillTma::kAll || (mode == PrefillTma::kAuto && D >= 128);
  const int slots = wanted ? kv_tma_box_slots(p.kv, Tr::kTileTokens) : 0;
  const int group = p.num_qo_heads / p.num_kv_heads;
  const bool store = Tr::kQBuffers == 2 && prefill_tma_store() && qo_tma_fits(p, true, group, 64);
  const bool q = Tr::kQBuffers == 2 && prefill_tma_q() && qo_tma_fits(p, false, group, Tr::kRows);
  if (slots == 0 && !store && !q) return launch_wgmma_form<D, Elem, kForm>(p, dims, stream);
  AttentionParams tp = p;
  if (slots > 0) {
    const KVBox box = p.kv.format == KVFormat::kRagged ? KVBox{1, Tr::kTileTokens} : KVBox{slots, 1};
    tp.tma_k = kv_tensor_map(p.kv, false, D, box);
    tp.tma_v = kv_tensor_map(p.kv, true, D, box);
    tp.tma_box_slots = slots;
    tp.tma_heads_inner = (kv_heads_inner(p.kv, false) ? 1 : 0) | (kv_heads_inner(p.kv, true) ? 2 : 0);
  }
  if (store) {
    tp.tma_o = qo_tensor_map(p, true, D, group, 64);
    tp.tma_store = 1;
  }
  if (q) {
    tp.tma_q = qo_tensor_map(p, false, D, group, Tr::kRows);
    tp.tma_q_rows = 1;
  }
  launch_wgmma_form<D, Elem, kForm>(tp, dims, stream);
}

template <int D, typename Elem>
void launch_wgmma(const AttentionParams& p, const KernelDims& dims, cudaStream_t stream) {
  auto form = form_at<D>(static_cast<WgmmaForm>(prefill_wgmma_form()));
  // The overlapped form compiles only the KV-range masks into its softmax; soft-cap, ALiBi and custom masks take
  // the pipelined form (the same work split and plan).
  const VariantParams& vp = p.variant;
  if (form == WgmmaForm::kOverlapped && (vp.soft_cap > 0.f || vp.alibi_slopes != nullptr || vp.custom_mask))
    form = WgmmaForm::kPipelined;
  switch (form) {
    case WgmmaForm::kBarrier:
      if constexpr (D != 256) return launch_wgmma_form<D, Elem, WgmmaForm::kBarrier>(p, dims, stream);
      [[fallthrough]];
    case WgmmaForm::kWarpSpecialized: return launch_wgmma_form<D, Elem, WgmmaForm::kWarpSpecialized>(p, dims, stream);
    case WgmmaForm::kOverlapped:
      if constexpr (D != 256) return launch_persistent<D, Elem, WgmmaForm::kOverlapped>(p, dims, stream);
      [[fallthrough]];
    default: return launch_persistent<D, Elem, WgmmaForm::kPipelined>(p, dims, stream);
  }
}

// Launches the Hopper kernel when it is requested and serves the plan; false otherwise.
bool launch_prefill_wgmma(const AttentionParams& p, const KernelDims& dims, cudaStream_t stream) {
  const int d = p.head_dim_qk;
  const int tile_rows = p.tile_rows > 0 ? p.tile_rows : prefill_plan_rows(p);
  if (!prefill_wgmma_serves(d, tile_rows) || p.head_dim_vo != d || p.variant.rope.enabled || p.kv.dtype != p.q_dtype)
    return false;
  // `dims` counts row blocks of the portable kernel's CTA rows (prefill_plan_rows: 64 at head_dim 256); this
  // kernel's CTAs hold kPrefillWgmmaRows.
  KernelDims wd = dims;
  wd.grid.z = (dims.grid.z * prefill_plan_rows(p) + kPrefillWgmmaRows - 1) / kPrefillWgmmaRows;
  AttentionParams np = p;
  np.narrow_tiles = prefill_narrow_tiles() ? 1 : 0;
  if (!prefill_schedule()) np.schedule_ctas = 0;
  const bool bf16 = p.q_dtype == DType::kBFloat16;
  if (d == 64)
    bf16 ? launch_wgmma<64, Bf16>(np, wd, stream) : launch_wgmma<64, F16>(np, wd, stream);
  else if (d == 256)
    bf16 ? launch_wgmma<256, Bf16>(np, wd, stream) : launch_wgmma<256, F16>(np, wd, stream);
  else
    bf16 ? launch_wgmma<128, Bf16>(np, wd, stream) : launch_wgmma<128, F16>(np, wd, stream);
  return true;
}

}  // namespace

KernelAttributes prefill_attributes(int head_dim, int stage_tokens, int rows) {
  switch (head_dim) {
    case 64: return attributes_of<64>(stage_tokens, rows);
    case 128: return attributes_of<128>(stage_tokens, rows);
    default: return attributes_of<256>(stage_tokens, rows);
  }
}

int prefill_plan_rows(const AttentionParams& p) {
  return prefill_cta_rows(p.head_dim_qk, p.tile_rows > 0 ? p.tile_rows : p.qo_tile * (p.num_qo_heads / p.num_kv_heads));
}

LaunchConfig prefill_launch_config(const AttentionParams& p, int stage_tokens, int rows) {
  LaunchConfig c = attention_launch_config(p, rows, prefill_attributes(p.head_dim_qk, stage_tokens, rows));
  // Row blocks for the longest query tile any re-plan of this shape can have (the planner's long tile,
  // prefill_tile_rows: 128 rows at head_dim 256 too where the Hopper kernel serves it; or one token of a group larger
  // than it), not only this plan's: a graph captured with a plan of short tiles then still covers every row of a
  // re-plan with long ones (CTAs past an item's rows skip it).
  const int group = p.num_qo_heads / p.num_kv_heads;
  const int longest = std::max({prefill_tile_rows(p.head_dim_qk), group, p.qo_tile * group});
  c.attention.grid.z = static_cast<unsigned>((longest + rows - 1) / rows);
  return c;
}

void set_prefill_wgmma(PrefillWgmma mode) { wgmma_override.store(static_cast<int>(mode)); }
PrefillWgmma prefill_wgmma() {
  const int o = wgmma_override.load(std::memory_order_relaxed);
  if (o >= 0) return static_cast<PrefillWgmma>(o);
  static const PrefillWgmma from_env = wgmma_from_env();
  return from_env;
}

bool prefill_wgmma_serves(int head_dim, int tile_rows) {
  const PrefillWgmma mode = prefill_wgmma();
  if (mode == PrefillWgmma::kOff || tile_rows != kPrefillWgmmaRows) return false;
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) return false;
  // Launch configurations are computed without a GPU too (prefill_tile_rows sizes the row blocks; unit tests): no
  // device, no Hopper kernel.
  static const bool has_device = [] {
    int count = 0;
    const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
    cudaGetLastError();  // a missing driver leaves no error behind for later checks
    return ok;
  }();
  return has_device && compute_capability() == 90;  // sm_90a code runs on 9.0 only
}

bool prefill_persistent(int head_dim, int tile_rows) {
  const auto form = static_cast<WgmmaForm>(prefill_wgmma_form());
  return prefill_wgmma_serves(head_dim, tile_rows) && (form == WgmmaForm::kPipelined || form == WgmmaForm::kOverlapped);
}

bool prefill_schedule() {
  static const bool on = detail::env_choice("ATTNFORGE_PREFILL_SCHEDULE", {"1", "0"}, "1") == "1";
  return on;
}

int prefill_tile_rows(int head_dim) {
  return prefill_wgmma_serves(head_dim, kPrefillWgmmaRows) ? kPrefillWgmmaRows : prefill_rows(head_dim);
}

// ATTNFORGE_PREFILL_TMA's values, in PrefillTma's order.
constexpr const char* kPrefillTmaNames[] = {"0", "ragged", "auto", "1"};

PrefillTma prefill_tma() {
  static const PrefillTma mode = [] {
    const std::string v = detail::env_choice("ATTNFORGE_PREFILL_TMA", {"auto", "0", "1", "ragged"}, "auto");
    int i = 0;
    while (v != kPrefillTmaNames[i]) ++i;
    return static_cast<PrefillTma>(i);
  }();
  return mode;
}

std::string prefill_copy_settings() {
  return std::string("ATTNFORGE_PREFILL_TMA=") + kPrefillTmaNames[static_cast<int>(prefill_tma())] +
         " _TMA_Q=" + (prefill_tma_q() ? "1" : "0") + " _TMA_STORE=" + (prefill_tma_store() ? "1" : "0") +
         " _NARROW=" + (prefill_narrow_tiles() ? "1" : "0") + " _SCHEDULE=" + (prefill_schedule() ? "1" : "0");
}

int kv_tma_box_slots(const KVParams& kv, int tile_tokens) {
  if (kv.dtype != DType::kBFloat16 && kv.dtype != DType::kFloat16) return 0;
  if (kv.num_pages < 1 || reinterpret_cast<uintptr_t>(kv.k) % 16 != 0 || reinterpret_cast<uintptr_t>(kv.v) % 16 != 0)
    return 0;
  const bool ragged = kv.format == KVFormat::kRagged;
  for (int64_t stride : {kv.k_stride_page, kv.k_stride_head, kv.v_stride_page, kv.v_stride_head,
                         ragged ? kv.k_stride_page : kv.k_stride_token, ragged ? kv.v_stride_page : kv.v_stride_token})
    if (stride <= 0 || (stride * 2) % 16 != 0) return 0;
  if (ragged) return 1;
  const int page = kv.page_size;
  if (page < 8 || (page % tile_tokens != 0 && tile_tokens % page != 0)) return 0;
  return std::min(page, tile_tokens);
}

bool prefill_tma_store() {
  static const bool on = detail::env_choice("ATTNFORGE_PREFILL_TMA_STORE", {"1", "0"}, "1") == "1";
  return on;
}

bool prefill_narrow_tiles() {
  static const bool on = detail::env_choice("ATTNFORGE_PREFILL_NARROW", {"1", "0"}, "1") == "1";
  return on;
}

bool prefill_tma_q() {
  static const bool on = detail::env_choice("ATTNFORGE_PREFILL_TMA_Q", {"1", "0"}, "1") == "1";
  return on;
}

bool qo_tma_fits(const AttentionParams& p, bool out, int group, int rows) {
  const DType dtype = out ? p.o_dtype : p.q_dtype;
  const int64_t token = out ? p.o_stride_token : p.q_stride_token, head = out ? p.o_stride_head : p.q_stride_head;
  return dtype == p.q_dtype && (dtype == DType::kBFloat16 || dtype == DType::kFloat16) && group >= 1 &&
         rows % group == 0 && p.num_qo_tokens >= 1 && reinterpret_cast<uintptr_t>(out ? p.o : p.q) % 16 == 0 &&
         token > 0 && head > 0 && token % 8 == 0 && head % 8 == 0;
}

int prefill_wgmma_form() {
  static const int form = std::stoi(detail::env_choice("ATTNFORGE_PREFILL_WGMMA_WS", {"0", "1", "2", "3"}, "2"));
  return form;
}

int prefill_ctas_per_sm(int head_dim, int tile_rows) {
  // The Hopper kernel holds one CTA per SM where it serves the plan's tiles; the planner's split targets follow
  // it. (A plan with RoPE still runs prefill_kernel, two CTAs per SM, on these targets: it splits less.)
  if (prefill_wgmma_serves(head_dim, tile_rows)) {
    const auto form = static_cast<WgmmaForm>(prefill_wgmma_form());
    return head_dim == 64    ? configure_wgmma_form<64>(form)
           : head_dim == 256 ? configure_wgmma_form<256>(form)
                             : configure_wgmma_form<128>(form);
  }
  switch (head_dim) {  // bf16 and fp16 instantiations use the same registers and shared memory
    case 64: return configure<PrefillTraits<64, Bf16>>();
    case 128: return configure<PrefillTraits<128, Bf16>>();
    case 256: return configure<PrefillTraits<256, Bf16>>();
    default: return 1;
  }
}

#if defined(ATTNFORGE_WGMMA_TRACE) && ATTNFORGE_WGMMA_TRACE
// Trace builds only (prefill_wgmma.cuh): waits for the launch and prints the warp-specialized forms' clock counters
// of every slot (a persistent CTA, or the CTAs sharing it), one line per side, for scripts/wgmma_trace.py.
void print_wgmma_trace(cudaStream_t stream) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  ATTNFORGE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  if (capturing != cudaStreamCaptureStatusNone) return;
  static long long h[kTraceCtas][3][kTraceFields];
  ATTNFORGE_CUDA_CHECK(cudaStreamSynchronize(stream));
  ATTNFORGE_CUDA_CHECK(cudaMemcpyFromSymbol(h, wgmma_trace, sizeof h));
  static const long long zero[kTraceCtas][3][kTraceFields] = {};
  ATTNFORGE_CUDA_CHECK(cudaMemcpyToSymbol(wgmma_trace, zero, sizeof zero));
  for (int cta = 0; cta < kTraceCtas; ++cta) {
    if (h[cta][0][0] == 0 && h[cta][1][0] == 0 && h[cta][2][0] == 0) continue;  // a slot no CTA used
    const long long* o = h[cta][0];
    std::printf("wgmma-trace copier cta %d items %lld tiles %lld total %lld range %lld fetch %lld empty %lld load %lld\n",
                cta, o[0], o[1], o[2], o[3], o[4], o[5], o[6]);
    for (int g = 0; g < 2; ++g) {
      o = h[cta][1 + g];
      std::printf("wgmma-trace consumer%d cta %d items %lld tiles %lld total %lld masked_tiles %lld setup %lld "
                  "first %lld wait %lld plain %lld masked %lld store %lld qwait %lld stage %lld lastpv %lld ssync %lld "
                  "between %lld sfence %lld q_wait %lld q_empty %lld q_top %lld q_issue %lld q_ready %lld "
                  "q_late %lld\n",
                  g, cta, o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8], o[9], o[10], o[11], o[12], o[13],
                  o[14], o[15], o[16], o[17], o[18], o[19], o[20], o[21]);
    }
  }
}
#endif

void run_prefill(const AttentionParams& p, cudaStream_t stream) {
  const LaunchConfig c = prefill_launch_config(p, prefill_tile_tokens(p.head_dim_qk), prefill_plan_rows(p));
  if (launch_prefill_wgmma(p, c.attention, stream)) {
#if defined(ATTNFORGE_WGMMA_TRACE) && ATTNFORGE_WGMMA_TRACE
    if (p.head_dim_qk == 256 || prefill_wgmma_form() >= 1) print_wgmma_trace(stream);  // not the barrier form
#endif
    return run_merge(p, stream);
  }
  switch (p.head_dim_qk) {
    case 64: launch_variant<64>(p, c.attention, stream); break;
    case 128: launch_variant<128>(p, c.attention, stream); break;
    case 256: launch_variant<256>(p, c.attention, stream); break;
    default: break;  // rejected by CudaBackend::check before any launch
  }
  run_merge(p, stream);
}

}  // namespace attnforge::cuda
