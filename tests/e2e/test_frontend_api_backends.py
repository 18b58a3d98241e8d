"""Frontend programs on the OpenAI backend (chat and completion models) pointed at our own `/v1`,
and the chat programs on the Anthropic backend pointed at our own `/v1/messages`, against the
session's shared radixlm server (SmolLM2-135M, fp32). A 135M model's answers are not asserted;
structure, variable flow, constraints, stop conditions and finish reasons are."""

from __future__ import annotations

import re

import openai
import pytest

import radixlm as sgl
from radixlm.lang.backend.anthropic import Anthropic
from radixlm.lang.backend.base import UnsupportedPrimitive
from radixlm.lang.backend.openai import OpenAI

pytestmark = pytest.mark.slow

FINISH_TYPES = {"stop", "length"}


@pytest.fixture(scope="module")
def runtime(main_server):
    """The session's shared server (tests/e2e/conftest.py: SmolLM2 fp32, --enable-cache-report,
    which OpenAI usage needs to report cached prompt tokens) as the native backend."""
    return sgl.RuntimeEndpoint(main_server.url)


@pytest.fixture(scope="module")
def served(runtime):
    return runtime.model_info["served_model_name"]


@pytest.fixture(scope="module")
def comp(runtime, served):
    b = OpenAI(served, base_url=runtime.base_url + "/v1", api_key="x", is_chat_model=False)
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def chat(runtime):
    b = OpenAI("default", base_url=runtime.base_url + "/v1", api_key="x")
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def anth(runtime):
    b = Anthropic("default", base_url=runtime.base_url, api_key="x")
    yield b
    b.shutdown()


@pytest.fixture
def backend(request):
    return request.getfixturevalue(request.param)


ALL = ["comp", "chat", "anth"]
OPENAI = ["comp", "chat"]


def finished(meta: dict) -> None:
    assert meta["finish_reason"]["type"] in FINISH_TYPES
    assert meta["completion_tokens"] >= 1 and meta["prompt_tokens"] >= 1


def test_backends_know_the_server(comp, chat, anth):
    assert comp.server_extras and chat.server_extras
    assert not comp.is_chat_model and chat.is_chat_model
    assert comp.get_chat_template().name == "smollm2"  # from the server's model path
    assert chat.get_chat_template().style == anth.get_chat_template().style == "messages"


# --- few-shot QA ---------------------------------------------------------------------------------

@sgl.function
def few_shot_qa(s, question):
    s += "Answer each question with one word.\n"
    s += "Q: What is the capital of France?\nA: Paris\n"
    s += "Q: What color is the sky?\nA: Blue\n"
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=8, stop="\n", temperature=0)
    s += "\nQ: Say again: " + s["answer"].strip() + "\n"


@pytest.mark.parametrize("backend", OPENAI, indirect=True)
def test_few_shot_qa(backend):
    st = few_shot_qa.run(question="What is the capital of Italy?", backend=backend)
    answer = st["answer"]
    assert answer.strip() and "\n" not in answer
    assert st.text().endswith("\nA:" + answer + "\nQ: Say again: " + answer.strip() + "\n")
    finished(st.get_meta_info("answer"))


# --- multi-turn chat, both role forms ------------------------------------------------------------

