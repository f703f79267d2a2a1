// 16-lane float vectors through GCC/Clang vector extensions: one AVX-512 register where the build machine has
// it, two AVX2 registers or four SSE registers elsewhere; and FVec, the register width's (see below). No
// intrinsics, so the CPU backend builds for any x86-64 (or other) target the compiler supports.
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

// fp8 codes to fp32 by bit arithmetic, exactly as the decoding tables (convert.cc) define them: the magnitude
// bits move into the fp32 exponent and mantissa fields, and one multiply by a power of two rebases the exponent
// (2^120 for e4m3's bias 7, 2^112 for e5m2's bias 15); fp8 subnormals enter as fp32 subnormals, which the
// multiply turns into exact normals. All-ones exponents: NaN for e4m3fn's S.1111.111; infinities and NaNs for
// e5m2. NaN is the positive quiet NaN, as in the tables. x holds the codes widened to 32-bit lanes (U, a uint32
// vector of any width, and F, the float vector of its width), so each target can widen the bytes its best way.
template <bool kE4M3, typename F, typename U>
inline F fp8_lanes_to_float(U x) {
  const U mag = x & 0x7fu;
  const U field = mag << (kE4M3 ? 20 : 21);
  F f;
  std::memcpy(&f, &field, sizeof(f));
  f *= kE4M3 ? 0x1p120f : 0x1p112f;
  U bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits |= (x & 0x80u) << 24;
  const U nan = U{} + 0x7fc00000u;
  if constexpr (kE4M3) {
    bits = mag == 0x7fu ? nan : bits;
  } else {
    bits = mag == 0x7cu ? ((x & 0x80u) << 24) | 0x7f800000u : bits;
    bits = mag > 0x7cu ? nan : bits;
  }
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// 16 fp8 codes to fp32 (see fp8_lanes_to_float).
template <bool kE4M3>
inline F16x fp8x16_to_float(const uint8_t* p) {
  U8x16 b;
  std::memcpy(&b, p, sizeof(b));
  return fp8_lanes_to_float<kE4M3, F16x>(__builtin_convertvector(b, U32x16));
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

// Lane-wise max and e^x for any width of float vector F (I: the int32 vector of its width).
template <typename F>
inline F max_lanes(F a, F b) {
  return a > b ? a : b;
}

// e^x (Cephes-style): x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial (relative error
// within a few fp32 rounding steps), 2^n through the exponent bits. Lanes below -87 (masked logits at -inf
// included) give exactly 0. (F{} + c: a constant broadcast, folded.)
template <typename F, typename I>
inline F exp_lanes(F x) {
  const I underflow = x < -87.f;
  x = x > 88.f ? F{} + 88.f : x;
  x = underflow ? F{} : x;
  const F t = x * 1.44269504f;
  F n = __builtin_convertvector(__builtin_convertvector(t + 0.5f, I), F);  // truncates toward zero
  n = n > t + 0.5f ? n - 1.f : n;                                          // so this is floor(t + 0.5)
  const F r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln 2 in two parts keeps r exact
  F p = F{} + 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  F scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflow ? F{} : p * scale;
}

inline float hmax16(F16x v) {
  v = max_lanes(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = max_lanes(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = max_lanes(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = max_lanes(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

// The float vector of the target's register width, for the hot loops: 16 lanes with AVX-512, 8 elsewhere. GCC 12
// keeps 16-lane values in memory where registers hold 8 (stores of xmm halves reloaded as ymm, perf annotate of
// attend on AVX2) and builds their selects (?:) one lane at a time, so loops that need not be 16 lanes wide use this.
typedef float F8x __attribute__((vector_size(32)));
typedef int32_t I8x __attribute__((vector_size(32)));

inline float hsum8(F8x v) {
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  return v[0];
}
inline float hmax8(F8x v) {
  v = max_lanes(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = max_lanes(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  v = max_lanes(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
  return v[0];
}
// The sums of four vectors (as hsum16x4), with shuffles inside 128-bit halves after the first step.
inline void hsum8x4(F8x a0, F8x a1, F8x a2, F8x a3, float* out) {
  // x: 4 partials of a0 (low half), 4 of a1 (high half); y: of a2, a3.
  const F8x x = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
  const F8x y = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
  // z: [a0 x2, a2 x2 | a1 x2, a3 x2].
  const F8x z = __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
                __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  const F8x w = z + __builtin_shufflevector(z, z, 1, 0, 3, 2, 5, 4, 7, 6);
  out[0] = w[0], out[1] = w[4], out[2] = w[2], out[3] = w[6];
}

#if defined(__AVX512F__)
typedef F16x FVec;
typedef I16x IVec;
inline FVec splat_vec(float x) { return splat16(x); }
inline float hsum_vec(FVec v) { return hsum16(v); }
inline float hmax_vec(FVec v) { return hmax16(v); }
inline void hsum_vec_x4(FVec a0, FVec a1, FVec a2, FVec a3, float* out) { hsum16x4(a0, a1, a2, a3, out); }
#else
typedef F8x FVec;
typedef I8x IVec;
inline FVec splat_vec(float x) { return FVec{x, x, x, x, x, x, x, x}; }
inline float hsum_vec(FVec v) { return hsum8(v); }
inline float hmax_vec(FVec v) { return hmax8(v); }
inline void hsum_vec_x4(FVec a0, FVec a1, FVec a2, FVec a3, float* out) { hsum8x4(a0, a1, a2, a3, out); }
#endif
constexpr int32_t kVecLanes = sizeof(FVec) / sizeof(float);
static_assert(kLanes % kVecLanes == 0);
inline FVec load_vec(const float* p) {
  FVec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store_vec(float* p, FVec v) { std::memcpy(p, &v, sizeof(v)); }

}  // namespace attnforge::cpu
