// bf16 GEMM of the CPU linear layers on AVX512-BF16: out (M, N) = x (M, K) . W^T [+ bias], W
// prepacked once (radixlm/runtime/layers/cpu_packed.py) into panels of 48 output columns laid out
// (K / 2, 48, 2): one VDPBF16PS multiplies a broadcast pair of x by the same pair of 16 columns.
//
// Why not oneDNN (which the prepacked layers used before): at decode's row counts (8-64) its
// kernels ran at 61-68% of the machine's bf16 peak on SmolLM2's projections (2-core EPYC); this
// kernel streams each panel once per call, the next panel prefetched into L2 along the current
// one's K loop: 0.57-0.68x oneDNN's time at 1-8 rows, 0.80x at 32, 1.02x at 512-2048
// (benchmarks/cpu_gemm_ab.py). 4 x 96 tiles instead of 8 x 48 ran 1.14x slower at 32 rows.
//
// Numerics: the products of bf16 pairs are exact in fp32; each output accumulates its pairs in K
// order in one fp32 register (VDPBF16PS: acc + odd product, then + even product), the bias is
// added in fp32, and the result is rounded to bf16 (nearest even). The order does not depend on
// M, on the row's position or on the thread count, so a token's projections are bit-identical
// in a prefill, a chunk or a decode batch (prefix caching relies on that). oneDNN sums in another
// order: ~4e-5 of the outputs differ from F.linear's by one bf16 rounding.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace radixlm_vec;

constexpr int NB = 48;   // output columns per panel: 3 vectors of 16 fp32
constexpr int MR = 8;    // rows per register tile: 8 x 3 accumulators + 3 B vectors + 1 A
constexpr int MC = 128;  // rows per chunk when many rows split across threads
// the paired gate/up panels (below): 64 columns, 6-row tiles; the shape check needs NBP on every
// build, including those without the AVX512-BF16 kernel
constexpr int NBP = 64, MRP = 6;

#if defined(__AVX512BF16__)
constexpr bool kHasKernel = true;

// acc (R x NV vectors of 16) = A (R x 2*K2) . the panel at B (K2 x 16*NV x 2 bf16): each
// output's K pairs in order, one VDPBF16PS per pair. Prefetches pf_bytes of `pf` (the next
// panel) into L2, spread over the K loop.
template <int R, int NV>
inline void accumulate(const uint16_t* A, long lda, const uint16_t* B, long K2, const char* pf,
                       long pf_bytes, __m512 (&acc)[R][NV]) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const long pf_per_k = pf ? (pf_bytes / 64 + K2 - 1) / K2 : 0;
  long pf_off = 0;
  for (long k2 = 0; k2 < K2; ++k2) {
    const uint16_t* b = B + k2 * NV * 32;
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + 32 * v);
    for (long p = 0; p < pf_per_k && pf_off < pf_bytes; ++p, pf_off += 64)
      __builtin_prefetch(pf + pf_off, 0, 2);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(
          *reinterpret_cast<const int32_t*>(A + r * lda + 2 * k2));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, bv[v]);
    }
  }
}

// C (R x nvalid) = A (R x 2*K2) . a 48-column panel [+ bias], rounded to bf16.
template <int R>
void tile(const uint16_t* A, long lda, const uint16_t* B, long K2, uint16_t* C, long ldc,
          int nvalid, const float* bias, const char* pf, long pf_bytes) {
  __m512 acc[R][3];
  accumulate<R, 3>(A, lda, B, K2, pf, pf_bytes, acc);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 3; ++v) {
      const int n0 = v * 16;
      if (n0 >= nvalid) break;
      __m512 o = acc[r][v];
      if (bias) o = _mm512_add_ps(o, _mm512_loadu_ps(bias + n0));
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(o);
      if (n0 + 16 <= nvalid)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(C + r * ldc + n0), h);
      else
        _mm256_mask_storeu_epi16(C + r * ldc + n0, (__mmask16)((1u << (nvalid - n0)) - 1), h);
    }
}

using Tile = void (*)(const uint16_t*, long, const uint16_t*, long, uint16_t*, long, int,
                      const float*, const char*, long);
constexpr Tile kTiles[MR] = {&tile<1>, &tile<2>, &tile<3>, &tile<4>,
                             &tile<5>, &tile<6>, &tile<7>, &tile<8>};

