"""The batch-1 int4 GEMV over TMA (layers/triton_int4_tma.py) on the CPU through Triton's
interpreter, at small shapes: tests/gpu/test_int4_tma_gpu.py's checks (the reference and its
tolerance: tests/gpu/test_int4.py). The interpreter's 2 "SMs" make every program walk several
row tiles (a tile's last step mid-loop, the SiLU gate kept across its up steps). fp16 / fp32
outputs only: the interpreter's fp32 -> bf16 store truncates instead of rounding."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from triton_interpreter import import_interpreted  # tests/unit is on sys.path

(triton_int4_tma,) = import_interpreted("radixlm.runtime.layers.triton_int4_tma",
                                        gpu_tests="tests/gpu/test_int4_tma_gpu.py")
_spec = importlib.util.spec_from_file_location(
    "_int4_tma_checks", os.path.join(os.path.dirname(__file__), "..", "gpu",
                                     "test_int4_tma_gpu.py"))
_checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_checks)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(triton_int4_tma.ENV_VAR, raising=False)


def test_int4_tma_kernel_interpreted():
    # 4 / 3 / 2 row tiles over 2 or 4 programs; groups 128 (8 a step), 32 (4 a step), 64 (2 a
    # step); 2, 4 and 3 steps a tile
    _checks.check_int4_tma_kernel("cpu", [
        (64, 2048, 128, (16, 1024, 4, 3, 1), False), (96, 512, 32, (32, 128, 2, 2, 2), True),
        (128, 384, 64, (64, 128, 4, 2, 1), False)], dtypes=(torch.float16, torch.float32))


def test_int4_tma_layer_interpreted():
    _checks.check_int4_tma_layer("cpu", torch.float32)


def test_int4_tma_off_by_env(monkeypatch):
    from radixlm.runtime.layers import int4_linear

    monkeypatch.setenv(triton_int4_tma.ENV_VAR, "0")
    lin = int4_linear.Int4Linear(1024, 64, 128, False, torch.float32, "cpu")
    assert not lin.use_tma() and lin.tma is None and lin.scales_t is None


def test_int4_tma_supported_shapes():
    s = triton_int4_tma.supported
    assert s(4096, 4096, 128, 16, 1024) and s(28672, 14336, 128, 32, 512)
    assert not s(4096, 4096 + 512, 128, 16, 1024)  # K not whole steps
    assert not s(4104, 4096, 128, 16, 1024)  # rows not whole tiles
    assert not s(4096, 4096, 256, 64, 128)  # a step smaller than a group
    assert not s(4096, 4096, 128, 16, 512)  # a 64-byte zero box (stage 1 misaligned)
    assert not s(4096, 4096, 128, 32, 256, scale_bytes=1) and s(4096, 4096, 128, 64, 256)
    assert triton_int4_tma.config_for(4096, 4096 + 512, 128)[:2] == (32, 512)
    assert triton_int4_tma.config_for(4096, 4096 + 256, 128)[:2] == (64, 256)
    with pytest.raises(ValueError, match="128-byte"):
        triton_int4_tma.descriptors(torch.zeros(64, 128, dtype=torch.int32),
                                    torch.zeros(8, 64, dtype=torch.float16),
                                    torch.zeros(8, 64, dtype=torch.uint8), 128, 16, 512)
