"""`--dp-size N`: N replicas of the server behind the router, all started by this process.

Each replica is a whole server (its own HTTP front, TokenizerManager, scheduler, detokenizer and
TP ranks: a separate process tree, so replicas share no Python lock, no event loop and no GIL)
listening on an internal 127.0.0.1 port; the router serves the user's --host/--port. Sending HTTP
between router and replica costs ~0.1-1 ms per request, nothing next to a generation, and it is the
same path as the standalone router over several machines: one code path for both.

Devices: replica i gets the GPUs base_gpu_id + i * tp_size ... + tp_size - 1 (dp_size * tp_size
GPUs in all) through CUDA_VISIBLE_DEVICES, set before its interpreter starts (torch sees only
its own GPUs, and its TP ranks take cuda:0.. of them). On the CPU the cores are split:
OMP_NUM_THREADS = cores // dp_size per replica (cores: OMP_NUM_THREADS if set, else this process's
CPU affinity).

Life cycle: start-up waits until every replica's /health answers 200 (a replica that exits first
fails the start, and the others are stopped). A replica that dies later is removed from the pool
at once (the watchdog polls the processes every 0.5 s; requests it never answered are retried on
another replica, proxy.py); the service goes on while one replica lives. SIGTERM / Ctrl-C: the
router drains its requests (--timeout-graceful-shutdown), then each replica gets SIGTERM (its own
graceful stop), then SIGKILL after a grace period; a replica's children follow their parent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager

from radixlm.net import free_port
from radixlm.runtime.config import ServerArgs
from radixlm.router.args import ARGS_ENV, PARENT_ENV, RouterArgs

logger = logging.getLogger("radixlm.router")

READY_TIMEOUT_S = 900.0
STOP_GRACE_S = 20.0


def visible_gpus(device: str) -> list[str]:
    """The GPUs this process may hand out (CUDA_VISIBLE_DEVICES order); [] on the CPU."""
    if device == "cpu":
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    import torch  # only here: counting GPUs needs it; the router itself never does

    return [str(i) for i in range(torch.cuda.device_count())]


def gpus_of(args: ServerArgs, replica: int, gpus: list[str]) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries of replica `replica` (tp_size of them)."""
    first = args.base_gpu_id + replica * args.tp_size
    if first < 0 or first + args.tp_size > len(gpus):
        raise ValueError(f"dp_size={args.dp_size} x tp_size={args.tp_size} from base_gpu_id="
                         f"{args.base_gpu_id} needs GPUs up to index "
                         f"{args.base_gpu_id + args.dp_size * args.tp_size - 1}; "
                         f"{len(gpus)} visible")
    return gpus[first:first + args.tp_size]


