"""The expressions a program appends (`s += ...`): gen, select, roles, image, video,
separate_reasoning. Names, arguments and defaults are SGLang's (`sglang.lang.api`)."""

from __future__ import annotations

import re
from typing import Any, Optional, Union

from radixlm.lang import ir
from radixlm.lang.reasoning import check_model_type


def gen(name: Optional[str] = None, max_tokens: Optional[int] = None,
        min_tokens: Optional[int] = None, n: Optional[int] = None,
        stop: Union[None, str, list[str]] = None, stop_token_ids: Optional[list[int]] = None,
        stop_regex: Union[None, str, list[str]] = None,
        temperature: Optional[float] = None, top_p: Optional[float] = None,
        top_k: Optional[int] = None, min_p: Optional[float] = None,
        frequency_penalty: Optional[float] = None, presence_penalty: Optional[float] = None,
        ignore_eos: Optional[bool] = None, return_logprob: Optional[bool] = None,
        logprob_start_len: Optional[int] = None, top_logprobs_num: Optional[int] = None,
        return_text_in_logprobs: Optional[bool] = None, dtype: Any = None,
        choices: Optional[list[str]] = None, choices_method=None,
        regex: Optional[str] = None, json_schema: Optional[str] = None) -> ir.Expr:
    """Generate text into variable `name`; `choices=[...]` makes it a select.

    The variable holds the generated text (also for `dtype=int` / `gen_int`, as in SGLang:
    convert it with `int(s["x"])`)."""
    if choices:
        return ir.Select(name, list(choices), 0.0 if temperature is None else temperature,
                         choices_method)
    if regex is not None:
        re.compile(regex)  # a bad pattern fails here, in the caller's frame (re.error)
    for pattern in ir.as_list(stop_regex):
        re.compile(pattern)
    if dtype is not None:
        ir.dtype_regex(dtype)  # validate now, in the caller's frame
    if json_schema is not None and (regex is not None or dtype is not None):
        raise ValueError("gen: json_schema cannot be combined with regex or dtype")
    params = ir.SamplingParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop,
        stop_token_ids=stop_token_ids, stop_regex=stop_regex, temperature=temperature,
        top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
        logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, json_schema=json_schema, regex=regex,
        dtype=dtype)
    return ir.Gen(name, params)


def gen_int(name: Optional[str] = None, **kwargs) -> ir.Expr:
    """An integer (regex-constrained); the variable holds its text."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: Optional[str] = None, **kwargs) -> ir.Expr:
    """A double-quoted string of word characters and spaces (regex-constrained)."""
    return gen(name, dtype=str, **kwargs)


def select(name: Optional[str] = None, choices: Optional[list[str]] = None,
           temperature: float = 0.0, choices_method=None) -> ir.Expr:
    if not choices:
        raise ValueError("select: choices must be a non-empty list of strings")
    return ir.Select(name, list(choices), temperature, choices_method)


def image(path: str) -> ir.Expr:
    return ir.Image(path)


def video(path: str, num_frames: int) -> ir.Expr:
    """A video clip (`num_frames` frames sampled from `path`). Executing it raises
    NotImplementedError naming the backend: no radixlm model takes images or video yet."""
    return ir.Video(path, num_frames)


def separate_reasoning(expr=None, model_type: Optional[str] = None) -> ir.Expr:
    """`s += sgl.assistant(sgl.separate_reasoning(sgl.gen("a"), model_type="deepseek-r1"))`: after
    the gen, `a` holds the answer and `a_reasoning_content` the reasoning, and the program's text
    keeps only the answer. Streamed programs keep the text as generated (as in SGLang)."""
    check_model_type(model_type)
    if expr is None:
        return ir.ExprList([])
    items = [expr]
    for e in ir.flatten(ir.as_expr(expr)):
        if isinstance(e, (ir.Gen, ir.Select)):
            if not e.name:
                raise ValueError("separate_reasoning: the gen/select needs a name")
            items.append(ir.SeparateReasoning(model_type, e.name))
    return ir.ExprList(items)


def _role(role: str, expr=None) -> ir.Expr:
    if expr is None:
        return ir.ExprList([ir.RoleBegin(role), ir.RoleEnd(role)])
    return ir.RoleBegin(role) + expr + ir.RoleEnd(role)


def system(expr=None):
    return _role("system", expr)


def user(expr=None):
    return _role("user", expr)


def assistant(expr=None):
    return _role("assistant", expr)


def system_begin():
    return ir.RoleBegin("system")


def system_end():
    return ir.RoleEnd("system")


def user_begin():
    return ir.RoleBegin("user")


def user_end():
    return ir.RoleEnd("user")


def assistant_begin():
    return ir.RoleBegin("assistant")


def assistant_end():
    return ir.RoleEnd("assistant")
