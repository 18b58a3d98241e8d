"""Prefill -> decode KV transfer (disaggregation): the handshake, 2-rank links, pages.

Handshake ("bootstrap"): a prefill scheduler hosts a torch TCPStore on
--disaggregation-bootstrap-port (bound to --host). A decode scheduler that meets a request
naming that prefill server (the router's bootstrap_host / bootstrap_port) connects to the store,
pushes HELLO(link id) on the control queue, and both sides build a 2-rank process group over
the store (prefill rank 0, decode rank 1): gloo moves host tensors, nccl device tensors.
For each request (a "room": a number the router gives both sides), the decode side reserves KV
slots for prompt tokens [start, start + count) and pushes READY(link, room, start, count): the
tokens below `start` hit its own radix tree, so they are never sent.

Data, on one link in order: a page is a header int64 (4,) = (room, first token, tokens, status),
then, when tokens > 0, the payload (L, 2, tokens, H_kv, D) in the pool's dtype, sent as bytes.
status CANCEL (tokens 0) closes a room the prefill side will not send (its request failed, was
aborted, or never arrived): the receiver stops waiting for that room's bytes.

Failure: every blocking call (store, rendezvous, send, recv) runs on a link's own thread, never
on the scheduler's; an error (a peer that died: gloo reports "Connection closed by peer" at
once) marks the link dead and fails each of its rooms through `events()`. A later request
builds a new link.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import pickle
import queue
import socket
import threading
import time
import uuid
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

CTL_QUEUE = "pd/ctl"  # the store queue of decode -> prefill control messages
OK, CANCEL = 0, 1
CONNECT_TIMEOUT_S = 10.0


def _settle(device: torch.device) -> None:
    """nccl: a send's or recv's wait() only orders the calling thread's stream; the host must
    know the bytes moved before it reuses (sender) or hands over (receiver) the buffer. Polled,
    never a blocking CUDA call: a recv waits for its peer (a prefill of hundreds of ms), and
    while one thread sat in a blocking call on it (a stream synchronize, the header's copy to
    pageable memory) the driver held the scheduler thread's launches and copies too: the
    decode GPU idled 11-44 ms at a time, 13 times in 4.3 s (2 x H200, torch.profiler: the
    scheduler's cudaGraphLaunch / cudaMemcpyAsync lasting exactly as long as the link
    thread's cudaMemcpyAsync), which made PD's inter-token p99."""
    if device.type == "cuda":
        _poll(torch.cuda.current_stream(device).record_event())


def _poll(event, poll_s: float = 1e-4) -> None:
    """Wait for a CUDA event by querying it (cudaEventQuery returns at once)."""
    while not event.query():
        time.sleep(poll_s)


def _own_stream(device: torch.device):
    """nccl: a link thread's own CUDA stream. wait() makes the CURRENT stream wait for the
    transfer, and a thread's current stream is by default the device's default stream, the one the
    scheduler's forwards run on: a recv posted while the prefill side still computes (hundreds of
    ms for a long prompt) would hold every decode step behind it (H200 x2, Llama-8B shape: ITL
    p99 35 ms under PD against 6.7 ms colocated). On its own stream only the link waits."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device))


def _timeout(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(1.0, s))


def make_group(store, rank: int, host: str, backend: str, timeout: float, device=None):
    """A 2-rank group over `store` (a PrefixStore per link). Blocks until both ranks joined.
    nccl: the calling thread's device becomes `device` (the communicator is made on it)."""
    if backend == "nccl":
        index = torch.device(device).index  # ("cuda" alone: the process's first visible GPU)
        torch.cuda.set_device(0 if index is None else index)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _timeout(timeout)
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = _timeout(timeout)
    wildcard = host in ("0.0.0.0", "::", "")  # (--host 0.0.0.0): the address gloo resolves
    opts._devices = [dist.ProcessGroupGloo.create_default_device() if wildcard
                     else dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, opts)


