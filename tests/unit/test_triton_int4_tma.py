"""The Hopper batch-1 int4 kernel (layers/triton_int4_tma.py) and its choice
(layers/int4_batch1.py) on the CPU through Triton's interpreter, at small shapes:
tests/gpu/test_int4_tma_gpu.py's checks (the reference and its tolerance: tests/gpu/test_int4.py). The interpreter's 2 "SMs" make every program walk several
row tiles (a tile's last step mid-loop, the SiLU gate kept across its up steps). fp16 / fp32
outputs only: the interpreter's fp32 -> bf16 store truncates instead of rounding."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import gpu_checks, import_interpreted  # tests/unit is on sys.path

triton_int4_tma, = import_interpreted(
    "radixlm.runtime.layers.triton_int4_tma", gpu_tests="tests/gpu/test_int4_tma_gpu.py")
_checks = gpu_checks("tests/gpu/test_int4_tma_gpu.py")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("RADIXLM_INT4_TMA", raising=False)


def test_int4_tma_kernel_interpreted():
    # 4 / 3 / 2 row tiles over 2 or 4 programs; groups 128 (8 a step), 32 (4 a step), 64 (2 a
    # step); 2, 4 and 3 steps a tile; a config with a register cap (its 6th value)
    _checks.check_int4_tma_kernel("cpu", [
        (64, 2048, 128, (16, 1024, 4, 3, 1), False), (96, 512, 32, (32, 128, 2, 2, 2), True),
        (128, 384, 64, (64, 128, 4, 2, 1), False), (64, 1024, 128, (32, 512, 4, 3, 1, 168), False)],
        dtypes=(torch.float16, torch.float32))


def test_int4_tma_layer_interpreted():
    _checks.check_int4_tma_layer("cpu", torch.float32)


def test_int4_batch1_setting(monkeypatch):
    from radixlm.runtime.layers import int4_batch1, int4_linear

    monkeypatch.setenv(int4_batch1.ENV_VAR, "0")
    lin = int4_linear.Int4Linear(1024, 64, 128, False, torch.float32, "cpu")
    assert not lin.use_tma() and lin.tma is None
    monkeypatch.setenv(int4_batch1.ENV_VAR, "1")
    assert lin.use_tma() and lin.tma.kind == "tma"
    old = lin.tma
    assert lin.use_tma() and lin.tma is old  # unchanged: refreshed in place
    monkeypatch.setenv(int4_batch1.ENV_VAR, "mma")  # no CUDA here: the TMA kernel instead
    assert lin.use_tma() and lin.tma is old
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


def test_int4_tma_tuned_configs(monkeypatch, tmp_path):
    # the GPU's measured config where it fits the shape, else DEFAULT; a sweep's own table
    # through RADIXLM_INT4_TMA_CONFIGS
    import json

    from radixlm.runtime.layers import int4_tma_tuned

    T = triton_int4_tma
    h200 = int4_tma_tuned.TUNED["NVIDIA H200"]["tma"]
    assert T.config_for(28672, 4096, 128, 2, "NVIDIA H200") == h200["28672,4096,128"]
    assert T.config_for(28672, 4096, 128, 2, "NVIDIA H100 80GB HBM3") == T.DEFAULT
    assert T.config_for(28672, 4096, 128, 2) == T.DEFAULT
    assert T.config_for(1024, 4096, 128, 2, "NVIDIA H200") == T.DEFAULT  # shape not swept
    table = tmp_path / "tuned.json"
    table.write_text(json.dumps({"GPU X": {"tma": {"1024,4096,128": [32, 512, 4, 3, 4],
                                                   "1024,2560,128": [16, 1024, 4, 3, 3]}}}))
    monkeypatch.setenv(int4_tma_tuned.ENV_VAR, str(table))
    assert T.config_for(1024, 4096, 128, 2, "GPU X") == (32, 512, 4, 3, 4)
    # a listed config that does not fit (K = 2048 + 512 is not whole 1024-value steps) is
    # skipped for the next that does
    assert T.config_for(1024, 2560, 128, 2, "GPU X") == T.FALLBACKS[0]
    assert T.config_for(28672, 4096, 128, 2, "NVIDIA H200") == T.DEFAULT  # (not in the file)
