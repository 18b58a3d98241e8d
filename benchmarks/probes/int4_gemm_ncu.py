"""The int4 GEMM (layers/triton_int4_gemm.py) at M rows on a Llama-3.1-8B shape at its default
config, twice: a target for Nsight Compute, e.g.

    ncu --set full -k regex:_int4_gemm_kernel -c 2 --csv --page details \
        python benchmarks/probes/int4_gemm_ncu.py down 64"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.probes import int4_gemv_bound as P  # noqa: E402
from radixlm.runtime.layers import triton_int4_gemm as G  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
n, k = SHAPES[sys.argv[1] if len(sys.argv) > 1 else "down"]
m = int(sys.argv[2]) if len(sys.argv) > 2 else 64
lyr = P._layer(n, k)
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
for _ in range(2):
    G.gemm(x, lyr.qweight, lyr.scales, lyr.zeros, P.GROUP)
torch.cuda.synchronize()
print("done", G.gemm_config(m, n, k, P.GROUP))
