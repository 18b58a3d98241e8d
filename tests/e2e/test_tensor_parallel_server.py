"""`launch_server --tp-size 2` on the CPU (gloo): the scheduler is rank 0, the launcher starts rank
1 as a worker process; greedy output equals the tp_size=1 engine's (fp32), the KV integrity check
passes, and SIGTERM leaves no process behind (worker included). The model is a tiny random Llama
on SmolLM2's tokenizer with SmolLM2's 3 KV heads (split 2 + 1): the server's TP plumbing is under
test here; SmolLM2's own numerics under TP are tests/unit/test_tensor_parallel*.py's."""

from __future__ import annotations

import pytest

from radixlm.runtime.engine import Engine
from server_harness import start_server, stop_and_check

PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "The capital of France is a city where"]  # the third: a radix cache hit
SP = {"max_new_tokens": 16, "temperature": 0}
COMMON = dict(dtype="float32", max_total_tokens=4096, context_length=1024)


@pytest.fixture(scope="module")
def tp1_texts(tiny_chat_path):
    eng = Engine(device="cpu", model_path=tiny_chat_path, **COMMON)
    try:
        return [r["text"] for r in eng.generate(PROMPTS, SP)]
    finally:
        eng.shutdown()


def test_server_tp2_matches_engine_tp1(tp1_texts, tiny_chat_path):
    args = ["--tp-size", "2", "--model-path", tiny_chat_path]
    for k, v in COMMON.items():
        args += ["--" + k.replace("_", "-"), str(v)]
    srv = start_server(args, name="tp2")
    try:
        assert len(srv.known_children) >= 3  # scheduler, detokenizer, TP rank 1
        texts = [srv.generate(p, **SP)["text"] for p in PROMPTS]
        assert texts == tp1_texts
        srv.check_integrity()
        # the model's own folder (paths elsewhere are refused before the scheduler sees them)
        r = srv.post("/update_weights_from_disk", {"model_path": tiny_chat_path})
        assert r.status_code == 400 and "tp_size" in r.text
    finally:
        stop_and_check(srv)
