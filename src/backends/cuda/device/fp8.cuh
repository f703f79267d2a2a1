// fp8 K/V storage for the tensor-core kernels: the storage tags and the conversion of fp8 codes to the 16-bit mma
// operand type by bit arithmetic. Every e4m3fn and e5m2 value is exactly an fp16 value (e4m3: 2^-9 .. 448, 3
// mantissa bits; e5m2: 2^-16 .. 57344, 2 mantissa bits) and exactly a bf16 value, so the conversions are exact:
// the tensor cores see the stored values, as the float64 reference does. Self-contained for NVRTC.
#pragma once

#include "backends/cuda/device/ptx.cuh"

namespace attnforge::cuda {

// K/V storage types besides the 16-bit operand types (Bf16, F16): one byte per element.
struct E4M3 {};  // e4m3fn
struct E5M2 {};

template <typename KV>
struct KVStorage {
  static constexpr int kBytes = 2;  // Bf16 or F16: K/V in the operand type
};
template <>
struct KVStorage<E4M3> {
  static constexpr int kBytes = 1;
};
template <>
struct KVStorage<E5M2> {
  static constexpr int kBytes = 1;
};

// Byte permute: byte i of the result is byte (selector >> 4 i) & 7 of {b:a} (a bytes 0-3, b bytes 4-7).
__device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
}

// Four fp8 codes x (bytes 0..3) -> two fp16 pairs: out[0] = (byte 0, byte 1), out[1] = (byte 2, byte 3), the
// lower byte in the lower half.
//
// e5m2 is the upper half of an fp16 (same sign, exponent width and bias): the bytes move into the high byte of
// each half, one prmt per pair.
__device__ __forceinline__ void fp8x4_to_f16x2(uint32_t x, uint32_t out[2], E5M2) {
  out[0] = byte_perm(x, 0u, 0x1404u);
  out[1] = byte_perm(x, 0u, 0x3424u);
}

// e4m3fn: sm_89 and newer convert two codes per instruction. Before that, the code's exponent and mantissa bits
// (s eeee mmm) are placed below an fp16's (s 0eeee mmm0000000): that fp16 is the value times 2^-8 for normal
// codes (bias 15 instead of 7) and for subnormal ones alike (fp16 subnormals have the fp8 subnormals' form), so
// one multiply by 2^8 in fp16 restores it exactly (fp16 arithmetic keeps subnormal inputs; every result is a
// normal fp16). The NaN codes 0x7f/0xff decode to +-480 on that path (they do not occur in a written cache).
__device__ __forceinline__ void fp8x4_to_f16x2(uint32_t x, uint32_t out[2], E4M3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n"
      ".reg .b16 lo, hi;\n"
      "mov.b32 {lo, hi}, %2;\n"
      "cvt.rn.f16x2.e4m3x2 %0, lo;\n"
      "cvt.rn.f16x2.e4m3x2 %1, hi;\n"
      "}\n"
      : "=r"(out[0]), "=r"(out[1])
      : "r"(x));
#else
  const uint32_t kTwoPow8 = 0x5c005c00u;  // (256, 256) in fp16
  for (int i = 0; i < 2; ++i) {
    const uint32_t high = byte_perm(x, 0u, i == 0 ? 0x1404u : 0x3424u);  // codes in bits 15..8 and 31..24
    const uint32_t bits = (high & 0x80008000u) | ((high >> 1) & 0x3f803f80u);
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(out[i]) : "r"(bits), "r"(kTwoPow8));
  }
#endif
}

// Four fp8 codes -> two pairs of the mma operand type (Elem), in the order of fp8x4_to_f16x2. bf16 goes through
// fp16 and fp32, both exact: no bf16 subnormal arithmetic is relied on.
template <typename KV>
__device__ __forceinline__ void fp8x4_to_pairs(uint32_t x, uint32_t out[2], F16) {
  fp8x4_to_f16x2(x, out, KV{});
}
template <typename KV>
__device__ __forceinline__ void fp8x4_to_pairs(uint32_t x, uint32_t out[2], Bf16) {
  uint32_t h[2];
  fp8x4_to_f16x2(x, h, KV{});
  for (int i = 0; i < 2; ++i)
    out[i] = pack2(f16_to_float(static_cast<uint16_t>(h[i] & 0xffffu)), f16_to_float(static_cast<uint16_t>(h[i] >> 16)),
                   Bf16{});
}

}  // namespace attnforge::cuda
