// A run of Llama decoder layers in one op: the same kernels models/llama.py calls layer by layer
// on the CPU fast path (cpu_fused's RMSNorm and rotary, cpu_gemm's packed GEMMs, store_kv and the
// decode / extend attention), called from C++ in the same order on the same arguments, so the
// results are bit-identical. The Python side (layers/cpu_layer_stack.py) decides when it applies.
//
// Why: a 32-request decode step of SmolLM2 (30 layers) makes ~270 custom-op calls and ~1,500
// tensor views, reshapes and allocations from Python, each a few microseconds of interpreter and
// dispatcher work while the other core waits at the next parallel region: a model of SmolLM2's
// layer count with tiny weights ran a decode step in 7.8 ms, against ~38 ms for the real one
// (2-core EPYC). Here a step makes one Python call; the ops are reached through the dispatcher's
// unboxed path (~0.2 us a call), which also keeps the A/B builds of RLM_OPS_NS apart.
//
// Per layer l (weights[10 l : 10 l + 10] = norm1, qkv, qkv_bias, o, o_bias, norm2, gate_up, down,
// q_norm, k_norm; an empty bias or q/k norm tensor means none):
//   h, residual = rmsnorm(x, norm1[, residual])        (the first layer: residual = x)
//   qkv = gemm(h, qkv); [Qwen3: rmsnorm of each q and k head]; rotary(q, k heads);
//   store_kv(k, v -> the layer's pool)
//   o = decode (plain or shared-prefix) or extend attention(q); h = gemm(o, o_proj)
//   h, residual = rmsnorm(h, norm2, residual); x = gemm(gemm_silu(h, gate_up), down)
// and returns (x, residual): the stack's output is x + residual.
//
// kinds[4 l + i] says how layer l's projection i (qkv, o, gate_up, down) multiplies, as the
// Python layer would at this row count: -1 a radixlm-GEMM pack (gate_up: paired, the SiLU in the
// GEMM's epilogue); -2 (gate_up only) an unpaired pack, then silu_and_mul; fmt >= 0 a GGUF
// QuantizedLinear's blocks of that ggml type at <= 16 rows: radixlm_quant::gemm in fp32, the
// bias added in fp32, rounded to bf16 (QuantizedLinear.forward), the SiLU by silu_and_mul.
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/maximum.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#ifndef RLM_OPS_NS
#define RLM_OPS_NS radixlm_cpu
#endif
#define RLM_STR2(x) #x
#define RLM_STR(x) RLM_STR2(x)

namespace {

using OptT = c10::optional<at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow((std::string(RLM_STR(RLM_OPS_NS)) + "::" + name).c_str(), "")
      .typed<Sig>();
}

// The ops' C++ signatures (as registered), each named once.
using T_ = const at::Tensor&;
using RmsnormSig = void(T_, T_, double, const OptT&, at::Tensor&, const OptT&);
using GemmSig = at::Tensor(T_, T_, int64_t, const OptT&);
using GemmSiluSig = at::Tensor(T_, T_);
using SiluMulSig = void(T_, at::Tensor&);
using RotarySig = void(at::Tensor&, T_, T_);
using StoreKvSig = void(T_, T_, at::Tensor&, at::Tensor&, T_);
using DecodeSig = void(T_, T_, T_, T_, T_, T_, T_, double, int64_t, double, at::Tensor&,
                       at::Tensor&);
using ExtendSig = void(T_, T_, T_, T_, T_, T_, T_, T_, bool, double, int64_t, double, at::Tensor&,
                       at::Tensor&);
using QuantGemmSig = at::Tensor(T_, T_, int64_t, int64_t);

struct Ops {
  c10::TypedOperatorHandle<RmsnormSig> rmsnorm = op<RmsnormSig>("rmsnorm");
  c10::TypedOperatorHandle<GemmSig> gemm = op<GemmSig>("gemm_bf16");
  c10::TypedOperatorHandle<GemmSiluSig> gemm_silu = op<GemmSiluSig>("gemm_bf16_silu");
  c10::TypedOperatorHandle<SiluMulSig> silu_mul = op<SiluMulSig>("silu_and_mul");
  c10::TypedOperatorHandle<RotarySig> rotary = op<RotarySig>("rotary_inplace");
  c10::TypedOperatorHandle<StoreKvSig> store_kv = op<StoreKvSig>("store_kv");
  c10::TypedOperatorHandle<DecodeSig> decode = op<DecodeSig>("decode");
  c10::TypedOperatorHandle<ExtendSig> extend = op<ExtendSig>("extend");
};

// radixlm_quant::gemm, looked up when a stack first has a quantized projection (its library is
// loaded by then: the QuantizedLinear layers load it)
const c10::TypedOperatorHandle<QuantGemmSig>& quant_gemm() {
  static const auto h = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("radixlm_quant::gemm", "")
                            .typed<QuantGemmSig>();
  return h;
}

