// The direct (few-row) GEMM of quant_gemm.cpp: y (M, N) fp32 = x (M, K) @ dequant(W)^T with W's
// blocks dequantized in registers, for the decode row counts (quantized_linear.DIRECT_MAX_M).
// Tasks of NB output rows, each against every x row in tiles of <= 8 rows (bf16 x: 16); up to
// kPoolMaxM rows they run on the claim pool (quant_pool.h) in chunks of ~8 per thread, else on
// OpenMP. On AVX-512 the Q4_1 / Q8_0 kernels are quant_avx512.h's (bf16 x: quant_bf16.h's);
// elsewhere row_dot (quant_formats.h's dequantize, then FMA with x).
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "quant_avx512.h"
#include "quant_bf16.h"
#include "quant_formats.h"
#include "quant_pool.h"

namespace radixlm_quant {

constexpr int NB = 16;  // output rows per task: their blocks stay cached across the x tiles

// y[m, n] for m < MB (rows x + m * K) and one W row of K / F::BK blocks. Each x row takes the
// same operations in the same order whatever MB is, so a row's result never depends on how many
// rows share the call (a speculative verify's rows equal plain decoding's bit for bit; with bf16
// x this is the AVX2 / generic build's path, tests/unit/test_quant_gemm.py). Per 32 values a
// row sums its 4 products in a chain of its own, then adds that to its one accumulator: the
// accumulator's dependency is one add per 32 values, so a single row is not bound by the FMA
// latency. (Until 2026-11-29 1 x row had 4 accumulators, 2 rows 2, more rows 1: other sums for
// the same row at each MB. This costs ~5% at MB = 1 and 8 on the AVX2 EPYC, one thread,
// SmolLM2's four Q4_1 projections x 30 layers and Q8_0 head; one accumulator per row with the
// 4 FMAs on it cost ~25% at MB = 1.)
//
// The 32-value formats (F::kFactored: Q4_1, Q8_0) take the block's scale out of the sum, as the
// AVX-512 kernels do: a block adds d * (q . x) to the row's vector accumulator and, for Q4_1,
// m * sum(x) (xs: x's block sums, row_block_sums) to a scalar one, so the 4 FMAs of the
// dequantization (w = q d + m) are gone: ~23 AVX2 instructions a block at MB = 1 against ~28
// (the nibble unpacking, 13 of them, remains). On the AVX2 EPYC (2026-11-29, one thread pinned,
// best of 6 alternating runs): one SmolLM2 token's GEMMs 17.0 -> 15.2 ms; benchmarks/cpu_bs1.py
// 59.8-64.8 -> 69.1-70.0 tok/s. xs may be null for a format without m. The same operations per
// row at every MB.
template <class F, int MB>
inline void row_dot(const float* x, const float* xs, int64_t K, const uint8_t* wrow, float* y,
                    int64_t ldy) {
  if constexpr (F::kFactored) {
    V acc[MB];
    float macc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = vzero(), macc[m] = 0.f;
    const int64_t nblk = K / 32;
    for (int64_t bi = 0; bi < nblk; ++bi) {
      const uint8_t* b = wrow + bi * F::BYTES;
      V q[4];
      F::quants(b, q);
      const V d = vset1(F::scale(b));
      [[maybe_unused]] const float mn = F::kMin ? F::minv(b) : 0.f;
      for (int m = 0; m < MB; ++m) {
        const float* xk = x + m * K + bi * 32;
        V s = vmul(q[0], vload(xk));
        for (int i = 1; i < 4; ++i) s = vfma(q[i], vload(xk + 8 * i), s);
        acc[m] = vfma(s, d, acc[m]);
        if constexpr (F::kMin) macc[m] = __builtin_fmaf(mn, xs[m * nblk + bi], macc[m]);
      }
    }
    for (int m = 0; m < MB; ++m) y[m * ldy] = vhsum(acc[m]) + macc[m];
  } else {  // (Q4_K, Q6_K: sub-block scales; each group dequantized, then multiplied)
    V acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = vzero();
    const int64_t nblk = K / F::BK;
    for (int64_t bi = 0; bi < nblk; ++bi) {
      const uint8_t* b = wrow + bi * F::BYTES;
      const auto p = F::prep(b);
      for (int g = 0; g < F::BK / 32; ++g) {
        V w[4];
        F::group(b, p, g, w);
        const float* xk = x + bi * F::BK + g * 32;
        for (int m = 0; m < MB; ++m) {
          V s = vmul(w[0], vload(xk + m * K));
          for (int i = 1; i < 4; ++i) s = vfma(w[i], vload(xk + m * K + 8 * i), s);
          acc[m] = vadd(acc[m], s);
        }
      }
    }
    for (int m = 0; m < MB; ++m) y[m * ldy] = vhsum(acc[m]);
  }
}

// The AVX-512 kernel of a format (quant_avx512.h), void where there is none (row_dot runs).
template <class F> struct Fast { using type = void; };
#ifdef RLQ_AVX512
template <> struct Fast<Q4_1> { using type = Q4_1x16; };
template <> struct Fast<Q8_0> { using type = Q8_0x16; };
#endif

// gemm_impl's work on AVX-512 for the formats quant_avx512.h has: the same task split, the
// block sums of x computed once for all of them. Few rows (decode) run on the claim pool
// (quant_pool.h: the caller never waits for a helper that is off its core); many rows, or a
// pool busy with another caller, on OpenMP as before.
template <class G>
struct FastJob {
  const float* x; const float* xs; int64_t M, K, N; const uint8_t* w; float* y;
  int64_t nb = NB;  // W rows per task

