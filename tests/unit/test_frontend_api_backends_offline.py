"""The OpenAI frontend backend without a server: parameter mapping, how programs become
messages, select's scoring arithmetic, streaming. The SDK client is replaced by a fake that
records each call's keyword arguments and answers with scripted objects (frontend_fakes.py); the
Anthropic backend is in test_frontend_anthropic_offline.py."""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest

import radixlm as sgl
from frontend_fakes import openai_backend, prefilled, two_turns, usage
from radixlm.lang.backend.anthropic import Anthropic
from radixlm.lang.backend.base import UnsupportedPrimitive
from radixlm.lang.backend.openai import OpenAI, is_completion_model_name
from radixlm.lang.ir import REGEX_INT, SamplingParams


# --- the model kind and the parameters -------------------------------------------------------

@pytest.mark.parametrize("name,completion", [
    ("gpt-3.5-turbo-instruct", True), ("davinci-002", True), ("babbage-002", True),
    ("text-curie-001", True), ("ada", True), ("gpt-4o-mini", False), ("default", False),
    ("SmolLM2-135M-Instruct", False), ("Llama-3.1-8B-Instruct", False), ("gpt-4o", False),
    ("ollama/llama3:8b", False), ("canada-model", False)])
def test_completion_model_guess(name, completion):
    assert is_completion_model_name(name) is completion
    assert OpenAI(name, api_key="x", server_extras=False).is_chat_model is (not completion)


def test_templates():
    assert openai_backend(chat=True).get_chat_template().style == "messages"
    assert openai_backend(chat=False).get_chat_template().name == "default"
    b = OpenAI("SmolLM2-135M-Instruct", api_key="x", is_chat_model=False, server_extras=False)
    assert b.get_chat_template().name == "smollm2"
    b = OpenAI("x", api_key="x", is_chat_model=False, server_extras=False, chat_template="chatml")
    assert b.get_chat_template().name == "chatml"
    with pytest.raises(ValueError, match="completion models"):
        OpenAI("gpt-4o", api_key="x", server_extras=False, chat_template="chatml")
    assert Anthropic("claude", api_key="x").get_chat_template().style == "messages"


def test_defaults_send_only_max_tokens():
    b = openai_backend()
    assert b.request_kwargs(SamplingParams()) == {"max_tokens": 128}


def test_standard_params_and_extras():
    b = openai_backend(extras=True)
    p = SamplingParams(max_new_tokens=7, stop="\n", temperature=0.0, top_p=0.9,
                       frequency_penalty=0.5, presence_penalty=-0.5, top_k=20, min_p=0.1,
                       min_new_tokens=2, ignore_eos=True, stop_token_ids=[5], regex="[ab]+")
    assert b.request_kwargs(p) == {
        "max_tokens": 7, "stop": ["\n"], "temperature": 0.0, "top_p": 0.9,
        "frequency_penalty": 0.5, "presence_penalty": -0.5,
        "extra_body": {"top_k": 20, "min_p": 0.1, "min_tokens": 2, "ignore_eos": True,
                       "stop_token_ids": [5], "regex": "[ab]+"}}
    # extras at their defaults are not sent
    p = SamplingParams(top_k=-1, min_p=0.0, min_new_tokens=0, ignore_eos=False, stop=["a", "b"])
    assert b.request_kwargs(p) == {"max_tokens": 128, "stop": ["a", "b"]}


def test_dtype_becomes_regex():
    b = openai_backend(extras=True)
    assert b.request_kwargs(SamplingParams(dtype=int))["extra_body"] == {"regex": REGEX_INT}


def test_extras_without_a_radixlm_server_are_unsupported():
    b = openai_backend(extras=False)
    with pytest.raises(UnsupportedPrimitive, match="top_k"):
        b.request_kwargs(SamplingParams(top_k=5))
    with pytest.raises(UnsupportedPrimitive, match="dtype=int"):
        b.request_kwargs(SamplingParams(dtype=int))
    with pytest.raises(UnsupportedPrimitive, match="min_tokens"):
        b.request_kwargs(SamplingParams(min_new_tokens=3))
    # json_schema on a chat model is OpenAI's response_format
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    kw = b.request_kwargs(SamplingParams(json_schema=json.dumps(schema)))
    assert kw["response_format"] == {"type": "json_schema",
                                     "json_schema": {"name": "output", "schema": schema}}
    assert "extra_body" not in kw
    with pytest.raises(UnsupportedPrimitive, match="json_schema"):
        openai_backend(chat=False, extras=False).request_kwargs(
            SamplingParams(json_schema=json.dumps(schema)))


