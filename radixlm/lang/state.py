"""ProgramState (the `s` of a @function) and ProgramStateGroup (what `s.fork(k)` returns).

A state wraps a StreamExecutor (duck-typed here: this module imports no executor, so the
interpreter can import it). Names and behaviour follow SGLang's `sglang.lang.interpreter`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from typing import Any, Optional

from radixlm.lang import ir, primitives

# the meta info fields a stream sends per chunk (the chunk's new tokens only)
INCREMENTAL_META_KEYS = ("output_token_logprobs", "output_top_logprobs",
                         "output_token_ids_logprobs")


def merge_stream_meta(pending: Optional[dict], meta: dict) -> dict:
    """Meta info of a chunk, with the logprob lists of earlier text-less chunks prepended when the
    server sends per-chunk lists (--incremental-streaming-output: a list shorter than the chunk's
    `completion_tokens`); a server's default cumulative lists already hold them."""
    if pending is None:
        return meta
    out = dict(meta)
    n = meta.get("completion_tokens")
    for key in INCREMENTAL_META_KEYS:
        if key not in meta and key not in pending:
            continue
        items = list(meta.get(key) or [])
        if key in meta and n is not None and len(items) >= n:  # cumulative
            out[key] = items
        else:
            out[key] = list(pending.get(key) or []) + items
    return out


