"""On a CUDA GPU, fp32: the hierarchical cache's device<->host copies (pinned host pool, the
transfer stream) and file store give the same greedy tokens as the plain engine when prefixes
come back from the host pool, from the store, and after a restart on the same store (through the
storage prefetch: the reader thread's CPU writes into the pinned pool, then the load's DMA); the
KV accounting holds after each run. Run with `pytest -m gpu tests/gpu`."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu

PAGE = 16
SP = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 512, (120,), generator=gen).tolist() for _ in range(6)]


def _engine(path, **kw):
    import radixlm

    return radixlm.Engine(model_path=path, device="cuda", dtype="float32", skip_tokenizer_init=True,
                          context_length=1024, attention_backend="triton", **kw)


def _run(eng, prompts, order) -> tuple[dict, dict]:
    outs, details = {}, {}
    for i in order:
        out = eng.generate(input_ids=prompts[i], sampling_params=SP)
        outs[i] = out["output_ids"]
        details[i] = out["meta_info"].get("cached_tokens_details")
        eng.wait_idle()
        eng.check_integrity()
    return outs, details


def test_tiers_on_cuda_match_the_plain_engine(tiny_llama_path, tmp_path):
    prompts = _prompts()
    plain = _engine(tiny_llama_path, max_total_tokens=4096)
    try:
        ref, _ = _run(plain, prompts, range(6))
    finally:
        plain.shutdown()
    # every stored page is worth a prefetch (SGLang's default threshold is 256 tokens), and a
    # request waits for its pages (on a GPU the tiny model computes faster than the disk reads,
    # so the default timeout policy would rightly recompute instead)
    extra = json.dumps({"file_storage_path": str(tmp_path), "page_tokens": PAGE,
                        "prefetch_threshold": PAGE})
    tiered = dict(max_total_tokens=300, enable_hicache=True, hicache_ratio=2.0,
                  hicache_storage_backend="file", hicache_storage_backend_extra_config=extra,
                  hicache_storage_prefetch_policy="wait_complete")
    eng = _engine(tiny_llama_path, **tiered)
    try:
        first, _ = _run(eng, prompts, range(6))
        again, details = _run(eng, prompts, reversed(range(6)))
        stats = eng.get_stats()["hicache"]
    finally:
        eng.shutdown()  # queued pages reach the folder
    assert first == ref and again == ref
    assert sum(d["host"] for d in details.values()) > 0, details
    assert sum(d["storage"] for d in details.values()) > 0, details
    assert stats["bytes_host_to_device"] > 0 and stats["bytes_device_to_host"] > 0
    eng = _engine(tiny_llama_path, **tiered)  # a restart: empty device and host pools
    try:
        restarted, details = _run(eng, prompts, range(6))
    finally:
        eng.shutdown()
    assert restarted == ref
    assert all(d["storage"] > 0 for d in details.values()), details
