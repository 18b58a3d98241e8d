"""The tokenizer of a model folder (or a --tokenizer-path folder): the light class when checked.

Why: `AutoTokenizer.from_pretrained` costs ~3 CPU-s in every process that loads it (server main,
scheduler, detokenizer, Engine), mostly importing transformers. The light tokenizer
(tokenizer_light.py) reproduces the part radixlm uses, but only where it was seen to: a folder's
first load builds HF's class as before and runs tokenizer_light_check against it; the verdict
is stored in the radixlm cache (cache.py's root), and a later load on the same tokenizer builds
the light class only under a verdict `light: true`.

Layout under the cache root:

    tokenizer-verdicts/<key>.json   {"light": bool, "folder": <path it was checked on>, ...}
    tokenizer-verdicts/<key>.lock   held (never waited for) while one process records the verdict

The key is a sha256 over everything that decides what either class builds:
  - the contents of every tokenizer file of the folder (tokenizer_light.is_tokenizer_file: also
    the ones the light class refuses, so such a folder simply keeps a `false` verdict);
  - config.json (AutoTokenizer picks the class from its model_type when tokenizer_config has
    none, and may override a class it knows to be wrong on the hub);
  - the versions of transformers, tokenizers and jinja2, and the source of the light modules,
    so an upgrade or a code change is checked again instead of trusted.
Hashing reads the files (contents, not mtimes: a copy of a folder shares the verdict, an edit in
place never does): measured ~3 ms for SmolLM2's 3.5 MB tokenizer.json, ~17 ms per 17 MB (a
Llama-3-size tokenizer.json), plus ~17 ms once per process for the versions (importlib.metadata).
The check itself (~0.5 CPU-s) runs once per key, in a process that has paid for HF's class.

Off: `RADIXLM_DISABLE_LIGHT_TOKENIZER=1` (HF's class, no verdicts) or `RADIXLM_DISABLE_CACHE=1`
(no verdicts, so HF's class). An unwritable cache only logs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from typing import Optional

from radixlm.runtime import tokenizer_light, tokenizer_light_check
from radixlm.runtime.models.cache import _read_json, _write_json, cache_root

logger = logging.getLogger(__name__)

# Bump when the verdict files change meaning: old verdicts are then not found.
VERDICT_FORMAT = 1
_VERDICT_DIR = "tokenizer-verdicts"
# The modules whose code the verdict vouches for (the chat template renderer included).
_LIGHT_SOURCES = ("tokenizer_light.py", "tokenizer_light_check.py", "chat_render.py")

_code_digest: Optional[str] = None


def _versions_and_code() -> str:
    """The library versions and light-module sources a verdict depends on (once per process)."""
    global _code_digest
    if _code_digest is None:
        from importlib.metadata import PackageNotFoundError, version

        h = hashlib.sha256()
        for dist in ("transformers", "tokenizers", "jinja2"):
            try:
                h.update(f"{dist}={version(dist)}\n".encode())
            except PackageNotFoundError:
                h.update(f"{dist}=absent\n".encode())
        here = os.path.dirname(tokenizer_light.__file__)
        for name in _LIGHT_SOURCES:
            with open(os.path.join(here, name), "rb") as f:
                h.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
        _code_digest = h.hexdigest()
    return _code_digest


def verdict_key(folder: str) -> str:
    """sha256 of what decides both tokenizers of `folder` (see the module docstring)."""
    h = hashlib.sha256(f"v{VERDICT_FORMAT}\n{_versions_and_code()}\n".encode())
    names = sorted(n for n in os.listdir(folder)
                   if tokenizer_light.is_tokenizer_file(n) or n == "config.json")
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isdir(path):  # additional_chat_templates/: every file in it
            files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs)
        else:
            files = [path]
        for file in files:
            with open(file, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            h.update(f"{os.path.relpath(file, folder)}\0{digest}\n".encode())
    return h.hexdigest()


def _verdict_path(root: str, key: str) -> str:
    return os.path.join(root, _VERDICT_DIR, key + ".json")


def _hf_tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def load_folder_tokenizer(folder: str):
    """The tokenizer `AutoTokenizer.from_pretrained(folder)` builds, or the LightTokenizer of the
    folder where a recorded verdict says it stands in for that one."""
    root = cache_root() if tokenizer_light.light_enabled() else None
    if root is None:
        return _hf_tokenizer(folder)
    try:
        key = verdict_key(folder)
    except OSError as e:
        logger.warning("%s: cannot hash the tokenizer files (%s); loading transformers'", folder, e)
        return _hf_tokenizer(folder)
    verdict = _read_json(_verdict_path(root, key))
    light = verdict.get("light") if isinstance(verdict, dict) else None
    if light is True:
        tok = _light_tokenizer(folder, key)
        if tok is not None:
            return tok
    hf = _hf_tokenizer(folder)
    if light is None:
        _record_verdict(root, folder, key, hf)
    return hf


def _light_tokenizer(folder: str, key: str):
    try:
        tok = tokenizer_light.LightTokenizer.from_dir(folder, model_folder=True)
    except Exception as e:  # noqa: BLE001 -- a file that does not parse: HF's loader decides
        logger.warning("light tokenizer %s: %s", folder, e)
        return None
    # The files may have been replaced while they were read: use only what the verdict covers.
    if tok is None or verdict_key(folder) != key:
        return None
    return tok


def _record_verdict(root: str, folder: str, key: str, hf) -> None:
    """Check the light tokenizer of `folder` against `hf` (loaded from it) and store the verdict
    under `key`, unless another process is doing it now (never waited for) or has done it."""
    path = _verdict_path(root, key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path[:-len(".json")] + ".lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            if isinstance(_read_json(path), dict):
                return
            light = tokenizer_light_check.check_dir(folder, hf, model_folder=True)
            # A file edited during the check: the verdict would be for other contents.
            if verdict_key(folder) != key:
                return
            _write_json(path, {"light": light, "folder": folder, "format": VERDICT_FORMAT})
            logger.info("%s: tokenizer verdict light=%s recorded in %s", folder, light, path)
    except OSError as e:
        logger.warning("could not write the tokenizer verdict to the radixlm cache %s: %s", root, e)
