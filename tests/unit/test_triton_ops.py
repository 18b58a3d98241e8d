"""The fused Llama-layer ops (layers/triton_ops.py) on the CPU through Triton's interpreter
(TRITON_INTERPRET=1), against the plain torch ops; the checks themselves live in
tests/gpu/test_fused_ops_gpu.py, which runs them compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import gpu_checks, import_interpreted  # tests/unit is on sys.path

import_interpreted("radixlm.runtime.layers.triton_ops", gpu_tests="tests/gpu/test_fused_ops_gpu.py")
_checks = gpu_checks("tests/gpu/test_fused_ops_gpu.py")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_ops_match_torch(dtype):
    _checks.check_ops(dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_pairs_match_torch(dtype):
    _checks.check_rope_pairs(dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mla_latent_store_matches_torch(dtype):
    _checks.check_mla_latent_store(dtype, "cpu")