class ProgramState:
    def __init__(self, executor):
        self.stream_executor = executor

    # --- building the stream ------------------------------------------------------------------
    def __iadd__(self, other):
        if other is None:
            raise ValueError("Tried to append None to state.")
        self.stream_executor.submit(ir.as_expr(other))
        return self

    def __add__(self, other):  # `s + "x"` is not an append: make the mistake loud
        raise TypeError("use `s += ...` to append to a program state")

    def gen(self, name: Optional[str] = None, **kwargs) -> ir.Gen:
        return primitives.gen(name, **kwargs)

    def select(self, name: Optional[str] = None, **kwargs) -> ir.Select:
        return primitives.select(name, **kwargs)

    def _role(self, role: str, expr):
        if expr is None:
            return self._role_scope(role)
        e = ir.RoleBegin(role) + expr + ir.RoleEnd(role)
        self += e
        return e

    @contextlib.contextmanager
    def _role_scope(self, role: str):
        self += ir.RoleBegin(role)
        yield
        self += ir.RoleEnd(role)

    def system(self, expr=None):
        return self._role("system", expr)

    def user(self, expr=None):
        return self._role("user", expr)

    def assistant(self, expr=None):
        return self._role("assistant", expr)

    @contextlib.contextmanager
    def var_scope(self, name: str):
        """`with s.var_scope("x"): s += ...` stores everything appended inside as variable x."""
        self.stream_executor.variable_events.setdefault(name, threading.Event())
        self += ir.VarScopeBegin(name)
        yield
        self += ir.VarScopeEnd(name)

    def fork(self, size: int = 1, position_ids_offset=None) -> "ProgramStateGroup":
        size = int(size)
        if size < 1:
            raise ValueError(f"fork: size must be >= 1 (got {size})")
        states = []
        for ex in self.stream_executor.fork(size):
            st = ProgramState(ex)
            weakref.finalize(st, ex.end)  # a branch nobody holds stops its worker
            states.append(st)
        return ProgramStateGroup(states, self)

    def copy(self, position_ids_offset=None) -> "CopiedState":
        """A copy of this state (a one-branch fork). As in SGLang it is also a context manager:
        `with s.copy() as c: ...` joins it (gathering its new variables) at the end."""
        group = self.fork(1)
        return CopiedState(group)

    # --- reading ------------------------------------------------------------------------------
    def __getitem__(self, name: str):
        return self.stream_executor.get_var(name)

    def __setitem__(self, name: str, value) -> None:
        self.stream_executor.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    def get_var(self, name: str):
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        self.stream_executor.get_var(name)
        return self.stream_executor.meta_info.get(name)

    def sync(self) -> "ProgramState":
        self.stream_executor.sync()
        return self

    def text(self) -> str:
        self.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict]:
        self.sync()
        return list(self.stream_executor.messages_)

    def error(self) -> Optional[BaseException]:
        self.stream_executor.wait_idle()
        return self.stream_executor.error_

    @property
    def variables(self) -> dict:
        self.sync()
        return self.stream_executor.variables

    def _chunks(self, var_name: Optional[str]):
        """(text, meta) as produced; meta is None for the whole-text stream."""
        ex = self.stream_executor
        q = ex.stream_queue(var_name)
        while True:
            item = q.get()
            if item is None:
                break
            yield item
        if ex.error_ is not None:
            raise ex.error_

    def text_iter(self, var_name: Optional[str] = None):
        """Yield text as it is produced: all of it, or one variable's (with `run(stream=True)`;
        without streaming, the whole text or the variable's value once)."""
        ex = self.stream_executor
        if not ex.stream:
            yield self.text() if var_name is None else self[var_name]
            return
        for piece, _ in self._chunks(var_name):
            if piece:
                yield piece

    async def text_async_iter(self, var_name: Optional[str] = None,
                              return_meta_data: bool = False):
        """text_iter for asyncio. With `return_meta_data=True` and a variable, yields
        `(text, meta_info)` pairs: the meta info of the chunk that produced the text, with the
        per-chunk logprobs of earlier text-less chunks prepended (SGLang's shape)."""
        ex = self.stream_executor
        if not ex.stream:
            yield self.text() if var_name is None else self[var_name]
            return
        it = self._chunks(var_name)
        loop = asyncio.get_running_loop()
        sentinel = object()
        pending = None
        while True:
            item = await loop.run_in_executor(None, next, it, sentinel)
            if item is sentinel:
                return
            piece, meta = item
            if var_name is None or not return_meta_data:
                if piece:
                    yield piece
            elif piece:
                yield piece, merge_stream_meta(pending, meta or {})
                pending = None
            elif meta is not None:
                pending = merge_stream_meta(pending, meta)

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    def __init__(self, states: list[ProgramState], src_state: Optional[ProgramState] = None):
        self.states = states
        self.src_state = src_state

    def __len__(self):
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value) -> None:
        """What `forks[i] += x` ends with: the branch itself comes back; nothing else may."""
        if value is not self.states[i]:
            raise TypeError("a fork group's branches cannot be replaced; append to them with "
                            "`forks[i] += ...`")

    def __iter__(self):
        return iter(self.states)

    def __iadd__(self, other):
        """An expression or text goes to every branch; a list or tuple gives branch i its item i;
        a callable is called with each branch's index and its result appended there."""
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"fork group: {len(other)} items for {len(self.states)} branches")
            for s, o in zip(self.states, other):
                s += o
        elif callable(other) and not isinstance(other, ir.Expr):
            for i, s in enumerate(self.states):
                s += other(i)
        else:
            for s in self.states:
                s += other
        return self

    def join(self, mode: str = "gather_variable"):
        """gather_variable: each variable the branches defined becomes a list in the source state
        (one item per branch that defined it). concate_and_append: the branches' new text is
        appended to the source state, in branch order."""
        if mode == "gather_variable":
            src = self.src_state.stream_executor
            before = set(src.variables)
            for s in self.states:
                s.sync()
                for k, v in s.stream_executor.variables.items():
                    if k not in before:
                        src.variables.setdefault(k, []).append(v)
            for k in set(src.variables) - before:
                src.variable_events.setdefault(k, threading.Event()).set()
        elif mode == "concate_and_append":
            texts = []
            for s in self.states:
                ex = s.stream_executor
                s.sync()
                texts.append(ex.text_[ex.fork_start_text_pos:])
            self.src_state += "".join(texts)
            self.src_state.sync()
        else:
            raise ValueError(f"join: unknown mode {mode!r} (gather_variable, concate_and_append)")
        for s in self.states:
            s.stream_executor.end()


class CopiedState(ProgramState):
    """`s.copy()`: a state of its own; `with s.copy() as c:` joins it back when the block ends."""

    def __init__(self, group: ProgramStateGroup):
        super().__init__(group.states[0].stream_executor)
        self._group = group

    def __enter__(self) -> "CopiedState":
        return self

    def __exit__(self, *exc) -> None:
        self._group.join()
