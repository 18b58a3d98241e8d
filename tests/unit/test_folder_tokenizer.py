"""The light tokenizer for HF model folders (runtime/models/folder_tokenizer.py).

A folder's first load builds transformers' class and records whether the light one agrees with
it; later loads of the same tokenizer files build the light class, which must behave the same.
Anything that changes the tokenizer (a config key, a file, config.json) gets a key of its own,
so it is checked again, never trusted. Each test uses its own cache root (RADIXLM_CACHE_DIR).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from radixlm.runtime.models import folder_tokenizer, loader
from radixlm.runtime.tokenizer_light import LightTokenizer
from radixlm.runtime.tokenizer_light_check import mismatch

HF_CLASS = "TokenizersBackend"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🦙, 2+2?"}]


def _verdicts(root: str) -> dict[str, dict]:
    d = os.path.join(root, "tokenizer-verdicts")
    if not os.path.isdir(d):
        return {}
    out = {}
    for name in os.listdir(d):
        if name.endswith(".json"):
            with open(os.path.join(d, name)) as f:
                out[name[:-5]] = json.load(f)
    return out


@pytest.fixture(scope="module")
def checked(tiny_chat_path, tmp_path_factory):
    """(model folder, cache root, HF tokenizer of the first load, light one of the second)."""
    folder = shutil.copytree(tiny_chat_path, tmp_path_factory.mktemp("model") / "tiny")
    root = str(tmp_path_factory.mktemp("radixlm-cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXLM_CACHE_DIR", root)
        mp.delenv("RADIXLM_DISABLE_CACHE", raising=False)
        mp.delenv("RADIXLM_DISABLE_LIGHT_TOKENIZER", raising=False)
        hf = loader.load_tokenizer(str(folder))
        light = loader.load_tokenizer(str(folder))
    return str(folder), root, hf, light


@pytest.fixture
def cache_env(checked, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", checked[1])
    monkeypatch.delenv("RADIXLM_DISABLE_CACHE", raising=False)
    monkeypatch.delenv("RADIXLM_DISABLE_LIGHT_TOKENIZER", raising=False)
    return checked


def test_first_load_hf_then_light(checked):
    folder, root, hf, light = checked
    assert type(hf).__name__ == HF_CLASS
    assert _verdicts(root) == {folder_tokenizer.verdict_key(folder):
                               {"light": True, "folder": folder, "format": 1}}
    assert isinstance(light, LightTokenizer)
    assert light.name_or_path == hf.name_or_path == folder
    assert mismatch(light, hf) is None
    for text in ["Hello, world!", "<|im_start|>user\nhé 東京<|im_end|>", ""]:
        ids = hf.encode(text)
        assert light.encode(text) == ids
        assert light.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    for tokenize in (False, True):
        kw = dict(add_generation_prompt=True, tokenize=tokenize, return_dict=False)
        assert light.apply_chat_template(CHAT, **kw) == hf.apply_chat_template(CHAT, **kw)


def test_light_refuses_unknown_tokenizer_files_only(checked, tmp_path):
    folder = checked[0]
    # config.json and the weights are not tokenizer files of a model folder...
    assert LightTokenizer.from_dir(folder) is None
    assert LightTokenizer.from_dir(folder, model_folder=True) is not None
    # ...but a tokenizer file the light class does not read is refused, as in a saved folder
    for extra in ("special_tokens_map.json", "tokenizer.model", "vocab.json", "added_tokens.json"):
        d = shutil.copytree(folder, tmp_path / extra)
        (d / extra).write_text("{}")
        assert LightTokenizer.from_dir(str(d), model_folder=True) is None, extra
        assert folder_tokenizer.verdict_key(str(d)) != folder_tokenizer.verdict_key(folder)


def _edited_copy(folder, dst, name, edit):
    d = shutil.copytree(folder, dst)
    with open(d / name) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(d / name, "w") as f:
        json.dump(cfg, f)
    return str(d)


def test_changed_tokenizer_config_is_checked_again(cache_env, tmp_path):
    folder, root = cache_env[:2]
    d = _edited_copy(folder, tmp_path / "legacy", "tokenizer_config.json",
                     lambda c: c.update(legacy=False))  # a key the light class does not know
    key = folder_tokenizer.verdict_key(d)
    assert key not in _verdicts(root)
    assert type(loader.load_tokenizer(d)).__name__ == HF_CLASS
    assert _verdicts(root)[key]["light"] is False
    assert type(loader.load_tokenizer(d)).__name__ == HF_CLASS  # and stays HF's


def test_copy_shares_verdict_config_json_does_not(cache_env, tmp_path):
    folder = cache_env[0]
    copy = shutil.copytree(folder, tmp_path / "copy")
    assert isinstance(loader.load_tokenizer(str(copy)), LightTokenizer)  # same contents
    d = _edited_copy(folder, tmp_path / "cfg", "config.json", lambda c: c.update(model_type="t5"))
    assert folder_tokenizer.verdict_key(d) != folder_tokenizer.verdict_key(folder)


def test_tokenizer_only_folder(cache_env, tmp_path):
    """--tokenizer-path: a folder of tokenizer files alone goes the same way."""
    folder = cache_env[0]
    d = tmp_path / "tok"
    d.mkdir()
    for name in os.listdir(folder):
        if name not in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(folder, name), d / name)
    assert type(loader.load_tokenizer(str(d))).__name__ == HF_CLASS
    assert isinstance(loader.load_tokenizer(str(d)), LightTokenizer)


def test_switches_and_unwritable_cache(cache_env, tmp_path, monkeypatch):
    folder = cache_env[0]
    monkeypatch.setenv("RADIXLM_DISABLE_LIGHT_TOKENIZER", "1")
    assert type(loader.load_tokenizer(folder)).__name__ == HF_CLASS
    monkeypatch.delenv("RADIXLM_DISABLE_LIGHT_TOKENIZER")
    monkeypatch.setenv("RADIXLM_DISABLE_CACHE", "1")
    assert type(loader.load_tokenizer(folder)).__name__ == HF_CLASS
    monkeypatch.delenv("RADIXLM_DISABLE_CACHE")
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")  # the cache root is a file: nothing can be written under it
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(blocked))
    assert type(loader.load_tokenizer(folder)).__name__ == HF_CLASS


def test_engine_on_checked_folder_does_not_import_transformers(checked):
    folder, root = checked[:2]
    code = ("import sys, radixlm\n"
            f"e = radixlm.Engine(model_path={folder!r}, dtype='float32', device='cpu',"
            " max_total_tokens=4096, context_length=1024)\n"
            "print(type(e.tokenizer).__name__)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
            "print(repr(e.generate('Hello', {'max_new_tokens': 4, 'temperature': 0})['text']))\n"
            "e.shutdown()\n")
    env = dict(os.environ, RADIXLM_CACHE_DIR=root)
    env.pop("RADIXLM_DISABLE_CACHE", None)
    env.pop("RADIXLM_DISABLE_LIGHT_TOKENIZER", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "LightTokenizer" and lines[1] == "[]", out.stdout
