"""The LiteLLM backend's requests and replies, with a stand-in `litellm` module that records
`completion()` calls (the real package, against a real server, runs in tests/sglang_compat)."""

from __future__ import annotations

import sys
from types import ModuleType
from types import SimpleNamespace as NS

import pytest

import radixlm as sgl
from radixlm.lang.backend.base import UnsupportedPrimitive


class FakeLiteLLM(ModuleType):
    def __init__(self, reply="Paris"):
        super().__init__("litellm")
        self.calls: list[dict] = []
        self.reply = reply

    def completion(self, **kw):
        self.calls.append(kw)
        usage = NS(prompt_tokens=11, completion_tokens=2)
        if not kw.get("stream"):
            return NS(id="c1", model=kw["model"], usage=usage, choices=[
                NS(finish_reason="stop", message=NS(content=self.reply))])
        pieces = [self.reply[:2], self.reply[2:]]
        chunks = [NS(id="c1", usage=None, choices=[NS(finish_reason=None, delta=NS(content=p))])
                  for p in pieces]
        chunks.append(NS(id="c1", usage=None, choices=[NS(finish_reason="length",
                                                          delta=NS(content=None))]))
        chunks.append(NS(id="c1", usage=usage, choices=[]))
        return iter(chunks)


@pytest.fixture
def fake(monkeypatch):
    mod = FakeLiteLLM()
    monkeypatch.setitem(sys.modules, "litellm", mod)
    return mod


@sgl.function
def chat(s):
    s += sgl.system("Be brief.")
    s += sgl.user("Capital of France?")
    s += sgl.assistant(sgl.gen("a", max_tokens=5, stop=".", temperature=0))


def test_messages_params_and_meta(fake):
    b = sgl.LiteLLM("openai/m", api_key="k", base_url="http://x/v1",
                    default_headers={"X-A": "1"})
    st = chat.run(backend=b)
    assert st["a"] == "Paris"
    call = fake.calls[0]
    assert call["model"] == "openai/m" and call["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    assert call["max_tokens"] == 5 and call["stop"] == ["."] and call["temperature"] == 0
    assert "top_p" not in call and "frequency_penalty" not in call  # defaults are not sent
    assert call["api_key"] == "k" and call["base_url"] == "http://x/v1"
    assert call["extra_headers"] == {"X-A": "1"} and "organization" not in call
    meta = st.get_meta_info("a")
    assert meta["finish_reason"] == {"type": "stop", "matched": None}
    assert meta["prompt_tokens"] == 11 and meta["completion_tokens"] == 2


def test_program_without_roles_is_one_user_message(fake):
    @sgl.function
    def plain(s):
        s += "Q: 1+1?\nA:" + sgl.gen("a", max_tokens=3)

    plain.run(backend=sgl.LiteLLM("m"))
    assert fake.calls[0]["messages"] == [{"role": "user", "content": "Q: 1+1?\nA:"}]


def test_stream(fake):
    st = chat.run(backend=sgl.LiteLLM("m"), stream=True)
    assert "".join(st.text_iter("a")) == "Paris"
    st.sync()
    assert fake.calls[0]["stream"] is True
    meta = st.get_meta_info("a")
    assert meta["finish_reason"] == {"type": "length"} and meta["completion_tokens"] == 2


@pytest.mark.parametrize("kw,what", [({"regex": "[a-z]+"}, "regex"), ({"top_k": 5}, "top_k"),
                                     ({"min_tokens": 2}, "min_tokens"),
                                     ({"return_logprob": True}, "return_logprob")])
def test_unsupported_fields_are_named(fake, kw, what):
    @sgl.function
    def prog(s):
        s += sgl.user("Hi") + sgl.assistant(sgl.gen("a", **kw))

    with pytest.raises(UnsupportedPrimitive, match=what):
        prog.run(backend=sgl.LiteLLM("m"))
    assert not fake.calls


def test_select_and_prefill_are_unsupported(fake):
    @sgl.function
    def pick(s):
        s += sgl.user("Yes or no?") + sgl.assistant(sgl.select("a", choices=["yes", "no"]))

    @sgl.function
    def prefill(s):
        s += sgl.user("Hi")
        with s.assistant():
            s += "Well, " + sgl.gen("a")

    with pytest.raises(UnsupportedPrimitive, match="select"):
        pick.run(backend=sgl.LiteLLM("m"))
    with pytest.raises(UnsupportedPrimitive, match="partial assistant message"):
        prefill.run(backend=sgl.LiteLLM("m"))


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "litellm", None)  # import litellm -> ImportError
    with pytest.raises(ImportError, match="pip install litellm"):
        sgl.LiteLLM("m")
