"""Compiled programs: run from the traced graph, they give what the interpreter gives (text,
variables, messages) for the same inputs, commit fork prefixes once, and batch with the constant
prefix cached once. A fake deterministic backend stands in for a model."""

from __future__ import annotations

import hashlib
import threading

import pytest

import radixlm as sgl
from radixlm.lang.backend.base import BaseBackend
from radixlm.lang.chat_template import get_chat_template
from radixlm.lang.choices import ChoicesDecision
from radixlm.lang.compiler import CompiledProgram, CompileError, compile_program
from radixlm.lang.ir import REGEX_INT


class FakeBackend(BaseBackend):
    """A gen returns a hash of (prompt, max_new_tokens, temperature, stop): any difference in what
    a run sends shows in its text. select picks by the prompt's length. Prompts containing
    "BARRIER" wait for `barrier` parties, so only concurrent branches get through."""

    def __init__(self, template: str = "default", barrier: int = 0):
        self.chat_template = get_chat_template(template)
        self.cached: list[str] = []
        self.commits: list[str] = []
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(barrier, timeout=5) if barrier else None

    def generate(self, s, params):
        text = s.text_
        if self.barrier is not None and "BARRIER" in text:
            self.barrier.wait()
        p = params.resolved()
        if p["regex"] == REGEX_INT:
            return str(len(text) % 97), {}
        key = f"{text}|{p['max_new_tokens']}|{p['temperature']}|{p['stop']}"
        return f"<{hashlib.md5(key.encode()).hexdigest()[:6]}>", {"prompt": text}

    def select(self, s, choices, temperature, choices_method):
        return ChoicesDecision(choices[len(s.text_) % len(choices)])

    def cache_prefix(self, prefix):
        with self.lock:
            self.cached.append(prefix)

    def commit_lazy_operations(self, s):
        with self.lock:
            self.commits.append(s.text_)


# --- programs -------------------------------------------------------------------------------------
@sgl.function
def few_shot(s, question):
    s += "Answer the questions.\nQ: What is 1+1?\nA: 2\n"
    s += "Q: " + question + "\nA: " + sgl.gen("answer", max_tokens=16, stop="\n")


@sgl.function
def multi_turn(s, q1, q2):
    s += sgl.system("You are helpful.")
    s += sgl.user(q1)
    s += sgl.assistant(sgl.gen("a1", max_tokens=8))
    with s.user():
        s += "And: " + q2
    with s.assistant():
        s += sgl.gen("a2", max_tokens=8)


DIMS = ["Clarity", "Originality", "Evidence"]


@sgl.function
def essay_judge(s, essay):
    s += "Please evaluate the following essay. " + essay
    forks = s.fork(len(DIMS))
    for f, dim in zip(forks, DIMS):
        f += ("Evaluate based on the following metric: " + dim +
              ". End your judgement with the word 'END'")
        f += "Judgment: " + f.gen("judgment", stop="END")
    for f, dim in zip(forks, DIMS):
        s += dim + ": " + f["judgment"]
    s += "In summary," + s.gen("summary")
    s += "I give the essay a letter grade of " + s.gen("grade", choices=["A", "B", "C", "D"])


@sgl.function
def tips_gather(s, topic):
    s += "Here are tips about " + topic + ".\n"
    forks = s.fork(3)
    forks += lambda i: f"Tip {i + 1}: "
    forks += sgl.gen("tip", max_tokens=8, stop="\n")
    forks.join()
    s += "Summary of tips."


@sgl.function
def tips_concat(s, topic):
    with s.user():
        s += "Outline " + topic
    with s.assistant():
        forks = s.fork(2)
        forks += ["Part A: ", "Part B: "]
        forks += sgl.gen("part", max_tokens=6)
        forks.join("concate_and_append")
        s += " End."


@sgl.function
def classify(s, text, yes_word):
    s += "Text: " + text + "\nLabel: " + sgl.select("label", choices=["pos", "neg", "neutral"])
    s += "\nAgain: " + sgl.gen("again", choices=[yes_word, "no"])
    s += "\nConfidence: " + sgl.gen_int("conf")


@sgl.function
def reuse_and_scope(s, topic, n):
    s += "City in " + topic + ": " + sgl.gen("city", max_tokens=n) + "\n"
    with s.var_scope("line"):
        s += "About " + s["city"] + ": " + sgl.gen("desc", max_tokens=n, temperature=0.5)
    s += "\nDone " + s["line"]


@sgl.function
def helper(s, x):
    s += "[helper " + x + "]"


@sgl.function
def outer(s, item, ctx=" ctx"):
    s += "Item " + item["name"] + ctx
    helper(s, item["kind"].upper())
    s += sgl.gen("out")


CASES = [
    (few_shot, {"question": "What is 2+2?"}),
    (multi_turn, {"q1": "Hi there", "q2": "how are you?"}),
    (essay_judge, {"essay": "Cats are great."}),
    (tips_gather, {"topic": "sleep"}),
    (tips_concat, {"topic": "history"}),
    (classify, {"text": "I loved it", "yes_word": "yes!"}),
    (reuse_and_scope, {"topic": "France", "n": 5}),
    (outer, {"item": {"name": "box", "kind": "tool"}}),
]


