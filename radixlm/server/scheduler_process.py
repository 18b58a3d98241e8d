"""The scheduler process: model + Scheduler, fed by ZMQ, sending token updates to the detokenizer.

Loop: take every pending message (block only when idle) -> one scheduler step -> one BatchTokenOut
with each touched request's new tokens. The same Scheduler class runs inside the offline Engine;
only this IO differs.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import time
import traceback

import torch
import zmq

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.distributed import tp_worker
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.gil_switch import lower_switch_interval
from radixlm.runtime.models import loader
from radixlm.server.child_process import watch_parent
from radixlm.runtime.request import Req
from radixlm.runtime.scheduler.pd_decode import DecodeSide
from radixlm.runtime.scheduler.pd_prefill import PrefillSide
from radixlm.runtime.scheduler.scheduler import Scheduler
from radixlm.server.loop_stats import LoopStats, freeze_startup_objects
from radixlm.server.io_struct import (AbortReq, BatchTokenOut, ControlReply, ControlReq,
                                      ReqUpdate, TokenizedGenerateReq)
from radixlm.server.scheduler_control import Profiler, update_weights_from_disk

logger = logging.getLogger(__name__)


class SchedulerServer:
    def __init__(self, args: ServerArgs, ipc: dict[str, str]):
        self.args = args
        # tp_size > 1: this process is rank 0; the launcher started the other ranks
        self.tp = tp_worker.join_rank0(args) if args.tp_size > 1 else None
        self.runner = ModelRunner(args)
        tok = None
        if not args.skip_tokenizer_init:
            tok_path = args.tokenizer_path or self.runner.model_path
            fmt = "auto" if args.tokenizer_path or self.runner.load_format == "dummy" else self.runner.load_format
            tok = loader.load_tokenizer(tok_path, fmt)
        self.scheduler = Scheduler(args, self.runner, tok)
        # disaggregation (scheduler/pd.py): the prefill or the decode role, or colocated
        roles = {"prefill": PrefillSide, "decode": DecodeSide}
        mode = args.disaggregation_mode
        self.scheduler.pd = roles[mode](self.scheduler, args) if mode else None
        self.eos_token_ids = tuple(loader.eos_token_ids(self.runner.hf_config, tok))
        ctx = zmq.Context(2)
        self.recv = ctx.socket(zmq.PULL)
        self.recv.bind(ipc["scheduler_in"])
        self.to_detok = ctx.socket(zmq.PUSH)
        self.to_detok.connect(ipc["detokenizer_in"])
        self.to_tm = ctx.socket(zmq.PUSH)
        self.to_tm.connect(ipc["control_out"])
        self.sent: dict[str, int] = {}  # rid -> output tokens already sent
        self.input_lp_sent: set[str] = set()
        self.profiler = Profiler()
        self.loop_stats = LoopStats(self.scheduler.stats, args.gc_warning_threshold_secs)
        if args.enable_gc_freeze:  # start-up is done: weights, graphs, tokenizer, sockets
            logger.info("gc.freeze(): %d objects kept out of collections", freeze_startup_objects())

    def info(self) -> dict:
        r = self.runner
        return {"model_path": r.model_path, "load_format": r.load_format,
                "context_len": r.context_len, "max_total_tokens": r.capacity,
                "vocab_size": r.model_config.vocab_size, "device": str(r.device),
                "dtype": str(r.dtype).removeprefix("torch."), "hf_config": r.hf_config,
                "eos_token_ids": list(self.eos_token_ids)}

    def serve_forever(self) -> None:
        sched = self.scheduler
        poller = zmq.Poller()
        poller.register(self.recv, zmq.POLLIN)
        while True:
            if sched.is_idle():  # (a PD role also polls its handshake store)
                timeout = None if sched.pd is None else 50
            elif sched.has_runnable_work():  # keep stepping
                timeout = 0
            else:  # 1 ms: a request's KV is arriving (disaggregation, or a preload to the
                # device); 5 ms: only grammars are compiling
                timeout = 1 if ((sched.pd is not None and sched.pd.busy())
                                or sched.waits_on_copies()) else 5
            got = poller.poll(timeout)
            marks = [time.perf_counter()]  # the turn's parts: messages, pd_poll, step, updates
            if got:
                while True:
                    try:
                        msg = pickle.loads(self.recv.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    if self.handle(msg) == "shutdown":
                        return
            marks.append(time.perf_counter())
            if sched.pd is not None:
                failed = sched.pd.poll()
                if failed:
                    self.send_updates(failed)
            marks.append(time.perf_counter())
            stepped = sched.has_runnable_work()
            touched = sched.step() if stepped else []
            marks.append(time.perf_counter())
            if touched:
                self.send_updates(touched)
            if stepped and self.profiler.active:
                self.profiler.on_step()
            if stepped or got:
                marks.append(time.perf_counter())
                self.loop_stats.turn(marks)

    def handle(self, msg):
        sched = self.scheduler
        if isinstance(msg, TokenizedGenerateReq):
            req = Req(msg.rid, msg.input_ids, msg.sampling_params, msg.return_logprob,
                      msg.logprob_start_len, msg.top_logprobs_num, self.eos_token_ids,
                      token_ids_logprob=msg.token_ids_logprob, embed_pooling=msg.embed_pooling,
                      mm=msg.mm)
            if msg.bootstrap is not None and sched.pd is not None:
                failed = sched.pd.add_request(req, *msg.bootstrap)
                if failed:
                    self.send_updates(failed)
            else:
                sched.add_request(req)
        elif isinstance(msg, AbortReq):
            req = sched.abort_request(msg.rid)
            if req is None and sched.pd is not None:  # held for its KV hand-off
                req = sched.pd.abort(msg.rid)
            if req is not None:
                self.send_updates([req])
        elif isinstance(msg, ControlReq):
            return self.handle_control(msg)

    def handle_control(self, msg: ControlReq):
        reply = ControlReply(msg.req_id)
        try:
            if msg.kind == "flush_cache":
                reply.result = self.scheduler.flush_cache(bool((msg.payload or {}).get("storage")))
            elif msg.kind == "get_stats":
                reply.result = self.scheduler.stats_snapshot()
            elif msg.kind == "check_integrity":
                self.scheduler.check_integrity()
                reply.result = True
            elif msg.kind == "start_profile":
                reply.result = self.profiler.start(msg.payload or {})
            elif msg.kind == "stop_profile":
                reply.result = self.profiler.stop()
            elif msg.kind == "update_weights_from_disk":
                reply.result = update_weights_from_disk(self.runner, self.scheduler, msg.payload)
            elif msg.kind == "shutdown":
                self.to_tm.send(pickle.dumps(reply))
                return "shutdown"
            else:
                reply.error = f"unknown control request {msg.kind!r}"
        except ValueError as e:  # the caller's mistake: a 400 naming it
            reply.error, reply.bad_request = str(e), True
        except Exception as e:  # a failed control request must not kill the scheduler
            reply.error = f"{type(e).__name__}: {e}"
        self.to_tm.send(pickle.dumps(reply))

    def send_updates(self, reqs: list[Req]) -> None:
        updates = []
        for req in reqs:
            try:
                updates.append(self._update_of(req))
            except Exception as e:  # this request's logprobs or fields: it fails alone
                updates.append(self._failed_update(req, e))
        self.to_detok.send(pickle.dumps(BatchTokenOut(updates)))

    def _failed_update(self, req: Req, exc: Exception) -> ReqUpdate:
        """The update of a request whose own update could not be built: the scheduler fails it
        (KV back, out of the batch; logged and counted) and the client gets an error."""
        self.scheduler.fail_outside_step(req, exc, "building its update")
        n_sent = self.sent.pop(req.rid, 0)  # the client has these tokens; no new ones follow
        self.input_lp_sent.discard(req.rid)
        finish = req.finish.to_dict()
        if finish.get("status_code") is None:  # it had finished, but its answer is lost
            finish = {"type": "abort", "status_code": 500,
                      "message": f"internal error building its update: {type(exc).__name__}: {exc}"}
        sp = req.sampling_params
        return ReqUpdate(req.rid, [], n_sent, finish,
                         len(req.origin_input_ids), req.cached_tokens, sp.skip_special_tokens,
                         sp.spaces_between_special_tokens, tuple(sp.stop_strs), sp.no_stop_trim)

    def _update_of(self, req: Req) -> ReqUpdate:
        start = self.sent.get(req.rid, 0)
        rollback = None
        if req.output_rollback is not None:
            if req.output_rollback < start:
                rollback = start = req.output_rollback
            req.output_rollback = None
        n = len(req.output_ids)
        sp = req.sampling_params
        up = ReqUpdate(req.rid, req.output_ids[start:n], n,
                       req.finish.to_dict() if req.finish else None,
                       len(req.origin_input_ids), req.cached_tokens,
                       sp.skip_special_tokens, sp.spaces_between_special_tokens,
                       tuple(sp.stop_strs), sp.no_stop_trim, rollback_to=rollback,
                       retractions=req.retractions,
                       spec_verify_steps=req.spec_verify_steps,
                       spec_verify_tokens=req.spec_verify_tokens)
        if req.embedding is not None:
            up.embedding = req.embedding
        up.cached_tokens_details = req.cached_tokens_details
        if req.return_logprob:
            up.output_token_logprobs = list(zip(req.output_token_logprobs[start:n],
                                                req.output_ids[start:n]))
            if req.top_logprobs_num:
                up.output_top_logprobs = req.output_top_logprobs[start:n]
            if req.token_ids_logprob:
                up.output_token_ids_logprobs = req.output_token_ids_logprobs[start:n]
            if req.rid not in self.input_lp_sent and (req.input_logprobs_done or req.finished):
                self.input_lp_sent.add(req.rid)
                start_pos = max(req.logprob_start_len, 0)
                up.input_token_logprobs = list(zip(req.input_token_logprobs,
                                                   req.vocab_input_ids()[start_pos:]))
                up.input_top_logprobs = req.input_top_logprobs
                if req.token_ids_logprob:
                    up.input_token_ids_logprobs = req.input_token_ids_logprobs
        self.sent[req.rid] = n
        if req.finished:
            self.sent.pop(req.rid, None)
            self.input_lp_sent.discard(req.rid)
        return up


def run_scheduler_process(args: ServerArgs, ipc: dict[str, str], ready_pipe) -> None:
    """Process entry point. Reports ("ready", info) or ("error", traceback) through ready_pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    watch_parent()
    logging.basicConfig(level=args.log_level.upper(),
                        format="[scheduler %(asctime)s] %(levelname)s %(message)s")
    try:
        torch.set_grad_enabled(False)
        lower_switch_interval()  # the cache's reader and writer threads share the GIL
        server = SchedulerServer(args, ipc)
        ready_pipe.send(("ready", server.info()))
    except Exception:
        ready_pipe.send(("error", traceback.format_exc()))
        return
    try:
        server.serve_forever()
        if server.scheduler.tiered:
            server.scheduler.tree_cache.close()  # queued pages reach the store before we go
        if server.scheduler.pd is not None:
            server.scheduler.pd.close()
        if server.tp is not None:  # a shutdown request: the workers leave their loop too
            server.runner.release_cuda_graphs()
            server.tp.stop()
    except Exception:
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
        os._exit(1)
