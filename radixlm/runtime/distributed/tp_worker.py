"""Processes of a tensor-parallel engine: rank 0 schedules, ranks 1..N-1 follow.

`start_tp(args)` (in rank 0's process, before its ModelRunner): spawns this node's worker ranks,
then joins the group itself. Each worker builds its own ModelRunner (the rank's shard, a KV pool
of the rank's KV heads) and loops: receive a batch from rank 0 (batch_sync), run the forward
(whose collectives pair with rank 0's), drop the logits (sampling is rank 0's). `TPHandle.stop()`
broadcasts the stop command, joins the workers (killing any that do not exit) and leaves the
group. Multi-node: ranks are node-major (node k holds ranks k * tp/nnodes ...); rank 0's node
runs the engine, every other node runs `run_node(args)` (launch_server with --node-rank > 0).
"""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from typing import Optional

import torch

from radixlm.net import free_port
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.distributed import batch_sync, parallel_state

logger = logging.getLogger(__name__)
STOP_TIMEOUT_S = 30.0


def check_args(args: ServerArgs) -> int:
    """Ranks per node, after checking the TP flags."""
    tp, nnodes = args.tp_size, args.nnodes
    if tp < 1 or nnodes < 1 or tp % nnodes:
        raise ValueError(f"tp_size={tp} must be a positive multiple of nnodes={nnodes}")
    if not 0 <= args.node_rank < nnodes:
        raise ValueError(f"node_rank={args.node_rank} is not in [0, nnodes={nnodes})")
    if nnodes > 1 and not args.dist_init_addr:
        raise ValueError("nnodes > 1 needs dist_init_addr (host:port of node 0)")
    return tp // nnodes


def _init_method(args: ServerArgs) -> str:
    return f"tcp://{args.dist_init_addr}"


def _custom_ar(args: ServerArgs) -> bool:
    """Symmetric-memory all-reduce: one node only (P2P between its GPUs), unless disabled."""
    return not args.disable_custom_all_reduce and args.nnodes == 1


def worker_main(args: ServerArgs, rank: int, threads: Optional[int] = None) -> None:
    """A worker rank's process: follow rank 0's batches until it says stop."""
    from radixlm.runtime.executor.model_runner import ModelRunner  # it imports this package

    from radixlm.server.child_process import watch_parent  # no orphans after a kill -9

    watch_parent()
    if threads:
        torch.set_num_threads(threads)
    try:
        tp = parallel_state.init_distributed(args.tp_size, rank, _init_method(args), _device(args),
                                              custom_all_reduce=_custom_ar(args))
        runner = ModelRunner(args)
        r2t = runner.req_to_token_pool.req_to_token
        timing = _StepTiming(rank)
        while True:
            t0 = time.perf_counter()
            fb = batch_sync.recv_batch(tp, r2t, runner.device)
            if fb is None:
                break
            t1 = time.perf_counter()
            runner.forward(fb)
            timing.add(fb, t1 - t0, time.perf_counter() - t1)
        timing.write()
        runner.release_cuda_graphs()
        parallel_state.destroy_distributed(timeout_s=STOP_TIMEOUT_S)  # with rank 0's
    except BaseException:
        logger.error("TP rank %d failed:\n%s", rank, traceback.format_exc())
        os._exit(1)  # rank 0's next collective fails on the closed connection


class _StepTiming:
    """A worker's host seconds a step: in recv_batch (mostly waiting for rank 0's next batch)
    and in the forward call (launching it; with CUDA graphs the GPU runs it later), by the kind
    of step (decode or extend; `_b1`: one row). Written, when `RADIXLM_TP_WORKER_TIMING` names
    a path prefix, to <prefix>.rank<r>.json at the loop's end (benchmarks/tp_gpu.py reads it:
    a worker whose forward calls take as long as a step holds every rank's collectives back)."""

    def __init__(self, rank: int):
        self.rank, self.prefix = rank, os.environ.get("RADIXLM_TP_WORKER_TIMING")
        self.kinds: dict = {}  # kind -> [steps, recv_s, forward_call_s]

    def add(self, fb, recv_s: float, forward_call_s: float) -> None:
        kind = fb.mode.name.lower() + ("_b1" if fb.batch_size == 1 else "")
        k = self.kinds.setdefault(kind, [0, 0.0, 0.0])
        k[0] += 1
        k[1] += recv_s
        k[2] += forward_call_s

    def write(self) -> None:
        if self.prefix:
            with open(f"{self.prefix}.rank{self.rank}.json", "w") as f:
                json.dump({"rank": self.rank, "kinds": {
                    kind: {"steps": n, "recv_s": round(r, 4), "forward_call_s": round(c, 4)}
                    for kind, (n, r, c) in self.kinds.items()}}, f)


