"""Packed bf16 weights kept in the start-up cache (executor/pack_cache.py): a warm start takes
the packs an earlier start saved, and they are the packs it would have made (bit for bit); a
pack of another shape is never adopted."""

from __future__ import annotations

import os

import pytest
import torch

from radixlm.runtime.layers import cpu_linear, cpu_packed


@pytest.fixture
def own_gemm(monkeypatch):
    monkeypatch.delenv(cpu_packed.ENV_VAR, raising=False)
    if not (cpu_linear.cpu_has_native_bf16_matmul() and cpu_packed.own_gemm_works()):
        pytest.skip("radixlm's GEMM needs AVX512-BF16 (and the built CPU kernels)")
    return monkeypatch


@pytest.mark.parametrize("n,gate_up", [(100, False), (128, True), (96, False)])
def test_adopt_takes_only_what_pack_makes(own_gemm, n, gate_up):
    w = torch.randn(n, 64).bfloat16()
    fresh = cpu_packed.pack(w, gate_up)
    got = cpu_packed.adopt(w, gate_up, fresh.data.clone())
    assert got is not None and torch.equal(got.data, fresh.data)
    assert (got.n, got.k, got.paired) == (fresh.n, fresh.k, fresh.paired)
    if n % 64 == 0:  # the other pairing has another shape
        assert cpu_packed.adopt(w, not gate_up, fresh.data) is None
    assert cpu_packed.adopt(torch.randn(n + 64, 64).bfloat16(), gate_up, fresh.data) is None
    assert cpu_packed.adopt(w, gate_up, fresh.data.float()) is None
    assert cpu_packed.adopt(w, gate_up, None) is None


def _seed_without_packs(src_root, dst_root) -> None:
    """Hard links (copies across file systems) of the suite cache's GGUF entries in a fresh
    root, without their packs: the cold start below then packs (what the test is about) but
    does not convert the GGUF again (~8 s on 2 cores, checked by test_startup_cache)."""
    import shutil

    if not src_root or not os.path.isdir(os.path.join(src_root, "gguf")):
        return
    for base, _, files in os.walk(src_root):
        rel = os.path.relpath(base, src_root)
        if rel.split(os.sep)[0] not in ("gguf", "hashes"):
            continue
        os.makedirs(os.path.join(dst_root, rel), exist_ok=True)
        for f in files:
            if f.startswith("packs-") or f.startswith(".") or f.endswith(".lock"):
                continue
            try:
                os.link(os.path.join(base, f), os.path.join(dst_root, rel, f))
            except OSError:
                shutil.copy2(os.path.join(base, f), os.path.join(dst_root, rel, f))


def test_warm_start_maps_the_saved_packs(own_gemm, tmp_path):
    from radixlm.runtime.config import ServerArgs
    from radixlm.runtime.executor import model_runner, pack_cache
    from radixlm.runtime.models.cache import cache_root

    _seed_without_packs(cache_root(), str(tmp_path))
    own_gemm.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    args = ServerArgs.from_kwargs(model_path=None, max_total_tokens=256)
    calls = []
    real_pack = cpu_packed.pack
    own_gemm.setattr(cpu_packed, "pack", lambda *a, **k: calls.append(1) or real_pack(*a, **k))
    model_runner._MODEL_CACHE.clear()
    cold = model_runner.ModelRunner(args).model
    cold_packs = cpu_packed.own_packs(cold)
    assert cold_packs and calls  # packed, and saved
    files = [f for f in os.listdir(next((tmp_path / "gguf").iterdir()))
             if f.startswith("packs-")]
    assert files == [f"packs-{pack_cache.LAYOUT}.safetensors"]
    calls.clear()
    model_runner._MODEL_CACHE.clear()
    warm = model_runner.ModelRunner(args).model
    model_runner._MODEL_CACHE.clear()
    warm_packs = cpu_packed.own_packs(warm)
    assert not calls  # nothing packed again
    assert warm_packs.keys() == cold_packs.keys()
    for name, data in cold_packs.items():
        assert torch.equal(warm_packs[name], data), name
