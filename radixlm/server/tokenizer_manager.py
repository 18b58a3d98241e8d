"""TokenizerManager: the main process's side of the runtime (asyncio).

It validates and tokenizes requests (the same RequestBuilder as the offline Engine, so bad input
fails identically, before queueing), sends them to the scheduler process, collects text updates
from the detokenizer process and hands them to the waiting HTTP handlers. One `ReqState` per
in-flight request; a handler whose client disconnects aborts its request (its KV is freed).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import time
import uuid
from typing import Any, AsyncIterator, Optional

import zmq
import zmq.asyncio

from radixlm.runtime.engine_io import RequestBuilder, spec_meta, token_text_fn
from radixlm.runtime.multimodal import image_processor_for
from radixlm.runtime.request_limits import RequestLimits
from radixlm.server.errors import QueueFullError, RuntimeGoneError, server_abort
from radixlm.server.io_struct import (AbortReq, BatchTextOut, ControlReply, ControlReq,
                                      GenerateReqInput, TokenizedGenerateReq)
from radixlm.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

CHATML_FALLBACK = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DISCONNECT_POLL_S = 1.0


class ReqState:
    def __init__(self, obj: GenerateReqInput, prompt_len: int):
        self.obj = obj
        self.prompt_len = prompt_len
        self.text = ""
        self.output_ids: list[int] = []
        self.finish: Optional[dict] = None
        self.cached_tokens = 0
        self.cached_tokens_details: Optional[dict] = None
        self.out_lp: list = []
        self.out_top: list = []
        self.in_lp: Optional[list] = None
        self.in_top: Optional[list] = None
        self.out_tid: list = []  # token_ids_logprob entries
        self.in_tid: Optional[list] = None
        self.embedding: Optional[list] = None
        self.retractions = 0
        self.spec: tuple = (None, 0)  # speculative decoding: (verify steps, their tokens)
        self.event = asyncio.Event()
        self.created = time.perf_counter()
        self.last_token_time: Optional[float] = None


class TokenizerManager:
    def __init__(self, args, tokenizer, info: dict[str, Any], ipc: dict[str, str]):
        self.server_args = args
        self.tokenizer = tokenizer
        self.info = info
        self.context_len = info["context_len"]
        self.model_path = info["model_path"]
        self.model_name = args.served_model_name or os.path.basename(self.model_path.rstrip("/"))
        self.weight_version = "default"  # set by /update_weights_from_disk (weight_version)
        self.builder = RequestBuilder(tokenizer, info["vocab_size"], self.context_len,
                                      info["max_total_tokens"], tuple(info["eos_token_ids"]),
                                      image_processor_for(self.model_path, info["hf_config"],
                                                          info["vocab_size"]),
                                      RequestLimits.from_args(args))
        self.chat_template = _load_chat_template(args.chat_template, tokenizer)
        ctx = zmq.asyncio.Context(1)
        self.to_scheduler = ctx.socket(zmq.PUSH)
        self.to_scheduler.connect(ipc["scheduler_in"])
        self.recv = ctx.socket(zmq.PULL)
        self.recv.bind(ipc["tokenizer_in"])
        self.states: dict[str, ReqState] = {}
        self.detokenizer_failures = 0  # requests the detokenizer failed (added to request_failures)
        self.control_waiters: dict[int, asyncio.Future] = {}
        self.control_ids = itertools.count()
        self.metrics = ServerMetrics(self.model_name, getattr(args, "metrics_names", "sglang")) \
            if args.enable_metrics else None
        self._loop_task: Optional[asyncio.Task] = None
        # why the runtime can no longer serve (a child died, the server stops); None while it can
        self.gone: Optional[str] = None
        self._resumed: Optional[asyncio.Event] = None  # cleared while weights are swapped
        self.request_log = _request_logger() if getattr(args, "log_requests", False) else None

    @property
    def resumed(self) -> asyncio.Event:
        if self._resumed is None:  # created on first use, inside the server's event loop
            self._resumed = asyncio.Event()
            self._resumed.set()
        return self._resumed

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._handle_loop())

    # --- inbound from the detokenizer / scheduler ------------------------------------------------
    async def _handle_loop(self) -> None:
        while True:
            msg = pickle.loads(await self.recv.recv())
            if isinstance(msg, BatchTextOut):
                now = time.perf_counter()
                for tu in msg.updates:
                    state = self.states.get(tu.rid)
                    if state is not None:
                        self._apply(state, tu, now)
                    if tu.failed:  # the detokenizer failed it: its KV goes back now
                        self.detokenizer_failures += 1
                        await self.abort_request(tu.rid)
            elif isinstance(msg, ControlReply):
                fut = self.control_waiters.pop(msg.req_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def _apply(self, state: ReqState, tu, now: float) -> None:
        up = tu.update
        state.text += tu.text_delta
        if up.rollback_to is not None:  # jump-forward replaced ids from here on
            del state.output_ids[up.rollback_to:]
            del state.out_lp[up.rollback_to:]
            del state.out_top[up.rollback_to:]
            del state.out_tid[up.rollback_to:]
        state.output_ids.extend(up.new_ids)
        state.retractions = up.retractions
        state.spec = (up.spec_verify_steps, up.spec_verify_tokens)
        state.cached_tokens = up.cached_tokens
        state.cached_tokens_details = up.cached_tokens_details
        if up.output_token_logprobs:
            state.out_lp.extend(up.output_token_logprobs)
        if up.output_top_logprobs:
            state.out_top.extend(up.output_top_logprobs)
        if up.output_token_ids_logprobs:
            state.out_tid.extend(up.output_token_ids_logprobs)
        if up.input_token_logprobs is not None:
            state.in_lp, state.in_top = up.input_token_logprobs, up.input_top_logprobs
            state.in_tid = up.input_token_ids_logprobs
        if up.embedding is not None:
            state.embedding = up.embedding
        measured = self.metrics is not None and state.obj.log_metrics
        if measured and up.new_ids:
            self.metrics.on_tokens(state, len(up.new_ids), now)
        state.last_token_time = now if up.new_ids else state.last_token_time
        if up.finish is not None:
            state.finish = up.finish
            if measured:
                self.metrics.on_finish(state, now)
        state.event.set()

    # --- requests ---------------------------------------------------------------------------------
    def tokenize_request(self, obj: GenerateReqInput) -> list[TokenizedGenerateReq]:
        """Validate and tokenize (ValueError naming the field). `n` > 1 expands to n requests."""
        extra = {"token_ids_logprob": obj.token_ids_logprob} if obj.token_ids_logprob else {}
        if obj.image_data is not None:
            extra["image_data"] = obj.image_data
        reqs, _ = self.builder.build(obj.text, obj.input_ids, obj.sampling_params,
                                     obj.return_logprob, obj.logprob_start_len,
                                     obj.top_logprobs_num, obj.rid or uuid.uuid4().hex, extra,
                                     embed_pooling=obj.embed_pooling)
        bootstrap = self._bootstrap(obj, len(reqs))
        return [TokenizedGenerateReq(r.rid, r.origin_input_ids, r.sampling_params, r.return_logprob,
                                     r.logprob_start_len, r.top_logprobs_num, obj.stream,
                                     r.token_ids_logprob, r.embed_pooling, r.mm, bootstrap)
                for r in reqs]

    def _bootstrap(self, obj: GenerateReqInput, n: int) -> Optional[tuple]:
        """(host, port, room) of a disaggregated request (the PD router's fields), else None."""
        if obj.bootstrap_room is None:
            return None
        mode = getattr(self.server_args, "disaggregation_mode", None)
        if mode is None:
            raise ValueError("bootstrap_room: this server runs colocated (no "
                             "--disaggregation-mode); send the request without bootstrap fields")
        room, port = obj.bootstrap_room, obj.bootstrap_port
        if not isinstance(room, int) or isinstance(room, bool) or room < 0:
            raise ValueError("bootstrap_room: a non-negative integer")
        if mode == "decode" and (not isinstance(obj.bootstrap_host, str)
                                 or not isinstance(port, int) or not 0 < port < 65536):
            raise ValueError("bootstrap_host / bootstrap_port: the prefill server's handshake "
                             "address (a host and a port) must come with bootstrap_room")
        if n != 1 or obj.embed_pooling or obj.image_data is not None:
            raise ValueError("bootstrap_room: a disaggregated request is one text generation "
                             "(n 1, no images, no embeddings)")
        return (obj.bootstrap_host, port, room)

    def _check_capacity(self, n: int) -> None:
        limit = self.server_args.max_queued_requests
        if limit is not None and len(self.states) + n > self.server_args.max_running_requests + limit:
            raise QueueFullError(f"the server has {len(self.states)} requests in flight; "
                                 f"the limit is max_running_requests + max_queued_requests")

    async def generate(self, obj: GenerateReqInput, request=None) -> AsyncIterator[dict]:
        """Yield SGLang-shaped dicts (cumulative text, ids and logprobs); non-stream: one final
        dict. A stream yields every `stream_interval` tokens (the request's, else the server's)."""
        await self.resumed.wait()  # a weight update is in progress: wait for it
        if self.gone is not None:  # nobody would ever answer it
            raise RuntimeGoneError(self.gone)
        tokenized = self.tokenize_request(obj)
        if len(tokenized) != 1:
            raise ValueError("sampling_params.n: use the batch form for n > 1 on /generate")
        treq = tokenized[0]
        if obj.rid is not None and obj.rid in self.states:
            raise ValueError(f"rid: {obj.rid!r} is already in flight")
        self._check_capacity(1)
        state = ReqState(obj, len(treq.input_ids))
        state.prompt_ids = treq.input_ids
        self.states[treq.rid] = state
        if self.metrics is not None and obj.log_metrics:
            self.metrics.on_request(len(treq.input_ids))
        if self.request_log is not None and not obj.no_logs:
            self.request_log.info("Receive: rid=%s prompt_tokens=%d text=%r sampling_params=%s",
                                  treq.rid, len(treq.input_ids), obj.text, obj.sampling_params)
        interval = max(1, treq.sampling_params.stream_interval
                       or getattr(self.server_args, "stream_interval", 1) or 1)
        sent_n = 0
        await self.to_scheduler.send(pickle.dumps(treq))
        try:
            # Updates arrive every step, so the client is checked on a clock, not only when
            # no update came for a while (a non-streaming request would never notice).
            next_check = time.monotonic() + DISCONNECT_POLL_S
            while True:
                try:
                    await asyncio.wait_for(state.event.wait(), DISCONNECT_POLL_S if request else None)
                except asyncio.TimeoutError:
                    pass
                if request is not None and time.monotonic() >= next_check:
                    next_check = time.monotonic() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        logger.info("client of %s disconnected; aborting", treq.rid)
                        return
                if not state.event.is_set():
                    continue
                state.event.clear()
                if state.finish is not None:
                    out = self.result(treq.rid, state)
                    if self.request_log is not None and not obj.no_logs:
                        self.request_log.info("Finish: rid=%s text=%r meta_info=%s", treq.rid,
                                              out["text"], _short_meta(out["meta_info"]))
                    yield out
                    return
                n_out = len(state.output_ids)  # the first token goes out at once (SGLang)
                if obj.stream and (n_out - sent_n >= interval or (sent_n == 0 and n_out)):
                    sent_n = len(state.output_ids)
                    yield self.result(treq.rid, state)
        finally:
            if state.finish is None:  # disconnect or cancellation: free the request's KV
                await self.abort_request(treq.rid)
            self.states.pop(treq.rid, None)

    def result(self, rid: str, state: ReqState) -> dict:
        """SGLang's result dict: meta_info keys in SGLang's order; logprob lists cumulative (the
        native stream slices them per chunk)."""
        obj = state.obj
        meta: dict[str, Any] = {
            "id": rid, "finish_reason": state.finish, "prompt_tokens": state.prompt_len,
            "weight_version": self.weight_version, "total_retractions": state.retractions,
        }
        if obj.return_logprob:
            # memoized per token id: an echo answer has a text per prompt token and per top-k
            # entry (~3k per 1.5k-token prompt), each a tokenizer.decode call unmemoized
            text = (token_text_fn(self.tokenizer) if obj.return_text_in_logprobs
                    and self.tokenizer is not None else (lambda t: None))
            triple = lambda pair: (pair[0], pair[1], text(pair[1]))  # logprob None: first token
            tops = lambda lst: [None if not e else [(v, t, text(t)) for v, t in e] for e in lst]
            meta["input_token_logprobs"] = [triple(p) for p in (state.in_lp or [])]
            meta["output_token_logprobs"] = [triple(p) for p in state.out_lp]
            meta["output_token_logprobs_length"] = len(state.out_lp)
            if obj.top_logprobs_num:
                meta["input_top_logprobs"] = tops(state.in_top or [])
                meta["output_top_logprobs"] = tops(state.out_top)
            if obj.token_ids_logprob:
                meta["input_token_ids_logprobs"] = tops(state.in_tid or [])
                meta["output_token_ids_logprobs"] = tops(state.out_tid)
        meta.update(reasoning_tokens=0, completion_tokens=len(state.output_ids),
                    cached_tokens=state.cached_tokens, **spec_meta(*state.spec))
        if state.cached_tokens_details is not None:
            meta["cached_tokens_details"] = dict(state.cached_tokens_details)
        if state.finish is not None:
            meta["e2e_latency"] = time.perf_counter() - state.created
        out = {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}
        if state.embedding is not None:
            out["embedding"] = state.embedding
        if obj.return_prompt_token_ids:
            out["prompt_token_ids"] = list(state.prompt_ids)
        return out

    def fail_all(self, message: str) -> None:
        """The runtime is gone (`message` names the dead process) or the server stops: finish every
        waiting handler with a server-side abort, which each route reports as an error (never as
        a complete answer), fail the control calls waiting on a reply, and refuse what comes
        later instead of letting it wait forever."""
        self.gone = message
        for state in self.states.values():
            if state.finish is None:
                state.finish = server_abort(message)
                state.event.set()
        for fut in self.control_waiters.values():
            if not fut.done():
                fut.set_exception(RuntimeGoneError(message))

    async def abort_request(self, rid: str) -> None:
        await self.to_scheduler.send(pickle.dumps(AbortReq(rid)))

    def apply_chat_template(self, messages: list[dict], tools: Optional[list] = None,
                            template_kwargs: Optional[dict] = None) -> str:
        if self.tokenizer is None:
            raise ValueError("messages: this server runs without a tokenizer")
        kw = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template,
                                                  tokenize=False, add_generation_prompt=True, **kw)

    # --- control ----------------------------------------------------------------------------------
    async def control(self, kind: str, payload=None, timeout: float = 30.0):
        if self.gone is not None:
            raise RuntimeGoneError(self.gone)
        req_id = next(self.control_ids)
        fut = asyncio.get_running_loop().create_future()
        self.control_waiters[req_id] = fut
        await self.to_scheduler.send(pickle.dumps(ControlReq(kind, req_id, payload)))
        try:
            reply: ControlReply = await asyncio.wait_for(fut, timeout)
        finally:
            self.control_waiters.pop(req_id, None)
        if reply.error:
            raise (ValueError if reply.bad_request else RuntimeError)(reply.error)
        return reply.result

    async def update_weights_from_disk(self, req: dict, drain_timeout: float = 300.0) -> dict:
        """Hold new requests back, let the running ones finish (or abort them with
        abort_all_requests), swap the weights in the scheduler, then let requests in again."""
        self.resumed.clear()
        try:
            if req.get("abort_all_requests"):
                for rid in list(self.states):
                    await self.abort_request(rid)
            deadline = time.monotonic() + drain_timeout
            while self.states and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if self.states:
                raise ValueError(f"{len(self.states)} requests still running after "
                                 f"{drain_timeout:.0f}s; pass abort_all_requests")
            result = await self.control("update_weights_from_disk", req, timeout=600.0)
            self.model_path = req["model_path"]
            return result
        finally:
            self.resumed.set()


def _load_chat_template(spec: Optional[str], tokenizer) -> Optional[str]:
    """--chat-template: a Jinja file or inline template; default: the model's own, else ChatML."""
    if spec:
        if os.path.exists(spec):
            with open(spec) as f:
                return f.read()
        if "{%" in spec or "{{" in spec:
            return spec
        raise ValueError(f"--chat-template {spec!r} is neither a file nor a Jinja template")
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return None  # the tokenizer's own
    logger.warning("the model has no chat template; using ChatML")
    return CHATML_FALLBACK


def _request_logger() -> logging.Logger:
    """--log-requests: its own logger at INFO, shown whatever --log-level says."""
    log = logging.getLogger("radixlm.requests")
    log.setLevel(logging.INFO)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[requests %(asctime)s] %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    return log


def _short_meta(meta: dict) -> dict:
    """meta_info for the request log, without the (long) logprob lists."""
    return {k: v for k, v in meta.items() if "logprobs" not in k}
