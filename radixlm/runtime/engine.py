"""The offline engine: the scheduler in a background thread of this process, no HTTP.

`Engine(model_path=..., **server_args).generate(prompt | input_ids, sampling_params, ...)` returns
SGLang-shaped dicts (`text`, `output_ids`, `meta_info`). Validation happens in the caller's thread,
before anything is queued; the scheduler thread only sees well-formed requests.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from typing import Any, AsyncIterator, Iterator, Optional, Union

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.distributed import tp_worker
from radixlm.runtime.engine_io import RequestBuilder, StreamText, build_result
from radixlm.runtime.gil_switch import lower_switch_interval
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.multimodal import image_processor_for
from radixlm.runtime.models import loader
from radixlm.runtime.request import Req
from radixlm.runtime.request_limits import RequestLimits
from radixlm.runtime.scheduler.scheduler import Scheduler
from radixlm.runtime.speculative import spec_config
from radixlm.server.loop_stats import freeze_startup_objects

logger = logging.getLogger(__name__)


class _Sink:
    """Where the scheduler thread reports progress of one request (thread-safe)."""

    def __init__(self, req: Req, loop: Optional[asyncio.AbstractEventLoop] = None):
        self.req = req
        self.loop = loop
        self.queue: Any = asyncio.Queue() if loop else queue.Queue()
        self.done = threading.Event()

    def notify(self, n_out: int, finished: bool) -> None:
        if self.loop:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (n_out, finished))
        else:
            self.queue.put((n_out, finished))
        if finished:
            self.done.set()


def _notify_all(updates: list) -> None:
    """A step's updates [(sink, n_out, finished)]: the asyncio consumers' in one callback per
    event loop. One call_soon_threadsafe per request and step (a write to the loop's wake-up
    socket each) cost the scheduler's thread ~20 us a token (an H200 run, 32 streams: ~1 s of
    its 23 s, cProfile 2026-11-28), and every callback woke the consumers' loop on its own."""
    by_loop: dict = {}
    for sink, n_out, finished in updates:
        if sink.loop is None:
            sink.notify(n_out, finished)
            continue
        by_loop.setdefault(sink.loop, []).append((sink.queue, (n_out, finished)))
        if finished:
            sink.done.set()
    for loop, puts in by_loop.items():
        loop.call_soon_threadsafe(_put_all, puts)


def _due(n_out: int, emitted: int, interval: int) -> bool:
    """A stream's next update: the first token at once (SGLang), then every `interval`."""
    return n_out > emitted and (emitted == 0 or n_out - emitted >= interval)


def _put_all(puts: list) -> None:
    for q, item in puts:
        q.put_nowait(item)


