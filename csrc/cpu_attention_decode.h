// The one-pass decode work item of the CPU attention kernels (cpu_attention_kernel.cpp includes it
// inside its anonymous namespace, after scores_bf16 and softcap_scores): one query token of one
// sequence, every KV head, one key split, read straight from a bf16 pool.
//
// Why a path of its own: run_task handles one KV head per call, gathers V into fp32 scratch and
// multiplies it by the GEMM microkernel, so a decode step passes over each slot row once per head
// and writes and re-reads every V row. Here each block of keys is visited once: every head's
// scores (VDPBF16PS from the pool, as scores_bf16 does), the online softmax, and O += P V with
// the V rows widened to fp32 in registers. The next block's rows are prefetched (all heads, K and
// V) while this one computes.
//
// Measured (benchmarks/cpu_attention_ab.py, SmolLM2's shapes, 30 layers of KV streaming from
// memory, 2-core EPYC, 2026-11-26): a 32-request decode over 230 keys 0.56x run_task's time
// (12.8 vs 22.9 ms), one request over 2000 keys 0.61x. What the prefetch is worth: without it
// the item took 1.5x as long; the next block prefetched in one burst at the block's start, 1.9x;
// into L1 instead of L2, 1.3x.
//
// Same arithmetic as run_task's direct path, in the same order (scores, the softmax, O scaled by
// alpha, then one FMA per key in key order): the outputs are bit-identical.
#pragma once

#if defined(RLM_BF16_DOT)
#define RLM_DECODE_ITEM 1

constexpr int kDecodeGC = 4;  // query heads per register tile: 4 x 4 accumulators + 4 V vectors

// Walks the cache lines of a run of slots in address order (each slot's K bytes of every head,
// then its V bytes) and prefetches `k` of them per call: the next block's rows are requested a
// few lines at a time from inside this block's key loops, so misses stay in flight all along
// the compute instead of in one burst, and in the slot order the hardware prefetcher follows.
struct PfCursor {
  const Ctx* c;
  const int64_t* slots = nullptr;
  int n = 0, i = 0, line = 0, k_lines = 0, lines = 0;
  void reset(const Ctx& ctx, const int64_t* s, int count) {
    c = &ctx;
    slots = s;
    n = count;
    i = line = 0;
    k_lines = (int)(((long)(c->Hkv - 1) * c->k_st1 * 2 + c->D * 2 + 63) / 64);
    lines = k_lines + (int)(((long)(c->Hkv - 1) * c->v_st1 * 2 + c->D * 2 + 63) / 64);
  }
  long remaining() const { return (long)(n - i) * lines - line; }
  inline void next(int k) {
    for (; k > 0 && i < n; --k) {
      const int64_t p = slots[i];
      if (p >= 0 && p < c->n_slots) {
        const char* a = line < k_lines ? c->k + p * c->k_st0 * 2 + line * 64
                                       : c->v + p * c->v_st0 * 2 + (line - k_lines) * 64;
        __builtin_prefetch(a, 0, 2);  // into L2: prefetches to L1 ran 1.3x slower
      }
      if (++line == lines) {
        line = 0;
        ++i;
      }
    }
  }
};