def test_logprob_requests():
    p = SamplingParams(return_logprob=True, top_logprobs_num=3)
    assert openai_backend(chat=True).request_kwargs(p)["logprobs"] is True
    assert openai_backend(chat=True).request_kwargs(p)["top_logprobs"] == 3
    assert openai_backend(chat=False).request_kwargs(p)["logprobs"] == 3


def test_flush_cache_and_server_info_are_unsupported():
    for b in (openai_backend(), Anthropic("claude", api_key="x")):
        with pytest.raises(UnsupportedPrimitive, match="flush_cache"):
            sgl.flush_cache(backend=b)
        with pytest.raises(UnsupportedPrimitive, match="get_server_info"):
            sgl.get_server_info(backend=b)


# --- programs as messages (OpenAI chat) ------------------------------------------------------

def test_chat_messages_from_roles():
    b = openai_backend(reply=lambda kind, kw: f"r{len(kw['messages'])}")
    st = two_turns.run(backend=b)
    assert st["a1"] == "r3" and st["a2"] == "r5"
    (k1, c1), (k2, c2) = b.client.calls
    assert k1 == k2 == "chat" and c1["model"] == "m"
    assert c1["messages"] == [{"role": "user", "content": "Context outside roles. "},
                              {"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Hi"}]
    assert c2["messages"][3:] == [{"role": "assistant", "content": "r3"},
                                  {"role": "user", "content": "Again: r3"}]
    assert c1["max_tokens"] == 5 and c2["max_tokens"] == 6
    assert st.get_meta_info("a1") == {"id": "r1", "model": "m",
                                      "finish_reason": {"type": "stop", "matched": "\n"},
                                      "prompt_tokens": 10, "completion_tokens": 3,
                                      "cached_tokens": 4}


def test_program_without_roles_is_one_user_message():
    @sgl.function
    def plain(s):
        s += "Q: 1+1?\nA:" + sgl.gen("a", max_tokens=3)

    b = openai_backend()
    assert plain.run(backend=b)["a"] == "ok"
    assert b.client.calls[0][1]["messages"] == [{"role": "user", "content": "Q: 1+1?\nA:"}]


def test_gen_outside_an_assistant_turn_is_an_error():
    @sgl.function
    def bad(s):
        s += sgl.user("Hi")
        s += sgl.gen("a", max_tokens=3)

    @sgl.function
    def in_user(s):
        with s.user():
            s += sgl.gen("a", max_tokens=3)

    for prog, match in ((bad, "inside an assistant turn"), (in_user, "'user' turn")):
        for b in (openai_backend(), Anthropic("claude", api_key="x")):
            with pytest.raises(ValueError, match=match):
                prog.run(backend=b)


def test_openai_chat_refuses_a_partial_assistant_message():
    with pytest.raises(UnsupportedPrimitive, match="partial assistant message"):
        prefilled.run(backend=openai_backend())


def test_completion_model_sends_the_text():
    b = openai_backend(chat=False)
    st = two_turns.run(backend=b)
    kind, kw = b.client.calls[1]
    assert kind == "completion" and "messages" not in kw
    assert kw["prompt"].startswith("Context outside roles. SYSTEM:Be brief.\nUSER:Hi\n")
    assert kw["prompt"].endswith("USER:Again: ok\nASSISTANT:")
    assert st.messages()[-1] == {"role": "assistant", "content": "ok"}


def test_streaming_yields_deltas_and_meta_last():
    b = openai_backend()
    st = two_turns.run(backend=b, stream=True)
    assert list(st.text_iter("a1")) == ["o", "k"]
    st.sync()
    assert st.get_meta_info("a2")["finish_reason"] == {"type": "stop", "matched": "\n"}
    assert st.get_meta_info("a2")["cached_tokens"] == 4
    kw = b.client.calls[0][1]
    assert kw["stream"] is True and kw["stream_options"] == {"include_usage": True}


def test_server_errors_surface():
    def reply(kind, kw):
        raise RuntimeError("Error code: 400 - regex: bad pattern")

    @sgl.function
    def prog(s):
        s += sgl.gen("a", regex="[0-9]+")

    with pytest.raises(RuntimeError, match="bad pattern"):
        prog.run(backend=openai_backend(chat=False, reply=reply))


# --- select -------------------------------------------------------------------------------

