// The register-blocked fp32 GEMM microkernel of the CPU attention kernels (cpu_attention_kernel.cpp
// includes it inside its anonymous namespace, after defining MR / NV for the ISA): C tiles of
// MR rows x NV vectors stay in registers while K streams.
#pragma once

// ---- the GEMM microkernel ---------------------------------------------------------------------
// C (R x V*W) = [C +] A (R x K) . B (K x V*W); A(i, k) = A[i * rsa + k * csa]; B, C row-major.
template <int R, int V>
void ukernel(int K, const float* A, long rsa, long csa, const float* B, long ldb, float* C,
             long ldc, bool acc) {
  vf c[R][V];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) c[i][v] = acc ? vload(C + i * ldc + v * W) : vzero();
  for (int k = 0; k < K; ++k) {
    vf b[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) b[v] = vload(B + k * ldb + v * W);
    const float* a = A + k * csa;
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      vf ai = vset1(a[i * rsa]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) c[i][v] = vfma(ai, b[v], c[i][v]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) vstore(C + i * ldc + v * W, c[i][v]);
}

using UKernel = void (*)(int, const float*, long, long, const float*, long, float*, long, bool);
template <int V, int... R>
constexpr std::array<UKernel, sizeof...(R)> ukernel_table(std::integer_sequence<int, R...>) {
  return {&ukernel<R + 1, V>...};
}
const auto kUkNV = ukernel_table<NV>(std::make_integer_sequence<int, MR>{});
const auto kUk1 = ukernel_table<1>(std::make_integer_sequence<int, MR>{});

// C (M x N) = [C +] A (M x K) . B (K x N), N a multiple of W.
void gemm(int M, int N, int K, const float* A, long rsa, long csa, const float* B, long ldb,
          float* C, long ldc, bool acc) {
  int n = 0;
  for (; n + NV * W <= N; n += NV * W)
    for (int i = 0; i < M; i += MR)
      kUkNV[std::min(MR, M - i) - 1](K, A + i * rsa, rsa, csa, B + n, ldb, C + i * ldc + n, ldc,
                                     acc);
  for (; n < N; n += W)
    for (int i = 0; i < M; i += MR)
      kUk1[std::min(MR, M - i) - 1](K, A + i * rsa, rsa, csa, B + n, ldb, C + i * ldc + n, ldc,
                                    acc);
}
