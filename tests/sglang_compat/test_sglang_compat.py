"""SGLang compatibility: the programs in compat_programs.py run (a) by radixlm's frontend (`import
radixlm as sgl`) and (b) by the real SGLang frontend (PyPI `sglang`, in the clients venv
`.venv-sglang`, created on first use by clients_venv.py), both against one real radixlm server.

Each program's `same` part (greedy text, variables, decisions) must be equal between the two
frontends; its `facts` (cache hits, token counts, constraint satisfaction) are checked for each
frontend on its own. The programs run on the shared tiny-model server, except those whose checks
need a real model's text (compat_programs.REAL_MODEL), which run on the shared SmolLM2 server. Both
servers run in float32 so that greedy decoding does not flip between two runs whose requests met
the cache at different points (in bf16 a cached prefix can decode differently from the same
prefix computed afresh).

The same module drives radixlm's LiteLLM backend (real `litellm`, against the server's `/v1`)
and VertexAI/Gemini backend (real `google-genai`, against fake_gemini.py) in the clients venv:
those packages' pins fight radixlm's venv.

Everything that needs the clients venv is skipped, with the reason, when the venv cannot be made
(no package index) or RADIXLM_SKIP_SGLANG_COMPAT=1 is set; radixlm's own half always runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import radixlm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import clients_venv  # noqa: E402
from fake_gemini import FakeGemini  # noqa: E402
import compat_programs as programs  # noqa: E402
import compat_runner as runner  # noqa: E402

# a module fixture runs a whole frontend (minutes on 2 shared cores): above the 600 s default
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

NAMES = list(programs.PROGRAMS)
SGLANG_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def server(tiny_server):
    """The shared fp32 tiny-model server with the cache report on (tests/conftest.py)."""
    try:
        yield tiny_server.url
    finally:
        radixlm.set_default_backend(None)


@pytest.fixture(scope="module")
def real_server(main_server) -> str:
    """The shared fp32 SmolLM2 server, for the programs in compat_programs.REAL_MODEL."""
    return main_server.url


@pytest.fixture(scope="module")
def ours(server, real_server) -> dict:
    return runner.run_all(runner.load_frontend("radixlm"), server, real_server)


@pytest.fixture(scope="module")
def clients_python() -> str:
    if os.environ.get("RADIXLM_SKIP_SGLANG_COMPAT") == "1":
        pytest.skip("RADIXLM_SKIP_SGLANG_COMPAT=1: the clients venv's half is off")
    try:
        return clients_venv.ensure(log=lambda msg: print(msg, file=sys.stderr))
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        last = str(exc).strip().splitlines()[-1:] or ["?"]
        what = ", ".join([clients_venv.SGLANG] + clients_venv.CLIENT_SDKS)
        pytest.skip(f"the clients venv ({what}) could not be installed into "
                    f"{clients_venv.VENV}: {last[0][:300]}")


@pytest.fixture(scope="module")
def theirs(server, real_server, clients_python, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sglang") / "results.json"
    # the clients venv sees radixlm's site-packages (reused packages); keep radixlm itself out
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([clients_python, os.path.join(HERE, "compat_runner.py"),
                        "--frontend", "sglang", "--url", server, "--real-model-url", real_server,
                        "--out", str(out)],
                       capture_output=True, text=True, timeout=SGLANG_TIMEOUT_S, env=env)
    assert r.returncode == 0, f"the SGLang runner failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    with open(out) as f:
        return json.load(f)


def result_of(results: dict, name: str) -> dict:
    res = results[name]
    assert "error" not in res, f"{results['_frontend']['module']}: {name} raised:\n{res['error']}"
    return res


# --- facts: what each frontend's run must show on its own -----------------------------------------

def check_few_shot(same, facts, frontend):
    assert same["answer"].strip() and "\n" not in same["answer"]
    assert same["text"].endswith("\nA:" + same["answer"])
    assert all(a.strip() and "\n" not in a for a in same["batch"])
    assert facts["finish"]["type"] in ("stop", "length")
    assert all(c >= 30 for c in facts["batch_cached"]), facts  # the shared few-shot prefix


def check_multi_turn(same, facts, frontend):
    assert [m["role"] for m in same["messages"]] == ["system", "user", "assistant", "user",
                                                      "assistant"]
    assert same["messages"][2]["content"] == same["a1"].lstrip()
    assert same["text"].startswith("<|im_start|>system\nYou are a terse assistant.<|im_end|>\n")
    a2 = facts["a2"]
    assert a2["cached_tokens"] >= a2["prompt_tokens"] // 2, a2  # the first turn was cached


def check_fork_gather(same, facts, frontend):
    assert isinstance(same["tip"], list) and len(same["tip"]) == 3
    assert same["text"].startswith("Three tips for staying healthy:\nSummary:")
    if frontend == "radixlm":
        # fork committed the shared prefix first: every branch read it from the cache
        assert all(c >= 5 for c in facts["branch_cached"]), facts
    # (SGLang's fork decides whether to commit the prefix from the text before the worker has
    # appended it, so it often sends no commit and one branch meets a cold cache; the summary
    # below reads the prefix the branches left in the cache either way)
    assert facts["summary"]["cached_tokens"] >= 5, facts


def check_fork_concat(same, facts, frontend):
    assert same["text"].startswith("Two facts about the Moon.\nFact 1:")
    assert "\nFact 2:" in same["text"] and same["text"].endswith("In short:" + same["short"])


def check_select_choices(same, facts, frontend):
    assert same["city"] in (" Paris", " Banana", " Keyboard")
    assert same["color"] in (" blue", " green", " purple") and same["hot"] in (" yes", " no")
    assert same["text"] == ("The capital of France is the city of" + same["city"] +
                            ". The color of the sky on a clear day is" + same["color"] +
                            ". Is fire hot? Answer:" + same["hot"])
    assert len(facts["scores"]) == 3


def check_regex_json(same, facts, frontend):
    octet = r"(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"
    assert re.fullmatch(rf"({octet}\.){{3}}{octet}", same["ip"]), same["ip"]
    person = json.loads(same["person"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert isinstance(same["legs"], str) and int(same["legs"]) == int(same["legs"].strip())


def check_streaming_logprobs(same, facts, frontend):
    assert same["streamed"] == same["a"] == same["plain"] and same["a"]
    assert same["text_iter"] == "Once upon a time" + same["a"]
    assert len(facts["chunk_texts"]) >= 2  # streamed in pieces, not at the end
    counts = facts["chunk_completion_tokens"]
    assert counts == sorted(counts) and counts[-1] == facts["plain_completion_tokens"]
    # the server's default stream shape (SGLang's): every chunk's logprob list holds all tokens
    # so far, so the last chunk's equals the non-streamed result
    lists = [[tuple(t[:2]) for t in (chunk or [])] for chunk in facts["chunk_logprobs"]]
    assert [len(x) for x in lists] == counts, lists
    assert all(a == b[:len(a)] for a, b in zip(lists, lists[1:]))
    want = [tuple(t[:2]) for t in facts["plain_logprobs"]]
    assert [t[1] for t in lists[-1]] == [t[1] for t in want], (lists[-1], want)
    assert all(abs(a[0] - b[0]) < 1e-3 for a, b in zip(lists[-1], want))


def check_min_tokens(same, facts, frontend):
    free, forced = facts["free"], facts["forced"]
    assert free["completion_tokens"] < 12 and free["finish_reason"]["type"] == "stop", free
    assert forced["completion_tokens"] >= 12, forced
    assert forced["completion_tokens"] > free["completion_tokens"]


def check_tool_use(same, facts, frontend):
    assert re.fullmatch(r"[0-9]+ ?[-+*] ?[0-9]+", same["expr"])
    value = eval(same["expr"], {"__builtins__": {}})
    assert f"\nResult: {value}\nSo the answer is" in same["text"]
    assert facts["final"]["cached_tokens"] >= facts["final"]["prompt_tokens"] // 2, facts


def check_react(same, facts, frontend):
    assert 1 <= len(same["actions"]) <= 2 and set(same["actions"]) <= {"search", "finish"}
    for i, action in enumerate(same["actions"]):
        assert f"\nAction {i}: {action}" in same["text"]


def check_stop_regex(same, facts, frontend):
    fr = facts["a"]["finish_reason"]
    if fr["type"] == "stop" and fr.get("matched") == "1[0-9]":
        assert re.search(r"1[0-9]$", same["a"]), same  # SGLang: the output keeps the match
    else:
        assert fr["type"] == "length" and not re.search(r"1[0-9]", same["a"]), (same, fr)


def check_reasoning(same, facts, frontend):
    assert facts["ok"] and same["reasoning"].strip()
    assert "<think>" not in same["a"] and "</think>" not in same["text"]


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_")}


def test_every_program_has_a_check():
    assert set(CHECKS) == set(NAMES)
    assert set(programs.REAL_MODEL) <= set(NAMES)  # a misspelt name would run on the tiny model


@pytest.mark.parametrize("name", NAMES)
def test_radixlm_frontend(ours, name):
    res = result_of(ours, name)
    CHECKS[name](res["same"], res["facts"], "radixlm")


@pytest.mark.parametrize("name", NAMES)
def test_sglang_frontend(theirs, name):
    assert theirs["_frontend"]["module"] == "sglang"
    res = result_of(theirs, name)
    CHECKS[name](res["same"], res["facts"], "sglang")


@pytest.mark.parametrize("name", NAMES)
def test_same_results(ours, theirs, name):
    a, b = result_of(ours, name)["same"], result_of(theirs, name)["same"]
    assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}


# --- radixlm's LiteLLM and VertexAI backends through the real packages (clients venv) -------------

@pytest.fixture(scope="module")
def api_backends(real_server, clients_python, tmp_path_factory):
    """(results of api_backends_check.py, the requests the fake Gemini server received). On
    SmolLM2: the checks read its answers (a random model's start with a space, which the chat
    messages strip)."""
    out = tmp_path_factory.mktemp("api") / "results.json"
    root = os.path.dirname(os.path.dirname(HERE))
    env = dict(os.environ, PYTHONPATH=root, LITELLM_LOCAL_MODEL_COST_MAP="True")
    fake = FakeGemini()
    try:
        r = subprocess.run([clients_python, os.path.join(HERE, "api_backends_check.py"),
                            "--radixlm-url", real_server, "--gemini-url", fake.url, "--out", str(out)],
                           capture_output=True, text=True, timeout=300, env=env)
    finally:
        fake.close()
    assert r.returncode == 0, (f"api_backends_check.py failed:\n{r.stdout[-3000:]}\n"
                               f"{r.stderr[-5000:]}")
    with open(out) as f:
        return json.load(f), fake.requests


def cases_of(results: dict, backend: str) -> dict:
    res = results[backend]
    assert "error" not in res, res["error"]
    for name, case in res.items():
        assert "error" not in case, f"{backend} {name}:\n{case['error']}"
    return res


def check_api_cases(res: dict, backend: str) -> None:
    chat = res["chat"]
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "user",
                                                     "assistant"]
    assert chat["messages"][2]["content"] == chat["a"] and chat["a"].strip()
    assert chat["messages"][4]["content"] == chat["b"] and chat["b"].strip()
    for meta in (chat["meta_a"], chat["meta_b"], res["stream"]["meta_a"]):
        assert meta["finish_reason"]["type"] in ("stop", "length") and meta["completion_tokens"]
    stream = res["stream"]
    assert len(stream["pieces"]) >= 2 and "".join(stream["pieces"]) == stream["a"] == chat["a"]
    assert res["plain"]["text"] == "Q: What is the capital of Italy?\nA:" + res["plain"]["a"]
    assert res["regex"]["raised"] == "UnsupportedPrimitive"
    assert f"the {backend} backend does not support regex" in res["regex"]["message"]


def test_litellm_backend_against_radixlm(api_backends):
    res = cases_of(api_backends[0], "litellm")
    check_api_cases(res, "LiteLLM")
    assert res["chat"]["meta_b"]["prompt_tokens"] > res["chat"]["meta_a"]["prompt_tokens"]


def test_vertexai_backend_against_a_fake_gemini(api_backends):
    results, requests = api_backends
    res = cases_of(results, "vertexai")
    check_api_cases(res, "VertexAI")
    assert res["chat"]["a"] == "Paris is the capital."
    assert res["chat"]["meta_a"] == {"id": "resp-1", "finish_reason": {"type": "stop",
                                                                       "matched": None},
                                     "prompt_tokens": 7, "completion_tokens": 5}
    first, second, streamed = requests[0], requests[1], requests[2]
    assert first["path"].endswith("/models/gemini-2.0-flash:generateContent")
    assert first["key"] == "test-key"
    body = first["body"]
    assert body["systemInstruction"]["parts"] == [{"text": "You are a terse assistant."}]
    assert body["contents"] == [{"role": "user",
                                 "parts": [{"text": "What is the capital of France?"}]}]
    assert body["generationConfig"] == {"maxOutputTokens": 12, "stopSequences": ["."],
                                        "temperature": 0.0}
    assert [c["role"] for c in second["body"]["contents"]] == ["user", "model", "user"]
    assert ":streamGenerateContent" in streamed["path"]
