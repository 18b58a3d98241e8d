// CPU attention over the paged KV pool, the compute (the ops and their argument checks are in
// cpu_attention.cpp, the shared types in cpu_attention.h).
//
// One call handles every request of the batch. Work is split into tasks of
// (sequence, kv head, query block, key split); the Hkv tasks of one (sequence, query block, key
// split) form a work item, run on one thread (see run_all), and items go to OpenMP threads with
// dynamic scheduling, biggest first. A task processes all G = Hq / Hkv query heads of its KV head
// together (GQA), so every K/V row is loaded and converted once for G * query_block query rows.
//
// Decode rows with a bf16 pool and q and D % 64 == 0 (the common serving case) skip the tasks:
// their work item runs decode_item (cpu_attention_decode.h), one pass over the keys for every
// head, reading the pool in place; the same arithmetic, bit-identical results.
//
// Inside a task keys go in blocks of KB: gather the block's K and V rows into fp32 scratch,
// scores, masked online softmax (base 2: q is pre-scaled by scale * log2 e), O += P V.
//   - a query block of one token (decode rows): scores are G x KB dot products along D
//     ("direct" path), 8 keys at a time so the horizontal sums share a transpose-add; with
//     AVX512-BF16, bf16 q and K and D % 32 == 0 they are VDPBF16PS products read straight from
//     the pool (scores_bf16: no fp32 copy of K; 1.55x faster per key and head when the KV is in
//     cache, ~10% off a 32-request decode step's attention when it streams from memory);
//   - a longer query block (prefill, shared prefix): scores are the small GEMM
//     St (KB x M) = K_blk (KB x D) . Qt (D x M) (VDPBF16PS on the pool's K rows for bf16 pools
//     and q, scores_ext16), vectorized over the M query rows, so the softmax
//     max/exp/sum are vector ops along the same rows too; then O (M x D) += P (M x KB) . V_blk.
// Both GEMMs use one register-blocked microkernel (MR rows x NV vectors of C in registers).
// Why not at::mm on the gathered fp32 tiles (an earlier measurement, not repeated since):
// the hand-written kernel wins here because the tiles are small (64 keys x <= 96 rows x 64) and
// a dispatcher call per tile costs as much as the tile's arithmetic.
//
// Sliding window (Ctx::window): the ops cut each sequence's key range to the keys its queries'
// windows reach; a task starts its key loop at its first query's window and masks, per key, the
// rows whose window ends before it (only in the blocks where some row's window begins). Logit
// soft-cap (Ctx::cap2): scores pass through cap * tanh(score / cap) before any mask.
//
// Key splits: when (sequences x kv heads x query blocks) gives fewer than 8 tasks per thread
// (batch-1 decode, a shared prefix), each sequence's key range is split; a split writes its
// unnormalized O with its running max m and sum l, and a merge pass combines the splits by
// log-sum-exp.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_attention.h"
#include "quant_pool.h"  // the claim pool the quantized GEMMs run on (one per process)

using namespace radixlm_vec;