class Page:
    """One page on the wire: header (room, first token, tokens, status) and its KV bytes."""

    def __init__(self, room: int, start: int, payload: Optional[torch.Tensor],
                 status: int = OK, ready_event=None):
        self.room, self.start, self.status = room, start, status
        self.payload = payload  # (L, 2, T, H_kv, D) contiguous, or None for CANCEL
        self.count = 0 if payload is None else payload.shape[2]
        self.ready_event = ready_event  # CUDA: the gather that filled payload

    def header(self, device) -> torch.Tensor:
        h = torch.tensor([self.room, self.start, self.count, self.status], dtype=torch.int64)
        if device.type != "cuda":
            return h
        # through pinned memory: no blocking copy on the link's stream (see _settle)
        return h.pin_memory().to(device, non_blocking=True)


class _Link:
    """Base: a group being built on a thread, pages in or out on another."""

    def __init__(self, name: str):
        self.name = name
        self.group = None
        self.dead: Optional[str] = None
        self.cv = threading.Condition()

    def _fail(self, why: str) -> None:
        with self.cv:
            if self.dead is None:
                self.dead = why
                logger.warning("disaggregation link %s failed: %s", self.name, why)
            self.cv.notify_all()


class SendLink(_Link):
    """Prefill side of one decode scheduler: pages go out in order on a thread."""

    def __init__(self, link_id: str, store, host: str, backend: str, timeout: float, device):
        super().__init__(link_id)
        self.device = device if backend == "nccl" else torch.device("cpu")
        self.jobs: "queue.SimpleQueue[Optional[Page]]" = queue.SimpleQueue()
        prefixed = dist.PrefixStore(f"pd/link/{link_id}/", store)
        self.thread = threading.Thread(target=self._run, name=f"pd-send-{link_id[:8]}",
                                       args=(prefixed, host, backend, timeout), daemon=True)
        self.thread.start()

    def send(self, page: Page) -> None:
        self.jobs.put(page)

    def close(self) -> None:
        self.jobs.put(None)

    def _run(self, store, host, backend, timeout) -> None:
        try:
            self.group = make_group(store, 0, host, backend, timeout, self.device)
        except Exception as e:
            self._fail(f"rendezvous: {type(e).__name__}: {e}")
            return
        with _own_stream(self.device):
            self._send_pages()

    def _send_pages(self) -> None:
        while True:
            page = self.jobs.get()
            if page is None or self.dead is not None:
                return
            try:
                self.group.send([page.header(self.device)], 1, 0).wait()
                if page.payload is not None:
                    if page.ready_event is not None:
                        _poll(page.ready_event)
                    data = page.payload.to(self.device).view(torch.uint8).reshape(-1)
                    self.group.send([data], 1, 0).wait()
                _settle(self.device)
            except Exception as e:
                self._fail(f"send: {type(e).__name__}: {e}")
                return


