"""Import Triton kernel modules under Triton's interpreter (TRITON_INTERPRET=1) for the CPU tests.

@triton.jit picks the interpreter when a kernel is defined (imported), and triton's own helpers
(tl.cdiv, reductions) are @jit functions decorated at triton's import: so the variable must be set
before either, and is restored afterwards so the rest of the suite (e.g. resolve_backend_name
refusing "triton" on the CPU) sees the environment it had. Test modules also set it around each
test (it is read at launch too)."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch  # does not import triton


def import_interpreted(*module_names: str, gpu_tests: str) -> list:
    """The named modules, imported with the interpreter on; skips the calling test module when
    CUDA is present (`gpu_tests` covers the compiled kernels there: setting the variable would turn
    every kernel of the session, GPU tests included, into the interpreter) or triton is missing."""
    if torch.cuda.is_available():
        pytest.skip(f"CUDA present: {gpu_tests} runs the compiled kernels", allow_module_level=True)
    prev = os.environ.get("TRITON_INTERPRET")
    if prev not in (None, "1"):
        pytest.skip("TRITON_INTERPRET is set to something other than 1", allow_module_level=True)
    if "triton" in sys.modules and prev != "1":
        # fine when an earlier interpreter test module imported it with the interpreter on
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(sys.modules["triton"].language.standard.cdiv, InterpretedFunction):
            raise RuntimeError("triton was imported before TRITON_INTERPRET=1 could be set; set it "
                               "earlier (e.g. in tests/conftest.py) for the interpreter tests")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        try:
            importlib.import_module("triton")
        except ImportError:
            pytest.skip("triton is not installed (pip install '.[test]')", allow_module_level=True)
        return [importlib.import_module(name) for name in module_names]
    finally:
        if prev is None:
            del os.environ["TRITON_INTERPRET"]


def gpu_checks(gpu_tests: str):
    """The check functions of a tests/gpu module (`gpu_tests`, a path from the repository root),
    loaded as a module of its own so the CPU tests can run them through the interpreter."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    name = "_checks_" + os.path.splitext(os.path.basename(gpu_tests))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, gpu_tests))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