// O (GC rows x 64 floats at O + d0, row stride Dp) = O * alpha + P (GC x n, row stride KB) . V,
// where V row j is 64 bf16 at vrow[j] + d0; `pf_k` lines of `pf` are prefetched per key.
template <int GC>
inline void pv_tile(const float* P, const float* alpha, int n, const uint16_t* const* vrow,
                    int d0, float* O, int Dp, PfCursor& pf, int pf_k) {
  vf acc[GC][4];
  for (int g = 0; g < GC; ++g) {
    const vf a = vset1(alpha[g]);
    for (int v = 0; v < 4; ++v) acc[g][v] = vmul(vload(O + g * Dp + d0 + v * W), a);
  }
  for (int j = 0; j < n; ++j) {
    pf.next(pf_k);
    const uint16_t* vp = vrow[j] + d0;
    vf b[4];
    for (int v = 0; v < 4; ++v) b[v] = vload_bf16(vp + v * W);
    for (int g = 0; g < GC; ++g) {
      const vf a = vset1(P[g * KB + j]);
      for (int v = 0; v < 4; ++v) acc[g][v] = vfma(a, b[v], acc[g][v]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int v = 0; v < 4; ++v) vstore(O + g * Dp + d0 + v * W, acc[g][v]);
}

using PvTile = void (*)(const float*, const float*, int, const uint16_t* const*, int, float*, int,
                       PfCursor&, int);
constexpr PvTile kPvTiles[kDecodeGC] = {&pv_tile<1>, &pv_tile<2>, &pv_tile<3>, &pv_tile<4>};

// Whether decode_item can run a sequence of this call: bf16 pool and q, whole 64-float tiles.
inline bool decode_item_ok(const Ctx& c, at::ScalarType kv_type, const Seq& sq) {
  return kv_type == at::kBFloat16 && c.q_type == at::kBFloat16 && sq.n_q == 1 && c.D % 64 == 0 &&
         c.D <= 512;
}

// The keys [lo, hi) that split `split` of a one-query sequence reads.
inline std::pair<int64_t, int64_t> decode_range(const Ctx& c, const Seq& sq, int split) {
  const int64_t k0 = split * sq.chunk, k1 = std::min(sq.kv_len, k0 + sq.chunk);
  const int64_t diag = sq.kv_len - 1;
  const int64_t hi = c.causal ? std::min(k1, diag + 1) : k1;
  const int64_t lo = c.window > 0 ? std::max(k0, diag - c.window + 1) : k0;
  return {lo, hi};
}

// One work item: tasks[0:Hkv] are its heads' tasks (same sequence, split; their own partial rows).
// `next_slots[0:next_n]`: the first block of the item this thread runs next, prefetched during
// this item's last block (and already requested when this item starts, unless `first`).
bool decode_item(const Ctx& c, const Seq& sq, const Task* tasks, bool first,
                 const int64_t* next_slots, int next_n) {
  const int G = c.G, D = c.D, Dp = c.Dp, H = c.Hkv, Hq = c.Hq;
  const auto [lo, hi] = decode_range(c, sq, tasks[0].split);
  static const uint16_t kZeroRow[512] = {};

  // scratch: q (Hq x D bf16, in Hq x Dp floats), scores (G x KB), O (Hq x Dp), m, l, alpha (Hq),
  // then the block's K and V row pointers
  const size_t n_f = round_up(Hq * Dp * 2 + G * KB + 3 * Hq, 2);  // floats before the pointers
  float* Q = scratch(n_f + KB * 2);
  float* S = Q + (size_t)Hq * Dp;
  float* O = S + G * KB;
  float* m = O + (size_t)Hq * Dp;
  float* l = m + Hq;
  float* alpha = l + Hq;
  const uint16_t** vrow = reinterpret_cast<const uint16_t**>(Q + n_f);
  uint16_t* qb = reinterpret_cast<uint16_t*>(Q);
  for (int hq = 0; hq < Hq; ++hq)
    std::memcpy(qb + (long)hq * D, c.q + (sq.q0 * c.q_st0 + hq * c.q_st1) * 2, (size_t)D * 2);
  std::fill(O, O + (size_t)Hq * Dp, 0.f);
  std::fill(m, m + Hq, -INFINITY);
  std::fill(l, l + Hq, 0.f);

  bool ok = true;
  for (int64_t j = lo; j < hi; ++j)
    if (sq.slots[j] < 0 || sq.slots[j] >= c.n_slots) ok = false;  // scores_bf16 reads slot 0
  PfCursor pf;
  if (first && lo < hi) {  // a thread's first block: nothing to overlap with yet
    pf.reset(c, sq.slots + lo, (int)std::min<int64_t>(KB, hi - lo));
    pf.next((int)pf.remaining());
  }
  const int pv_calls = H * ((G + kDecodeGC - 1) / kDecodeGC) * (D / 64);
  for (int64_t kb0 = lo; kb0 < hi; kb0 += KB) {
    const int n = (int)std::min<int64_t>(KB, hi - kb0), nw = round_up(n, W);
    const int64_t* slots = sq.slots + kb0;
    if (kb0 + n < hi)
      pf.reset(c, slots + n, (int)std::min<int64_t>(KB, hi - kb0 - n));
    else
      pf.reset(c, next_slots, next_n);
    const int pf_k = (int)((pf.remaining() + (long)pv_calls * n - 1) / ((long)pv_calls * n));
    for (int h = 0; h < H; ++h) {
      scores_bf16(c, qb + (long)h * G * D, slots, h, n, S, kZeroRow);
      float* mh = m + h * G;
      float* lh = l + h * G;
      float* ah = alpha + h * G;
      for (int g = 0; g < G; ++g) softmax_row(c, S + g * KB, n, nw, mh[g], lh[g], ah[g]);
      for (int j = 0; j < n; ++j) {
        int64_t s = slots[j];
        if (s < 0 || s >= c.n_slots) s = 0;
        vrow[j] = reinterpret_cast<const uint16_t*>(c.v + (s * c.v_st0 + h * c.v_st1) * 2);
      }
      for (int g0 = 0; g0 < G; g0 += kDecodeGC) {
        const int gc = std::min(kDecodeGC, G - g0);
        for (int d0 = 0; d0 < D; d0 += 64)
          kPvTiles[gc - 1](S + g0 * KB, ah + g0, n, vrow, d0, O + (long)(h * G + g0) * Dp, Dp, pf,
                           pf_k);
      }
    }
  }

  for (int h = 0; h < H; ++h) {
    const Task& t = tasks[h];
    for (int g = 0; g < G; ++g) {
      const int hq = h * G + g;
      const float* o = O + (long)hq * Dp;
      if (t.part >= 0) {  // unnormalized partial; the merge pass finishes it
        const int64_t row = t.part + (int64_t)t.split * G + g;
        std::copy(o, o + Dp, c.part_o + row * Dp);
        c.part_ml[2 * row] = m[hq];
        c.part_ml[2 * row + 1] = l[hq];
        continue;
      }
      char* dst = c.out + (sq.q0 * c.o_st0 + hq * c.o_st1) * c.o_esize;
      RLM_FLOAT_SWITCH(c.o_type, store_scaled, dst, o, D, l[hq] > 0.f ? 1.f / l[hq] : 0.f);
      if (c.lse) c.lse[sq.q0 * Hq + hq] = l[hq] > 0.f ? (m[hq] + std::log2(l[hq])) * kLn2 : -INFINITY;
    }
  }
  return ok;
}
#endif