def pin_single_server_gpus(args: ServerArgs) -> None:
    """dp_size 1 with base_gpu_id > 0: this process (before any CUDA use) and its children see
    GPUs base_gpu_id .. base_gpu_id + tp_size - 1 only. Not checked against the GPU count here
    (that would initialize CUDA before the scheduler is forked); --device cuda fails loudly when
    the GPUs are not there."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = ([g.strip() for g in env.split(",") if g.strip()] if env is not None
            else [str(i) for i in range(args.base_gpu_id + args.tp_size)])
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(
        gpus[args.base_gpu_id:args.base_gpu_id + args.tp_size])


def cpu_threads(dp_size: int) -> int:
    env = os.environ.get("OMP_NUM_THREADS", "")
    cores = int(env) if env.isdigit() and int(env) > 0 else len(os.sched_getaffinity(0))
    return max(1, cores // dp_size)


def check_dp_args(args: ServerArgs) -> None:
    if args.dp_size < 1:
        raise ValueError(f"dp_size must be >= 1 (got {args.dp_size})")
    if args.nnodes > 1:
        raise ValueError("--dp-size with --nnodes > 1 is not supported: run a server per node "
                         "and `radixlm router --worker-urls ...` in front of them")


class Replica:
    def __init__(self, index: int, args: ServerArgs, env: dict):
        self.index, self.args = index, args
        self.url = f"http://127.0.0.1:{args.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "radixlm.router.replica"], env=env)

    def alive(self) -> bool:
        return self.proc.poll() is None


def start_replicas(args: ServerArgs) -> list[Replica]:
    device = args.device.split(":")[0]
    gpus = visible_gpus(device)
    threads = cpu_threads(args.dp_size)
    replicas = []
    for i in range(args.dp_size):
        rargs = args.replace(dp_size=1, base_gpu_id=0, host="127.0.0.1", port=free_port(),
                             dist_init_addr=None, device=device)
        env = {**os.environ, ARGS_ENV: json.dumps(dataclasses.asdict(rargs)),
               PARENT_ENV: str(os.getpid()), "OMP_NUM_THREADS": str(threads)}
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus_of(args, i, gpus))
        replicas.append(Replica(i, rargs, env))
    return replicas


def wait_ready(replicas: list[Replica], timeout: float = READY_TIMEOUT_S) -> None:
    import httpx

    pending = list(replicas)
    deadline = time.monotonic() + timeout
    # one client for the polls: httpx.get builds a client (and a TLS context) per call, ~27 ms of
    # CPU, on the cores the replicas are starting on
    with httpx.Client(timeout=2) as poll:
        while pending:
            for r in list(pending):
                if not r.alive():
                    raise RuntimeError(f"replica {r.index} exited during start-up "
                                       f"(code {r.proc.returncode})")
                try:
                    if poll.get(r.url + "/health").status_code == 200:
                        pending.remove(r)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"replicas {[r.index for r in pending]} not ready in "
                                   f"{timeout:.0f}s")
            if pending:
                time.sleep(0.1)


def stop_replicas(replicas: list[Replica], grace: float = STOP_GRACE_S) -> None:
    for r in replicas:
        if r.alive():
            r.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for r in replicas:
        try:
            r.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait(10)


def router_args(args: ServerArgs) -> RouterArgs:
    """The router's settings under --dp-size: the policy from --load-balance-method, the HTTP
    settings from the server's flags, and a lenient health-check timeout (a replica busy with a
    burst may answer /health late; a dead one is caught by the process watchdog anyway)."""
    return RouterArgs(host=args.host, port=args.port, policy=args.load_balance_method,
                      api_key=args.api_key, admin_api_key=args.admin_api_key,
                      max_payload_size=args.max_payload_size,
                      timeout_graceful_shutdown=args.timeout_graceful_shutdown,
                      health_check_timeout_secs=10.0, log_level=args.log_level)


def launch_dp(args: ServerArgs) -> None:
    """Serve `args` with dp_size replicas behind the router (see module doc)."""
    import uvicorn

    from radixlm.router.app import Router, build_app
    from radixlm.server.http_server import KEEP_ALIVE_S

    logging.basicConfig(level=args.log_level.upper(),
                        format="[router %(asctime)s] %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per forwarded request
    replicas: list[Replica] = []
    try:
        check_dp_args(args)
        rargs = router_args(args)
        replicas = start_replicas(args)
        wait_ready(replicas)
    except BaseException as e:  # Ctrl-C during start-up too: no replica left behind
        stop_replicas(replicas, grace=5.0)
        print(f"radixlm: start-up failed: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(1)

    by_url = {r.url: r for r in replicas}
    state: dict = {"dead": None}

    def on_remove(worker, reason: str) -> None:
        """A replica out of the pool (health checks) is stopped, not left running unused."""
        r = by_url.get(worker.url)
        if r is not None and r.alive():
            r.proc.send_signal(signal.SIGTERM)

    router = Router(rargs, on_remove=on_remove)
    for r in replicas:
        router.pool.add(r.url, pid=r.proc.pid)
    # the workers' info is resolved (device, dtype, model path); these fields are the front's
    info = {"dp_size": args.dp_size, "load_balance_method": args.load_balance_method,
            "base_gpu_id": args.base_gpu_id, "host": args.host, "port": args.port}
    app = build_app(router, health=lambda: state["dead"], info_extra=info)
    server_box: dict = {}
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a):
        async with inner(a):
            watchdog = asyncio.create_task(_watch_replicas(replicas, router, state, server_box))
            yield
            watchdog.cancel()

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.timeout_graceful_shutdown,
                            timeout_keep_alive=KEEP_ALIVE_S, loop="asyncio")
    server = uvicorn.Server(config)
    server_box["server"] = server
    print(f"radixlm: serving with dp_size={args.dp_size} ({args.load_balance_method}) on "
          f"http://{args.host}:{args.port}; replicas: {', '.join(by_url)}", flush=True)
    from radixlm.server.sigterm import run_then_clean_up

    run_then_clean_up(server, lambda: stop_replicas(replicas))  # SIGTERM: replicas stopped first
    if state["dead"]:
        raise SystemExit(1)


async def _watch_replicas(replicas, router, state, server_box) -> None:
    reported: set[int] = set()
    while True:
        await asyncio.sleep(0.5)
        for r in replicas:
            if r.index not in reported and not r.alive():
                reported.add(r.index)
                logger.error("replica %d (%s) exited with code %s", r.index, r.url,
                             r.proc.returncode)
                router.pool.remove(r.url, f"replica process exited (code {r.proc.returncode})")
        if all(not r.alive() for r in replicas):
            state["dead"] = "every replica has exited"
            logger.error("%s; shutting down", state["dead"])
            server = server_box.get("server")
            if server is not None:
                server.should_exit = True
            return
