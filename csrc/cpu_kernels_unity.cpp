// The CPU kernels' one translation unit: every source of the build, compiled together.
//
// Why: each source includes torch's operator-registration headers (ATen/core/Tensor.h,
// torch/library.h), and parsing them costs ~6 CPU-s per translation unit: 5 units took 45 CPU-s
// to build, this one 24 (measured 2026-11-27, g++ 12, -O3, the 2-core Zen 4 VM). The build runs
// on every fresh machine (`make install`, `make test`, CI), where the cores are otherwise busy.
// The sources stay separate files, each readable on its own; the build's name hashes all of them
// (attention/cpu_kernels.py _SOURCES, _HEADERS).
#include "cpu_attention.cpp"
#include "cpu_attention_kernel.cpp"
#include "cpu_elementwise.cpp"
#include "cpu_gemm.cpp"
#include "cpu_layers.cpp"
