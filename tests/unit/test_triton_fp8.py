"""The FP8 Triton kernels (layers/triton_fp8.py: per-row e4m3 quantization, the batch-1 FP8 GEMV)
on the CPU through Triton's interpreter, at small odd shapes; the checks live in
tests/gpu/test_fp8.py, which also runs them compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import gpu_checks, import_interpreted  # tests/unit is on sys.path

(triton_fp8,) = import_interpreted("radixlm.runtime.layers.triton_fp8",
                                   gpu_tests="tests/gpu/test_fp8.py")
_checks = gpu_checks("tests/gpu/test_fp8.py")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_quantize_rows_interpreted():
    _checks.check_quantize_rows("cpu", [(7, 96), (3, 2500), (1, 16)], interpreted=True)


def test_fp8_gemv_interpreted():
    # fp16 / fp32 out only: the interpreter's fp32 -> bf16 store truncates instead of rounding
    _checks.check_fp8_gemv("cpu", [(37, 96), (16, 64), (5, 1030)],
                           out_dtypes=(torch.float16, torch.float32),
                           configs=(None, (16, 32, 4, 2), (4, 64, 2, 3)))