const Ops& ops() {
  static const Ops o;  // looked up at the first call, when every fragment is registered
  return o;
}

constexpr int64_t kWeights = 10;  // a layer's weights (the order above)

OptT maybe(const at::Tensor& t) { return t.defined() && t.numel() ? OptT(t) : OptT(); }

// x (T, K) bf16 times projection w of the given kind (-1: a pack with n outputs; fmt >= 0: GGUF
// blocks), plus bias (empty: none): as layers/cpu_packed.linear or QuantizedLinear.forward.
at::Tensor project(const Ops& o, const at::Tensor& x, const at::Tensor& w, int64_t kind,
                   int64_t n, const at::Tensor& bias) {
  if (kind < 0) return o.gemm.call(x, w, n, maybe(bias));
  at::Tensor y = quant_gemm().call(x, w, kind, x.size(1));
  if (bias.defined() && bias.numel()) y.add_(bias.to(at::kFloat));
  if (x.scalar_type() != at::kBFloat16 || !y.is_contiguous()) return y.to(x.scalar_type());
  // fp32 -> bf16 here, not by y.to(): the same round-to-nearest-even (c10::BFloat16's, which
  // torch's conversion also applies), without a dispatch and a TensorIterator for each of a
  // decode step's 120 small projections (~3 us each on this CPU, serial while the GEMV helpers
  // wait for the next job)
  at::Tensor out = at::empty(y.sizes(), x.options());
  const float* src = y.data_ptr<float>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  for (int64_t i = 0, e = y.numel(); i < e; ++i) dst[i] = c10::BFloat16(src[i]);
  return out;
}

// silu(gate) * up of x (T, 2I) = [gate | up]: cpu_fused.silu_and_mul.
at::Tensor silu_mul(const Ops& o, const at::Tensor& x) {
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  o.silu_mul.call(x, out);
  return out;
}

// Shared-prefix decode (attention/shared_prefix.decode_with_groups with CpuAttention's ranged
// ops): each row over its own keys [kv_start, len) with its lse; each group's members, packed,
// over the group's prefix by a non-causal extend; merged by log-sum-exp with the same torch ops
// as merge_states, into the members' rows of attn (B, hq, d).
// groups = [rows (M), qo_indptr (G+1), rep rows (G), shared lens (G), zeros (G), kv_start (B)].
void grouped_decode(const Ops& o, const at::Tensor& q, const at::Tensor& kb,
                    const at::Tensor& vb, const at::Tensor& req_to_token, const at::Tensor& rows,
                    const at::Tensor& lens, at::TensorList groups, double scale, double softcap,
                    at::Tensor& attn) {
  const at::Tensor &g_rows = groups[0], &g_indptr = groups[1], &g_reps = groups[2],
                   &g_lens = groups[3], &g_zeros = groups[4], &kv_start = groups[5];
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  o.decode.call(q, kb, vb, req_to_token, rows, kv_start, lens, scale, 0, softcap, attn, lse);
  const at::Tensor q_sh = q.index_select(0, g_rows);  // (M, hq, d), group after group
  at::Tensor o_sh = at::empty(q_sh.sizes(), q_sh.options());
  at::Tensor lse_sh = at::empty({q_sh.size(0), q_sh.size(1)}, lse.options());
  o.extend.call(q_sh, kb, vb, req_to_token, g_reps, g_indptr, g_zeros, g_lens, false, scale, 0,
                softcap, o_sh, lse_sh);
  const at::Tensor o_own = attn.index_select(0, g_rows), lse_own = lse.index_select(0, g_rows);
  const at::Tensor m = at::maximum(lse_sh, lse_own);
  const at::Tensor w_sh = at::exp(lse_sh - m).unsqueeze(-1);  // (M, hq, 1)
  const at::Tensor w_own = at::exp(lse_own - m).unsqueeze(-1);
  const at::Tensor merged =
      (o_sh.to(at::kFloat) * w_sh + o_own.to(at::kFloat) * w_own) / (w_sh + w_own);
  attn.index_copy_(0, g_rows, merged.to(attn.scalar_type()));
}

