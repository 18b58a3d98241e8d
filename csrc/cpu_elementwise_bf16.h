// The AVX512-BF16 row kernels of the fused elementwise ops (cpu_elementwise.cpp includes this
// inside its anonymous namespace, after the row codecs, scratch() and grain_rows()): RMSNorm and
// the rotary on bf16 rows, one vector pass where the generic loops convert row by row.
#pragma once

#if defined(__AVX512BF16__)
// bf16 rows on AVX512-BF16, N % 16 == 0: the same steps as rmsnorm_kernel's, in two vector passes
// per row instead of nine scalar ones (the sum of squares in the same 16 lanes, summed lane by
// lane in the same order; roundings by VCVTNEPS2BF16, nearest even). A prefill step's ~2000-row
// calls took ~0.6 ms each through the generic loops.
inline vf round_bf16(vf v) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store_bf16(uint16_t* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
void rmsnorm_bf16_rows(const uint16_t* x, int64_t sx, const uint16_t* res, int64_t sr,
                       const uint16_t* w, uint16_t* out, int64_t so, uint16_t* sum, int64_t ss,
                       int64_t R, int64_t N, float eps) {
  at::parallel_for(0, R, grain_rows(N), [&](int64_t r0, int64_t r1) {
    float* buf = scratch(0, N);
    for (int64_t r = r0; r < r1; ++r) {
      vf acc = vzero();
      for (int64_t i = 0; i < N; i += W) {
        vf v = vload_bf16(x + r * sx + i);
        if (res != nullptr) {  // s = x + residual, rounded to bf16
          v = round_bf16(vadd(v, vload_bf16(res + r * sr + i)));
          store_bf16(sum + r * ss + i, v);
        }
        vstore(buf + i, v);
        acc = vfma(v, v, acc);
      }
      float lanes[W];
      vstore(lanes, acc);
      float sq = 0.f;
      for (int j = 0; j < W; ++j) sq += lanes[j];
      const vf inv = vset1(1.0f / std::sqrt(sq / static_cast<float>(N) + eps));
      for (int64_t i = 0; i < N; i += W)
        store_bf16(out + r * so + i,
                   vmul(round_bf16(vmul(vload(buf + i), inv)), vload_bf16(w + i)));
    }
  });
}

// bf16, D % 32 == 0: 16 pairs (j, j + D/2) per step, in torch's order (layers/rotary.py's
// apply_rotary): x * cos and rotate_half(x) * sin each rounded to fp32, then added (the FMA
// contraction is off for this function), one rounding to bf16: bit-identical to apply_rotary.
// The generic loop below took 0.85 ms for a 2048-token prefill's 12 heads of 64 (its per-head
// row copies and scalar conversions), this 0.13 ms (2-core EPYC).
__attribute__((optimize("fp-contract=off")))
void rotary_bf16_rows(uint16_t* x, int64_t sxr, int64_t sxh, const float* cs, int64_t scs,
                      const float* sn, int64_t ssn, int64_t r0, int64_t r1, int64_t H, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t r = r0; r < r1; ++r) {
    const float* c = cs + r * scs;
    const float* s = sn + r * ssn;
    for (int64_t h = 0; h < H; ++h) {
      uint16_t* v = x + r * sxr + h * sxh;
      for (int64_t j = 0; j < half; j += W) {
        const vf a = vload_bf16(v + j), b = vload_bf16(v + j + half);
        const vf lo = _mm512_sub_ps(_mm512_mul_ps(a, vload(c + j)), _mm512_mul_ps(b, vload(s + j)));
        const vf hi = _mm512_add_ps(_mm512_mul_ps(b, vload(c + j + half)),
                                    _mm512_mul_ps(a, vload(s + j + half)));
        store_bf16(v + j, lo);
        store_bf16(v + j + half, hi);
      }
    }
  }
}
void rotary_bf16(uint16_t* x, int64_t sxr, int64_t sxh, const float* cs, int64_t scs,
                 const float* sn, int64_t ssn, int64_t R, int64_t H, int64_t D) {
  at::parallel_for(0, R, grain_rows(H * D), [&](int64_t r0, int64_t r1) {
    rotary_bf16_rows(x, sxr, sxh, cs, scs, sn, ssn, r0, r1, H, D);
  });
}
#endif
