"""Start the server: scheduler and detokenizer processes, then FastAPI in this process.

This module is imported before the scheduler is forked, so it imports nothing heavy at the top.
Start-up waits until each child reports ready (or fails, printing its traceback). A watchdog
checks the children: if one dies, /health turns 503 and the server shuts down instead of
hanging. SIGTERM lets running requests finish (up to --timeout-graceful-shutdown seconds), then
stops the children; none is left behind.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import shutil
import sys
import tempfile
from contextlib import asynccontextmanager
from typing import Optional

from radixlm.runtime.config import ServerArgs
from radixlm.server.child_process import forget_parent_logging
from radixlm.server.sigterm import run_then_clean_up

logger = logging.getLogger("radixlm.server")

READY_TIMEOUT_S = 600.0


def _ipc_paths() -> tuple[str, dict[str, str]]:
    d = tempfile.mkdtemp(prefix="radixlm-ipc-")
    tm = f"ipc://{d}/tokenizer"
    return d, {"scheduler_in": f"ipc://{d}/scheduler", "detokenizer_in": f"ipc://{d}/detokenizer",
               "tokenizer_in": tm, "control_out": tm}


def _wait_ready(name: str, proc, pipe) -> object:
    if not pipe.poll(READY_TIMEOUT_S):
        raise RuntimeError(f"{name} process did not report ready in {READY_TIMEOUT_S:.0f}s")
    try:
        status, payload = pipe.recv()
    except EOFError:
        raise RuntimeError(f"{name} process died during start-up (exit code {proc.exitcode})") from None
    if status != "ready":
        raise RuntimeError(f"{name} process failed to start:\n{payload}")
    return payload


def _start_method() -> str:
    """`fork` while this process has no other threads, else `spawn`.

    fork skips what spawn repeats in every child: a fresh interpreter and its imports. It is
    unsafe once other threads exist (a lock one of them holds is copied held, forever) and once
    torch's intra-op pool has run (the child's first parallel op can hang), so start-up forks
    before any thread or torch op exists here; an embedding program that already has threads
    gets spawn."""
    import threading

    return "fork" if threading.active_count() == 1 else "spawn"


def _scheduler_main(args: ServerArgs, ipc: dict[str, str], ready_pipe) -> None:
    # imported in the child: this module stays light, so the parent can fork the scheduler
    # before it imports torch or anything else heavy
    forget_parent_logging()
    from radixlm.server.scheduler_process import run_scheduler_process

    run_scheduler_process(args, ipc, ready_pipe)


def _detokenizer_main(*args) -> None:
    forget_parent_logging()
    from radixlm.server.detokenizer_process import run_detokenizer_process

    run_detokenizer_process(*args)


def launch_server(args: ServerArgs) -> None:
    """Start-up, ordered for the critical path (two CPU cores are enough to overlap it all):
      1. import torch and the request types here, which both this process (to build requests)
         and the scheduler need: the forked scheduler inherits them instead of importing them
         again (torch alone is ~2 CPU-s, most of the scheduler's start on a small model);
      2. fork the scheduler: loading the model is the longest path;
      3. meanwhile import the HTTP stack and load the tokenizer here (the GGUF-derived parts
         come from the on-disk cache, see runtime/models/cache.py);
      4. fork the detokenizer from here, so it inherits the loaded tokenizer instead of
         importing transformers and loading it a third time on the same cores;
      5. wait for both to report ready, then serve.
    dp_size > 1: replicas of this server behind the router instead (radixlm/router/dp.py)."""
    from radixlm.runtime.speculative import spec_config

    from radixlm.runtime.distributed.pd_args import check_disaggregation_args

    spec_config.resolve(args)  # a flag that cannot run fails here, before any process starts
    try:
        args = check_disaggregation_args(args)
    except ValueError as e:
        print(f"radixlm: {e}", file=sys.stderr)
        raise SystemExit(2)
    if args.dp_size > 1:
        from radixlm.router.dp import launch_dp

        return launch_dp(args)
    if args.base_gpu_id:
        from radixlm.router.dp import pin_single_server_gpus

        pin_single_server_gpus(args)
    from radixlm.runtime.models import loader

    logging.basicConfig(level=args.log_level.upper(),
                        format="[server %(asctime)s] %(levelname)s %(message)s")
    if args.model_path is None:
        args = args.replace(model_path=loader.default_model_path())
    if args.tp_size > 1:
        from radixlm.runtime.distributed import tp_worker

        if args.node_rank > 0:  # another node of a multi-node TP group: its ranks only
            tp_worker.run_node(args)
            return
        args = tp_worker.prepare_args(args)  # a meeting address for the scheduler and workers
    ipc_dir, ipc = _ipc_paths()
    procs: list[tuple[str, mp.Process]] = []
    try:
        fmt = loader.resolve_load_format(args.model_path, args.load_format)
        tok_path = args.tokenizer_path or args.model_path
        tok_fmt = "auto" if args.tokenizer_path or fmt == "dummy" else fmt
        # importing starts no thread (fork stays safe) and touches no GPU
        import radixlm.runtime.engine_io  # noqa: F401

        ctx = mp.get_context(_start_method())
        s_recv, s_send = ctx.Pipe(duplex=False)
        sched = ctx.Process(target=_scheduler_main, args=(args, ipc, s_send),
                            name="radixlm-scheduler", daemon=True)
        sched.start()
        procs.append(("scheduler", sched))
        if args.tp_size > 1:  # ranks 1..: started here, the scheduler (rank 0) is a daemon
            procs += [(p.name, p) for p in tp_worker.spawn_workers(args)]

        import uvicorn

        from radixlm.server.http_server import KEEP_ALIVE_S, build_app
        from radixlm.server.tokenizer_manager import TokenizerManager

        tokenizer = None if args.skip_tokenizer_init else loader.load_tokenizer(tok_path, tok_fmt)
        method = _start_method()
        ctx = mp.get_context(method)
        d_recv, d_send = ctx.Pipe(duplex=False)
        # a forked child inherits the tokenizer; a spawned one would get it pickled, so it
        # loads its own (from the cache) instead
        detok = ctx.Process(target=_detokenizer_main,
                            args=(tok_path, tok_fmt, args.skip_tokenizer_init, ipc, d_send,
                                  args.log_level, tokenizer if method == "fork" else None),
                            name="radixlm-detokenizer", daemon=True)
        detok.start()
        procs.append(("detokenizer", detok))
        info = _wait_ready("scheduler", sched, s_recv)
        _wait_ready("detokenizer", detok, d_recv)
    except Exception as e:
        _stop_children(procs)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        print(f"radixlm: start-up failed: {e}", file=sys.stderr)
        raise SystemExit(1)

    state = {"dead": None}

    def health() -> Optional[str]:
        return state["dead"]

    server_box: dict = {}

    @asynccontextmanager
    async def lifespan(app):
        tm.start()
        watchdog = asyncio.create_task(_watch_children(procs, state, server_box, tm))
        cutter = asyncio.create_task(_fail_before_cut(server_box, tm, args.timeout_graceful_shutdown))
        yield
        watchdog.cancel()
        cutter.cancel()

    tm = TokenizerManager(args, tokenizer, info, ipc)
    app = build_app(tm, args, health)
    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.timeout_graceful_shutdown,
                            timeout_keep_alive=KEEP_ALIVE_S, loop="asyncio")
    server = uvicorn.Server(config)
    server_box["server"] = server
    print(f"radixlm: serving {tm.model_name} on http://{args.host}:{args.port} "
          f"(KV capacity {info['max_total_tokens']} tokens, {info['device']}, {info['dtype']})",
          flush=True)

    def clean_up() -> None:
        _stop_children(procs)
        shutil.rmtree(ipc_dir, ignore_errors=True)

    run_then_clean_up(server, clean_up)
    if state["dead"]:
        raise SystemExit(1)


async def _watch_children(procs, state, server_box, tm) -> None:
    """Every 0.5 s: a dead child fails every request in flight and stops the server (exit code
    1). All the children found dead are named: a killed TP rank takes the scheduler down with it
    within milliseconds, and the log must not blame only the scheduler."""
    while True:
        await asyncio.sleep(0.5)
        dead = [f"the {name} process died (exit code {p.exitcode})"
                for name, p in procs if not p.is_alive()]
        if dead:
            state["dead"] = "; ".join(dead)
            logger.error("%s; shutting down", state["dead"])
            tm.fail_all(state["dead"])
            server = server_box.get("server")
            if server is not None:
                server.should_exit = True
            return


# How long before uvicorn's graceful-shutdown deadline the requests still running are failed: their
# handlers need a moment to send the error before uvicorn cancels them mid-response.
CUT_MARGIN_S = 0.5


async def _fail_before_cut(server_box, tm, grace: float) -> None:
    """After SIGTERM, uvicorn lets running requests finish for `grace` seconds, then cancels them:
    a stream would just stop (a client reading SSE lines may take it for complete) and a
    non-streamed request would lose its connection. Shortly before that, fail what still runs
    with an error that says why (the routes send it in their own format)."""
    while server_box.get("server") is None or not server_box["server"].should_exit:
        await asyncio.sleep(0.1)
    if tm.gone is not None:  # a dead child already failed everything
        return
    await asyncio.sleep(max(0.0, grace - CUT_MARGIN_S))
    if tm.states:
        message = (f"the server is shutting down: the request did not finish within "
                   f"--timeout-graceful-shutdown ({grace:g} s)")
        logger.warning("%s (%d requests)", message, len(tm.states))
        tm.fail_all(message)


def _stop_children(procs) -> None:
    for _, p in procs:
        if p.is_alive():
            p.terminate()
    for _, p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