def scored(prompts, table):
    """An echo+logprobs completion response: `table` maps each prompt to (tokens, logprobs)."""
    choices = []
    for i, p in enumerate(prompts):
        toks, lps = table[p]
        assert "".join(toks) == p
        offs = [sum(len(t) for t in toks[:k]) for k in range(len(toks))]
        choices.append(NS(index=i, text=p, finish_reason="length", model_extra={},
                          logprobs=NS(tokens=toks, token_logprobs=lps, text_offset=offs)))
    return NS(id="s", model="m", choices=list(reversed(choices)), usage=usage())


TABLE = {
    "The sky is": (["The", " sky", " is"], [None, -1.0, -1.0]),
    # " blue" is one token after the prefix; " grey" two; "!x" merges with " is" (token healing)
    "The sky is blue": (["The", " sky", " is", " blue"], [None, -1.0, -1.0, -0.5]),
    "The sky is grey": (["The", " sky", " is", " gr", "ey"], [None, -1.0, -1.0, -3.0, -0.1]),
    "The sky is!x": (["The", " sky", " is!", "x"], [None, -1.0, -6.0, -6.0]),
    "\n": (["\n"], [None]),
    "\n blue": (["\n", " blue"], [None, -0.7]),
    "\n gr" "ey": (["\n", " gr", "ey"], [None, -4.0, -0.2]),
    "\n is!x": (["\n", " is!", "x"], [None, -6.5, -6.5]),
}


def test_select_scores_choices_with_echo_logprobs():
    b = openai_backend(chat=False, reply=lambda kind, kw: scored(kw["prompt"], TABLE))

    @sgl.function
    def prog(s, method):
        s += "The sky is" + sgl.select("c", choices=[" blue", " grey", "!x"], choices_method=method)

    st = prog.run(method=None, backend=b)
    assert st["c"] == " blue" and st.text() == "The sky is blue"
    kw = b.client.calls[0][1]
    assert kw["prompt"] == ["The sky is", "The sky is blue", "The sky is grey", "The sky is!x"]
    assert kw["echo"] is True and kw["logprobs"] == 0 and kw["max_tokens"] == 0
    meta = st.get_meta_info("c")
    assert meta["input_token_logprobs"] == [[(-0.5, None, " blue")],
                                            [(-3.0, None, " gr"), (-0.1, None, "ey")],
                                            [(-6.0, None, " is!"), (-6.0, None, "x")]]
    assert meta["normalized_prompt_logprobs"] == pytest.approx([-0.5, -1.55, -6.0])

    # greedy: the first tokens decide
    assert prog.run(method=sgl.greedy_token_selection, backend=b)["c"] == " blue"
    # unconditional: grey gains most over its no-context likelihood (mean gains 0.2, 0.55, 0.5)
    st = prog.run(method=sgl.unconditional_likelihood_normalized, backend=b)
    assert b.client.calls[-1][1]["prompt"] == ["\n", "\n blue", "\n grey", "\n is!x"]
    assert [[t[0] for t in row] for row in st.get_meta_info("c")[
        "unconditional_token_logprobs"]] == [[-0.7], [-4.0, -0.2], [-6.5, -6.5]]
    assert st["c"] == " grey"


def test_select_with_an_empty_prefix():
    table = {"yes": (["yes"], [None]), "no way": (["no", " way"], [None, -1.0])}
    b = openai_backend(chat=False, reply=lambda kind, kw: scored(kw["prompt"], table))

    @sgl.function
    def prog(s):
        s += sgl.select("c", choices=["yes", "no way"])

    assert prog.run(backend=b)["c"] == "yes"  # no scored token: mean 0 beats -1
    assert b.client.calls[0][1]["prompt"] == ["yes", "no way"]


def test_chat_select_is_constrained_decoding_on_radixlm_servers():
    b = openai_backend(chat=True, extras=True, reply=lambda kind, kw: "B.c")

    @sgl.function
    def prog(s, method=None):
        s += sgl.user("Pick")
        s += sgl.assistant(sgl.select("c", choices=["A+", "B.c", "C"], choices_method=method))

    st = prog.run(backend=b)
    assert st["c"] == "B.c" and st.get_meta_info("c")["method"] == "constrained_decoding"
    kw = b.client.calls[0][1]
    assert kw["extra_body"] == {"regex": r"(A\+|B\.c|C)"}
    assert kw["temperature"] == 0.0 and kw["max_tokens"] == 5
    with pytest.raises(UnsupportedPrimitive, match="choices_method"):
        prog.run(method=sgl.unconditional_likelihood_normalized, backend=b)
    with pytest.raises(UnsupportedPrimitive, match="select"):
        prog.run(backend=openai_backend(chat=True, extras=False))
