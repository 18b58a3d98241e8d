// CPU attention over the paged KV pool, read in place through req_to_token (page size 1): the
// ops. The compute is in cpu_attention_kernel.cpp (its top comment describes the algorithm), the
// types both share in cpu_attention.h.
//
// Shapes (the Python side is radixlm/runtime/attention/cpu_kernels.py / cpu_backend.py):
//   q, out          (T, Hq, D)    any float dtype, any row/head strides, unit stride in D
//   k_buf, v_buf    (N, Hkv, D)   the pool of one layer: bf16 / fp16 / fp32, unit stride in D
//   req_to_token    (R, C) int64  slot of each token of each request row
//   lse_out         (T, Hq) fp32  natural-log-sum-exp of the scaled scores, or an empty tensor
//
// Light headers on purpose: <torch/extension.h> alone takes ~50 s of CPU to parse, these ~10 s.
// The ops are registered with the dispatcher (torch.ops.radixlm_cpu.*), not through pybind11.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_attention.h"

using namespace radixlm_vec;
using namespace radixlm_attn;

namespace {

// TORCH_CHECK with a printf-formatted message. The message reaches c10 as one `const char*`:
// TORCH_CHECK's multi-argument form builds a std::string in this .so and hands it to libc10,
// which crashed (SIGSEGV) with torch 2.11 + g++ 13 (seen on the GPU image); one C string is safe.
#define RLM_CHECKF(cond, ...)                             \
  do {                                                    \
    if (!(cond)) {                                        \
      char rlm_msg_[256];                                 \
      std::snprintf(rlm_msg_, sizeof(rlm_msg_), __VA_ARGS__); \
      TORCH_CHECK(false, static_cast<const char*>(rlm_msg_)); \
    }                                                     \
  } while (0)

bool is_float(const at::Tensor& t) {
  auto st = t.scalar_type();
  return st == at::kFloat || st == at::kBFloat16 || st == at::kHalf;
}

// Validate shapes, fill the shared part of Ctx; q / out: (T, Hq, D); k_buf / v_buf: (N, Hkv, D).
Ctx make_ctx(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
             const at::Tensor& out, const at::Tensor& lse_out, double scale, bool causal,
             int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3,
              "q, out: (T, Hq, D); k_buf, v_buf: (N, Hkv, D)");
  TORCH_CHECK(q.device().is_cpu() && k_buf.device().is_cpu() && out.device().is_cpu(), "CPU tensors");
  TORCH_CHECK(is_float(q) && is_float(out) && is_float(k_buf), "float32 / bfloat16 / float16 only");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type() && k_buf.sizes() == v_buf.sizes(),
              "k_buf and v_buf must match");
  TORCH_CHECK(q.sizes() == out.sizes(), "out must have q's shape");
  const int Hq = q.size(1), Hkv = k_buf.size(1), D = q.size(2);
  TORCH_CHECK(k_buf.size(2) == D && Hkv > 0 && Hq % Hkv == 0, "head dims: Hq % Hkv == 0, same D");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_buf.stride(2) == 1 && v_buf.stride(2) == 1,
              "the head dim must be contiguous");
  Ctx c{};
  c.q = static_cast<const char*>(q.data_ptr());
  c.q_st0 = q.stride(0); c.q_st1 = q.stride(1); c.q_type = q.scalar_type();
  c.q_esize = q.element_size();
  c.k = static_cast<const char*>(k_buf.data_ptr());
  c.v = static_cast<const char*>(v_buf.data_ptr());
  c.k_st0 = k_buf.stride(0); c.k_st1 = k_buf.stride(1);
  c.v_st0 = v_buf.stride(0); c.v_st1 = v_buf.stride(1);
  c.n_slots = k_buf.size(0);
  c.out = static_cast<char*>(out.data_ptr());
  c.o_st0 = out.stride(0); c.o_st1 = out.stride(1); c.o_type = out.scalar_type();
  c.o_esize = out.element_size();
  c.lse = nullptr;
  if (lse_out.numel() > 0) {
    TORCH_CHECK(lse_out.scalar_type() == at::kFloat && lse_out.is_contiguous() &&
                lse_out.dim() == 2 && lse_out.size(0) == q.size(0) && lse_out.size(1) == Hq,
                "lse_out: contiguous float32 (T, Hq)");
    c.lse = lse_out.data_ptr<float>();
  }
  c.Hq = Hq; c.Hkv = Hkv; c.G = Hq / Hkv; c.D = D; c.Dp = round_up(D, W);
  c.qscale = static_cast<float>(scale) * kLog2e;
  c.causal = causal;
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  c.window = window;
  c.cap2 = static_cast<float>(softcap) * kLog2e;
  c.cap_k = softcap > 0 ? static_cast<float>(2.0 / softcap) : 0.f;
  return c;
}

