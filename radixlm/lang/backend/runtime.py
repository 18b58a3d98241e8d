"""Runtime: starts a radixlm server subprocess and talks to it as a RuntimeEndpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Optional

import httpx

from radixlm.lang.backend.runtime_endpoint import RuntimeEndpoint
from radixlm.net import free_port

START_TIMEOUT_S = 300.0


class Runtime(RuntimeEndpoint):
    """SGLang's `Runtime(model_path=..., log_level=..., launch_timeout=..., **server_args)`: the
    keyword arguments are the server's flags (`max_total_tokens=...` -> `--max-total-tokens`).
    It is a RuntimeEndpoint itself; `runtime.endpoint` (what SGLang programs use) is itself."""

    def __init__(self, model_path: Optional[str] = None, log_file: Optional[str] = None,
                 log_level: Optional[str] = None, launch_timeout: float = START_TIMEOUT_S,
                 **server_args):
        if log_level is not None:
            server_args["log_level"] = log_level
        self.port = server_args.pop("port", None) or free_port()
        cmd = [sys.executable, "-m", "radixlm.launch_server", "--port", str(self.port)]
        if model_path:
            cmd += ["--model-path", model_path]
        for k, v in server_args.items():
            flag = "--" + k.replace("_", "-")
            if v is True:
                cmd.append(flag)
            elif v is not False and v is not None:
                cmd += [flag, str(v)]
        out = open(log_file, "ab") if log_file else subprocess.DEVNULL
        self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # its own group: one kill stops all
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + launch_timeout
        # one client for the polls: httpx.get builds a client (and a TLS context) per call, ~27 ms
        # of CPU, which made frequent polls cost more than the wait they shorten
        with httpx.Client(timeout=2) as poll:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the radixlm server exited during start-up (code "
                                       f"{self.process.returncode}); command: {' '.join(cmd)}")
                try:
                    if poll.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.shutdown()
                    raise TimeoutError(f"the radixlm server did not start in "
                                       f"{launch_timeout:.0f}s")
                time.sleep(0.1)
        super().__init__(url, api_key=server_args.get("api_key"))
        self.url = url
        self.generate_url = url + "/generate"

    def shutdown(self) -> None:
        proc = getattr(self, "process", None)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if hasattr(self, "client"):
            self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