class Engine:
    def __init__(self, model_path: Optional[str] = None, **kwargs):
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        if self.server_args.dp_size != 1:
            raise ValueError("dp_size > 1 is served by `radixlm serve --dp-size N` (replicas behind "
                             "a router); an Engine is one replica")
        spec_config.resolve(self.server_args)  # refused flags fail before the model loads
        if self.server_args.disaggregation_mode not in (None, "null"):
            raise ValueError("disaggregation_mode: prefill/decode disaggregation runs between "
                             "servers (radixlm serve, radixlm router --pd-disaggregation)")
        logging.getLogger("radixlm").setLevel(self.server_args.log_level.upper())
        # the caller's threads share the GIL with the scheduler thread's torch ops (gil_switch)
        lower_switch_interval()
        # tp_size > 1: this process is rank 0; the other ranks run in worker processes
        self._tp = tp_worker.start_tp(self.server_args)
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._error: Optional[BaseException] = None
        self._stopped = False
        # The model is built on the scheduler thread, the one that runs it: OpenMP keeps a thread
        # team per thread that starts parallel regions, and a second team (the weights packed on
        # this thread, the steps on that one) left libgomp with more threads than cores, where it
        # stops spinning between regions. The same decode GEMMs took ~12% longer in a loop
        # (220 vs 196 us per call, SmolLM2 shapes, 2-core EPYC, 2026-11-26) and 280-340 us
        # inside the Engine's steps.
        built = threading.Event()
        init_error: list[BaseException] = []

        def run() -> None:
            try:
                self._build()
            except BaseException as e:
                init_error.append(e)
                return
            finally:
                built.set()
            self._loop()

        self._thread = threading.Thread(target=run, name="radixlm-scheduler", daemon=True)
        self._thread.start()
        built.wait()
        if init_error:
            if self._tp is not None:
                self._tp.stop(graceful=False)
            raise init_error[0]
        if self.server_args.enable_gc_freeze:  # as the server's scheduler process does
            freeze_startup_objects()

    def _build(self) -> None:
        """The model runner, tokenizer, request builder and scheduler (on the scheduler thread)."""
        self.runner = ModelRunner(self.server_args)
        self.tokenizer = None
        if not self.server_args.skip_tokenizer_init:
            tok_path = self.server_args.tokenizer_path or self.runner.model_path
            tok_format = "auto" if self.server_args.tokenizer_path else self.runner.load_format
            if tok_format == "dummy":
                tok_format = "auto"
            self.tokenizer = loader.load_tokenizer(tok_path, tok_format)
        eos = loader.eos_token_ids(self.runner.hf_config, self.tokenizer)
        images = image_processor_for(self.runner.model_path, self.runner.hf_config,
                                     self.runner.model_config.vocab_size)
        self.builder = RequestBuilder(self.tokenizer, self.runner.model_config.vocab_size,
                                      self.runner.context_len, self.runner.capacity, eos, images,
                                      RequestLimits.from_args(self.server_args, in_process=True))
        self.scheduler = Scheduler(self.server_args, self.runner, self.tokenizer)
        reader = getattr(self.scheduler.tree_cache, "reader", None)
        if reader is not None:  # a storage prefetch's lookup or read ended: wake the loop
            reader.notify = lambda: self._inbox.put(("wake", None))

    # --- scheduler thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        sched = self.scheduler
        while not self._stopped:
            try:
                self._drain_inbox(block=not sched.has_runnable_work(), idle=sched.is_idle(),
                                  copying=sched.waits_on_copies())
                if not sched.has_runnable_work():
                    continue
                updates = []
                for req in sched.step():
                    sink = self._sinks.get(req.rid)
                    if sink is not None:
                        updates.append((sink, len(req.output_ids), req.finished))
                        if req.finished:
                            self._sinks.pop(req.rid, None)
                _notify_all(updates)
            except BaseException as e:  # never leave callers waiting on a dead thread
                logger.exception("scheduler thread failed")
                self._error = e
                for sink in list(self._sinks.values()):
                    sink.notify(len(sink.req.output_ids), True)
                self._sinks.clear()
                return

    def _drain_inbox(self, block: bool, idle: bool = False, copying: bool = False) -> None:
        # Short timeout: a request waiting for its grammar must be re-checked soon. With no
        # request at all, only the inbox can bring work (a submit, a storage read's "wake", the
        # "wake" that shutdown sends), as in the server's scheduler loop, which blocks then: an
        # idle engine polling every 5 ms cost ~1% of a core each, and a test process keeps
        # dozens alive. The 1 s is only a backstop.
        try:
            if not block:
                item = self._inbox.get_nowait()
            else:
                # (copying: a preload's landing is polled every millisecond)
                item = self._inbox.get(timeout=1.0 if idle else 0.001 if copying else 0.005)
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":  # one call's requests, all added before the next step
                for sink in payload:
                    self._sinks[sink.req.rid] = sink
                    self.scheduler.add_request(sink.req)
            elif kind == "abort":
                req = self.scheduler.abort_request(payload)
                sink = self._sinks.pop(payload, None)
                if sink is not None and req is not None:
                    sink.notify(len(req.output_ids), True)
            elif kind == "call":
                fn, box = payload
                try:
                    box["result"] = fn()
                except BaseException as e:
                    box["error"] = e
                box["event"].set()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _call_in_loop(self, fn):
        """Run fn on the scheduler thread between steps (so it sees a consistent state)."""
        box: dict[str, Any] = {"event": threading.Event()}
        self._inbox.put(("call", (fn, box)))
        while not box["event"].wait(0.1):
            self._raise_if_dead()
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the scheduler thread failed: {self._error!r}") from self._error
        if self._stopped:
            raise RuntimeError("the engine is shut down")

    # --- public API -----------------------------------------------------------------------------
    def generate(self, prompt: Union[None, str, list[str]] = None,
                 sampling_params: Union[None, dict, list[dict]] = None,
                 input_ids: Union[None, list[int], list[list[int]]] = None,
                 return_logprob: Union[bool, list[bool]] = False,
                 logprob_start_len: Union[None, int, list[int]] = None,
                 top_logprobs_num: Union[None, int, list[int]] = None,
                 stream: bool = False, rid: Union[None, str, list[str]] = None, **kwargs):
        """One prompt -> a dict (or an iterator of dicts with `stream=True`); a batch -> a list."""
        reqs, single = self.builder.build(prompt, input_ids, sampling_params, return_logprob,
                                          logprob_start_len, top_logprobs_num, rid, kwargs)
        sinks = self._submit(reqs)
        if stream:
            if not single:
                raise ValueError("stream=True takes a single prompt")
            return self._stream(sinks[0])
        for sink in sinks:
            while not sink.done.wait(0.1):
                self._raise_if_dead()
        self._raise_if_dead()
        results = [build_result(s.req, self.tokenizer) for s in sinks]
        return results[0] if single else results

    def encode(self, prompt: Union[None, str, list[str]] = None,
               input_ids: Union[None, list[int], list[list[int]]] = None,
               pooling: str = "last") -> Union[dict, list[dict]]:
        """Embeddings (SGLang's Engine.encode): the final hidden state pooled over the prompt,
        "last" token or "mean", L2-normalized -> {"embedding": [...], "meta_info": {...}}."""
        if pooling not in ("last", "mean"):
            raise ValueError(f"pooling: must be last or mean (got {pooling!r})")
        reqs, single = self.builder.build(prompt, input_ids, {"max_new_tokens": 0}, False, None,
                                          None, None, {}, embed_pooling=pooling)
        sinks = self._submit(reqs)
        for sink in sinks:
            while not sink.done.wait(0.1):
                self._raise_if_dead()
        self._raise_if_dead()
        results = [{"embedding": s.req.embedding,
                    "meta_info": build_result(s.req, self.tokenizer)["meta_info"]} for s in sinks]
        return results[0] if single else results

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None,
                             return_logprob=False, logprob_start_len=None, top_logprobs_num=None,
                             stream: bool = False, rid=None, **kwargs):
        reqs, single = self.builder.build(prompt, input_ids, sampling_params, return_logprob,
                                          logprob_start_len, top_logprobs_num, rid, kwargs)
        loop = asyncio.get_running_loop()
        sinks = self._submit(reqs, loop)
        if stream:
            if not single:
                raise ValueError("stream=True takes a single prompt")
            return self._astream(sinks[0])
        for sink in sinks:
            while True:
                _, finished = await sink.queue.get()
                if finished:
                    break
        self._raise_if_dead()
        results = [build_result(s.req, self.tokenizer) for s in sinks]
        return results[0] if single else results

    def _submit(self, reqs: list[Req], loop=None) -> list[_Sink]:
        """One inbox item for the call's whole batch: the scheduler adds all of it before its
        next step, so a batch is scheduled the same way however fast the thread picks it up
        (one request at a time, a step could start on part of it: a GGUF layer's kernel, and so
        its roundings, depends on the step's row count)."""
        self._raise_if_dead()
        now = time.perf_counter()
        sinks = []
        for req in reqs:
            req.created_at = now
            sinks.append(_Sink(req, loop))
        self._inbox.put(("add", sinks))
        return sinks

    def _stream(self, sink: _Sink) -> Iterator[dict]:
        emitted, interval = 0, self._stream_interval(sink.req)
        text = StreamText(sink.req, self.tokenizer)
        while True:
            try:
                n_out, finished = sink.queue.get(timeout=0.1)
            except queue.Empty:
                self._raise_if_dead()
                continue
            if finished or _due(n_out, emitted, interval):
                emitted = n_out
                yield build_result(sink.req, self.tokenizer, upto=n_out, partial=not finished,
                                   stream_text=text)
            if finished:
                self._raise_if_dead()
                return

    def _stream_interval(self, req: Req) -> int:
        """Tokens between a stream's updates: the request's sampling_params.stream_interval,
        else the engine's, as the server's streams (tokenizer_manager)."""
        return max(1, req.sampling_params.stream_interval or self.server_args.stream_interval or 1)

    async def _astream(self, sink: _Sink) -> AsyncIterator[dict]:
        emitted, interval = 0, self._stream_interval(sink.req)
        text = StreamText(sink.req, self.tokenizer)
        while True:
            n_out, finished = await sink.queue.get()
            if finished or _due(n_out, emitted, interval):
                emitted = n_out
                yield build_result(sink.req, self.tokenizer, upto=n_out, partial=not finished,
                                   stream_text=text)
            if finished:
                self._raise_if_dead()
                return

    def abort_request(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def flush_cache(self, storage: bool = False) -> bool:
        """Drop the cached KV of the device and host tiers (and the store's with `storage`)."""
        return self._call_in_loop(lambda: self.scheduler.flush_cache(storage))

    def check_integrity(self) -> None:
        """Assert the KV accounting invariant (free + cached + in use == capacity)."""
        self._call_in_loop(self.scheduler.check_integrity)

    def wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._call_in_loop(self.scheduler.is_idle):
            if time.monotonic() > deadline:
                raise TimeoutError("engine did not become idle")
            time.sleep(0.01)

    def get_stats(self) -> dict:
        """Scheduler counters and KV use; with the hierarchical cache, `hicache` holds each tier's
        use, hits and bytes moved."""
        return self._call_in_loop(self.scheduler.stats_snapshot)

    def shutdown(self) -> None:
        """Stop the scheduler thread and release what the engine holds: the weights, the KV
        pool, the radix tree, the grammar compile thread. The object stays (its calls then raise
        "the engine is shut down"); the memory goes back, so engines created and shut down one
        after another in one process end where they started (tests/unit/test_engine_lifecycle.py).
        Calling it again does nothing."""
        if getattr(self, "_released", False):
            return
        self._stopped = True
        self._inbox.put(("wake", None))  # an idle loop waits on the inbox
        self._thread.join(timeout=10)
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None and scheduler.tiered:
            scheduler.tree_cache.close()  # queued pages reach the store before we go
        if scheduler is not None and scheduler.grammars is not None:
            scheduler.grammars.shutdown()
        graceful = not self._thread.is_alive()  # no forward can be in flight
        if graceful and getattr(self, "runner", None) is not None:
            # graphs go now, not whenever a later collection finds the runner's cycle: that
            # could be during another engine's capture, which it would invalidate
            self.runner.release_cuda_graphs()
        if self._tp is not None:  # the stop broadcast only when no forward can be in flight
            self._tp.stop(graceful=graceful)
        if not graceful:  # a step still runs on them: leave them to it
            return
        self._released = True
        for sink in list(self._sinks.values()):  # nobody waits on a request that cannot finish
            sink.notify(len(sink.req.output_ids), True)
        self._sinks.clear()
        self.scheduler = self.runner = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def new_rid() -> str:
    return uuid.uuid4().hex
