// Hopper warpgroup matrix products (wgmma) and the shared-memory layout they read: the building blocks of the
// sm_90a prefill kernel. Self-contained for NVRTC. Only sm_90a code may call the instructions (the "a" target);
// everything else here is plain arithmetic and compiles anywhere.
//
// Layout: an operand tile of R rows x 64 16-bit elements (128 bytes a row) in the 128-byte swizzle: row r at byte
// 128 r, its 16-byte chunk c at chunk c ^ (r % 8); tiles 1024-byte aligned. Wider operands are panels of 64
// elements, one after another. A K-major operand (A = Q rows, B = K rows for S = Q K^T) takes the product's K
// along a row; an MN-major operand (B = V rows for O = P V: K = tokens down the rows, N = dims along them) is
// transposed by the instruction (imm-trans-b).
#pragma once

#include "attnforge/kernel/types.h"
#include "backends/cuda/device/ptx.cuh"

namespace attnforge::cuda::wgmma {

constexpr int kRowBytes = 128;               // one swizzle row: 64 16-bit elements
constexpr int kAtomBytes = 8 * kRowBytes;    // eight rows: the swizzle pattern's repeat

// Byte offset of element (row, col) of a 64-column panel in the 128-byte swizzle (16-bit elements).
__host__ __device__ __forceinline__ uint32_t swizzled_offset(uint32_t row, uint32_t col) {
  const uint32_t chunk = (col / 8) ^ (row % 8);
  return row * kRowBytes + chunk * 16 + (col % 8) * 2;
}

// The 64-bit shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading and
// stride byte offsets (all in 16-byte units, 14 bits each) and the swizzle mode (bits 62-63; 1 = 128-byte).
__host__ __device__ __forceinline__ uint64_t descriptor(uint32_t smem_addr, uint32_t leading_bytes,
                                                        uint32_t stride_bytes) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((smem_addr & 0x3FFFFu) >> 4);
  d |= static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFFu) << 16;
  d |= static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFFu) << 32;
  d |= static_cast<uint64_t>(1) << 62;  // 128-byte swizzle; base offset 0 (tiles are 1024-byte aligned)
  return d;
}

// K-major operand, k16 step `k` (16 elements = 32 bytes along a row) of a panel starting at `panel_addr`: eight-row
// groups 1024 bytes apart (stride offset); the leading offset is unused within a 128-byte swizzle row.
__host__ __device__ __forceinline__ uint64_t k_major(uint32_t panel_addr, int k) {
  return descriptor(panel_addr + 32u * static_cast<uint32_t>(k), 16, kAtomBytes);
}

// MN-major operand (rows = K, 64 N elements a row in each panel), k16 step `k` (16 rows = 2048 bytes down): eight-
// row groups along K 1024 bytes apart (stride offset), 64-element panels along N `panel_bytes` apart (leading).
__host__ __device__ __forceinline__ uint64_t mn_major(uint32_t panel_addr, int k, uint32_t panel_bytes) {
  return descriptor(panel_addr + 16u * kRowBytes * static_cast<uint32_t>(k), panel_bytes, kAtomBytes);
}

#if defined(__CUDA_ARCH__)
// Orders this thread's generic-proxy shared-memory stores before async-proxy reads (wgmma operands).
__device__ __forceinline__ void fence_operands() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Before the first wgmma that reads or writes registers the warpgroup changed since its last wgmma.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed groups are pending.
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Accumulator registers of an m64nNk16 product, f32: warp w of the warpgroup holds rows 16 w + lane / 4 and + 8;
// d[4 j + e] is row (lane / 4 + 8 (e / 2)), column 8 j + 2 (lane % 4) + e % 2 of the warp's rows, as mma.m16n8.
#define ATTNFORGE_WGMMA_D32                                                                                       \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),      \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),     \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define ATTNFORGE_WGMMA_REGS32                                                                                    \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31}"

// D (64 x 64, f32) = A (64 x 16, shared, K-major) B^T (B: 64 x 16, shared, K-major) + (accumulate ? D : 0).
#define ATTNFORGE_WGMMA_SS(TYPE)                                                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                       \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " ATTNFORGE_WGMMA_REGS32             \
               ", %32, %33, p, 1, 1, 0, 0;\n}\n"                                                                  \
               : ATTNFORGE_WGMMA_D32                                                                              \
               : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)))

// A (64 x 16) from registers in the mma.m16n8k16 A layout (warp w: rows 16 w ..), B from shared memory; B is
// MN-major (transposed by the instruction) when trans_b.
#define ATTNFORGE_WGMMA_RS(TYPE, TRANS)                                                                            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                       \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " ATTNFORGE_WGMMA_REGS32             \
               ", {%32, %33, %34, %35}, %36, p, 1, 1, " TRANS ";\n}\n"                                             \
               : ATTNFORGE_WGMMA_D32                                                                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)))

