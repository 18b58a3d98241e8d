"""Executes a program's stream: each ProgramState owns a StreamExecutor whose worker thread runs the
appended expressions in order, so `s += ...` returns at once and `s["x"]` waits for `x`.

Text is the program's state: roles append the chat template's prefix/suffix and record messages;
gen/select call the backend with the text so far (the runtime's radix cache makes each call pay
only for its new suffix). Behaviour follows SGLang's interpreter: a gen also stops at the chat
template's stop strings; the first non-system turn of a template with a default system prompt
starts with that system turn (a message of its own); a message's content is its turn's text
without leading whitespace; a variable holds the generated text (also for `dtype=int`).

Streaming (`run(stream=True)`): the program body runs on a thread of its own and every appended
piece of text is queued for `text_iter()`; each gen/select/var_scope variable has a queue of
`(text, meta_info)` chunks for `text_iter(name)` / `text_async_iter(name, return_meta_data=True)`.
"""

from __future__ import annotations

import queue
import threading
import uuid
from typing import Any, Callable, Optional

from radixlm.lang import ir
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.global_config import global_config
from radixlm.lang.reasoning import split_reasoning
from radixlm.lang.state import INCREMENTAL_META_KEYS, ProgramState

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
        # sgl.image()s of the text so far, in order: each left the chat template's image token in
        # text_, and every call with text_ sends them along (backend.supports_images)
        self.images_: list = []
        self.variables: dict[str, Any] = {}
        self.variable_events: dict[str, threading.Event] = {}
        self.meta_info: dict[str, Any] = {}
        self.gen_spans: dict[str, tuple[int, int]] = {}  # variable -> its text's span in text_
        self.cur_role: Optional[str] = None
        self.cur_role_begin_pos = 0
        self.var_scopes: dict[str, int] = {}
        self.fork_start_text_pos = 0
        self.error_: Optional[BaseException] = None
        self.stream_var_queues: dict[Optional[str], queue.Queue] = {}
        self._queues_lock = threading.Lock()
        self.streams_closed = False
        if stream:
            self.stream_var_queues[None] = queue.Queue()  # all text, for text_iter()
        self.use_thread = use_thread
        self.ended = False
        self.body_thread: Optional[threading.Thread] = None  # a streamed program's body
        self.body_done = threading.Event()
        self.body_done.set()
        self.queue: queue.Queue = queue.Queue()
        if use_thread:
            self.worker = threading.Thread(target=self._work, daemon=True, name=f"sgl-{self.sid[:6]}")
            self.worker.start()

    # --- submission -------------------------------------------------------------------------
    def submit(self, expr: ir.Expr) -> None:
        for e in ir.flatten(expr):
            for name in self._declared_names(e):
                self.variable_events.setdefault(name, threading.Event())
                if self.stream:
                    self.stream_queue(name)
            if self.use_thread and not self.ended:
                self.queue.put(e)
            else:  # no worker (use_thread=False, or the program has ended): run it here
                self.wait_idle()  # after what the worker still has, in order
                self._run_one(e)

    @staticmethod
    def _declared_names(e: ir.Expr) -> list[str]:
        if isinstance(e, (ir.Gen, ir.Select)) and e.name:
            return [e.name]
        if isinstance(e, ir.VarScopeEnd):
            return [e.name]
        if isinstance(e, ir.SeparateReasoning):
            return [e.reasoning_name]
        return []

    def wait_idle(self) -> None:
        if self.use_thread:
            self.queue.join()

    def _wait_body(self) -> None:
        """Outside a streamed program's body: wait until the body has appended everything."""
        if self.body_thread is not None and threading.current_thread() is not self.body_thread:
            self.body_done.wait()

    def sync(self) -> None:
        self._wait_body()
        self.wait_idle()
        if self.error_ is not None:
            raise self.error_

    def end(self) -> None:
        """No more expressions will come: the worker finishes the queue, closes the streams and
        exits (expressions submitted later run in the submitting thread)."""
        if self.ended:
            return
        self.ended = True
        if self.use_thread:
            self.queue.put(_STOP)
        else:
            self._close_streams()

    def get_var(self, name: str) -> Any:
        if name in self.variables:
            return self.variables[name]
        event = self.variable_events.get(name)
        if event is None:
            self._wait_body()
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
                self._run_one(e)
            finally:
                self.queue.task_done()

    def _run_one(self, e: ir.Expr) -> None:
        if self.error_ is not None:  # after an error, drain without executing
            return
        try:
            self._execute(e)
        except BaseException as exc:  # surfaced by sync() / get_var() / text()
            self.error_ = exc
            for ev in self.variable_events.values():
                ev.set()
            self._close_streams()
            if not self.use_thread:
                raise

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
                self._set_streamed(e.name, decision.decision, decision.meta_info)
        elif isinstance(e, ir.RoleBegin):
            self._role_begin(e.role)
        elif isinstance(e, ir.RoleEnd):
            self._role_end(e.role)
        elif isinstance(e, ir.VarScopeBegin):
            self.var_scopes[e.name] = len(self.text_)
        elif isinstance(e, ir.VarScopeEnd):
            self._set_streamed(e.name, self.text_[self.var_scopes.pop(e.name):])
        elif isinstance(e, ir.CommitLazy):
            self.backend.commit_lazy_operations(self)
        elif isinstance(e, ir.GetForkVariable):
            self._append(str(e.state.get_var(e.name)))
        elif isinstance(e, ir.FuncCall):
            result = e.fn(ProgramState(self))
            if result is not None:
                for sub in ir.flatten(ir.as_expr(result)):
                    self._execute(sub)
        elif isinstance(e, ir.SeparateReasoning):
            self._separate_reasoning(e)
        elif isinstance(e, ir.Image):
            if not getattr(self.backend, "supports_images", False):
                raise NotImplementedError(
                    f"image(): the {type(self.backend).__name__} backend does not take images "
                    "(radixlm's RuntimeEndpoint / Engine backends do, serving a vision model)")
            self.images_.append(self.backend.image_payload(e.path))
            self._append(self.chat_template.image_token)
        elif isinstance(e, ir.Video):
            raise NotImplementedError(
                f"video(): the {type(self.backend).__name__} backend does not take video "
                "(radixlm's vision models take images only)")
        else:
            raise TypeError(f"unknown expression {type(e).__name__}")

    def _append(self, text: str) -> None:
        self.text_ += text
        if self.stream and text:
            self.stream_var_queues[None].put((text, None))

    def _set_streamed(self, name: str, value: Any, meta: Optional[dict] = None) -> None:
        """Set a variable that was not streamed piece by piece; its stream gets it whole."""
        self.set_var(name, value)
        if self.stream:
            q = self.stream_queue(name)
            q.put((str(value), meta))
            q.put(None)

    def _gen(self, e: ir.Gen) -> None:
        params = e.params.merged(self.default_params).with_stops(self.chat_template.stop_str)
        start = len(self.text_)
        if self.stream:
            pieces: list[str] = []
            meta: dict = {}
            q = self.stream_queue(e.name) if e.name else None
            for chunk, chunk_meta in self.backend.generate_stream(self, params):
                pieces.append(chunk)
                self._append(chunk)
                if chunk_meta is not None:
                    meta = accumulate_stream_meta(meta, chunk_meta)
                if q is not None:
                    q.put((chunk, chunk_meta))
            comp = "".join(pieces)
            if q is not None:
                q.put(None)
        else:
            comp, meta = self.backend.generate(self, params)
            self._append(comp)
        if e.name:
            self.meta_info[e.name] = meta
            self.gen_spans[e.name] = (start, len(self.text_))
            self.set_var(e.name, comp)

    def _separate_reasoning(self, e: ir.SeparateReasoning) -> None:
        if self.stream:  # as in SGLang: a streamed program keeps the text as generated
            self.set_var(e.reasoning_name, "")
            return
        reasoning, answer = split_reasoning(str(self.get_var(e.name)), e.model_type)
        self.set_var(e.name, answer)
        self.set_var(e.reasoning_name, reasoning)
        span = self.gen_spans.get(e.name)
        if span is not None and span[1] == len(self.text_):  # the gen's text is the latest
            self.text_ = self.text_[:span[0]] + answer
            self.gen_spans[e.name] = (span[0], len(self.text_))

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {role!r} begins inside role {self.cur_role!r}")
        default_system = self.chat_template.default_system_prompt
        if not self.messages_ and role != "system" and default_system:
            self._role_begin("system")
            self._append(default_system)
            self._role_end("system")
        prefix, _ = self.chat_template.prefix_and_suffix(role, self.messages_)
        self.cur_role = role
        self._append(prefix)
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"role {role!r} ends but the open role is {self.cur_role!r}")
        content = self.text_[self.cur_role_begin_pos:].lstrip()
        _, suffix = self.chat_template.prefix_and_suffix(role, self.messages_)
        self._append(suffix)
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None

    # --- streaming --------------------------------------------------------------------------------
    def _close_streams(self) -> None:
        with self._queues_lock:
            self.streams_closed = True
            queues = list(self.stream_var_queues.values())
        for q in queues:
            q.put(None)

    def stream_queue(self, name: Optional[str]) -> queue.Queue:
        with self._queues_lock:
            q = self.stream_var_queues.get(name)
            if q is None:
                q = self.stream_var_queues[name] = queue.Queue()
                if self.streams_closed:
                    q.put(None)
            return q

    # --- forking ---------------------------------------------------------------------------------
    def fork(self, k: int) -> list["StreamExecutor"]:
        """k copies sharing this state's text so far (committed to the backend first)."""
        if k > 1:
            self.submit(ir.CommitLazy())
        self.sync()
        forks = []
        for _ in range(k):
            ex = StreamExecutor(self.backend, self.arguments, self.default_params, self.chat_template,
                                self.stream, self.use_thread)
            ex.text_ = self.text_
            ex.messages_ = list(self.messages_)
            ex.images_ = list(self.images_)
            ex.variables = dict(self.variables)
            ex.cur_role, ex.cur_role_begin_pos = self.cur_role, self.cur_role_begin_pos
            ex.fork_start_text_pos = len(self.text_)
            forks.append(ex)
        return forks


