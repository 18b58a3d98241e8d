"""The scheduler's two disaggregation roles (--disaggregation-mode prefill | decode).

Who computes what: the prefill server computes the whole prompt (and its prompt logprobs) and
sends the KV of prompt tokens [start, n - 1) to the decode server; the decode server computes
the last prompt token itself, in a one-token extend, and samples the first output token there.
So sampling, stop conditions, grammars, output logprobs and streaming all run on one side, as
colocated, and the decode side recomputes one token, never the prompt. (SGLang instead samples
the first token on the prefill side and ships it with the KV.)

Prefix hits: the decode side matches prompt[:n - 1] against its own radix tree and asks only for
the tokens past the match (`start`); the match stays locked until the KV is in the tree.

A room's life on the decode side: reserve slots -> READY -> pages land in the slots -> the prompt
goes into the radix tree (the tree owns the slots) and the request enters the waiting queue with
its path locked; admission then finds n - 1 cached tokens. On a link failure, a CANCEL, or the
timeout, the reserved slots go back to the allocator and the request fails with an error.
On the prefill side a request waits (held) for its room's READY, then runs as a prompt-only
request (max_new_tokens 0); after every extend step the newly computed KV goes out in pages, on
the link's thread, while the next chunk computes. A request that ends before its KV is all sent
(abort, failure) sends CANCEL.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from typing import Optional

import torch

from radixlm.runtime.distributed import pd_transfer as xfer
from radixlm.runtime.request import Finish, FinishReason, Req

logger = logging.getLogger(__name__)

PAGE_TOKENS = 256  # tokens per page on the wire (one gather, one header)


def gather_kv(pool, slots: torch.Tensor) -> torch.Tensor:
    """slots (T,) -> (L, 2, T, H_kv, D): the pool's K and V at those slots, one tensor."""
    return torch.stack([torch.stack((k.index_select(0, slots), v.index_select(0, slots)))
                        for k, v in zip(pool.k_buffers, pool.v_buffers)])


