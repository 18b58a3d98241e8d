"""One int4 TMA GEMV of a Llama-3.1-8B shape at the GPU's tuned config, with its math (MATH 1)
and without (MATH 0, the loads alone), twice each: a target for Nsight Compute, e.g.

    ncu --set full -k regex:_int4_gemv_tma_kernel -c 4 --csv --page details \
        python benchmarks/probes/int4_gemv_ncu.py gate_up_silu

(results/profiles/int4_gemv_gate_up_ncu-h200-c02cff1.txt: 249 registers a thread, 8 warps an SM,
issue slots 61% busy with the math against 15% without)."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.probes import int4_gemv_bound as P  # noqa: E402
from radixlm.runtime.layers import triton_int4_tma as T  # noqa: E402

n, k, silu = P.SHAPES[sys.argv[1] if len(sys.argv) > 1 else "gate_up_silu"]
cfg = T.config_for(n, k, P.GROUP, 2, torch.cuda.get_device_name())
lyr = P._layer(n, k)
x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
for math in (True, False, True, False):
    P._tma_call(lyr, x, n, k, silu, cfg, math)
torch.cuda.synchronize()
print("done", cfg)