@sgl.function
def multi_turn(s, question):
    s += sgl.system("You are a helpful assistant. Answer briefly.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("a1", max_tokens=8, temperature=0))
    with s.user():
        s += "You said: " + s["a1"] + " Say it in other words."
    with s.assistant():
        s += sgl.gen("a2", max_tokens=8, temperature=0)


@pytest.mark.parametrize("backend", ALL, indirect=True)
def test_multi_turn_chat(backend):
    st = multi_turn.run(question="What is the capital of France?", backend=backend)
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[1]["content"] == "What is the capital of France?"
    assert msgs[2]["content"] == st["a1"] and st["a1"].strip()
    assert msgs[3]["content"] == "You said: " + st["a1"] + " Say it in other words."
    assert msgs[4]["content"] == st["a2"] and st["a2"].strip()
    for name in ("a1", "a2"):
        finished(st.get_meta_info(name))
    if backend.get_chat_template().style == "plain":  # the completion model saw ChatML markup
        assert st.text().count("<|im_start|>assistant\n") == 2


# --- streaming ----------------------------------------------------------------------------------

@sgl.function
def streamed(s):
    s += sgl.user("Name three colors.")
    s += sgl.assistant(sgl.gen("colors", max_tokens=10, temperature=0))


@pytest.mark.parametrize("backend", ALL, indirect=True)
def test_streaming(backend):
    st = streamed.run(backend=backend, stream=True)
    pieces = list(st.text_iter("colors"))
    assert len(pieces) >= 2 and "".join(pieces) == st["colors"]
    assert st.get_meta_info("colors")["finish_reason"]["type"] in FINISH_TYPES
    whole = "".join(st.text_iter())  # everything, buffered meanwhile
    assert whole == st.text() and st["colors"] in whole


# --- select ---------------------------------------------------------------------------------------

@sgl.function
def capital(s, method):
    s += "The capital of France is"
    s += sgl.select("city", choices=[" Paris", " London", " a banana"], choices_method=method)


def test_select_on_completion_model_matches_native(comp, runtime):
    st = capital.run(method=None, backend=comp)
    native = capital.run(method=None, backend=runtime)
    assert st["city"] == native["city"] == " Paris"
    assert st.text() == "The capital of France is Paris"
    mine, theirs = st.get_meta_info("city"), native.get_meta_info("city")
    assert [len(x) for x in mine["input_token_logprobs"]] == [1, 1, 2]
    assert mine["normalized_prompt_logprobs"] == pytest.approx(
        theirs["normalized_prompt_logprobs"], abs=1e-2)


@pytest.mark.parametrize("method", [sgl.greedy_token_selection,
                                    sgl.unconditional_likelihood_normalized],
                         ids=["greedy", "unconditional"])
def test_select_methods_on_completion_model(comp, method):
    st = capital.run(method=method, backend=comp)
    assert st["city"] in (" Paris", " London", " a banana")
    assert st.text() == "The capital of France is" + st["city"]
    meta = st.get_meta_info("city")
    assert [len(x) for x in meta["input_token_logprobs"]] == [1, 1, 2]
    if method is sgl.unconditional_likelihood_normalized:
        assert [len(x) for x in meta["unconditional_token_logprobs"]] == [1, 1, 2]
        assert len(meta["unconditional_normalized_scores"]) == 3
        # SGLang's key for the same scores (programs written for SGLang read this one)
        assert meta["normalized_unconditional_prompt_logprobs"] == meta["unconditional_normalized_scores"]


def test_select_on_chat_model_is_constrained(chat, anth):
    @sgl.function
    def yes_no(s):
        s += sgl.user("Is Paris in France? Answer Yes or No.")
        s += sgl.assistant(sgl.select("yn", choices=["Yes", "No"]))

    st = yes_no.run(backend=chat)
    assert st["yn"] in ("Yes", "No") and st.messages()[-1]["content"] == st["yn"]
    assert st.get_meta_info("yn")["method"] == "constrained_decoding"
    with pytest.raises(UnsupportedPrimitive, match="Anthropic backend does not support select"):
        yes_no.run(backend=anth)


# --- constrained decoding ------------------------------------------------------------------------

@sgl.function
def constrained(s):
    s += sgl.user("How many legs does a dog have? And what color is grass?")
    with s.assistant():
        s += sgl.gen_int("legs", max_tokens=4, temperature=0)
    s += sgl.user("One word: the color of grass.")
    s += sgl.assistant(sgl.gen("color", regex="(red|green|blue)", max_tokens=4))


@pytest.mark.parametrize("backend", OPENAI, indirect=True)
def test_gen_int_and_regex(backend):
    st = constrained.run(backend=backend)
    # as in SGLang, a dtype=int variable holds the generated text (a regex-constrained integer)
    assert isinstance(st["legs"], str) and re.fullmatch(r"[-+]?[0-9]+", st["legs"].strip())
    assert isinstance(int(st["legs"]), int)
    first_answer = [m for m in st.messages() if m["role"] == "assistant"][0]["content"]
    assert re.fullmatch(r"[-+]?[0-9]+[ \n]*", first_answer)
    assert st["color"] in ("red", "green", "blue")


def test_anthropic_refuses_constraints(anth):
    with pytest.raises(UnsupportedPrimitive, match="dtype=int"):
        constrained.run(backend=anth)


# --- stop conditions, min_tokens, prefill, server errors -----------------------------------------

@pytest.mark.parametrize("backend", ALL, indirect=True)
def test_stop_string(backend):
    @sgl.function
    def prog(s):
        s += sgl.user("Count from one to ten in words, separated by commas.")
        s += sgl.assistant(sgl.gen("count", max_tokens=12, stop=",", temperature=0))

    st = prog.run(backend=backend)
    meta = st.get_meta_info("count")
    assert "," not in st["count"]
    if meta["finish_reason"]["type"] == "stop" and meta["finish_reason"]["matched"] == ",":
        assert meta["completion_tokens"] < 12


def test_min_tokens_and_ignore_eos(comp):
    @sgl.function
    def prog(s):
        s += "Hi" + sgl.gen("a", max_tokens=5, min_tokens=5, ignore_eos=True, temperature=0)

    meta = prog.run(backend=comp).get_meta_info("a")
    assert meta["completion_tokens"] == 5 and meta["finish_reason"] == {"type": "length"}


def test_anthropic_prefill_continues_the_assistant_turn(anth, chat):
    @sgl.function
    def prog(s):
        s += sgl.user("What is the capital of France?")
        with s.assistant():
            s += "The capital of France is "
            s += sgl.gen("city", max_tokens=4, temperature=0)

    st = prog.run(backend=anth)
    assert st["city"].strip() and not st["city"][0].isspace()
    assert st.messages()[-1]["content"] == "The capital of France is " + st["city"]
    with pytest.raises(UnsupportedPrimitive, match="partial assistant message"):
        prog.run(backend=chat)


def test_server_rejection_surfaces(chat):
    @sgl.function
    def prog(s):
        s += sgl.user("Hi")
        s += sgl.assistant(sgl.gen("a", max_tokens=4, top_k=0))

    with pytest.raises(openai.BadRequestError, match="top_k"):
        prog.run(backend=chat)


# --- fork and run_batch ---------------------------------------------------------------------------

def test_fork_branches_hit_the_cache(comp):
    @sgl.function
    def prog(s, branches):
        s += "Here is a list of fruits and their colors, one per line.\n" * 4
        forks = s.fork(2)
        for f, fruit in zip(forks, ["Apple", "Banana"]):
            f += fruit + ":" + sgl.gen("color", max_tokens=3, temperature=0)
        branches.extend(forks)
        forks.join()

    branches = []
    st = prog.run(branches=branches, backend=comp)
    assert len(st["color"]) == 2 and all(c.strip() for c in st["color"])
    # fork committed the shared prefix (~50 tokens) first: both branches read it from the cache
    for f in branches:
        meta = f.get_meta_info("color")
        assert meta["cached_tokens"] >= 40 and meta["prompt_tokens"] > meta["cached_tokens"]


@pytest.mark.parametrize("backend", ALL, indirect=True)
def test_run_batch(backend):
    @sgl.function
    def ask(s, thing):
        s += sgl.user("Describe " + thing + " in a few words.")
        s += sgl.assistant(sgl.gen("desc", max_tokens=6, temperature=0))

    things = ["the sun", "the sea", "a tree", "a cat"]
    states = ask.run_batch([{"thing": t} for t in things], backend=backend, progress_bar=True)
    assert len(states) == 4
    for st, t in zip(states, things):
        # a completion model's template (smollm2) starts with its default system turn, a message
        # of its own as in SGLang; the user turn follows it
        users = [m for m in st.messages() if m["role"] == "user"]
        assert [m["content"] for m in users] == ["Describe " + t + " in a few words."]
        assert st["desc"].strip()
        finished(st.get_meta_info("desc"))
