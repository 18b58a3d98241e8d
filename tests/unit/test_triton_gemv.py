"""The batch-1 Triton GEMV (layers/triton_gemv.py) on the CPU through Triton's interpreter
(TRITON_INTERPRET=1), at small odd shapes (rows and K not multiples of the tiles, bias or not);
the checks live in tests/gpu/test_triton_gemv_gpu.py, which also runs them compiled on a GPU."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from triton_interpreter import import_interpreted  # tests/unit is on sys.path

(triton_gemv, _) = import_interpreted("radixlm.runtime.layers.triton_gemv",
                                      "radixlm.runtime.layers.triton_skinny",
                                      gpu_tests="tests/gpu/test_triton_gemv_gpu.py")
_spec = importlib.util.spec_from_file_location(
    "_gemv_checks", os.path.join(os.path.dirname(__file__), "..", "gpu", "test_triton_gemv_gpu.py"))
_checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_checks)


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
