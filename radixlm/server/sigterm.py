"""Serving until stopped, then cleaning up, also when SIGTERM is what stopped it (the HTTP
server's launcher and the DP router's launcher both use it)."""

from __future__ import annotations

import signal


def run_then_clean_up(server, clean_up) -> None:
    """`server.run()` (uvicorn), then `clean_up()`, also when SIGTERM stopped the server.

    uvicorn handles SIGTERM while it serves (the graceful drain), then restores the handler it
    found and raises the signal again: with the default handler the process would die right
    there, before any `finally` of its caller, leaving its children to notice later (or never)
    and their resources behind. With this handler clean_up runs first; the process still ends
    by SIGTERM."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    terminated = False
    try:
        server.run()
    except _Terminated:
        terminated = True
    finally:
        clean_up()
    if terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)


class _Terminated(BaseException):
    """SIGTERM reached this process outside uvicorn's own handling (after its drain)."""


def _raise_terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up
    raise _Terminated()
