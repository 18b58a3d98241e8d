"""`launch_server --tp-size 2` on the CPU (gloo): the scheduler is rank 0, the launcher starts rank
1 as a worker process; greedy output equals the tp_size=1 engine's (fp32), the KV integrity check
passes, and SIGTERM leaves no process behind (worker included). SIGKILL of rank 1 mid-stream:
the stream ends with an error naming it and the server exits non-zero within 5 s. The model is a tiny random Llama
on SmolLM2's tokenizer with SmolLM2's 3 KV heads (split 2 + 1): the server's TP plumbing is under
test here; SmolLM2's own numerics under TP are tests/unit/test_tensor_parallel*.py's."""

from __future__ import annotations

import json
import threading
import time

import psutil
import pytest

from radixlm.runtime.engine import Engine
from server_harness import http, start_server, stop_and_check

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
        _kill_rank1_mid_stream(srv)
    finally:
        stop_and_check(srv)


def _kill_rank1_mid_stream(srv) -> None:
    """Rank 1 (the one spawned process among the children) dies while a stream runs: the
    client gets an error chunk that names it, and the server exits non-zero within 5 s."""
    rank1 = [p for p in srv.known_children if "spawn_main" in " ".join(p.cmdline())]
    assert len(rank1) == 1, [p.cmdline() for p in srv.known_children]
    body = {"text": "A long story:", "stream": True,
            "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    lines: list[str] = []
    started = threading.Event()

    def read():
        with http.stream("POST", srv.url + "/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    lines.append(line)
                    started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(60), "the stream never started"
    rank1[0].kill()
    t0 = time.monotonic()
    srv.proc.wait(timeout=30)
    assert time.monotonic() - t0 < 5.0 and srv.proc.returncode != 0
    assert "the radixlm-tp1 process died (exit code -9)" in srv.log()
    reader.join(10)
    assert not reader.is_alive(), "the stream hangs after rank 1 died"
    last = json.loads(lines[-2][5:])  # then [DONE]
    assert "radixlm-tp1 process died" in last["error"]["message"], lines[-2:]
    assert not psutil.wait_procs(srv.known_children, timeout=10)[1], "children left"
