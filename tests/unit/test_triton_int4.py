"""The int4 Triton kernels (layers/triton_int4.py: the batch-1 GEMV and the batched GEMM) and the
Int4Linear layer on the CPU through Triton's interpreter, at small shapes, against the
dequantized fp64 reference with the tolerance stated in tests/gpu/test_int4.py (which runs the
same checks compiled on a GPU). fp16 / fp32 outputs only: the interpreter's fp32 -> bf16 store
truncates instead of rounding."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from triton_interpreter import import_interpreted  # tests/unit is on sys.path

(triton_int4,) = import_interpreted("radixlm.runtime.layers.triton_int4",
                                    gpu_tests="tests/gpu/test_int4.py")
_spec = importlib.util.spec_from_file_location(
    "_int4_checks", os.path.join(os.path.dirname(__file__), "..", "gpu", "test_int4.py"))
_checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_checks)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_int4_gemv_interpreted():
    # N not a multiple of BLOCK_N, group 32 / 64 / 128 and one group per row (K = 96)
    _checks.check_int4_kernels("cpu", [(37, 256, 32, 1), (16, 512, 128, 1), (20, 96, 96, 1),
                                       (9, 256, 64, 1)], dtypes=(torch.float16,))
    _checks.check_int4_kernels("cpu", [(9, 128, 32, 1), (7, 256, 128, 1)],
                               dtypes=(torch.float32,), gemv_configs=((4, 64, 4, 2), (2, 32, 2, 1)))


def test_int4_gemm_interpreted():
    _checks.check_int4_kernels("cpu", [(37, 256, 32, 5), (16, 256, 128, 17), (20, 96, 96, 3)],
                               dtypes=(torch.float16, torch.float32),
                               gemm_configs=(None, (16, 32, 32, 4, 2)))


def test_int4_layer_interpreted():
    """Act-order permutation of x, bias, GEMV and GEMM through Int4Linear.forward."""
    _checks.check_int4_layer("cpu", torch.float32, ms=(1, 4))
    _checks.check_int4_layer("cpu", torch.float16, ms=(1, 4))
