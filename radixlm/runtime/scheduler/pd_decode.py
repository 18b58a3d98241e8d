"""The decode role of disaggregation (see pd.py): reserve slots past its own prefix hit, land
the received pages, put the prompt into the radix tree and queue the request."""

from __future__ import annotations

import queue
import time
from typing import Optional

import torch

from radixlm.runtime.distributed import pd_transfer as xfer
from radixlm.runtime.request import Req
from radixlm.runtime.scheduler.pd import fail, link_timeout, scatter_kv


class DecodeSide:
    def __init__(self, sched, args):
        self.sched = sched
        self.pool = sched.runner.kv_pool
        self.backend = args.disaggregation_transfer_backend
        self.timeout = args.disaggregation_timeout
        L, (_, H, D) = len(self.pool.k_buffers), self.pool.k_buffers[0].shape  # (cap + 1, H, D)
        self.bytes_per_token = 2 * L * H * D * self.pool.k_buffers[0].element_size()
        self.kv_shape = (L, 2, H, D)
        self.links: dict[tuple[str, int], xfer.RecvLink] = {}
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.rooms: dict[int, dict] = {}  # room -> {req, slots, start, got, node, deadline}
        self.wait_locks: dict[int, object] = {}  # id(req) -> tree node locked until admission
        # (req, host, port, room, deadline) waiting for free slots, first come first served
        self.unreserved: list[tuple] = []
        sched.stats.update(pd_rooms=0, pd_tokens_received=0, pd_prefix_hit_tokens=0)

    def busy(self) -> bool:
        return bool(self.rooms or self.unreserved)

    def held_slots(self) -> int:
        return sum(len(r["slots"]) for r in self.rooms.values())

    def add_request(self, req: Req, host: str, port: int, room: int) -> list[Req]:
        """Reserve the slots past the decode side's own prefix hit and send READY; while the
        pool has no room, the request waits (in order, within the timeout)."""
        req.logprob_start_len = -1  # prompt logprobs come from the prefill side (the router)
        if room in self.rooms or any(w[3] == room for w in self.unreserved):
            fail(req, f"bootstrap_room {room} is already in use", 400)
            return [req]
        n = len(req.origin_input_ids)
        if n - 1 > self.sched.allocator.capacity:
            fail(req, f"the prompt ({n} tokens) does not fit the decode server's KV pool", 400)
            return [req]
        self.unreserved.append((req, host, port, room, time.monotonic() + self.timeout))
        return self._reserve_waiting()

    def _reserve_waiting(self) -> list[Req]:
        failed = []
        while self.unreserved:
            req, host, port, room, deadline = self.unreserved[0]
            if time.monotonic() > deadline:
                self.unreserved.pop(0)
                fail(req, f"the decode server's KV pool had no room for the prompt within "
                           f"{self.timeout:g} s (--disaggregation-timeout)", 503)
                failed.append(req)
                continue
            if not self._reserve(req, host, port, room, deadline):
                break
            self.unreserved.pop(0)
            failed += self._after_reserve(req, host, port, room)
        return failed

    def _reserve(self, req: Req, host: str, port: int, room: int, deadline: float) -> bool:
        sched, tree = self.sched, self.sched.tree_cache
        n = len(req.origin_input_ids)
        slots, node = tree.match_prefix(req.origin_input_ids[: n - 1])
        start, count = len(slots), max(n - 1 - len(slots), 0)
        tree.inc_lock_ref(node)
        if sched.allocator.available_size() < count:
            tree.evict(count - sched.allocator.available_size())
        new = sched.allocator.alloc(count) if count else slots[:0]
        if new is None:
            tree.dec_lock_ref(node)
            return False
        self.rooms[room] = {"req": req, "slots": new, "prefix": slots, "start": start,
                            "got": 0, "node": node, "deadline": deadline}
        sched.stats["pd_rooms"] += 1
        sched.stats["pd_prefix_hit_tokens"] += start
        return True

    def _after_reserve(self, req: Req, host: str, port: int, room: int) -> list[Req]:
        """READY to the prefill server, over its link (built on first use)."""
        start, count = self.rooms[room]["start"], len(self.rooms[room]["slots"])
        link = self.links.get((host, port))
        if link is None or link.dead is not None:
            link = xfer.RecvLink(host, port, self.backend, link_timeout(self.timeout),
                                 self.sched.device,
                                 self.bytes_per_token, self.events)
            self.links[(host, port)] = link
        if not link.expect(room, start, count):
            return self._drop(room, f"the link to the prefill server {host}:{port} is down: "
                                    f"{link.dead}", 502)
        return self._complete(room) if count == 0 else []

    def poll(self) -> list[Req]:
        """Land arrived pages; fail rooms whose link failed or whose time ran out. Returns the
        requests failed here (admitted ones joined the waiting queue)."""
        failed = []
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                break
            room = ev[1]
            if room not in self.rooms:
                continue  # a room already failed or aborted here
            if ev[0] == "fail":
                failed += self._drop(room, ev[2], 502)
                continue
            r = self.rooms[room]
            if ev[3].is_cuda:  # received on the link's stream: keep its block until ours used it
                ev[3].record_stream(torch.cuda.current_stream(ev[3].device))
            kv = ev[3].view(self.pool.k_buffers[0].dtype)
            kv = kv.view(self.kv_shape[0], 2, -1, *self.kv_shape[2:])  # (L, 2, T, H_kv, D)
            kv = kv.to(self.sched.device, non_blocking=True)  # (pinned: ordered before scatter)
            lo = ev[2] - r["start"]
            scatter_kv(self.pool, r["slots"][lo : lo + kv.shape[2]], kv)
            r["got"] += kv.shape[2]
            self.sched.stats["pd_tokens_received"] += kv.shape[2]
            if r["got"] >= len(r["slots"]):
                failed += self._complete(room)
        now = time.monotonic()
        for room in [k for k, r in self.rooms.items() if now > r["deadline"]]:
            failed += self._drop(room, f"the prompt's KV did not arrive within "
                                       f"{self.timeout:g} s (--disaggregation-timeout)", 504)
        return failed + self._reserve_waiting()

    def _complete(self, room: int) -> list[Req]:
        """All pages landed: the prompt goes into the tree, the request into the waiting queue
        with its path locked until admission (so no eviction can take it before)."""
        r = self.rooms.pop(room)
        req, tree = r["req"], self.sched.tree_cache
        tokens = req.origin_input_ids[: len(req.origin_input_ids) - 1]
        have = tree.insert(tokens, torch.cat((r["prefix"], r["slots"])))
        if have > r["start"]:  # another request inserted some of these meanwhile: ours go back
            self.sched.allocator.free(r["slots"][: have - r["start"]])
        tree.dec_lock_ref(r["node"])
        _, node = tree.match_prefix(tokens)
        tree.inc_lock_ref(node)
        self.wait_locks[id(req)] = node
        self.sched.add_request(req)
        return []

    def _drop(self, room: int, message: str, status: int) -> list[Req]:
        r = self.rooms.pop(room)
        if len(r["slots"]):
            self.sched.allocator.free(r["slots"])
        self.sched.tree_cache.dec_lock_ref(r["node"])
        fail(r["req"], message, status)
        return [r["req"]]

    def abort(self, rid: str) -> Optional[Req]:
        for room, r in list(self.rooms.items()):
            if r["req"].rid == rid:
                return self._drop(room, "aborted by request", 499)[0]
        for i, (req, *_) in enumerate(self.unreserved):
            if req.rid == rid:
                self.unreserved.pop(i)
                fail(req, "aborted by request", 499)
                return req
        return None

    def release_wait_lock(self, req: Req) -> None:
        """The request was admitted (its own lock now holds the path) or left the queue."""
        node = self.wait_locks.pop(id(req), None)
        if node is not None:
            self.sched.tree_cache.dec_lock_ref(node)

    def after_extend(self, reqs: list[Req]) -> None:
        pass

    def on_finish(self, req: Req) -> None:
        self.release_wait_lock(req)

    def close(self) -> None:
        for link in self.links.values():
            link.close()
