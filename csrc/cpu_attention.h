// Shared by the two translation units of the CPU attention kernels:
//   cpu_attention.cpp         the ops: argument checks, one Seq per sequence, store_kv, and the
//                             registration with the dispatcher (torch.ops.radixlm_cpu.*)
//   cpu_attention_kernel.cpp  the compute: tasks (sequence, kv head, query block, key split),
//                             gathered K/V blocks, online softmax, the GEMM microkernel, merges;
//                             its top comment describes the algorithm
// Both are compiled with the same flags; radixlm/runtime/attention/cpu_kernels.py lists them
// (and this header) in the build and in the build cache's key.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "cpu_vec.h"

namespace radixlm_attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

// ---- per-call description -----------------------------------------------------------------------
struct Seq {
  const int64_t* slots;  // req_to_token row + kv_start: slots of this sequence's keys
  int64_t kv_len;
  int64_t q0;            // first query row in q / out
  int n_q, qb;           // query tokens, tokens per query block
  int nsplit;
  int64_t chunk;         // keys per split
};

struct Task {
  int s, h, blk, split;
  int64_t part;  // first partial row of this task's (s, h, blk) group, -1 when unsplit
  double cost;
};

struct Ctx {
  const char* q; long q_st0, q_st1; at::ScalarType q_type;
  const char* k; const char* v; long k_st0, k_st1, v_st0, v_st1; int64_t n_slots;
  char* out; long o_st0, o_st1; at::ScalarType o_type; int o_esize, q_esize;
  float* lse;  // (T, Hq) or nullptr
  int Hq, Hkv, G, D, Dp, Mp_max;
  float qscale;  // scale * log2(e): scores in base 2
  bool causal;
  // sliding window (0: none): query at position p sees keys in (p - window, p]; causal only
  int64_t window;
  // logit soft-cap c (0: none) in the base-2 score units: cap2 = c * log2(e), cap_k = 2 / c;
  // a score s (base 2) becomes cap2 * tanh(s / cap2), before any mask
  float cap2, cap_k;
  float* part_o; float* part_ml;  // split partials: (rows, Dp) and (rows, 2)
};

// Run attention for every sequence of one call (cpu_attention_kernel.cpp): plan the tasks, run
// them with OpenMP, merge key splits; kv_type is k_buf's dtype. Fills out (and lse when given).
void dispatch(Ctx& c, at::ScalarType kv_type, std::vector<Seq>& seqs);

}  // namespace radixlm_attn