  void task(int64_t t) const {
#ifdef RLQ_AVX512
    const int64_t nblk = K / 32;
    const int64_t n0 = t * nb, n1 = std::min(N, n0 + nb);
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t left = M - m0;
      const int mb = left >= 8 ? 8 : static_cast<int>(left);
      const float* xm = x + m0 * K;
      const float* sm = xs + m0 * nblk;
      float* ym = y + m0 * N;
      switch (mb) {
        case 8: rows512<G, 8>(xm, sm, K, w, n0, n1, ym, N); break;
        case 7: rows512<G, 7>(xm, sm, K, w, n0, n1, ym, N); break;
        case 6: rows512<G, 6>(xm, sm, K, w, n0, n1, ym, N); break;
        case 5: rows512<G, 5>(xm, sm, K, w, n0, n1, ym, N); break;
        case 4: rows512<G, 4>(xm, sm, K, w, n0, n1, ym, N); break;
        case 3: rows512<G, 3>(xm, sm, K, w, n0, n1, ym, N); break;
        case 2: rows512<G, 2>(xm, sm, K, w, n0, n1, ym, N); break;
        default: rows512<G, 1>(xm, sm, K, w, n0, n1, ym, N); break;
      }
      m0 += mb;
    }
#else
    (void)t;
#endif
  }
  static void call(void* self, int64_t t) { static_cast<const FastJob*>(self)->task(t); }
};

constexpr int64_t kPoolMaxM = 16;  // rows up to which the claim pool runs a GEMM

// A job on the claim pool in chunks of whole NB-row tasks, ~8 per thread: each claim is an
// atomic on a line the threads share, and SmolLM2's head in 16-row tasks made 3072 of them a
// call. False where the pool is busy (the caller then takes OpenMP).
template <class Job>
bool pool_run(Job& job, int64_t N) {
  const int nt = std::max(1, at::get_num_threads());
  const int64_t per = (N + 8 * nt - 1) / (8 * nt);
  job.nb = std::max<int64_t>(NB, (per + NB - 1) / NB * NB);
  const int64_t ntask = (N + job.nb - 1) / job.nb;
  const int helpers = static_cast<int>(std::min<int64_t>(nt, ntask)) - 1;
  if (claim_pool().run(ntask, helpers, &Job::call, &job)) return true;
  job.nb = NB;
  return false;
}

#ifdef RLQ_AVX512BF16
// Q4_1 / Q8_0 with bf16 x (quant_bf16.h's group_bf16, F = Q4_1bf / Q8_0bf): FastJob's split on x's
// own bf16 values, each task's W rows in groups of 16, x in tiles of up to 16 rows (a verify of
// 8 drafted tokens, 9 rows, builds each block's weights once).
template <class F>
struct Bf16Job {
  const uint16_t* x; int64_t M, K, N; const uint8_t* w; float* y;
  int64_t nb = NB;  // W rows per task

  template <int MB>
  void tile(const uint16_t* xm, int64_t n0, int64_t n1, float* ym) const {
    const int64_t row_bytes = K / 32 * F::BYTES;
    for (int64_t n = n0; n < n1; n += 16) {
      const int rows = static_cast<int>(std::min<int64_t>(16, n1 - n));
      group_bf16<F, MB>(xm, K, w + n * row_bytes, rows, ym + n, N);
    }
  }

  void task(int64_t t) const {
    const int64_t n0 = t * nb, n1 = std::min(N, n0 + nb);
    for (int64_t m0 = 0; m0 < M;) {
      const int mb = static_cast<int>(std::min<int64_t>(16, M - m0));
      const uint16_t* xm = x + m0 * K;
      float* ym = y + m0 * N;
      switch (mb) {
        case 16: tile<16>(xm, n0, n1, ym); break;
        case 15: tile<15>(xm, n0, n1, ym); break;
        case 14: tile<14>(xm, n0, n1, ym); break;
        case 13: tile<13>(xm, n0, n1, ym); break;
        case 12: tile<12>(xm, n0, n1, ym); break;
        case 11: tile<11>(xm, n0, n1, ym); break;
        case 10: tile<10>(xm, n0, n1, ym); break;
        case 9: tile<9>(xm, n0, n1, ym); break;
        case 8: tile<8>(xm, n0, n1, ym); break;
        case 7: tile<7>(xm, n0, n1, ym); break;
        case 6: tile<6>(xm, n0, n1, ym); break;
        case 5: tile<5>(xm, n0, n1, ym); break;
        case 4: tile<4>(xm, n0, n1, ym); break;
        case 3: tile<3>(xm, n0, n1, ym); break;
        case 2: tile<2>(xm, n0, n1, ym); break;
        default: tile<1>(xm, n0, n1, ym); break;
      }
      m0 += mb;
    }
  }
  static void call(void* self, int64_t t) { static_cast<const Bf16Job*>(self)->task(t); }
};

