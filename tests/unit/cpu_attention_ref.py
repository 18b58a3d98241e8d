"""Shared by the CPU attention tests (test_cpu_attention.py: the kernels;
test_cpu_attention_backend.py: the backend, the wiring and the engine): the built kernels `OPS`
(loaded at first use: a test that uses them is skipped when the build tools are missing, and fails
on any other build failure), scattered KV pools, the dense fp32 reference and the tolerances.

The kernels are built once per machine (~30 s, cached under ~/.cache/radixlm/kernels; `make
install` prebuilds them).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from radixlm.runtime.attention import cpu_kernels
from radixlm.runtime.attention.cpu_kernels import CpuKernelsUnavailable

if os.environ.get("RADIXLM_DISABLE_CPU_KERNELS") == "1":
    pytest.skip("RADIXLM_DISABLE_CPU_KERNELS=1: the CPU kernels are disabled on purpose",
                allow_module_level=True)


def _load_or_skip():
    try:
        return cpu_kernels.load()
    except CpuKernelsUnavailable as e:
        if not shutil.which(os.environ.get("CXX", "c++")):
            pytest.skip(f"no C++ compiler, the CPU kernels cannot be built: {e}")
        from torch.utils.cpp_extension import is_ninja_available
        if not is_ninja_available():
            pytest.skip(f"no ninja (torch.utils.cpp_extension needs it), the CPU kernels cannot "
                        f"be built: {e}")
        raise  # the tools exist: a build failure is a bug, not a skip


class _LazyOps:
    """torch.ops.radixlm_cpu, loaded by the first test that uses it, not when the module is
    imported: `make test` builds the kernels in the background while pytest's workers collect,
    and a load at import held every worker's collection until the build ended (~45 s on a fresh
    clone), although most tests need no kernel. A test that uses it waits on the build's lock."""

    _ops = None

    def __getattr__(self, name):
        if name.startswith("_"):  # what pytest and mock probe for at collection, not an op
            raise AttributeError(name)
        if _LazyOps._ops is None:
            _LazyOps._ops = _load_or_skip()
        return getattr(_LazyOps._ops, name)


OPS = _LazyOps()


@pytest.fixture(autouse=True)
def kernels_built():
    """Imported by a test module whose every test needs the kernels: each is skipped or failed
    as their build is (what importing this module did when it loaded them at once)."""
    OPS.isa()

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16]


def make_pool(lens, hkv, d, dtype, gen, shared=0):
    """req_to_token rows for requests of `lens` tokens, slots scattered through the pool (never
    slot 0); request i is pool row 2*i+1, and every request's first `shared` slots are request
    0's (a radix-cache prefix). Returns k_buf, v_buf, req_to_token, rows."""
    ctx = max(lens) + 3
    r2t = torch.zeros(2 * len(lens) + 2, ctx, dtype=torch.int64)
    n = sum(lens)
    perm = torch.randperm(n, generator=gen) + 1
    rows, at = [], 0
    for i, ln in enumerate(lens):
        r2t[2 * i + 1, :ln] = perm[at:at + ln]
        at += ln
        rows.append(2 * i + 1)
    for i, ln in enumerate(lens[1:], 1):
        s = min(shared, ln, lens[0])
        r2t[rows[i], :s] = r2t[rows[0], :s]
    k = torch.randn(n + 1, hkv, d, generator=gen).to(dtype)
    v = torch.randn(n + 1, hkv, d, generator=gen).to(dtype)
    return k, v, r2t, torch.tensor(rows)


def dense(q, k_buf, v_buf, slots, scale, causal_offset=None):
    """q (n, Hq, D) against keys k_buf[slots], fp32; causal_offset c: query i sees keys j <= c + i.
    Returns out (n, Hq, D) (0 for a row that sees no key) and lse (n, Hq) (-inf there)."""
    g = q.shape[1] // k_buf.shape[1]
    k = k_buf[slots].float().repeat_interleave(g, 1)
    v = v_buf[slots].float().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->qhk", q.float(), k) * scale
    if causal_offset is not None:
        ok = torch.arange(len(slots))[None, :] <= causal_offset + torch.arange(q.shape[0])[:, None]
        s = s.masked_fill(~ok[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("qhk,khd->qhd", p, v), lse


def close(out, ref, dtype):
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def close_lse(lse, ref):
    assert torch.equal(torch.isinf(lse), torch.isinf(ref)), (lse, ref)
    fin = torch.isfinite(ref)
    torch.testing.assert_close(lse[fin], ref[fin], atol=1e-4, rtol=1e-5)

