// Q4_1 and Q8_0 against bf16 x (a bf16 model's activations, the bundled GGUF's layers and tied
// head) where the CPU has AVX512-BF16: the direct (few-row) kernels of quant_direct.h's Bf16Job.
//
// A block's 32 quants become bf16 values (exact: small integers; Q4_1's by one table lookup), and
// VDPBF16PS multiplies them with x's bf16 values 32 at a time. Each product is exact in fp32
// (8-bit x 8-bit significands) and they are summed in fp32, so this is the same "exact products,
// fp32 sums" as the fp32 kernels (quant_avx512.h), within test_quant_gemm's tolerance of
// "dequantize, then fp32 matmul". (VDPBF16PS treats bf16 denormals, |x| < 1.2e-38, as 0: far
// below the fp32 sums' error.) With the block scales factored out:
//   sum_i (d q_i + m) x_i = d * (sum_i q_i x_i) + m * (sum_i x_i)
// per block and x row one VDPBF16PS and one FMA by d; the m terms are a dot product of the W
// row's m's with x's block sums.
//
// Work goes in groups of 16 W rows (group_bf16), so that what is per (x row, W row) rather than
// per block is vectorized across the group: the 16 accumulators' horizontal sums (one shuffle
// tree, sum16) and the m terms (16-block FMAs, no scalar chain). Per W row and x row this was
// ~30 instructions (a reduction, a 4-wide m-term loop, a scalar store) against 36 per 18-block
// row (SmolLM2's K = 576) in the blocks themselves: verifying 8 drafted tokens cost 8 rows of it.
//
// A row's result never depends on how many x rows share the call (tiles of 1..16 rows run the
// same operations per row in the same order, and the sum tree keeps W rows apart): the rows of a
// speculative verify equal the plain decode step's bit for bit.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define RLQ_AVX512BF16 1
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "quant_formats.h"

namespace radixlm_quant {

inline __m512i q4_bf16_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {  // entries i and i + 16 alike: see Q4_1bf
    const float f = static_cast<float>(i & 15);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    t[i] = static_cast<uint16_t>(u >> 16);  // exact: i & 15 has at most 4 significant bits
  }
  return _mm512_load_si512(t);
}

// xs[m * nblk + b] = sum of bf16 x row m's 32 values of block b, in fp32
inline void block_sums_bf16(const uint16_t* x, int64_t M, int64_t K, float* xs) {
  const int64_t nblk = K / 32;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nblk; ++b) {
      const __m512i v = _mm512_loadu_si512(x + m * K + b * 32);
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));  // even elements
      const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536)));
      xs[m * nblk + b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
}

// A block's 32 quants as bf16 values in order. Q4_1: d, m, then the nibbles; Q8_0: d, then int8s
// widened, converted to fp32 and narrowed to bf16 (exact: |q| <= 128 has at most 8 significant
// bits). scales(b, d, m) reads the block's fp16 scales as fp32 (Q8_0: m unused).
struct Q4_1bf {
  static constexpr int BYTES = 20;
  static constexpr bool kMin = true;  // w = d * q + m
  static __m512bh quants(const uint8_t* b, __m512i table) {
    // the bytes as words, unmasked: VPERMW reads an index's low 5 bits, and the table maps
    // i and i + 16 alike (q4_bf16_table), so a low nibble needs no AND with 0x0F
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4),
                                           1);  // q[0..31] in the words' low nibbles
    return (__m512bh)_mm512_permutexvar_epi16(idx, table);
  }
  static void scales(const uint8_t* b, float& d, float& m) {  // adjacent fp16s: one conversion
    uint32_t u;
    std::memcpy(&u, b, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(u)));
    d = _mm_cvtss_f32(f);
    m = _mm_cvtss_f32(_mm_movehdup_ps(f));
  }
};

