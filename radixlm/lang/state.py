"""ProgramState (the `s` of a @function) and ProgramStateGroup (what `s.fork(k)` returns)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Optional

from radixlm.lang import ir


class ProgramState:
    def __init__(self, executor):
        self.stream_executor = executor

    # --- building the stream ------------------------------------------------------------------
    def __iadd__(self, other):
        self.stream_executor.submit(ir.as_expr(other))
        return self

    def __add__(self, other):  # `s + "x"` is not an append: make the mistake loud
        raise TypeError("use `s += ...` to append to a program state")

    def gen(self, name: Optional[str] = None, **kwargs) -> ir.Gen:
        from radixlm.lang.api import gen
        return gen(name, **kwargs)

    def select(self, name: Optional[str] = None, **kwargs) -> ir.Select:
        from radixlm.lang.api import select
        return select(name, **kwargs)

    def _role(self, role: str, expr):
        if expr is None:
            return self._role_scope(role)
        self += ir.RoleBegin(role) + expr + ir.RoleEnd(role)

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
        self.stream_executor.variable_events.setdefault(name, __import__("threading").Event())
        self += ir.VarScopeBegin(name)
        yield
        self += ir.VarScopeEnd(name)

    def fork(self, size: int = 1, position_ids_offset=None) -> "ProgramStateGroup":
        if size < 1:
            raise ValueError(f"fork: size must be >= 1 (got {size})")
        return ProgramStateGroup([ProgramState(ex) for ex in self.stream_executor.fork(size)], self)

    def copy(self) -> "ProgramState":
        return self.fork(1)[0]

    # --- reading ------------------------------------------------------------------------------
    def __getitem__(self, name: str):
        return self.stream_executor.get_var(name)

    def __setitem__(self, name: str, value) -> None:
        self.stream_executor.set_var(name, value)

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
        self.stream_executor.queue.join()
        return self.stream_executor.error_

    @property
    def variables(self) -> dict:
        self.sync()
        return self.stream_executor.variables

    def text_iter(self, var_name: Optional[str] = None):
        """Yield text as it is produced: all of it, or one gen variable's (needs stream=True)."""
        ex = self.stream_executor
        if not ex.stream:
            yield self.text() if var_name is None else self[var_name]
            return
        q = ex.stream_queue(var_name)
        while True:
            piece = q.get()
            if piece is None:
                break
            yield piece
        if ex.error_ is not None:
            raise ex.error_

    async def text_async_iter(self, var_name: Optional[str] = None):
        it = self.text_iter(var_name)
        loop = asyncio.get_running_loop()
        sentinel = object()
        while True:
            piece = await loop.run_in_executor(None, next, it, sentinel)
            if piece is sentinel:
                return
            yield piece

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    def __init__(self, states: list[ProgramState], src_state: ProgramState):
        self.states = states
        self.src_state = src_state

    def __len__(self):
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __iter__(self):
        return iter(self.states)

    def __iadd__(self, other):
        """Text or an expression goes to every branch; a list gives branch i its item i; a
        callable is called with each branch's index and its result appended there."""
        if isinstance(other, list):
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
        if mode == "gather_variable":
            src_vars = self.src_state.stream_executor.variables
            before = set(src_vars)
            for s in self.states:
                s.sync()
                for k, v in s.stream_executor.variables.items():
                    if k not in before:
                        src_vars.setdefault(k, []).append(v)
            for k in set(src_vars) - before:
                self.src_state.stream_executor.variable_events.setdefault(
                    k, __import__("threading").Event()).set()
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
