"""SGLang's server surface over real HTTP (and the openai SDK): the endpoints users script against
(/tokenize, /detokenize, /v1/embeddings, /encode, /get_model_info, /update_weights_from_disk,
/start_profile + /stop_profile, /v1/models), the flags --served-model-name, --chat-template,
--stream-interval, --log-requests, --reasoning-parser (cache report off here), and SGLang's /generate fields and
stream shapes. One server for the module; every test that generates ends with the KV check."""

from __future__ import annotations

import gzip
import json
import math
import os

import openai
import pytest

from server_harness import http, sse_events, start_server, stop_and_check

NAME = "sgl-served-name"
INTERVAL = 4
ARGS = ["--dtype", "float32", "--context-length", "1024", "--max-total-tokens", "8192",
        "--served-model-name", NAME, "--stream-interval", str(INTERVAL), "--log-requests",
        "--reasoning-parser", "qwen3", "--timeout-graceful-shutdown", "5"]
COUNT = "Count: 1, 2, 3,"
TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}|{{ greeting | default('none') }}>>"
            "{{ m['content'] }}\n{% endfor %}<<assistant>>")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    srv = start_server(ARGS + ["--chat-template", str(template)], name="sglang")
    yield srv
    stop_and_check(srv)


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def stream(server, body: dict):
    return http.stream("POST", server.url + "/generate", json=body, timeout=300)


def gen(server, body: dict) -> dict:
    r = server.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_served_model_name_and_model_info(server, oai):
    assert [m.id for m in oai.models.list().data] == [NAME]
    info = server.get("/get_model_info").json()
    assert info["served_model_name"] == NAME and info["is_generation"] is True
    assert info["reasoning_parser"] == "qwen3" and info["context_length"] == 1024
    assert info["model_path"] and info["weight_version"] == "default"
    r = oai.completions.create(model=NAME, prompt=COUNT, max_tokens=2, temperature=0)
    assert r.model == NAME
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="some-other-model", prompt=COUNT, max_tokens=2)
    # --enable-cache-report is off here: no prompt_tokens_details (SGLang's default)
    assert r.usage.prompt_tokens_details is None
    server.check_integrity()


def test_chat_template_flag(server, oai):
    def prompt_tokens(rendered: str) -> int:
        return server.post("/tokenize", {"prompt": rendered, "add_special_tokens": False}).json()[
            "count"]

    msgs = [{"role": "user", "content": "Hi there"}]
    r = oai.chat.completions.create(model=NAME, messages=msgs, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == prompt_tokens("<<user|none>>Hi there\n<<assistant>>")
    r = oai.chat.completions.create(model=NAME, messages=msgs, max_tokens=1, temperature=0,
                                    extra_body={"chat_template_kwargs": {"greeting": "hey"}})
    assert r.usage.prompt_tokens == prompt_tokens("<<user|hey>>Hi there\n<<assistant>>")
    server.check_integrity()


def test_tokenize_detokenize_round_trip(server):
    text = "Radix trees share prefixes."
    tok = server.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 1024
    assert server.post("/detokenize", {"tokens": tok["tokens"]}).json()["text"] == text
    batch = server.post("/tokenize", {"prompt": [text, "hi"]}).json()
    assert batch["count"] == [len(t) for t in batch["tokens"]]
    back = server.post("/detokenize", {"tokens": batch["tokens"]}).json()["text"]
    assert back[1].endswith("hi")
    r = server.post("/detokenize", {"tokens": [10**9]})
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]
    assert server.post("/tokenize", {"text": text}).status_code == 400  # the field is `prompt`


def test_embeddings_openai_sdk_and_encode(server, oai):
    texts = ["The capital of France is Paris.", "Radix trees share prefixes."]
    res = oai.embeddings.create(model=NAME, input=texts)  # the SDK asks for base64 and decodes it
    vecs = [d.embedding for d in res.data]
    assert [d.index for d in res.data] == [0, 1] and res.model == NAME
    assert len(vecs[0]) == len(vecs[1]) > 100
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4 for v in vecs)  # L2-normalized
    assert res.usage.prompt_tokens == res.usage.total_tokens > 0
    floats = oai.embeddings.create(model=NAME, input=texts[0], encoding_format="float")
    native = server.post("/encode", {"text": texts[0]}).json()
    for other in (floats.data[0].embedding, native["embedding"]):
        assert max(abs(a - b) for a, b in zip(vecs[0], other)) < 1e-4
    with pytest.raises(openai.BadRequestError):
        oai.embeddings.create(model=NAME, input=texts[0], dimensions=8)
    assert server.post("/v1/rerank", {"query": "q", "documents": ["d"]}).status_code == 404
    server.check_integrity()