// Element types: the Bf16 and F16 tags of ptx.cuh.
__device__ __forceinline__ void m64n64k16_ss(float d[32], uint64_t a, uint64_t b, bool accumulate, Bf16) {
  ATTNFORGE_WGMMA_SS("bf16");
}
__device__ __forceinline__ void m64n64k16_ss(float d[32], uint64_t a, uint64_t b, bool accumulate, F16) {
  ATTNFORGE_WGMMA_SS("f16");
}
// B MN-major (O = P V with V rows in shared memory).
__device__ __forceinline__ void m64n64k16_rs_tb(float d[32], const uint32_t a[4], uint64_t b, bool accumulate,
                                                Bf16) {
  ATTNFORGE_WGMMA_RS("bf16", "1");
}
__device__ __forceinline__ void m64n64k16_rs_tb(float d[32], const uint32_t a[4], uint64_t b, bool accumulate,
                                                F16) {
  ATTNFORGE_WGMMA_RS("f16", "1");
}
// The same with N = 128 (64 accumulator registers: n8 blocks j = 0 .. 15): S over 128-token K tiles, O = P V at
// head_dim 128. B spans two 64-element panels along N (MN-major: the descriptor's leading offset is the panel
// stride; K-major: 128 rows of one panel).
#define ATTNFORGE_WGMMA_D64 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define ATTNFORGE_WGMMA_REGS64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define ATTNFORGE_WGMMA_SS128(TYPE)                                                                                \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                       \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " ATTNFORGE_WGMMA_REGS64            \
               ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                                                  \
               : ATTNFORGE_WGMMA_D64                                                                              \
               : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)))
#define ATTNFORGE_WGMMA_RS128(TYPE, TRANS)                                                                         \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                       \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " ATTNFORGE_WGMMA_REGS64            \
               ", {%64, %65, %66, %67}, %68, p, 1, 1, " TRANS ";\n}\n"                                           \
               : ATTNFORGE_WGMMA_D64                                                                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)))

__device__ __forceinline__ void m64n128k16_ss(float d[64], uint64_t a, uint64_t b, bool accumulate, Bf16) {
  ATTNFORGE_WGMMA_SS128("bf16");
}
__device__ __forceinline__ void m64n128k16_ss(float d[64], uint64_t a, uint64_t b, bool accumulate, F16) {
  ATTNFORGE_WGMMA_SS128("f16");
}
__device__ __forceinline__ void m64n128k16_rs_tb(float d[64], const uint32_t a[4], uint64_t b, bool accumulate,
                                                 Bf16) {
  ATTNFORGE_WGMMA_RS128("bf16", "1");
}
__device__ __forceinline__ void m64n128k16_rs_tb(float d[64], const uint32_t a[4], uint64_t b, bool accumulate,
                                                 F16) {
  ATTNFORGE_WGMMA_RS128("f16", "1");
}
// N = 32 (16 accumulator registers): S over a K tile's first 32 tokens (a warpgroup's narrow last tile).
#define ATTNFORGE_WGMMA_SS32(TYPE)                                                                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                                       \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " "                                    \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),     \
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
               : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)))
__device__ __forceinline__ void m64n32k16_ss(float d[16], uint64_t a, uint64_t b, bool accumulate, Bf16) {
  ATTNFORGE_WGMMA_SS32("bf16");
}
__device__ __forceinline__ void m64n32k16_ss(float d[16], uint64_t a, uint64_t b, bool accumulate, F16) {
  ATTNFORGE_WGMMA_SS32("f16");
}
// N = 96 (48 accumulator registers): S over a K tile's first 96 tokens (prefill_wgmma.cuh: a warpgroup's last
// tile of an item computes only the tokens its rows can see, rounded up to 32).
#define ATTNFORGE_WGMMA_D48 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
  "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), \
  "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
  "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), \
  "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), \
  "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
#define ATTNFORGE_WGMMA_REGS48 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}"
#define ATTNFORGE_WGMMA_SS96(TYPE)                                                                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"                                                       \
               "wgmma.mma_async.sync.aligned.m64n96k16.f32." TYPE "." TYPE " " ATTNFORGE_WGMMA_REGS48             \
               ", %48, %49, p, 1, 1, 0, 0;\n}\n"                                                                  \
               : ATTNFORGE_WGMMA_D48                                                                              \
               : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)))
__device__ __forceinline__ void m64n96k16_ss(float d[48], uint64_t a, uint64_t b, bool accumulate, Bf16) {
  ATTNFORGE_WGMMA_SS96("bf16");
}
__device__ __forceinline__ void m64n96k16_ss(float d[48], uint64_t a, uint64_t b, bool accumulate, F16) {
  ATTNFORGE_WGMMA_SS96("f16");
}
#undef ATTNFORGE_WGMMA_SS96
#undef ATTNFORGE_WGMMA_D48
#undef ATTNFORGE_WGMMA_REGS48
#undef ATTNFORGE_WGMMA_SS32
#undef ATTNFORGE_WGMMA_SS128
#undef ATTNFORGE_WGMMA_RS128
#undef ATTNFORGE_WGMMA_D64
#undef ATTNFORGE_WGMMA_REGS64
#undef ATTNFORGE_WGMMA_SS
#undef ATTNFORGE_WGMMA_RS
#undef ATTNFORGE_WGMMA_D32
#undef ATTNFORGE_WGMMA_REGS32
#endif  // __CUDA_ARCH__

}  // namespace attnforge::cuda::wgmma
