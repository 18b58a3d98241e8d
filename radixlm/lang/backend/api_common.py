"""What the API backends (OpenAI, Anthropic, LiteLLM) share: sampling parameters in API terms,
API keys, the native-server probe, and how a program becomes chat messages.

How a program becomes chat messages (`chat_messages`)
    - Each finished role turn is one message (`system`, `user`, `assistant`).
    - Text appended outside any role (before the first role or between turns) is sent as a `user`
      message of its own at its position; whitespace-only text outside roles is dropped.
    - `gen`/`select` must run inside an assistant turn, except in a program that uses no roles at
      all: its whole text is sent as one user message.
    - Text before a `gen` inside the same assistant turn is returned as the partial assistant
      message (a "prefill"); each backend decides whether it can send one.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

from radixlm.lang.ir import SamplingParams, as_list

_COMPLETION_MODEL = re.compile(r"turbo-instruct|davinci|babbage|curie|(^|[-/:])ada($|[-:])")

# our field -> OpenAI's name, for the parameters every OpenAI server knows
STANDARD_PARAMS = (("temperature", "temperature"), ("top_p", "top_p"),
             ("frequency_penalty", "frequency_penalty"), ("presence_penalty", "presence_penalty"))
# our field -> SGLang's extra_body name
EXTRA_PARAMS = (("top_k", "top_k"), ("min_p", "min_p"), ("min_new_tokens", "min_tokens"),
           ("ignore_eos", "ignore_eos"), ("stop_token_ids", "stop_token_ids"),
           ("stop_regex", "stop_regex"), ("regex", "regex"), ("json_schema", "json_schema"))
# with no prefix to condition on, a choice is scored after this text
UNCONDITIONAL_PREFIX = "\n"


def is_completion_model_name(model_name: str) -> bool:
    return bool(_COMPLETION_MODEL.search((model_name or "").lower()))


def resolve_api_key(api_key: Optional[str], env_var: str, base_url: Optional[str]) -> Optional[str]:
    if api_key is not None:
        return api_key
    if os.environ.get(env_var):
        return os.environ[env_var]
    return "EMPTY" if base_url else None


def probe_native_server(base_url: Optional[str], timeout: float = 5.0) -> Optional[dict]:
    """radixlm's / SGLang's `/get_model_info` next to an OpenAI-style base URL, or None."""
    if not base_url:
        return None
    import httpx

    root = str(base_url).rstrip("/")
    if root.endswith("/v1"):
        root = root[:-3]
    try:
        r = httpx.get(root + "/get_model_info", timeout=timeout)
        if r.status_code == 200:
            info = r.json()
            if isinstance(info, dict) and "model_path" in info:
                return info
    except (httpx.HTTPError, ValueError):
        pass
    return None


def sampling_extras(params: SamplingParams) -> dict[str, Any]:
    """SGLang's extra sampling fields that are set (differ from the defaults), by our field name."""
    d = params.resolved()
    out = {}
    for ours, _ in EXTRA_PARAMS:
        v = d[ours]
        if ours in ("stop_token_ids", "stop_regex"):
            if v:
                out[ours] = as_list(v)
        elif v is not None and v is not False and v != SamplingParams.DEFAULTS.get(ours, None):
            out[ours] = v
    return out


def stop_list(params: SamplingParams) -> list[str]:
    return as_list(params.resolved()["stop"])


def extra_name(field: str, params: SamplingParams) -> str:
    """How to name a sampling field in an error: `regex` that came from dtype says so."""
    if field == "regex" and params.regex is None and params.dtype is not None:
        dtype = params.dtype.__name__ if isinstance(params.dtype, type) else params.dtype
        return f"gen(dtype={dtype}) (gen_int/gen_string; a regex constraint)"
    return {"min_new_tokens": "min_tokens"}.get(field, field)


# --- programs as chat messages (used by the Anthropic backend too) ------------------------------

def chat_messages(s, backend) -> tuple[list[dict], str]:
    """(messages, partial assistant text) of the program state `s` for a gen/select now.

    See the module docstring for the rules. Raises ValueError when the gen is not in an assistant
    turn of a program that uses roles.
    """
    name = type(backend).__name__
    text, msgs = s.text_, list(s.messages_)
    if s.cur_role is None:
        if msgs:
            raise ValueError(
                f"the {name} backend (a chat model) needs gen/select inside an assistant turn: "
                "`s += sgl.assistant(sgl.gen(...))` or `with s.assistant(): ...`")
        if not text.strip():
            raise ValueError(f"the {name} backend: nothing to send (the program's text is empty)")
        return [{"role": "user", "content": text}], ""
    if s.cur_role != "assistant":
        raise ValueError(f"the {name} backend (a chat model) generates assistant turns only; "
                         f"this gen/select is inside a {s.cur_role!r} turn")
    end = s.cur_role_begin_pos
    partial = text[end:]
    out: list[dict] = []
    pos = 0
    for m in msgs:  # recover text outside roles: it lies between the messages' contents
        at = text.find(m["content"], pos, end) if m["content"] else pos
        if at < 0:  # not a markup-free template: the messages alone
            return [dict(m) for m in msgs], partial
        if text[pos:at].strip():
            out.append({"role": "user", "content": text[pos:at]})
        out.append({"role": m["role"], "content": m["content"]})
        pos = at + len(m["content"])
    if text[pos:end].strip():
        out.append({"role": "user", "content": text[pos:end]})
    return out, partial


def finish_meta(reason: Optional[str], matched: Any = None) -> Optional[dict]:
    """A native-style `finish_reason` dict from an API's finish reason."""
    if reason is None:
        return None
    if reason in ("length", "max_tokens"):
        return {"type": "length"}
    return {"type": "stop", "matched": matched}


def regex_literal(s: str) -> str:
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}" else c for c in s)