const int64_t* i64(const at::Tensor& t, int64_t n, const char* name) {
  RLM_CHECKF(t.scalar_type() == at::kLong && t.is_contiguous() && t.device().is_cpu() &&
             t.numel() == n, "%s: contiguous int64 CPU tensor of %lld elements", name, (long long)n);
  return t.data_ptr<int64_t>();
}

// Slots req_to_token[row, start : start + len] must lie inside the table.
const int64_t* slot_row(const at::Tensor& r2t, int64_t row, int64_t start, int64_t len) {
  RLM_CHECKF(row >= 0 && row < r2t.size(0), "req_pool_index %lld out of range", (long long)row);
  RLM_CHECKF(start >= 0 && len >= 0 && start + len <= r2t.size(1),
             "kv range [%lld, %lld) exceeds req_to_token's %lld columns", (long long)start,
             (long long)(start + len), (long long)r2t.size(1));
  return r2t.data_ptr<int64_t>() + row * r2t.stride(0) + start;
}

void check_r2t(const at::Tensor& r2t) {
  TORCH_CHECK(r2t.scalar_type() == at::kLong && r2t.dim() == 2 && r2t.stride(1) == 1,
              "req_to_token: (R, C) int64, rows contiguous");
}

}  // namespace

// Row b attends to slots req_to_token[req_pool_indices[b], kv_start[b] : seq_lens[b]]; with a
// window, only to the last `window` of them (the row's query is at position seq_lens[b] - 1):
// the range is cut here, so splits and the loops see only keys in the window.
void decode(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
            const at::Tensor& kv_start, const at::Tensor& seq_lens, double scale,
            int64_t window, double softcap, at::Tensor& out, at::Tensor& lse_out) {
  check_r2t(req_to_token);
  Ctx c = make_ctx(q, k_buf, v_buf, out, lse_out, scale, false, window, softcap);
  const int64_t B = q.size(0);
  const int64_t* rows = i64(req_pool_indices, B, "req_pool_indices");
  const int64_t* lens = i64(seq_lens, B, "seq_lens");
  const int64_t* starts = kv_start.numel() ? i64(kv_start, B, "kv_start") : nullptr;
  std::vector<Seq> seqs(B);
  for (int64_t b = 0; b < B; ++b) {
    int64_t st = starts ? starts[b] : 0;
    if (window > 0) st = std::max<int64_t>(st, lens[b] - window);
    const int64_t len = std::max<int64_t>(0, lens[b] - st);
    seqs[b] = Seq{slot_row(req_to_token, rows[b], st, len), len, b, 1, 1, 1, 1};
  }
  dispatch(c, k_buf.scalar_type(), seqs);
}

