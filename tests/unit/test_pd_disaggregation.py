"""Prefill/decode disaggregation on the CPU (gloo): real servers on a tiny random Llama with
SmolLM2's tokenizer, one prefill + one decode server behind `radixlm router --pd-disaggregation`,
shared by the module.

The colocated reference is the prefill server itself: a request without bootstrap fields runs
there on the ordinary colocated path (same weights, same flags), so greedy outputs must match
token for token. A third server (a second prefill server) is the one the failure tests kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e"))
from server_harness import http, ROOT, sse_events, start_server, stop_and_check  # noqa: E402

from radixlm.net import free_port  # noqa: E402
from radixlm.runtime.config import ServerArgs  # noqa: E402
from radixlm.runtime.distributed.pd_args import check_disaggregation_args  # noqa: E402

TIMEOUT_S = 4  # --disaggregation-timeout of the servers here: failures must come well before
SHORT_TIMEOUT_S = 1.5  # the second prefill server's
COMMON = ["--dtype", "float32", "--max-total-tokens", "4096", "--context-length", "1024",
          "--chunked-prefill-size", "48", "--disaggregation-timeout", str(TIMEOUT_S),
          "--timeout-graceful-shutdown", "5"]
PROMPTS = ["The capital of France is",
           "Once upon a time, in a land far away, there lived a " * 8,  # 3 chunks of 48: 3 pages
           "def fibonacci(n): return n if n < 2 else",
           "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"]


def _wait_all(procs: dict) -> None:
    """Wait for servers started side by side (a start is mostly imports and the model; a router
    starts once its workers answer); on any failure every one of them is killed."""
    errors = []

    def one(srv):
        try:
            srv.wait_ready()
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)

    threads = [threading.Thread(target=one, args=(srv,)) for srv in procs.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for srv in procs.values():
            srv.kill()
        raise errors[0]


@pytest.fixture(scope="module")
def pd(tiny_chat_path):
    model = ["--model-path", tiny_chat_path, *COMMON]
    boot, boot2 = free_port(), free_port()
    srv = {"prefill": start_server([*model, "--disaggregation-mode", "prefill",
                                    "--disaggregation-bootstrap-port", str(boot)],
                                   name="prefill", wait=False),
           "decode": start_server([*model, "--disaggregation-mode", "decode"], name="decode",
                                  wait=False),
           # the one the failure tests kill; a short timeout for the unclaimed-room test
           "prefill2": start_server([*model, "--disaggregation-mode", "prefill",
                                     "--disaggregation-bootstrap-port", str(boot2),
                                     "--disaggregation-timeout", str(SHORT_TIMEOUT_S)],
                                    name="prefill2", wait=False)}
    srv["router"] = start_server(["--pd-disaggregation", "--prefill", srv["prefill"].url,
                                  str(boot), "--decode", srv["decode"].url], name="router",
                                 wait=False, module="radixlm.router")
    srv["router2"] = start_server(["--pd-disaggregation", "--prefill", srv["prefill2"].url,
                                   "--decode", srv["decode"].url], name="router2", wait=False,
                                  module="radixlm.router")
    _wait_all(srv)
    srv["boot2"] = boot2
    yield srv
    errors = []  # every server is stopped, whatever one of them did
    for name in ("router", "router2", "prefill", "decode", "prefill2"):
        try:
            if srv[name].stopped:  # killed by its test
                os.unlink(srv[name].log_path)
            else:
                stop_and_check(srv[name])
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            srv[name].kill()
            errors.append(e)
    if errors:
        raise errors[0]


def _gen(server, prompt, **kw) -> dict:
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 24,
                                                **kw.pop("sp", {})}, **kw}
    r = server.post("/generate", body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stats_of(server) -> dict:
    return server.stats()


def test_greedy_matches_colocated(pd):
    """Greedy ids and text through the PD router == the same prompt run colocated; the KV
    really moved (the decode side received the prompts' tokens, in pages)."""
    before = _stats_of(pd["decode"])["pd_tokens_received"]
    pages = _stats_of(pd["prefill"])["pd_pages_sent"]
    for prompt in PROMPTS:
        out = _gen(pd["router"], prompt, sp={"n": 1})  # first: the prefill side computes it all
        ref = _gen(pd["prefill"], prompt)
        assert out["output_ids"] == ref["output_ids"], prompt
        assert out["text"] == ref["text"]
        assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
    assert _stats_of(pd["decode"])["pd_tokens_received"] > before
    # a page per prefill chunk: the long prompt's KV left in three pieces while it computed
    assert _stats_of(pd["prefill"])["pd_pages_sent"] - pages >= len(PROMPTS) + 2


def test_stop_strings_logprobs_and_streaming_match(pd):
    prompt = PROMPTS[1]
    ref = _gen(pd["prefill"], prompt)
    stop = ref["text"][len(ref["text"]) // 2:][:6]  # a string in the middle of the output
    ref_stop = _gen(pd["prefill"], prompt, sp={"stop": [stop]})
    out_stop = _gen(pd["router"], prompt, sp={"stop": [stop]})
    assert out_stop["text"] == ref_stop["text"] and len(ref_stop["text"]) < len(ref["text"])
    assert out_stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}

    lp = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    ref_lp, out_lp = _gen(pd["prefill"], prompt, **lp), _gen(pd["router"], prompt, **lp)
    for key in ("input_token_logprobs", "output_token_logprobs", "output_top_logprobs"):
        a, b = ref_lp["meta_info"][key], out_lp["meta_info"][key]
        assert len(a) == len(b) > 0, key
        flat = lambda x: [v for e in x for v in (e if isinstance(e[0], list) else [e])]  # noqa
        for (va, ta, _), (vb, tb, _) in zip(flat(a), flat(b)):
            assert ta == tb and (va is None and vb is None or abs(va - vb) < 1e-4), key

    # 160 tokens: the tiny model writes 24 faster than the first chunk leaves (one chunk only)
    sp = {"temperature": 0, "max_new_tokens": 160, "ignore_eos": True}
    ref_long = _gen(pd["prefill"], prompt, sp=sp, **lp)
    body = {"text": prompt, "sampling_params": sp, "stream": True, **lp}
    with http.stream("POST", pd["router"].url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = list(sse_events(r))
    assert len(chunks) > 1 and all("error" not in c for c in chunks)
    assert chunks[-1]["text"] == ref_long["text"]
    assert chunks[-1]["output_ids"] == ref_long["output_ids"]
    assert chunks[0]["meta_info"]["input_token_logprobs"] == ref_long["meta_info"][
        "input_token_logprobs"]


def test_openai_routes_match_colocated(pd):
    """/v1/chat/completions (streamed too) and /v1/completions through the PD router."""
    chat = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 12,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    rooms = _stats_of(pd["decode"])["pd_rooms"]
    out = pd["router"].post("/v1/chat/completions", chat)
    ref = pd["prefill"].post("/v1/chat/completions", chat)
    assert out.status_code == ref.status_code == 200, out.text
    a, b = out.json()["choices"][0], ref.json()["choices"][0]
    assert a["message"]["content"] == b["message"]["content"]
    assert [t["token"] for t in a["logprobs"]["content"]] == \
        [t["token"] for t in b["logprobs"]["content"]]
    with http.stream("POST", pd["router"].url + "/v1/chat/completions",
                     json={**chat, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        text = "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in sse_events(r) if c.get("choices"))
    assert text == b["message"]["content"]
    comp = {"prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0, "stop": ["\n\n"]}
    out, ref = pd["router"].post("/v1/completions", comp), pd["prefill"].post("/v1/completions",
                                                                               comp)
    assert out.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
    assert _stats_of(pd["decode"])["pd_rooms"] == rooms + 3  # all three went through PD
    for bad in ({**comp, "n": 2}, {**comp, "prompt": ["a", "b"]}):
        r = pd["router"].post("/v1/completions", bad)
        assert r.status_code == 400 and "disaggregated" in r.text, r.text
    assert pd["router"].post("/v1/embeddings", {"input": "a"}).status_code == 501


def test_decode_prefix_hit_is_not_resent(pd):
    """A second prompt sharing a long prefix: the decode side serves the prefix from its own
    radix tree and receives only the rest."""
    head = "System: you are a helpful assistant who answers in one short line. " * 3
    first, second = head + "Question: what is two plus two?", head + "Question: name a color."
    _gen(pd["router"], first)
    s0 = _stats_of(pd["decode"])
    out = _gen(pd["router"], second)
    s1 = _stats_of(pd["decode"])
    n = out["meta_info"]["prompt_tokens"]
    hit = s1["pd_prefix_hit_tokens"] - s0["pd_prefix_hit_tokens"]
    received = s1["pd_tokens_received"] - s0["pd_tokens_received"]
    assert hit > n // 2, (hit, n)
    assert received == n - 1 - hit  # only the tail came over the link
    assert out["output_ids"] == _gen(pd["prefill"], second)["output_ids"]
    pd["decode"].check_integrity()
    pd["prefill"].check_integrity()


def test_unreachable_prefill_fails_the_request(pd):
    """A decode request whose prefill server does not answer: an error (not a hang), and the
    reserved slots are back. (A prompt the decode side has not cached: a full prefix hit would
    need no KV from anyone.)"""
    body = {"text": "A prompt no server has seen: 31 41 59 26 53",
            "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(), "bootstrap_room": 7}
    t0 = time.monotonic()
    r = pd["decode"].post("/generate", body, timeout=30)
    assert r.status_code >= 500 and "bootstrap" in r.text, r.text
    assert time.monotonic() - t0 < TIMEOUT_S + 5
    pd["decode"].check_integrity()


def test_unclaimed_room_times_out_on_prefill(pd):
    """A prefill request no decode server claims (its decode died before the handshake): the
    prefill side fails it after --disaggregation-timeout and holds nothing."""
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": pd["boot2"], "bootstrap_room": 8}
    r = pd["prefill2"].post("/generate", body, timeout=30)
    assert r.status_code == 504 and "no decode server claimed" in r.text, r.text
    pd["prefill2"].check_integrity()


def test_bad_flags_and_fields_are_refused(pd):
    base = ServerArgs(disaggregation_mode="decode")
    assert check_disaggregation_args(base) is base
    assert check_disaggregation_args(ServerArgs(disaggregation_mode="null")).disaggregation_mode \
        is None
    for bad, words in [(dict(disaggregation_transfer_backend="mooncake"), "not available"),
                       (dict(disable_radix_cache=True), "radix cache"),
                       (dict(disaggregation_mode="both"), "prefill, decode"),
                       (dict(tp_size=2), "--tp-size"),
                       (dict(disaggregation_transfer_backend="nccl", device="cpu"), "CUDA")]:
        with pytest.raises(ValueError, match=words):
            check_disaggregation_args(base.replace(**bad))
    cli = subprocess.run([sys.executable, "-m", "radixlm.launch_server", "--disaggregation-mode",
                          "decode", "--disaggregation-transfer-backend", "mooncake"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 2 and "mooncake" in cli.stderr, cli.stderr
    # a colocated server refuses bootstrap fields; the PD router refuses a batch
    r = pd["router"].post("/generate", {"text": ["a", "b"]})
    assert r.status_code == 400 and "batch" in r.text
    r = pd["decode"].post("/generate", {"text": "a", "bootstrap_room": -1,
                                        "bootstrap_host": "127.0.0.1", "bootstrap_port": 1})
    assert r.status_code == 400 and "bootstrap_room" in r.text


def _wait_for(cond, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_prefill_killed_mid_request(pd):
    """The prefill server dies while the decode side waits for a request's KV (its link to
    that prefill server already up): the client gets an error well before the timeout, the
    decode side's pool passes the integrity check, and it goes on serving."""
    router2, p2, dec = pd["router2"], pd["prefill2"], pd["decode"]
    _gen(router2, PROMPTS[0])  # the link exists
    rooms = _stats_of(dec)["pd_rooms"]
    os.kill(p2.pid, signal.SIGSTOP)  # (the launcher; its scheduler too, below)
    for child in p2.children():
        os.kill(child.pid, signal.SIGSTOP)
    result = {}

    def call():
        t0 = time.monotonic()
        result["r"] = http.post(router2.url + "/generate", json={
            "text": PROMPTS[2], "sampling_params": {"max_new_tokens": 8}}, timeout=60)
        result["s"] = time.monotonic() - t0

    t = threading.Thread(target=call)
    t.start()
    _wait_for(lambda: _stats_of(dec)["pd_rooms"] > rooms)  # the decode side reserved its slots
    t_kill = time.monotonic()
    p2.kill()
    t.join(30)
    assert not t.is_alive()
    r = result["r"]
    assert r.status_code >= 500, r.text
    assert time.monotonic() - t_kill < TIMEOUT_S, "failed by the timeout, not the link error"
    dec.check_integrity()
    # a stream through the dead prefill server ends with an error chunk, not a hang
    body = {"text": "Another prompt for a dead prefill server", "stream": True,
            "sampling_params": {"max_new_tokens": 8}}
    with http.stream("POST", router2.url + "/generate", json=body, timeout=60) as r:
        chunks = list(sse_events(r)) if r.status_code == 200 else [{"error": r.text}]
    assert chunks and "error" in chunks[-1], chunks
    dec.check_integrity()
    assert _gen(pd["router"], PROMPTS[0])["output_ids"]  # the other pair still works
    p2.stopped = True


def test_decode_killed_mid_request(pd):
    """The decode server dies while the prefill side holds a request for it: the client gets
    an error, the prefill side frees the request (integrity holds) and keeps serving."""
    router, pre, dec = pd["router"], pd["prefill"], pd["decode"]
    for proc in [dec.pid] + [c.pid for c in dec.children()]:
        os.kill(proc, signal.SIGSTOP)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", http.post(
        router.url + "/generate", json={"text": PROMPTS[3],
                                        "sampling_params": {"max_new_tokens": 8}}, timeout=60)))
    t.start()
    _wait_for(lambda: pre.get("/get_server_info").json()["open_requests"] > 0)
    dec.kill()
    t.join(30)
    assert not t.is_alive()
    assert result["r"].status_code >= 500, result["r"].text
    pre.check_integrity()
    assert pre.generate("Hello", max_new_tokens=2, temperature=0)["output_ids"]
    dec.stopped = True
