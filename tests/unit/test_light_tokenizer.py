"""The light tokenizer (runtime/tokenizer_light.py) against transformers' on the bundled model.

The light class stands in for HF's at start-up (no transformers import), so everything radixlm
uses of a tokenizer must come out identical: encode, decode (skipping special tokens or not, and
incrementally as the detokenizer does it), special ids, chat templates. It must also refuse the
folders it cannot reproduce, and the Engine's start-up must not import transformers at all.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from radixlm.runtime.detokenize import IncrementalDetokenizer
from radixlm.runtime.models import cache, loader
from radixlm.runtime.tokenizer_light import LightTokenizer
from radixlm.runtime.tokenizer_light_check import mismatch

TEXTS = [
    "What is the capital of France?", "", " ", "  leading and trailing  ", "\t\ttabs\tand\nnewlines\n\n\n",
    "crlf\r\nline\rbreaks", "héllo wörld — naïve café, e\u0301 (combining)", "日本語のテキスト、中文，한국어",
    "Привет мир", "مرحبا بالعالم", "emoji 🤖👍🏽 and ZWJ 👩‍👩‍👧 and flags 🇫🇷", "\u00a0nbsp\u200bzwsp\ufeffbom",
    "def f(x):\n    return x**2  # code\n", "12 + 7 = 19; 3.14159e-10", "a" * 500, "\x00\x01 control",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>", "<|im_start|><|im_end|>",
    "<|im_start", "im_end|>", "text<|im_end|>text", " <|im_end|> spaced ", "<repo_name>x<file_sep>y",
    "<s>[INST] not special here [/INST]</s>",
]
SYSTEM = {"role": "system", "content": "You are terse."}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [SYSTEM, {"role": "user", "content": "Hi"}],
    [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "12 + 7?"}, {"role": "assistant", "content": "19"},
     {"role": "user", "content": "émoji 🦙 <b>html</b> \"quotes\""}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tool_calls": None}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {}}}}]
# A template exercising what transformers adds to jinja: raise_exception, tojson (no HTML
# escaping, indent), namespace, dict, loopcontrols, strftime_now, tools and custom variables.
TEMPLATE = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}"
    "{% if m['role'] == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}{{ dict(a=1) | tojson }}"
    "{{ {'html': '<b>&</b>', 'uni': 'é'} | tojson }}{{ ns.n }}{{ extra_var | default('') }}"
    "{{ bos_token }}{% if strftime_now('%Y') | length != 4 %}bad{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(cache entry, the HF tokenizer transformers builds from the GGUF): a fresh cache."""
    try:
        smol = loader.default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    root = str(tmp_path_factory.mktemp("radixlm-cache"))
    c = cache.GGUFCache(smol, root=root)
    hf = c.get_tokenizer()  # miss: built from the GGUF, saved, checked against the light class
    assert type(hf).__name__ == "TokenizersBackend"
    return c, hf


@pytest.fixture(scope="module")
def hf(built):
    return built[1]


@pytest.fixture(scope="module")
def light(built):
    tok = cache.GGUFCache(built[0].gguf_path, root=built[0].root).get_tokenizer()  # hit
    assert isinstance(tok, LightTokenizer)
    return tok


def test_cache_records_verdict_and_serves_light(built, light, hf):
    c, _ = built
    with open(os.path.join(c.tokenizer_dir, "MANIFEST.json")) as f:
        assert json.load(f)["light"] is True
    assert light.name_or_path == hf.name_or_path == os.path.dirname(c.gguf_path)
    assert type(c.get_tokenizer(light=False)).__name__ == "TokenizersBackend"
    assert mismatch(light, hf) is None


def test_vocab_and_special_tokens(built, light, hf):
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "mask_token",
                 "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id",
                 "all_special_ids", "all_special_tokens", "special_tokens_map", "vocab_size",
                 "chat_template", "model_max_length", "clean_up_tokenization_spaces", "is_fast",
                 "added_tokens_encoder", "extra_special_tokens"):
        assert getattr(light, attr) == getattr(hf, attr), attr
    assert (light.bos_token_id, light.eos_token_id, light.pad_token_id) == (1, 2, 2)
    assert len(light) == len(hf) and light.get_vocab() == hf.get_vocab()
    assert light.added_tokens_decoder == hf.added_tokens_decoder
    ids = [0, 1, 2, 5, 100, 1000, 49151]
    assert light.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert light.convert_ids_to_tokens(ids, skip_special_tokens=True) == \
        hf.convert_ids_to_tokens(ids, skip_special_tokens=True)
    assert light.convert_ids_to_tokens(100) == hf.convert_ids_to_tokens(100)
    toks = ["<|im_end|>", "Hello", "Ġworld", "not-a-token-at-all"]
    assert light.convert_tokens_to_ids(toks) == hf.convert_tokens_to_ids(toks)
    cfg = built[0].get_config()
    assert loader.eos_token_ids(cfg, light) == loader.eos_token_ids(cfg, hf)


