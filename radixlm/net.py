"""Free TCP ports for the processes radixlm starts (HTTP servers, DP replicas, TP rendezvous).

A port is chosen outside the kernel's ephemeral range (Linux: ip_local_port_range, 32768-60999 by
default). A port from that range, found free and released, can be handed by the kernel to any
socket that binds port 0 or connects out (gloo's pair sockets, a TCPStore, an HTTP client) before
the server binds it; that race failed a CI run ("address already in use" at start-up)."""

from __future__ import annotations

import random
import socket

_DEFAULT_EPHEMERAL = (32768, 60999)
_LOW = 10000  # below: well-known and registered service ports that other software expects


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A port on `host` that was free a moment ago, preferably outside the ephemeral range. Only
    when none of `tries` random candidates binds does it fall back to one the kernel picks."""
    lo, hi = _ephemeral_range()
    candidates = [p for p in ((_LOW, lo - 1), (hi + 1, 65535)) if p[1] > p[0]]
    if candidates:
        rng = random.SystemRandom()  # independent of any seed the caller set (tests seed random)
        weights = [b - a + 1 for a, b in candidates]
        for _ in range(tries):
            a, b = rng.choices(candidates, weights=weights)[0]
            port = rng.randint(a, b)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
