// Fused elementwise ops of the decoder layer on the CPU: RMSNorm (with the residual add), the
// SiLU-and-mul of the MLP and the rotate-half rotary, each one pass over its rows instead of the
// 4-9 torch ops (and fp32 temporaries) of models/llama.py's reference code; and the greedy
// sampler's row-wise argmax.
//
// Numerics follow that torch code step by step: fp32 math, rounded to the storage type T at the
// same places (the residual sum, the normalized row before the weight multiply, silu(gate)
// before the product, each rotated element). Only the order of the sum of squares, the exp
// polynomial (cpu_vec.h's vexp2, < 1 ulp in fp32) and FMA contraction differ, so a bf16 result
// may rarely differ from torch's by one bf16 rounding.
//
// Registered as torch.ops.radixlm_cpu.{rmsnorm, silu_and_mul, rotary_inplace, argmax_rows}; the
// Python side is radixlm/runtime/layers/cpu_fused.py (reshapes, output allocation, the switch and
// the fallback).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace radixlm_vec;

// Rows per thread: below ~this many elements a second thread costs more (an OpenMP fork and
// join, ~10-50 us on a shared 2-core VM) than it saves; decode-sized calls stay on one thread.
constexpr int64_t kGrainElems = 65536;

// Row codecs: T <-> fp32 over whole rows, in loops the compiler vectorizes (bf16 by bit ops:
// widening is a shift, narrowing rounds to nearest even and maps NaN to 0x7FC0, as c10 does).
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}
inline uint32_t bf16_bits_rne(uint32_t u) {
  uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r;
}
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = uint32_t(s[i]) << 16;
    std::memcpy(dst + i, &u, 4);
  }
}
template <>
inline void store_row<c10::BFloat16>(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, 4);
    d[i] = static_cast<uint16_t>(bf16_bits_rne(u));
  }
}
// buf[i] = float(T(buf[i])): the rounding torch applies when an op's result is stored as T
template <typename T>
inline void round_row(float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(static_cast<T>(buf[i]));
}
template <>
inline void round_row<float>(float*, int64_t) {}
template <>
inline void round_row<c10::BFloat16>(float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, buf + i, 4);
    u = bf16_bits_rne(u) << 16;
    std::memcpy(buf + i, &u, 4);
  }
}

// Per-thread fp32 row buffers, reused across calls (no allocation per call or per row).
float* scratch(int which, int64_t n) {
  static thread_local std::vector<float> bufs[3];
  if ((int64_t)bufs[which].size() < n) bufs[which].resize(n);
  return bufs[which].data();
}

int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems));
}

#include "cpu_elementwise_bf16.h"  // rmsnorm_bf16_rows, rotary_bf16 (AVX512-BF16)

// x, residual, out, sum: (R, N) with row strides; w: (N,). sum may be null (no residual).
template <typename T>
void rmsnorm_kernel(const T* x, int64_t sx, const T* res, int64_t sr, const T* w, T* out,
                    int64_t so, T* sum, int64_t ss, int64_t R, int64_t N, float eps) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (N % W == 0) {
      auto u = [](const T* p) { return reinterpret_cast<const uint16_t*>(p); };
      rmsnorm_bf16_rows(u(x), sx, res ? u(res) : nullptr, sr, u(w),
                        reinterpret_cast<uint16_t*>(out), so, reinterpret_cast<uint16_t*>(sum),
                        ss, R, N, eps);
      return;
    }
  }
#endif
  float* wf = scratch(2, N);  // the caller's thread's buffer, read by all threads below
  load_row<T>(w, wf, N);
  at::parallel_for(0, R, grain_rows(N), [&](int64_t r0, int64_t r1) {
    float* buf = scratch(0, N);
    float* tmp = scratch(1, N);
    for (int64_t r = r0; r < r1; ++r) {
      load_row<T>(x + r * sx, buf, N);
      if (res != nullptr) {  // s = x + residual, rounded to T (torch's add in T)
        load_row<T>(res + r * sr, tmp, N);
        for (int64_t i = 0; i < N; ++i) buf[i] += tmp[i];
        round_row<T>(buf, N);
        store_row<T>(buf, sum + r * ss, N);
      }
      float acc[16] = {0};  // 16 partial sums: the compiler vectorizes this loop
      int64_t i = 0;
      for (; i + 16 <= N; i += 16)
        for (int j = 0; j < 16; ++j) acc[j] += buf[i + j] * buf[i + j];
      float sq = 0.f;
      for (int j = 0; j < 16; ++j) sq += acc[j];
      for (; i < N; ++i) sq += buf[i] * buf[i];
      const float inv = 1.0f / std::sqrt(sq / static_cast<float>(N) + eps);
      for (int64_t k = 0; k < N; ++k) buf[k] *= inv;
      round_row<T>(buf, N);  // (x * rsqrt(...)).to(T), then weight * that in T
      for (int64_t k = 0; k < N; ++k) buf[k] *= wf[k];
      store_row<T>(buf, out + r * so, N);
    }
  });
}

