#include "ceilings.h"

#include <fmt/format.h>
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

namespace attnforge::cli {

namespace {

int32_t hardware_threads() { return static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency())); }

// Runs fn(chunk, thread) for every chunk in [0, chunks) on `threads` fresh std::threads that take chunks from a
// shared counter, so a thread slowed by another process on its core does less of the work rather than holding up
// the pass. Starting threads costs tens of microseconds against passes of tens of milliseconds: cheaper in code
// than a pool and invisible in the median.
template <typename Fn>
void for_chunks(int32_t threads, int64_t chunks, const Fn& fn) {
  std::atomic<int64_t> next{0};
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads));
  for (int32_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (int64_t c = next++; c < chunks; c = next++) fn(c, t);
    });
  for (std::thread& th : pool) th.join();
}

// Sums n floats, n a multiple of kSumLanes. kSumLanes independent partial sums make the loop a plain
// element-wise add that GCC vectorizes without -ffast-math (a single accumulator would be a serial dependency
// chain, bound by add latency, not memory).
constexpr size_t kSumLanes = 32;
float sum_floats(const float* p, size_t n) {
  float acc[kSumLanes] = {};
  for (size_t i = 0; i < n; i += kSumLanes)
    for (size_t j = 0; j < kSumLanes; ++j) acc[j] += p[i + j];
  float total = 0.f;
  for (float a : acc) total += a;
  return total;
}

// Register block of the GEMM: kMR rows of A times kNR columns of B accumulate in kMR x kNR / kVecFloats vector
// registers, sized to leave room for the B row and the A broadcast in the register file (AVX-512: 16 of 32 zmm;
// AVX2: 12 of 16 ymm; SSE: 8 of 16), and enough independent FMAs (>= latency x FMA ports) to keep the FMA units busy.
#if defined(__AVX512F__)
constexpr int32_t kVecFloats = 16;
constexpr int32_t kMR = 8;
#elif defined(__AVX2__) && defined(__FMA__)
#define ATTNFORGE_GEMM_AVX2 1
constexpr int32_t kVecFloats = 8;
constexpr int32_t kMR = 6;
#elif defined(__AVX__)
constexpr int32_t kVecFloats = 8;
constexpr int32_t kMR = 4;
#else
constexpr int32_t kVecFloats = 4;
constexpr int32_t kMR = 4;
#endif
constexpr int32_t kNR = 2 * kVecFloats;
constexpr int32_t kGemmDim = 1024;  // M = N = K
constexpr int64_t kTaskRows = 64;   // rows of C per task: 16 tasks, enough to even out two threads
// The last block of a task's rows, where kMR does not divide them (AVX2: 64 = 10 x 6 + 4).
constexpr int32_t kTailMR = kTaskRows % kMR == 0 ? kMR : kTaskRows % kMR;
// K is cut so a packed B slice (kKC x kNR floats: 32 KiB with AVX-512) stays in L1/L2 while every row block of a
// thread streams past it; 256 measured best of 64 to 512 on the 2-core Zen 4 this was tuned on.
constexpr int32_t kKC = 256;
static_assert(kGemmDim % kTaskRows == 0 && kGemmDim % kNR == 0 && kGemmDim % kKC == 0);

// c[MR][kNR] (row stride ldc) = (accumulate ? c : 0) + a[MR][kc] (row stride lda) x bp[kc][kNR] (packed).
#if defined(ATTNFORGE_GEMM_AVX2)
// In intrinsics: GCC 12 vectorized the portable loop below across k with permutes on AVX2 (6-7 GFLOP/s on a Zen 3
// core pair, against numpy's 108). Per k: two B loads and MR broadcasts of A feed 2 MR independent FMAs.
constexpr const char* kGemmKernelNote = " in AVX2 FMA intrinsics";
template <int32_t MR>
void micro_kernel(const float* __restrict a, int64_t lda, const float* __restrict bp, int32_t kc, float* __restrict c,
                  int64_t ldc, bool accumulate) {
  __m256 acc[MR][2];
  for (int32_t r = 0; r < MR; ++r)
    for (int32_t j = 0; j < 2; ++j) acc[r][j] = accumulate ? _mm256_loadu_ps(c + r * ldc + 8 * j) : _mm256_setzero_ps();
  for (int32_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(bp + k * kNR), b1 = _mm256_loadu_ps(bp + k * kNR + 8);
    for (int32_t r = 0; r < MR; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda + k);
      acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
    }
  }
  for (int32_t r = 0; r < MR; ++r)
    for (int32_t j = 0; j < 2; ++j) _mm256_storeu_ps(c + r * ldc + 8 * j, acc[r][j]);
}
#else
// GCC vectorizes the column loop by itself; the row loop must be unrolled too (the pragma: GCC does not do it on
// its own here), or acc[r] stays indexed by a variable and lives on the stack instead of in MR x 2 registers.
constexpr const char* kGemmKernelNote = "";
template <int32_t MR>
void micro_kernel(const float* __restrict a, int64_t lda, const float* __restrict bp, int32_t kc, float* __restrict c,
                  int64_t ldc, bool accumulate) {
  float acc[MR][kNR] = {};
  for (int32_t k = 0; k < kc; ++k) {
    const float* b = bp + static_cast<int64_t>(k) * kNR;
#pragma GCC unroll 16
    for (int32_t r = 0; r < MR; ++r) {
      const float x = a[r * lda + k];
      for (int32_t j = 0; j < kNR; ++j) acc[r][j] += x * b[j];
    }
  }
  for (int32_t r = 0; r < MR; ++r)
    for (int32_t j = 0; j < kNR; ++j) c[r * ldc + j] = (accumulate ? c[r * ldc + j] : 0.f) + acc[r][j];
}
#endif

}  // namespace

