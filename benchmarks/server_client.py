"""A radixlm server in its own process, driven over HTTP the way SGLang's clients drive theirs:
for benchmarks whose `Engine` runs would share a process (and the GIL) between the scheduler
and the client. An in-process Engine's scheduler thread gives the GIL up inside every torch op,
and the client thread (the streams' results, their detokenization, asyncio) takes it: on an
H200 multi-turn run with the hierarchical cache ~3 s of the client's work sat beside the
scheduler's 24 s (cProfile, 2026-11-28). The server keeps the scheduler alone in its process.

    with ServerProcess(dict(model_path=..., max_total_tokens=...)) as srv:
        srv.generate(input_ids=[...], sampling_params={...})      # blocking, one result
        async for chunk in await srv.async_generate(input_ids=..., sampling_params=..., stream=True)
        srv.flush_cache(); srv.get_stats()                        # as Engine's

The keywords are ServerArgs fields (Engine's): each becomes its flag (`--max-total-tokens N`; a
True bool its bare flag; a dict its JSON).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
from typing import AsyncIterator, Optional

import httpx

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.dp_router import Proc  # noqa: E402  (a server subprocess: start, health, stop)

START_TIMEOUT_S = 900  # an 8B model's dummy weights and CUDA graphs on a cold machine


def server_flags(kw: dict) -> list[str]:
    """ServerArgs keywords -> launch_server's flags."""
    out: list[str] = []
    for k, v in kw.items():
        if v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        else:
            out += [flag, json.dumps(v) if isinstance(v, dict) else str(v)]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, kw: dict, port: Optional[int] = None):
        port = port or _free_port()
        self.base = f"http://127.0.0.1:{port}"
        self._logs = tempfile.mkdtemp(prefix="radixlm-server-")
        self.proc = Proc("server", [sys.executable, "-m", "radixlm.launch_server", "--port",
                                    str(port), *server_flags(kw)], self._logs, port)
        try:
            self.proc.wait_ready(START_TIMEOUT_S)
        except RuntimeError:
            self.shutdown()
            raise

    # --- Engine's calls -------------------------------------------------------------------------
    def generate(self, input_ids: list[int], sampling_params: dict) -> dict:
        r = httpx.post(self.base + "/generate", json={"input_ids": input_ids,
                                                      "sampling_params": sampling_params},
                       timeout=None)
        r.raise_for_status()
        return r.json()

    async def async_generate(self, input_ids: list[int], sampling_params: dict,
                             stream: bool = True) -> AsyncIterator[dict]:
        assert stream, "the benchmarks stream"
        return self._stream(input_ids, sampling_params)

    async def _stream(self, input_ids, sampling_params) -> AsyncIterator[dict]:
        if not hasattr(self, "_client"):  # one pooled client (in the caller's event loop)
            self._client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(
                max_connections=1024, max_keepalive_connections=1024))
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "stream": True}
        async with self._client.stream("POST", self.base + "/generate", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    yield json.loads(data)

    async def aclose(self) -> None:
        client = self.__dict__.pop("_client", None)
        if client is not None:
            await client.aclose()

    def flush_cache(self) -> None:
        httpx.post(self.base + "/flush_cache", timeout=60).raise_for_status()

    def get_stats(self) -> dict:
        r = httpx.get(self.base + "/get_server_info", timeout=60)
        r.raise_for_status()
        return r.json()["internal_states"][0]

    def shutdown(self) -> None:
        """SIGTERM: running requests finish and pending page writes reach the store (a restart
        phase reads them next), for up to 120 s."""
        self.proc.stop(timeout=120)
        shutil.rmtree(self._logs, ignore_errors=True)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
