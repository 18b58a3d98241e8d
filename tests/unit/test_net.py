"""radixlm.net.free_port: a bindable port outside the kernel's ephemeral range, whatever the
caller seeded `random` with; the fallback when no candidate binds."""

from __future__ import annotations

import random
import socket

from radixlm import net


def test_port_is_bindable_and_outside_the_ephemeral_range():
    lo, hi = net._ephemeral_range()
    seen = set()
    for _ in range(20):
        random.seed(0)  # tests seed the global RNG: the ports must not repeat because of it
        port = net.free_port()
        assert not lo <= port <= hi and port >= net._LOW
        seen.add(port)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    assert len(seen) > 1


def test_falls_back_to_a_kernel_port_when_no_candidate_binds(monkeypatch):
    monkeypatch.setattr(net, "_bindable", lambda host, port: False)
    port = net.free_port(tries=3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