// dims = [hq, hkv, d, qkv_n, o_n, down_n, intermediate]; windows[l]: layer l's sliding window
// (0: none); groups: a decode step's prefix groups (grouped_decode), empty for none.
std::tuple<at::Tensor, at::Tensor> llama_layers(
    const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList weights, at::IntArrayRef kinds, at::IntArrayRef dims, double eps,
    at::TensorList k_bufs,
    at::TensorList v_bufs, const at::Tensor& loc, const at::Tensor& req_to_token,
    const at::Tensor& rows, const at::Tensor& lens, const at::Tensor& qo_indptr, bool decode,
    double scale, at::IntArrayRef windows, double softcap, at::TensorList groups) {
  const int64_t L = (int64_t)k_bufs.size();
  TORCH_CHECK(L > 0 && (int64_t)weights.size() == kWeights * L && (int64_t)kinds.size() == 4 * L &&
              (int64_t)v_bufs.size() == L && (int64_t)windows.size() == L && dims.size() == 7 &&
              (groups.empty() || groups.size() == 6),
              "llama_layers: 10 weights, 4 kinds, a K and a V buffer and a window per layer; "
              "7 dims; 6 group tensors or none");
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_contiguous(), "llama_layers: x must be (T, hidden)");
  const Ops& o = ops();
  const int64_t T = x_in.size(0), N = x_in.size(1);
  const int64_t hq = dims[0], hkv = dims[1], d = dims[2];
  const int64_t q_size = hq * d, kv_size = hkv * d;
  const at::Tensor empty_i64 = at::empty({0}, rows.options());
  const at::Tensor empty_f = at::empty({0}, cos.options());
  at::Tensor x = x_in, residual;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + kWeights * l;
    const int64_t* kind = kinds.data() + 4 * l;
    // input norm (the first layer: residual = x)
    at::Tensor h = at::empty({T, N}, x.options());
    if (!residual.defined()) {
      o.rmsnorm.call(x, w[0], eps, OptT(), h, OptT());
      residual = x;
    } else {
      at::Tensor s = at::empty({T, N}, x.options());
      o.rmsnorm.call(x, w[0], eps, OptT(residual), h, OptT(s));
      residual = s;
    }
    // attention: q and k heads rotated in place, k and v stored, q attends
    at::Tensor qkv = project(o, h, w[1], kind[0], dims[3], w[2]);
    at::Tensor qk;  // (T, hq + hkv, d): q heads then k heads, rotated in place
    if (w[8].numel()) {  // Qwen3's QKNormAttention: each q and k head RMS-normed, then joined
      at::Tensor qn = at::empty({T * hq, d}, x.options());
      at::Tensor kn = at::empty({T * hkv, d}, x.options());
      o.rmsnorm.call(qkv.narrow(1, 0, q_size).reshape({T * hq, d}), w[8], eps, OptT(), qn, OptT());
      o.rmsnorm.call(qkv.narrow(1, q_size, kv_size).reshape({T * hkv, d}), w[9], eps, OptT(), kn,
                     OptT());
      qk = at::cat({qn.view({T, hq, d}), kn.view({T, hkv, d})}, 1);
    } else {
      qk = qkv.narrow(1, 0, q_size + kv_size).view({T, hq + hkv, d});
    }
    o.rotary.call(qk, cos, sin);
    const at::Tensor q = qk.narrow(1, 0, hq);
    const at::Tensor k = qk.narrow(1, hq, hkv);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, hkv, d});
    at::Tensor kb = k_bufs[l], vb = v_bufs[l];
    o.store_kv.call(k, v, kb, vb, loc);
    at::Tensor attn = at::empty({T, hq, d}, x.options());
    at::Tensor no_lse = empty_f;
    if (decode && !groups.empty() && windows[l] == 0)
      grouped_decode(o, q, kb, vb, req_to_token, rows, lens, groups, scale, softcap, attn);
    else if (decode)
      o.decode.call(q, kb, vb, req_to_token, rows, empty_i64, lens, scale, windows[l], softcap,
                    attn, no_lse);
    else
      o.extend.call(q, kb, vb, req_to_token, rows, qo_indptr, empty_i64, lens, true, scale,
                    windows[l], softcap, attn, no_lse);
    at::Tensor a = project(o, attn.view({T, q_size}), w[3], kind[1], dims[4], w[4]);
    // post-attention norm with the residual add, then the MLP
    at::Tensor h2 = at::empty({T, N}, x.options()), s2 = at::empty({T, N}, x.options());
    o.rmsnorm.call(a, w[5], eps, OptT(residual), h2, OptT(s2));
    residual = s2;
    const at::Tensor act = kind[2] == -1 ? o.gemm_silu.call(h2, w[6])
                                         : silu_mul(o, project(o, h2, w[6], kind[2] == -2 ? -1
                                                                                          : kind[2],
                                                               2 * dims[6], at::Tensor()));
    x = project(o, act, w[7], kind[3], dims[5], at::Tensor());
  }
  return {x, residual};
}

}  // namespace

#define RLM_LAYERS_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define RLM_LAYERS_FRAGMENT_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

RLM_LAYERS_FRAGMENT(RLM_OPS_NS, m) {
  m.def("llama_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] weights, int[] kinds, int[] dims, "
        "float eps, Tensor[] k_bufs, Tensor[] v_bufs, Tensor loc, Tensor req_to_token, "
        "Tensor rows, Tensor lens, Tensor qo_indptr, bool decode, float scale, int[] windows, "
        "float softcap, Tensor[] groups) -> (Tensor, Tensor)");
}

RLM_LAYERS_FRAGMENT_IMPL(RLM_OPS_NS, CPU, m) { m.impl("llama_layers", &llama_layers); }
