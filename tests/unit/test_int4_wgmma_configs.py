"""The wgmma GEMM's routing and configs (layers/int4_wgmma_configs.py, int4_batch1's
takes_gemm), torch only: which calls it takes, each call's config (the measured table, a sweep's
file, the default pattern), split-K. The kernel itself runs only on a Hopper GPU
(tests/gpu/test_int4_wgmma_gemm_gpu.py); it compiles here (test_gluon_int4_gemm_compile.py)."""

from __future__ import annotations

import json

import pytest
import torch

from radixlm.runtime.layers import int4_batch1, int4_linear
from radixlm.runtime.layers import int4_wgmma_configs as WC


def test_batch_tiles_and_default_configs():
    assert [WC.bm_for(m) for m in (9, 16, 17, 32, 33, 64, 65, 500)] == [16, 16, 32, 32, 64, 64,
                                                                         64, 64]
    # 8 warps (128 rows a program) where N allows; one MMA chain a group up to 32 rows; 64-row
    # tiles: steps of 64 k, a register cap, a group's MMAs in flight
    assert WC.default_config(4096, 128, 16) == (8, 1, 128)
    assert WC.default_config(4160, 64, 32) == (4, 1, 64)
    assert WC.default_config(4096, 128, 64) == (8, 1, 64, None, 128, 1)
    assert WC.default_config(192, 32, 40) == (4, 1, 32, None, None, 1)


def test_config_table_and_file(tmp_path, monkeypatch):
    monkeypatch.delenv(WC.ENV_VAR, raising=False)
    h200 = "NVIDIA H200"
    assert WC.config_for(28672, 4096, 128, 64, h200) == (8, 1, 64, 1, 128, 1)
    assert WC.config_for(28672, 4096, 128, 12, h200) == (8, 1, 128, 1)
    assert WC.config_for(28672, 4096, 128, 12, "NVIDIA H100") == (8, 1, 128)  # no table
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"NVIDIA H100": {"28672,4096,128": {"16": [4, 1, 64, 2]}}}))
    monkeypatch.setenv(WC.ENV_VAR, str(path))
    assert WC.config_for(28672, 4096, 128, 12, "NVIDIA H100") == (4, 1, 64, 2)
    assert WC.config_for(28672, 4096, 128, 12, h200) == (8, 1, 128)  # the file replaces TUNED


def test_supported_shapes_and_splits():
    assert WC.supported(4096, 4096, 128, torch.bfloat16, 8, 1)
    assert not WC.supported(4160, 4096, 128, torch.bfloat16, 8, 1)  # not 128-row programs
    assert WC.supported(4160, 4096, 128, torch.float16, 4, 1)
    assert not WC.supported(4096, 4096, 128, torch.float32)  # the MMA's operand types
    assert not WC.supported(4096, 4096 + 32, 32, torch.bfloat16)  # K in whole 64-k chunks
    assert not WC.supported(4096, 4096, 256, torch.bfloat16)  # groups 32 / 64 / 128
    # split-K: programs within ~2 an SM, >= 4 groups a split, at most 8
    assert WC.split_for(32, 32) == 8 and WC.split_for(48, 32) == 4
    assert WC.split_for(224, 32) == 1 and WC.split_for(32, 8) == 2


def test_wgmma_setting_and_routing(monkeypatch):
    lin = int4_linear.Int4Linear(1024, 128, 128, False, torch.bfloat16, "cpu")
    x = torch.randn(16, 1024, dtype=torch.bfloat16)
    tma = int4_batch1.Batch1("tma", (16, 1024, 4, 3), (lin.scales.t(), lin.zeros.t()), None)
    assert not tma.takes_gemm(lin, x)  # the TMA GEMV's operands are not the mma words
    mma = int4_batch1.Batch1("mma", (1, 8, 1), (torch.zeros(8, 16, 32, 4, dtype=torch.int32),),
                             None)
    assert not mma.takes_gemm(lin, x)  # not CUDA
    monkeypatch.setenv(int4_batch1.WGMMA_ENV, "0")
    assert not int4_batch1.wgmma_enabled()  # (1 would import the Gluon kernel: not here, where
    # the unit tests' Triton runs interpreted)
    monkeypatch.setenv(int4_batch1.WGMMA_ENV, "on")
    with pytest.raises(ValueError, match=int4_batch1.WGMMA_ENV):
        int4_batch1.wgmma_enabled()
