#include "backends/cpu/convert.h"

#include "backends/cpu/simd.h"

#include <cmath>
#include <limits>

namespace attnforge::cpu {

namespace {

struct Fp8Tables {
  float e4m3[256];
  float e5m2[256];
  Fp8Tables() {
    for (int b = 0; b < 256; ++b) {
      const float sign = (b & 0x80) ? -1.f : 1.f;
      {  // e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, S.1111.111 is NaN, no infinities.
        const int e = (b >> 3) & 0xf, m = b & 7;
        if (e == 15 && m == 7)
          e4m3[b] = std::numeric_limits<float>::quiet_NaN();
        else if (e == 0)
          e4m3[b] = sign * std::ldexp(static_cast<float>(m) / 8.f, -6);
        else
          e4m3[b] = sign * std::ldexp(1.f + static_cast<float>(m) / 8.f, e - 7);
      }
      {  // e5m2: 5 exponent bits (bias 15), 2 mantissa bits, IEEE-style infinities and NaNs.
        const int e = (b >> 2) & 0x1f, m = b & 3;
        if (e == 31)
          e5m2[b] = m == 0 ? sign * std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
        else if (e == 0)
          e5m2[b] = sign * std::ldexp(static_cast<float>(m) / 4.f, -14);
        else
          e5m2[b] = sign * std::ldexp(1.f + static_cast<float>(m) / 4.f, e - 15);
      }
    }
  }
};

const Fp8Tables& tables() {
  static const Fp8Tables t;
  return t;
}

// Nearest finite code among the non-negative codes [0, max_code] of `table` (values increase with the code),
// ties to the even code; the sign bit is added afterwards.
uint8_t encode_fp8(float f, const float* table, int max_code, uint8_t nan_code) {
  if (std::isnan(f)) return nan_code;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  if (a >= table[max_code]) return sign | static_cast<uint8_t>(max_code);
  int lo = 0, hi = max_code;  // table[lo] <= a < table[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (table[mid] <= a) lo = mid; else hi = mid;
  }
  const float dlo = a - table[lo], dhi = table[hi] - a;
  const int code = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
  return sign | static_cast<uint8_t>(code);
}

}  // namespace

const float* e4m3_table() { return tables().e4m3; }
const float* e5m2_table() { return tables().e5m2; }

uint8_t float_to_e4m3(float f) { return encode_fp8(f, tables().e4m3, 0x7e, 0x7f); }
uint8_t float_to_e5m2(float f) { return encode_fp8(f, tables().e5m2, 0x7b, 0x7f); }

void load_row(const void* base, DType type, int64_t offset, int32_t n, float scale, float* dst) {
  switch (type) {
    case DType::kFloat32: {
      const float* s = static_cast<const float*>(base) + offset;
      for (int32_t i = 0; i < n; ++i) dst[i] = scale * s[i];
      return;
    }
    case DType::kFloat16: {
      const _Float16* s = static_cast<const _Float16*>(base) + offset;
      for (int32_t i = 0; i < n; ++i) dst[i] = scale * static_cast<float>(s[i]);
      return;
    }
    case DType::kBFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(base) + offset;
      for (int32_t i = 0; i < n; ++i) {
        const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        dst[i] = scale * f;
      }
      return;
    }
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2: {
      // 16 codes at a time by bit arithmetic (simd.h); the table covers the tail.
      const bool e4m3 = type == DType::kFloat8E4M3;
      const float* table = e4m3 ? e4m3_table() : e5m2_table();
      const uint8_t* s = static_cast<const uint8_t*>(base) + offset;
      int32_t i = 0;
      for (; i + kLanes <= n; i += kLanes)
        store16(dst + i, splat16(scale) * (e4m3 ? fp8x16_to_float<true>(s + i) : fp8x16_to_float<false>(s + i)));
      for (; i < n; ++i) dst[i] = scale * table[s[i]];
      return;
    }
    default: return;  // index types never reach here: callers validated the dtype
  }
}

void store_row(void* base, DType type, int64_t offset, int32_t n, const float* src, float scale) {
  switch (type) {
    case DType::kFloat32: {
      float* d = static_cast<float*>(base) + offset;
      for (int32_t i = 0; i < n; ++i) d[i] = src[i];
      return;
    }
    case DType::kFloat16: {
      _Float16* d = static_cast<_Float16*>(base) + offset;
      for (int32_t i = 0; i < n; ++i) d[i] = static_cast<_Float16>(src[i]);
      return;
    }
    case DType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(base) + offset;
      for (int32_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
      return;
    }
    case DType::kFloat8E4M3: {
      uint8_t* d = static_cast<uint8_t*>(base) + offset;
      for (int32_t i = 0; i < n; ++i) d[i] = float_to_e4m3(src[i] / scale);
      return;
    }
    case DType::kFloat8E5M2: {
      uint8_t* d = static_cast<uint8_t*>(base) + offset;
      for (int32_t i = 0; i < n; ++i) d[i] = float_to_e5m2(src[i] / scale);
      return;
    }
    default: return;
  }
}

float load_one(const void* base, DType type, int64_t offset) {
  float f = 0.f;
  load_row(base, type, offset, 1, 1.f, &f);
  return f;
}

}  // namespace attnforge::cpu
