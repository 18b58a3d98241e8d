"""Is the light tokenizer of a folder the same tokenizer as transformers' one? (tokenizer_light.py)

`from_dir` refuses the configurations it knows it does not reproduce; this check covers what it
could not foresee. It runs where the HF tokenizer exists anyway -- when the start-up cache builds
an entry from the GGUF (cache.py) -- and its verdict is stored next to the files, so a later
start trusts the light class only for a folder on which it was seen to agree with HF.

Compared: the serialized Rust tokenizer (normalizer, pre-tokenizer, model, added tokens, post-
processor, decoder: so transformers changed nothing in it), vocabulary and special tokens, then
behaviour on probes: encode with and without special tokens, decode with and without skipping
them, per-token conversion, and chat templates (system or not, multi-turn, generation prompt,
tools, a role order the template may reject: the same text or the same error).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

_TEXTS = [
    "Hello, world!", "  leading and trailing spaces  ", "tabs\tand\nnewlines\r\n\n\nend",
    "Unicode: héllo wörld, naïve café, 東京タワー, Привет, مرحبا, 🦙🚀👍🏽 e\u0301",
    "def f(x):\n    return x ** 2  # code\n", "numbers 1234567890 3.14159 1e-9",
    "<|im_start|>user\nhi<|im_end|>\n", "<s></s><unk><pad>[INST]", "", " ", "\u00a0\u200b\ufeff",
    "a" * 300, "The quick brown fox jumps over the lazy dog. " * 5,
]
_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
_CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3 <b>?</b>"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
     {"role": "user", "content": "émoji 🦙"}],
    [{"role": "assistant", "content": "first"}, {"role": "assistant", "content": "second"}],
]


def _outcome(fn: Callable[[], Any]) -> Any:
    """The value, or the error's type and text (both sides must fail the same way)."""
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 -- comparing whatever the template raises
        return ("error", type(e).__name__, str(e))


def _added(tok) -> dict:
    return {i: (t.content, t.special, t.normalized, t.lstrip, t.rstrip, t.single_word)
            for i, t in tok.added_tokens_decoder.items()}


def mismatch(light, hf) -> Optional[str]:
    """What differs between the two tokenizers, or None when the probes find nothing."""
    if light.backend_tokenizer.to_str() != hf.backend_tokenizer.to_str():
        return "the serialized Rust tokenizer"
    for attr in ("vocab_size", "all_special_ids", "all_special_tokens", "special_tokens_map",
                 "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id",
                 "cls_token_id", "mask_token_id", "chat_template", "model_max_length",
                 "clean_up_tokenization_spaces", "split_special_tokens", "padding_side"):
        if getattr(light, attr) != getattr(hf, attr):
            return attr
    if len(light) != len(hf) or light.get_vocab() != hf.get_vocab() or _added(light) != _added(hf):
        return "vocabulary / added tokens"
    specials = sorted(set(light.all_special_ids) | set(_added(light)))
    texts = _TEXTS + ["".join(t for t, *_ in _added(light).values())]
    for text in texts:
        for add in (True, False):
            ids = hf.encode(text, add_special_tokens=add)
            if light.encode(text, add_special_tokens=add) != ids:
                return f"encode({text!r}, add_special_tokens={add})"
            if light(text, add_special_tokens=add)["input_ids"] != ids:
                return f"__call__({text!r})"
            for skip in (False, True):
                for seq in (ids, specials + ids + specials[:1]):
                    if light.decode(seq, skip_special_tokens=skip) != hf.decode(seq, skip_special_tokens=skip):
                        return f"decode of {text!r}, skip_special_tokens={skip}"
            if light.convert_ids_to_tokens(ids) != hf.convert_ids_to_tokens(ids):
                return f"convert_ids_to_tokens of {text!r}"
            # one token at a time: the incremental detokenizer's small windows
            if [light.decode([i]) for i in ids[:64]] != [hf.decode([i]) for i in ids[:64]]:
                return f"per-token decode of {text!r}"
    if light.convert_ids_to_tokens(specials, skip_special_tokens=True) != \
            hf.convert_ids_to_tokens(specials, skip_special_tokens=True):
        return "convert_ids_to_tokens(skip_special_tokens=True)"
    if light.chat_template is None:
        return None
    for chat in _CHATS:
        for gen in (False, True):
            for kw in ({}, {"tools": _TOOLS}):
                def render(t):
                    return t.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen, **kw)

                if _outcome(lambda: render(light)) != _outcome(lambda: render(hf)):
                    return f"chat template ({len(chat)} messages, generation prompt {gen}, {kw})"
    return None


def check_dir(path: str, hf, model_folder: bool = False) -> bool:
    """Whether the light tokenizer of `path` (saved from `hf`, or the model folder `hf` was
    loaded from) stands in for `hf`."""
    from radixlm.runtime.tokenizer_light import LightTokenizer

    try:
        light = LightTokenizer.from_dir(path, model_folder=model_folder)
        why = "refused by LightTokenizer.from_dir" if light is None else mismatch(light, hf)
    except Exception as e:  # noqa: BLE001 -- any failure means: keep using transformers
        why = f"{type(e).__name__}: {e}"
    if why is not None:
        logger.info("tokenizer in %s: using transformers' class (the light one differs: %s)",
                    path, why)
    return why is None
