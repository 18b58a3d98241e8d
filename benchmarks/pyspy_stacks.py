"""py-spy over a served model's processes: record raw stacks, then the top frames per process.

Used by dp_router.py (--spy-dir) and probes/dp_profile.py. It sits below both so that neither
imports the other for it (the probe drives dp_router; dp_router must not reach back up).
"""

from __future__ import annotations

import collections
import subprocess


def record(pid: int, seconds: float, raw_path: str) -> None:
    """py-spy raw stacks of `pid` and its children for `seconds` at 100 Hz into `raw_path`
    (py-spy's own output is dropped; a missing file afterwards means it did not run)."""
    subprocess.run(["py-spy", "record", "--pid", str(pid), "--subprocesses",
                    "--duration", str(int(seconds)), "--rate", "100", "--format", "raw",
                    "--output", raw_path], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def summarize(raw_path: str, top: int = 25) -> str:
    """py-spy raw lines ('frame;frame;... count') -> top own and inclusive frames per process."""
    own: dict = collections.defaultdict(collections.Counter)
    incl: dict = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    with open(raw_path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if not n.isdigit():
                continue
            frames = stack.split(";")
            # a child's stack starts with its parent's frames: the innermost "process" frame
            at = max((i for i, fr in enumerate(frames) if fr.startswith("process")), default=-1)
            proc = frames[at] if at >= 0 else "?"
            totals[proc] += int(n)
            own[proc][frames[-1]] += int(n)
            for fr in set(frames[at + 1:]):
                incl[proc][fr] += int(n)
    out = []
    for proc, tot in totals.most_common():
        out.append(f"== {proc[:160]}: {tot} samples")
        out += [f"own  {100 * v / tot:5.1f}% {k[:150]}" for k, v in own[proc].most_common(top)]
        out += [f"incl {100 * v / tot:5.1f}% {k[:150]}" for k, v in incl[proc].most_common(top)]
    return "\n".join(out)