def test_stream_interval_flag_and_per_request(server):
    body = {"text": COUNT, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 13, "ignore_eos": True}}
    with stream(server, body) as r:
        chunks = list(sse_events(r))
    done = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert done[0] == 1 and done[-1] == 13  # the first token at once, then every INTERVAL
    assert all(b - a >= INTERVAL for a, b in zip(done[:-2], done[1:-1])), done
    body["sampling_params"]["stream_interval"] = 100  # the request's own interval wins
    with stream(server, body) as r:
        assert [c["meta_info"]["completion_tokens"] for c in sse_events(r)] == [1, 13]
    server.check_integrity()


def test_log_requests(server):
    gen(server, {"text": "log me please", "rid": "logged-rid",
                 "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    gen(server, {"text": "not me", "rid": "quiet-rid", "no_logs": True,
                 "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    log = server.log()
    assert "Receive: rid=logged-rid" in log and "Finish: rid=logged-rid" in log
    assert "quiet-rid" not in log
    server.check_integrity()


# the meta_info keys SGLang's TokenizerManager always sets on a finished generation
SGLANG_META = {"id", "finish_reason", "prompt_tokens", "weight_version", "total_retractions",
               "completion_tokens", "cached_tokens", "e2e_latency"}
THINK = {"regex": r"<think>[a-z]{3,8}</think>[A-Z][a-z]{2,6}"}


def test_reasoning_parser_separates_reasoning(server, oai):
    msgs = [{"role": "user", "content": "Think, then answer in one word."}]
    r = oai.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=40,
                                    extra_body=THINK)
    m = r.choices[0].message
    assert m.reasoning_content and m.reasoning_content.isalpha() and m.reasoning_content.islower()
    assert m.content and m.content[0].isupper() and "<think>" not in m.content
    stream = oai.chat.completions.create(model=NAME, messages=msgs, temperature=0,
                                         max_tokens=40, extra_body=THINK, stream=True)
    parts = {"reasoning_content": "", "content": ""}
    for chunk in stream:
        if chunk.choices:
            d = chunk.choices[0].delta
            for k in parts:
                parts[k] += getattr(d, k, None) or ""
    assert parts == {"reasoning_content": m.reasoning_content, "content": m.content}
    whole = oai.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=40,
                                        extra_body={**THINK, "separate_reasoning": False})
    assert whole.choices[0].message.content.startswith("<think>" + m.reasoning_content)
    server.check_integrity()