Ceiling measure_read_bandwidth(int32_t passes) {
  constexpr size_t kBytes = size_t{1} << 30;
  constexpr size_t kChunkFloats = size_t{4} << 20;  // 16 MiB
  constexpr int64_t kChunks = kBytes / sizeof(float) / kChunkFloats;
  static_assert(kChunkFloats % kSumLanes == 0);
  const int32_t threads = hardware_threads();
  const std::unique_ptr<float[]> data(new float[kChunks * kChunkFloats]);
  // Written once before timing, so every page is mapped and no pass pays for page faults.
  for_chunks(threads, kChunks, [&](int64_t c, int32_t) {
    float* p = data.get() + c * kChunkFloats;
    for (size_t i = 0; i < kChunkFloats; ++i) p[i] = 1.f + static_cast<float>(i % 7);
  });
  std::vector<double> sums(static_cast<size_t>(threads));
  const Measurement m = measure(static_cast<double>(kBytes), 1, passes, [&](int32_t) {
    for_chunks(threads, kChunks,
               [&](int64_t c, int32_t t) { sums[t] += sum_floats(data.get() + c * kChunkFloats, kChunkFloats); });
  });
  // Using the sums keeps the compiler from dropping the reads; every element is >= 1, so a zero means a bug.
  double total = 0;
  for (double s : sums) total += s;
  if (!(total > 0)) throw std::runtime_error("streaming-read ceiling: the sum of the buffer is not positive");
  return {"streaming read",
          fmt::format("{} threads summing 16 MiB chunks of a 1 GiB fp32 buffer, median of {} passes", threads, passes),
          m};
}

Ceiling measure_fp32_gemm(int32_t passes) {
  constexpr int64_t n = kGemmDim;
  constexpr int64_t kPanels = n / kNR;
  const int32_t threads = hardware_threads();
  std::vector<float> a(n * n), b(n * n), c(n * n), bp(n * n);
  for (int64_t i = 0; i < n * n; ++i) {
    a[i] = static_cast<float>(i % 13) / 13.f - 0.5f;
    b[i] = static_cast<float>(i % 11) / 11.f - 0.5f;
  }
  const Measurement m = measure(2.0 * n * n * n, 1, passes, [&](int32_t) {
    // Packing B into column panels [panel][k][kNR] is part of the product, as in any GEMM, so it is timed.
    for_chunks(threads, kPanels, [&](int64_t p, int32_t) {
      for (int64_t k = 0; k < n; ++k) std::copy_n(&b[k * n + p * kNR], kNR, &bp[(p * n + k) * kNR]);
    });
    for_chunks(threads, n / kTaskRows, [&](int64_t task, int32_t) {
      for (int64_t k0 = 0; k0 < n; k0 += kKC)
        for (int64_t p = 0; p < kPanels; ++p)
          for (int64_t i = task * kTaskRows, end = i + kTaskRows; i < end; i += kMR) {
            const float* ai = &a[i * n + k0];
            const float* bk = &bp[(p * n + k0) * kNR];
            float* ci = &c[i * n + p * kNR];
            if (end - i >= kMR)
              micro_kernel<kMR>(ai, n, bk, kKC, ci, n, k0 > 0);
            else
              micro_kernel<kTailMR>(ai, n, bk, kKC, ci, n, k0 > 0);
          }
    });
  });
  // A ceiling computed by a broken loop would flatter every case measured against it: spot-check C in double.
  for (int64_t i : {int64_t{0}, n / 3, n - 1})
    for (int64_t j : {int64_t{0}, n / 2 + 5, n - 1}) {
      double want = 0;
      for (int64_t k = 0; k < n; ++k) want += static_cast<double>(a[i * n + k]) * b[k * n + j];
      if (std::fabs(c[i * n + j] - want) > 1e-3 * (1 + std::fabs(want)))
        throw std::runtime_error(fmt::format("fp32 GEMM ceiling: C[{}][{}] = {} but the float64 product is {}", i, j,
                                             c[i * n + j], want));
    }
  return {"fp32 gemm",
          fmt::format("attnforge's own fp32 GEMM loop ({}x{} register block{}, B packed), C = A x B of {}^3 on {} "
                      "threads, median of {} passes; not a tuned BLAS, so compute percentages are against this loop",
                      kMR, kNR, kGemmKernelNote, n, threads, passes),
          m};
}

}  // namespace attnforge::cli
