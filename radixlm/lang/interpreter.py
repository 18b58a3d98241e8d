"""Executes a program's stream: each ProgramState owns a StreamExecutor whose worker thread runs the
appended expressions in order, so `s += ...` returns at once and `s["x"]` waits for `x`.

Text is the program's state: roles append the chat template's prefix/suffix and record messages;
gen/select call the backend with the text so far (the runtime's radix cache makes each call pay
only for its new suffix).
"""

from __future__ import annotations

import queue
import threading
import uuid
from typing import Any, Callable, Optional

from radixlm.lang import ir
from radixlm.lang.chat_template import ChatTemplate

_STOP = object()


class StreamExecutor:
    def __init__(self, backend, arguments: dict, default_params: ir.SamplingParams,
                 chat_template: Optional[ChatTemplate], stream: bool = False, use_thread: bool = True):
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.default_params = default_params
        self.chat_template = chat_template or backend.get_chat_template()
        self.stream = stream
        self.text_ = ""
        self.messages_: list[dict] = []
        self.variables: dict[str, Any] = {}
        self.variable_events: dict[str, threading.Event] = {}
        self.meta_info: dict[str, Any] = {}
        self.cur_role: Optional[str] = None
        self.cur_role_begin_pos = 0
        self.var_scopes: dict[str, int] = {}
        self.fork_start_text_pos = 0
        self.error_: Optional[BaseException] = None
        self.stream_var_queues: dict[Optional[str], queue.Queue] = {}
        if stream:
            self.stream_var_queues[None] = queue.Queue()  # all text, for text_iter()
        self.use_thread = use_thread
        self.queue: queue.Queue = queue.Queue()
        self.done = threading.Event()
        self.done.set()
        if use_thread:
            self.worker = threading.Thread(target=self._work, daemon=True, name=f"sgl-{self.sid[:6]}")
            self.worker.start()

    # --- submission -------------------------------------------------------------------------
    def submit(self, expr: ir.Expr) -> None:
        for e in ir.flatten(expr):
            for name in self._declared_names(e):
                self.variable_events.setdefault(name, threading.Event())
            if self.use_thread:
                self.done.clear()
                self.queue.put(e)
            else:
                self._execute(e)

    @staticmethod
    def _declared_names(e: ir.Expr) -> list[str]:
        if isinstance(e, (ir.Gen, ir.Select)) and e.name:
            return [e.name]
        if isinstance(e, ir.VarScopeEnd):
            return [e.name]
        return []

    def sync(self) -> None:
        if self.use_thread:
            self.queue.join()
        if self.error_ is not None:
            raise self.error_

    def end(self) -> None:
        if self.use_thread:
            self.queue.put(_STOP)

    def get_var(self, name: str) -> Any:
        if name in self.variables:
            return self.variables[name]
        event = self.variable_events.get(name)
        if event is None:
            raise KeyError(f"the program defines no variable {name!r}")
        while not event.wait(0.05):
            if self.error_ is not None:
                raise self.error_
        if self.error_ is not None and name not in self.variables:
            raise self.error_
        return self.variables[name]

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value
        self.variable_events.setdefault(name, threading.Event()).set()

    # --- the worker -----------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            e = self.queue.get()
            try:
                if e is _STOP:
                    self._close_streams()
                    return
                if self.error_ is None:  # after an error, drain without executing
                    self._execute(e)
            except BaseException as exc:  # surfaced by sync() / get_var() / text()
                self.error_ = exc
                for ev in self.variable_events.values():
                    ev.set()
                self._close_streams()
            finally:
                self.queue.task_done()

    def _execute(self, e: ir.Expr) -> None:
        if isinstance(e, ir.Text):
            self._append(e.value)
        elif isinstance(e, ir.Gen):
            self._gen(e)
        elif isinstance(e, ir.Select):
            decision = self.backend.select(self, e.choices, e.temperature, e.choices_method)
            self._append(decision.decision)
            if e.name:
                self.meta_info[e.name] = decision.meta_info
                self.set_var(e.name, decision.decision)
        elif isinstance(e, ir.RoleBegin):
            self._role_begin(e.role)
        elif isinstance(e, ir.RoleEnd):
            self._role_end(e.role)
        elif isinstance(e, ir.VarScopeBegin):
            self.var_scopes[e.name] = len(self.text_)
        elif isinstance(e, ir.VarScopeEnd):
            self.set_var(e.name, self.text_[self.var_scopes.pop(e.name):])
        elif isinstance(e, ir.CommitLazy):
            self.backend.commit_lazy_operations(self)
        elif isinstance(e, ir.GetForkVariable):
            self._append(str(e.state.get_var(e.name)))
        elif isinstance(e, ir.FuncCall):
            from radixlm.lang.state import ProgramState
            result = e.fn(ProgramState(self))
            if result is not None:
                for sub in ir.flatten(ir.as_expr(result)):
                    self._execute(sub)
        elif isinstance(e, ir.Image):
            raise NotImplementedError(f"image(): the {type(self.backend).__name__} backend and "
                                      "the bundled text-only model do not take images")
        else:
            raise TypeError(f"unknown expression {type(e).__name__}")

    def _append(self, text: str, var: Optional[str] = None) -> None:
        self.text_ += text
        if self.stream:
            for key in ({None, var} if var is not None else (None,)):
                q = self.stream_var_queues.get(key)
                if q is not None:
                    q.put(text)

    def _gen(self, e: ir.Gen) -> None:
        params = e.params.merged(self.default_params)
        if self.stream:
            pieces = []
            meta = None
            self._open_stream(e.name)
            for chunk, meta in self.backend.generate_stream(self, params):
                pieces.append(chunk)
                self._append(chunk, e.name)
            comp = "".join(pieces)
            self._end_stream(e.name)
        else:
            comp, meta = self.backend.generate(self, params)
            self._append(comp)
        if params.dtype is not None:
            comp = _cast(comp, params.dtype)
        if e.name:
            self.meta_info[e.name] = meta
            self.set_var(e.name, comp)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {role!r} begins inside role {self.cur_role!r}")
        prefix, _ = self.chat_template.prefix_and_suffix(role, self.messages_)
        self.cur_role = role
        self._append(prefix)
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"role {role!r} ends but the open role is {self.cur_role!r}")
        content = self.text_[self.cur_role_begin_pos:]
        _, suffix = self.chat_template.prefix_and_suffix(role, self.messages_)
        self._append(suffix)
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None

    # --- streaming --------------------------------------------------------------------------------
    def _open_stream(self, name: Optional[str]) -> None:
        if name is not None:
            self.stream_var_queues.setdefault(name, queue.Queue())

    def _end_stream(self, name: Optional[str]) -> None:
        if name is not None and name in self.stream_var_queues:
            self.stream_var_queues[name].put(None)

    def _close_streams(self) -> None:
        for q in self.stream_var_queues.values():
            q.put(None)

    def stream_queue(self, name: Optional[str]) -> queue.Queue:
        return self.stream_var_queues.setdefault(name, queue.Queue())

    # --- forking ---------------------------------------------------------------------------------
    def fork(self, k: int) -> list["StreamExecutor"]:
        """k copies sharing this state's text so far (committed to the backend first)."""
        self.submit(ir.CommitLazy())
        self.sync()
        forks = []
        for _ in range(k):
            ex = StreamExecutor(self.backend, self.arguments, self.default_params, self.chat_template,
                                self.stream, self.use_thread)
            ex.text_ = self.text_
            ex.messages_ = list(self.messages_)
            ex.variables = dict(self.variables)
            ex.cur_role, ex.cur_role_begin_pos = self.cur_role, self.cur_role_begin_pos
            ex.fork_start_text_pos = len(self.text_)
            forks.append(ex)
        return forks


def _cast(text: str, dtype):
    s = text.strip()
    if dtype in (int, "int"):
        return int(s)
    if dtype in (float, "float"):
        return float(s)
    if dtype in (bool, "bool"):
        return s == "True"
    return text


def run_program(program: Callable, backend, args: tuple, kwargs: dict,
                default_params: ir.SamplingParams, stream: bool, use_thread: bool = True):
    """Run a @function body on a fresh state; returns the ProgramState (still running if streaming)."""
    from radixlm.lang.state import ProgramState

    ex = StreamExecutor(backend, kwargs, default_params, None, stream=stream, use_thread=use_thread)
    state = ProgramState(ex)
    try:
        program(state, *args, **kwargs)
    except BaseException:
        ex.end()
        raise
    if not stream:
        ex.sync()
    ex.end()
    return state
