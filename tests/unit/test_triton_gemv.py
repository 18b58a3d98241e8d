"""The batch-1 Triton GEMV (layers/triton_gemv.py) on the CPU through Triton's interpreter
(TRITON_INTERPRET=1), at small odd shapes (rows and K not multiples of the tiles, bias or not);
the checks live in tests/gpu/test_triton_gemv_gpu.py, which also runs them compiled on a GPU."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch  # does not import triton

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_triton_gemv_gpu.py runs the compiled kernel",
                allow_module_level=True)
# as in test_triton_ops.py: the interpreter must be on when triton and the kernel are imported
_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
if _PREV_INTERPRET not in (None, "1"):
    pytest.skip("TRITON_INTERPRET is set to something other than 1", allow_module_level=True)
if "triton" in sys.modules and _PREV_INTERPRET != "1":
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(sys.modules["triton"].language.standard.cdiv, InterpretedFunction):
        raise RuntimeError("triton was imported before this module could set TRITON_INTERPRET=1")
os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton  # noqa: F401
except ImportError:
    if _PREV_INTERPRET is None:
        del os.environ["TRITON_INTERPRET"]
    pytest.skip("triton is not installed (pip install '.[test]')", allow_module_level=True)

from radixlm.runtime.layers import triton_gemv  # noqa: E402,F401  (kernel defined interpreted)

_spec = importlib.util.spec_from_file_location(
    "_gemv_checks", os.path.join(os.path.dirname(__file__), "..", "gpu", "test_triton_gemv_gpu.py"))
_checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_checks)

if _PREV_INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_gemv_matches_reference_interpreted():
    # fp16 only: the interpreter's fp32 -> bf16 store truncates instead of rounding
    _checks.check_gemv("cpu", [(37, 96), (16, 64), (5, 1030)], dtypes=(torch.float16,),
                       configs=(None, (16, 32, 4, 2), (4, 64, 2, 3)))


def test_gemv_is_cuda_only():
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    assert not triton_gemv.supports(torch.randn(1, 16, dtype=torch.bfloat16), w)
