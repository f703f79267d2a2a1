// Thin wrappers over the PTX instructions the kernels use. Self-contained (no toolkit headers), so kernels built
// on them compile under nvcc and NVRTC alike. sm_80 or newer.
#pragma once

#include "attnforge/kernel/types.h"

namespace attnforge::cuda {

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1; src_bytes 0 fills the destination with zeros (the source
// pointer must still be a valid address).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)), "l"(gmem),
               "r"(src_bytes));
}
// A 4-byte global load cached in L2 only (ld.global.cg): data another CTA wrote in this launch, never a stale L1 line.
__device__ __forceinline__ float load_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
  return v;
}
// load_cg of 16 bytes.
__device__ __forceinline__ float4 load_cg4(const float* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}
// A flag between CTAs of different grids on one GPU: the release store orders the writer's earlier writes (and,
// after a CTA barrier, its CTA's) before the flag; the acquire load orders the reader's later reads after it.
__device__ __forceinline__ void store_release_gpu(int32_t* p, int32_t v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int32_t load_acquire_gpu(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// `p` through a register move the compiler cannot see through: addresses made from it are made where they are used,
// not hoisted out of the loop around them into registers of their own.
template <typename T>
__device__ __forceinline__ const T* opaque_pointer(const T* p) {
  const T* q;
  asm volatile("mov.b64 %0, %1;\n" : "=l"(q) : "l"(p));
  return q;
}
// Brings the line holding *p into this SM's L1 (no register, nothing waits for it): a later load finds it there.
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p)); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem)));
}
// Transposes an 8x8 matrix of 16-bit elements held in mma fragment form (lane holds row lane / 4, columns
// 2 (lane % 4) and 2 (lane % 4) + 1): the result holds the same places of the transpose.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem)));
}

// Programmatic dependent launch (sm_90+; no-ops before): the running grid lets the next one, launched with the
// programmatic-serialization attribute, be scheduled; the dependent grid waits until the grid before it has
// completed and its memory is visible. Without that attribute the wait returns at once.
__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Element types of the 16-bit tensor-core operands.
struct Bf16 {};
struct F16 {};

// D = A (16x16, row) * B (16x8, col) + D, fp32 accumulation.
__device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1, Bf16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1, F16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats to a packed pair (lo in the low half), rounded to nearest even.
__device__ __forceinline__ uint32_t pack2(float lo, float hi, Bf16) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ uint32_t pack2(float lo, float hi, F16) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float bf16_to_float(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }
__device__ __forceinline__ float f16_to_float(uint16_t h) {
  float f;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ uint16_t float_to_bf16(float f) {
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(r) : "f"(f));
  return r;
}
__device__ __forceinline__ uint16_t float_to_f16(float f) {
  uint16_t r;
  asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(r) : "f"(f));
  return r;
}

// The 16-bit element types to and from fp32 (round to nearest even), by the mma operand tag.
__device__ __forceinline__ float elem_to_float(uint16_t h, Bf16) { return bf16_to_float(h); }
__device__ __forceinline__ float elem_to_float(uint16_t h, F16) { return f16_to_float(h); }
__device__ __forceinline__ uint16_t float_to_elem(float f, Bf16) { return float_to_bf16(f); }
__device__ __forceinline__ uint16_t float_to_elem(float f, F16) { return float_to_f16(f); }

// Loads one element of `type` (fp32, fp16 or bf16) at element `offset` of `base` as a float.
__device__ __forceinline__ float load_element(const void* base, DType type, int64_t offset) {
  if (type == DType::kFloat32) return static_cast<const float*>(base)[offset];
  const uint16_t h = static_cast<const uint16_t*>(base)[offset];
  return type == DType::kBFloat16 ? bf16_to_float(h) : f16_to_float(h);
}

// Stores one float as `type` (fp32, fp16 or bf16) at element `offset` of `base`.
__device__ __forceinline__ void store_element(void* base, DType type, int64_t offset, float v) {
  if (type == DType::kFloat32)
    static_cast<float*>(base)[offset] = v;
  else if (type == DType::kBFloat16)
    static_cast<uint16_t*>(base)[offset] = float_to_bf16(v);
  else
    static_cast<uint16_t*>(base)[offset] = float_to_f16(v);
}

// 2^x on the special-function unit, subnormal results flushed to zero: one instruction, where exp2f adds the
// range fix-ups for subnormals (four per element, a quarter of the prefill kernel's softmax). 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float warp_max_quad(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float warp_sum_quad(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
// The same over the 8 lanes of a column of mma fragments (the lanes that share lane % 4).
__device__ __forceinline__ float warp_max_column(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}
__device__ __forceinline__ float warp_sum_column(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

}  // namespace attnforge::cuda
