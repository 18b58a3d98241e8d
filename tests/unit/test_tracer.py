"""Tracing: the dataflow graph of a program, the errors for what tracing cannot follow, and the
constant prefix run_batch caches. A fake backend stands in for a model."""

from __future__ import annotations

import hashlib
import threading

import pytest

import radixlm as sgl
from radixlm.lang.backend.base import BaseBackend
from radixlm.lang.chat_template import get_chat_template
from radixlm.lang.choices import ChoicesDecision
from radixlm.lang.ir import REGEX_INT
from radixlm.lang.tracer import (TracedArgument, TracingError, extract_prefix_by_tracing,
                                 trace_program)


class FakeBackend(BaseBackend):
    """Deterministic: a gen returns a hash of the prompt; select picks by the prompt's length."""

    def __init__(self, template: str = "default"):
        self.chat_template = get_chat_template(template)
        self.cached: list[str] = []
        self.commits: list[str] = []
        self.prompts: list[str] = []
        self.lock = threading.Lock()

    def generate(self, s, params):
        text = s.text_
        with self.lock:
            self.prompts.append(text)
        if params.regex == REGEX_INT or params.dtype is not None:
            return str(len(text) % 97), {}
        return f"<{hashlib.md5(text.encode()).hexdigest()[:6]}>", {}

    def select(self, s, choices, temperature, choices_method):
        return ChoicesDecision(choices[len(s.text_) % len(choices)])

    def cache_prefix(self, prefix):
        with self.lock:
            self.cached.append(prefix)

    def commit_lazy_operations(self, s):
        with self.lock:
            self.commits.append(s.text_)


@sgl.function
def few_shot(s, question):
    s += "Answer the questions.\n"
    s += "Q: What is 1+1?\nA: 2\n"
    s += "Q: " + question + "\nA: "
    s += sgl.gen("answer", max_tokens=16, stop="\n")


def kinds(tp, stream=0):
    return [n.kind for n in tp.stream_nodes(stream)]


def test_few_shot_graph():
    tp = few_shot.trace()
    assert list(tp.arguments) == ["question"]
    arg = tp.node(tp.arguments["question"])
    assert arg.kind == "argument" and arg.stream is None and arg.name == "question"
    assert kinds(tp) == ["text", "text", "text", "arg", "text", "gen"]
    main = tp.stream_nodes(0)
    assert main[0].text == "Answer the questions.\n"
    use, gen = main[3], main[5]
    assert use.name == "question"
    assert (arg.id, use.id, "arg") in tp.edges
    assert gen.name == "answer" and gen.attrs["params"].max_new_tokens == 16
    assert tp.variables == {"answer": [gen.id]}
    # the stream's text flows node to node
    for a, b in zip(main, main[1:]):
        assert (a.id, b.id, "seq") in tp.edges
    # ids are a topological order
    assert all(e.src < e.dst for e in tp.edges)
    assert tp.topological_order() == list(range(len(tp.nodes)))
    text = str(tp)
    assert "few_shot(question)" in text and "arg" in text and "gen           answer" in text


def test_fork_branches_and_join():
    @sgl.function
    def tips(s, topic):
        s += "Topic: " + topic + "\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Tip {i}: " + sgl.gen("tip", max_tokens=8)
        forks.join()
        s += "Done."

    tp = tips.trace()
    assert len(tp.streams) == 3
    fork = tp.nodes_of("fork")[0]
    assert fork.stream == 0 and fork.attrs["size"] == 2 and fork.attrs["branches"] == [1, 2]
    gens = []
    for sid in (1, 2):
        st = tp.streams[sid]
        assert st.parent == 0 and st.fork_node == fork.id
        first, last = tp.stream_nodes(sid)[0], tp.stream_nodes(sid)[-1]
        assert (fork.id, first.id, "fork") in tp.edges
        assert kinds(tp, sid) == ["text", "gen"] and last.name == "tip"
        gens.append(last.id)
    join = tp.nodes_of("join")[0]
    assert join.stream == 0 and join.attrs["mode"] == "gather_variable"
    assert join.attrs["variables"] == ["tip"]
    assert {(g, join.id, "join") for g in gens} <= set(tp.edges)
    assert tp.variables["tip"] == gens + [join.id]  # the join produces the gathered list
    assert kinds(tp) == ["text", "arg", "text", "fork", "join", "text"]
    assert "branch 1 of fork" in tp.pretty()


