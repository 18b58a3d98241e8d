"""SGLang-style programs for the compatibility suite (compat_runner.py runs them). Every program
is written against a frontend module `sgl` it receives (radixlm's or the real SGLang's), imports
neither itself, and returns a JSON-able dict:

- `same`: what both frontends must agree on exactly (greedy text, variables, decisions);
- `facts`: what the test checks for each frontend on its own (cache hits, token counts,
  constraint satisfaction), since the two runs share one server and cannot have equal counters.

Every program starts by flushing the server's cache, so its cache hits are its own. Generation is
greedy (temperature 0) wherever the two frontends' outputs are compared.

The programs run on the tiny random chat model (tests/tiny_models.py): what they check is the
frontend's and the runtime's behaviour, which holds for any model. The ones in REAL_MODEL run on
the bundled SmolLM2, because their checks need a real model's text.
"""

from __future__ import annotations

import asyncio
import json
import re

CHAT_TEMPLATE = "chatml"  # both frontends render roles the same way (SGLang: RuntimeEndpoint's
# chat_template_name; the model's own name matches no SGLang template)
PROGRAMS = {}
# program -> what its checks need of a real model (the tiny random one repeats a token until
# max_tokens, never emits EOS, and has no clear favourite among choices)
REAL_MODEL = {
    # the two frontends score a choice over different spans (SGLang's takes in the prompt's last
    # tokens), so they pick the same choice only when one clearly wins; on the tiny model they
    # do not (Banana vs Keyboard)
    "select_choices": "one choice must clearly win",
    # the tiny model writes all 8 tokens before the first chunk leaves the server
    "streaming_logprobs": "the answer must stream in more than one chunk",
    "regex_json": "the JSON object and the integer must end within max_tokens",
    "min_tokens": "the free answer must end (EOS) before min_tokens",
    "tool_use": "the regex-constrained expression must end within max_tokens",
}


def program(fn):
    PROGRAMS[fn.__name__] = fn
    return fn


def meta(st, name, *keys):
    m = st.get_meta_info(name) or {}
    return {k: m.get(k) for k in keys}


@program
def few_shot(sgl):
    @sgl.function
    def qa(s, question):
        s += "Answer each question with one word.\n"
        s += "Q: What is the capital of Italy?\nA: Rome\n"
        s += "Q: What is the capital of Germany?\nA: Berlin\n"
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=8, stop="\n", temperature=0)

    sgl.flush_cache()
    st = qa.run(question="What is the capital of France?")
    qs = ["What is the capital of Spain?", "What is the capital of Japan?",
          "What is the capital of Egypt?"]
    batch = qa.run_batch([{"question": q} for q in qs], num_threads=3)
    return {"same": {"answer": st["answer"], "text": st.text(),
                     "batch": [b["answer"] for b in batch]},
            "facts": {"batch_cached": [meta(b, "answer", "cached_tokens")["cached_tokens"]
                                       for b in batch],
                      "finish": meta(st, "answer", "finish_reason")["finish_reason"]}}


@program
def multi_turn(sgl):
    @sgl.function
    def chat(s, q1, q2):
        s += sgl.system("You are a terse assistant.")
        s += sgl.user(q1)
        s += sgl.assistant(sgl.gen("a1", max_tokens=12, temperature=0))
        with s.user():
            s += q2
        with s.assistant():
            s += sgl.gen("a2", max_tokens=12, temperature=0)

    sgl.flush_cache()
    st = chat.run(q1="What is the capital of France?", q2="And of Spain?")
    return {"same": {"a1": st["a1"], "a2": st["a2"], "text": st.text(),
                     "messages": st.messages()},
            "facts": {"a2": meta(st, "a2", "cached_tokens", "prompt_tokens")}}