@pytest.mark.parametrize("text", TEXTS)
def test_encode(light, hf, text):
    for add in (True, False):
        assert light.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add)
        assert light(text, add_special_tokens=add)["input_ids"] == hf(text, add_special_tokens=add)["input_ids"]
        assert light(text)["attention_mask"] == hf(text)["attention_mask"]
    assert light.encode(text) == hf.encode(text)
    assert light.tokenize(text) == hf.tokenize(text)
    assert light(TEXTS[:3])["input_ids"] == hf(TEXTS[:3])["input_ids"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode(light, hf, text):
    ids = hf.encode(text)
    mixed = [1] + ids + [2, 0] + ids[:3] + [5, 2]
    for seq in (ids, mixed):
        for skip in (False, True):
            assert light.decode(seq, skip_special_tokens=skip) == hf.decode(seq, skip_special_tokens=skip)
            # the detokenizer passes this slow-tokenizer option too; fast ones ignore it
            assert light.decode(seq, skip_special_tokens=skip, spaces_between_special_tokens=False) == \
                hf.decode(seq, skip_special_tokens=skip, spaces_between_special_tokens=False)
    assert light.decode(tuple(mixed)) == hf.decode(mixed)
    assert light.decode(np.array(mixed)) == hf.decode(np.array(mixed))
    assert light.decode(torch.tensor(mixed)) == hf.decode(torch.tensor(mixed))
    assert light.decode([ids, mixed]) == hf.decode([ids, mixed])
    assert light.batch_decode([ids, mixed], skip_special_tokens=True) == \
        hf.batch_decode([ids, mixed], skip_special_tokens=True)
    if ids:
        assert light.decode(ids[0]) == hf.decode(ids[0])


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_incremental_detokenize(light, hf, skip, step):
    """As the detokenizer process streams: the same deltas, whichever tokenizer decodes."""
    ids = [1] + hf.encode("emoji 🤖👍🏽 ZWJ 👩‍👩‍👧 日本語 héllo\n\ncode()") + [2, 0] + \
        hf.encode(" after special <|im_end|> tail")
    for text in TEXTS:
        ids += hf.encode(text)
    outs = []
    for tok in (light, hf):
        d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        deltas = [d.push(ids[i:i + step]) for i in range(0, len(ids), step)] + [d.flush()]
        outs.append(deltas)
    assert outs[0] == outs[1]
    assert "".join(outs[0]) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template(light, hf, chat, gen):
    kw = dict(add_generation_prompt=gen)
    assert light.apply_chat_template(chat, tokenize=False, **kw) == \
        hf.apply_chat_template(chat, tokenize=False, **kw)
    assert list(light.apply_chat_template(chat, **kw)["input_ids"]) == \
        list(hf.apply_chat_template(chat, **kw)["input_ids"])
    assert light.apply_chat_template(chat, return_dict=False, **kw) == \
        hf.apply_chat_template(chat, return_dict=False, **kw)
    # what the server's TokenizerManager passes: its template (None: the model's), tools
    for template in (None, TEMPLATE):
        for extra in ({}, {"tools": TOOLS}, {"extra_var": "X"}, {"documents": [{"title": "t", "text": "d"}]}):
            assert light.apply_chat_template(chat, chat_template=template, tokenize=False, **kw, **extra) == \
                hf.apply_chat_template(chat, chat_template=template, tokenize=False, **kw, **extra)


def test_chat_template_batched_and_errors(light, hf):
    assert light.apply_chat_template(CHATS[:2], tokenize=False) == hf.apply_chat_template(CHATS[:2], tokenize=False)
    bad = [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]
    import jinja2

    for tok in (light, hf):
        with pytest.raises(jinja2.TemplateError, match="tool messages are not supported"):
            tok.apply_chat_template(bad, chat_template=TEMPLATE, tokenize=False)
        with pytest.raises(ValueError, match="empty conversation"):
            tok.apply_chat_template([], tokenize=False)
    with pytest.raises(jinja2.exceptions.SecurityError):
        light.apply_chat_template(CHATS[0], chat_template="{% set ns = namespace(_x=1) %}", tokenize=False)


def test_hf_handles_the_rest(light, hf):
    """Arguments and attributes outside the light surface give HF's own answers."""
    chat = CHATS[1] + [{"role": "assistant", "content": "Partial ans"}]
    assert light.apply_chat_template(chat, continue_final_message=True, tokenize=False) == \
        hf.apply_chat_template(chat, continue_final_message=True, tokenize=False)
    assert light.num_special_tokens_to_add() == hf.num_special_tokens_to_add()
    assert light.encode("a b", return_tensors="pt").tolist() == hf.encode("a b", return_tensors="pt").tolist()
    with pytest.raises(AttributeError):
        light.no_such_attribute


def test_pickle_and_grammar(light):
    again = pickle.loads(pickle.dumps(light))
    assert again.encode("Hello world") == light.encode("Hello world") and again._hf is None
    from radixlm.runtime.constrained.grammar import GrammarCompilerPool

    pool = GrammarCompilerPool(light, light.vocab_size, (2,))  # xgrammar gets the HF twin
    try:
        assert pool.submit("regex", "[ab]{3}").result(timeout=60) is not None
    finally:
        pool.shutdown()


def _copy_dir(src, dst, edit=None):
    shutil.copytree(src, dst)
    if edit:
        path = os.path.join(dst, "tokenizer_config.json")
        with open(path) as f:
            cfg = json.load(f)
        edit(cfg)
        with open(path, "w") as f:
            json.dump(cfg, f)
    return str(dst)


@pytest.mark.parametrize("case", ["add_bos", "unknown_key", "special_not_added", "extra_file",
                                  "no_tokenizer_json", "slow_class"])
def test_refuses_what_it_cannot_reproduce(built, tmp_path, case):
    src = built[0].tokenizer_dir
    edits = {"add_bos": lambda c: c.update(add_bos_token=True),
             "unknown_key": lambda c: c.update(legacy=False),
             "special_not_added": lambda c: c.update(mask_token="<mask_not_in_vocab>"),
             "slow_class": lambda c: c.update(tokenizer_class="LlamaTokenizer")}
    d = _copy_dir(src, tmp_path / "tok", edits.get(case))
    if case == "extra_file":
        with open(os.path.join(d, "special_tokens_map.json"), "w") as f:
            json.dump({}, f)
    if case == "no_tokenizer_json":
        os.remove(os.path.join(d, "tokenizer.json"))
    assert LightTokenizer.from_dir(d) is None
    assert LightTokenizer.from_dir(_copy_dir(src, tmp_path / "ok")) is not None


def test_old_entry_gets_checked_once(built, hf):
    """An entry written before the check: HF's class this time, the verdict recorded for next."""
    c, _ = built
    path = os.path.join(c.tokenizer_dir, "MANIFEST.json")
    with open(path) as f:
        manifest = json.load(f)
    try:
        with open(path, "w") as f:
            json.dump({k: v for k, v in manifest.items() if k != "light"}, f)
        assert type(c.get_tokenizer()).__name__ == "TokenizersBackend"
        assert isinstance(c.get_tokenizer(), LightTokenizer)
        with open(path, "w") as f:
            json.dump(dict(manifest, light=False), f)  # a folder the check rejected
        assert type(c.get_tokenizer()).__name__ == "TokenizersBackend"
    finally:
        with open(path, "w") as f:
            json.dump(manifest, f)


def test_engine_startup_does_not_import_transformers(built):
    """A warm start, as a user's second start meets it: on the suite's cache (its weights, built
    once per run by whichever engine starts first; a fresh cache here would build them again),
    whose tokenizer entry must carry the light verdict."""
    root = cache.cache_root() or built[0].root  # the suite may run with the cache off
    suite = cache.GGUFCache(built[0].gguf_path, root=root)
    suite.get_tokenizer()  # built if absent; an entry older than the light check gets it now
    assert isinstance(suite.get_tokenizer(), LightTokenizer)
    code = ("import sys, radixlm\n"
            "e = radixlm.Engine()\n"
            "print(type(e.tokenizer).__name__)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
            "print(e.generate('The capital of France is', {'max_new_tokens': 4, 'temperature': 0})['text'])\n"
            "e.shutdown()\n")
    env = dict(os.environ, RADIXLM_CACHE_DIR=root)
    env.pop("RADIXLM_DISABLE_CACHE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "LightTokenizer" and lines[1] == "[]", out.stdout
    assert "Paris" in lines[2]
