// CPU batch attention: one task = (work item, a range of KV heads, a block of rows). The rows of a head are the
// item's query tokens times the query heads of its group, so every K/V row is converted to fp32 once and used
// by all of them; decode tasks span all KV heads so they stream through whole pages. Scores and the online
// softmax stay in fp32.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attnforge/kernel/state.h"
#include "attnforge/kernel/variant.h"
#include "backends/cpu/convert.h"
#include "backends/cpu/kernels.h"
#include "backends/cpu/simd.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ATTNFORGE_CPU_AVX2 1
#endif
// The raw bf16 K/V paths (scores and P V straight from the cache's bf16 rows), in AVX-512 BF16 or AVX2 + FMA.
#if defined(__AVX512BF16__) || defined(ATTNFORGE_CPU_AVX2)
#define ATTNFORGE_CPU_RAW_KV 1
#endif
#include "backends/cpu/thread_pool.h"

namespace attnforge::cpu {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int32_t kMaxRawPvRows = 8;  // rows per head that take the raw bf16 P V path (decode)

inline void scale_row(float* __restrict y, float a, int32_t n) {
#pragma omp simd
  for (int32_t i = 0; i < n; ++i) y[i] *= a;
}

// Writes a finished row: to the output (applying the head's sink) or to the partial-state buffers.
void write_row(const AttentionParams& p, const WorkItem& it, int32_t tok, int32_t h, float* o_row, float lse_nat) {
  const int32_t qo_start = p.plan->qo_indptr[it.request];
  if (it.partial_row < 0) {
    float lse = lse_nat * kLog2e;
    if (p.variant.sinks) scale_row(o_row, apply_sink(p.variant, h, &lse), p.head_dim_vo);
    store_row(p.o, p.o_dtype, (qo_start + tok) * p.o_stride_token + h * p.o_stride_head, p.head_dim_vo, o_row);
    if (p.lse) p.lse[(qo_start + tok) * p.lse_stride_token + h] = lse;
  } else {
    const int64_t row = static_cast<int64_t>(it.partial_row) + (tok - it.qo_begin);
    std::memcpy(p.plan->partial_o + (row * p.num_qo_heads + h) * p.head_dim_vo, o_row, sizeof(float) * p.head_dim_vo);
    p.plan->partial_lse[row * p.num_qo_heads + h] = lse_nat * kLog2e;
  }
}

// K/V rows to fp32: bf16 (the common cache type) inline, other types through load_row.
inline void load_kv_row(const void* base, DType type, int64_t offset, int32_t n, float* __restrict dst) {
  if (type == DType::kBFloat16) {
    const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
    int32_t i = 0;
    for (; i + kLanes <= n; i += kLanes) store16(dst + i, bf16x16_to_float(src + i));
    for (; i < n; ++i) {
      const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(dst + i, &u, 4);
    }
    return;
  }
  load_row(base, type, offset, n, 1.f, dst);
}

// Rows live in scratch at strides padded to 16 floats, with zero tails, so every inner loop runs on whole
// vectors (a zero tail adds nothing to a dot product or an accumulation).
inline int32_t padded(int32_t d) { return (d + kLanes - 1) / kLanes * kLanes; }

// Scores of one query row against tokens [0, n) of the converted K block: four tokens at a time share each
// load of the query, and each dot product ends in one shuffle-tree sum.
void score_row(const float* __restrict qr, const float* __restrict kb, int32_t n, int32_t d16, float* __restrict out) {
  for (int32_t t = 0; t < n; t += 4) {
    FVec a0{}, a1{}, a2{}, a3{};
    const float* k0 = kb + t * d16;
    for (int32_t c = 0; c < d16; c += kVecLanes) {
      const FVec qv = load_vec(qr + c);
      a0 += qv * load_vec(k0 + c);
      a1 += qv * load_vec(k0 + d16 + c);
      a2 += qv * load_vec(k0 + 2 * d16 + c);
      a3 += qv * load_vec(k0 + 3 * d16 + c);
    }
    hsum_vec_x4(a0, a1, a2, a3, out + t);
  }
}

// One task: KV heads [head0, head1) of a work item, and rows [row0, row1) of each head's rows (query tokens x
// the query heads of its group). Decode tasks take every KV head at once: a token's K/V rows of all heads are
// adjacent in an NHD page, so the task streams through whole pages instead of reading one 256-byte row every
// few kilobytes.
// acc[0, d16) += sum over t < n of p[t] * v[t][0, d16), NC vectors at a time: the accumulators stay in
// registers across the tokens (independent FMA chains) and each probability is broadcast once per group.
template <int NC>
inline void accumulate_pv_group(float* __restrict acc, const float* __restrict p, const float* __restrict v, int32_t n,
                                int32_t d16) {
  FVec a[NC];
  for (int i = 0; i < NC; ++i) a[i] = load_vec(acc + i * kVecLanes);
  for (int32_t t = 0; t < n; ++t) {
    const FVec pt = splat_vec(p[t]);
    const float* vt = v + t * d16;
    for (int i = 0; i < NC; ++i) a[i] += pt * load_vec(vt + i * kVecLanes);
  }
  for (int i = 0; i < NC; ++i) store_vec(acc + i * kVecLanes, a[i]);
}

inline void accumulate_pv(float* acc, const float* p, const float* v, int32_t n, int32_t d16) {
  int32_t c = 0;
  for (; c + 8 * kVecLanes <= d16; c += 8 * kVecLanes) accumulate_pv_group<8>(acc + c, p, v + c, n, d16);
  if (c + 4 * kVecLanes <= d16) accumulate_pv_group<4>(acc + c, p, v + c, n, d16), c += 4 * kVecLanes;
  if (c + 2 * kVecLanes <= d16) accumulate_pv_group<2>(acc + c, p, v + c, n, d16), c += 2 * kVecLanes;
  if (c + kVecLanes <= d16) accumulate_pv_group<1>(acc + c, p, v + c, n, d16);
}

#if defined(__AVX512BF16__)
// 16 fp8 codes to the bits of their fp32 values, as fp8x16_to_float (simd.h) computes them, with the bytes widened
// by one vpmovzxbd (GCC turned the vector-extension widening into byte-by-byte inserts, and perf put fp8 decode's
// time there).
// GCC 12 warns that the intrinsics' own undefined pass-through operand "may be used uninitialized" (a known false
// positive of its AVX-512 headers); the masks here are full, so no lane of it is ever read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <bool kE4M3>
inline __m512i fp8x16_to_fp32_bits(const uint8_t* p) {
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7f));
  const __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(mag, kE4M3 ? 20 : 21)),
                                 _mm512_set1_ps(kE4M3 ? 0x1p120f : 0x1p112f));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  __m512i bits = _mm512_or_si512(_mm512_castps_si512(f), sign);
  const __m512i nan = _mm512_set1_epi32(0x7fc00000);
  if constexpr (kE4M3) {
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)), nan);
  } else {
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7c)),
                                 _mm512_or_si512(sign, _mm512_set1_epi32(0x7f800000)));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(0x7c)), nan);
  }
  return bits;
}

