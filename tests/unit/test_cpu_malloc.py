"""executor/cpu_malloc: the glibc settings apply once on glibc (and are skipped when switched off),
and a big freed block then stays in malloc's heap and is handed out again, where glibc's defaults
give it a mapping of its own and unmap it on free (so its pages are faulted in anew each time).

What is checked is malloc's own bookkeeping (mallinfo2) and the block's address, not page-fault
counts: these VMs run DAMON's proactive pageout, which takes retained pages back at its own pace,
so fault counts of the tuned heap ranged from 0 to 60% of the default's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from radixlm.runtime.executor import cpu_malloc

SCRIPT = textwrap.dedent("""
    import ctypes, sys, torch
    from radixlm.runtime.executor import cpu_malloc
    applied = cpu_malloc.tune() if sys.argv[1] == "tune" else False

    class MallInfo2(ctypes.Structure):  # glibc >= 2.33, every field a size_t
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                    "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    big = 40 << 20  # above glibc's largest adaptive mmap threshold (32 MiB)
    for _ in range(3):  # warm up: the heap grows once
        torch.empty(big, dtype=torch.uint8).fill_(1)
    heap = libc.mallinfo2().arena  # bytes of heap malloc holds (brk)
    t = torch.empty(big, dtype=torch.uint8).fill_(1)
    mapped_live = libc.mallinfo2().hblkhd  # bytes in blocks that have a mapping of their own
    del t
    kept_free = libc.mallinfo2().fordblks  # free bytes malloc keeps in its heap
    for _ in range(10):  # fresh blocks, touched and freed: served from the kept heap
        torch.empty(big, dtype=torch.uint8).fill_(1)
    print(applied, mapped_live >= big, kept_free >= big, libc.mallinfo2().arena == heap)
""")


def run(mode: str, env=None) -> list[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                          check=True, env={**os.environ, **(env or {})}).stdout.split()


def _glibc_version() -> tuple[int, ...]:
    return tuple(int(x) for x in os.confstr("CS_GNU_LIBC_VERSION").split()[1].split(".")[:2])


@pytest.mark.skipif(not cpu_malloc._glibc() or _glibc_version() < (2, 33),
                    reason="glibc malloc settings, read back through mallinfo2 (glibc >= 2.33)")
def test_tune_keeps_big_blocks_in_the_heap():
    applied, own_mapping, kept, heap_same = run("tune")
    assert (applied, own_mapping, kept, heap_same) == ("True", "False", "True", "True")
    applied, own_mapping, kept, _ = run("tune", {cpu_malloc.ENV_VAR: "0"})
    # glibc's defaults: the block is a mapping of its own, unmapped (not kept) on free
    assert (applied, own_mapping, kept) == ("False", "True", "False")
