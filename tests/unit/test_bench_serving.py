"""benchmarks/serving.py: metric math on synthetic timings, and the streaming client against a tiny
in-process fake server (FastAPI + uvicorn in a thread) that emits scripted SSE. No model needed."""

import asyncio
import json
import math
import os
import socket
import sys
import threading
import time
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import serving as sv  # noqa: E402
from benchmarks.datasets import BenchRequest  # noqa: E402

np = pytest.importorskip("numpy")
uvicorn = pytest.importorskip("uvicorn")
fastapi = pytest.importorskip("fastapi")


# ---------------------------------------------------------------------------------- metric math

@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    xs = [5.0, 1.0, 9.5, 3.25, 7.0, 2.0, 8.0]
    assert sv.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert sv.percentile([4.0], q) == 4.0
    assert math.isnan(sv.percentile([], q))


def test_token_timer_splits_multi_token_gaps_evenly():
    t = sv.TokenTimer(start=10.0)
    t.add(10.0, 0)  # an event without new tokens (e.g. held-back text) is not the first token
    t.add(10.5, 1)  # first token: TTFT 0.5
    t.add(10.6, 1)  # ITL 0.1
    t.add(10.6, 0)  # no tokens: ignored
    t.add(10.9, 3)  # 0.3 s for 3 tokens: 0.1 x 3
    assert t.ttft == pytest.approx(0.5)
    assert t.itl == pytest.approx([0.1, 0.1, 0.1, 0.1])


