// Tile shapes of the prefill kernel, shared by its traits (device) and the planner hooks (host). NVRTC-clean, and
// a .cuh so the run-time compiler embeds it with the kernels.
#pragma once

#include "attnforge/kernel/types.h"

namespace attnforge::cuda {

constexpr int kPrefillWarps = 4;
// m16 row tiles per warp: two where the accumulators fit the register file (head_dim <= 128), one otherwise.
ATTNFORGE_HOST_DEVICE constexpr int prefill_m_tiles(int head_dim) { return head_dim <= 128 ? 2 : 1; }
// Packed query rows (tokens x heads of a group) per CTA: 128 at head_dim <= 128, 64 at 256.
ATTNFORGE_HOST_DEVICE constexpr int prefill_rows(int head_dim) { return 16 * kPrefillWarps * prefill_m_tiles(head_dim); }
// The short CTA tile: one m16 tile per warp. Query tiles of at most this many packed rows (speculative
// verification, chunked prefill mixed with decode) run in it rather than paying for 128-row tiles.
constexpr int kPrefillShortRows = 16 * kPrefillWarps;
// Rows per CTA of the kernel run() launches for a plan whose query tiles pack `tile_rows` rows (qo_tile x group).
ATTNFORGE_HOST_DEVICE constexpr int prefill_cta_rows(int head_dim, int tile_rows) {
  return tile_rows <= kPrefillShortRows ? kPrefillShortRows : prefill_rows(head_dim);
}
// Packed query rows per CTA of the Hopper kernel (prefill_wgmma.cuh) at every head dim; at head_dim 256, where the
// portable kernel's CTA holds 64, plans of these tiles run it with two row blocks per item.
constexpr int kPrefillWgmmaRows = 128;
// K/V tokens per pipeline stage: 64 at head_dim 64; 32 above, where 64 made ptxas spill the accumulators.
ATTNFORGE_HOST_DEVICE constexpr int prefill_tile_tokens(int head_dim) { return head_dim <= 64 ? 64 : 32; }

}  // namespace attnforge::cuda
