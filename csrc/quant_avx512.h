// AVX-512 direct kernels for the two formats of the bundled model (Q4_1 layers, Q8_0 tied head),
// used by quant_gemm.cpp's gemm for M <= 8-row tiles when the build has AVX-512F/BW (the build is
// -march=native and keyed on the CPU's flags, so this is the CPU's own feature set).
//
// Why not the generic row_dot with 16 lanes: there each block is dequantized (int -> float, then
// w = d * q + m) before the FMA with x, and that dequantize is most of a decode GEMV's work on
// this model (~90 MB of weights, far from the memory roofline on 2 cores). Here the scales are
// factored out of the block's dot product:
//   sum_i (d q_i + m) x_i = d * (sum_i q_i x_i) + m * (sum_i x_i)
// The block sums of x are computed once per call and shared by every W row, so per 32 values a
// block costs 2 int -> float conversions, 2 FMAs with x and 1 FMA by d (vs 4 + 4 + 4 in AVX2).
// The result differs from "dequantize, then fp32 matmul" by rounding only (the sums are exact
// products summed in fp32, then scaled once): the same fp32-summation tolerance as row_dot
// (tests/unit/test_quant_gemm.py). `dequant` and the tiled / chunked paths are unchanged.
//
// R W rows run together (their chains interleave: one block's d-FMA has a 4-cycle latency, and
// a single row's chain would wait on it), each x load is shared by the R rows.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define RLQ_AVX512 1
#include <immintrin.h>

#include <cstdint>

#include "quant_formats.h"

namespace radixlm_quant {

// xs[m * nblk + b] = sum of x row m's 32 values of block b (nblk = K / 32)
inline void block_sums(const float* x, int64_t M, int64_t K, float* xs) {
  const int64_t nblk = K / 32;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nblk; ++b) {
      const float* p = x + m * K + b * 32;
      xs[m * nblk + b] =
          _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)));
    }
}

// The 32 quants of a block as two 16-float vectors (values 0..31 in order).
struct Q4_1x16 {
  static constexpr int BYTES = 20;
  static constexpr bool kMin = true;  // w = d * q + m
  static void load(const uint8_t* b, __m512& lo, __m512& hi) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i mask = _mm_set1_epi8(0x0F);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask)));
  }
};

struct Q8_0x16 {
  static constexpr int BYTES = 34;
  static constexpr bool kMin = false;  // w = d * q
  static void load(const uint8_t* b, __m512& lo, __m512& hi) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18))));
  }
};

// y[m * ldy + r] for m < MB, r < R: x rows m (x + m * K, block sums xs + m * nblk) against the R
// consecutive W rows at w (row_bytes apart).
template <class F, int MB, int R>
inline void rows_dot512(const float* x, const float* xs, int64_t K, const uint8_t* w,
                        int64_t row_bytes, float* y, int64_t ldy) {
  const int64_t nblk = K / 32;
  __m512 acc[MB][R];
  float macc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      acc[m][r] = _mm512_setzero_ps();
      macc[m][r] = 0.f;
    }
  for (int64_t bi = 0; bi < nblk; ++bi) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = w + r * row_bytes + bi * F::BYTES;
      __m512 lo, hi;
      F::load(b, lo, hi);
      const __m512 d = _mm512_set1_ps(f16(b));
      [[maybe_unused]] const float mn = F::kMin ? f16(b + 2) : 0.f;
      for (int m = 0; m < MB; ++m) {
        const float* xk = x + m * K + bi * 32;
        const __m512 s = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xk + 16),
                                         _mm512_mul_ps(lo, _mm512_loadu_ps(xk)));
        acc[m][r] = _mm512_fmadd_ps(s, d, acc[m][r]);
        if constexpr (F::kMin) macc[m][r] = __builtin_fmaf(mn, xs[m * nblk + bi], macc[m][r]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + r] = _mm512_reduce_add_ps(acc[m][r]) + macc[m][r];
}

// W rows [n0, n1) against x rows [m0, m0 + MB): R rows at a time, then the remainder one by one.
template <class F, int MB>
inline void rows512(const float* x, const float* xs, int64_t K, const uint8_t* w, int64_t n0,
                    int64_t n1, float* y, int64_t N) {
  constexpr int R = MB == 1 ? 4 : (MB <= 4 ? 2 : 1);
  const int64_t row_bytes = K / 32 * F::BYTES;
  int64_t n = n0;
  for (; n + R <= n1; n += R) rows_dot512<F, MB, R>(x, xs, K, w + n * row_bytes, row_bytes, y + n, N);
  for (; n < n1; ++n) rows_dot512<F, MB, 1>(x, xs, K, w + n * row_bytes, row_bytes, y + n, N);
}

}  // namespace radixlm_quant
#endif