// 32 fp8 codes to bf16 (the high halves of the fp32 bits: exact, fp8 values are bf16 values).
template <bool kE4M3>
inline void fp8x32_to_bf16(const uint8_t* src, uint16_t* dst) {
  const __m512i lo = fp8x16_to_fp32_bits<kE4M3>(src), hi = fp8x16_to_fp32_bits<kE4M3>(src + 16);
  // Word 2i + 1 of lo, then of hi (index bit 5 picks the second source).
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                                       25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(lo, odd, hi));
}
#pragma GCC diagnostic pop
#elif defined(ATTNFORGE_CPU_AVX2)
typedef uint32_t U32x8 __attribute__((vector_size(32)));

// 16 fp8 codes to bf16 (the high halves of the fp32 bits: exact, fp8 values are bf16 values), 8 at a time, the
// bytes widened by one vpmovzxbd (GCC 12 builds the 16-byte vector-extension widening from byte inserts).
template <bool kE4M3>
inline void fp8x16_to_bf16(const uint8_t* src, uint16_t* dst) {
  auto bits = [](const uint8_t* p) {
    const U32x8 x = (U32x8)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_srli_epi32((__m256i)fp8_lanes_to_float<kE4M3, F8x>(x), 16);
  };
  // packus works within 128-bit lanes ([0-3 of src, 0-3 of src + 8 | 4-7, 4-7]); the qword permute restores order.
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permute4x64_epi64(_mm256_packus_epi32(bits(src), bits(src + 8)), 0xd8));
}
#endif

#if defined(ATTNFORGE_CPU_RAW_KV)
// n fp8 codes (e4m3 or e5m2) to bf16, exactly: the fp32 value's top half (n a multiple of 16).
__attribute__((noinline)) void fp8_row_to_bf16(const uint8_t* src, DType type, int32_t n, uint16_t* dst) {
#if defined(__AVX512BF16__)
  if (n % 32 == 0) {
    for (int32_t i = 0; i < n; i += 32)
      type == DType::kFloat8E4M3 ? fp8x32_to_bf16<true>(src + i, dst + i) : fp8x32_to_bf16<false>(src + i, dst + i);
    return;
  }
#elif defined(ATTNFORGE_CPU_AVX2)
  for (int32_t i = 0; i < n; i += 16)
    type == DType::kFloat8E4M3 ? fp8x16_to_bf16<true>(src + i, dst + i) : fp8x16_to_bf16<false>(src + i, dst + i);
  return;
#endif
  for (int32_t i = 0; i < n; i += kLanes) {
    const F16x f = type == DType::kFloat8E4M3 ? fp8x16_to_float<true>(src + i) : fp8x16_to_float<false>(src + i);
    U32x16 bits;
    std::memcpy(&bits, &f, sizeof(bits));
    const U16x16 h = __builtin_convertvector(bits >> 16, U16x16);
    std::memcpy(dst + i, &h, sizeof(h));
  }
}
#endif

// Calls f.template operator()<R>(first row) over rows [begin, end) in groups of R <= 4 rows (registers: 16 score
// accumulators, or 8 P V chains).
template <class F>
void for_row_groups(int32_t begin, int32_t end, F&& f) {
  for (int32_t r = begin; r < end; r += 4) {
    switch (std::min(4, end - r)) {
      case 4: f.template operator()<4>(r); break;
      case 3: f.template operator()<3>(r); break;
      case 2: f.template operator()<2>(r); break;
      default: f.template operator()<1>(r); break;
    }
  }
}