// ---- the MLP's gate/up projection: paired panels ------------------------------------------------
// Panel p of a (2I, K) gate_up weight holds gate rows [32p, 32p + 32) then up rows
// [I + 32p, I + 32p + 32): 64 columns, K / 2 x 64 x 2. A 6 x 64 tile (24 accumulators) then has
// row r's gate and up values for the same 32 features, and its epilogue either stores both (the
// plain projection, C = (M, 2I)) or silu(gate) * up (C = (M, I)): the SiLU-and-mul of
// cpu_elementwise.cpp's silu_mul_kernel, the same vector math and roundings (gate and up rounded
// to bf16 as the GEMM's output, silu rounded to bf16, the product rounded), so both paths give the
// same bits, without writing and re-reading the (M, 2I) projection.

template <int R, bool SILU>
void tile_pair(const uint16_t* A, long lda, const uint16_t* B, long K2, uint16_t* C, long ldc,
               long up_off, const char* pf, long pf_bytes) {
  __m512 acc[R][4];
  accumulate<R, 4>(A, lda, B, K2, pf, pf_bytes, acc);
  constexpr float kLog2e = 1.4426950408889634f;
  for (int r = 0; r < R; ++r) {
    __m256i h[4];
    for (int v = 0; v < 4; ++v) h[v] = (__m256i)_mm512_cvtneps_pbh(acc[r][v]);
    if constexpr (!SILU) {
      for (int v = 0; v < 4; ++v)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(C + r * ldc + (v < 2 ? 0 : up_off) +
                                                       16 * (v & 1)), h[v]);
    } else {
      for (int v = 0; v < 2; ++v) {
        const vf g = vload_bf16(reinterpret_cast<const uint16_t*>(&h[v]));
        const vf u = vload_bf16(reinterpret_cast<const uint16_t*>(&h[v + 2]));
        const vf e = vexp2(vmul(g, vset1(-kLog2e)));
        const __m256i sh = (__m256i)_mm512_cvtneps_pbh(vdiv(g, vadd(vset1(1.f), e)));
        const vf sv = vload_bf16(reinterpret_cast<const uint16_t*>(&sh));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(C + r * ldc + 16 * v),
                            (__m256i)_mm512_cvtneps_pbh(vmul(sv, u)));
      }
    }
  }
}

using PairTile = void (*)(const uint16_t*, long, const uint16_t*, long, uint16_t*, long, long,
                          const char*, long);
template <bool SILU>
constexpr PairTile kPairTiles[MRP] = {&tile_pair<1, SILU>, &tile_pair<2, SILU>,
                                      &tile_pair<3, SILU>, &tile_pair<4, SILU>,
                                      &tile_pair<5, SILU>, &tile_pair<6, SILU>};

// Rows [m0, m1) times panels [p0, p1); the first row tile of each panel prefetches the next one.
// mode 0: 48-column panels; 1: paired panels, both halves stored; 2: paired, silu(gate) * up.
void run_block(int mode, const uint16_t* A, long lda, const uint16_t* B, long K2, uint16_t* C,
               long N, const float* bias, long m0, long m1, long p0, long p1) {
  const int nb = mode == 0 ? NB : NBP, mr = mode == 0 ? MR : MRP;
  const long panel = K2 * nb * 2;  // elements
  const long I = N / 2;            // paired: the intermediate size (N = 2I)
  const long ldc = mode == 2 ? I : N;
  // the next panel's prefetch is spread over this panel's row tiles (a slice each), so the
  // memory stream runs at a steady rate through the whole panel instead of bursting in one tile
  const long ntiles = (m1 - m0 + mr - 1) / mr;
  const long pf_slice = ((panel * 2 / 64 + ntiles - 1) / ntiles) * 64;  // bytes, whole lines
  for (long p = p0; p < p1; ++p) {
    const char* pf = p + 1 < p1 ? reinterpret_cast<const char*>(B + (p + 1) * panel) : nullptr;
    for (long m = m0, ti = 0; m < m1; m += mr, ++ti) {
      const int r = (int)std::min<long>(mr, m1 - m);
      const long off = std::min(ti * pf_slice, panel * 2);
      const char* tpf = pf && off < panel * 2 ? pf + off : nullptr;
      const long tpf_bytes = std::min(pf_slice, panel * 2 - off);
      if (mode == 0)
        kTiles[r - 1](A + m * lda, lda, B + p * panel, K2, C + m * N + p * NB, N,
                      (int)std::min<long>(NB, N - p * NB), bias ? bias + p * NB : nullptr, tpf,
                      tpf_bytes);
      else if (mode == 1)
        kPairTiles<false>[r - 1](A + m * lda, lda, B + p * panel, K2, C + m * ldc + p * 32, ldc,
                                 I, tpf, tpf_bytes);
      else
        kPairTiles<true>[r - 1](A + m * lda, lda, B + p * panel, K2, C + m * ldc + p * 32, ldc,
                                0, tpf, tpf_bytes);
    }
  }
}
#else
constexpr bool kHasKernel = false;
#endif

bool gemm_bf16_available() { return kHasKernel; }

