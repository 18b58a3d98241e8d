"""Safetensors files written one tensor at a time and read back as memory-mapped views, for the
start-up weight cache (cache.py); plus the all-or-nothing file writes the cache uses.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import struct
import tempfile
from typing import Any, Optional

logger = logging.getLogger(__name__)

# safetensors dtype names for the runtime dtypes (torch.dtype's str without "torch.")
ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_TORCH_DTYPES = {v: k for k, v in ST_DTYPES.items()}


# --- atomic files --------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_file(path: str, mode: str = "wb"):
    """Write `path` all-or-nothing: a temp file in the same directory, fsynced, then renamed.
    On any exception the temp file is removed and `path` is left as it was."""
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-" + os.path.basename(path) + "-")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache is readable like any cache
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def map_safetensors(path: str) -> Optional[list[tuple[str, Any]]]:
    """(name, tensor) views over a private memory map of the file, in file order, or None when
    the file is missing or damaged. Views, not copies: the model copies each tensor into its
    parameters straight from the page cache (safe_open's get_tensor would first copy it into
    fresh memory: one more pass over the weights, page faults included).
    Validity is checked by safetensors itself: the header's offsets must cover the file exactly,
    so a truncated or extended file is refused."""
    import torch
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(path):
        return None
    try:
        with safe_open(path, framework="pt"):
            pass
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            # ACCESS_COPY (MAP_PRIVATE): writable for torch, but a write never reaches the file
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        header.pop("__metadata__", None)
        data = torch.frombuffer(mapped, dtype=torch.uint8)[8 + n:]
        out = []
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            start, end = info["data_offsets"]
            dtype = getattr(torch, _TORCH_DTYPES[info["dtype"]])
            out.append((name, data[start:end].view(dtype).view(info["shape"])))
        return out
    except (SafetensorError, OSError, ValueError, KeyError, RuntimeError) as e:
        logger.warning("cache file %s is damaged (%s); rebuilding it", path, e)
        return None


class StreamWriter:
    """Writes a safetensors file one tensor at a time. The header (names, shapes, offsets) is
    known up front from the GGUF's tensor table. The file is renamed into place only by
    `commit()` after the last tensor: a consumer that stops early (an error in load_weights)
    leaves no cache file behind. A write error disables the writer, never the load."""

    def __init__(self, path: str, plan: list, dtype, ctx):
        self.path, self.plan, self.dtype, self.ctx = path, plan, dtype, ctx
        self.f = ctx.__enter__()
        self.next = 0

    @classmethod
    def create(cls, path: str, gguf_path: str, dtype, source_sha256: str,
               format_version: int) -> Optional["StreamWriter"]:
        import torch

        from radixlm.runtime.models.gguf_loader import gguf_weight_plan

        plan = gguf_weight_plan(gguf_path)
        elem = torch.empty((), dtype=dtype).element_size()
        dtype_name = str(dtype).removeprefix("torch.")
        header: dict[str, Any] = {"__metadata__": {"source_sha256": source_sha256,
                                                   "format_version": str(format_version)}}
        offset = 0
        for name, shape in plan:
            nbytes = elem
            for n in shape:
                nbytes *= n
            header[name] = {"dtype": ST_DTYPES[dtype_name], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header: data is 8-byte aligned
        ctx = atomic_file(path)
        try:
            w = cls(path, plan, dtype, ctx)
            w.f.write(struct.pack("<Q", len(raw)) + raw)
            return w
        except OSError as e:
            logger.warning("not caching weights in %s: %s", path, e)
            with contextlib.suppress(BaseException):
                ctx.__exit__(type(e), e, None)
            return None

    def write(self, name: str, t) -> Optional["StreamWriter"]:
        import torch

        want_name, want_shape = self.plan[self.next]
        self.next += 1
        if (name, tuple(t.shape), t.dtype) != (want_name, tuple(want_shape), self.dtype):
            # the plan and the reader disagree: a bug, but the tensors themselves are fine
            self.abort(RuntimeError(f"tensor {name} {tuple(t.shape)} {t.dtype} does not match "
                                    f"the planned {want_name} {want_shape} {self.dtype}"))
            return None
        try:
            self.f.write(t.contiguous().view(torch.uint8).numpy().data)
        except OSError as e:
            self.abort(e)
            return None
        return self

    def abort(self, e: BaseException) -> None:
        logger.warning("not caching weights in %s: %s", self.path, e)
        with contextlib.suppress(BaseException):
            self.ctx.__exit__(type(e), e, None)  # removes the temp file

    def commit(self) -> None:
        if self.next != len(self.plan):
            self.abort(RuntimeError(f"{self.next} of {len(self.plan)} tensors were written"))
            return
        try:
            self.ctx.__exit__(None, None, None)  # fsync + rename into place
            logger.info("cached weights in %s", self.path)
        except OSError as e:
            logger.warning("not caching weights in %s: %s", self.path, e)