def test_essay_judge_reads_fork_variables():
    dims = ["Clarity", "Evidence"]

    @sgl.function
    def essay_judge(s, essay):
        s += "Please evaluate the following essay. " + essay
        forks = s.fork(len(dims))
        for f, dim in zip(forks, dims):
            f += ("Evaluate based on the following metric: " + dim +
                  ". End your judgement with the word 'END'")
            f += "Judgment: " + f.gen("judgment", stop="END")
        for f, dim in zip(forks, dims):
            s += dim + ": " + f["judgment"]
        s += "In summary," + s.gen("summary")
        s += "I give the essay a letter grade of " + s.gen("grade", choices=["A", "B", "C", "D"])

    tp = essay_judge.trace()
    reads = tp.nodes_of("get_fork_var")
    assert len(reads) == 2 and all(r.stream == 0 and r.name == "judgment" for r in reads)
    for r, sid in zip(reads, (1, 2)):
        producer = tp.stream_nodes(sid)[-1]
        assert producer.kind == "gen" and (producer.id, r.id, "var") in tp.edges
    sel = tp.nodes_of("select")[0]
    assert sel.name == "grade" and sel.attrs["choices"] == ["A", "B", "C", "D"]


def test_variable_reused_in_prompt():
    @sgl.function
    def reuse(s, topic):
        s += "Name a city in " + topic + ": " + sgl.gen("city", max_tokens=4) + "\n"
        s += "Describe " + s["city"] + " in one line: " + sgl.gen("desc", max_tokens=8)

    tp = reuse.trace()
    city = tp.variables["city"][0]
    read = tp.nodes_of("var")[0]
    assert read.name == "city" and read.stream == 0
    assert (city, read.id, "var") in tp.edges
    desc = tp.node(tp.variables["desc"][0])
    # the read flows into the later gen through the stream
    assert read.id < desc.id and tp.node(read.id + 1).kind == "text"


def test_roles_var_scope_set_var_and_params():
    @sgl.function
    def chat(s, question, n):
        with s.system():
            s += "Be brief."
        s += sgl.user(question)
        with s.var_scope("reply"):
            s += sgl.assistant(sgl.gen("answer", max_tokens=n))
        s["fixed"] = "constant"

    tp = chat.trace()
    assert kinds(tp) == ["role_begin", "text", "role_end", "role_begin", "arg", "role_end",
                         "var_scope_begin", "role_begin", "gen", "role_end", "var_scope_end",
                         "set_var"]
    gen = tp.nodes_of("gen")[0]
    assert (tp.arguments["n"], gen.id, "param") in tp.edges
    assert gen.attrs["dynamic"]
    assert set(tp.variables) == {"answer", "reply", "fixed"}


@pytest.mark.parametrize("body, op", [
    (lambda s, q: s.__iadd__(f"Question: {q}"), "f-string"),
    (lambda s, q: s.__iadd__("Question: {}".format(q)), "f-string or str.format"),
    (lambda s, q: s.__iadd__(str(q)), "str()"),
    (lambda s, q: s.__iadd__("Q: %s" % q), "%-formatting"),
    (lambda s, q: s.__iadd__("x" * len(q)), "len()"),
    (lambda s, q: [s.__iadd__(w) for w in q], "iteration"),
    (lambda s, q: s.__iadd__("yes" if q else "no"), "truth test"),
    (lambda s, q: s.__iadd__("yes" if q == "hi" else "no"), "comparison"),
])
def test_consuming_an_argument_raises(body, op):
    def prog(s, question):
        body(s, question)

    with pytest.raises(TracingError) as info:
        trace_program(prog, {})
    msg = str(info.value)
    assert "'question'" in msg and op in msg
    assert "tracing cannot follow" in msg and 's += "..." + question' in msg


def test_fstring_error_through_sgl_function():
    @sgl.function
    def bad(s, question):
        s += f"Q: {question}\nA: " + sgl.gen("a")

    with pytest.raises(TracingError, match=r"argument 'question' .*f-string"):
        bad.trace()


def test_str_join_of_argument_is_a_tracing_error():
    def prog(s, question):
        s += "".join(["Q: ", question])

    with pytest.raises(TracingError, match="placeholder"):
        trace_program(prog, {})