// out (M, n) = x . W^T [+ bias] for a 48-column pack; for a paired pack (64 columns) n = 2I and
// out = [gate | up] (silu=false) or silu(gate) * up, (M, I) (silu=true).
at::Tensor run_gemm(const at::Tensor& x, const at::Tensor& wp, int64_t n,
                    const c10::optional<at::Tensor>& bias, bool silu) {
  TORCH_CHECK(kHasKernel, "gemm_bf16: this build has no AVX512-BF16 kernel (see gemm_bf16_available)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
              x.stride(1) == 1, "gemm_bf16: x must be a (M, K) bf16 CPU tensor, unit stride in K");
  TORCH_CHECK(wp.scalar_type() == at::kBFloat16 && wp.dim() == 4 && wp.is_contiguous() &&
              (wp.size(2) == NB || wp.size(2) == NBP) && wp.size(3) == 2,
              "gemm_bf16: wp must be a packed (P, K/2, 48 or 64, 2) weight");
  const bool paired = wp.size(2) == NBP;
  TORCH_CHECK(!silu || paired, "gemm_bf16_silu needs a paired (gate/up) pack");
  const int64_t M = x.size(0), K = x.size(1), K2 = wp.size(1), P = wp.size(0);
  TORCH_CHECK(K == 2 * K2, "gemm_bf16: x has K=", K, ", the weight was packed for K=", 2 * K2);
  if (paired) {
    TORCH_CHECK(n == 64 * P, "gemm_bf16: a paired (gate/up) pack of ", P, " panels has n=", 64 * P);
  } else {
    TORCH_CHECK(n > 0 && (n + NB - 1) / NB == P, "gemm_bf16: n does not match the panels");
  }
  TORCH_CHECK(!paired || !(bias.has_value() && bias->defined()), "gemm_bf16: no bias on a paired pack");
  at::Tensor out = at::empty({M, silu ? n / 2 : n}, x.options());
  if (M == 0) return out;
#if defined(__AVX512BF16__)
  std::vector<float> bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "gemm_bf16: bias must be (n,)");
    at::Tensor b = bias->to(at::kFloat).contiguous();
    bias_f.assign(b.data_ptr<float>(), b.data_ptr<float>() + n);
    bias_f.resize(P * NB, 0.f);
  }
  const float* bp = bias_f.empty() ? nullptr : bias_f.data();
  const uint16_t* A = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* B = reinterpret_cast<const uint16_t*>(wp.data_ptr());
  uint16_t* C = reinterpret_cast<uint16_t*>(out.data_ptr());
  const long lda = x.stride(0);
  const int mode = paired ? (silu ? 2 : 1) : 0;
  const int nt = std::max(1, at::get_num_threads());
  const long chunks = (M + MC - 1) / MC;
  if (nt == 1) {
    run_block(mode, A, lda, B, K2, C, n, bp, 0, M, 0, P);
  } else if (chunks >= nt) {  // many rows: each thread takes whole row chunks, every panel
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (long c = 0; c < chunks; ++c)
      run_block(mode, A, lda, B, K2, C, n, bp, c * MC, std::min<long>(M, (c + 1) * MC), 0, P);
  } else {  // few rows: each thread takes a run of panels, every row
    const int T = (int)std::min<long>(nt, P);
#pragma omp parallel num_threads(T)
    {
      const int t = omp_get_thread_num();
      run_block(mode, A, lda, B, K2, C, n, bp, 0, M, P * t / T, P * (t + 1) / T);
    }
  }
#endif
  return out;
}

at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& wp, int64_t n,
                     const c10::optional<at::Tensor>& bias) {
  return run_gemm(x, wp, n, bias, false);
}

at::Tensor gemm_bf16_silu(const at::Tensor& x, const at::Tensor& wp) {
  return run_gemm(x, wp, 64 * wp.size(0), c10::nullopt, true);
}

}  // namespace

#ifndef RLM_OPS_NS
#define RLM_OPS_NS radixlm_cpu
#endif
#define RLM_GEMM_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define RLM_GEMM_FRAGMENT_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

RLM_GEMM_FRAGMENT(RLM_OPS_NS, m) {
  m.def("gemm_bf16(Tensor x, Tensor wp, int n, Tensor? bias) -> Tensor");
  m.def("gemm_bf16_silu(Tensor x, Tensor wp) -> Tensor");
  m.def("gemm_bf16_available() -> bool", &gemm_bf16_available);
}

RLM_GEMM_FRAGMENT_IMPL(RLM_OPS_NS, CPU, m) {
  m.impl("gemm_bf16", &gemm_bf16);
  m.impl("gemm_bf16_silu", &gemm_bf16_silu);
}
