"""SGLang's frontend surface on a fake backend: fork-group item assignment, streaming with meta
data, global_config, stop_regex, separate_reasoning, video, copy(), run_batch forms, SGLang's
interpreter conventions (template stop strings, the default system turn, text variables)."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest

import radixlm as sgl
from radixlm.lang.backend.base import BaseBackend
from radixlm.lang.backend.runtime_endpoint import RuntimeEndpoint
from radixlm.lang.chat_template import get_chat_template
from radixlm.lang.choices import ChoicesDecision
from radixlm.lang.ir import REGEX_INT, SamplingParams


class Fake(BaseBackend):
    """gen returns `reply(prompt, params)`; streams it two characters per chunk, each chunk with
    its own output_token_logprobs (one entry per character) and a text-less chunk in between."""

    def __init__(self, reply=None, template="default"):
        self.chat_template = get_chat_template(template)
        self.reply = reply or (lambda text, params: "ok")
        self.params: list[SamplingParams] = []
        self.cached: list[str] = []
        self.lock = threading.Lock()

    def generate(self, s, params):
        with self.lock:
            self.params.append(params)
        out = self.reply(s.text_, params)
        return out, {"completion_tokens": len(out),
                     "output_token_logprobs": [(-0.5, i, c) for i, c in enumerate(out)]}

    def generate_stream(self, s, params):
        out = self.reply(s.text_, params)
        sent = 0
        for i in range(0, len(out), 2):
            piece = out[i:i + 2]
            lps = [(-0.5, j, c) for j, c in enumerate(piece, start=i)]
            sent += len(piece)
            yield piece, {"completion_tokens": sent, "output_token_logprobs": lps}
            if i == 0:  # a chunk that brings a logprob but no text (e.g. held-back text)
                yield "", {"completion_tokens": sent, "output_token_logprobs": [(-9.0, 99, "")]}

    def select(self, s, choices, temperature, choices_method):
        return ChoicesDecision(choices[0], {"how": "first"})

    def cache_prefix(self, prefix):
        self.cached.append(prefix)


@pytest.fixture(autouse=True)
def clean_config():
    saved = dict(vars(sgl.global_config))
    yield
    vars(sgl.global_config).update(saved)


def test_fork_group_item_assignment():
    @sgl.function
    def prog(s):
        s += "Q:"
        forks = s.fork(2)
        forks[0] += " first" + sgl.gen("a")
        forks[1] += " second" + sgl.gen("a")
        forks += (" x", " y")  # tuples too
        forks.join()
        with pytest.raises(TypeError, match="cannot be replaced"):
            forks[0] = forks[1]

    st = prog.run(backend=Fake(lambda t, p: t[-6:]))
    assert st["a"] == ["Q: first"[-6:], "second"]
    assert "a" in st and "b" not in st


def test_stream_text_async_iter_with_meta_data():
    @sgl.function
    def prog(s):
        s += "Say:" + sgl.gen("a", max_tokens=8)

    async def collect(st):
        return [c async for c in st.text_async_iter("a", return_meta_data=True)]

    st = prog.run(backend=Fake(lambda t, p: "hello!"), stream=True)
    chunks = asyncio.run(collect(st))
    assert [c for c, _ in chunks] == ["he", "ll", "o!"]
    # the text-less chunk's logprob is carried by the next chunk with text (SGLang's merge)
    assert [lp[1] for lp in chunks[1][1]["output_token_logprobs"]] == [99, 2, 3]
    assert [lp[1] for lp in chunks[2][1]["output_token_logprobs"]] == [4, 5]
    st.sync()
    # the variable's meta info has every chunk's logprobs, in order
    ids = [lp[1] for lp in st.get_meta_info("a")["output_token_logprobs"]]
    assert ids == [0, 1, 99, 2, 3, 4, 5]
    assert st["a"] == "hello!"


class CumulativeFake(Fake):
    """Streams as a server does by default (SGLang's shape): every chunk's logprob list holds all
    tokens so far; the second chunk brings a token but no text (held back)."""

    def generate_stream(self, s, params):
        lps = [(-0.5, i, c) for i, c in enumerate("hello!")]
        yield "he", {"completion_tokens": 2, "output_token_logprobs": lps[:2]}
        yield "", {"completion_tokens": 3, "output_token_logprobs": lps[:3]}
        yield "llo!", {"completion_tokens": 6, "output_token_logprobs": lps[:6]}


def test_stream_meta_data_with_cumulative_lists():
    @sgl.function
    def prog(s):
        s += "Say:" + sgl.gen("a", max_tokens=8)

    async def collect(st):
        return [c async for c in st.text_async_iter("a", return_meta_data=True)]

    st = prog.run(backend=CumulativeFake(), stream=True)
    chunks = asyncio.run(collect(st))
    assert [c for c, _ in chunks] == ["he", "llo!"]
    # cumulative lists are taken as they are: nothing is prepended twice
    assert [lp[1] for lp in chunks[1][1]["output_token_logprobs"]] == [0, 1, 2, 3, 4, 5]
    st.sync()
    assert [lp[1] for lp in st.get_meta_info("a")["output_token_logprobs"]] == [0, 1, 2, 3, 4, 5]

    st = prog.run(backend=Fake(lambda t, p: "hello!"), stream=True)
    assert "".join(st.text_iter()) == "Say:hello!"
    st = prog.run(backend=Fake(lambda t, p: "hello!"), stream=True)
    assert list(st.text_iter("a")) == ["he", "ll", "o!"]


def test_stream_body_runs_on_its_own_thread_and_errors_surface():
    @sgl.function
    def prog(s):
        s += "A" + sgl.gen("a")
        s += "B" + s["a"]  # reads a generated value: blocks the body, not run()
        raise KeyError("in the body")

    st = prog.run(backend=Fake(), stream=True)
    with pytest.raises(KeyError, match="in the body"):
        list(st.text_iter())


def test_global_config():
    b = Fake()
    sgl.set_default_backend(b)
    assert sgl.global_config.default_backend is b

    @sgl.function
    def few(s, q):
        s += "A long constant instruction that every run shares. Q: " + q + sgl.gen("a")

    few.run_batch([{"q": "1"}, {"q": "2"}])
    assert b.cached == ["A long constant instruction that every run shares. Q: "]
    sgl.global_config.enable_precache_with_tracing = False
    few.run_batch([{"q": "1"}, {"q": "2"}])
    assert len(b.cached) == 1
    sgl.set_default_backend(None)
    assert sgl.flush_cache() is False and sgl.get_server_info() is None


def test_verbosity_prints_the_text(capsys):
    sgl.global_config.verbosity = 2
    sgl.function(lambda s: s.__iadd__("hi there")).run(backend=Fake())
    assert "hi there" in capsys.readouterr().out


def test_runtime_endpoint_body_follows_global_config():
    ep = RuntimeEndpoint.__new__(RuntimeEndpoint)
    assert ep.endpoint is ep
    s = sgl.function(lambda s: None).run(backend=Fake()).stream_executor
    params = SamplingParams(stop_regex=r"\d+", max_new_tokens=4)
    sp = ep._generate_body(s, params, stream=False)["sampling_params"]
    assert sp["stop_regex"] == [r"\d+"] and sp["skip_special_tokens"] is True
    sgl.global_config.skip_special_tokens_in_output = False
    assert ep._generate_body(s, params, stream=False)["sampling_params"][
        "skip_special_tokens"] is False


def test_stop_regex_and_dtype_params():
    with pytest.raises(re.error):
        sgl.gen("a", stop_regex="(")
    b = Fake(lambda t, p: "7")

    @sgl.function
    def prog(s):
        s += "N: " + sgl.gen("n", stop_regex=["x+"]) + " I: " + sgl.gen_int("i")

    st = prog.run(backend=b)
    assert st["i"] == "7"  # the text, as in SGLang
    first, second = b.params
    assert first.resolved()["stop_regex"] == ["x+"]
    assert second.resolved()["regex"] == REGEX_INT
    assert second.resolved()["stop"] == [" ", "\n"]  # int/float stop at a space or newline


def test_chat_template_stops_default_system_turn_and_messages():
    b = Fake(lambda t, p: " Paris", template="smollm2")

    @sgl.function
    def chat(s):
        s += sgl.user("Capital of France?")
        s += sgl.assistant(sgl.gen("a"))

    st = chat.run(backend=b)
    assert b.params[0].stop == ["<|im_end|>"]
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
    assert msgs[0]["content"].startswith("You are a helpful AI assistant named SmolLM")
    assert msgs[2]["content"] == "Paris"  # leading whitespace stripped, as in SGLang
    assert st.text().startswith("<|im_start|>system\nYou are a helpful AI")


@pytest.mark.parametrize("model_type,out,reasoning,answer", [
    ("deepseek-r1", "Let me think.</think>Paris", "Let me think.", "Paris"),
    ("deepseek-r1", "<think>hmm</think> Rome", "hmm", " Rome"),
    ("deepseek-r1", "still thinking", "still thinking", ""),
    ("qwen3", "<think>a</think>b", "a", "b"),
    ("qwen3", "no reasoning here", "", "no reasoning here"),
])
def test_separate_reasoning(model_type, out, reasoning, answer):
    @sgl.function
    def prog(s):
        s += sgl.user("Q?")
        s += sgl.assistant(sgl.separate_reasoning(sgl.gen("a"), model_type=model_type))

    st = prog.run(backend=Fake(lambda t, p: out))
    assert st["a"] == answer and st["a_reasoning_content"] == reasoning
    assert st.text().endswith("ASSISTANT:" + answer + "\n")


def test_separate_reasoning_errors():
    with pytest.raises(ValueError, match="name"):
        sgl.separate_reasoning(sgl.gen(), model_type="qwen3")
    with pytest.raises(ValueError, match="unsupported model_type 'nope'"):
        sgl.separate_reasoning(sgl.gen("a"), "nope")


def test_video_is_a_clear_error():
    prog = sgl.function(lambda s: s.__iadd__("Describe: " + sgl.video("clip.mp4", 8)))
    with pytest.raises(NotImplementedError, match="video.*vision"):
        prog.run(backend=Fake())
    st = prog.run(backend=Fake(), stream=True)
    with pytest.raises(NotImplementedError, match="video"):
        st.sync()


def test_copy_context_manager_and_run_batch_tuples():
    @sgl.function
    def prog(s, a, b="B"):
        s += a + b
        with s.copy() as c:
            c += sgl.gen("g")
        s += "|"

    st = prog.run("A", backend=Fake(lambda t, p: t))
    assert st["g"] == ["AB"] and st.text() == "AB|"
    states = prog.run_batch([("x",), ("y", "z")], backend=Fake(lambda t, p: t))
    assert [s.text() for s in states] == ["xB|", "yz|"]
    with pytest.raises(TypeError, match="does not match"):
        prog.run_batch([(1, 2, 3)], backend=Fake())


def test_append_none_and_state_after_run():
    @sgl.function
    def prog(s):
        s += None

    with pytest.raises(ValueError, match="None"):
        prog.run(backend=Fake())
    st = sgl.function(lambda s: s.__iadd__("a")).run(backend=Fake())
    st += "b" + sgl.gen("x")  # after run() ended: still runs, in order
    assert st.text() == "abok"
