// 16-lane float vectors through GCC/Clang vector extensions: one AVX-512 register where the build machine has
// it, two AVX2 registers or four SSE registers elsewhere. No intrinsics, so the CPU backend builds for any
// x86-64 (or other) target the compiler supports.
#pragma once

#include <cstdint>
#include <cstring>

namespace attnforge::cpu {

typedef float F16x __attribute__((vector_size(64)));    // 16 floats
typedef int32_t I16x __attribute__((vector_size(64)));  // 16 int32

typedef uint16_t U16x16 __attribute__((vector_size(32)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));

constexpr int32_t kLanes = 16;

// 16 bf16 values to fp32: widen and shift into the high half (bf16 is the top 16 bits of an fp32).
inline F16x bf16x16_to_float(const uint16_t* p) {
  U16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const U32x16 w = __builtin_convertvector(h, U32x16) << 16;
  F16x f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

typedef uint8_t U8x16 __attribute__((vector_size(16)));

// 16 fp8 codes to fp32 by bit arithmetic, exactly as the decoding tables (convert.cc) define them: the magnitude
// bits move into the fp32 exponent and mantissa fields, and one multiply by a power of two rebases the exponent
// (2^120 for e4m3's bias 7, 2^112 for e5m2's bias 15); fp8 subnormals enter as fp32 subnormals, which the
// multiply turns into exact normals. All-ones exponents: NaN for e4m3fn's S.1111.111; infinities and NaNs for
// e5m2. NaN is the positive quiet NaN, as in the tables.
template <bool kE4M3>
inline F16x fp8x16_to_float(const uint8_t* p) {
  U8x16 b;
  std::memcpy(&b, p, sizeof(b));
  const U32x16 x = __builtin_convertvector(b, U32x16);
  const U32x16 mag = x & 0x7fu;
  const U32x16 field = mag << (kE4M3 ? 20 : 21);
  F16x f;
  std::memcpy(&f, &field, sizeof(f));
  f *= kE4M3 ? 0x1p120f : 0x1p112f;
  U32x16 bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits |= (x & 0x80u) << 24;
  const U32x16 nan = U32x16{} + 0x7fc00000u;
  if constexpr (kE4M3) {
    bits = mag == 0x7fu ? nan : bits;
  } else {
    bits = mag == 0x7cu ? ((x & 0x80u) << 24) | 0x7f800000u : bits;
    bits = mag > 0x7cu ? nan : bits;
  }
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline F16x load16(const float* p) {
  F16x v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, F16x v) { std::memcpy(p, &v, sizeof(v)); }
// A broadcast (not 0 + x, which the compiler may not fold: 0 + -0 is +0).
inline F16x splat16(float x) { return F16x{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// Sum of the 16 lanes by halving: four shuffle-and-add steps instead of fifteen dependent scalar adds.
inline float hsum16(F16x v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// The sums of four vectors at once: halving steps that pair lanes of different vectors, so four reductions
// take five adds and ten shuffles instead of sixteen of each.
inline void hsum16x4(F16x a0, F16x a1, F16x a2, F16x a3, float* out) {
  const F16x x = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const F16x y = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // x: 8 partials of a0, 8 of a1; y: of a2, a3. Fold to 4 each: [a0 x4, a1 x4, a2 x4, a3 x4].
  const F16x z = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                 __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const F16x w = z + __builtin_shufflevector(z, z, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  const F16x v = w + __builtin_shufflevector(w, w, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  out[0] = v[0], out[1] = v[4], out[2] = v[8], out[3] = v[12];
}

inline F16x max16(F16x a, F16x b) { return a > b ? a : b; }
inline float hmax16(F16x v) {
  v = max16(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = max16(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = max16(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = max16(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

// e^x for 16 lanes (Cephes-style): x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial
// (relative error within a few fp32 rounding steps), 2^n through the exponent bits. Lanes below -87 (masked logits
// at -inf included) give exactly 0.
inline F16x exp16(F16x x) {
  const I16x underflow = x < -87.f;
  x = x > 88.f ? splat16(88.f) : x;
  x = underflow ? splat16(0.f) : x;
  const F16x t = x * 1.44269504f;
  F16x n = __builtin_convertvector(__builtin_convertvector(t + 0.5f, I16x), F16x);  // truncates toward zero
  n = n > t + 0.5f ? n - 1.f : n;                                                    // so this is floor(t + 0.5)
  const F16x r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln 2 in two parts keeps r exact
  F16x p = splat16(1.f / 5040.f);
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const I16x bits = (__builtin_convertvector(n, I16x) + 127) << 23;
  F16x scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflow ? splat16(0.f) : p * scale;
}

}  // namespace attnforge::cpu