struct Q8_0bf {
  static constexpr int BYTES = 34;
  static constexpr bool kMin = false;  // w = d * q
  static __m512bh quants(const uint8_t* b, __m512i) {
    const __m512 lo = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2))));
    const __m512 hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18))));
    return _mm512_cvtne2ps_pbh(hi, lo);  // lanes 0..15 from lo, 16..31 from hi
  }
  static void scales(const uint8_t* b, float& d, float&) { d = f16(b); }
};

// Lane j of the result = the sum of v[j]'s 16 lanes, for 16 vectors: a tree of in-lane unpacks,
// then 128-bit lane shuffles, each level adding pairs (45 instructions for 16 sums). Every output
// lane adds lanes of its own v[j] only, in a fixed order.
inline __m512 sum16(const __m512* v) {
  __m512 s1[8], s2[4], s3[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                          _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane q: rows 4i..4i+3, summed over lanes 4q..4q+3
    const __m512d a = _mm512_castps_pd(s1[2 * i]), b = _mm512_castps_pd(s1[2 * i + 1]);
    s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // [A(q0+q1), A(q2+q3), B(q0+q1), B(q2+q3)], A, B = s2[2i], s2[2i+1]
    s3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

constexpr int64_t kGroupChunk = 256;  // blocks of K per pass (K = 8192): the scales on the stack

// y[m * ldy + j] for m < MB, j < rows (<= 16): x rows m (x + m * K, block sums xs + m * nblk when
// F has a min) against W rows j (w + j * row_bytes). K runs in chunks of kGroupChunk blocks. Per W
// row and chunk, the block scales are converted once (dd, and Q4_1's m's, mm); then each block's
// quants are decoded once for all MB rows (one accumulator per x row: MB <= 16 chains hide the
// FMA latency, and at MB = 1 a block's decode takes longer than the chain's 4 cycles anyway).
// The m terms join the same accumulator as FMAs of 16 blocks' m's with x's block sums (lanes =
// blocks): sum16 adds all lanes.
template <class F, int MB>
inline void group_bf16(const uint16_t* x, const float* xs, int64_t K, const uint8_t* w, int rows,
                       float* y, int64_t ldy, __m512i table) {
  const int64_t nblk = K / 32, row_bytes = nblk * F::BYTES;
  alignas(64) __m512 part[MB][16];  // per x row, W row: 16 lanes of sums
  alignas(64) float dd[kGroupChunk];
  alignas(64) float mm[F::kMin ? kGroupChunk : 1];  // (Q8_0: unused)
  for (int m = 0; m < MB; ++m)
    for (int j = rows; j < 16; ++j) part[m][j] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < nblk; c0 += kGroupChunk) {
    const int64_t cn = std::min(kGroupChunk, nblk - c0);
    for (int j = 0; j < rows; ++j) {
      const uint8_t* wr = w + j * row_bytes + c0 * F::BYTES;
      for (int64_t b = 0; b < cn; ++b) F::scales(wr + b * F::BYTES, dd[b], mm[b]);
      __m512 acc[MB];
      for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
      const uint16_t* xc = x + c0 * 32;
      for (int64_t b = 0; b < cn; ++b) {
        const __m512bh q = F::quants(wr + b * F::BYTES, table);
        const __m512 d = _mm512_set1_ps(dd[b]);
        for (int m = 0; m < MB; ++m) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(xc + m * K + b * 32);
          acc[m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q, xv), d, acc[m]);
        }
      }
      if constexpr (F::kMin)
        for (int64_t b = 0; b < cn; b += 16) {
          const __mmask16 live = static_cast<__mmask16>(cn - b >= 16 ? 0xffff : (1u << (cn - b)) - 1);
          for (int m = 0; m < MB; ++m)
            acc[m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, mm + b),
                                     _mm512_maskz_loadu_ps(live, xs + m * nblk + c0 + b), acc[m]);
        }
      for (int m = 0; m < MB; ++m) part[m][j] = c0 == 0 ? acc[m] : _mm512_add_ps(part[m][j], acc[m]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * ldy, keep, sum16(part[m]));
}

}  // namespace radixlm_quant
#endif
