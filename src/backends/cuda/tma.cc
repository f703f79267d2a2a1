#include "backends/cuda/tma.h"

#include <cuda.h>

#include <initializer_list>
#include <utility>

#include "backends/cuda/driver_api.h"
#include "attnforge/tensor.h"
#include "core/check.h"

namespace attnforge::cuda {

static_assert(sizeof(TensorMap) == sizeof(CUtensorMap) && alignof(TensorMap) >= 64,
              "TensorMap stands in for CUtensorMap in device code (the accelerator reads it 64-byte aligned)");

namespace {

// What every map here needs of its elements: 16-bit, head_dim a multiple of the 64-element box row.
void check_elements(const char* which, DType dtype, int head_dim) {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16)
    detail::fail(ErrorKind::kUnsupported, "tensor map of {}: dtype {} (allowed: bfloat16, float16)", which,
                 to_string(dtype));
  if (head_dim <= 0 || head_dim % 64 != 0)
    detail::fail(ErrorKind::kUnsupported, "tensor map of {}: head_dim {} (allowed: a multiple of 64)", which,
                 head_dim);
}

// And of its memory: a 16-byte aligned address, strides (named, in bytes) that step in 16 bytes.
void check_layout(const char* which, const void* base, std::initializer_list<std::pair<const char*, int64_t>> strides) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0)
    detail::fail(ErrorKind::kUnsupported, "tensor map of {}: address {} is not 16-byte aligned", which, base);
  for (const auto& [name, bytes] : strides)
    if (bytes <= 0 || bytes % 16 != 0 || bytes >= (int64_t{1} << 40))
      detail::fail(ErrorKind::kUnsupported,
                   "tensor map of {}: {} stride of {} bytes (allowed: a positive multiple of 16 under 2^40)", which,
                   name, bytes);
}

// A tiled map of `rank` dimensions (strides: of dimensions 1 .. rank - 1, in bytes), 128-byte swizzle, unit element
// strides.
TensorMap encode(DType dtype, cuuint32_t rank, const void* base, const cuuint64_t* dims, const cuuint64_t* strides,
                 const cuuint32_t* box, CUtensorMapL2promotion promotion) {
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  CUtensorMap map;  // 128-byte aligned; copied into TensorMap's bytes below
  ATTNFORGE_CU_CHECK(driver().cuTensorMapEncodeTiled(
      &map, dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, rank,
      const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
  TensorMap out;
  __builtin_memcpy(&out, &map, sizeof out);
  return out;
}

}  // namespace

TensorMap kv_tensor_map(const KVParams& kv, bool value, int head_dim, KVBox box) {
  const char* which = value ? "V" : "K";
  check_elements(which, kv.dtype, head_dim);
  const int page_size = kv.format == KVFormat::kRagged ? 1 : kv.page_size;
  if (box.slots < 1 || box.slots > 256 || box.slots > page_size || box.pages < 1 || box.pages > 256)
    detail::fail(ErrorKind::kUnsupported,
                 "tensor map of {}: a box of {} slots x {} pages (allowed: 1 to min(256, page size {}) slots, 1 to "
                 "256 pages)",
                 which, box.slots, box.pages, page_size);
  const int64_t num_pages = kv.num_pages;
  if (num_pages < 1) detail::fail(ErrorKind::kUnsupported, "tensor map of {}: {} pages (at least 1)", which, num_pages);
  const void* base = value ? kv.v : kv.k;
  const int64_t page = (value ? kv.v_stride_page : kv.k_stride_page) * 2;
  // Ragged KV has no token stride (a page is a row, of one slot); the map's slot axis of extent 1 takes the row's.
  const int64_t token = kv.format == KVFormat::kRagged ? page : (value ? kv.v_stride_token : kv.k_stride_token) * 2;
  const int64_t head = (value ? kv.v_stride_head : kv.k_stride_head) * 2;
  check_layout(which, base, {{"token", token}, {"head", head}, {"page", page}});
  const auto slots = static_cast<cuuint64_t>(page_size), heads = static_cast<cuuint64_t>(kv.num_kv_heads);
  const auto box_slots = static_cast<cuuint32_t>(box.slots);
  const bool inner = kv_heads_inner(kv, value);
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), inner ? heads : slots, inner ? slots : heads,
                              static_cast<cuuint64_t>(num_pages)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(inner ? head : token),
                                 static_cast<cuuint64_t>(inner ? token : head), static_cast<cuuint64_t>(page)};
  const cuuint32_t box_dims[4] = {64, inner ? 1u : box_slots, inner ? box_slots : 1u,
                                  static_cast<cuuint32_t>(box.pages)};
  return encode(kv.dtype, 4, base, dims, strides, box_dims, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

TensorMap qo_tensor_map(const AttentionParams& p, bool out, int head_dim, int group, int rows) {
  const char* which = out ? "O" : "Q";
  const DType dtype = out ? p.o_dtype : p.q_dtype;
  check_elements(which, dtype, head_dim);
  if (group < 1 || rows < 1 || rows > 256 || rows % group != 0)
    detail::fail(ErrorKind::kUnsupported, "tensor map of {}: group size {} (allowed: a divisor of {} rows)", which,
                 group, rows);
  if (p.num_qo_tokens < 1 || p.num_qo_heads < group)
    detail::fail(ErrorKind::kUnsupported, "tensor map of {}: {} tokens x {} heads (at least 1 x {})", which,
                 p.num_qo_tokens, p.num_qo_heads, group);
  const void* base = out ? p.o : p.q;
  const int64_t token = (out ? p.o_stride_token : p.q_stride_token) * 2;
  const int64_t head = (out ? p.o_stride_head : p.q_stride_head) * 2;
  check_layout(which, base, {{"token", token}, {"head", head}});
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(p.num_qo_heads),
                              static_cast<cuuint64_t>(p.num_qo_tokens)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(head), static_cast<cuuint64_t>(token)};
  const cuuint32_t box_dims[3] = {64, static_cast<cuuint32_t>(group), static_cast<cuuint32_t>(rows / group)};
  return encode(dtype, 3, base, dims, strides, box_dims,
                out ? CU_TENSOR_MAP_L2_PROMOTION_NONE : CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

bool kv_heads_inner(const KVParams& kv, bool value) {
  if (kv.format == KVFormat::kRagged) return true;  // a row holds every head
  return value ? kv.v_stride_head < kv.v_stride_token : kv.k_stride_head < kv.k_stride_token;
}

}  // namespace attnforge::cuda