def _device(args: ServerArgs) -> str:
    from radixlm.runtime.executor.model_runner import resolve_device

    return str(resolve_device(args.device))


class TPHandle:
    """Rank 0's view of its worker processes (this node's)."""

    def __init__(self, tp: parallel_state.TPGroup, procs: list):
        self.tp, self.procs = tp, procs
        self.stopped = False

    def stop(self, graceful: bool = True) -> None:
        """graceful: broadcast stop (only when no forward is in flight on another thread)."""
        if self.stopped:
            return
        self.stopped = True
        left = False
        if graceful and all(p.is_alive() for p in self.procs):
            try:
                batch_sync.send_stop(self.tp)
                if self.tp.backend == "nccl":
                    # the workers leave the group as soon as they see the stop: leave with them,
                    # before joining them (NCCL's teardown pairs a node's ranks). The caller
                    # released its CUDA graphs first (ModelRunner.release_cuda_graphs)
                    left = True
                    parallel_state.destroy_distributed(timeout_s=STOP_TIMEOUT_S)
            except Exception as e:  # a dead worker: the kill below cleans up
                logger.warning("TP stop broadcast failed: %s", e)
        deadline = time.monotonic() + (STOP_TIMEOUT_S if graceful else 0.0)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        if not left:  # gloo: after the workers are gone (see tests/unit/tp_harness.py)
            parallel_state.destroy_distributed(timeout_s=5.0)


def prepare_args(args: ServerArgs) -> ServerArgs:
    """The TP flags checked; without dist_init_addr (one node) a free local port to meet on."""
    check_args(args)
    if args.tp_size > 1 and not args.dist_init_addr:
        args = args.replace(dist_init_addr=f"127.0.0.1:{free_port()}")
    return args


def spawn_workers(args: ServerArgs, daemon: bool = True) -> list:
    """Start this node's worker ranks (rank 0's node: ranks 1..per_node-1) as spawned processes
    (never forked from a process holding torch threads / CUDA). `args` from prepare_args."""
    import multiprocessing as mp

    per_node = check_args(args)
    first = args.node_rank * per_node
    ranks = [r for r in range(first, first + per_node) if r != 0]
    # CPU: the node's cores shared between its ranks (rank 0 keeps its process's setting)
    threads = max(1, (os.cpu_count() or 1) // per_node) if _device(args) == "cpu" else None
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(args, r, threads), daemon=daemon,
                         name=f"radixlm-tp{r}") for r in ranks]
    for p in procs:
        p.start()
    return procs


def join_rank0(args: ServerArgs, procs: list = ()) -> TPHandle:
    """Join the group as rank 0 (args from prepare_args); `procs`: workers this process owns."""
    try:
        tp = parallel_state.init_distributed(args.tp_size, 0, _init_method(args), _device(args),
                                              custom_all_reduce=_custom_ar(args))
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return TPHandle(tp, list(procs))


def start_tp(args: ServerArgs) -> Optional[TPHandle]:
    """The engine's process as rank 0: spawn the node's workers and join. None when tp_size == 1."""
    args = prepare_args(args)
    if args.tp_size == 1:
        return None
    if args.node_rank != 0:
        raise ValueError("the engine runs on node_rank 0; other nodes run run_node(args)")
    return join_rank0(args, spawn_workers(args))


def run_node(args: ServerArgs) -> None:
    """A node other than rank 0's: run its ranks until rank 0 stops them."""
    if args.node_rank == 0:
        raise ValueError("node_rank 0 runs the engine / server, not run_node")
    procs = spawn_workers(args, daemon=False)
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(1)
