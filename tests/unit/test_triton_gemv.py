"""The batch-1 Triton GEMV (layers/triton_gemv.py) on the CPU through Triton's interpreter
(TRITON_INTERPRET=1), at small odd shapes (rows and K not multiples of the tiles, bias or not);
the checks live in tests/gpu/test_triton_gemv_gpu.py, which also runs them compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import gpu_checks, import_interpreted  # tests/unit is on sys.path

(triton_gemv, _) = import_interpreted("radixlm.runtime.layers.triton_gemv",
                                      "radixlm.runtime.layers.triton_skinny",
                                      gpu_tests="tests/gpu/test_triton_gemv_gpu.py")
_checks = gpu_checks("tests/gpu/test_triton_gemv_gpu.py")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_gemv_matches_reference_interpreted():
    # fp16 only: the interpreter's fp32 -> bf16 store truncates instead of rounding
    _checks.check_gemv("cpu", [(37, 96), (16, 64), (5, 1030)], dtypes=(torch.float16,),
                       configs=(None, (16, 32, 4, 2), (4, 64, 2, 3)))


def test_gate_up_silu_interpreted():
    _checks.check_gate_up_silu("cpu", [(2 * 37, 96), (2 * 5, 1030)], dtypes=(torch.float16,),
                               configs=(None, (16, 32, 4, 2), (2, 64, 2, 3)))


def test_skinny_matches_reference_interpreted():
    # (fp16: the interpreter's bf16 dot is wrong, besides its truncating bf16 store)
    _checks.check_skinny("cpu", [(37, 96), (64, 256), (10, 1030)], rows=(1, 2, 5, 16),
                         dtypes=(torch.float16,), configs=((16, 32, 4, 2), (32, 64, 4, 3)))


def test_gemv_is_cuda_only():
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    assert not triton_gemv.supports(torch.randn(1, 16, dtype=torch.bfloat16), w)


# the per-GPU configs: TUNED_BY_GPU / SILU_BY_GPU entries win on the GPU they were measured on,
# every other GPU (and a call without a device) keeps the rule (the GPU's name faked here;
# tests/gpu/test_triton_gemv_gpu.py runs every entry against the reference)
@pytest.fixture
def gpu_named(monkeypatch):
    def name(n: str):
        monkeypatch.setattr(triton_gemv, "_gpu_name", lambda index: n)
    return name


def test_table_entries_win_on_their_gpu_only(gpu_named):
    dev = torch.device("cuda", 0)
    gpu_named("NVIDIA H200")
    assert triton_gemv.tuned_config(128256, 4096, dev) == (8, 256, 2, 4)
    assert triton_gemv.tuned_config(4096, 2048, dev) == (4, 256, 2, 4)  # cuBLAS by the rule
    assert triton_gemv.tuned_config(6144, 4096, dev) == (8, 256, 2, 4)  # not listed: the rule
    assert triton_gemv.silu_config(28672, 4096, dev) == (4, 1024, 4, 3)
    assert triton_gemv.silu_config(14336, 4096, dev) == (4, 256, 2, 4)  # the rule's, halved
    gpu_named("NVIDIA H100 80GB HBM3")
    assert triton_gemv.tuned_config(128256, 4096, dev) == (2, 1024, 8, 3)
    assert triton_gemv.tuned_config(4096, 2048, dev) is None
    assert triton_gemv.silu_config(28672, 4096, dev) == (2, 1024, 8, 3)
    for d in (None, torch.device("cpu")):
        assert triton_gemv.tuned_config(128256, 4096, d) == (2, 1024, 8, 3)
        assert triton_gemv.tuned_config(4096, 2048, d) is None


def test_table_entries_are_valid_configs():
    for table in (triton_gemv.TUNED_BY_GPU, triton_gemv.SILU_BY_GPU):
        for gpu, shapes in table.items():
            for (n, k), (block_n, block_k, warps, stages) in shapes.items():
                for v in (block_n, block_k, warps):
                    assert v & (v - 1) == 0, (gpu, n, k)  # powers of two (Triton's aranges)
                assert block_k <= k and 1 <= stages <= 8 and warps <= 8, (gpu, n, k)
