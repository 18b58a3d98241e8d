"""sampling/triton_argmax on the CPU through Triton's interpreter: torch.argmax's answer bit for
bit (first of equal maxima, the first NaN wins, an all -inf row gives 0) over rows longer than
a chunk; tests/gpu/test_triton_argmax_gpu.py runs the same checks compiled."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import gpu_checks, import_interpreted  # tests/unit is on sys.path

(triton_argmax,) = import_interpreted("radixlm.runtime.sampling.triton_argmax",
                                      gpu_tests="tests/gpu/test_triton_argmax_gpu.py")
_checks = gpu_checks("tests/gpu/test_triton_argmax_gpu.py")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_argmax_matches_torch_interpreted():
    _checks.check_argmax(triton_argmax.argmax_rows, "cpu", vocab=(1, 4096, 9000))


def test_only_cuda_rows_are_taken():
    assert not triton_argmax.supports(torch.zeros(2, 8))
