"""Defaults that depend on the machine: the prefill chunk size."""

from __future__ import annotations

import types

import torch

from radixlm.runtime.config import ServerArgs, resolve_chunked_prefill_size


def test_chunk_size_given_wins_and_cpu_default():
    assert ServerArgs().chunked_prefill_size is None
    assert resolve_chunked_prefill_size(512, torch.device("cpu")) == 512
    assert resolve_chunked_prefill_size(0, torch.device("cuda")) == 0  # chunking off, as asked
    assert resolve_chunked_prefill_size(None, torch.device("cpu")) == 2048


def test_chunk_size_grows_with_gpu_memory(monkeypatch):
    for gib, want in ((16, 2048), (40, 4096), (80, 8192), (141, 8192)):
        props = types.SimpleNamespace(total_memory=gib * 2**30)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev, p=props: p)
        assert resolve_chunked_prefill_size(None, torch.device("cuda")) == want, gib
