"""The Hopper batch-1 int4 kernels (layers/triton_int4_tma.py, the tensor-core one in
layers/triton_int4_tc.py: its fp32 dequant path, the interpreter runs no PTX) and their choice
(layers/int4_batch1.py) on the CPU through Triton's interpreter, at small shapes:
tests/gpu/test_int4_tma_gpu.py's checks (the reference and its tolerance: tests/gpu/test_int4.py). The interpreter's 2 "SMs" make every program walk several
row tiles (a tile's last step mid-loop, the SiLU gate kept across its up steps). fp16 / fp32
outputs only: the interpreter's fp32 -> bf16 store truncates instead of rounding."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from triton_interpreter import import_interpreted  # tests/unit is on sys.path

triton_int4_tma, triton_int4_tc = import_interpreted(
    "radixlm.runtime.layers.triton_int4_tma", "radixlm.runtime.layers.triton_int4_tc",
    gpu_tests="tests/gpu/test_int4_tma_gpu.py")
_spec = importlib.util.spec_from_file_location(
    "_int4_tma_checks", os.path.join(os.path.dirname(__file__), "..", "gpu",
                                     "test_int4_tma_gpu.py"))
_checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_checks)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("RADIXLM_INT4_TMA", raising=False)


def test_int4_tma_kernel_interpreted():
    # 4 / 3 / 2 row tiles over 2 or 4 programs; groups 128 (8 a step), 32 (4 a step), 64 (2 a
    # step); 2, 4 and 3 steps a tile
    _checks.check_int4_tma_kernel("cpu", [
        (64, 2048, 128, (16, 1024, 4, 3, 1), False), (96, 512, 32, (32, 128, 2, 2, 2), True),
        (128, 384, 64, (64, 128, 4, 2, 1), False)], dtypes=(torch.float16, torch.float32))


def test_int4_tma_layer_interpreted():
    _checks.check_int4_tma_layer("cpu", torch.float32)


def test_int4_tc_kernel_interpreted():
    # the fp32 dequant path (the interpreter runs no PTX); 4 row tiles over 2 programs (split
    # 1), split-K 2 and 4 (one item a program, the last arriving reduces), act-order, SiLU
    _checks.check_int4_tc_kernel("cpu", [
        (64, 512, 128, (16, 4, 3, 1, 1), False, False), (64, 256, 32, (16, 4, 2, 1, 2), True, True),
        (96, 384, 64, (32, 4, 3, 1, 3), False, True), (128, 2048, 128, (32, 4, 3, 1, 4), True, False)],
        dtypes=(torch.float16,))


def test_int4_tc_rows_interpreted():
    # 3 / 16 / 20 rows (BLOCK_M 16 / 16 / 32), split-K 1 / 2, act-order, bias
    _checks.check_int4_tc_rows("cpu", [
        (64, 512, 128, (16, 4, 3, 1, 1), 3, True, False),
        (64, 256, 32, (16, 4, 2, 1, 2), 16, False, True),
        (32, 512, 64, (32, 4, 2, 2, 0), 20, True, True)], dtypes=(torch.float16,))


def test_int4_tc_layer_interpreted():
    _checks.check_int4_tma_layer("cpu", torch.float16, n=128, k=512, kind="tc")


def test_int4_batch1_setting(monkeypatch):
    from radixlm.runtime.layers import int4_batch1, int4_linear

    monkeypatch.setenv(int4_batch1.ENV_VAR, "0")
    lin = int4_linear.Int4Linear(1024, 64, 128, False, torch.float32, "cpu")
    assert not lin.use_tma() and lin.tma is None
    monkeypatch.setenv(int4_batch1.ENV_VAR, "tc")  # fp32 activations: the tensor cores refuse
    assert not lin.use_tma()
    monkeypatch.setenv(int4_batch1.ENV_VAR, "1")
    assert lin.use_tma() and lin.tma.kind == "tma"
    monkeypatch.setenv(int4_batch1.ENV_VAR, "yes")
    with pytest.raises(ValueError, match="RADIXLM_INT4_TMA"):
        lin.use_tma()


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


def test_int4_tc_silu_needs_whole_tiles_in_each_half(monkeypatch):
    # [gate | up] of 2 x 192 rows: 3 row tiles of 128 in all, not whole ones in each half:
    # the SiLU call takes the register GEMV (the same values as its own), plain calls the tc
    from radixlm.runtime.layers import int4_batch1, triton_int4

    monkeypatch.setenv(int4_batch1.ENV_VAR, "tc")
    lin = _checks._layer("cpu", 384, 256, 128, torch.float16, seed=4)
    assert lin.use_tma() and lin.tma.kind == "tc"
    x = torch.randn(1, 256).half()
    assert not lin.tma.accepts(lin, x, silu=True) and lin.tma.accepts(lin, x)
    want = triton_int4.gemv(x, lin.qweight, lin.scales, lin.zeros, 128, silu=True)
    assert torch.equal(lin.gate_up_silu(x), want)
