// y (M, N) fp32 = x (M, K) @ dequant(W)^T with W kept in GGUF's on-disk block layout:
// the ops torch.ops.radixlm_quant.{gemm, dequant, isa}. The Python side (build, cache, fallback)
// is radixlm/runtime/layers/quant_kernels.py; the layer using it is layers/quantized_linear.py.
//
// W is (N, row_bytes) uint8: each output row is K / BK blocks laid end to end (a GGUF tensor's
// rows are independent, blocks run along K). Formats, by their ggml type id (ggml-common.h):
//   Q4_1 (3)   32 values in 20 bytes:  fp16 d, fp16 m, 16 bytes of nibbles;
//              w[i] = d * q[i] + m, q[i] = low nibble of byte i (i < 16), high of byte i - 16
//   Q8_0 (8)   32 values in 34 bytes:  fp16 d, 32 int8; w[i] = d * q[i]
//   Q4_K (12)  256 values in 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) pairs
//              for 8 sub-blocks of 32, 128 bytes of nibbles (bytes 32c..32c+31: low nibbles are
//              sub-block 2c, high nibbles 2c+1); w = (d * sc[j]) * q - (dmin * mn[j])
//   Q6_K (14)  256 values in 210 bytes: 6-bit q in 128 + 64 bytes, 16 int8 scales, fp16 d;
//              w = (d * sc[j]) * (q - 32) (llama.cpp's Q4_K_M files keep some tensors in Q6_K)
// Q4_K / Q6_K blocks are dequantized to fp32 in registers and FMA'd into fp32 accumulators: the
// dequantized values are bit-identical to gguf.quants' (each is one fp32 rounding of the same
// exact product / sum: d * q is exact for a fp16 d and a 4- or 8-bit q, so fma(q, d, m) rounds
// once, as d * q + m does; Q6_K's (d * sc) * q rounds once in both; the dequant op gives those
// values for every format), so y differs from "dequantize, then fp32 matmul" only in summation
// order. Q4_1 / Q8_0 take the block's scale out of the sums (the AVX-512 kernels and
// quant_direct.h's row_dot alike): d * (q . x) (+ m * sum(x)), other roundings within the same
// fp32 tolerance.
//
// Work split: for up to 16 rows (decode) the claim pool of quant_pool.h, in chunks of whole
// NB-row tasks (~8 per thread); otherwise OpenMP (dynamic: on a shared box a preempted thread
// then delays only its current task) over blocks of NB output rows. On AVX-512 the Q4_1 / Q8_0
// kernels are quant_avx512.h's (block scales factored out), with bf16 x quant_bf16.h's (VDPBF16PS
// on the weights rounded to bf16, where the CPU has AVX512-BF16; the many-row paths then round
// their tiles alike: bf16_weights). Inside a task, each x tile of MB <= 8 rows (bf16: 16) runs
// against each W row of the block (the W block stays in L1/L2 across the x tiles). Decode
// (M = 1..8, bf16 1..16) reads every weight byte once: 4-8x fewer bytes than the fp32 GEMM's.
// Large M is better served by dequantized fp32 + a BLAS GEMM: gemm_tiled (per-thread tiles) and
// gemm_chunked (16 MiB chunks, one multithreaded GEMM each); layers/quantized_linear.py picks per M.
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "quant_direct.h"
#include "quant_formats.h"

using namespace radixlm_quant;

namespace {

// rows n < N of w (N, row_bytes) -> out (N, K) fp32, on the calling thread
template <class F>
void dequant_rows(const uint8_t* w, int64_t N, int64_t K, float* out) {
  const int64_t row_bytes = K / F::BK * F::BYTES;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t bi = 0; bi < K / F::BK; ++bi) {
      const uint8_t* b = w + n * row_bytes + bi * F::BYTES;
      const auto p = F::prep(b);
      for (int g = 0; g < F::BK / 32; ++g) {
        V v[4];
        F::group(b, p, g, v);
        for (int i = 0; i < 4; ++i) vstore(out + n * K + bi * F::BK + g * 32 + 8 * i, v[i]);
      }
    }
}

template <class F>
void dequant_impl(const uint8_t* w, int64_t N, int64_t K, float* out) {
  const int64_t row_bytes = K / F::BK * F::BYTES, chunk = 16;
  const int64_t ntask = (N + chunk - 1) / chunk;
  const int nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntask));
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t t = 0; t < ntask; ++t)
    dequant_rows<F>(w + t * chunk * row_bytes, std::min(chunk, N - t * chunk), K, out + t * chunk * K);
}