template <class F>
inline void gemm_bf16x(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                       float* y) {
  Bf16Job<F> job{x, M, K, N, w, y};
  if (M <= kPoolMaxM && pool_run(job, N)) return;
  const int64_t ntask = (N + NB - 1) / NB;
  const int nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntask));
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t t = 0; t < ntask; ++t) job.task(t);
}
#endif

template <class G>
void gemm_fast(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y) {
#ifdef RLQ_AVX512
  std::vector<float> xs(M * (K / 32));
  block_sums(x, M, K, xs.data());
  FastJob<G> job{x, xs.data(), M, K, N, w, y};
  if (M <= kPoolMaxM && pool_run(job, N)) return;
  const int64_t ntask = (N + NB - 1) / NB;
  const int nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntask));
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t t = 0; t < ntask; ++t) job.task(t);
#else
  (void)x, (void)M, (void)K, (void)w, (void)N, (void)y;
#endif
}

// xs[m * nblk + b] = the sum of x row m's 32 values of block b (row_dot's factored formats)
inline void row_block_sums(const float* x, int64_t M, int64_t K, float* xs) {
  const int64_t nblk = K / 32;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nblk; ++b) {
      const float* p = x + m * K + b * 32;
      V s = vadd(vadd(vload(p), vload(p + 8)), vadd(vload(p + 16), vload(p + 24)));
      xs[m * nblk + b] = vhsum(s);
    }
}

// The direct kernel's task t: W rows [t * NB, t * NB + NB) against every row of x.
template <class F>
struct DirectJob {
  const float* x; const float* xs; int64_t M, K, N; const uint8_t* w; float* y;
  int64_t nb = NB;  // W rows per task

  void task(int64_t t) const {
    const int64_t row_bytes = K / F::BK * F::BYTES;
    const int64_t n0 = t * nb, n1 = std::min(N, n0 + nb);
    for (int64_t m0 = 0; m0 < M;) {
      // any 1..8 rows in one tile: a block is dequantized once per tile, and that (not the
      // bytes) is most of the cost, so M = 3, 5, 6, 7 (speculative verifies) take one pass
      // instead of the 2-3 a {8, 4, 2, 1} split needs
      const int64_t left = M - m0;
      const int mb = left >= 8 ? 8 : static_cast<int>(left);
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* wr = w + n * row_bytes;
        const float* xm = x + m0 * K;
        const float* sm = xs ? xs + m0 * (K / 32) : nullptr;
        float* ym = y + m0 * N + n;
        switch (mb) {
          case 8: row_dot<F, 8>(xm, sm, K, wr, ym, N); break;
          case 7: row_dot<F, 7>(xm, sm, K, wr, ym, N); break;
          case 6: row_dot<F, 6>(xm, sm, K, wr, ym, N); break;
          case 5: row_dot<F, 5>(xm, sm, K, wr, ym, N); break;
          case 4: row_dot<F, 4>(xm, sm, K, wr, ym, N); break;
          case 3: row_dot<F, 3>(xm, sm, K, wr, ym, N); break;
          case 2: row_dot<F, 2>(xm, sm, K, wr, ym, N); break;
          default: row_dot<F, 1>(xm, sm, K, wr, ym, N); break;
        }
      }
      m0 += mb;
    }
  }
  static void call(void* self, int64_t t) { static_cast<const DirectJob*>(self)->task(t); }
};

template <class F>
void gemm_impl(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y) {
  if constexpr (!std::is_void_v<typename Fast<F>::type>) {
    gemm_fast<typename Fast<F>::type>(x, M, K, w, N, y);
    return;
  }
  std::vector<float> xs;
  if constexpr (F::kFactored && F::kMin) {
    xs.resize(M * (K / 32));
    row_block_sums(x, M, K, xs.data());
  }
  DirectJob<F> job{x, xs.empty() ? nullptr : xs.data(), M, K, N, w, y};
  if (M <= kPoolMaxM && pool_run(job, N)) return;
  const int64_t ntask = (N + NB - 1) / NB;
  const int nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntask));
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)  // a preempted thread holds 1 task
  for (int64_t t = 0; t < ntask; ++t) job.task(t);
}

}  // namespace radixlm_quant
