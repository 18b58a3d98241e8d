"""The fused Llama-layer ops (layers/triton_ops.py) on the CPU through Triton's interpreter
(TRITON_INTERPRET=1), against the plain torch ops; the checks themselves live in
tests/gpu/test_fused_ops_gpu.py, which runs them compiled on a GPU."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch  # does not import triton

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_fused_ops_gpu.py runs the compiled kernels",
                allow_module_level=True)
# as in test_triton_attention.py: the interpreter must be on when triton and the kernels are
# imported, and the environment is restored afterwards for the rest of the suite
_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
if _PREV_INTERPRET not in (None, "1"):
    pytest.skip("TRITON_INTERPRET is set to something other than 1", allow_module_level=True)
if "triton" in sys.modules and _PREV_INTERPRET != "1":
    # fine when an earlier interpreter test module (test_triton_attention.py) imported it with
    # the interpreter on; not when it was imported compiled
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

from radixlm.runtime.layers import triton_ops  # noqa: E402,F401  (kernels defined interpreted)

_spec = importlib.util.spec_from_file_location(
    "_fused_ops_checks", os.path.join(os.path.dirname(__file__), "..", "gpu",
                                      "test_fused_ops_gpu.py"))
_checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_checks)

if _PREV_INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_ops_match_torch(dtype):
    _checks.check_ops(dtype, "cpu")