#if defined(__AVX512BF16__)
// Scores of R query rows (raw bf16 at q + r * q_stride) straight from bf16 K rows with the AVX-512 BF16 dot product
// (pairs of bf16 products, exact, summed in fp32): K is neither converted nor stored, and each K load serves all R
// rows of the head (a GQA group). The caller scales the scores. Tokens past n read row n - 1 again (their scores
// are discarded).
template <int R>
void score_rows_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k, const int64_t* k_rows, int32_t n,
                     int32_t d, float* __restrict out, int32_t out_stride) {
  for (int32_t t = 0; t < n; t += 4) {
    const uint16_t* kt[4] = {k + k_rows[t], k + k_rows[t + 1], k + k_rows[t + 2], k + k_rows[t + 3]};
    __m512 a[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) a[r][j] = _mm512_setzero_ps();
    for (int32_t c = 0; c < d; c += 32) {
      __m512bh kc[4];
      for (int j = 0; j < 4; ++j) kc[j] = (__m512bh)_mm512_loadu_si512(kt[j] + c);
      for (int r = 0; r < R; ++r) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + r * q_stride + c);  // scratch rows: not 64-byte aligned
        for (int j = 0; j < 4; ++j) a[r][j] = _mm512_dpbf16_ps(a[r][j], qv, kc[j]);
      }
    }
    for (int r = 0; r < R; ++r)
      hsum16x4((F16x)a[r][0], (F16x)a[r][1], (F16x)a[r][2], (F16x)a[r][3], out + r * out_stride + t);
  }
}

// acc_r += P_r V over tokens [0, n) for R rows at once from raw bf16 V rows, two tokens per AVX-512 BF16 dot
// product: the rows of tokens t and t + 1 are interleaved (unpack, once for all R rows) so each fp32 lane sums
// v_t[d] p_t + v_t+1[d] p_t+1, with the row's probability pair (p_pairs + r * 16) broadcast; 2R independent
// accumulator chains. The unpacks leave the dimensions in a fixed permuted order inside each 32-dim chunk (see
// unpermute_row); the accumulators stay in that order until the row is written.
template <int R>
void accumulate_pv_rows_bf16(float* acc, int32_t acc_stride, const uint32_t* p_pairs, const uint16_t* v,
                             const int64_t* v_rows, int32_t n, int32_t d) {
  for (int32_t c = 0; c < d; c += 32) {
    __m512 lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm512_loadu_ps(acc + r * acc_stride + c);
      hi[r] = _mm512_loadu_ps(acc + r * acc_stride + c + 16);
    }
    for (int32_t t = 0; t < n; t += 2) {
      const __m512i vt = _mm512_loadu_si512(v + v_rows[t] + c);
      const __m512i vt1 = _mm512_loadu_si512(v + v_rows[t + 1 < n ? t + 1 : t] + c);  // its probability is 0
      const __m512bh ulo = (__m512bh)_mm512_unpacklo_epi16(vt, vt1), uhi = (__m512bh)_mm512_unpackhi_epi16(vt, vt1);
      for (int r = 0; r < R; ++r) {
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(p_pairs[r * (kKVBlock / 2) + t / 2]));
        lo[r] = _mm512_dpbf16_ps(lo[r], ulo, pp);
        hi[r] = _mm512_dpbf16_ps(hi[r], uhi, pp);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(acc + r * acc_stride + c, lo[r]);
      _mm512_storeu_ps(acc + r * acc_stride + c + 16, hi[r]);
    }
  }
}

// Back to natural order: within a 32-dim chunk, lane j of the low half holds dim 8 (j / 4) + j % 4 and lane j
// of the high half dim 8 (j / 4) + 4 + j % 4 (unpack works inside 128-bit lanes).
void unpermute_row(const float* permuted, float* out, int32_t d) {
  for (int32_t c = 0; c < d; c += 32)
    for (int32_t j = 0; j < 16; ++j) {
      out[c + 8 * (j / 4) + j % 4] = permuted[c + j];
      out[c + 8 * (j / 4) + 4 + j % 4] = permuted[c + 16 + j];
    }
}
constexpr bool kRawQ = true;  // score_rows_bf16 reads the raw bf16 Q rows; the caller scales the scores
#elif defined(ATTNFORGE_CPU_AVX2)
// AVX2 + FMA: the same design in 8-lane fp32 FMAs. A 32-byte load holds 16 bf16 values as 8 pairs: shifting each
// 32-bit lane left by 16 gives the even elements as fp32, clearing its low half the odd ones, two instructions per
// 16 values and no shuffle. So the fp32 Q rows (even_odd_row) and the P V accumulators hold each 16-dim chunk as
// its 8 even dims, then its 8 odd ones (unpermute_row restores the order).
inline void bf16x16_even_odd(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u))));
}

