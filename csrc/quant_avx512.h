// AVX-512 direct kernels for the two formats of the bundled model (Q4_1 layers, Q8_0 tied head)
// with fp32 x, used by quant_gemm.cpp's gemm for M <= 8-row tiles when the build has AVX-512F/BW
// (the build is -march=native and keyed on the CPU's flags, so this is the CPU's own feature set).
// bf16 x (a bf16 model, the default) takes quant_bf16.h's kernels where the CPU has AVX512-BF16.
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
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define RLQ_AVX512 1
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

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

// block(bi, slot) for bi < nblk, NA blocks a round, block bi + a into accumulator slot a (a
// compile-time constant: with a run-time index the accumulators lived on the stack, and the
// store-to-load forwarding of each block's FMA was most of a row's time)
template <int NA, class Block>
inline void for_blocks(int64_t nblk, Block&& block) {
  int64_t bi = 0;
  for (; bi + NA <= nblk; bi += NA) {
    block(bi, std::integral_constant<int, 0>{});
    if constexpr (NA > 1) block(bi + 1, std::integral_constant<int, 1>{});
    if constexpr (NA > 2) block(bi + 2, std::integral_constant<int, 2>{});
    if constexpr (NA > 3) block(bi + 3, std::integral_constant<int, 3>{});
  }
  for (; bi < nblk; ++bi) block(bi, std::integral_constant<int, 0>{});
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

// A W row's block scales as fp32, converted before its dot products: dd[b] = d of block b and,
// for formats with a min, mm[b] = its m. Converting them inside the block loop (two scalar fp16
// conversions a block, on the FMA chain's critical path) cost ~20% of the Q4_1 decode GEMV; the
// values are the same, so the results are bit-identical. Rows of more than kMaxRowBlocks blocks
// (K > 32768) convert in the loop as before.
constexpr int64_t kMaxRowBlocks = 1024;

template <class F>
inline void row_scales(const uint8_t* w, int64_t nblk, float* dd, float* mm) {
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const uint8_t* b = w + bi * F::BYTES;
    if constexpr (F::kMin) {  // d and m are adjacent fp16s: one 2-wide conversion
      uint32_t u;
      std::memcpy(&u, b, 4);
      const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(u)));
      dd[bi] = _mm_cvtss_f32(f);
      mm[bi] = _mm_cvtss_f32(_mm_movehdup_ps(f));
    } else {
      dd[bi] = f16(b);
    }
  }
}

// The m terms of one x row, sum_b mm[b] * xs[b], in 4 partial sums: lane a of a 4-wide FMA takes
// blocks a, a + 4, ... (for MB = 1 of the fp32 kernel, exactly the scalar chain macc[a] of
// for_blocks<4>'s slot a); the tail blocks then go to sum 0 in order.
inline void m_terms4(const float* mm, const float* xs, int64_t nblk, float macc[4]) {
  __m128 v = _mm_setzero_ps();
  int64_t bi = 0;
  for (; bi + 4 <= nblk; bi += 4) v = _mm_fmadd_ps(_mm_loadu_ps(mm + bi), _mm_loadu_ps(xs + bi), v);
  _mm_storeu_ps(macc, v);
  for (; bi < nblk; ++bi) macc[0] = __builtin_fmaf(mm[bi], xs[bi], macc[0]);
}

// y[m * ldy] for m < MB: x rows m (x + m * K, block sums xs + m * nblk) against the W row at w.
// One row at a time, so the weights stream sequentially (rows of a task are contiguous): running
// 4 rows interleaved was 1.4x faster with the weights in L2, but 2.8x slower on SmolLM2's 30 MB
// head, which streams from memory (the prefetchers lost the pattern). NA accumulators per x row
// (and as many scalar sums of the m terms) take blocks in turn, so the FMA latency (4 cycles per
// block on one chain) does not bound a single row.
// Pre: the row's scales come from row_scales (dd, mm) instead of being converted per block.
template <class F, int MB, bool Pre>
inline void row_dot512_impl(const float* x, const float* xs, int64_t K, const uint8_t* w, float* y,
                            int64_t ldy, const float* dd, const float* mm) {
  constexpr int NA = MB == 1 ? 4 : (MB == 2 ? 2 : 1);
  constexpr bool kVecM = Pre && F::kMin && MB == 1;  // the m terms by m_terms4, after the loop
  const int64_t nblk = K / 32;
  __m512 acc[MB][NA];
  float macc[MB][NA];
  for (int m = 0; m < MB; ++m)
    for (int a = 0; a < NA; ++a) {
      acc[m][a] = _mm512_setzero_ps();
      macc[m][a] = 0.f;
    }
  auto block = [&](int64_t bi, auto slot) {
    constexpr int a = decltype(slot)::value;
    const uint8_t* b = w + bi * F::BYTES;
    __m512 lo, hi;
    F::load(b, lo, hi);
    const __m512 d = _mm512_set1_ps(Pre ? dd[bi] : f16(b));
    [[maybe_unused]] const float mn = F::kMin && !kVecM ? (Pre ? mm[bi] : f16(b + 2)) : 0.f;
    for (int m = 0; m < MB; ++m) {
      const float* xk = x + m * K + bi * 32;
      const __m512 s = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xk + 16),
                                       _mm512_mul_ps(lo, _mm512_loadu_ps(xk)));
      acc[m][a] = _mm512_fmadd_ps(s, d, acc[m][a]);
      if constexpr (F::kMin && !kVecM)
        macc[m][a] = __builtin_fmaf(mn, xs[m * nblk + bi], macc[m][a]);
    }
  };
  for_blocks<NA>(nblk, block);
  if constexpr (kVecM) m_terms4(mm, xs, nblk, macc[0]);
  for (int m = 0; m < MB; ++m) {
    __m512 s = acc[m][0];
    float ms = macc[m][0];
    for (int a = 1; a < NA; ++a) {
      s = _mm512_add_ps(s, acc[m][a]);
      ms += macc[m][a];
    }
    y[m * ldy] = _mm512_reduce_add_ps(s) + ms;
  }
}

template <class F, int MB>
inline void row_dot512(const float* x, const float* xs, int64_t K, const uint8_t* w, float* y,
                       int64_t ldy) {
  const int64_t nblk = K / 32;
  if (nblk > kMaxRowBlocks) return row_dot512_impl<F, MB, false>(x, xs, K, w, y, ldy, nullptr, nullptr);
  alignas(64) float dd[kMaxRowBlocks], mm[F::kMin ? kMaxRowBlocks : 1];
  row_scales<F>(w, nblk, dd, mm);
  row_dot512_impl<F, MB, true>(x, xs, K, w, y, ldy, dd, mm);
}

// W rows [n0, n1) against x rows [m0, m0 + MB), one after another.
template <class F, int MB>
inline void rows512(const float* x, const float* xs, int64_t K, const uint8_t* w, int64_t n0,
                    int64_t n1, float* y, int64_t N) {
  const int64_t row_bytes = K / 32 * F::BYTES;
  for (int64_t n = n0; n < n1; ++n) row_dot512<F, MB>(x, xs, K, w + n * row_bytes, y + n, N);
}

}  // namespace radixlm_quant
#endif