// x: (R, 2I) = [gate | up] with row stride sx; out: (R, I) contiguous.
template <typename T>
void silu_mul_kernel(const T* x, int64_t sx, T* out, int64_t R, int64_t I) {
  constexpr float kLog2e = 1.4426950408889634f;
  at::parallel_for(0, R, grain_rows(2 * I), [&](int64_t r0, int64_t r1) {
    float* g = scratch(0, I);
    float* u = scratch(1, I);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * sx;
      load_row<T>(xr, g, I);
      load_row<T>(xr + I, u, I);
      int64_t i = 0;
      for (; i + W <= I; i += W) {  // silu(g) = g / (1 + exp(-g)), exp(-g) = 2^(-g log2 e)
        vf v = vload(&g[i]);
        vf e = vexp2(vmul(v, vset1(-kLog2e)));
        vstore(&g[i], vdiv(v, vadd(vset1(1.f), e)));
      }
      for (; i < I; ++i) g[i] = g[i] / (1.f + std::exp(-g[i]));
      round_row<T>(g, I);  // silu rounded to T before the product, as torch's 2 ops
      for (int64_t k = 0; k < I; ++k) g[k] *= u[k];
      store_row<T>(g, out + r * I, I);
    }
  });
}


// x: (R, H, D) with strides (sxr, sxh, 1); cos, sin: (R, D) fp32 with row strides.
// out[j] = x[j] cos[j] - x[j + D/2] sin[j]; out[j + D/2] = x[j + D/2] cos[j + D/2] + x[j] sin[j + D/2]
template <typename T>
void rotary_kernel(T* x, int64_t sxr, int64_t sxh, const float* cs, int64_t scs, const float* sn,
                   int64_t ssn, int64_t R, int64_t H, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, R, grain_rows(H * D), [&](int64_t r0, int64_t r1) {
    float* a = scratch(0, D);
    float* o = scratch(1, D);
    for (int64_t r = r0; r < r1; ++r) {
      const float* c = cs + r * scs;
      const float* s = sn + r * ssn;
      for (int64_t h = 0; h < H; ++h) {
        T* v = x + r * sxr + h * sxh;
        load_row<T>(v, a, D);
        for (int64_t j = 0; j < half; ++j) {
          o[j] = a[j] * c[j] - a[j + half] * s[j];
          o[j + half] = a[j + half] * c[j + half] + a[j] * s[j + half];
        }
        store_row<T>(o, v, D);
      }
    }
  });
}

// Row r of x (R, V) fp32 -> out[r] = torch.argmax(x[r]): the first maximum, or the first NaN
// when the row has one (torch's NaN-propagating max). Two vector passes: the max, with x - x
// summed alongside (NaN iff the row holds a NaN or an infinity, which then take the exact scalar
// path), then the first vector holding the max. torch's argmax took 0.87 ms on the sampler's
// (32, 49152) logits on this 2-core EPYC, these 2 passes ~0.2 ms.
void argmax_kernel(const float* x, int64_t sx, int64_t* out, int64_t R, int64_t V) {
  at::parallel_for(0, R, std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, V)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = x + r * sx;
      vf mv = vset1(-INFINITY), chk = vzero();
      int64_t i = 0;
      for (; i + W <= V; i += W) {
        const vf v = vload(row + i);
        mv = vmax(mv, v);
        chk = vadd(chk, vsub(v, v));
      }
      float m = vhmax(mv), c = vhsum(chk);
      for (int64_t k = i; k < V; ++k) {
        m = std::max(m, row[k]);
        c += row[k] - row[k];
      }
      int64_t at = 0;
      if (c != c) {  // a NaN or an infinity somewhere: torch's rules, one element at a time
        float best = row[0];
        for (int64_t k = 1; k < V && best == best; ++k)
          if (row[k] != row[k] || row[k] > best) { best = row[k]; at = k; }
      } else {
        int64_t k = 0;
        for (; k + W <= V; k += W)
          if (vhmax(vload(row + k)) == m) break;
        at = k;
        while (row[at] != m) ++at;
      }
      out[r] = at;
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with a contiguous last dim");
}