// The sums of four vectors: [sum a0, sum a1, sum a2, sum a3]. (simd.h's hsum8x4 in its place measured fp8 decode
// 16x4096 at 51-53 ms instead of 37-39.)
inline __m128 hadd8x4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The row formats the kernels below read, each widening 16 elements to fp32 in that even/odd order: bf16 (the
// cache's, or fp8 widened in scratch), and fp8 read directly, where a 16-byte load widened by vpmovzxwd holds a code
// pair in each 32-bit lane (fp8_lanes_to_float masks the even code out of the low byte; the odd one is shifted down).
struct Bf16Rows {
  using T = uint16_t;
  static void widen(const uint16_t* p, __m256& even, __m256& odd) { bf16x16_even_odd(p, even, odd); }
};
template <bool kE4M3>
struct Fp8Rows {
  using T = uint8_t;
  static void widen(const uint8_t* p, __m256& even, __m256& odd) {
    const U32x8 x = (U32x8)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    even = (__m256)fp8_lanes_to_float<kE4M3, F8x>(x);
    odd = (__m256)fp8_lanes_to_float<kE4M3, F8x>(x >> 8);
  }
};

// Scores of R query rows (fp32, scaled, even/odd order, at q + r * q_stride) against tokens [0, n) (n a multiple
// of 4) of bf16 K rows: each K load and widening serves all R rows (a GQA group). T tokens per pass and S
// accumulators per product keep 6-8 independent FMA chains (latency 4 x 2 FMA ports) within the 16 registers.
// Tokens past the block's end read row n - 1 again (the caller discards their scores).
template <int R, class Rows>
void score_rows_raw(const float* q, int64_t q_stride, const typename Rows::T* k, const int64_t* k_rows, int32_t n,
                    int32_t d, float* __restrict out, int32_t out_stride) {
  constexpr int T = R <= 2 ? 4 : 2;
  constexpr int S = R == 1 ? 2 : 1;  // one row: even and odd dims in separate chains
  for (int32_t t = 0; t < n; t += T) {
    __m256 a[R][T][S];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < T; ++j)
#pragma GCC unroll 8
        for (int s = 0; s < S; ++s) a[r][j][s] = _mm256_setzero_ps();
    for (int32_t c = 0; c < d; c += 16)
#pragma GCC unroll 8
      for (int j = 0; j < T; ++j) {
        __m256 ke, ko;
        Rows::widen(k + k_rows[t + j] + c, ke, ko);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const float* qr = q + r * q_stride + c;
          a[r][j][0] = _mm256_fmadd_ps(_mm256_loadu_ps(qr), ke, a[r][j][0]);
          a[r][j][S - 1] = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8), ko, a[r][j][S - 1]);
        }
      }
    if constexpr (S == 2)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int j = 0; j < T; ++j) a[r][j][0] = _mm256_add_ps(a[r][j][0], a[r][j][1]);
    if constexpr (T == 4) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        _mm_storeu_ps(out + r * out_stride + t, hadd8x4(a[r][0][0], a[r][1][0], a[r][2][0], a[r][3][0]));
    } else {  // two rows per reduction: [row r tokens t, t + 1; row r + 1 tokens t, t + 1]
#pragma GCC unroll 8
      for (int r = 0; r < R; r += 2) {
        const int r1 = r + 1 < R ? r + 1 : r;
        const __m128 sums = hadd8x4(a[r][0][0], a[r][1][0], a[r1][0][0], a[r1][1][0]);
        _mm_storel_pi(reinterpret_cast<__m64*>(out + r * out_stride + t), sums);
        if (r1 != r) _mm_storeh_pi(reinterpret_cast<__m64*>(out + r1 * out_stride + t), sums);
      }
    }
  }
}