def scatter_kv(pool, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """kv (L, 2, T, H_kv, D) into the pool at slots (T,)."""
    for layer, (k, v) in enumerate(zip(pool.k_buffers, pool.v_buffers)):
        k.index_copy_(0, slots, kv[layer, 0])
        v.index_copy_(0, slots, kv[layer, 1])


def _fail(req: Req, message: str, status: int) -> None:
    req.finish = Finish(FinishReason.ABORT, message=message, status=status)
    req.finished_at = time.perf_counter()


def _prefill_only(req: Req) -> None:
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
        self.store, self._sock = xfer.listen_store(args.host, args.disaggregation_bootstrap_port,
                                                   self.timeout)
        self.links: dict[str, xfer.SendLink] = {}
        self.held: dict[int, tuple[Req, float]] = {}  # room -> (request, deadline)
        self.readies: dict[int, tuple] = {}  # room -> (link id, start, count, deadline)
        self.sending: dict[int, dict] = {}  # id(req) -> {room, link, sent, end}
        sched.stats.update(pd_pages_sent=0, pd_tokens_sent=0)

    def add_request(self, req: Req, host: str, port: int, room: int) -> list[Req]:
        """Hold the request until its room's READY comes (host, port: this server's own)."""
        _prefill_only(req)
        if room in self.held or any(s["room"] == room for s in self.sending.values()):
            _fail(req, f"bootstrap_room {room} is already in use", 400)
            return [req]
        self.held[room] = (req, time.monotonic() + self.timeout)
        return self._match(room)

    def busy(self) -> bool:
        return bool(self.held or self.readies or self.sending)

    def held_slots(self) -> int:
        return 0  # a held request owns no KV yet; a sending one is a scheduler request

    def poll(self) -> list[Req]:
        """Control messages in, expired rooms out. Returns the requests failed here."""
        failed = []
        for msg in xfer.pop_control(self.store):
            if msg[0] == "hello":
                self.links[msg[1]] = xfer.SendLink(msg[1], self.store, self.host, self.backend,
                                                   self.timeout, self.sched.device)
            elif msg[0] == "ready":
                _, link_id, room, start, count = msg
                self.readies[room] = (link_id, start, count, time.monotonic() + self.timeout)
                failed += self._match(room)
        now = time.monotonic()
        for room, (req, deadline) in list(self.held.items()):
            if now > deadline:
                del self.held[room]
                _fail(req, f"no decode server claimed bootstrap_room {room} within "
                           f"{self.timeout:g} s (--disaggregation-timeout)", 504)
                failed.append(req)
        for room, (link_id, *_, deadline) in list(self.readies.items()):
            if now > deadline:  # the request never came here: the decode side stops waiting
                del self.readies[room]
                self._cancel(link_id, room)
        for link_id, link in list(self.links.items()):
            if link.dead is not None:
                del self.links[link_id]
        return failed

    def abort(self, rid: str) -> Optional[Req]:
        for room, (req, _) in list(self.held.items()):
            if req.rid == rid:
                del self.held[room]
                _fail(req, "aborted by request", 499)
                return req
        return None

    def _match(self, room: int) -> list[Req]:
        if room not in self.held or room not in self.readies:
            return []
        req, _ = self.held.pop(room)
        link_id, start, count, _ = self.readies.pop(room)
        n = len(req.origin_input_ids)
        if start + count != n - 1 or link_id not in self.links:
            self._cancel(link_id, room)
            _fail(req, f"bootstrap_room {room}: the decode server expects KV of tokens "
                       f"[{start}, {start + count}) of a {n}-token prompt (different prompts?)",
                  400)
            return [req]
        self.sending[id(req)] = {"room": room, "link": self.links[link_id], "sent": start,
                                 "end": start + count}
        self.sched.add_request(req)
        return []

    def _cancel(self, link_id: str, room: int) -> None:
        link = self.links.get(link_id)
        if link is not None:
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
                kv = gather_kv(self.pool, slots)
                event = None
                if kv.is_cuda:
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
        self._sock.close()


class DecodeSide:
    def __init__(self, sched, args):
        self.sched = sched
        self.pool = sched.runner.kv_pool
        self.backend = args.disaggregation_transfer_backend
        self.timeout = args.disaggregation_timeout
        L, (cap1, H, D) = len(self.pool.k_buffers), self.pool.k_buffers[0].shape
        self.bytes_per_token = 2 * L * H * D * self.pool.k_buffers[0].element_size()
        self.kv_shape = (L, 2, H, D)
        self.links: dict[tuple[str, int], xfer.RecvLink] = {}
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.rooms: dict[int, dict] = {}  # room -> {req, slots, start, got, node, deadline}
        self.wait_locks: dict[int, object] = {}  # id(req) -> tree node locked until admission
        sched.stats.update(pd_rooms=0, pd_tokens_received=0, pd_prefix_hit_tokens=0)

    def busy(self) -> bool:
        return bool(self.rooms)

    def held_slots(self) -> int:
        return sum(len(r["slots"]) for r in self.rooms.values())

    def add_request(self, req: Req, host: str, port: int, room: int) -> list[Req]:
        """Reserve the slots past the decode side's own prefix hit and send READY."""
        sched, tree = self.sched, self.sched.tree_cache
        req.logprob_start_len = -1  # prompt logprobs come from the prefill side (the router)
        if room in self.rooms:
            _fail(req, f"bootstrap_room {room} is already in use", 400)
            return [req]
        n = len(req.origin_input_ids)
        slots, node = tree.match_prefix(req.origin_input_ids[: n - 1])
        start, count = len(slots), max(n - 1 - len(slots), 0)
        tree.inc_lock_ref(node)
        if sched.allocator.available_size() < count:
            tree.evict(count - sched.allocator.available_size())
        new = sched.allocator.alloc(count) if count else slots[:0]
        if new is None:
            tree.dec_lock_ref(node)
            _fail(req, f"the decode server's KV pool has no room for {count} tokens now", 503)
            return [req]
        self.rooms[room] = {"req": req, "slots": new, "prefix": slots, "start": start,
                            "got": 0, "node": node,
                            "deadline": time.monotonic() + self.timeout}
        sched.stats["pd_rooms"] += 1
        sched.stats["pd_prefix_hit_tokens"] += start
        link = self.links.get((host, port))
        if link is None or link.dead is not None:
            link = xfer.RecvLink(host, port, self.backend, self.timeout, sched.device,
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
            kv = ev[3].view(self.pool.k_buffers[0].dtype)
            kv = kv.view(self.kv_shape[0], 2, -1, *self.kv_shape[2:]).to(self.sched.device)
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
        return failed

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
        _fail(r["req"], message, status)
        return [r["req"]]

    def abort(self, rid: str) -> Optional[Req]:
        for room, r in list(self.rooms.items()):
            if r["req"].rid == rid:
                return self._drop(room, "aborted by request", 499)[0]
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


def make_side(args, sched):
    """The scheduler's disaggregation role, or None when colocated."""
    if args.disaggregation_mode == "prefill":
        return PrefillSide(sched, args)
    if args.disaggregation_mode == "decode":
        return DecodeSide(sched, args)
    return None