#define RLM_DISPATCH_FLOATS(dtype, NAME, ...)                                         \
  [&] {                                                                             \
    switch (dtype) {                                                                \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }            \
      case at::kBFloat16: { using scalar_t = c10::BFloat16; return __VA_ARGS__(); } \
      case at::kHalf: { using scalar_t = c10::Half; return __VA_ARGS__(); }         \
      default: TORCH_CHECK(false, NAME, ": unsupported dtype ", dtype);             \
    }                                                                               \
  }()

// out = weight * norm(x + residual?); with a residual, sum_out receives x + residual.
void rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps,
             const c10::optional<at::Tensor>& residual, at::Tensor& out,
             const c10::optional<at::Tensor>& sum_out) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t R = x.size(0), N = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == N, "weight must be (", N, ",) contiguous");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "x, weight and out must share a dtype");
  TORCH_CHECK(out.size(0) == R && out.size(1) == N, "out must be shaped like x");
  TORCH_CHECK(residual.has_value() == sum_out.has_value(), "residual and sum_out go together");
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    check_rows(*sum_out, "sum_out");
    TORCH_CHECK(residual->sizes() == x.sizes() && sum_out->sizes() == x.sizes(),
                "residual and sum_out must be shaped like x");
    TORCH_CHECK(residual->scalar_type() == x.scalar_type() &&
                sum_out->scalar_type() == x.scalar_type(), "residual and sum_out: x's dtype");
  }
  RLM_DISPATCH_FLOATS(x.scalar_type(), "rmsnorm", [&] {
    const scalar_t* res = residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
    scalar_t* sum = sum_out.has_value() ? sum_out->data_ptr<scalar_t>() : nullptr;
    rmsnorm_kernel<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), res,
                             residual.has_value() ? residual->stride(0) : 0,
                             weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), out.stride(0),
                             sum, sum_out.has_value() ? sum_out->stride(0) : 0, R, N,
                             static_cast<float>(eps));
  });
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(1) > 0, "argmax_rows: x must be (R, V) fp32, V > 0");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  argmax_kernel(x.data_ptr<float>(), x.stride(0), out.data_ptr<int64_t>(), x.size(0), x.size(1));
  return out;
}

void silu_and_mul(const at::Tensor& x, at::Tensor& out) {
  check_rows(x, "x");
  TORCH_CHECK(out.is_contiguous() && x.size(1) % 2 == 0 && out.size(0) == x.size(0) &&
              out.size(1) * 2 == x.size(1) && out.scalar_type() == x.scalar_type(),
              "out must be (T, I) contiguous for x (T, 2I), same dtype");
  RLM_DISPATCH_FLOATS(x.scalar_type(), "silu_and_mul", [&] {
    silu_mul_kernel<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), out.data_ptr<scalar_t>(),
                              x.size(0), out.size(1));
  });
}

void rotary_inplace(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1,
              "x must be a (T, H, D) CPU tensor with a contiguous last dim");
  const int64_t R = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0, "head dim must be even");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == R &&
                t->size(1) == D && t->stride(1) == 1, "cos/sin must be (T, D) fp32, last dim contiguous");
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && D % 32 == 0) {
    rotary_bf16(reinterpret_cast<uint16_t*>(x.data_ptr()), x.stride(0), x.stride(1),
                cos.data_ptr<float>(), cos.stride(0), sin.data_ptr<float>(), sin.stride(0), R, H,
                D);
    return;
  }
#endif
  RLM_DISPATCH_FLOATS(x.scalar_type(), "rotary_inplace", [&] {
    rotary_kernel<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1),
                            cos.data_ptr<float>(), cos.stride(0), sin.data_ptr<float>(),
                            sin.stride(0), R, H, D);
  });
}

}  // namespace

#ifndef RLM_OPS_NS
#define RLM_OPS_NS radixlm_cpu
#endif
#define RLM_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define RLM_FRAGMENT_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

RLM_FRAGMENT(RLM_OPS_NS, m) {
  m.def("rmsnorm(Tensor x, Tensor weight, float eps, Tensor? residual, Tensor(a!) out, "
        "Tensor(b!)? sum_out) -> ()");
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
  m.def("rotary_inplace(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

RLM_FRAGMENT_IMPL(RLM_OPS_NS, CPU, m) {
  m.impl("rmsnorm", &rmsnorm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_inplace", &rotary_inplace);
  m.impl("argmax_rows", &argmax_rows);
}
