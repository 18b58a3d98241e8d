// A tiny SIMD layer for cpu_attention.cpp: one fp32 vector type `vf` of W lanes and the few
// operations the kernels need. The ISA is chosen at compile time from the -march=native macros
// (the Python loader puts the CPU's feature flags into the build's cache key, so a build is only
// ever loaded on the kind of CPU it was compiled for):
//   AVX-512F        W = 16  (__m512)
//   AVX2+FMA+F16C   W = 8   (__m256)
//   otherwise       W = 8   plain arrays the compiler may vectorize (correct, not fast)
// Storage types are converted to fp32 on load: bf16 is the high half of an fp32 (shift left by
// 16), fp16 goes through the F16C / AVX-512 conversion instruction.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace radixlm_vec {

// 2^f = sum_k (ln2 f)^k / k! on f in [-0.5, 0.5]: the degree-7 Taylor error is ~5e-9 (< 1 ulp)
constexpr float kExp2C[8] = {1.0f, 0.6931471805599453f, 0.2402265069591007f,
                             0.05550410866482158f, 0.009618129107628477f,
                             0.0013333558146428443f, 0.00015403530393381606f,
                             1.525273380405984e-05f};

#if defined(__AVX512F__)
constexpr int W = 16;
constexpr const char* kIsa = "avx512";
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float vhsum(vf a) { return _mm512_reduce_add_ps(a); }
inline float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
inline vf vload_bf16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf vload_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// lanes where `m` is -inf become 0 (used as the subtrahend of exp2 when a row saw no key yet)
inline vf vfinite_or_zero(vf m) {
  __mmask16 k = _mm512_cmp_ps_mask(m, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
  return _mm512_mask_mov_ps(m, k, _mm512_setzero_ps());
}
inline vf vexp2(vf x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
  vf n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf f = _mm512_sub_ps(x, n);
  vf p = _mm512_set1_ps(kExp2C[7]);
  for (int k = 6; k >= 0; --k) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2C[k]));
  // 2^n from the exponent bits; n = -127 gives the bit pattern of 0.0, so exp2(-inf) == 0
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
// out[t] = sum of the lanes of a[t], t < 8: fold each 512-bit vector to 256 bits, then the
// AVX2 transpose-add (4 hadd levels instead of 8 separate horizontal sums)
inline void reduce8(const vf* a, float* out) {
  __m256 h[8];
  for (int t = 0; t < 8; ++t)
    h[t] = _mm256_add_ps(_mm512_castps512_ps256(a[t]),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[t]), 1)));
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                      _mm256_permute2f128_ps(u0, u1, 0x31)));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int W = 8;
constexpr const char* kIsa = "avx2";
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline float vhsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vhmax(vf a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline vf vload_bf16(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vf vload_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vf vfinite_or_zero(vf m) {
  vf is_ninf = _mm256_cmp_ps(m, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
  return _mm256_andnot_ps(is_ninf, m);
}
inline vf vexp2(vf x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
  vf n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf f = _mm256_sub_ps(x, n);
  vf p = _mm256_set1_ps(kExp2C[7]);
  for (int k = 6; k >= 0; --k) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2C[k]));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
// out[t] = sum of the lanes of a[t], t < 8, by a transpose-add: 6 hadd + 2 permutes + 1 add
inline void reduce8(const vf* a, float* out) {
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                      _mm256_permute2f128_ps(u0, u1, 0x31)));
}

#else
constexpr int W = 8;
constexpr const char* kIsa = "generic";
#define RLM_GENERIC_ISA 1
struct vf { float v[W]; };
#define RLM_MAP(expr) vf r; for (int i = 0; i < W; ++i) r.v[i] = (expr); return r
inline vf vzero() { RLM_MAP(0.f); }
inline vf vset1(float x) { RLM_MAP(x); }
inline vf vload(const float* p) { RLM_MAP(p[i]); }
inline void vstore(float* p, vf x) { for (int i = 0; i < W; ++i) p[i] = x.v[i]; }
inline vf vfma(vf a, vf b, vf c) { RLM_MAP(a.v[i] * b.v[i] + c.v[i]); }
inline vf vadd(vf a, vf b) { RLM_MAP(a.v[i] + b.v[i]); }
inline vf vsub(vf a, vf b) { RLM_MAP(a.v[i] - b.v[i]); }
inline vf vmul(vf a, vf b) { RLM_MAP(a.v[i] * b.v[i]); }
inline vf vdiv(vf a, vf b) { RLM_MAP(a.v[i] / b.v[i]); }
inline vf vmax(vf a, vf b) { RLM_MAP(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
inline vf vfinite_or_zero(vf m) { RLM_MAP(m.v[i] == -INFINITY ? 0.f : m.v[i]); }
inline vf vexp2(vf x) { RLM_MAP(std::exp2(x.v[i] < -127.f ? -127.f : x.v[i]) * (x.v[i] > -127.f)); }
inline float vhsum(vf a) { float s = 0; for (int i = 0; i < W; ++i) s += a.v[i]; return s; }
inline float vhmax(vf a) { float s = a.v[0]; for (int i = 1; i < W; ++i) s = a.v[i] > s ? a.v[i] : s; return s; }
inline vf vload_bf16(const uint16_t* p) {
  vf r;
  for (int i = 0; i < W; ++i) { uint32_t u = uint32_t(p[i]) << 16; std::memcpy(&r.v[i], &u, 4); }
  return r;
}
vf vload_f16(const uint16_t* p);  // unused: fp16 rows take the scalar path below
inline void reduce8(const vf* a, float* out) { for (int t = 0; t < 8; ++t) out[t] = vhsum(a[t]); }
#undef RLM_MAP
#endif

}  // namespace radixlm_vec
