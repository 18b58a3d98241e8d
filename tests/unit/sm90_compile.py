"""Runs a script that compiles Triton / Gluon kernels for sm_90 without a GPU (Triton lowers to
PTX and runs its bundled ptxas, which needs no device), in a fresh process: the test session's
triton may be imported with the interpreter on. The script prints "compiled" at its end."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_sm90_script(script: str, *modules: str) -> None:
    """Skips without triton's NVIDIA backend (or one of `modules`) or its ptxas; fails with the
    script's stderr otherwise."""
    for mod in ("triton", "triton.backends.nvidia") + modules:
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"no {mod}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    if "ptxas" in p.stderr and "not found" in p.stderr:
        pytest.skip("Triton's bundled ptxas is missing")
    assert p.returncode == 0 and "compiled" in p.stdout, p.stderr[-3000:]
