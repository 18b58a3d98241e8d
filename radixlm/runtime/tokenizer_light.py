"""A tokenizer over `tokenizers.Tokenizer` + tokenizer_config + chat template, without transformers.

Why: importing transformers costs ~1 s of every start-up (its lazy import structure and
dependency checks) and its `from_pretrained` another ~0.35 s, while the Rust tokenizer it wraps
loads in ~0.1 s. The engine, the server and the detokenizer only use a small part of the HF
tokenizer: encode / __call__, decode (incremental detokenization included), token <-> id
conversion, special tokens and their ids, the vocabulary, apply_chat_template. This class
implements that part the way transformers 5's `TokenizersBackend` does, on the same Rust object.

It is only built for what it reproduces exactly (`from_dir` refuses the rest, and cache.py
additionally checks it against the HF tokenizer once per cache entry, tokenizer_light_check.py):
a `tokenizer.json` with no truncation/padding, a config whose keys are all understood, special
tokens that already are plain special added tokens. Anything else loads HF's, as before.

Calls outside that surface (another argument, an attribute we do not define, xgrammar which
wants the HF object) go to the HF tokenizer, loaded on first use from the same folder: the same
result, paid for only by whoever needs it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any, Optional

logger = logging.getLogger(__name__)

SPECIAL_TOKENS_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                             "cls_token", "mask_token")
VERY_LARGE_INTEGER = int(1e30)  # transformers' model_max_length when the config has none
# The files a folder may hold (others, e.g. special_tokens_map.json or added_tokens.json, carry
# settings transformers would apply and we would not).
_FILES = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
_IGNORED_FILES = {"MANIFEST.json", ".lock"}
# In a model folder (config.json, weights, README, ... beside the tokenizer) the names that
# transformers may read for the tokenizer: anything starting like its tokenizer files, the
# slow tokenizers' vocabularies, the extra chat templates. Any of them outside _FILES is refused,
# as any file outside _FILES is in a saved tokenizer folder.
TOKENIZER_FILE_PREFIXES = ("tokenizer", "special_tokens", "added_tokens", "chat_template",
                           "additional_chat_templates", "vocab", "merges", "spiece",
                           "sentencepiece")
TOKENIZER_FILE_SUFFIXES = (".model", ".tiktoken", ".vocab", ".bpe")


def light_enabled() -> bool:
    """False under `RADIXLM_DISABLE_LIGHT_TOKENIZER=1`: every load then builds HF's class."""
    return os.environ.get("RADIXLM_DISABLE_LIGHT_TOKENIZER", "") in ("", "0")


def is_tokenizer_file(name: str) -> bool:
    """Whether transformers may read this file of a model folder when it loads the tokenizer."""
    low = name.lower()
    return low.startswith(TOKENIZER_FILE_PREFIXES) or low.endswith(TOKENIZER_FILE_SUFFIXES)
# tokenizer_config keys understood here; any other one means "let transformers load it".
_CONFIG_KEYS = {"backend", "tokenizer_class", "is_local", "local_files_only", "name_or_path",
                "model_max_length", "clean_up_tokenization_spaces", "split_special_tokens",
                "chat_template", "extra_special_tokens", "additional_special_tokens",
                "padding_side", "truncation_side", *SPECIAL_TOKENS_ATTRIBUTES}


def _plain_special(tok) -> bool:
    """An added token that transformers' `_post_init` re-adding as special changes nothing."""
    return (tok.special and not tok.normalized and not tok.lstrip and not tok.rstrip
            and not tok.single_word)


def _refusal(path: str, cfg: dict, backend) -> Optional[str]:
    """Why the light class cannot stand in for HF's on this folder (None: it can)."""
    if set(cfg) - _CONFIG_KEYS:
        return f"config keys {sorted(set(cfg) - _CONFIG_KEYS)}"
    if cfg.get("tokenizer_class", "TokenizersBackend") not in ("TokenizersBackend",
                                                              "PreTrainedTokenizerFast"):
        return f"tokenizer_class {cfg.get('tokenizer_class')}"
    if cfg.get("backend", "tokenizers") != "tokenizers" or cfg.get("split_special_tokens"):
        return "backend / split_special_tokens"
    if cfg.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        return "clean_up_tokenization_spaces on a non-BPE model"  # BPE: transformers skips it
    if backend.truncation is not None or backend.padding is not None:
        return "truncation / padding in tokenizer.json"
    if backend.post_processor is None:
        return "no post-processor (transformers would build one)"
    added = {t.content: t for t in backend.get_added_tokens_decoder().values()}
    extra = cfg.get("extra_special_tokens", cfg.get("additional_special_tokens")) or []
    if not isinstance(extra, list):
        return "extra_special_tokens is not a list"
    for value in [cfg.get(a) for a in SPECIAL_TOKENS_ATTRIBUTES] + extra:
        if value is None:
            continue
        if not isinstance(value, str):
            return f"special token {value!r} is not a plain string"
        if value not in added or not _plain_special(added[value]):
            return f"special token {value!r} is not a plain special added token"
    template = cfg.get("chat_template")
    if template is not None and not isinstance(template, (str, list)):
        return "chat_template of an unknown shape"
    return None