def accumulate_stream_meta(total: dict, chunk: dict) -> dict:
    """The meta info of a streamed gen so far: the latest chunk's, with the output logprob lists
    accumulated when the server sends them per chunk (a chunk holding fewer entries than
    `completion_tokens`) and taken as they are when it sends them whole."""
    out = dict(chunk)
    n = chunk.get("completion_tokens")
    for key in INCREMENTAL_META_KEYS:
        if key not in chunk:
            if key in total:
                out[key] = total[key]
            continue
        items = list(chunk[key] or [])
        if n is not None and len(items) < n and key in total:
            out[key] = list(total[key]) + items
        else:
            out[key] = items
    return out


def run_program(program: Callable, backend, args: tuple, kwargs: dict,
                default_params: ir.SamplingParams, stream: bool, use_thread: bool = True):
    """Run a @function body on a fresh state. Not streaming: returns the finished state.
    Streaming: the body runs on a thread of its own and the state returns at once (read it with
    text_iter / text_async_iter; errors in the body surface there and in sync())."""
    ex = StreamExecutor(backend, kwargs, default_params, None, stream=stream, use_thread=use_thread)
    state = ProgramState(ex)

    def body():
        try:
            program(state, *args, **kwargs)
        finally:
            ex.end()

    if stream:
        def body_in_thread():
            try:
                body()
            except BaseException as exc:  # reported through the state
                if ex.error_ is None:
                    ex.error_ = exc
                ex._close_streams()
            finally:
                ex.body_done.set()
        ex.body_done.clear()
        ex.body_thread = threading.Thread(target=body_in_thread, daemon=True,
                                          name=f"sgl-body-{ex.sid[:6]}")
        ex.body_thread.start()
        return state
    body()
    ex.sync()
    if global_config.verbosity >= 2:
        print(ex.text_)
    return state
