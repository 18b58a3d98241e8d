"""executor/cpu_malloc: the glibc settings apply once on glibc (and are skipped when switched off);
a big block then comes from malloc's heap and stays there when freed, where glibc's defaults give
it a mapping of its own and unmap it on free (so its pages are faulted in anew each time).

Checked through malloc's own bookkeeping (mallinfo2), not page-fault counts: how much of the kept
heap a later block reuses depends on the allocation sequence. torch allocates with
posix_memalign(64), which asks malloc for the size plus the alignment; a freed block of the same
size is then a little too small for the next such request, so a loop of equal 40 MiB blocks still
grew the heap in 4-6 of 10 rounds (measured here, 2026-11-27; plain malloc reused the block every
time), and the fault counts of such a test varied from 0 to 60% of the default's."""

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
    t = torch.empty(big, dtype=torch.uint8).fill_(1)
    mapped_live = libc.mallinfo2().hblkhd  # bytes in blocks that have a mapping of their own
    del t
    kept_free = libc.mallinfo2().fordblks  # free bytes malloc keeps in its heap
    print(applied, mapped_live >= big, kept_free >= big)
""")


def run(mode: str, env=None) -> list[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                          check=True, env={**os.environ, **(env or {})}).stdout.split()


def _glibc_version() -> tuple[int, ...]:
    return tuple(int(x) for x in os.confstr("CS_GNU_LIBC_VERSION").split()[1].split(".")[:2])


@pytest.mark.skipif(not cpu_malloc._glibc() or _glibc_version() < (2, 33),
                    reason="glibc malloc settings, read back through mallinfo2 (glibc >= 2.33)")
def test_tune_keeps_big_blocks_in_the_heap():
    applied, own_mapping, kept = run("tune")
    assert (applied, own_mapping, kept) == ("True", "False", "True")
    applied, own_mapping, kept = run("tune", {cpu_malloc.ENV_VAR: "0"})
    # glibc's defaults: the block is a mapping of its own, unmapped (not kept) on free
    assert (applied, own_mapping, kept) == ("False", "True", "False")