// (block values, block bytes) of a format id; BK 0 for an unknown id
void fmt_info(int64_t fmt, int& bk, int& bytes) {
  switch (fmt) {
    case 3: bk = Q4_1::BK; bytes = Q4_1::BYTES; return;
    case 8: bk = Q8_0::BK; bytes = Q8_0::BYTES; return;
    case 12: bk = Q4_K::BK; bytes = Q4_K::BYTES; return;
    case 14: bk = Q6_K::BK; bytes = Q6_K::BYTES; return;
    default: bk = 0; bytes = 0;
  }
}

void check_w(const at::Tensor& w, int64_t fmt, int64_t K) {
  int bk, bytes;
  fmt_info(fmt, bk, bytes);
  TORCH_CHECK(bk > 0, "quant_gemm: unsupported format id (Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14)");
  TORCH_CHECK(K > 0 && K % bk == 0, "quant_gemm: K must be a positive multiple of the block size");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 &&
                  w.is_contiguous() && w.size(1) == K / bk * bytes,
              "quant_gemm: w must be a contiguous uint8 (N, K / block * block_bytes) CPU tensor");
}

// Whether the direct kernel multiplies x by the weights rounded to bf16 (quant_bf16.h: Q4_1 /
// Q8_0 against a bf16 model's activations on an AVX512-BF16 CPU). The many-row paths then round
// their dequantized tiles alike, so that every row count of that model multiplies the same
// weights: those of its dense bf16 weight (and of HF transformers loading the GGUF as bf16).
bool bf16_weights(const at::Tensor& x, int64_t fmt) {
#ifdef RLQ_AVX512BF16
  return (fmt == 3 || fmt == 8) && x.scalar_type() == at::kBFloat16;
#else
  (void)x, (void)fmt;
  return false;
#endif
}

void round_bf16(float* p, int64_t n) {  // to nearest even, as torch's .to(torch.bfloat16)
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(c10::BFloat16(p[i]));
}

}  // namespace

// x (M, K) float32 / bfloat16 / float16 -> y (M, N) float32
at::Tensor gemm(const at::Tensor& x_in, const at::Tensor& w, int64_t fmt, int64_t K) {
  check_w(w, fmt, K);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K && x_in.device().is_cpu(),
              "quant_gemm: x must be a (M, K) CPU tensor");
#ifdef RLQ_AVX512BF16
  if ((fmt == 3 || fmt == 8) && x_in.scalar_type() == at::kBFloat16) {  // a bf16 model's layers
    const at::Tensor xb = x_in.contiguous();
    const int64_t M = xb.size(0), N = w.size(0);
    at::Tensor y = at::empty({M, N}, xb.options().dtype(at::kFloat));
    if (M == 0 || N == 0) return y;
    const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
    if (fmt == 3)
      gemm_bf16x<Q4_1bf>(xp, M, K, w.data_ptr<uint8_t>(), N, y.data_ptr<float>());
    else
      gemm_bf16x<Q8_0bf>(xp, M, K, w.data_ptr<uint8_t>(), N, y.data_ptr<float>());
    return y;
  }
#endif
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  switch (fmt) {
    case 3: gemm_impl<Q4_1>(xp, M, K, wp, N, yp); break;
    case 8: gemm_impl<Q8_0>(xp, M, K, wp, N, yp); break;
    case 12: gemm_impl<Q4_K>(xp, M, K, wp, N, yp); break;
    default: gemm_impl<Q6_K>(xp, M, K, wp, N, yp); break;
  }
  return y;
}

// gemm(x, w).to(x.dtype).float() in one pass on this thread: the logits of a bf16 / fp16 model
// (LlamaForCausalLM.compute_logits rounds them through the hidden states' dtype). Two torch
// casts of SmolLM2's 49152 logits each ran a 2-thread OpenMP region, ~10% of a batch-1 decode
// step on the loaded 2-core box; the rounding is c10's, the same round-to-nearest-even.
at::Tensor gemm_rounded(const at::Tensor& x_in, const at::Tensor& w, int64_t fmt, int64_t K) {
  at::Tensor y = gemm(x_in, w, fmt, K);
  float* p = y.data_ptr<float>();
  const int64_t n = y.numel();
  if (x_in.scalar_type() == at::kBFloat16) {
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(c10::BFloat16(p[i]));
  } else if (x_in.scalar_type() == at::kHalf) {
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(c10::Half(p[i]));
  }
  return y;
}

