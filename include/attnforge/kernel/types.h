// Basic types shared by the host library, nvcc-compiled kernels and NVRTC-compiled kernels.
// This header must stay NVRTC-clean: no standard-library or toolkit includes under __CUDACC_RTC__.
#pragma once

#if defined(__CUDACC_RTC__)
namespace attnforge {
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
}  // namespace attnforge
#else
#include <cstdint>
namespace attnforge {
using std::int32_t;
using std::int64_t;
using std::int8_t;
using std::uint16_t;
using std::uint32_t;
using std::uint64_t;
using std::uint8_t;
}  // namespace attnforge
#endif

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define ATTNFORGE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ATTNFORGE_HOST_DEVICE inline
#endif

// +infinity without <math.h>, which NVRTC does not have.
#if defined(__CUDACC_RTC__)
#define ATTNFORGE_INFINITY __int_as_float(0x7f800000)
#else
#define ATTNFORGE_INFINITY __builtin_huge_valf()
#endif

namespace attnforge {

// Element types. Q/K/V/O take fp32, fp16 and bf16; K/V also take the two fp8 formats (with per-tensor scales).
// Index tensors are int32; custom masks are bit-packed uint8.
enum class DType : int32_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat8E4M3 = 3,  // e4m3fn: no infinities, max 448
  kFloat8E5M2 = 4,
  kInt32 = 5,
  kInt64 = 6,
  kUInt8 = 7,
};

ATTNFORGE_HOST_DEVICE int32_t dtype_bytes(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat8E4M3: return 1;
    case DType::kFloat8E5M2: return 1;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
  }
  return 0;
}

// Where K and V pages keep their heads. NHD: [page, token, head, dim]; HND: [page, head, token, dim].
// Both are described by strides in KVParams; the layout only matters when reading user tensors.
enum class KVLayout : int32_t { kNHD = 0, kHND = 1 };

// How a request finds its KV tokens.
//   kPagedCSR:   pages of request b are page_ids[page_list_indptr[b] .. page_list_indptr[b+1])
//   kBlockTable: pages of request b are page_ids[b * page_list_stride + j] (a dense [batch, max_pages] table)
//   kRagged:     token t of request b is row page_list_indptr[b] + t of packed K/V (page size 1, no page ids)
enum class KVFormat : int32_t { kPagedCSR = 0, kBlockTable = 1, kRagged = 2 };

}  // namespace attnforge