def assert_same(a, b):
    assert a.text() == b.text()
    assert a.messages() == b.messages()
    va = {k: v for k, v in a.variables.items()}
    vb = {k: v for k, v in b.variables.items()}
    assert va == vb


@pytest.mark.parametrize("template", ["default", "chatml"])
@pytest.mark.parametrize("prog, kwargs", CASES, ids=[c[0].__name__ for c in CASES])
def test_compiled_equals_interpreted(prog, kwargs, template):
    b = FakeBackend(template)
    interpreted = prog.run(backend=b, **kwargs)
    compiled = prog.compile(backend=b)
    assert isinstance(compiled, CompiledProgram)
    state = compiled.run(**kwargs)
    assert_same(interpreted, state)
    assert state.text()  # non-trivial
    # variables are readable like a run's
    for name in interpreted.variables:
        assert state[name] == interpreted[name]


def test_run_level_params_and_positional_args():
    b = FakeBackend()
    c = few_shot.compile(backend=b)
    want = few_shot.run("Why?", backend=b, temperature=0, max_new_tokens=3)
    got = c.run("Why?", temperature=0, max_new_tokens=3)
    assert got.text() == want.text()
    assert got.text() != c.run("Why?").text()  # the params reached the backend


def test_gen_params_from_arguments_are_substituted():
    b = FakeBackend()
    c = reuse_and_scope.compile(backend=b)
    for n in (3, 7):
        assert c.run(topic="Peru", n=n).text() == reuse_and_scope.run(
            topic="Peru", n=n, backend=b).text()


def test_fork_commits_shared_prefix_once():
    b = FakeBackend()
    c = essay_judge.compile(backend=b)
    c.run(essay="E")
    assert b.commits == ["Please evaluate the following essay. E"]


def test_branches_run_concurrently():
    @sgl.function
    def par(s, q):
        s += q
        forks = s.fork(3)
        forks += [f"BARRIER {i} " for i in range(3)]
        forks += sgl.gen("x")
        forks.join()

    b = FakeBackend(barrier=3)  # a gen passes only when all three branches are generating
    st = par.compile(backend=b).run(q="go ")
    assert len(st["x"]) == 3


def test_compiled_run_batch():
    b = FakeBackend()
    batch = [{"question": f"question {i}"} for i in range(6)]
    c = compile_program(few_shot, b)
    states = c.run_batch(batch, num_threads=3, progress_bar=True, temperature=0)
    assert b.cached == ["Answer the questions.\nQ: What is 1+1?\nA: 2\nQ: "]
    for kw, st in zip(batch, states):
        assert_same(few_shot.run(backend=b, temperature=0, **kw), st)
    assert c.run_batch([]) == []


def test_compiled_run_batch_with_forks():
    b = FakeBackend()
    batch = [{"essay": f"essay {i}"} for i in range(4)]
    states = essay_judge.compile(backend=b).run_batch(batch)
    assert b.cached == ["Please evaluate the following essay. "]
    assert len(b.commits) == 4  # one per run, not one per branch
    for kw, st in zip(batch, states):
        assert_same(essay_judge.run(backend=b, **kw), st)


def test_default_backend_used_at_run_time():
    b = FakeBackend()
    c = few_shot.compile()  # no backend yet
    old = sgl.lang.api.get_default_backend()
    sgl.set_default_backend(b)
    try:
        assert c.run(question="x").text() == few_shot.run(question="x").text()
    finally:
        sgl.lang.api._default_backend = old


# --- what cannot be compiled ----------------------------------------------------------------------
def test_control_flow_on_generated_value_cannot_compile():
    @sgl.function
    def react(s, q):
        s += q + sgl.gen("action", max_tokens=4)
        if s["action"] == "finish":
            s += "bye"

    with pytest.raises(CompileError, match=r"cannot compile program 'react'.*'action'.*comparison"):
        react.compile(backend=FakeBackend())


def test_argument_in_python_control_flow_needs_binding():
    @sgl.function
    def shots(s, examples, question):
        for q, a in examples:
            s += "Q: " + q + "\nA: " + a + "\n"
        s += "Q: " + question + "\nA: " + sgl.gen("answer")

    with pytest.raises(CompileError, match=r"argument 'examples'.*iteration.*bind"):
        shots.compile()
    b = FakeBackend()
    ex = [("1+1?", "2"), ("2+2?", "4")]
    c = shots.bind(examples=ex).compile(backend=b)
    assert c.run(question="3+3?").text() == shots.run(examples=ex, question="3+3?",
                                                      backend=b).text()
    with pytest.raises(ValueError, match="fixed"):
        c.run(examples=[], question="x")


def test_missing_argument_and_backend_errors():
    class Failing(FakeBackend):
        def generate(self, s, params):
            if "Originality" in s.text_:
                raise RuntimeError("backend down")
            return super().generate(s, params)

    c = essay_judge.compile(backend=Failing())
    with pytest.raises(TypeError, match="essay"):
        c.run()
    with pytest.raises(RuntimeError, match="backend down"):
        c.run(essay="E")


def test_streaming_is_refused_clearly():
    c = few_shot.compile(backend=FakeBackend())
    with pytest.raises(NotImplementedError, match="does not stream"):
        c.run(question="x", stream=True)