def test_tpot_and_summary():
    rs = [sv.RequestResult(ok=True, prompt_len=10, server_prompt_len=10, output_len=5, cached_tokens=4,
                           ttft=0.2, latency=1.0, itl=[0.2] * 4),
          sv.RequestResult(ok=True, prompt_len=30, output_len=1, cached_tokens=0, ttft=0.5, latency=0.5),
          sv.RequestResult(ok=False, prompt_len=99, error="HTTP 503: busy")]
    assert sv.tpot(rs[0]) == pytest.approx(0.2)  # (1.0 - 0.2) / (5 - 1)
    assert sv.tpot(rs[1]) is None  # one token: no TPOT
    s = sv.summarize(rs, duration=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 503: busy"])
    assert s["total_input_tokens"] == 40 and s["total_output_tokens"] == 6
    assert s["request_throughput"] == 1.0 and s["input_throughput"] == 20.0
    assert s["output_throughput"] == 3.0 and s["total_token_throughput"] == 23.0
    assert s["mean_ttft_ms"] == pytest.approx(350.0) and s["median_ttft_ms"] == pytest.approx(350.0)
    assert s["p99_ttft_ms"] == pytest.approx(float(np.percentile([200.0, 500.0], 99)))
    assert s["mean_tpot_ms"] == pytest.approx(200.0) and s["p99_itl_ms"] == pytest.approx(200.0)
    assert s["mean_e2e_latency_ms"] == pytest.approx(750.0)
    assert s["cache_hit_rate"] == pytest.approx(4 / 40)  # failed requests excluded
    assert s["concurrency"] == pytest.approx(0.75)
    empty = sv.summarize([sv.RequestResult(error="x")], 1.0)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None
    json.dumps(empty, allow_nan=False)


# ---------------------------------------------------------------------------------- fake server

GAP = 0.02  # seconds between scripted events
SCRIPT = [1, 0, 2, 1]  # new output tokens per event after the first request's arrival


def _fake_app(state):
    from fastapi import Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = fastapi.FastAPI()

    def sse(obj):
        return "data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n"

    @app.get("/get_server_info")
    async def info():
        return {"device": "fake-device", "dtype": "float32", "model_path": "/m/fake.gguf", "api_key": None}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/flush_cache")
    async def flush():
        state["flushed"] += 1
        return "ok"

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        state["bodies"].append(body)
        ids = body["input_ids"]
        if ids[0] == 0:  # scripted failure before the stream
            return JSONResponse({"error": {"message": "bad prompt"}}, status_code=400)

        async def events():
            state["inflight"] += 1
            state["max_inflight"] = max(state["max_inflight"], state["inflight"])
            try:
                out = []
                for k, n in enumerate(SCRIPT):
                    await asyncio.sleep(GAP)
                    if ids[0] == 1 and k == 2:
                        yield sse({"error": {"message": "mid-stream failure"}})
                        break
                    out += [7] * n
                    meta = {"prompt_tokens": len(ids), "completion_tokens": len(out), "cached_tokens": 2,
                            "finish_reason": {"type": "length"} if k == len(SCRIPT) - 1 else None}
                    yield sse({"text": "x" * len(out), "output_ids": list(out), "meta_info": meta})
                yield sse("[DONE]")
            finally:
                state["inflight"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state["bodies"].append(body)

        async def events():
            for piece in ["a", "", "bc", "d"]:
                await asyncio.sleep(GAP)
                yield sse({"choices": [{"index": 0, "text": piece, "finish_reason": None}]})
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 4,
                     "prompt_tokens_details": {"cached_tokens": 1}}
            yield sse({"choices": [], "usage": usage})
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    state = {"bodies": [], "flushed": 0, "inflight": 0, "max_inflight": 0}
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_fake_app(state), log_level="error"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    assert server.started
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    th.join(timeout=5)
    sock.close()


def _args(url, **kw):
    base = dict(base_url=url, backend="radixlm", model=None, api_key=None, send_text=False,
                disable_ignore_eos=False, request_rate=float("inf"), max_concurrency=None, seed=0,
                flush_cache=False)
    base.update(kw)
    return SimpleNamespace(**base)


def test_native_stream_timings_and_counts(fake_server):
    url, state = fake_server
    reqs = [BenchRequest("p", [5, 6, 7, 8], 4), BenchRequest("p", [0, 1], 4), BenchRequest("p", [1, 2], 4)]
    out = asyncio.run(sv.run_benchmark(_args(url, flush_cache=True), reqs))
    assert state["flushed"] == 1
    assert out["server_info"] == {"device": "fake-device", "dtype": "float32", "model_path": "/m/fake.gguf"}
    assert (out["completed"], out["failed"]) == (1, 2)
    assert any(e.startswith("HTTP 400") and "bad prompt" in e for e in out["errors"])
    assert "mid-stream failure" in out["errors"]
    assert out["total_output_tokens"] == 4 and out["cache_hit_rate"] == pytest.approx(0.5)
    # the server sleeps a gap before each of 4 events; exact ITL math is tested on TokenTimer, as
    # a loaded machine can deliver two events in one read
    assert out["mean_ttft_ms"] >= GAP * 1000 * 0.9
    assert out["mean_e2e_latency_ms"] >= 4 * GAP * 1000 * 0.9
    assert 0 <= out["median_itl_ms"] <= out["mean_e2e_latency_ms"] - out["mean_ttft_ms"]
    body = state["bodies"][-1]
    assert body["stream"] is True and body["sampling_params"]["max_new_tokens"] == 4
    assert body["sampling_params"]["ignore_eos"] is True


def test_openai_stream_and_concurrency_cap(fake_server):
    url, state = fake_server
    reqs = [BenchRequest("p", [3, 4, 5], 4) for _ in range(2)]
    out = asyncio.run(sv.run_benchmark(_args(url, backend="openai", disable_ignore_eos=True), reqs))
    assert (out["completed"], out["failed"]) == (2, 0)
    assert out["total_output_tokens"] == 8 and out["cache_hit_rate"] == pytest.approx(1 / 3, abs=1e-4)
    body = state["bodies"][-1]
    assert body["model"] == "fake-model" and body["prompt"] == [3, 4, 5] and "ignore_eos" not in body
    assert body["stream_options"] == {"include_usage": True}

    state["max_inflight"] = 0
    reqs = [BenchRequest("p", [9, 9], 4) for _ in range(6)]
    out = asyncio.run(sv.run_benchmark(_args(url, max_concurrency=2, request_rate=200.0), reqs))
    assert out["completed"] == 6 and state["max_inflight"] <= 2


class _FakeTokenizer:
    all_special_ids = [0]
    added_tokens_decoder = {}

    def __len__(self):
        return 50

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_main_prints_one_json_line(fake_server, tmp_path, capsys):
    url, _ = fake_server
    result_file = tmp_path / "r.jsonl"
    argv = ["--base-url", url, "--dataset-name", "random", "--num-prompts", "4", "--random-input-len", "8",
            "--random-output-len", "4", "--request-rate", "100", "--result-file", str(result_file)]
    res = sv.main(argv, tokenizer=_FakeTokenizer())
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(line) == res == json.loads(result_file.read_text())
    assert res["completed"] + res["failed"] == 4 and res["device"] == "fake-device"
    for key in ("request_throughput", "output_throughput", "p99_ttft_ms", "median_itl_ms", "p99_tpot_ms",
                "mean_e2e_latency_ms", "concurrency", "git_commit", "command", "date"):
        assert key in res