// Sequence s: queries q[qo_indptr[s] : qo_indptr[s+1]] (n_q rows) against the keys
// req_to_token[req_pool_indices[s], kv_start[s] : kv_start[s] + kv_len[s]]; causal: query i sees
// key j iff j <= kv_len - n_q + i, and with a window also j > kv_len - n_q + i - window (causal
// only). The keys no query of a sequence can see (below its first query's window) are cut here.
void extend(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
            const at::Tensor& qo_indptr, const at::Tensor& kv_start, const at::Tensor& kv_len,
            bool causal, double scale, int64_t window, double softcap, at::Tensor& out,
            at::Tensor& lse_out) {
  check_r2t(req_to_token);
  TORCH_CHECK(causal || window == 0, "a sliding window needs causal attention");
  Ctx c = make_ctx(q, k_buf, v_buf, out, lse_out, scale, causal, window, softcap);
  const int64_t S = req_pool_indices.numel();
  const int64_t* rows = i64(req_pool_indices, S, "req_pool_indices");
  const int64_t* indptr = i64(qo_indptr, S + 1, "qo_indptr");
  const int64_t* starts = kv_start.numel() ? i64(kv_start, S, "kv_start") : nullptr;
  const int64_t* lens = i64(kv_len, S, "kv_len");
  TORCH_CHECK(indptr[0] >= 0 && indptr[S] <= q.size(0), "qo_indptr exceeds q's rows");
  std::vector<Seq> seqs;
  seqs.reserve(S);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n_q = indptr[s + 1] - indptr[s], st = starts ? starts[s] : 0;
    TORCH_CHECK(n_q >= 0, "qo_indptr must be non-decreasing");
    if (n_q == 0) continue;
    const int64_t* slots = slot_row(req_to_token, rows[s], st, lens[s]);
    // query 0 is at position lens - n_q: no query sees keys below lens - n_q - window + 1
    const int64_t cut = window > 0 ? std::max<int64_t>(0, lens[s] - n_q - window + 1) : 0;
    seqs.push_back(Seq{slots + cut, lens[s] - cut, indptr[s], (int)n_q, 1, 1, 1});
  }
  dispatch(c, k_buf.scalar_type(), seqs);
}

// k_buf[loc[t]] = k[t], v_buf[loc[t]] = v[t] (converted to the pool's dtype); k, v: (T, Hkv, D).
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_buf, at::Tensor& v_buf,
              const at::Tensor& loc) {
  const int64_t T = k.size(0);
  const int64_t* slots = i64(loc, T, "loc");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == k_buf.size(1) &&
              k.size(2) == k_buf.size(2) && k_buf.sizes() == v_buf.sizes(), "store_kv shapes");
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < k_buf.size(0), "store_kv: slot out of range");
  if (k.scalar_type() != k_buf.scalar_type() || v.scalar_type() != v_buf.scalar_type() ||
      k.stride(2) != 1 || v.stride(2) != 1 || k_buf.stride(2) != 1 || !k_buf.is_contiguous() ||
      !v_buf.is_contiguous()) {  // rare: let ATen convert (index_copy_ takes any strides)
    k_buf.index_copy_(0, loc, k.to(k_buf.scalar_type()));
    v_buf.index_copy_(0, loc, v.to(v_buf.scalar_type()));
    return;
  }
  // the common case: same dtype, one memcpy per (token, head) row of D elements
  const int64_t H = k.size(1), rb = k.size(2) * k.element_size(), es = k.element_size();
  char* kb = static_cast<char*>(k_buf.data_ptr());
  char* vb = static_cast<char*>(v_buf.data_ptr());
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(kb + (slots[t] * H + h) * rb, ks + (t * k.stride(0) + h * k.stride(1)) * es, rb);
        std::memcpy(vb + (slots[t] * H + h) * rb, vs + (t * v.stride(0) + h * v.stride(1)) * es, rb);
      }
  });
}

// Registered as torch.ops.radixlm_cpu.{decode,extend,store_kv}; `isa` names the SIMD path.
std::string isa() { return kIsa; }

// RLM_OPS_NS lets an experiment load two builds side by side (A/B timing in one process)
#ifndef RLM_OPS_NS
#define RLM_OPS_NS radixlm_cpu
#endif
#define RLM_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define RLM_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

RLM_LIBRARY(RLM_OPS_NS, m) {
  m.def("decode(Tensor q, Tensor k_buf, Tensor v_buf, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor kv_start, Tensor seq_lens, float scale, int window, "
        "float softcap, Tensor(a!) out, Tensor(b!) lse_out) -> ()");
  m.def("extend(Tensor q, Tensor k_buf, Tensor v_buf, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor qo_indptr, Tensor kv_start, Tensor kv_len, bool causal, "
        "float scale, int window, float softcap, Tensor(a!) out, Tensor(b!) lse_out) -> ()");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor loc) -> ()");
  m.def("isa() -> str", &isa);
}

RLM_LIBRARY_IMPL(RLM_OPS_NS, CPU, m) {
  m.impl("decode", &decode);
  m.impl("extend", &extend);
  m.impl("store_kv", &store_kv);
}