// w (N, row_bytes) -> (N, K) float32, the values gguf.quants.dequantize gives
at::Tensor dequant(const at::Tensor& w, int64_t fmt, int64_t K) {
  check_w(w, fmt, K);
  const int64_t N = w.size(0);
  at::Tensor out = at::empty({N, K}, w.options().dtype(at::kFloat));
  if (N == 0) return out;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  switch (fmt) {
    case 3: dequant_impl<Q4_1>(wp, N, K, op); break;
    case 8: dequant_impl<Q8_0>(wp, N, K, op); break;
    case 12: dequant_impl<Q4_K>(wp, N, K, op); break;
    default: dequant_impl<Q6_K>(wp, N, K, op); break;
  }
  return out;
}

// Large M (prefill): the direct kernel re-dequantizes each W row once per 8 rows of x, and its
// FMA loop is no match for a BLAS GEMM's register blocking. Here each thread takes NT-row tiles
// of W in turn, dequantizes one into its own L2-sized fp32 buffer and multiplies it with a
// single-threaded BLAS GEMM (at::mm inside the parallel region: nested OpenMP is off, so MKL runs
// on the calling thread):
//   yT[n0:n0+NT] (NT, M) = tile (NT, K) @ x^T (K, M);   y = yT^T at the end.
// One parallel region per call, dynamically scheduled: on this shared 2-core box every region's
// barrier can wait a whole time slice for a preempted thread, so alternating our dequantize
// region with MKL's own per tile cost ~10 ms per tile under load. y^T keeps each tile's output
// rows contiguous; the final transpose copies M * N floats, small next to the M * N * K FMAs.
at::Tensor gemm_tiled(const at::Tensor& x_in, const at::Tensor& w, int64_t fmt, int64_t K) {
  check_w(w, fmt, K);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K && x_in.device().is_cpu(),
              "quant_gemm: x must be a (M, K) CPU tensor");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  int bk, bytes;
  fmt_info(fmt, bk, bytes);
  const int64_t row_bytes = K / bk * bytes;
  // Tiles of at most ~512 KiB of fp32 (half this CPU's per-core L2), at least 32 rows so the
  // GEMM is not thin, and a whole number of tiles per thread: 5 tiles on 2 threads left one
  // thread idle for a fifth of the call (SmolLM2's qkv, N = 960)
  const int64_t nt_max = std::max<int64_t>(1, at::get_num_threads());
  const int64_t cap = std::max<int64_t>(32, (1 << 17) / K / 16 * 16);
  const int64_t rounds = (N + nt_max * cap - 1) / (nt_max * cap);  // tiles per thread
  const int64_t NT = std::min<int64_t>(
      N, std::max<int64_t>(32, ((N + nt_max * rounds - 1) / (nt_max * rounds) + 15) / 16 * 16));
  const int64_t ntile = (N + NT - 1) / NT;
  const int nt = std::max<int64_t>(1, std::min<int64_t>(nt_max, ntile));
  const bool rounded = bf16_weights(x_in, fmt);
  at::Tensor tiles = at::empty({nt, NT, K}, x.options());
  at::Tensor yT = at::empty({N, M}, x.options());
  const at::Tensor xT = x.t();
  // the workers run ATen ops: give them the caller's thread-local state (inference mode: the
  // outputs are inference tensors, which only an inference-mode thread may write in place), as
  // at::parallel_for does; an exception must not leave the parallel region (std::terminate)
  const at::ThreadLocalState tls;
  std::string error;
#pragma omp parallel num_threads(nt)
  {
    at::ThreadLocalStateGuard tls_guard(tls);
    const int tid = omp_get_thread_num();
    float* tp = tiles.data_ptr<float>() + tid * NT * K;  // this thread's tile
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < ntile; ++i) {
      const int64_t n0 = i * NT, rows = std::min(NT, N - n0);
      const uint8_t* wp = w.data_ptr<uint8_t>() + n0 * row_bytes;
      switch (fmt) {
        case 3: dequant_rows<Q4_1>(wp, rows, K, tp); break;
        case 8: dequant_rows<Q8_0>(wp, rows, K, tp); break;
        case 12: dequant_rows<Q4_K>(wp, rows, K, tp); break;
        default: dequant_rows<Q6_K>(wp, rows, K, tp); break;
      }
      if (rounded) round_bf16(tp, rows * K);
      try {  // per iteration: every thread must still reach the loop's closing barrier
        at::Tensor dst = yT.narrow(0, n0, rows);
        at::mm_out(dst, tiles.select(0, tid).narrow(0, 0, rows), xT);
      } catch (const std::exception& e) {
#pragma omp critical
        error = e.what();
      }
    }
  }
  TORCH_CHECK(error.empty(), error.substr(0, 2000).c_str());
  return yT.t().contiguous();
}

