"""The prefill role of disaggregation (see pd.py): hold each request until its decode server's
READY names the tokens to send, run it prompt-only, send its KV in pages after every extend."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from radixlm.runtime.distributed import pd_transfer as xfer
from radixlm.runtime.request import Req
from radixlm.runtime.scheduler.pd import PAGE_TOKENS, fail, gather_kv, link_timeout

POLL_S = 0.001


def prefill_only(req: Req) -> None:
    """The prefill side's copy of a request computes its prompt and stops: no output, no
    grammar (the decode side samples)."""
    req.sampling_params = dataclasses.replace(req.sampling_params, max_new_tokens=0,
                                              regex=None, json_schema=None, ebnf=None,
                                              structural_tag=None)


class PrefillSide:
    def __init__(self, sched, args):
        self.sched = sched
        self.pool = sched.runner.kv_pool
        self.backend = args.disaggregation_transfer_backend
        self.timeout = args.disaggregation_timeout
        self.host = args.host
        self.store = xfer.listen_store(args.host, args.disaggregation_bootstrap_port,
                                       self.timeout)
        self.links: dict[str, xfer.SendLink] = {}
        self.held: dict[int, tuple[Req, float]] = {}  # room -> (request, deadline)
        self.readies: dict[int, tuple] = {}  # room -> (link id, start, count, deadline)
        self.sending: dict[int, dict] = {}  # id(req) -> {room, link, sent, end}
        self._next_poll = 0.0
        sched.stats.update(pd_pages_sent=0, pd_tokens_sent=0)

    def add_request(self, req: Req, host: str, port: int, room: int) -> list[Req]:
        """Hold the request until its room's READY comes (host, port: this server's own)."""
        prefill_only(req)
        if room in self.held or any(s["room"] == room for s in self.sending.values()):
            fail(req, f"bootstrap_room {room} is already in use", 400)
            return [req]
        self.held[room] = (req, time.monotonic() + self.timeout)
        return self._match(room)

    def busy(self) -> bool:
        return bool(self.held or self.readies or self.sending)

    def held_slots(self) -> int:
        return 0  # a held request owns no KV yet; a sending one is a scheduler request

    def poll(self) -> list[Req]:
        """Control messages in, expired rooms out. Returns the requests failed here. The store
        is read at most every POLL_S (a read is a round trip to its server thread)."""
        now = time.monotonic()
        if now < self._next_poll:
            return []
        self._next_poll = now + POLL_S
        failed = []
        for msg in xfer.pop_control(self.store):
            if msg[0] == "hello":
                self.links[msg[1]] = xfer.SendLink(msg[1], self.store, self.host, self.backend,
                                                   link_timeout(self.timeout), self.sched.device)
            elif msg[0] == "ready":
                _, link_id, room, start, count = msg
                self.readies[room] = (link_id, start, count, time.monotonic() + self.timeout)
                failed += self._match(room)
        now = time.monotonic()
        for room, (req, deadline) in list(self.held.items()):
            if now > deadline:
                del self.held[room]
                fail(req, f"no decode server claimed bootstrap_room {room} within "
                           f"{self.timeout:g} s (--disaggregation-timeout)", 504)
                failed.append(req)
        for room, (link_id, _, count, deadline) in list(self.readies.items()):
            if now > deadline:  # the request never came here: the decode side stops waiting
                del self.readies[room]
                self._cancel(link_id, room, count)
        for link_id, link in list(self.links.items()):
            if link.dead is not None:
                del self.links[link_id]
        return failed

    def abort(self, rid: str) -> Optional[Req]:
        for room, (req, _) in list(self.held.items()):
            if req.rid == rid:
                del self.held[room]
                fail(req, "aborted by request", 499)
                return req
        return None

    def _match(self, room: int) -> list[Req]:
        if room not in self.held or room not in self.readies:
            return []
        req, _ = self.held.pop(room)
        link_id, start, count, _ = self.readies.pop(room)
        n = len(req.origin_input_ids)
        if start + count != n - 1 or link_id not in self.links:
            self._cancel(link_id, room, count)
            fail(req, f"bootstrap_room {room}: the decode server expects KV of tokens "
                       f"[{start}, {start + count}) of a {n}-token prompt (different prompts?)",
                  400)
            return [req]
        self.sending[id(req)] = {"room": room, "link": self.links[link_id], "sent": start,
                                 "end": start + count}
        self.sched.add_request(req)
        return []

    def _cancel(self, link_id: str, room: int, count: int) -> None:
        """Close a room the decode side waits bytes for (one expecting none has no recv posted:
        a page for it would block the link)."""
        link = self.links.get(link_id)
        if link is not None and count > 0:
            link.send(xfer.Page(room, 0, None, status=xfer.CANCEL))

    def after_extend(self, reqs: list[Req]) -> None:
        """The KV this step computed (and the cached prefix before it, the first time) goes out
        in pages: gathered now (ordered after the forward), sent on the link's thread."""
        rt = self.sched.req_pool.req_to_token
        for req in reqs:
            s = self.sending.get(id(req))
            if s is None or req.finished:
                continue
            upto = min(req.kv_len, s["end"])
            while s["sent"] < upto:
                hi = min(upto, s["sent"] + PAGE_TOKENS)
                slots = rt[req.req_pool_idx, s["sent"]:hi]
                kv = gather_kv(self.pool, slots)  # (L, 2, T, H_kv, D)
                event = None
                if kv.is_cuda:
                    if self.backend == "gloo":  # to pinned host memory now: queued pages must
                        host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
                        kv = host.copy_(kv, non_blocking=True)  # not hold device memory
                    event = torch.cuda.Event()
                    event.record()
                s["link"].send(xfer.Page(s["room"], s["sent"], kv, ready_event=event))
                self.sched.stats["pd_pages_sent"] += 1
                self.sched.stats["pd_tokens_sent"] += hi - s["sent"]
                s["sent"] = hi

    def release_wait_lock(self, req: Req) -> None:
        pass  # (the decode role's)

    def on_finish(self, req: Req) -> None:
        s = self.sending.pop(id(req), None)
        if s is not None and s["sent"] < s["end"]:
            s["link"].send(xfer.Page(s["room"], 0, None, status=xfer.CANCEL))

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.store = None  # (the store closes its socket when the last reference goes)
