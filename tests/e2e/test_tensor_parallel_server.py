"""`launch_server --tp-size 2` on the CPU (gloo): the scheduler is rank 0, the launcher starts rank
1 as a worker process; greedy output equals the tp_size=1 engine's (fp32, bundled SmolLM2), the KV
integrity check passes, and SIGTERM leaves no process behind (worker included)."""

from __future__ import annotations

import pytest

from radixlm.runtime.engine import Engine
from server_harness import start_server, stop_and_check

PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "The capital of France is a city where"]  # the third: a radix cache hit
SP = {"max_new_tokens": 16, "temperature": 0}
COMMON = dict(dtype="float32", max_total_tokens=4096, context_length=1024)


@pytest.fixture(autouse=True, scope="module")
def _dense_gguf():
    """TP splits dense weights only (a GGUF model keeps its quantized blocks at tp_size=1 when
    the quantized CPU GEMM is available): both sides of every comparison run dense."""
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setenv("RADIXLM_GGUF_KEEP_QUANTIZED", "off")
        yield


@pytest.fixture(scope="module")
def tp1_texts(_dense_gguf):
    eng = Engine(device="cpu", **COMMON)
    try:
        return [r["text"] for r in eng.generate(PROMPTS, SP)]
    finally:
        eng.shutdown()


def test_server_tp2_matches_engine_tp1(tp1_texts):
    args = ["--tp-size", "2"]
    for k, v in COMMON.items():
        args += ["--" + k.replace("_", "-"), str(v)]
    srv = start_server(args, name="tp2")
    try:
        assert len(srv.known_children) >= 3  # scheduler, detokenizer, TP rank 1
        texts = [srv.generate(p, **SP)["text"] for p in PROMPTS]
        assert texts == tp1_texts
        srv.check_integrity()
        r = srv.post("/update_weights_from_disk", {"model_path": "/nonexistent"})
        assert r.status_code == 400 and "tp_size" in r.text
    finally:
        stop_and_check(srv)