// Very large M: dequantize chunks of up to ~16 MiB of W rows into a scratch buffer kept by the
// calling thread (no page faults after the first call) and run ONE multithreaded at::mm per chunk,
// where MKL's blocking beats per-thread GEMMs on thin tiles. Two parallel regions per chunk.
at::Tensor gemm_chunked(const at::Tensor& x_in, const at::Tensor& w, int64_t fmt, int64_t K) {
  check_w(w, fmt, K);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K && x_in.device().is_cpu(),
              "quant_gemm: x must be a (M, K) CPU tensor");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  int bk, bytes;
  fmt_info(fmt, bk, bytes);
  const int64_t row_bytes = K / bk * bytes;
  const int64_t nchunk = (N * K + (1 << 22) - 1) >> 22;  // 4 Mi floats = 16 MiB per chunk
  const int64_t CH = (N + nchunk - 1) / nchunk;
  static thread_local std::vector<float> scratch;
  if ((int64_t)scratch.size() < CH * K) scratch.resize(CH * K);
  const bool rounded = bf16_weights(x_in, fmt);
  if (nchunk == 1) {  // the whole W fits: exactly F.linear's GEMM, y = x @ W^T, no transpose
    switch (fmt) {
      case 3: dequant_impl<Q4_1>(w.data_ptr<uint8_t>(), N, K, scratch.data()); break;
      case 8: dequant_impl<Q8_0>(w.data_ptr<uint8_t>(), N, K, scratch.data()); break;
      case 12: dequant_impl<Q4_K>(w.data_ptr<uint8_t>(), N, K, scratch.data()); break;
      default: dequant_impl<Q6_K>(w.data_ptr<uint8_t>(), N, K, scratch.data()); break;
    }
    if (rounded) round_bf16(scratch.data(), N * K);
    return at::mm(x, at::from_blob(scratch.data(), {N, K}, x.options()).t());
  }
  at::Tensor yT = at::empty({N, M}, x.options());
  const at::Tensor xT = x.t();
  for (int64_t n0 = 0; n0 < N; n0 += CH) {
    const int64_t rows = std::min(CH, N - n0);
    const uint8_t* wp = w.data_ptr<uint8_t>() + n0 * row_bytes;
    switch (fmt) {
      case 3: dequant_impl<Q4_1>(wp, rows, K, scratch.data()); break;
      case 8: dequant_impl<Q8_0>(wp, rows, K, scratch.data()); break;
      case 12: dequant_impl<Q4_K>(wp, rows, K, scratch.data()); break;
      default: dequant_impl<Q6_K>(wp, rows, K, scratch.data()); break;
    }
    if (rounded) round_bf16(scratch.data(), rows * K);
    at::Tensor dst = yT.narrow(0, n0, rows);
    at::mm_out(dst, at::from_blob(scratch.data(), {rows, K}, x.options()), xT);
  }
  return yT.t().contiguous();
}

// "avx512" where the Q4_1 / Q8_0 direct kernels are quant_avx512.h's (the rest is AVX2 there),
// "avx512bf16" where Q4_1 / Q8_0 with bf16 x also take VDPBF16PS
std::string isa() {
#if defined(RLQ_AVX512BF16)
  return "avx512bf16";
#elif defined(RLQ_AVX512)
  return "avx512";
#else
  return kQuantIsa;
#endif
}

TORCH_LIBRARY(radixlm_quant, m) {
  m.def("gemm(Tensor x, Tensor w, int fmt, int K) -> Tensor");
  m.def("gemm_rounded(Tensor x, Tensor w, int fmt, int K) -> Tensor");
  m.def("gemm_tiled(Tensor x, Tensor w, int fmt, int K) -> Tensor");
  m.def("gemm_chunked(Tensor x, Tensor w, int fmt, int K) -> Tensor");
  m.def("dequant(Tensor w, int fmt, int K) -> Tensor");
  m.def("isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(radixlm_quant, CPU, m) {
  m.impl("gemm", &gemm);
  m.impl("gemm_rounded", &gemm_rounded);
  m.impl("gemm_tiled", &gemm_tiled);
  m.impl("gemm_chunked", &gemm_chunked);
  m.impl("dequant", &dequant);
}