namespace radixlm_attn {
namespace {

constexpr int KB = 64;            // keys per block (multiple of 8 and of W)
constexpr int kTargetRows = 96;   // query rows (tokens x G heads) per extend task
constexpr int kMinSplit = 128;    // fewest keys worth a split of their own
constexpr int64_t kMinParallelWork = 1 << 18;  // (key, query row) pairs worth a 2nd thread
// ... on the claim pool (quant_pool.h) instead of OpenMP, from this much: a speculative verify's
// few query rows over a long prompt (SmolLM2, 6 rows x ~1k keys: ~100 us a layer on one thread,
// 15% of the verify step) without an OpenMP region, whose waits next to the pool's helper thread
// the threshold above avoids
constexpr int64_t kMinPoolWork = 1 << 15;
constexpr int64_t kPoolRows = 16;  // ... and at most this many query rows (see run_all)
// ... or from this much where it is several decode rows (a verify of 8 drafts over a 300-token
// history: 24k pairs, ~120 us a layer on one thread), which go to the threads whole: no row's
// sums change
constexpr int64_t kMinPoolRowsWork = 1 << 13;
#if defined(__AVX512F__)
constexpr int MR = 12, NV = 2;    // 24 accumulators + 2 B vectors + 1 broadcast of 32 registers
#else
constexpr int MR = 6, NV = 2;     // 12 accumulators + 2 + 1 of 16 registers
#endif

#include "cpu_attention_gemm.h"  // gemm(): the register-blocked microkernel of both GEMMs

// ---- logit soft-cap ---------------------------------------------------------------------------
// x[0:n] (n a multiple of W; base-2 scores) <- cap2 * tanh(x / cap2), tanh(y) = 1 - 2 / (e^2y + 1)
// with e^2y = 2^(x * cap_k) (cap_k = 2 / c). vexp2 clamps to 2^+-127, where tanh is +-1 in fp32.
void softcap_scores(const Ctx& c, float* x, long n) {
  const vf k = vset1(c.cap_k), c2 = vset1(c.cap2), one = vset1(1.f), two = vset1(2.f);
  for (long i = 0; i < n; i += W) {
    vf t = vexp2(vmul(vload(x + i), k));
    vstore(x + i, vmul(c2, vsub(one, vdiv(two, vadd(t, one)))));
  }
}

// ---- conversions ------------------------------------------------------------------------------
// One row of D storage elements -> fp32 dst[0:Dp], the tail D..Dp zeroed.
template <typename T>
inline void row_to_f32(const T* src, float* dst, int D, int Dp) {
  int d = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; d + W <= D; d += W) vstore(dst + d, vload(src + d));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; d + W <= D; d += W) vstore(dst + d, vload_bf16(reinterpret_cast<const uint16_t*>(src) + d));
  } else {
#ifndef RLM_GENERIC_ISA
    for (; d + W <= D; d += W) vstore(dst + d, vload_f16(reinterpret_cast<const uint16_t*>(src) + d));
#endif
  }
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
  for (; d < Dp; ++d) dst[d] = 0.f;
}

// q / out rows have the caller's dtype; they are O(rows x D) per task, so a scalar loop is fine.
template <typename T>
void load_scaled(const void* src, float* dst, long dst_stride, int D, float mul) {
  const T* s = static_cast<const T*>(src);
  for (int d = 0; d < D; ++d) dst[d * dst_stride] = static_cast<float>(s[d]) * mul;
}
template <typename T>
void store_scaled(void* dst, const float* src, int D, float mul) {
  T* o = static_cast<T*>(dst);
  for (int d = 0; d < D; ++d) o[d] = static_cast<T>(src[d] * mul);
}
#define RLM_FLOAT_SWITCH(st, NAME, ...)                                              \
  switch (st) {                                                                     \
    case at::kFloat: NAME<float>(__VA_ARGS__); break;                               \
    case at::kBFloat16: NAME<c10::BFloat16>(__VA_ARGS__); break;                    \
    case at::kHalf: NAME<c10::Half>(__VA_ARGS__); break;                            \
    default: break;                                                                 \
  }