def test_appending_argument_forms_allowed():
    @sgl.function
    def ok(s, question, item):
        s += question
        s += "Q: " + question + "!"
        s += question + " (end)"
        s += item["title"] + ": " + item["body"][:20]

    tp = ok.trace()
    uses = tp.nodes_of("arg")
    assert [u.attrs["placeholder"].display for u in uses] == [
        "question", "question", "question", "item['title']", "item['body'][slice(None, 20, None)]"]
    assert isinstance(uses[0].attrs["placeholder"], TracedArgument)


def test_control_flow_on_generated_value_raises():
    @sgl.function
    def react(s, q):
        s += q + sgl.gen("action", max_tokens=4)
        if s["action"] == "finish":
            s += "bye"

    with pytest.raises(TracingError, match=r"generated variable 'action'.*comparison"):
        react.trace()


def test_swallowed_tracing_error_still_raised():
    @sgl.function
    def sneaky(s, q):
        try:
            s += str(q)
        except Exception:
            s += "fallback"

    with pytest.raises(TracingError, match="'q'"):
        sneaky.trace()


def test_concrete_arguments_are_traced_as_values():
    @sgl.function
    def prog(s, examples, question):
        for q, a in examples:
            s += "Q: " + q + "\nA: " + a + "\n"
        s += "Q: " + question + "\nA: " + sgl.gen("answer")

    with pytest.raises(TracingError, match="'examples'"):
        prog.trace()
    tp = prog.trace(examples=[("1+1?", "2")])
    assert list(tp.arguments) == ["question"] and tp.concrete == {"examples": [("1+1?", "2")]}
    assert tp.constant_prefix() == "Q: 1+1?\nA: 2\nQ: "
    assert extract_prefix_by_tracing(prog.bind(examples=[("a", "b")]), None) == "Q: a\nA: b\nQ: "


# --- constant prefix ------------------------------------------------------------------------------
def test_prefix_without_roles_matches_real_run():
    b = FakeBackend()
    prefix = extract_prefix_by_tracing(few_shot, b)
    assert prefix == "Answer the questions.\nQ: What is 1+1?\nA: 2\nQ: "
    text = few_shot.run(question="Why?", backend=b).text()
    assert text.startswith(prefix) and text[len(prefix):].startswith("Why?")


@sgl.function
def chat_prog(s, question):
    s += sgl.system("You are a careful assistant.")
    with s.user():
        s += "Question: " + question
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))


@sgl.function
def chat_no_system(s, question):
    s += sgl.user("Please answer. " + question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))


@pytest.mark.parametrize("template", ["default", "chatml", "smollm2", "llama-3-instruct"])
@pytest.mark.parametrize("prog", [chat_prog, chat_no_system])
def test_prefix_with_roles_matches_real_run(template, prog):
    b = FakeBackend(template)
    prefix = extract_prefix_by_tracing(prog, b)
    state = prog.run(question="QUESTION", backend=b)
    text = state.text()
    assert prefix and text.startswith(prefix)
    assert text[len(prefix):].startswith("QUESTION")  # everything before the argument is in it
    if template == "smollm2" and prog is chat_no_system:  # the template's default system turn
        assert prefix.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_prefix_is_none_without_constant_text_or_on_error():
    @sgl.function
    def starts_with_arg(s, q):
        s += q + "?" + sgl.gen("a")

    @sgl.function
    def broken(s, q):
        raise ValueError("boom")

    @sgl.function
    def consumes(s, q):
        s += "Hello " + q.upper() + f" {q}"

    b = FakeBackend()
    assert extract_prefix_by_tracing(starts_with_arg, b) is None
    assert extract_prefix_by_tracing(broken, b) is None
    assert extract_prefix_by_tracing(consumes, b) is None


def test_prefix_continues_past_fork_and_stops_at_gen():
    @sgl.function
    def prog(s):
        s += "Shared context. "
        forks = s.fork(2)
        forks += ["a", "b"]
        s += "More. " + sgl.gen("x") + " tail"

    assert extract_prefix_by_tracing(prog, FakeBackend()) == "Shared context. More. "


def test_run_batch_caches_the_traced_prefix_once():
    b = FakeBackend()
    states = few_shot.run_batch([{"question": f"q{i}"} for i in range(4)], backend=b,
                                num_threads=2)
    assert b.cached == ["Answer the questions.\nQ: What is 1+1?\nA: 2\nQ: "]
    assert [s.text().startswith(b.cached[0]) for s in states] == [True] * 4
