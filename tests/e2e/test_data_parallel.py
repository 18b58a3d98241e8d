"""Data parallelism over HTTP (radixlm/router), real servers (fp32, CPU) on a tiny random Llama with
SmolLM2's tokenizer (tests/tiny_models.py): every check here holds for any deterministic model,
and its forwards cost ~1/10 of SmolLM2's:

- `launch_server --dp-size 2`: a 256-request burst through the router loses nothing and every
  answer is the greedy text a single replica gives; streams pass through; requests sharing a long
  prefix land on one replica (its cached-token count shows it); /v1/responses continuations
  reach the replica holding the previous response; SIGKILL of one replica: it leaves
  the pool, the requests it held are retried on the other, later requests all succeed, its
  children exit, and SIGTERM of the server leaves no process behind. KV integrity on each replica.
- `python -m radixlm.router` in front of the same two replicas (each a full server): round robin
  serves the same text; when one is killed it is removed and the other carries on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from server_harness import http, sse_events, start_server, stop_and_check

COMMON = ["--dtype", "float32", "--max-total-tokens", "8192", "--context-length", "1024",
          "--enable-cache-report", "--timeout-graceful-shutdown", "10"]
PROMPTS = [f"Question {i}: what is {i} plus {i + 1}? Answer:" for i in range(8)] + [
    "The capital of France is", "Write a haiku about the sea.", "Once upon a time",
    "List three colors:", "def fibonacci(n):", "The opposite of hot is", "Translate 'cat' to "
    "Spanish:", "My favourite fruit is"]
SP = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
BURST = 256


@pytest.fixture(scope="module")
def common(tiny_chat_path) -> list[str]:
    return [*COMMON, "--model-path", tiny_chat_path]


@pytest.fixture(scope="module")
def dp(common):
    srv = start_server(["--dp-size", "2", *common], name="dp2")
    yield srv
    stop_and_check(srv)


@pytest.fixture(scope="module")
def standalone(dp):
    """`python -m radixlm.router` in front of the DP server's two replicas (full servers of their
    own; starting two more would double this module's cost): round robin, health checks every
    second. The killed-replica test then checks that it, too, drops the dead one."""
    urls = [w["url"] for w in _workers(dp)]
    router = start_server(["--worker-urls", *urls, "--policy", "round_robin",
                           "--health-check-interval-secs", "1"], name="router",
                          module="radixlm.router")
    yield router
    stop_and_check(router)


def _workers(srv) -> list[dict]:
    r = srv.get("/list_workers")
    assert r.status_code == 200, r.text
    return r.json()["workers"]


def _replica_stats(url: str) -> dict:
    r = http.get(url + "/get_server_info", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["internal_states"][0]


def _check_replica_integrity(url: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        s = _replica_stats(url)
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            break
        assert time.monotonic() < deadline, f"{url} is not idle: {s}"
        time.sleep(0.1)
    r = http.get(url + "/debug/kv_integrity", timeout=60)
    assert r.status_code == 200 and r.json()["ok"] is True, r.text


async def _burst(url: str, n: int, sp: dict) -> list:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        async def one(i):
            r = await client.post(url + "/generate",
                                  json={"text": PROMPTS[i % len(PROMPTS)], "sampling_params": sp})
            return r.status_code, (r.json() if r.status_code == 200 else r.text)
        return await asyncio.gather(*(one(i) for i in range(n)))


def test_burst_of_256_matches_a_single_replica(dp):
    workers = _workers(dp)
    assert len(workers) == 2
    # the reference: each replica alone, one batch of the distinct prompts
    refs = []
    for w in workers:
        r = http.post(w["url"] + "/generate", json={"text": PROMPTS, "sampling_params": SP},
                      timeout=300)
        assert r.status_code == 200, r.text
        refs.append([o["text"] for o in r.json()])
    assert refs[0] == refs[1], "the replicas disagree with each other"
    before = sum(_replica_stats(w["url"])["generated_tokens"] for w in workers)

    results = asyncio.run(_burst(dp.url, BURST, SP))

    failed = [(i, r) for i, r in enumerate(results) if r[0] != 200]
    assert not failed, f"{len(failed)} of {BURST} requests failed, e.g. {failed[:3]}"
    wrong = [(i, r[1]["text"]) for i, r in enumerate(results)
             if r[1]["text"] != refs[0][i % len(PROMPTS)]]
    assert not wrong, f"{len(wrong)} answers differ from a single replica's, e.g. {wrong[:3]}"
    after_workers = _workers(dp)
    assert sum(w["routed"] for w in after_workers) == BURST
    assert all(w["routed"] > 0 and w["in_flight"] == 0 for w in after_workers), after_workers
    after = sum(_replica_stats(w["url"])["generated_tokens"] for w in workers)
    assert after - before == BURST * SP["max_new_tokens"]
    info = dp.get("/get_server_info").json()
    assert info["dp_size"] == 2 and info["load_balance_method"] == "cache_aware"
    assert len(info["internal_states"]) == 2
    for w in workers:
        _check_replica_integrity(w["url"])
    assert dp.get("/debug/kv_integrity").status_code == 200  # the router asks every replica


def test_streams_pass_through(dp):
    sp = {**SP, "max_new_tokens": 96}  # the tiny model's steps are fast: enough for several chunks
    body = {"text": PROMPTS[9], "stream": True, "sampling_params": sp}
    with http.stream("POST", dp.url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        chunks = list(sse_events(r))
    assert len(chunks) >= 2 and chunks[-1]["meta_info"]["completion_tokens"] == 96
    assert chunks[-1]["text"] == dp.generate(PROMPTS[9], **sp)["text"]
    chat = {"model": "default", "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 5, "temperature": 0, "stream": True}
    with http.stream("POST", dp.url + "/v1/chat/completions", json=chat, timeout=120) as r:
        assert r.status_code == 200
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in sse_events(r)
                       if c.get("choices"))
    plain = dp.post("/v1/chat/completions", {**chat, "stream": False}).json()
    assert text == plain["choices"][0]["message"]["content"] and text


def test_shared_prefix_goes_to_one_replica(dp):
    workers = _workers(dp)
    before = {w["url"]: _replica_stats(w["url"])["cached_tokens"] for w in workers}
    system = ("You are a meticulous assistant for a shipping company. You answer questions "
              "about parcels, tracking numbers, customs forms and delivery windows, briefly. ")
    system = system * 3  # ~100 tokens, ~600 characters
    outs = []
    for q in ("Where is my parcel?", "How do I fill in a customs form?", "When do you deliver?",
              "Can I change the address?", "What does 'in transit' mean?"):
        r = dp.post("/v1/chat/completions", {
            "model": "default", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]})
        assert r.status_code == 200, r.text
        outs.append(r.json()["usage"])
    gained = {w["url"]: _replica_stats(w["url"])["cached_tokens"] - before[w["url"]]
              for w in workers}
    # requests 2..5 reuse the system prompt's KV, all on the same replica
    hit = [u for u, g in gained.items() if g > 0]
    assert len(hit) == 1, gained
    assert gained[hit[0]] >= 4 * 80, gained
    assert sum(u["prompt_tokens_details"]["cached_tokens"] for u in outs) == gained[hit[0]]


def test_responses_continue_on_the_replica_holding_them(dp):
    """/v1/responses through the router with the openai SDK: each conversation's turns go to
    the replica that stored the previous one (another would answer 404), where the radix cache
    serves the whole history; retrieval by id finds it too."""
    import openai

    client = openai.OpenAI(base_url=dp.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    for conv in range(2):
        prev, history = None, 0
        for turn in range(3):
            r = client.responses.create(model="default", input=f"Conversation {conv}, turn {turn}",
                                        instructions=f"You are assistant number {conv}. " * 8,
                                        previous_response_id=prev, max_output_tokens=4)
            assert r.usage.input_tokens_details.cached_tokens >= history - 1
            history, prev = r.usage.input_tokens + r.usage.output_tokens, r.id
        assert client.responses.retrieve(prev).previous_response_id is not None
    for w in _workers(dp):
        _check_replica_integrity(w["url"])


def test_standalone_router_serves_round_robin(dp, standalone):
    first = _workers(dp)[0]["url"]
    r = http.post(first + "/generate", json={"text": PROMPTS[8], "sampling_params": SP},
                  timeout=60)
    assert r.status_code == 200, r.text
    texts = [standalone.generate(PROMPTS[8], **SP)["text"] for _ in range(4)]
    assert texts == [r.json()["text"]] * 4
    listed = standalone.get("/list_workers").json()
    assert [w["routed"] for w in listed["workers"]] == [2, 2]  # round robin
    info = standalone.get("/get_server_info").json()
    assert info["dp_size"] == 2 and info["load_balance_method"] == "round_robin"


def test_killed_replica_is_removed_and_requests_go_on(dp, standalone):
    sp = {**SP, "max_new_tokens": 160}  # long enough that the kill lands mid-generation
    box = {}

    def load():
        box["results"] = asyncio.run(_burst(dp.url, 64, sp))

    t = threading.Thread(target=load)
    t.start()
    # the victim: a replica with requests in flight (the second when both are busy). Which one
    # the cache-aware policy loads depends on how fast the burst arrives, and a slow client
    # (a busy machine) may send it all to one replica.
    deadline = time.monotonic() + 60
    while not (busy := [w for w in _workers(dp) if w["in_flight"]]):
        assert time.monotonic() < deadline, "the load never reached a replica"
        time.sleep(0.05)
    victim = busy[-1]
    survivor = next(w["url"] for w in _workers(dp) if w["url"] != victim["url"])
    victim_children = psutil.Process(victim["pid"]).children(recursive=True)
    assert victim_children, "a replica has scheduler and detokenizer children"
    os.kill(victim["pid"], signal.SIGKILL)
    t.join(300)
    failed = [r for r in box["results"] if r[0] != 200]
    # the victim's requests had sent nothing back yet (not streamed): retried on the survivor
    assert not failed, f"{len(failed)} requests failed, e.g. {failed[:2]}"
    listed = dp.get("/list_workers").json()
    assert listed["urls"] == [survivor]
    assert listed["removed"] and listed["removed"][0]["url"] == victim["url"]
    assert dp.get("/health").status_code == 200
    for i in range(8):
        out = dp.generate(PROMPTS[i], **SP)
        assert out["meta_info"]["completion_tokens"] == 6
    alive = psutil.wait_procs(victim_children, timeout=15)[1]
    assert not alive, f"the killed replica's children outlived it: {alive}"
    # the standalone router in front of the same two replicas: requests go on, the dead one leaves
    for i in range(6):
        assert standalone.generate(PROMPTS[i], **SP)["meta_info"]["completion_tokens"] == 6
    listed = standalone.get("/list_workers").json()
    assert listed["urls"] == [survivor]
    assert listed["removed"][0]["url"] == victim["url"]
    _check_replica_integrity(survivor)
