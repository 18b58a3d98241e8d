"""A request's routing key: the text (or token ids) the worker will prefill, as a str.

The key only has to preserve prefixes: two requests whose prompts share a prefix must get keys
sharing a prefix of about the same relative length. So:
  /generate, /encode          `text`, or `input_ids` as `tree.ids_key`; a batch by its first
                              prompt (the whole batch goes to one worker)
  /v1/completions             `prompt` (str, list of str, ids, list of ids) likewise
  /v1/chat/completions        a canonical text of the messages, the tools first (chat templates
                              put tool definitions in the system part): each message as
                              SEP role SEP content, so a conversation's next turn extends the key
                              of its previous turn, as its chat-templated prompt does
  /v1/messages (Anthropic)    `system`, then the messages, the same way
  /v1/responses               the tools, `instructions`, then `input` (a string as one user
                              message; items as chat messages, calls and outputs by their JSON)
  /v1/embeddings              `input`
Anything else has no key (None): the policy picks by load.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from radixlm.router.tree import ids_key

_SEP = "\x1e"  # ASCII record separator: never typed, so it cannot fake a message boundary
_PART = "\x1f"


def _is_ids(x: Any) -> bool:
    """A token-id prompt, by its first element (checking every id costs the router more than
    the key is worth; ids_key copes with a bad one)."""
    return isinstance(x, list) and bool(x) and isinstance(x[0], int)


def _prompt_key(p: Any) -> Optional[str]:
    """str | list[str] | list[int] | list[list[int]] -> the first prompt's key."""
    if isinstance(p, str):
        return p
    if _is_ids(p):
        return ids_key(p)
    if isinstance(p, list) and p:
        return _prompt_key(p[0])
    return None


def _content_text(c: Any) -> str:
    """A message's content (str, or a list of parts) as text; images by their URL's first 256
    characters (enough to tell images apart without keeping megabytes of base64)."""
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        out = []
        for part in c:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict):
                if isinstance(part.get("text"), str):
                    out.append(part["text"])
                elif part.get("type") in ("image_url", "image", "input_image"):
                    src = part.get("image_url") or part.get("source") or part
                    out.append("[image " + json.dumps(src, sort_keys=True)[:256] + "]")
                elif "content" in part:  # Anthropic tool_result blocks
                    out.append(_content_text(part["content"]))
                else:
                    out.append(json.dumps(part, sort_keys=True))
        return _PART.join(out)
    return json.dumps(c, sort_keys=True)


def _messages_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        text = _content_text(m.get("content"))
        if m.get("tool_calls"):
            text += _PART + json.dumps(m["tool_calls"], sort_keys=True)
        out.append(_SEP + str(m.get("role", "")) + _SEP + text)
    return "".join(out)


def _items_text(items: Any) -> str:
    """Responses API input items: messages as in chat; function calls and their outputs by
    their type and JSON, so a call's round trip extends the key of the turn that made it."""
    if not isinstance(items, list):
        return ""
    out = []
    for it in items:
        if not isinstance(it, dict):
            continue
        if it.get("type", "message") == "message":
            out.append(_messages_text([it]))
        else:
            rest = {k: v for k, v in it.items() if k not in ("id", "status")}
            out.append(_SEP + str(it.get("type")) + _SEP + json.dumps(rest, sort_keys=True))
    return "".join(out)


def routing_key(path: str, body: Any) -> Optional[str]:
    """The key of a request to `path` with JSON `body`; None when it has no prompt."""
    if not isinstance(body, dict):
        return None
    path = path.rstrip("/")
    if path in ("/generate", "/encode", "/v1/encode"):
        key = _prompt_key(body.get("text"))
        return key if key is not None else _prompt_key(body.get("input_ids"))
    if path == "/v1/completions":
        return _prompt_key(body.get("prompt"))
    if path == "/v1/chat/completions":
        tools = json.dumps(body["tools"], sort_keys=True) if body.get("tools") else ""
        return (tools + _messages_text(body.get("messages"))) or None
    if path == "/v1/messages":
        tools = json.dumps(body["tools"], sort_keys=True) if body.get("tools") else ""
        system = _SEP + "system" + _SEP + _content_text(body.get("system"))
        return tools + system + _messages_text(body.get("messages"))
    if path == "/v1/responses":
        inp = body.get("input")
        text = _SEP + "user" + _SEP + inp if isinstance(inp, str) else _items_text(inp)
        tools = json.dumps(body["tools"], sort_keys=True) if body.get("tools") else ""
        return tools + _SEP + "system" + _SEP + _content_text(body.get("instructions")) + text
    if path == "/v1/embeddings":
        return _prompt_key(body.get("input"))
    return None


def key_units(key: Optional[str]) -> int:
    """The minimum_tokens load of a request: its key's length (characters or ids)."""
    return len(key) if key else 0
