// The 8-lane fp32 vector `V` of quant_gemm.cpp and the integer -> float loads its block formats
// need. AVX2 + FMA (-march=native on any x86 since Haswell / Zen, AVX-512 ones included) or a
// plain-array fallback the compiler may vectorize (correct everywhere, not fast). The Python
// loader keys the build on the CPU's flags, so a build only runs on the CPU it was made for.
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <c10/util/Half.h>

namespace radixlm_quant {

// a block's fp16 scale -> fp32: one instruction with F16C (c10::Half's portable bit-twiddling
// conversion cost ~20 cycles per block, a third of a Q4_1 block's whole dequantize-and-FMA)
inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
constexpr const char* kQuantIsa = "avx2";
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset1(float x) { return _mm256_set1_ps(x); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V x) { _mm256_storeu_ps(p, x); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }   // a * b + c
inline V vfmsub(V a, V b, V c) { return _mm256_fmsub_ps(a, b, c); } // a * b - c
inline float vhsum(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// 8 int8 -> 8 floats
inline V vload_i8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// 16 bytes of two nibbles each -> q[0..15] (low nibbles), q[16..31] (high nibbles) (Q4_0/Q4_1).
// Each 8 bytes zero-extended to 8 int32 lanes straight from memory (one VPMOVZXBD), then the low
// nibble by a mask and the high one by a shift, in place: 10 instructions for 32 values where
// splitting the nibbles in bytes first took 13 (the same values)
inline void load_nibbles16(const uint8_t* p, V w[4]) {
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  const __m256i mask = _mm256_set1_epi32(0x0F);
  w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, mask));
  w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
  w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
  w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
// 32 bytes -> their low (hi == 0) or high nibbles as 32 floats (Q4_K's sub-blocks), each 8
// bytes zero-extended straight from memory as load_nibbles16's
inline void load_nibbles32(const uint8_t* p, int hi, V w[4]) {
  const __m256i mask = _mm256_set1_epi32(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m256i a =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i)));
    w[i] = _mm256_cvtepi32_ps(hi ? _mm256_srli_epi32(a, 4) : _mm256_and_si256(a, mask));
  }
}

// Q6_K: q = (4 low bits: nibble `s` of ql[0..31]) | (2 high bits: bits 2r..2r+1 of qh[0..31]) << 4,
// as 32 floats q - 32
inline void load_q6(const uint8_t* ql, const uint8_t* qh, int s, int r, V w[4]) {
  const __m256i lo = _mm256_and_si256(
      _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql)), _mm_cvtsi32_si128(4 * s)),
      _mm256_set1_epi8(0x0F));
  const __m256i hi = _mm256_and_si256(
      _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)), _mm_cvtsi32_si128(2 * r)),
      _mm256_set1_epi8(0x03));
  const __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));  // bytes 0..63 (no carry)
  const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
  const __m256i k32 = _mm256_set1_epi32(32);
  w[0] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(q0), k32));
  w[1] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(q0, 8)), k32));
  w[2] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(q1), k32));
  w[3] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(q1, 8)), k32));
}

#else
constexpr const char* kQuantIsa = "generic";
struct V { float v[8]; };
#define RLQ_MAP(expr) V r; for (int i = 0; i < 8; ++i) r.v[i] = (expr); return r
inline V vzero() { RLQ_MAP(0.f); }
inline V vset1(float x) { RLQ_MAP(x); }
inline V vload(const float* p) { RLQ_MAP(p[i]); }
inline void vstore(float* p, V x) { for (int i = 0; i < 8; ++i) p[i] = x.v[i]; }
inline V vadd(V a, V b) { RLQ_MAP(a.v[i] + b.v[i]); }
inline V vmul(V a, V b) { RLQ_MAP(a.v[i] * b.v[i]); }
// std::fma: one rounding, as the FMA instruction (keeps dequantized values identical to AVX2's)
inline V vfma(V a, V b, V c) { RLQ_MAP(__builtin_fmaf(a.v[i], b.v[i], c.v[i])); }
inline V vfmsub(V a, V b, V c) { RLQ_MAP(__builtin_fmaf(a.v[i], b.v[i], -c.v[i])); }
inline float vhsum(V a) { float s = 0; for (int i = 0; i < 8; ++i) s += a.v[i]; return s; }
inline V vload_i8(const uint8_t* p) { RLQ_MAP(static_cast<float>(static_cast<int8_t>(p[i]))); }
inline void load_nibbles16(const uint8_t* p, V w[4]) {
  for (int i = 0; i < 16; ++i) {
    w[i / 8].v[i % 8] = static_cast<float>(p[i] & 0x0F);
    w[2 + i / 8].v[i % 8] = static_cast<float>(p[i] >> 4);
  }
}
inline void load_nibbles32(const uint8_t* p, int hi, V w[4]) {
  for (int i = 0; i < 32; ++i) w[i / 8].v[i % 8] = static_cast<float>(hi ? p[i] >> 4 : p[i] & 0x0F);
}
inline void load_q6(const uint8_t* ql, const uint8_t* qh, int s, int r, V w[4]) {
  for (int i = 0; i < 32; ++i)
    w[i / 8].v[i % 8] = static_cast<float>((((ql[i] >> (4 * s)) & 0x0F) |
                                            (((qh[i] >> (2 * r)) & 0x03) << 4)) - 32);
}
#undef RLQ_MAP
#endif

}  // namespace radixlm_quant