// acc_r += P_r V over tokens [0, n) for R rows (fp32 probabilities at p + r * kKVBlock, accumulators in even/odd
// order at acc + r * acc_stride) from raw bf16 V rows: each V load and widening serves all R rows, CH 16-dim
// chunks per pass for 2 R CH >= 6 independent FMA chains.
template <int R, int CH, class Rows>
inline void accumulate_pv_chunks(float* acc, int32_t acc_stride, const float* p, const typename Rows::T* v,
                                 const int64_t* v_rows, int32_t n) {
  __m256 e[R][CH], o[R][CH];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int ch = 0; ch < CH; ++ch) {
      e[r][ch] = _mm256_loadu_ps(acc + r * acc_stride + 16 * ch);
      o[r][ch] = _mm256_loadu_ps(acc + r * acc_stride + 16 * ch + 8);
    }
  for (int32_t t = 0; t < n; ++t) {
    __m256 pt[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) pt[r] = _mm256_broadcast_ss(p + r * kKVBlock + t);
#pragma GCC unroll 8
    for (int ch = 0; ch < CH; ++ch) {
      __m256 ve, vo;
      Rows::widen(v + v_rows[t] + 16 * ch, ve, vo);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        e[r][ch] = _mm256_fmadd_ps(pt[r], ve, e[r][ch]);
        o[r][ch] = _mm256_fmadd_ps(pt[r], vo, o[r][ch]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int ch = 0; ch < CH; ++ch) {
      _mm256_storeu_ps(acc + r * acc_stride + 16 * ch, e[r][ch]);
      _mm256_storeu_ps(acc + r * acc_stride + 16 * ch + 8, o[r][ch]);
    }
}

template <int R, class Rows>
void accumulate_pv_rows_raw(float* acc, int32_t acc_stride, const float* p, const typename Rows::T* v,
                            const int64_t* v_rows, int32_t n, int32_t d) {
  constexpr int CH = R == 1 ? 4 : R == 2 ? 2 : 1;
  int32_t c = 0;
  for (; c + 16 * CH <= d; c += 16 * CH) accumulate_pv_chunks<R, CH, Rows>(acc + c, acc_stride, p, v + c, v_rows, n);
  for (; c < d; c += 16) accumulate_pv_chunks<R, 1, Rows>(acc + c, acc_stride, p, v + c, v_rows, n);
}

// Calls f.template operator()<Rows>() with the format of the raw rows: fp8 read directly, or bf16.
template <class F>
void with_raw_rows(DType type, bool fp8_direct, F&& f) {
  if (fp8_direct && type == DType::kFloat8E4M3)
    f.template operator()<Fp8Rows<true>>();
  else if (fp8_direct)
    f.template operator()<Fp8Rows<false>>();
  else
    f.template operator()<Bf16Rows>();
}

// A Q row (d a multiple of 16) to the even/odd order of the widened K pairs, in place.
void even_odd_row(float* row, int32_t d) {
  for (int32_t c = 0; c < d; c += 16) {
    float chunk[16];
    std::memcpy(chunk, row + c, sizeof(chunk));
    for (int32_t j = 0; j < 8; ++j) row[c + j] = chunk[2 * j], row[c + 8 + j] = chunk[2 * j + 1];
  }
}

// Back to natural order (see bf16x16_even_odd).
void unpermute_row(const float* permuted, float* out, int32_t d) {
  for (int32_t c = 0; c < d; c += 16)
    for (int32_t j = 0; j < 8; ++j) out[c + 2 * j] = permuted[c + j], out[c + 2 * j + 1] = permuted[c + 8 + j];
}
constexpr bool kRawQ = false;  // score_rows_raw reads fp32 Q rows, already scaled
#else
constexpr bool kRawQ = false;  // no raw paths
#endif

void attend(const AttentionParams& p, const WorkItem& it, int32_t head0, int32_t head1, int32_t row0,
            int32_t row1, float* scratch) {
  const KVParams& kv = p.kv;
  const VariantParams& vp = p.variant;
  const int32_t b = it.request;
  const int32_t qo_start = p.plan->qo_indptr[b], qo_len = p.plan->qo_indptr[b + 1] - qo_start;
  const int32_t kv_len = p.plan->kv_len[b];
  const int32_t group = p.num_qo_heads / p.num_kv_heads;
  const int32_t dqk = p.head_dim_qk, dvo = p.head_dim_vo;
  const int32_t dqk16 = padded(dqk), dvo16 = padded(dvo);
  const int32_t per_head = row1 - row0;
  const int32_t rows = (head1 - head0) * per_head;

  float* q = scratch;
  float* acc = q + kMaxRows * kMaxHeadDim;
  float* kb = acc + kMaxRows * kMaxHeadDim;
  float* vb = kb + kKVBlock * kMaxHeadDim;
  float* s = vb + kKVBlock * kMaxHeadDim;
  float* freqs = s + kMaxRows * kKVBlock;
  float m[kMaxRows], l[kMaxRows];
  int32_t lo[kMaxRows], hi[kMaxRows], tok[kMaxRows], head[kMaxRows], qpos[kMaxRows];
  bool active[kMaxRows];
  for (int32_t t = 0; t < kKVBlock; ++t) {
    std::fill(kb + t * dqk16 + dqk, kb + (t + 1) * dqk16, 0.f);
    std::fill(vb + t * dvo16 + dvo, vb + (t + 1) * dvo16, 0.f);
  }

  const bool rope = vp.rope.enabled != 0;
  [[maybe_unused]] const bool fp8 = kv.dtype == DType::kFloat8E4M3 || kv.dtype == DType::kFloat8E5M2;
#if defined(__AVX512BF16__)
  // bf16 Q and K without RoPE: dot products on the raw bf16 values (see score_rows_bf16).
  // bf16 Q and V: P V on the raw values too, with probabilities rounded to bf16, the input precision (as
  // tensor-core kernels hold them; the same-precision baseline of the tests rounds them likewise).
  // Only for few rows per head (decode): the bf16 probabilities are packed per row and block, which a prefill
  // tile's many rows do better through one converted fp32 block.
  // fp8 K/V with bf16 Q (decode without RoPE): each block's fp8 rows are converted to bf16 in scratch, exactly (every
  // e4m3 and e5m2 value is a bf16 value), and take the same two paths.
  const bool fp8_as_bf16 = fp8 && p.q_dtype == DType::kBFloat16 && !rope && dqk % 32 == 0 && dvo % 32 == 0 &&
                           per_head <= kMaxRawPvRows;
  const bool raw_bf16 =
      (kv.dtype == DType::kBFloat16 && p.q_dtype == DType::kBFloat16 && !rope && dqk % 32 == 0) || fp8_as_bf16;
  const bool raw_pv =
      (kv.dtype == DType::kBFloat16 && p.q_dtype == DType::kBFloat16 && dvo % 32 == 0 && per_head <= kMaxRawPvRows) ||
      fp8_as_bf16;
#elif defined(ATTNFORGE_CPU_AVX2)
  // The same paths in fp32 FMAs: Q is converted to fp32 (any type; scaled, in even/odd order) and the
  // probabilities stay fp32, so any number of rows per head takes them (prefill tiles too) and head dims need only
  // be multiples of 16. RoPE rotates K, so it keeps the converted K block; V is raw either way.
  // fp8 K/V: read by the kernels directly where a head has few rows (decode: one or two row groups decode each
  // code), else widened to bf16 in scratch once per block and head (prefill tiles: shared by many row groups).
  const bool fp8_raw = fp8 && !rope && dqk % 16 == 0 && dvo % 16 == 0;
  const bool fp8_direct = fp8_raw && per_head <= kMaxRawPvRows;
  const bool fp8_as_bf16 = fp8_raw && !fp8_direct;
  const bool raw_bf16 = (kv.dtype == DType::kBFloat16 && !rope && dqk % 16 == 0) || fp8_raw;
  const bool raw_pv = (kv.dtype == DType::kBFloat16 && dvo % 16 == 0) || fp8_raw;
#else
  [[maybe_unused]] const bool raw_bf16 = false, raw_pv = false, fp8_as_bf16 = false;
#endif
  // Sources of the raw paths: the cache itself, or the block's rows converted from fp8 (in the K and V block buffers).
  uint16_t* kb16 = reinterpret_cast<uint16_t*>(kb);
  uint16_t* vb16 = reinterpret_cast<uint16_t*>(vb);
  [[maybe_unused]] const uint16_t* k_src = fp8_as_bf16 ? kb16 : static_cast<const uint16_t*>(kv.k);
  [[maybe_unused]] const uint16_t* v_src = fp8_as_bf16 ? vb16 : static_cast<const uint16_t*>(kv.v);
#if defined(ATTNFORGE_CPU_AVX2)
  const void* k_raw = fp8_direct ? kv.k : k_src;
  const void* v_raw = fp8_direct ? kv.v : v_src;
#endif
  if (rope)
    for (int32_t i = 0; i < vp.rope.rotary_dim / 2; ++i) freqs[i] = rope_frequency(vp.rope, i);
  const int32_t pos_offset = rope && vp.rope.pos_offset ? vp.rope.pos_offset[b] : 0;
  const float q_scale = vp.sm_scale * kv.k_scale;

  int32_t range_lo = kv_len, range_hi = 0;
  for (int32_t r = 0; r < rows; ++r) {
    const int32_t rr = row0 + r % per_head;
    tok[r] = it.qo_begin + rr / group;
    head[r] = (head0 + r / per_head) * group + rr % group;
    qpos[r] = query_position(tok[r], qo_len, kv_len);
    float* qr = q + r * dqk16;
    const int64_t q_offset = (qo_start + tok[r]) * p.q_stride_token + head[r] * p.q_stride_head;
    if (raw_bf16 && kRawQ) {
      // The row's raw bf16 values, in the scratch row (scores are scaled by q_scale afterwards).
      std::memcpy(qr, static_cast<const uint16_t*>(p.q) + q_offset, dqk * sizeof(uint16_t));
    } else {
      load_row(p.q, p.q_dtype, q_offset, dqk, 1.f, qr);
      if (rope) rope_rotate(vp.rope, freqs, qr, qpos[r] + pos_offset);
      scale_row(qr, q_scale, dqk);
      std::fill(qr + dqk, qr + dqk16, 0.f);
#if defined(ATTNFORGE_CPU_AVX2)
      if (raw_bf16) even_odd_row(qr, dqk);
#endif
    }
    allowed_kv_range(vp, qpos[r], kv_len, &lo[r], &hi[r]);
    lo[r] = std::max(lo[r], it.kv_begin);
    hi[r] = std::max(lo[r], std::min(hi[r], it.kv_end));
    if (lo[r] < hi[r]) {
      range_lo = std::min(range_lo, lo[r]);
      range_hi = std::max(range_hi, hi[r]);
    }
    m[r] = kNegInf;
    l[r] = 0.f;
    std::fill(acc + r * dvo16, acc + (r + 1) * dvo16, 0.f);
  }

  // Element offsets of each token of a block in K and V (head 0): one page lookup per token, shared by all
  // heads of the task. (Tasks read whole pages in address order, which the hardware prefetchers follow:
  // software prefetching measured no gain once tasks spanned all KV heads.)
  int64_t k_base[kKVBlock], v_base[kKVBlock];

  const bool transform = vp.soft_cap > 0.f || vp.alibi_slopes != nullptr;
  for (int32_t j0 = range_lo; j0 < range_hi; j0 += kKVBlock) {
    const int32_t n = std::min(kKVBlock, range_hi - j0);
    const int32_t n4 = (n + 3) / 4 * 4;  // score_row works in fours; the extra scores are discarded
    for (int32_t t = 0; t < n; ++t) {
      k_base[t] = kv_k_offset(kv, b, j0 + t, 0);
      v_base[t] = kv_v_offset(kv, b, j0 + t, 0);
    }
    // Software prefetch: a head's K and V rows (64-512 bytes) sit apart in every token's stretch of all heads, too
    // sparse for the hardware prefetchers, and P V stalled on its V loads (perf; fp8, on its conversions). While
    // head kh of this block computes, its V rows of this block and its K and V rows of the next block are requested
    // (prefetcht2: prefetcht0 and prefetchnta measured slower). docs/perf-notes.md, CPU batch decode v9.
    const int32_t j1 = j0 + kKVBlock, n1 = std::min(kKVBlock, range_hi - j1);
    int64_t k_next[kKVBlock], v_next[kKVBlock];
    for (int32_t t = 0; t < n1; ++t) {
      k_next[t] = kv_k_offset(kv, b, j1 + t, 0);
      v_next[t] = kv_v_offset(kv, b, j1 + t, 0);
    }
    const int32_t eb = dtype_bytes(kv.dtype), k_row_bytes = dqk * eb, v_row_bytes = dvo * eb;
    auto prefetch_row = [](const void* base, int64_t element, int32_t elem_bytes, int32_t bytes) {
      const char* row = static_cast<const char*>(base) + element * elem_bytes;
      for (int32_t c = 0; c < bytes; c += 64) __builtin_prefetch(row + c, 0, 1);
    };
#if defined(ATTNFORGE_CPU_RAW_KV)
    // Raw bf16 K (v11): the scores of every head are computed first, token-major (four tokens, then every head's
    // rows against them), so K is read in address order through each page (a token's rows of all heads are
    // adjacent in NHD), and the next block's K rows are requested four tokens at a time between the dot products
    // instead of in bursts per head. docs/perf-notes.md, CPU batch decode v11.
    // fp8 K takes the same order: each head's four rows are widened to bf16 in scratch just before their scores.
    if (raw_bf16)
      for (int32_t t = 0; t < n4; t += 4)
        for (int32_t kh = head0; kh < head1; ++kh) {
          for (int32_t u = t; u < std::min(t + 4, n1); ++u)
            prefetch_row(kv.k, k_next[u] + kh * kv.k_stride_head, eb, k_row_bytes);
          const int32_t r_begin = (kh - head0) * per_head, r_end = r_begin + per_head;
          int64_t k_rows[4];
          for (int j = 0; j < 4; ++j) {
            const int64_t row = k_base[std::min(t + j, n - 1)] + kh * kv.k_stride_head;
            if (fp8_as_bf16) {
              fp8_row_to_bf16(static_cast<const uint8_t*>(kv.k) + row, kv.dtype, dqk, kb16 + j * dqk);
              k_rows[j] = j * dqk;
            } else {
              k_rows[j] = row;
            }
          }
          for_row_groups(r_begin, r_end, [&]<int R>(int32_t r) {
#if defined(__AVX512BF16__)
            score_rows_bf16<R>(reinterpret_cast<const uint16_t*>(q + r * dqk16), 2 * dqk16, k_src, k_rows, 4, dqk,
                               s + r * kKVBlock + t, kKVBlock);
#else
            with_raw_rows(kv.dtype, fp8_direct, [&]<class Rows>() {
              score_rows_raw<R, Rows>(q + r * dqk16, dqk16, static_cast<const typename Rows::T*>(k_raw), k_rows, 4, dqk,
                                      s + r * kKVBlock + t, kKVBlock);
            });
#endif
          });
        }
#endif
    for (int32_t kh = head0; kh < head1; ++kh) {
      const int32_t r_begin = (kh - head0) * per_head, r_end = r_begin + per_head;
      for (int32_t t = 0; t < n; ++t) prefetch_row(kv.v, v_base[t] + kh * kv.v_stride_head, eb, v_row_bytes);
      for (int32_t t = 0; t < n1; ++t) {
        if (!raw_bf16) prefetch_row(kv.k, k_next[t] + kh * kv.k_stride_head, eb, k_row_bytes);  // else above
        prefetch_row(kv.v, v_next[t] + kh * kv.v_stride_head, eb, v_row_bytes);
      }
      if (!raw_bf16) {  // (raw bf16 K was scored above, token-major)
        for (int32_t t = 0; t < n; ++t) {
          load_kv_row(kv.k, kv.dtype, k_base[t] + kh * kv.k_stride_head, dqk, kb + t * dqk16);
          if (rope) rope_rotate(vp.rope, freqs, kb + t * dqk16, j0 + t + pos_offset);
        }
        for (int32_t t = n; t < n4; ++t) std::fill(kb + t * dqk16, kb + t * dqk16 + dqk, 0.f);
      }
      bool any = false;
      for (int32_t r = r_begin; r < r_end; ++r) {
        float* sr = s + r * kKVBlock;
        const int32_t t_lo = std::max(lo[r] - j0, 0), t_hi = std::min(hi[r] - j0, n);
        active[r] = t_lo < t_hi;
        if (!active[r]) continue;
        if (!raw_bf16)
          score_row(q + r * dqk16, kb, n4, dqk16, sr);
        else if (kRawQ)
          for (int32_t t = 0; t < kKVBlock; t += kLanes) store16(sr + t, load16(sr + t) * q_scale);
        if (t_lo == 0 && t_hi == kKVBlock && !transform && !vp.custom_mask) {
          // Whole block allowed and no per-logit work: the common case of decode.
        } else {
          for (int32_t t = 0; t < kKVBlock; ++t) {
            if (t < t_lo || t >= t_hi) {
              sr[t] = kNegInf;
              continue;
            }
            if (transform) sr[t] = transform_logit(vp, sr[t], head[r], qpos[r], j0 + t);
            if (vp.custom_mask && !custom_mask_allows(vp, b, tok[r], j0 + t, kv_len)) sr[t] = kNegInf;
          }
        }
        FVec mx = load_vec(sr);
        for (int32_t t = kVecLanes; t < kKVBlock; t += kVecLanes) mx = max_lanes(mx, load_vec(sr + t));
        const float block_max = hmax_vec(mx);
        if (block_max == kNegInf) {
          active[r] = false;
          continue;
        }
        const float m_new = std::max(m[r], block_max);
        const float corr = std::exp(m[r] - m_new);  // 0 when m[r] is -inf
        if (corr != 1.f) {
          l[r] *= corr;
          scale_row(acc + r * dvo16, corr, dvo16);
        }
        FVec sum{};
        for (int32_t t = 0; t < kKVBlock; t += kVecLanes) {
          const FVec e = exp_lanes<FVec, IVec>(load_vec(sr + t) - m_new);
          store_vec(sr + t, e);
          sum += e;
        }
        l[r] += hsum_vec(sum);
        m[r] = m_new;
        any = true;
      }
      if (!any) continue;
#if defined(ATTNFORGE_CPU_RAW_KV)
      if (raw_pv) {
        int64_t v_rows[kKVBlock];
        for (int32_t t = 0; t < n; ++t) {
          if (fp8_as_bf16)
            fp8_row_to_bf16(static_cast<const uint8_t*>(kv.v) + v_base[t] + kh * kv.v_stride_head, kv.dtype, dvo,
                            vb16 + t * dvo);
          v_rows[t] = fp8_as_bf16 ? t * dvo : v_base[t] + kh * kv.v_stride_head;
        }
#if defined(__AVX512BF16__)
        // Each row's 32 probabilities (zeros past n: masked scores) to bf16 pairs in one instruction, rounded to
        // nearest even as float_to_bf16 does; rows that see no key of the block weigh 0. Then P V for the head's
        // rows together, each V load and interleave shared by them.
        static_assert(kKVBlock == 32, "one cvtne2ps_pbh per block");
        uint32_t pairs[kMaxRawPvRows * kKVBlock / 2];
        for (int32_t r = r_begin; r < r_end; ++r) {
          uint32_t* pr = pairs + (r - r_begin) * (kKVBlock / 2);
          const float* sr = s + r * kKVBlock;
          if (active[r])
            _mm512_storeu_si512(pr, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sr + 16), _mm512_loadu_ps(sr)));
          else
            std::fill(pr, pr + kKVBlock / 2, 0u);
        }
        for_row_groups(r_begin, r_end, [&]<int R>(int32_t r) {
          accumulate_pv_rows_bf16<R>(acc + r * dvo16, dvo16, pairs + (r - r_begin) * (kKVBlock / 2), v_src, v_rows, n,
                                     dvo);
        });
#else
        // fp32 probabilities as they are (zeros past n: masked scores); rows that see no key of the block weigh 0
        // (their score rows still hold logits or -inf).
        for (int32_t r = r_begin; r < r_end; ++r)
          if (!active[r]) std::fill(s + r * kKVBlock, s + (r + 1) * kKVBlock, 0.f);
        for_row_groups(r_begin, r_end, [&]<int R>(int32_t r) {
          with_raw_rows(kv.dtype, fp8_direct, [&]<class Rows>() {
            accumulate_pv_rows_raw<R, Rows>(acc + r * dvo16, dvo16, s + r * kKVBlock,
                                            static_cast<const typename Rows::T*>(v_raw), v_rows, n, dvo);
          });
        });
#endif
        continue;
      }
#endif
      for (int32_t t = 0; t < n; ++t)
        load_kv_row(kv.v, kv.dtype, v_base[t] + kh * kv.v_stride_head, dvo, vb + t * dvo16);
      for (int32_t r = r_begin; r < r_end; ++r) {
        if (!active[r]) continue;
        const float* sr = s + r * kKVBlock;
        float* ar = acc + r * dvo16;
        accumulate_pv(ar, sr, vb, n, dvo16);
      }
    }
  }

  for (int32_t r = 0; r < rows; ++r) {
    float* ar = acc + r * dvo16;
#if defined(ATTNFORGE_CPU_RAW_KV)
    if (raw_pv) {
      unpermute_row(ar, kb, dvo);  // the K block buffer is free now
      ar = kb;
    }
#endif
    scale_row(ar, l[r] > 0.f ? kv.v_scale / l[r] : 0.f, dvo);
    const float lse_nat = l[r] > 0.f ? m[r] + std::log(l[r]) : kNegInf;
    write_row(p, it, tok[r], head[r], ar, lse_nat);
  }
}

