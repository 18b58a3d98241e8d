// The AVX512-BF16 score kernels of the CPU attention (cpu_attention_kernel.cpp includes this
// inside its anonymous namespace, after gather_kv and the conversions): decode scores straight
// from a bf16 pool (scores_bf16) and extend scores as VDPBF16PS products of the pool's K rows and
// the query block packed in pairs (scores_ext16). Defines RLM_BF16_DOT where they exist.
#pragma once

#if defined(__AVX512BF16__)
#define RLM_BF16_DOT 1
// Decode scores straight from a bf16 pool: S[g * KB + j] = (q_g . k_j) * qscale for the keys
// slots[0:n] of one block, by VDPBF16PS on the unscaled bf16 q rows (qb: G x D) and the K rows
// where they lie: no fp32 copy of K (the K half of gather_kv and its conversions is skipped).
// The products of bf16 pairs are exact in fp32; only the order of the sum differs from the fp32
// path (and bf16 subnormals, below 1e-38, count as zero). Keys j0 + u >= n read `zero`; the caller
// masks their scores. D % 32 == 0 (whole 512-bit rows of 32 bf16).
void scores_bf16(const Ctx& c, const uint16_t* qb, const int64_t* slots, int h, int n, float* S,
                 const uint16_t* zero) {
  const int G = c.G, D = c.D, nc = D / 32;
  for (int j0 = 0; j0 < n; j0 += 8) {
    const uint16_t* kp[8];
    for (int u = 0; u < 8; ++u) {
      if (j0 + u >= n) {
        kp[u] = zero;
        continue;
      }
      int64_t sl = slots[j0 + u];
      if (sl < 0 || sl >= c.n_slots) sl = 0;  // gather_kv reports a bad slot
      kp[u] = reinterpret_cast<const uint16_t*>(c.k + (sl * c.k_st0 + h * c.k_st1) * 2);
    }
    for (int g = 0; g < G; ++g) {  // the 8 K rows stay in L1 across the G heads
      const uint16_t* q = qb + g * D;
      vf acc[8];
      for (int u = 0; u < 8; ++u) acc[u] = vzero();
      for (int cc = 0; cc < nc; ++cc) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + cc * 32);
        for (int u = 0; u < 8; ++u)
          acc[u] = _mm512_dpbf16_ps(acc[u], qv, (__m512bh)_mm512_loadu_si512(kp[u] + cc * 32));
      }
      reduce8(acc, S + g * KB + j0);
    }
  }
  const vf scale = vset1(c.qscale);
  const int nw = round_up(n, W);
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < nw; j += W) vstore(S + g * KB + j, vmul(vload(S + g * KB + j), scale));
}

// Extend scores from a bf16 pool: St (n x Mp, row stride Mp) = qscale * K_blk . Q^T for R keys
// at a time, by VDPBF16PS on K's pairs (read from the pool rows krow[0:R]) broadcast against
// Qp, the block's unscaled bf16 query rows packed in pairs (D/2 x Mp x 2): 16 query rows per
// vector, R x NVQ accumulators. Half the instructions of the fp32 GEMM on gathered K, and no K
// conversion; the products are exact in fp32 (only the summation order differs). An 8 x 200
// causal extend (SmolLM2's shapes, 30 layers) took 0.77x the fp32 GEMM's time (cpu_attention_ab).
template <int R, int NVQ>
void scores_ext16(const uint16_t* Qp, int Mp, const uint16_t* const* krow, int D, float qscale,
                  float* S) {
  __m512 acc[R][NVQ];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NVQ; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int i = 0; i < D / 2; ++i) {
    __m512bh qv[NVQ];
    for (int v = 0; v < NVQ; ++v)
      qv[v] = (__m512bh)_mm512_loadu_si512(Qp + ((long)i * Mp + 16 * v) * 2);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(
          *reinterpret_cast<const int32_t*>(krow[r] + 2 * i));
      for (int v = 0; v < NVQ; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, qv[v]);
    }
  }
  const __m512 sc = _mm512_set1_ps(qscale);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NVQ; ++v) _mm512_storeu_ps(S + (long)r * Mp + 16 * v, _mm512_mul_ps(acc[r][v], sc));
}
using ScoresExt = void (*)(const uint16_t*, int, const uint16_t* const*, int, float, float*);
template <int R, int... V>
constexpr std::array<ScoresExt, sizeof...(V)> ext_row(std::integer_sequence<int, V...>) {
  return {&scores_ext16<R, V + 1>...};
}
constexpr int kExtR = 4, kExtNV = 6;  // keys per tile; query vectors (96 rows / 16)
const std::array<std::array<ScoresExt, kExtNV>, kExtR> kScoresExt = {
    ext_row<1>(std::make_integer_sequence<int, kExtNV>{}),
    ext_row<2>(std::make_integer_sequence<int, kExtNV>{}),
    ext_row<3>(std::make_integer_sequence<int, kExtNV>{}),
    ext_row<4>(std::make_integer_sequence<int, kExtNV>{})};
#endif