@program
def fork_gather(sgl):
    @sgl.function
    def tips(s, topic):
        s += "Three tips for " + topic + ":\n"
        forks = s.fork(3)
        for i in range(3):
            forks[i] += f"{i + 1}."  # item assignment on the fork group
        forks += sgl.gen("tip", max_tokens=8, stop="\n", temperature=0)
        forks.join()
        s += "Summary:" + sgl.gen("summary", max_tokens=8, temperature=0)
        s["branch_cached"] = [f.get_meta_info("tip")["cached_tokens"] for f in forks]

    sgl.flush_cache()
    st = tips.run(topic="staying healthy")
    return {"same": {"tip": st["tip"], "summary": st["summary"], "text": st.text()},
            "facts": {"prefix_tokens": meta(st, "summary", "prompt_tokens")["prompt_tokens"],
                      "branch_cached": st["branch_cached"],
                      "summary": meta(st, "summary", "cached_tokens", "prompt_tokens")}}


@program
def fork_concat(sgl):
    @sgl.function
    def outline(s, subject):
        s += "Two facts about " + subject + ".\n"
        forks = s.fork(2)
        forks += lambda i: f"Fact {i + 1}:" + sgl.gen("fact", max_tokens=8, stop="\n",
                                                       temperature=0) + "\n"
        forks.join("concate_and_append")
        s += "In short:" + sgl.gen("short", max_tokens=6, stop="\n", temperature=0)

    # SGLang programs turn KV splicing off for this join mode (SGLang's server has no such route)
    sgl.global_config.enable_parallel_encoding = False
    try:
        sgl.flush_cache()
        st = outline.run(subject="the Moon")
    finally:
        sgl.global_config.enable_parallel_encoding = True
    return {"same": {"text": st.text(), "short": st["short"]}, "facts": {}}


@program
def select_choices(sgl):
    @sgl.function
    def pick(s):
        s += "The capital of France is the city of"
        s += sgl.select("city", choices=[" Paris", " Banana", " Keyboard"])
        s += ". The color of the sky on a clear day is"
        s += sgl.select("color", choices=[" blue", " green", " purple"],
                        choices_method=sgl.greedy_token_selection)
        s += ". Is fire hot? Answer:" + sgl.gen("hot", choices=[" yes", " no"])

    sgl.flush_cache()
    st = pick.run()
    return {"same": {"city": st["city"], "color": st["color"], "hot": st["hot"],
                     "text": st.text()},
            "facts": {"scores": st.get_meta_info("city")["normalized_prompt_logprobs"]}}


@program
def regex_json(sgl):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}

    @sgl.function
    def structured(s):
        s += "An IP address: " + sgl.gen(
            "ip", regex=r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",
            max_tokens=20, temperature=0)
        s += "\nA person as JSON: "
        with s.var_scope("person"):
            s += sgl.gen("json_body", json_schema=json.dumps(schema), max_tokens=40,
                         temperature=0)
        s += "\nHow many legs does a spider have? " + sgl.gen_int("legs", max_tokens=4,
                                                               temperature=0)

    sgl.flush_cache()
    st = structured.run()
    return {"same": {"ip": st["ip"], "person": st["person"], "legs": st["legs"],
                     "text": st.text()}, "facts": {}}


@program
def streaming_logprobs(sgl):
    @sgl.function
    def story(s):
        s += "Once upon a time" + sgl.gen("a", max_tokens=8, temperature=0,
                                          return_logprob=True)

    async def collect(st):
        return [[text, meta] async for text, meta in
                st.text_async_iter("a", return_meta_data=True)]

    sgl.flush_cache()
    st = story.run(stream=True)
    chunks = asyncio.run(collect(st))
    st.sync()
    whole = story.run(stream=True)
    pieces = list(whole.text_iter())
    plain = story.run()
    plain_meta = plain.get_meta_info("a")
    return {"same": {"streamed": "".join(t for t, _ in chunks), "a": st["a"],
                     "text_iter": "".join(pieces), "plain": plain["a"]},
            "facts": {"chunk_texts": [t for t, _ in chunks],
                      "chunk_logprobs": [m.get("output_token_logprobs") for _, m in chunks],
                      "chunk_completion_tokens": [m.get("completion_tokens") for _, m in chunks],
                      "plain_logprobs": plain_meta["output_token_logprobs"],
                      "plain_completion_tokens": plain_meta["completion_tokens"]}}