// Combines the partial states of one merge item for one head into the output.
void merge_item(const AttentionParams& p, const MergeItem& mi, int32_t h, float* o) {
  const int32_t dvo = p.head_dim_vo;
  const PlanView& plan = *p.plan;
  const int32_t qo_start = plan.qo_indptr[mi.request];
  for (int32_t tok = mi.qo_begin; tok < mi.qo_end; ++tok) {
    std::fill(o, o + dvo, 0.f);
    float lse = kNegInf;
    for (int32_t k = 0; k < mi.num_items; ++k) {
      const int64_t row = static_cast<int64_t>(plan.items[mi.first_item + k].partial_row) + (tok - mi.qo_begin);
      const float lse_k = plan.partial_lse[row * p.num_qo_heads + h];
      float wa, wb;
      lse = merge_weights(lse, lse_k, &wa, &wb);
      const float* part = plan.partial_o + (row * p.num_qo_heads + h) * dvo;
#pragma omp simd
      for (int32_t d = 0; d < dvo; ++d) o[d] = wa * o[d] + wb * part[d];
    }
    if (p.variant.sinks) scale_row(o, apply_sink(p.variant, h, &lse), dvo);
    store_row(p.o, p.o_dtype, (qo_start + tok) * p.o_stride_token + h * p.o_stride_head, dvo, o);
    if (p.lse) p.lse[(qo_start + tok) * p.lse_stride_token + h] = lse;
  }
}

}  // namespace

