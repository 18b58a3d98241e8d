"""Tools and tool traffic in the prompt.

Messages arrive in OpenAI's shape (the Anthropic route converts to it): assistant messages may
carry `tool_calls` ([{id, type, function: {name, arguments: JSON text}}]) and `tool` messages
carry a result for a `tool_call_id`.

- A chat template that renders tools itself (it mentions `tools`, as Qwen's, Llama 3.1's and
  Mistral's do) gets them as they are, with each call's arguments parsed into a dict (templates
  `tojson` them; a string would be encoded twice).
- Otherwise (SmolLM2's template, for one) radixlm renders them: the tool list and the expected
  call format go into the system message; earlier calls are written into the assistant's text in
  the model family's format; tool results become one `tool` turn of <tool_response> blocks
  (`results_role`: a template that refuses unknown roles is retried with "user", see
  openai_api.apply_chat_template_with_tools). SmolLM2 answers from a result far better in a
  turn of its own role than in a user turn, which it tends to echo.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from radixlm.server.tool_calls.grammar import Tool
from radixlm.server.tool_calls.parsers import ToolCallFormat


def _args_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _args_value(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def render_calls(fmt: ToolCallFormat, calls: list[tuple[str, str]]) -> str:
    """Calls (name, arguments JSON text) written the way the model family writes them."""
    objs = ["{" + f'"name": {json.dumps(name, ensure_ascii=False)}, "{fmt.args_key}": '
            + (args.strip() or "{}") + "}" for name, args in calls]
    if fmt.name == "hermes":
        return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs)
    if fmt.name == "llama3":
        return "; ".join(objs)
    return "[TOOL_CALLS] [" + ", ".join(objs) + "]"


def tool_instructions(fmt: ToolCallFormat, tools: list[Tool], forced_name: Optional[str] = None) -> str:
    """The system-prompt text that offers the tools (kept short: it precedes every turn)."""
    # compact: a small model's context (and the attention cost of every later token) is short
    listing = "\n".join(json.dumps(t.openai_dict()["function"], ensure_ascii=False,
                                   separators=(",", ":")) for t in tools)
    example = render_calls(fmt, [("<function name>", "<arguments as a JSON object>")])
    rule = (f"Call the function {forced_name!r} now." if forced_name is not None
            else "Call functions when they help; otherwise answer directly.")
    return (f"You can call these functions:\n<tools>\n{listing}\n</tools>\n{rule} "
            f"To call a function, reply with:\n{example}\n"
            "Results come back inside <tool_response></tool_response>.")


def _tool_result_text(msg: dict) -> str:
    return f"<tool_response>\n{msg.get('content') or ''}\n</tool_response>"


def prepare_messages(fmt: ToolCallFormat, template_has_tools: bool, messages: list[dict],
                     tools: Optional[list[Tool]], forced_name: Optional[str] = None,
                     results_role: str = "tool") -> tuple[list[dict], Optional[list[dict]]]:
    """(messages for the template, tools for the template). `tools` None: not offered."""
    template_tools = [t.openai_dict() for t in tools] if tools else None
    if template_has_tools:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [
                    {**c, "function": {**c["function"], "arguments": _args_value(c["function"]["arguments"])}}
                    for c in m["tool_calls"]]
            out.append(m)
        return out, template_tools

    out: list[dict] = []
    merging_results = False  # consecutive tool results go into one user turn
    for m in messages:
        if m["role"] == "tool":
            text = _tool_result_text(m)
            if merging_results:
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": results_role, "content": text})
            merging_results = True
            continue
        merging_results = False
        msg = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if m.get("tool_calls"):
            calls = [(c["function"]["name"], _args_text(c["function"]["arguments"]))
                     for c in m["tool_calls"]]
            text = msg.get("content") or ""
            msg["content"] = (text + "\n" if text else "") + render_calls(fmt, calls)
        out.append(msg)
    for m in out:
        if m.get("content") is None:
            m["content"] = ""
    if tools:
        note = tool_instructions(fmt, tools, forced_name)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + note).lstrip()}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out, template_tools
