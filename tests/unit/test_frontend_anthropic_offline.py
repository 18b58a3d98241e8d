"""The Anthropic frontend backend without a server: parameter mapping, system turns, prefill
of a partial assistant message, streaming. The SDK client is replaced by a fake that records each
call's keyword arguments (frontend_fakes.py)."""

from __future__ import annotations

import pytest

import radixlm as sgl
from frontend_fakes import anthropic_backend, prefilled, two_turns
from radixlm.lang.backend.anthropic import Anthropic
from radixlm.lang.backend.base import UnsupportedPrimitive
from radixlm.lang.ir import SamplingParams


def test_anthropic_params():
    b = Anthropic("claude-x", api_key="x")
    assert b.request_kwargs(SamplingParams()) == {"max_tokens": 128}
    assert b.request_kwargs(SamplingParams(max_new_tokens=9, stop=".", temperature=0.0, top_p=0.5,
                                           top_k=4)) == {
        "max_tokens": 9, "stop_sequences": ["."],
        "extra_body": {"temperature": 0.0, "top_p": 0.5, "top_k": 4}}
    for p, name in ((SamplingParams(frequency_penalty=0.2), "frequency_penalty"),
                    (SamplingParams(min_p=0.1), "min_p"),
                    (SamplingParams(min_new_tokens=2), "min_tokens"),
                    (SamplingParams(regex="a"), "regex"),
                    (SamplingParams(dtype=int), "dtype=int"),
                    (SamplingParams(return_logprob=True), "return_logprob")):
        with pytest.raises(UnsupportedPrimitive, match=name):
            b.request_kwargs(p)


def test_anthropic_system_turns_and_meta():
    b = anthropic_backend(reply=["o", "k"], stop_reason="stop_sequence", stop_sequence="\n")
    st = two_turns.run(backend=b)
    c1, c2 = b.client.calls
    assert c1["system"] == "Be brief." and c1["model"] == "claude-x"
    assert c1["messages"] == [{"role": "user", "content": "Context outside roles. "},
                              {"role": "user", "content": "Hi"}]
    assert c2["messages"][-2:] == [{"role": "assistant", "content": "ok"},
                                   {"role": "user", "content": "Again: ok"}]
    assert st.get_meta_info("a1") == {"id": "msg1", "stop_reason": "stop_sequence",
                                      "finish_reason": {"type": "stop", "matched": "\n"},
                                      "prompt_tokens": 11, "completion_tokens": 2,
                                      "cached_tokens": 5}


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_prefill(stream):
    b = anthropic_backend(reply=[" ", " Paris", "."], stop_reason="max_tokens")
    st = prefilled.run(backend=b, stream=stream)
    if stream:
        assert list(st.text_iter("a")) == ["Paris", "."]
    assert st["a"] == "Paris."
    assert st.text() == "Capital of France?The capital is Paris."
    kw = b.client.calls[0]
    assert kw["messages"][-1] == {"role": "assistant", "content": "The capital is"}
    assert kw.get("stream", False) is stream
    assert st.get_meta_info("a")["finish_reason"] == {"type": "length"}


def test_anthropic_select_is_unsupported():
    @sgl.function
    def prog(s):
        s += sgl.user("Pick")
        s += sgl.assistant(sgl.select("c", choices=["a", "b"]))

    with pytest.raises(UnsupportedPrimitive, match="select"):
        prog.run(backend=anthropic_backend())
