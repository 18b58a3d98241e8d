// Q4_1 and Q8_0 against bf16 x (a bf16 model's activations, the bundled GGUF's layers and tied
// head) where the CPU has AVX512-BF16: the direct (few-row) kernels of quant_direct.h's Bf16Job.
// VDPBF16PS multiplies 32 bf16 weights with 32 bf16 x values; each product is exact in fp32
// (8-bit x 8-bit significands) and they are summed in fp32. (VDPBF16PS treats bf16 denormals,
// |x| < 1.2e-38, as 0: far below the fp32 sums' error.)
//
// A block's weights become bf16 values, the ones a bf16 model's dense weight holds (gguf.quants
// dequantizes in fp32; torch rounds to bf16 nearest-even): Q4_1's bf16(d * q + m) from a 16-entry
// table per block (one multiply, one add, one conversion) looked up by the nibbles, Q8_0's
// bf16(d * q) by two multiplies. Then each x row costs ONE VDPBF16PS per block, accumulated
// straight across blocks. On Zen 4 a 512-bit VDPBF16PS issues every other cycle: the floor of 2
// cycles a row and block. Factoring the scales out instead (d * sum q x + m * sum x, with the
// exact d * q + m: the kernels before 2026-11-28) cost a VDPBF16PS and an FMA, 3 cycles. One Zen 4
// thread, weights streamed from DRAM, old / new time: SmolLM2's four Q4_1 projections x 30 layers
// 0.87 at 1 x row, 0.58 at 5, 0.81 at 9, 0.71 at 16; its Q8_0 head 0.97, 0.71, 0.73, 0.84.
//
// Work goes in groups of 16 W rows, so that what is per (x row, W row) rather than per block is
// vectorized across the group: the 16 accumulators' horizontal sums (one shuffle tree, sum16).
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

// Q4_1 (20 bytes: fp16 d, fp16 m, 16 bytes of nibbles: q[i] in byte i's low nibble, q[i + 16] in
// its high one): the block's 32 weights bf16(d * q + m), in order. `iota` = 0, 1, ..., 15.
struct Q4_1bf {
  static constexpr int BYTES = 20;
  static __m512bh weights(const uint8_t* b, __m512 iota) {
    uint32_t u;  // adjacent fp16s d, m: one conversion
    std::memcpy(&u, b, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(u)));
    const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_broadcastss_ps(f), iota),
                                   _mm512_broadcastss_ps(_mm_movehdup_ps(f)));
    // the 16 values twice: VPERMW reads an index's low 5 bits, so i and i + 16 find the same
    // weight and a low nibble needs no AND with 0x0F
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(v, v);
    const __m256i q =
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
    return (__m512bh)_mm512_permutexvar_epi16(idx, table);
  }
};

// Q8_0 (34 bytes: fp16 d, 32 int8s): the block's 32 weights bf16(d * q), in order (q widened to
// fp32 exactly, the product rounded once to fp32 as gguf.quants does, then to bf16).
struct Q8_0bf {
  static constexpr int BYTES = 34;
  static __m512bh weights(const uint8_t* b, __m512) {
    const __m512 d = _mm512_set1_ps(f16(b));
    const __m512 lo = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2))));
    const __m512 hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18))));
    return _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, d), _mm512_mul_ps(lo, d));  // lo: lanes 0..15
  }
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

// Ask for `bytes` of W from `p` on, a line each. group_bf16 asks for the first kPrefetchAhead
// bytes of its group, then before each W row for that row's length kPrefetchAhead bytes past the
// next row's start: rows lie one after another, so this runs a fixed distance ahead of the reads
// through the task's rows and into the next task's. Why: a W row's blocks are read
// between VDPBF16PS chains, so few loads miss at once; streaming a decode step's ~66 MB of
// SmolLM2 blocks from DRAM, one x row ran at half the old kernel's speed in the engine (whose
// scales prepass read each row ahead of its blocks); with this, 0.87-0.93x its time on one
// thread. (A prefetch never faults past the tensor's end.)
constexpr int64_t kPrefetchAhead = 2048;
inline void prefetch_lines(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
}

// y[m * ldy + j] for m < MB, j < rows (<= 16): x rows m (x + m * K) against W rows j (w + j *
// row_bytes) of format F (Q4_1bf / Q8_0bf). Per W row, each block's bf16 weights are built once
// for all MB x rows; one accumulator per (x row, W row), blocks in order (MB <= 16 chains; at
// MB = 1 building a block's weights takes longer than the chain's 6 cycles anyway). (Two or
// four W rows at once gave one x row more independent chains, but their interleaved reads
// streamed from DRAM 10-25% slower.)
template <class F, int MB>
inline void group_bf16(const uint16_t* x, int64_t K, const uint8_t* w, int rows, float* y,
                       int64_t ldy) {
  const int64_t nblk = K / 32, row_bytes = nblk * F::BYTES;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) __m512 part[MB][16];
  for (int m = 0; m < MB; ++m)
    for (int j = rows; j < 16; ++j) part[m][j] = _mm512_setzero_ps();
  prefetch_lines(w, std::min(kPrefetchAhead, rows * row_bytes));
  for (int j = 0; j < rows; ++j) {
    const uint8_t* wr = w + j * row_bytes;
    prefetch_lines(wr + row_bytes + kPrefetchAhead, row_bytes);
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblk; ++b) {
      const __m512bh wv = F::weights(wr + b * F::BYTES, iota);
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {  // (unrolled: without it 6, 9 and 12 rows ran ~1.5x slower)
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + b * 32);
        acc[m] = _mm512_dpbf16_ps(acc[m], wv, xv);
      }
    }
    for (int m = 0; m < MB; ++m) part[m][j] = acc[m];
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * ldy, keep, sum16(part[m]));
}

}  // namespace radixlm_quant
#endif