void attention(const AttentionParams& p) {
  ThreadPool& pool = ThreadPool::instance();
  const int32_t group = p.num_qo_heads / p.num_kv_heads;
  int32_t max_rows = 0;
  const PlanView& plan = *p.plan;
  const int32_t num_items = plan.num_items, num_merges = plan.num_merges;
  for (int32_t i = 0; i < num_items; ++i)
    max_rows = std::max(max_rows, (plan.items[i].qo_end - plan.items[i].qo_begin) * group);
  // Split each item's rows into tasks: several KV heads per task when a head's rows are few (decode), blocks
  // of one head's rows when they are many (prefill tiles of large groups).
  const int32_t row_blocks = (max_rows + kMaxRows - 1) / kMaxRows;
  const int32_t heads_per_task = row_blocks > 1 || max_rows == 0 ? 1 : std::max(1, kMaxRows / max_rows);
  const int32_t head_tasks = (p.num_kv_heads + heads_per_task - 1) / heads_per_task;
  const int64_t per_item = static_cast<int64_t>(head_tasks) * row_blocks;
  pool.parallel_for(num_items * per_item, [&](int64_t task, int32_t worker) {
    const WorkItem& it = plan.items[task / per_item];
    const int32_t head0 = static_cast<int32_t>((task % per_item) / row_blocks) * heads_per_task;
    const int32_t head1 = std::min(p.num_kv_heads, head0 + heads_per_task);
    const int32_t rb = static_cast<int32_t>(task % row_blocks);
    const int32_t rows = (it.qo_end - it.qo_begin) * group;
    const int32_t row0 = rb * kMaxRows, row1 = std::min(rows, row0 + kMaxRows);
    if (row0 < row1) attend(p, it, head0, head1, row0, row1, pool.scratch(worker));
  });
  if (num_merges > 0) {
    pool.parallel_for(static_cast<int64_t>(num_merges) * p.num_qo_heads, [&](int64_t task, int32_t worker) {
      merge_item(p, plan.merges[task / p.num_qo_heads], static_cast<int32_t>(task % p.num_qo_heads),
                 pool.scratch(worker));
    });
  }
}

}  // namespace attnforge::cpu