def test_sglang_frontend_fields_and_streamed_logprobs(server):
    # what SGLang's frontend sends: every field, unset ones null or empty, plus stop_regex
    sp = {"max_new_tokens": 24, "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [],
          "stop_regex": r"[6-7]", "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
          "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False, "regex": None,
          "json_schema": None, "ebnf": None, "skip_special_tokens": True,
          "spaces_between_special_tokens": True, "no_stop_trim": False, "logit_bias": None,
          "sampling_seed": None, "custom_params": None, "structural_tag": None,
          "stream_interval": 1}
    body = {"text": COUNT, "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 2,
            "return_text_in_logprobs": True, "token_ids_logprob": [33, 34],
            "logprob_start_len": -1, "lora_path": None, "return_hidden_states": False,
            "rid": "sgl-fields"}
    full = gen(server, body)
    assert full["text"].endswith("6") and "7" not in full["text"]
    m = full["meta_info"]
    assert SGLANG_META <= set(m), SGLANG_META - set(m)
    assert m["finish_reason"] == {"type": "stop", "matched": "[6-7]"}
    n = m["completion_tokens"]
    assert len(m["output_token_logprobs"]) == len(m["output_top_logprobs"]) == n
    assert len(m["output_token_ids_logprobs"]) == n
    assert all(isinstance(e[2], str) for e in m["output_token_logprobs"])  # text in logprobs
    assert [e[1] for e in m["output_token_ids_logprobs"][0]] == [33, 34]
    # streamed (SGLang's default shape): every chunk is cumulative, logprob lists included
    with stream(server, {**body, "stream": True, "rid": "sgl-fields-s"}) as r:
        chunks = list(sse_events(r))
    assert len(chunks) > 1 and chunks[-1]["text"] == full["text"]
    for c in chunks:
        cm = c["meta_info"]
        assert len(cm["output_token_logprobs"]) == cm["completion_tokens"] == len(c["output_ids"])
        assert len(cm["output_top_logprobs"]) == len(cm["output_token_ids_logprobs"]) == \
            cm["completion_tokens"]
    got = chunks[-1]["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in got] == [e[1] for e in m["output_token_logprobs"]]
    assert all(abs(a[0] - b[0]) < 1e-4 for a, b in zip(got, m["output_token_logprobs"]))
    # fields SGLang has and this server does not: a 400 that names them
    for extra in ({"lora_path": "adapter"}, {"return_hidden_states": True},
                  {"session_params": {"id": "s"}}):
        r = server.post("/generate", {"text": "x", **extra})
        assert r.status_code == 400 and next(iter(extra)) in r.json()["error"]["message"]
    r = server.post("/generate", {"text": "x", "sampling_params": {"beam_width": 4}})
    assert r.status_code == 400 and "beam_width" in r.text
    # logit_bias through HTTP: a huge bias forces the token
    tok = server.post("/tokenize", {"prompt": " banana", "add_special_tokens": False}).json()
    out = gen(server, {"text": COUNT, "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "logit_bias": {str(tok["tokens"][0]): 100}}})
    assert out["output_ids"] == [tok["tokens"][0]] * 3
    server.check_integrity()


def test_profile_trace(server, tmp_path):
    assert server.post("/stop_profile").status_code == 400  # nothing running
    r = server.post("/start_profile", {"output_dir": str(tmp_path), "profile_id": "t1",
                                       "activities": ["CPU"]})
    assert r.status_code == 200, r.text
    assert server.post("/start_profile", {"output_dir": str(tmp_path)}).status_code == 400
    gen(server, {"text": COUNT, "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    r = server.post("/stop_profile")
    assert r.status_code == 200, r.text
    path = os.path.join(tmp_path, "t1-TP-0.trace.json.gz")
    with gzip.open(path, "rt") as f:
        assert json.load(f)["traceEvents"]
    bad = server.post("/start_profile", {"profile_by_stage": True})
    assert bad.status_code == 400 and "profile_by_stage" in bad.text
    server.check_integrity()


def test_update_weights_from_disk(server):
    before = gen(server, {"text": COUNT, "sampling_params": {"max_new_tokens": 6,
                                                              "temperature": 0}})
    path = server.get("/get_model_info").json()["model_path"]
    r = server.post("/update_weights_from_disk", {"model_path": path, "weight_version": "v2"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    after = gen(server, {"text": COUNT, "sampling_params": {"max_new_tokens": 6,
                                                             "temperature": 0}})
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_version"] == "v2"
    assert server.get("/get_model_info").json()["weight_version"] == "v2"
    assert after["meta_info"]["cached_tokens"] == 0  # the cache was flushed: its KV was the old weights
    r = server.post("/update_weights_from_disk", {"model_path": "/nonexistent/model"})
    assert r.status_code == 400 and r.json()["success"] is False
    r = server.post("/update_weights_from_disk", {"model_path": path, "manifest": {"a": 1}})
    assert r.status_code == 400 and "manifest" in r.json()["message"]
    server.assert_serving()
    server.check_integrity()


def test_sampling_seed_and_streamed_batch(server):
    sp = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 1234}
    a, b = (gen(server, {"text": COUNT, "sampling_params": sp})["output_ids"] for _ in range(2))
    assert a == b  # the same seed: the same sample
    others = {tuple(gen(server, {"text": COUNT, "sampling_params": {**sp, "sampling_seed": s}})
                    ["output_ids"]) for s in range(3)}
    assert len(others | {tuple(a)}) > 1
    # a streamed batch: chunks of both prompts interleaved, each tagged with its index
    body = {"text": [COUNT, "Hello"], "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}}
    with stream(server, body) as r:
        chunks = list(sse_events(r))
    last = {c["index"]: c for c in chunks}
    assert sorted(last) == [0, 1]
    whole = gen(server, {**body, "stream": False})
    assert [last[i]["text"] for i in (0, 1)] == [w["text"] for w in whole]
    server.check_integrity()
