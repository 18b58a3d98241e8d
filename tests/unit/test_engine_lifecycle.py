"""Engine life cycle: a context manager whose shutdown() gives back the weights, the KV pool and
the threads, so engines created and shut down one after another in one process end where they
started. Measured: the process RSS after gc.collect() and glibc's malloc_trim(0) (which returns
freed heap pages to the OS; without it freed arenas stay resident and RSS says nothing). The
baseline is taken after one engine has come and gone: the first one loads libraries, OpenMP
teams and torch's lazy state, which stay by design."""

from __future__ import annotations

import ast
import ctypes
import gc
import pathlib
import threading

import psutil
import pytest

from radixlm.runtime.engine import Engine
from tests.tiny_models import write_tiny_llama


def _rss_after_trim() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny")), vocab=512, heads=4,
                            kv_heads=2, tied=True, hidden=64, inter=96)


def _one(path: str) -> Engine:
    # a 64K-token KV pool (~33 MB): an engine that kept it would move RSS past 1% at once
    with Engine(path, skip_tokenizer_init=True, max_total_tokens=1 << 16, device="cpu") as e:
        out = e.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4,
                                                               "temperature": 0})
        assert len(out["output_ids"]) == 4
    return e


def test_twenty_engines_end_with_the_memory_they_started_with(tiny):
    threads_before = threading.active_count()
    _one(tiny)  # warm-up: libraries, thread pools, allocator arenas
    start = _rss_after_trim()
    kept = [_one(tiny) for _ in range(20)]  # still referenced: shutdown() itself must release
    end = _rss_after_trim()
    # a leak grows RSS; in a test worker RSS may also shrink (the kernel drops clean pages of
    # files other tests' engines mapped: seen once, 62 MB below the start), which is no leak
    assert end - start <= 0.01 * start, (start, end)
    assert threading.active_count() <= threads_before
    assert all(e.runner is None for e in kept)


def test_shutdown_releases_and_later_calls_say_so(tiny):
    e = Engine(tiny, skip_tokenizer_init=True, max_total_tokens=4096, device="cpu")
    e.shutdown()
    e.shutdown()  # idempotent
    assert e.runner is None and e.scheduler is None
    with pytest.raises(RuntimeError, match="shut down"):
        e.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})


def test_no_model_file_is_unpickled():
    """Weights load from safetensors / GGUF only: no torch.load, pickle.load or numpy's
    allow_pickle anywhere in the package (pickle.loads of our own IPC messages is allowed)."""
    root = pathlib.Path(__file__).resolve().parents[2] / "radixlm"
    bad = []
    for f in root.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = node.func.attr
                owner = getattr(node.func.value, "id", "")
                if (owner, name) in (("torch", "load"), ("pickle", "load"), ("np", "load"),
                                     ("numpy", "load")):
                    weights_only = any(k.arg == "weights_only" and getattr(k.value, "value", 0)
                                       is True for k in node.keywords)
                    if not weights_only:
                        bad.append(f"{f.relative_to(root)}:{node.lineno}")
    assert not bad, bad


def test_context_longer_than_the_model_is_refused_at_start(tiny):
    """Past max_position_embeddings (512 here) the rotary tables end: such a server used to
    crash its scheduler when a request reached that position (found killing processes under
    load with the tiny model and --context-length 4096)."""
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Engine(tiny, skip_tokenizer_init=True, device="cpu", context_length=1024)
    with Engine(tiny, skip_tokenizer_init=True, device="cpu", context_length=512) as e:
        assert e.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2})["output_ids"]
