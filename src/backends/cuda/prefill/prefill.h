// Launch of the prefill and merge kernels. The launch configuration (grid, block, shared memory, attributes) is
// computed here once for both builds of the kernels: the nvcc-compiled instantiations (run_prefill) and the NVRTC
// compiled ones (backends/cuda/jit_kernels.h).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "attnforge/kernel/params.h"
#include "backends/cuda/kernel_config.h"
#include "backends/cuda/prefill/tile_config.cuh"

namespace attnforge::cuda {

// `stage_tokens`: K/V tokens per cp.async stage, a multiple of prefill_tile_tokens(head_dim) (PrefillTraits).
// `rows`: packed query rows per CTA, prefill_rows(head_dim) or kPrefillShortRows (tile_config.cuh).
// RoPE and the element type change neither the threads nor the shared memory.
KernelAttributes prefill_attributes(int head_dim, int stage_tokens, int rows);
// The rows per CTA run() launches for a plan: the short tile when its query tiles pack at most that many rows.
int prefill_plan_rows(const AttentionParams& p);
LaunchConfig prefill_launch_config(const AttentionParams& p, int stage_tokens, int rows);

// Which kernel runs the plans the Hopper kernel serves (prefill_wgmma.cuh: nvcc-built, compute capability 9.0,
// query tiles of kPrefillWgmmaRows = 128 packed rows, 16-bit K/V in Q's type, no RoPE); every other plan runs
// prefill_kernel (at head_dim 256, whose CTAs hold 64 rows, two row blocks per 128-row tile).
//   kAuto (ATTNFORGE_PREFILL_WGMMA unset or "auto") and kOn ("1"): head_dim 64, 128 and 256, all measured faster
//   on the H200 than the portable kernel; kOff ("0"): never (the portable kernel everywhere).
enum class PrefillWgmma { kAuto, kOff, kOn };
void set_prefill_wgmma(PrefillWgmma mode);  // overrides the environment (tests, A/B runs)
PrefillWgmma prefill_wgmma();
// Whether plans of this head dim and query tile rows (AttentionPlan::tile_rows) run on the Hopper kernel on the
// current device (RoPE, dtypes aside).
bool prefill_wgmma_serves(int head_dim, int tile_rows);
// Whether those plans run on a persistent form (2 or 3, prefill_wgmma_form), one CTA per SM walking the plan's
// schedule (RoPE, dtypes aside: such plans run prefill_kernel, which walks the items by stride).
bool prefill_persistent(int head_dim, int tile_rows);
// Whether the persistent forms' CTAs walk the (KV head, item) pairs the planner balanced over them
// (AttentionPlan::schedule): ATTNFORGE_PREFILL_SCHEDULE "1" (the default) or "0" (CTA c walks pairs c, c + grid,
// c + 2 grid, ... on a grid of the same size). Read once.
bool prefill_schedule();
// The planner's query tile rows for long queries: kPrefillWgmmaRows where the Hopper kernel serves them, else the
// portable kernel's CTA rows (prefill_rows).
int prefill_tile_rows(int head_dim);
// The Hopper kernel's form (prefill_wgmma.cuh: WgmmaForm), ATTNFORGE_PREFILL_WGMMA_WS: "2" (the default,
// kPipelined: persistent CTAs whose copying warpgroup runs into the next item while the two computing ones finish
// the last), "1" (kWarpSpecialized: the CTA meets twice per item), "0" (kBarrier: all 256 threads copy and meet at
// a barrier per tile; head_dim 256 runs "1" instead) or "3" (kOverlapped: as "2", and each computing warpgroup runs
// a tile's softmax while the last tile's O += P V runs; not at head_dim 256, which runs "2"; measured 7-13% slower
// than "2" on the H200 at 1bc07db, kept for study). Read once.
int prefill_wgmma_form();
// Which K/V the Hopper kernel's persistent forms (2 and 3) copy with the tensor memory accelerator, where the
// layout allows it (kv_tma_box_slots), rather than with cp.async: ATTNFORGE_PREFILL_TMA "auto" (the default,
// kAuto: ragged K/V, a tile's rows one box per 64-dim panel, and paged K/V at head_dim 128 and 256, a box per page,
// issued by lane 0 of each of the four copier warps), "1" (kAll: paged K/V at head_dim 64 too), "ragged" (kRagged:
// paged K/V by cp.async) or "0" (kOff). Paged boxes against cp.async with 16-token pages on the H200 (d5bb98c,
// d101df3): 6-8% faster at head_dim 128, 12% at 256, 1.8% slower at 64; 18% slower at 128 when one thread issued
// them all (e4daea1). Read once.
enum class PrefillTma { kOff, kRagged, kAuto, kAll };
PrefillTma prefill_tma();
// The tokens of a page one accelerator box copies for tiles of `tile_tokens` tokens: the page size, or the tile
// where pages are longer, for 16-bit paged K/V whose pages hold 8 tokens or more and divide or are divided by the
// tile, with 16-byte aligned addresses and strides; 1 for ragged K/V (a tile's rows in one box); 0 where the
// accelerator cannot copy the layout (cp.async does).
int kv_tma_box_slots(const KVParams& kv, int tile_tokens);
// Whether the persistent forms write a computing warpgroup's 64 final rows as boxes of O by the accelerator, where
// qo_tma_fits: ATTNFORGE_PREFILL_TMA_STORE "1" (the default) or "0" (16-byte writes by the warpgroup's threads);
// and whether their copier copies an item's 128 rows of Q as boxes (ATTNFORGE_PREFILL_TMA_Q "1", the default) or
// by its threads' cp.async ("0"). Read once. Head_dim 256 (one Q buffer, copied by the computing warpgroups) takes
// neither.
bool prefill_tma_store();
bool prefill_tma_q();
// Whether the Hopper kernel's warp-specialized and pipelined forms compute a warpgroup's tile only up to the last
// key its rows see, rounded up to 32 tokens (AttentionParams::narrow_tiles): ATTNFORGE_PREFILL_NARROW "1" (the
// default) or "0" (every tile whole). Read once.
bool prefill_narrow_tiles();
// The settings above as the environment would give them ("ATTNFORGE_PREFILL_TMA=auto _TMA_Q=1 ..."), for records.
std::string prefill_copy_settings();
// Whether Q's (out false) or O's layout can be copied in boxes of `rows` packed rows (tma.h: qo_tensor_map): 16-bit
// elements (O in Q's type), `group` (query heads per KV head) dividing `rows`, a 16-byte aligned address and
// strides.
bool qo_tma_fits(const AttentionParams& p, bool out, int group, int rows);

// The nvcc-compiled kernels (the default tile configuration): CTAs per SM of the kernel that runs plans of
// `tile_rows` query tile rows.
int prefill_ctas_per_sm(int head_dim, int tile_rows);
// Grid sizes come from the plan's capacities, never its counts (see kernel_config.h), so graphs survive re-plans.
void run_prefill(const AttentionParams& p, cudaStream_t stream);

}  // namespace attnforge::cuda
