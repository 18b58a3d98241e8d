"""One data-parallel replica: `python -m radixlm.router.replica`, started by dp.py.

Its ServerArgs come as JSON in RADIXLM_REPLICA_ARGS (every field is a str / number / bool /
None), its GPUs and CPU threads as CUDA_VISIBLE_DEVICES / OMP_NUM_THREADS set by the launcher
before this interpreter started, so torch sees only this replica's devices from its first import.

A replica is a normal server (launch_server: scheduler, detokenizer, TP ranks) on an internal
port. It must not outlive the launcher: Linux's PR_SET_PDEATHSIG sends it SIGTERM when the
launcher dies, even by SIGKILL (no watcher thread: launch_server forks its children only while it
has a single thread), and its own children already follow it (child_process.watch_parent).
"""

from __future__ import annotations

import json
import os
import signal
import sys

from radixlm.router.args import ARGS_ENV, PARENT_ENV


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when the process that started it exits (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        raise SystemExit(1)


def main() -> None:
    die_with_parent(int(os.environ[PARENT_ENV]))
    from radixlm.runtime.config import ServerArgs
    from radixlm.server.launch import launch_server

    launch_server(ServerArgs(**json.loads(os.environ[ARGS_ENV])))


if __name__ == "__main__":
    main()
