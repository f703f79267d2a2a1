// Tensor maps of K/V caches for the tensor memory accelerator (device/tma.cuh), encoded on the host through the
// driver (cuTensorMapEncodeTiled; libcuda through driver_api.h). A cache is seen as one 4-dimensional tensor of
// 16-bit elements, fastest first: head dims [D], then token slots of a page [page_size] and KV heads
// [num_kv_heads] in the order of their strides (HND: slots first; NHD and ragged: heads first, kv_heads_inner), then
// pages [num_pages] (ragged KV: page_size 1 and a page a row), so NHD, HND and combined K/V caches all fit with
// strides that grow. A box is 64 head dims (one wgmma panel row of 128 bytes, in the 128-byte swizzle) of
// box_slots x box_pages tokens of one KV head; it lands as box_slots x box_pages rows of a panel. Its coordinates:
// (dim, head, slot, page) where kv_heads_inner, else (dim, slot, head, page).
#pragma once

#include <cstdint>

#include "attnforge/kernel/params.h"

namespace attnforge::cuda {

struct KVBox {
  int slots = 1;  // tokens of a page a box covers (<= page_size, at most 256)
  int pages = 1;  // pages a box covers (ragged KV: tokens; at most 256)
};

// The map of K (value = false) or V of `kv` (16-bit elements, head_dim a multiple of 64) over its kv.num_pages pages
// (ragged: rows). Throws Error(kUnsupported) naming the value when the layout cannot be described (an address not
// 16-byte aligned, a stride not a multiple of 16 bytes, a box over 256 or past the page), Error(kBackend) when the
// driver refuses it.
TensorMap kv_tensor_map(const KVParams& kv, bool value, int head_dim, KVBox box);
// The map of Q (`out` false: p.q) or O (p.o), 16-bit, [num_qo_tokens, num_qo_heads, head_dim] with their strides,
// as a 3-d tensor (head dims, query heads, tokens) whose boxes are 64 head dims x `group` heads x rows / group
// tokens: `rows` packed rows of one KV head's query tile (packed row r = token r / group, head r % group of the
// group), one wgmma panel's rows in the 128-byte swizzle. Throws Error(kUnsupported) naming the value when `group`
// does not divide `rows` or an address or stride is not 16-byte aligned, Error(kBackend) when the driver refuses it.
TensorMap qo_tensor_map(const AttentionParams& p, bool out, int head_dim, int group, int rows);
// Whether K's (value = false) or V's map puts the KV-head axis before the slot axis: its head stride is the smaller.
bool kv_heads_inner(const KVParams& kv, bool value);

}  // namespace attnforge::cuda
