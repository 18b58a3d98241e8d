"""Prefill/decode disaggregation on CUDA: a prefill server and a decode server (fp32, the tiny
chat model) behind the PD router, KV over gloo (host staging: pinned copies both ways) or nccl
(device to device; needs the two servers on two GPUs). Greedy output equals the prefill server's
own colocated answer, a multi-chunk prompt arrives in several pages, both pools pass the
integrity check. Run on a 2-GPU machine: `pytest -m gpu tests/gpu/test_pd_gpu.py`
(gloo also runs on one GPU: both servers share it)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from server_harness import start_server, stop_and_check  # noqa: E402

from radixlm.net import free_port  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS = ["The capital of France is",
           "Once upon a time, in a land far away, there lived a " * 40,  # ~560 tokens: 5 chunks
           "def fibonacci(n): return n if n < 2 else"]


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_pd_on_cuda_matches_colocated(tiny_chat_path, backend):
    two = torch.cuda.device_count() >= 2
    if backend == "nccl" and not two:
        pytest.skip("nccl between two servers needs two GPUs")
    common = ["--model-path", tiny_chat_path, "--dtype", "float32", "--device", "cuda",
              "--max-total-tokens", "16384", "--context-length", "2048",
              "--chunked-prefill-size", "128", "--disaggregation-timeout", "30",
              "--disaggregation-transfer-backend", backend]
    boot = free_port()
    servers = []
    try:
        pre = start_server([*common, "--disaggregation-mode", "prefill", "--base-gpu-id", "0",
                            "--disaggregation-bootstrap-port", str(boot)], name="pd-prefill")
        servers.append(pre)
        dec = start_server([*common, "--disaggregation-mode", "decode",
                            "--base-gpu-id", "1" if two else "0"], name="pd-decode")
        servers.append(dec)
        router = start_server(["--pd-disaggregation", "--prefill", pre.url, str(boot),
                               "--decode", dec.url], name="pd-router", module="radixlm.router")
        servers.append(router)
        for prompt in PROMPTS:
            body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 32},
                    "return_logprob": True}
            out = router.post("/generate", body)
            ref = pre.post("/generate", body)
            assert out.status_code == ref.status_code == 200, out.text
            assert out.json()["output_ids"] == ref.json()["output_ids"], prompt
        d, p = dec.stats(), pre.stats()
        assert d["pd_rooms"] == len(PROMPTS) and p["pd_pages_sent"] >= len(PROMPTS) + 4
        assert d["pd_tokens_received"] == p["pd_tokens_sent"]
        dec.check_integrity()
        pre.check_integrity()
    finally:
        errors = []  # every server is stopped, whatever one of them did
        for srv in reversed(servers):
            try:
                stop_and_check(srv)
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                srv.kill()
                errors.append(e)
        if errors:
            raise errors[0]