class RecvLink(_Link):
    """Decode side of one prefill server: connects, pushes READYs, receives pages in order.
    Events (to the scheduler, via `out`): ("page", room, start, payload) and ("fail", room, why).
    """

    def __init__(self, host: str, port: int, backend: str, timeout: float, device,
                 page_bytes_per_token: int, out: "queue.SimpleQueue"):
        super().__init__(f"{host}:{port}")
        self.link_id = uuid.uuid4().hex
        self.device = device if backend == "nccl" else torch.device("cpu")
        # gloo to a CUDA pool: pinned buffers, so the scheduler's copy to the device is async
        self.pin = backend != "nccl" and torch.device(device).type == "cuda"
        self.bytes_per_token = page_bytes_per_token
        self.out = out
        self.remaining: dict[int, int] = {}  # room -> tokens still to come
        self.ctl: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self.store = None
        self.thread = threading.Thread(target=self._run, name=f"pd-recv-{host}:{port}",
                                       args=(host, port, backend, timeout), daemon=True)
        self.thread.start()

    def expect(self, room: int, start: int, count: int) -> bool:
        """Register a room, then tell the prefill side (READY). False when the link is dead."""
        with self.cv:
            if self.dead is not None:
                return False
            if count:  # a full prefix hit expects no bytes (and must not post a recv)
                self.remaining[room] = count
                self.cv.notify_all()
        self.ctl.put(("ready", self.link_id, room, start, count))
        return True

    def close(self) -> None:
        self._fail("closed")

    def _fail(self, why: str) -> None:
        super()._fail(why)
        self.ctl.put(None)  # the control thread ends too
        with self.cv:
            rooms, self.remaining = list(self.remaining), {}
        for room in rooms:
            self.out.put(("fail", room, f"KV transfer from the prefill server {self.name} "
                                        f"failed: {why}"))

    def _run(self, host, port, backend, timeout) -> None:
        try:  # refused fails fast here; TCPStore itself retries until its timeout
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
            self.store = dist.TCPStore(host, port, None, False,
                                       timeout=_timeout(min(timeout, CONNECT_TIMEOUT_S)))
            self.store.queue_push(CTL_QUEUE, pickle.dumps(("hello", self.link_id)))
            self.group = make_group(dist.PrefixStore(f"pd/link/{self.link_id}/", self.store),
                                    1, _local_host(host), backend, timeout, self.device)
        except Exception as e:
            self._fail(f"bootstrap: {type(e).__name__}: {e}")
            return
        threading.Thread(target=self._control, name=f"pd-ctl-{host}:{port}",
                         daemon=True).start()
        with _own_stream(self.device):
            self._receive()

    def _control(self) -> None:
        """READY messages onto the prefill side's queue, in order."""
        while self.dead is None:
            msg = self.ctl.get()
            if msg is None:
                return
            try:
                self.store.queue_push(CTL_QUEUE, pickle.dumps(msg))
            except Exception as e:
                self._fail(f"handshake store: {type(e).__name__}: {e}")
                return

    def _receive(self) -> None:
        header = torch.empty(4, dtype=torch.int64, device=self.device)
        # the header reaches the host through pinned memory once the recv is done (_settle)
        header_host = torch.empty(4, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        while True:
            with self.cv:  # post a recv only while some room still expects bytes
                while self.dead is None and not self.remaining:
                    self.cv.wait()
                if self.dead is not None:
                    return
            try:
                self.group.recv([header], 0, 0).wait()
                if self.device.type == "cuda":
                    header_host.copy_(header, non_blocking=True)
                    _settle(self.device)
                else:
                    header_host.copy_(header)
                room, start, count, status = header_host.tolist()
                payload = None
                if count:
                    data = torch.empty(count * self.bytes_per_token, dtype=torch.uint8,
                                       device=self.device, pin_memory=self.pin)
                    self.group.recv([data], 0, 0).wait()
                    _settle(self.device)
                    payload = data
            except Exception as e:
                self._fail(f"receive: {type(e).__name__}: {e}")
                return
            with self.cv:
                left = self.remaining.get(room)
                if left is None:  # a room this side gave up on (timeout): its bytes are dropped
                    continue
                left -= count
                if status == CANCEL or left <= 0:
                    del self.remaining[room]
                else:
                    self.remaining[room] = left
            if status == CANCEL:
                self.out.put(("fail", room, "the prefill server dropped the request"))
            else:
                self.out.put(("page", room, start, payload))


def _local_host(remote: str) -> str:
    """The address this side's gloo device binds: loopback for a loopback peer, else the
    interface that routes to it."""
    if remote in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((remote, 9))
        return s.getsockname()[0]


def listen_store(host: str, port: int, timeout: float):
    """The prefill side's handshake store, bound to `host` only (TCPStore alone binds every
    interface): it serves on a socket bound here, which it then owns and closes when it goes
    (so the socket is detached: closing it here too would close whatever reused the number)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    port = sock.getsockname()[1]
    return dist.TCPStore(host, port, None, True, timeout=_timeout(timeout),
                         wait_for_workers=False, master_listen_fd=sock.detach())


def pop_control(store) -> list[tuple]:
    """Every control message waiting on the prefill side's store (non-blocking)."""
    msgs = []
    for _ in range(store.queue_len(CTL_QUEUE)):
        msgs.append(pickle.loads(store.queue_pop(CTL_QUEUE, False)))
    return msgs