@program
def min_tokens(sgl):
    @sgl.function
    def short(s, at_least):  # not `n`: SGLang's run() takes n as a sampling parameter
        s += sgl.user("Is the sky blue? Answer yes or no.")
        s += sgl.assistant(sgl.gen("a", max_tokens=16, min_tokens=at_least, temperature=0))

    sgl.flush_cache()
    free, forced = short.run(at_least=0), short.run(at_least=12)
    return {"same": {"free": free["a"], "forced": forced["a"]},
            "facts": {"free": meta(free, "a", "completion_tokens", "finish_reason"),
                      "forced": meta(forced, "a", "completion_tokens", "finish_reason")}}


@program
def tool_use(sgl):
    @sgl.function
    def calculator(s, question):
        s += "Write a Python arithmetic expression that answers the question.\n"
        s += "Question: " + question + "\nExpression: "
        s += sgl.gen("expr", regex=r"[0-9]+ ?[-+*] ?[0-9]+", max_tokens=12, temperature=0)
        value = eval(s["expr"], {"__builtins__": {}})  # the tool runs in Python
        s += f"\nResult: {value}\nSo the answer is"
        s += sgl.gen("final", max_tokens=6, stop="\n", temperature=0)

    sgl.flush_cache()
    st = calculator.run(question="What is 12 plus 7?")
    return {"same": {"expr": st["expr"], "final": st["final"], "text": st.text()},
            "facts": {"final": meta(st, "final", "cached_tokens", "prompt_tokens")}}


@program
def react(sgl):
    @sgl.function
    def agent(s, question):
        s += "Question: " + question + "\n"
        for step in range(2):
            s += f"Thought {step}:" + sgl.gen(f"thought{step}", max_tokens=8, stop="\n",
                                              temperature=0)
            s += f"\nAction {step}: " + sgl.select(f"action{step}", choices=["search", "finish"])
            if s[f"action{step}"] == "finish":
                break
            s += f"\nObservation {step}: (no results)\n"
        s += "\nAnswer:" + sgl.gen("answer", max_tokens=8, stop="\n", temperature=0)

    sgl.flush_cache()
    st = agent.run(question="Who wrote Hamlet?")
    actions = [st[f"action{i}"] for i in range(2) if f"action{i}" in st]
    return {"same": {"actions": actions, "answer": st["answer"], "text": st.text()}, "facts": {}}


@program
def stop_regex(sgl):
    @sgl.function
    def count(s):
        s += "Count: 1, 2, 3, 4, 5," + sgl.gen("a", max_tokens=30, stop_regex=r"1[0-9]",
                                               temperature=0)

    sgl.flush_cache()
    st = count.run()
    return {"same": {"a": st["a"]},
            "facts": {"a": meta(st, "a", "finish_reason", "completion_tokens")}}


@program
def reasoning(sgl):
    @sgl.function
    def think(s):
        s += sgl.user("What is the capital of France? Think first.")
        s += sgl.assistant(sgl.separate_reasoning(
            sgl.gen("a", regex=r"<think>[a-z ]{1,30}</think>[A-Z][a-z]{1,10}", max_tokens=24,
                    temperature=0), model_type="qwen3"))

    sgl.flush_cache()
    st = think.run()
    st.sync()  # SGLang's run() returns before the last expressions ran: separate_reasoning
    # rewrites `a` after the gen has set it
    return {"same": {"a": st["a"], "reasoning": st["a_reasoning_content"], "text": st.text()},
            "facts": {"ok": bool(re.fullmatch(r"[A-Z][a-z]{1,10}", st["a"]))}}
