"""What every child process of the server (scheduler, detokenizer) does first.

Kept apart from launch.py so that the children import nothing of the launcher: launch.py imports
scheduler_process / detokenizer_process (lazily, in the child), never the other way round.
"""

from __future__ import annotations

import logging
import os


def forget_parent_logging() -> None:
    """A forked child inherits the parent's handlers (with the parent's "[server" prefix), which
    would turn the child's own logging.basicConfig into a no-op."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)


def watch_parent() -> None:
    """In a child: exit when the parent process is gone (no orphans after a crash or kill -9)."""
    import threading
    import time

    parent = os.getppid()

    def loop():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=loop, daemon=True, name="watch-parent").start()