float* scratch(size_t n) {
  static thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// Gather the K and V rows of slots[0:n], head h, into Kb / Vb (n x Dp fp32); Kb rows n..n_pad
// are zeroed. The rows of slot j + kPrefetch are prefetched: the slots are known ahead and are
// scattered through the pool, which the hardware prefetcher cannot guess (and even for in-order
// slots a head touches only 1 / Hkv of each slot's bytes). `n_ahead` bounds the prefetch reads
// of the slots array.
#ifndef RLM_PREFETCH
#define RLM_PREFETCH 8
#endif
constexpr int kPrefetch = RLM_PREFETCH;
template <typename TK>
bool gather_kv(const Ctx& c, const int64_t* slots, int h, int n, int64_t n_ahead, int n_pad,
               float* Kb, float* Vb, bool with_k = true) {
  bool ok = true;
  const long row_bytes = (long)c.D * sizeof(TK);
  // head 0 of a work item prefetches the whole slot (every head's row, when they are adjacent):
  // the item's other heads run next on this thread and find their rows in its cache
  const bool whole = h == 0 && c.k_st1 == c.D && c.k_st0 == (long)c.Hkv * c.D &&
                     c.v_st1 == c.D && c.v_st0 == (long)c.Hkv * c.D;
  const long pf_bytes = whole ? row_bytes * c.Hkv : row_bytes;
  for (int j = 0; j < n; ++j) {
    if (j + kPrefetch < n_ahead) {
      const int64_t p = slots[j + kPrefetch];
      if (p >= 0 && p < c.n_slots) {
        const char* kp = c.k + (p * c.k_st0 + h * c.k_st1) * sizeof(TK);
        const char* vp = c.v + (p * c.v_st0 + h * c.v_st1) * sizeof(TK);
        for (long o = 0; o < pf_bytes; o += 64) {
          __builtin_prefetch(kp + o);
          __builtin_prefetch(vp + o);
        }
      }
    }
    int64_t s = slots[j];
    if (s < 0 || s >= c.n_slots) { ok = false; s = 0; }  // never read out of bounds
    if (with_k)
      row_to_f32(reinterpret_cast<const TK*>(c.k + (s * c.k_st0 + h * c.k_st1) * sizeof(TK)),
                 Kb + (long)j * c.Dp, c.D, c.Dp);
    row_to_f32(reinterpret_cast<const TK*>(c.v + (s * c.v_st0 + h * c.v_st1) * sizeof(TK)),
               Vb + (long)j * c.Dp, c.D, c.Dp);
  }
  if (with_k && n_pad > n) std::fill(Kb + (long)n * c.Dp, Kb + (long)n_pad * c.Dp, 0.f);
  return ok;
}

#include "cpu_attention_bf16.h"  // scores_bf16, scores_ext16 (AVX512-BF16)

// The online softmax of one query row over a block of base-2 scores Sg[0:n] (padded to nw, a
// multiple of W): soft-cap, mask the pad, Sg <- 2^(s - m_new) in place; m, l updated, alpha the
// factor (2^(m_old - m_new)) the row's O is scaled by before this block's P V.
inline void softmax_row(const Ctx& c, float* Sg, int n, int nw, float& m, float& l,
                        float& alpha) {
  if (c.cap2 > 0.f) softcap_scores(c, Sg, nw);
  for (int j = n; j < nw; ++j) Sg[j] = -INFINITY;
  vf bm = vset1(-INFINITY);
  for (int j = 0; j < nw; j += W) bm = vmax(bm, vload(Sg + j));
  const float m_new = std::max(m, vhmax(bm));
  const float mu = m_new == -INFINITY ? 0.f : m_new;
  vf sum = vzero(), muv = vset1(mu);
  for (int j = 0; j < nw; j += W) {
    vf p = vexp2(vsub(vload(Sg + j), muv));
    vstore(Sg + j, p);
    sum = vadd(sum, p);
  }
  alpha = std::exp2(m - mu);
  l = l * alpha + vhsum(sum);
  m = m_new;
}

#include "cpu_attention_decode.h"  // decode_item(): one pass over a decode sequence's keys

// One task: query rows r = (i - i0) * G + g of query block `blk`, keys [k0, k1) of the split.
template <typename TK>
bool run_task(const Ctx& c, const Seq& sq, const Task& t) {
  const int G = c.G, D = c.D, Dp = c.Dp, h = t.h;
  const int i0 = t.blk * sq.qb, i1 = std::min(i0 + sq.qb, sq.n_q);
  const int M = (i1 - i0) * G, Mp = round_up(M, W);
  const bool direct = (i1 - i0) == 1;
#ifdef RLM_BF16_DOT
  static const uint16_t kZeroRow[512] = {};
  const bool dot16 = direct && std::is_same_v<TK, c10::BFloat16> && c.q_type == at::kBFloat16 &&
                     D % 32 == 0 && D <= 512;
  const bool ext16 = !direct && std::is_same_v<TK, c10::BFloat16> &&
                     c.q_type == at::kBFloat16 && D % 32 == 0 && D <= 512 && Mp <= 16 * kExtNV;
#else
  const bool dot16 = false, ext16 = false;
#endif
  const int64_t k0 = t.split * sq.chunk, k1 = std::min(sq.kv_len, k0 + sq.chunk);
  const int64_t diag = sq.kv_len - sq.n_q;  // query i sees keys j <= diag + i
  const int64_t hi = c.causal ? std::min(k1, diag + i1) : k1;
  const int64_t free_hi = c.causal ? diag + i0 + 1 : k1;  // keys below: visible to all rows
  // window (causal): query i sees keys j > diag + i - window; no row sees keys below lo, and
  // keys below win_lo are cut for some rows (a one-query block has lo == win_lo: no mask)
  const int64_t win = c.window;
  const int64_t lo = win > 0 ? std::max(k0, diag + i0 - win + 1) : k0;
  const int64_t win_lo = win > 0 ? diag + i1 - win : k0;

  // scratch: Q (direct: G x Dp rows; gemm: Dp x Mp, transposed), K, V blocks, scores, O, m, l
  const int sc_len = direct ? G * KB : KB * Mp;
  float* Q = scratch((size_t)Dp * Mp + 2 * KB * Dp + sc_len + (size_t)Mp * Dp + 3 * Mp);
  float* Kb = Q + (size_t)Dp * Mp;
  float* Vb = Kb + KB * Dp;
  float* S = Vb + KB * Dp;
  float* O = S + sc_len;
  float* m = O + (size_t)Mp * Dp;
  float* l = m + Mp;
  float* alpha = l + Mp;
  std::fill(Q, Q + (size_t)Dp * Mp, 0.f);
  std::fill(O, O + (size_t)Mp * Dp, 0.f);
  std::fill(m, m + Mp, -INFINITY);
  std::fill(l, l + Mp, 0.f);
  for (int r = 0; r < M; ++r) {
    const int i = i0 + r / G, hq = h * G + r % G;
    const char* src = c.q + ((sq.q0 + i) * c.q_st0 + hq * c.q_st1) * c.q_esize;
    if (dot16) {  // the raw bf16 row (G x D bf16 fits in Q's G x Dp floats)
      std::memcpy(reinterpret_cast<uint16_t*>(Q) + (long)r * D, src, (size_t)D * 2);
      continue;
    }
    if (ext16) {  // Qp: pairs (D/2 x Mp x 2 bf16, in Q's Dp x Mp floats); rows >= M stay 0
      uint32_t* qp = reinterpret_cast<uint32_t*>(Q);
      for (int i = 0; i < D / 2; ++i) std::memcpy(qp + (long)i * Mp + r, src + 4 * i, 4);
      continue;
    }
    float* dst = direct ? Q + r * Dp : Q + r;
    const long dst_stride = direct ? 1 : Mp;
    RLM_FLOAT_SWITCH(c.q_type, load_scaled, src, dst, dst_stride, D, c.qscale);
  }

  bool ok = true;
  for (int64_t kb0 = lo; kb0 < hi; kb0 += KB) {
    const int n = (int)std::min<int64_t>(KB, hi - kb0), nw = round_up(n, W);
    ok &= gather_kv<TK>(c, sq.slots + kb0, h, n, hi - kb0, direct ? round_up(n, 8) : n, Kb, Vb,
                        !dot16 && !ext16);
    if (direct) {
#ifdef RLM_BF16_DOT
      if (dot16)
        scores_bf16(c, reinterpret_cast<const uint16_t*>(Q), sq.slots + kb0, h, n, S, kZeroRow);
#endif
      // S (G x KB): 8 keys at a time, accumulators along D, one transpose-add per 8 keys
      for (int g = 0; g < G; ++g) {
        const float* qg = Q + g * Dp;
        float* Sg = S + g * KB;
        for (int j0 = 0; !dot16 && j0 < n; j0 += 8) {
          vf acc[8];
          for (int u = 0; u < 8; ++u) acc[u] = vzero();
          for (int d = 0; d < Dp; d += W) {
            vf qv = vload(qg + d);
            for (int u = 0; u < 8; ++u) acc[u] = vfma(qv, vload(Kb + (j0 + u) * Dp + d), acc[u]);
          }
          reduce8(acc, Sg + j0);
        }
        softmax_row(c, Sg, n, nw, m[g], l[g], alpha[g]);
      }
    } else {
      // St (n x Mp) = K_blk . Qt; causal mask near the diagonal; softmax down each column
#ifdef RLM_BF16_DOT
      if (ext16) {
        const uint16_t* krow[kExtR];
        for (int j0 = 0; j0 < n; j0 += kExtR) {
          const int rr = std::min(kExtR, n - j0);
          for (int u = 0; u < rr; ++u) {
            int64_t sl = sq.slots[kb0 + j0 + u];
            if (sl < 0 || sl >= c.n_slots) sl = 0;  // gather_kv reports a bad slot
            krow[u] = reinterpret_cast<const uint16_t*>(c.k + (sl * c.k_st0 + h * c.k_st1) * 2);
          }
          kScoresExt[rr - 1][Mp / 16 - 1](reinterpret_cast<const uint16_t*>(Q), Mp, krow, D,
                                           c.qscale, S + (long)j0 * Mp);
        }
      } else
#endif
      gemm(n, Mp, Dp, Kb, Dp, 1, Q, Mp, S, Mp, false);
      if (c.cap2 > 0.f) softcap_scores(c, S, (long)n * Mp);
      if (kb0 < win_lo) {
        for (int j = 0; j < n; ++j) {
          const int64_t end_i = kb0 + j - diag + win;  // first query past this key's window
          const int cut = (int)std::min<int64_t>(M, std::max<int64_t>(0, (end_i - i0) * G));
          std::fill(S + (long)j * Mp + cut, S + (long)j * Mp + M, -INFINITY);
        }
      }
      if (kb0 + n > free_hi) {
        for (int j = 0; j < n; ++j) {
          const int64_t first_i = kb0 + j - diag;  // first query that sees this key
          const int cut = (int)std::min<int64_t>(M, std::max<int64_t>(0, (first_i - i0) * G));
          std::fill(S + (long)j * Mp, S + (long)j * Mp + cut, -INFINITY);
        }
      }
      for (int r = 0; r < Mp; r += W) {
        vf mv = vload(m + r), bm = vset1(-INFINITY);
        for (int j = 0; j < n; ++j) bm = vmax(bm, vload(S + (long)j * Mp + r));
        vf m_new = vmax(mv, bm), mu = vfinite_or_zero(m_new), sum = vzero();
        for (int j = 0; j < n; ++j) {
          vf p = vexp2(vsub(vload(S + (long)j * Mp + r), mu));
          vstore(S + (long)j * Mp + r, p);
          sum = vadd(sum, p);
        }
        vf a = vexp2(vsub(mv, mu));
        vstore(alpha + r, a);
        vstore(l + r, vfma(vload(l + r), a, sum));
        vstore(m + r, m_new);
      }
    }
    for (int r = 0; r < M; ++r) {
      if (alpha[r] == 1.f) continue;
      vf a = vset1(alpha[r]);
      for (int d = 0; d < Dp; d += W) vstore(O + r * Dp + d, vmul(vload(O + r * Dp + d), a));
    }
    if (direct)
      gemm(M, Dp, n, S, KB, 1, Vb, Dp, O, Dp, true);
    else
      gemm(M, Dp, n, S, 1, Mp, Vb, Dp, O, Dp, true);
  }

  for (int r = 0; r < M; ++r) {
    const int i = i0 + r / G, hq = h * G + r % G;
    if (t.part >= 0) {  // unnormalized partial; the merge pass finishes it
      const int64_t row = t.part + (int64_t)t.split * M + r;
      std::copy(O + r * Dp, O + (r + 1) * Dp, c.part_o + row * Dp);
      c.part_ml[2 * row] = m[r];
      c.part_ml[2 * row + 1] = l[r];
      continue;
    }
    const int64_t tq = sq.q0 + i;
    char* dst = c.out + (tq * c.o_st0 + hq * c.o_st1) * c.o_esize;
    RLM_FLOAT_SWITCH(c.o_type, store_scaled, dst, O + r * Dp, D, l[r] > 0.f ? 1.f / l[r] : 0.f);
    if (c.lse) c.lse[tq * c.Hq + hq] = l[r] > 0.f ? (m[r] + std::log2(l[r])) * kLn2 : -INFINITY;
  }
  return ok;
}

// Combine the splits of one (sequence, head, query block) group by log-sum-exp.
void merge_group(const Ctx& c, const Seq& sq, const Task& t) {
  const int G = c.G, Dp = c.Dp;
  const int i0 = t.blk * sq.qb, i1 = std::min(i0 + sq.qb, sq.n_q), M = (i1 - i0) * G;
  float* acc = scratch(Dp);
  for (int r = 0; r < M; ++r) {
    float mmax = -INFINITY;
    for (int s = 0; s < sq.nsplit; ++s) mmax = std::max(mmax, c.part_ml[2 * (t.part + s * M + r)]);
    std::fill(acc, acc + Dp, 0.f);
    float L = 0.f;
    if (mmax != -INFINITY) {
      for (int s = 0; s < sq.nsplit; ++s) {
        const int64_t row = t.part + (int64_t)s * M + r;
        const float w = std::exp2(c.part_ml[2 * row] - mmax);
        if (w == 0.f) continue;
        L += w * c.part_ml[2 * row + 1];
        vf wv = vset1(w);
        for (int d = 0; d < Dp; d += W)
          vstore(acc + d, vfma(wv, vload(c.part_o + row * Dp + d), vload(acc + d)));
      }
    }
    const int64_t tq = sq.q0 + i0 + r / G;
    const int hq = t.h * G + r % G;
    char* dst = c.out + (tq * c.o_st0 + hq * c.o_st1) * c.o_esize;
    RLM_FLOAT_SWITCH(c.o_type, store_scaled, dst, acc, c.D, L > 0.f ? 1.f / L : 0.f);
    if (c.lse) c.lse[tq * c.Hq + hq] = L > 0.f ? (mmax + std::log2(L)) * kLn2 : -INFINITY;
  }
}

// f(i) for i in [0, n) on the claim pool (this thread and its helpers); alone where the pool is
// busy (another caller's job) or there is one task.
template <class F>
void pool_for(int64_t n, F& f) {
  if (n <= 0) return;
  const int helpers = static_cast<int>(std::min<int64_t>(at::get_num_threads(), n)) - 1;
  auto call = [](void* ctx, int64_t i) { (*static_cast<F*>(ctx))(i); };
  if (!radixlm_quant::claim_pool().run(n, helpers, call, &f))
    for (int64_t i = 0; i < n; ++i) f(i);
}

// Plan tasks (query blocks, key splits), run them biggest first, merge the splits.
// A work item is the Hkv tasks of one (sequence, query block, key split), run one after another
// on one thread. The heads of a slot are adjacent in the pool (Hkv x D per slot): head 0's pass
// prefetches every head's bytes of each slot (gather_kv), so the next heads' passes read them
// from this core's cache instead of memory. Measured on SmolLM2-135M's decode (3 KV heads, 32
// requests x 230 keys, 2-core EPYC, 2026-11-26): per-head tasks took 21-25 ms per step against
// 15 ms for the same bytes laid out one head per slot; grouping the tasks alone changed nothing,
// grouping plus the whole-slot prefetch took 0.78x the time (benchmarks/cpu_attention_ab.py).
template <typename TK>
void run_all(Ctx& c, std::vector<Seq>& seqs) {
  [[maybe_unused]] const at::ScalarType kv_type =
      std::is_same_v<TK, float> ? at::kFloat
                                : (std::is_same_v<TK, c10::BFloat16> ? at::kBFloat16 : at::kHalf);
  const int H = c.Hkv;
  int64_t base = 0, work = 0;
  for (auto& sq : seqs) {
    sq.qb = std::max(1, std::min(sq.n_q, kTargetRows / c.G));
    base += (sq.n_q + sq.qb - 1) / sq.qb;
    work += sq.kv_len * sq.n_q;
  }
  // Little work (batch-1 decode of a short context: SmolLM2 at 300 keys is ~20 us) runs on this
  // thread alone, unsplit: a 2-thread OpenMP region here woke the team's other thread (asleep
  // while the GEMMs ran on quant_pool.h's helper) twice a layer, and that wait was ~80% of a
  // batch-1 decode step on the loaded 2-core box (py-spy, 2026-11-27)
  // the pool only where the step's GEMMs run on it too (quant_direct.h's kPoolMaxM rows): next
  // to OpenMP GEMMs (a 64-token extend over a 300-token prefix) its helper and OpenMP's spinning
  // threads shared the second core, and such an extend took 6% longer than on one thread
  int64_t q_rows = 0;
  bool all_decode = true;
  for (const auto& sq : seqs) {
    q_rows += sq.n_q;
    all_decode = all_decode && sq.n_q == 1;
  }
  const int64_t pairs = work * H * c.G;
  const int64_t pool_from = all_decode && seqs.size() > 1 ? kMinPoolRowsWork : kMinPoolWork;
  const bool pooled = pairs < kMinParallelWork && pairs >= pool_from && q_rows <= kPoolRows &&
                      at::get_num_threads() > 1;
  const int nt = pairs < kMinParallelWork && !pooled ? 1 : std::max(1, at::get_num_threads());
  // too few work items to keep every thread busy (batch-1 decode, one shared prefix): split the
  // key ranges of long sequences so there are ~8 items per thread
  const int64_t want = nt > 1 ? 8 * nt : 0;
  const int64_t target = base > 0 && base < want ? (want + base - 1) / base : 1;
  int64_t part_rows = 0;
  std::vector<Task> tasks, groups;  // tasks: item i is tasks[i * H .. i * H + H)
  std::vector<double> item_cost;
  std::vector<int64_t> part(H);
  // A decode batch (one query a sequence) splits each sequence as it would alone in a batch of
  // one: a row's key splits, so its sums and their merge, then do not depend on the rows beside
  // it, and a speculative verify run as decode rows (speculative/verify.py's as_decode) gives
  // bit for bit what plain batch-1 steps give, in bf16 too. (Batch 1 plans as before; a wider
  // decode batch splits only rows of >= kMinPoolWork pairs, where merging 8 x threads splits
  // costs little beside reading the keys.)
  const int threads = at::get_num_threads();
  for (int s = 0; s < (int)seqs.size(); ++s) {
    Seq& sq = seqs[s];
    int64_t seq_target = target;
    if (all_decode)
      seq_target = sq.kv_len * H * c.G >= kMinPoolWork && threads > 1 ? 8 * threads : 1;
    sq.nsplit = (int)std::min(seq_target, std::max<int64_t>(1, sq.kv_len / kMinSplit));
    sq.chunk = std::max<int64_t>(1, (sq.kv_len + sq.nsplit - 1) / sq.nsplit);
    const int nblk = (sq.n_q + sq.qb - 1) / sq.qb;
    for (int b = 0; b < nblk; ++b) {
      const int rows = (std::min(sq.n_q, (b + 1) * sq.qb) - b * sq.qb) * c.G;
      for (int h = 0; h < H; ++h) {
        part[h] = -1;
        if (sq.nsplit > 1) {
          part[h] = part_rows;
          part_rows += (int64_t)sq.nsplit * rows;
          groups.push_back({s, h, b, 0, part[h], 0.0});
        }
      }
      // cost ~ (rows + overhead) x (keys seen + overhead); causal blocks see fewer keys
      int64_t keys = c.causal ? std::clamp<int64_t>(sq.kv_len - sq.n_q + (b + 1) * sq.qb,
                                                    0, sq.kv_len)
                              : sq.kv_len;
      if (c.window > 0) keys = std::min<int64_t>(keys, c.window + sq.qb);
      const double cost = (rows + 8.0) * ((double)keys / sq.nsplit + 16.0);
      for (int sp = 0; sp < sq.nsplit; ++sp) {
        for (int h = 0; h < H; ++h) tasks.push_back({s, h, b, sp, part[h], cost});
        item_cost.push_back(cost * H);
      }
    }
  }
  std::vector<float> part_o((size_t)part_rows * c.Dp), part_ml((size_t)part_rows * 2);
  c.part_o = part_o.data();
  c.part_ml = part_ml.data();
  std::vector<int> order(item_cost.size());
  for (int i = 0; i < (int)order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return item_cost[a] > item_cost[b]; });

  std::atomic<bool> ok{true};
  const int n = (int)order.size(), ng = (int)groups.size();
  if (pooled) {  // one item a claim (no prefetch of the next item's keys), then the merges
    auto item = [&](int64_t i) {
      const Task* it = &tasks[(size_t)order[i] * H];
      const Seq& sq = seqs[it->s];
#ifdef RLM_DECODE_ITEM
      if (decode_item_ok(c, kv_type, sq)) {
        if (!decode_item(c, sq, it, true, nullptr, 0)) ok = false;
        return;
      }
#endif
      for (int h = 0; h < H; ++h)
        if (!run_task<TK>(c, sq, it[h])) ok = false;
    };
    pool_for(n, item);
    auto merge = [&](int64_t i) { merge_group(c, seqs[groups[i].s], groups[i]); };
    pool_for(ng, merge);
    TORCH_CHECK(ok.load(), "cpu_attention: req_to_token holds a slot outside the KV pool");
    return;
  }
  // dynamic scheduling, biggest first, with a thread claiming its next item when it starts one,
  // so a decode item can prefetch the next one's first keys while it computes its last
  std::atomic<int> next_item{0};
#pragma omp parallel num_threads(std::min(nt, std::max(1, n)))
  {
    int i = next_item.fetch_add(1);
    bool first = true;
    while (i < n) {
      const int j = next_item.fetch_add(1);
      const Task* item = &tasks[(size_t)order[i] * H];
      const Seq& sq = seqs[item->s];
#ifdef RLM_DECODE_ITEM
      if (decode_item_ok(c, kv_type, sq)) {
        const int64_t* nx = nullptr;
        int nx_n = 0;
        if (j < n) {
          const Task* nt_item = &tasks[(size_t)order[j] * H];
          const Seq& ns = seqs[nt_item->s];
          if (decode_item_ok(c, kv_type, ns)) {
            const auto [nlo, nhi] = decode_range(c, ns, nt_item->split);
            nx = ns.slots + nlo;
            nx_n = (int)std::clamp<int64_t>(nhi - nlo, 0, KB);
          }
        }
        if (!decode_item(c, sq, item, first, nx, nx_n)) ok = false;
        first = false;
        i = j;
        continue;
      }
#endif
      for (int h = 0; h < H; ++h)
        if (!run_task<TK>(c, sq, item[h])) ok = false;
      first = true;
      i = j;
    }
  }
#pragma omp parallel for num_threads(std::min(nt, std::max(1, ng))) schedule(dynamic, 1)
  for (int i = 0; i < ng; ++i) merge_group(c, seqs[groups[i].s], groups[i]);
  TORCH_CHECK(ok.load(), "cpu_attention: req_to_token holds a slot outside the KV pool");
}

}  // namespace

void dispatch(Ctx& c, at::ScalarType kv_type, std::vector<Seq>& seqs) {
  if (seqs.empty()) return;
  switch (kv_type) {
    case at::kFloat: run_all<float>(c, seqs); break;
    case at::kBFloat16: run_all<c10::BFloat16>(c, seqs); break;
    default: run_all<c10::Half>(c, seqs); break;
  }
}

}  // namespace radixlm_attn