def tokenizer_from_dir(path: str):
    """transformers' tokenizer saved in `path` (what LightTokenizer stands in for)."""
    # The class transformers builds for GGUF tokenizers, imported directly: AutoTokenizer's
    # dispatch machinery costs more import time than the load itself.
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend.from_pretrained(path)


class LightTokenizer:
    is_fast = True
    # What HF's tokenizer returns from __call__ (its model_input_names default).
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, path: str, backend, cfg: dict, chat_template, model_folder: bool = False):
        self.path = path
        # a model folder's HF twin is whatever AutoTokenizer picks there (config.json's model_type
        # may choose the class); a saved folder's is TokenizersBackend, as cache.py built it
        self._model_folder = model_folder
        self.name_or_path = path
        self._tok = backend
        self._special = {a: cfg.get(a) for a in SPECIAL_TOKENS_ATTRIBUTES}
        self._extra = list(cfg.get("extra_special_tokens", cfg.get("additional_special_tokens"))
                           or [])
        mml = cfg.get("model_max_length")
        self.model_max_length = mml if mml is not None else VERY_LARGE_INTEGER
        self.clean_up_tokenization_spaces = cfg.get("clean_up_tokenization_spaces", False)
        self.split_special_tokens = False
        self.padding_side = cfg.get("padding_side", "right")
        self.truncation_side = cfg.get("truncation_side", "right")
        self.chat_template = chat_template
        self._hf = None
        self._hf_lock = threading.Lock()

    @classmethod
    def from_dir(cls, path: str, model_folder: bool = False) -> Optional["LightTokenizer"]:
        """The light tokenizer of a saved HF tokenizer folder, or None when it would not behave
        exactly like the HF one (the caller then loads HF's).

        `model_folder`: `path` is a model folder (config.json, weights, ...): only its tokenizer
        files (is_tokenizer_file) count, with the same refusals as a saved folder's files."""
        try:
            names = set(os.listdir(path)) - _IGNORED_FILES
            if model_folder:
                names = {n for n in names if is_tokenizer_file(n)}
            if not {"tokenizer.json", "tokenizer_config.json"} <= names or names - _FILES:
                logger.debug("%s: files %s: not a light tokenizer", path, sorted(names))
                return None
            with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(cfg, dict):
            return None
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        why = _refusal(path, cfg, backend)
        if why is not None:
            logger.debug("%s: %s: not a light tokenizer", path, why)
            return None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}], as transformers reads it
            template = {t["name"]: t["template"] for t in template}
        jinja = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja):  # the file wins over the config key, as in transformers
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        return cls(path, backend, cfg, template, model_folder)

    # --- the HF tokenizer, for whatever is not reproduced here ------------------------------------
    @property
    def hf(self):
        """transformers' tokenizer for the same folder, loaded on first use (xgrammar needs it)."""
        with self._hf_lock:
            if self._hf is None:
                logger.info("loading the transformers tokenizer from %s", self.path)
                if self._model_folder:
                    from transformers import AutoTokenizer

                    self._hf = AutoTokenizer.from_pretrained(self.path)
                else:
                    self._hf = tokenizer_from_dir(self.path)
                self._hf.name_or_path = self.name_or_path
            return self._hf

    def __getattr__(self, name: str):
        # Only reached for names this class does not define: HF has the answer (or raises the
        # same AttributeError). Private and dunder names never load it (pickle, copy probe them).
        if name.startswith("_") or name == "hf":  # "hf": its loader itself raised AttributeError
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_hf"], state["_hf_lock"] = None, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._hf_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"LightTokenizer(name_or_path={self.name_or_path!r}, vocab_size={len(self)})"

    def __bool__(self) -> bool:
        return True

    # --- vocabulary --------------------------------------------------------------------------------
    @property
    def backend_tokenizer(self):
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    vocab = property(get_vocab)

    @property
    def added_tokens_decoder(self) -> dict:
        return self._tok.get_added_tokens_decoder()

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {t.content: i for i, t in sorted(self.added_tokens_decoder.items())}

    def get_added_vocab(self) -> dict[str, int]:
        return self.added_tokens_encoder

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            i = self._tok.token_to_id(tokens)
            return i if i is not None else self.unk_token_id
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else ()
        return [self._tok.id_to_token(int(i)) for i in ids if int(i) not in skip]

    # --- special tokens (named + extra, as transformers 5 keeps them) -----------------------------
    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {a: v for a, v in self._special.items() if v is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        seen: dict[str, None] = {}
        for t in [v for v in self._special.values() if v is not None] + self._extra:
            seen.setdefault(t)
        return list(seen)

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    @property
    def extra_special_tokens(self) -> list[str]:
        return list(self._extra)

    @property
    def extra_special_tokens_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self._extra)

    add_bos_token = False  # refused by from_dir otherwise
    add_eos_token = False

    # --- encode ------------------------------------------------------------------------------------
    def encode(self, text, text_pair=None, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if not isinstance(text, str) or text_pair is not None or kwargs:
            return self.hf.encode(text, text_pair, add_special_tokens=add_special_tokens, **kwargs)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text=None, add_special_tokens: bool = True, **kwargs):
        """{"input_ids", "attention_mask"} for a string or a list of strings (HF's BatchEncoding
        holds the same keys; any other argument is handled by HF itself)."""
        if kwargs or not (isinstance(text, str) or (isinstance(text, list) and text and all(
                isinstance(t, str) for t in text))):
            return self.hf(text, add_special_tokens=add_special_tokens, **kwargs)
        encs = self._tok.encode_batch([text] if isinstance(text, str) else text,
                                      add_special_tokens=add_special_tokens)
        out = {"input_ids": [e.ids for e in encs], "attention_mask": [e.attention_mask for e in encs]}
        return {k: v[0] for k, v in out.items()} if isinstance(text, str) else out

    def tokenize(self, text: str, pair=None, add_special_tokens: bool = False, **kwargs) -> list[str]:
        if pair is not None or kwargs:
            return self.hf.tokenize(text, pair, add_special_tokens=add_special_tokens, **kwargs)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).tokens

    # --- decode ------------------------------------------------------------------------------------
    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs):
        """HF's decode: the Rust decoder, no clean-up (off, or skipped for BPE as transformers
        does). Other kwargs (spaces_between_special_tokens: slow tokenizers only) are ignored
        by HF's fast tokenizer too."""
        if kwargs.get("clean_up_tokenization_spaces"):
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if hasattr(token_ids, "tolist"):  # numpy / torch, as transformers' to_py_obj
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        elif isinstance(token_ids, dict):
            token_ids = token_ids["input_ids"]
        if isinstance(token_ids, (list, tuple)) and token_ids and isinstance(token_ids[0], (list, tuple)):
            return [self._tok.decode(list(s), skip_special_tokens=skip_special_tokens)
                    for s in token_ids]
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False, **kwargs) -> list[str]:
        out = self.decode(sequences, skip_special_tokens=skip_special_tokens, **kwargs)
        return [out] if isinstance(out, str) else out

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        dec = self._tok.decoder
        return dec.decode(tokens) if dec is not None else " ".join(tokens)

    # --- chat template -----------------------------------------------------------------------------
    def get_chat_template(self, chat_template: Optional[str] = None, tools=None) -> str:
        if isinstance(self.chat_template, dict):
            named = self.chat_template
            if chat_template is not None and chat_template in named:
                return named[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in named:
                    return named["tool_use"]
                if "default" in named:
                    return named["default"]
                raise ValueError("This model has multiple chat templates with no default specified! "
                                 "Please either pass a chat template or the name of the template you "
                                 "wish to use to the `chat_template` argument. Available template "
                                 f"names are {sorted(named.keys())}.")
        elif chat_template is None:
            if self.chat_template is None:
                raise ValueError("Cannot use chat template functions because tokenizer.chat_template "
                                 "is not set and no template argument was passed!")
            return self.chat_template
        return chat_template

    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template=None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = True, **kwargs):
        """transformers' apply_chat_template for the common case: messages (+ JSON-schema tools,
        documents, template variables) to text, or to ids with `tokenize`. Prefill
        (continue_final_message), assistant masks, padding/tensors and callable tools are left
        to transformers, as are templates with `{% generation %}` blocks."""
        from radixlm.runtime import chat_render

        hf_only = {"continue_final_message", "sanitize_control_tokens", "padding", "truncation",
                   "max_length", "return_tensors", "return_assistant_tokens_mask",
                   "tokenizer_kwargs"}
        template = self.get_chat_template(chat_template, tools)
        if (any(kwargs.get(k) for k in hf_only) or (tools and not all(isinstance(t, dict) for t in tools))
                or chat_render.GENERATION_TAG.search(template)):
            return self.hf.apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, tokenize=tokenize,
                return_dict=return_dict, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in hf_only}
        conversations, batched = chat_render.split_conversations(conversation)
        texts = chat_render.render(template, conversations, tools, documents, add_generation_prompt,
                                   **{**self.special_tokens_map, **kwargs})
        if not tokenize:
            return texts if batched else texts[0]
        out = self(texts if batched else texts[0], add_special_tokens=False)
        return out if return_dict else out["input_ids"]


def _named_token(attr: str):
    def token(self) -> Optional[str]:
        return self._special[attr]

    def token_id(self) -> Optional[int]:
        value = self._special[attr]
        return None if value is None else self.convert_tokens_to_ids(value)

    return property(token), property(token_id)


for _attr in SPECIAL_TOKENS_ATTRIBUTES:  # bos_token, bos_token_id, ... as HF's __getattr__ answers
    _tok_prop, _id_prop = _named_token(_attr)
    setattr(LightTokenizer, _attr, _tok_prop)
    setattr(LightTokenizer, _attr + "_id", _id_prop)
