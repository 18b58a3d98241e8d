"""The disaggregation transfer (runtime/distributed/pd_transfer.py) in one process: a prefill-side
store and SendLink, a decode-side RecvLink, gloo over loopback. Pages reassemble bit-exactly, a
CANCEL closes its room, a silent peer fails the waiting room at the link's timeout, an
unreachable prefill server fails at once. (The servers' side: test_pd_disaggregation.py.)"""

from __future__ import annotations

import queue
import time

import pytest
import torch

from radixlm.net import free_port
from radixlm.runtime.distributed import pd_transfer as xfer
from radixlm.runtime.mem_cache.kv_pool import KVPool
from radixlm.runtime.scheduler.pd import gather_kv, scatter_kv

L, H, D = 2, 3, 4
BYTES_PER_TOKEN = 2 * L * H * D * 4  # fp32 K and V


def _control(store, n: int) -> list[tuple]:
    msgs, deadline = [], time.monotonic() + 10
    while len(msgs) < n:
        assert time.monotonic() < deadline, f"{n} control messages did not come"
        msgs += xfer.pop_control(store)
        time.sleep(0.01)
    return msgs


@pytest.fixture
def linked():
    """(store, sender, receiver, events): one link over the store, built as the servers do."""
    port = free_port()
    store = xfer.listen_store("127.0.0.1", port, 1.0)
    events: queue.SimpleQueue = queue.SimpleQueue()
    recv = xfer.RecvLink("127.0.0.1", port, "gloo", 1.0, torch.device("cpu"), BYTES_PER_TOKEN,
                         events)
    (kind, link_id), = _control(store, 1)
    assert kind == "hello"
    send = xfer.SendLink(link_id, store, "127.0.0.1", "gloo", 1.0, torch.device("cpu"))
    yield store, send, recv, events
    send.close()
    recv.close()


def test_pages_land_bit_exact_in_the_pool(linked):
    store, send, recv, events = linked
    src = KVPool(16, L, H, D, torch.float32, "cpu")
    dst = KVPool(16, L, H, D, torch.float32, "cpu")
    for k, v in zip(src.k_buffers, src.v_buffers):
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    src_slots, dst_slots = torch.tensor([3, 9, 4, 12, 7]), torch.tensor([1, 2, 15, 6, 5])
    assert recv.expect(room=11, start=2, count=5)
    assert _control(store, 1) == [("ready", recv.link_id, 11, 2, 5)]
    for lo, hi in ((0, 2), (2, 5)):  # two pages, tokens 2-3 and 4-6 of the prompt
        send.send(xfer.Page(11, 2 + lo, gather_kv(src, src_slots[lo:hi])))
    for _ in range(2):
        kind, room, start, payload = events.get(timeout=10)
        assert (kind, room) == ("page", 11)
        kv = payload.view(torch.float32).view(L, 2, -1, H, D)
        scatter_kv(dst, dst_slots[start - 2 : start - 2 + kv.shape[2]], kv)
    assert torch.equal(gather_kv(dst, dst_slots), gather_kv(src, src_slots))
    assert not recv.remaining  # the room is complete: no recv stays posted


def test_cancel_closes_the_room(linked):
    store, send, recv, events = linked
    assert recv.expect(room=12, start=0, count=7)
    _control(store, 1)
    send.send(xfer.Page(12, 0, None, status=xfer.CANCEL))
    kind, room, message = events.get(timeout=10)
    assert (kind, room) == ("fail", 12) and "dropped" in message
    assert not recv.remaining and recv.dead is None  # the link stays usable


def test_silent_prefill_fails_the_room_at_the_timeout(linked):
    store, send, recv, events = linked
    assert recv.expect(room=13, start=0, count=7)
    t0 = time.monotonic()
    kind, room, message = events.get(timeout=15)  # nothing is ever sent for it
    assert (kind, room) == ("fail", 13) and "Timed out" in message
    assert time.monotonic() - t0 < 5
    assert recv.dead is not None and not recv.expect(room=14, start=0, count=1)


def test_unreachable_prefill_fails_at_once():
    events: queue.SimpleQueue = queue.SimpleQueue()
    recv = xfer.RecvLink("127.0.0.1", free_port(), "gloo", 30.0, torch.device("cpu"),
                         BYTES_PER_TOKEN, events)
    if recv.expect(room=1, start=0, count=3):  # registered before the connection failed
        kind, room, message = events.get(timeout=10)
        assert (kind, room) == ("fail", 1) and "bootstrap" in message
    else:  # it had failed already: the caller fails the room itself (pd_decode._after_reserve)
        assert "bootstrap" in recv.dead
    recv.close()
