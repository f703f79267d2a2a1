// Element conversions for the CPU backend. Rows are converted to and from fp32 in loops the compiler
// vectorizes (F16C for fp16, shifts for bf16; fp8 by bit arithmetic 16 at a time, simd.h, with 256-entry tables
// for tails and scalar use).
#pragma once

#include <cstdint>
#include <cstring>

#include "attnforge/kernel/types.h"

namespace attnforge::cpu {

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN stays NaN (quiet bit set so truncation cannot make it infinity).
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// fp8 decoding tables (index = the byte).
const float* e4m3_table();
const float* e5m2_table();
// Round to nearest even; values beyond the largest finite value saturate to it (e4m3fn has no infinity);
// NaN maps to NaN.
uint8_t float_to_e4m3(float f);
uint8_t float_to_e5m2(float f);

// dst[i] = scale * element(offset + i) for i < n; offset in elements of `type`.
void load_row(const void* base, DType type, int64_t offset, int32_t n, float scale, float* dst);
// element(offset + i) = src[i] (fp8 targets store src[i] / scale).
void store_row(void* base, DType type, int64_t offset, int32_t n, const float* src, float scale = 1.f);

// Scalar access, for code off the hot path.
float load_one(const void* base, DType type, int64_t offset);

}  // namespace attnforge::cpu
