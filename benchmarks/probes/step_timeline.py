"""multiturn_profile.py --timeline: every forward, request and KV move of a run as JSON lines.

The compute stream's idle time between forwards (multiturn_profile's `between_s`) has two
causes the CUDA events around forwards cannot tell apart: the host launched the next forward
late (an admission round, a host sync), or the compute stream waited on the GPU (for a backup
before slots are reused). This records, beside each forward (kind, rows, new and prefix tokens
of an extend, the host's call and the GPU's span), each load (host -> device: tokens, when the
scheduler issued it, the GPU's time from its first DMA to its last scatter), each backup (device
-> host), each wait of the compute stream for backups (`guard_device_reuse`, with how many were
still copying) and each host wait for backups (`complete`), and each request's arrival, first
admission and first token. Times are ms from the first forward: `host_ms` on the host's clock,
`gpu_ms` on the GPU's (the first forward starts on an idle GPU, so the two are aligned there).
"""

from __future__ import annotations

import json
import time

import torch


class StepTimeline:
    def __init__(self):
        self.moves: list = []  # (kind, tokens, host t, call s, start event, end event, extra)

    def wrap_builds(self) -> None:
        """An event on the compute stream before each extend batch is built (its inputs' copy
        to the device is in the build): a forward whose start waited while this one did not
        waited inside the build (`build` records, `gpu_ms` when the stream reached it)."""
        from radixlm.runtime.scheduler import overlap_extend, scheduler

        for module in (scheduler, overlap_extend):
            real = module.build_extend

            def build(*args, _real=real, **kwargs):
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                t0 = time.perf_counter()
                out = _real(*args, **kwargs)
                self.moves.append(("build", len(args[0]), t0, time.perf_counter() - t0, ev, ev,
                                   None))
                return out

            module.build_extend = build

    def wrap_mover(self, mover) -> None:
        """Record every load, backup and wait of the cache's KVMover (CUDA)."""
        def timed(name, real, stream_of):
            def call(*args, **kwargs):
                start, end = (torch.cuda.Event(enable_timing=True),
                              torch.cuda.Event(enable_timing=True))
                start.record(stream_of())
                t0 = time.perf_counter()
                out = real(*args, **kwargs)
                call_s = time.perf_counter() - t0
                end.record(stream_of(True))
                self.moves.append((name, int(args[0].numel()), t0, call_s, start, end, None))
                return out
            return call

        mover.to_device = timed("load", mover.to_device,
                                lambda after=False: mover.scatter_stream if after
                                else mover.load_stream)
        mover.to_host = timed("backup", mover.to_host, lambda after=False: mover.stream)
        real_guard, real_complete = mover.guard_device_reuse, mover.complete

        def guard(events):
            pending = sum(1 for e in events if e is not None and not e.query())
            if pending:
                self.moves.append(("compute_waits_backups", pending, time.perf_counter(), 0.0,
                                   None, None, None))
            return real_guard(events)

        def complete(loads=False):
            t0 = time.perf_counter()
            waiting = len(mover._backups)
            real_complete(loads)
            if waiting:
                self.moves.append(("host_waits_backups", waiting, t0, time.perf_counter() - t0,
                                   None, None, None))

        mover.guard_device_reuse, mover.complete = guard, complete

    def write(self, path: str, marks: list, seen: dict) -> None:
        torch.cuda.synchronize()
        first, host0 = marks[0][2], marks[0][5]

        def ms(t):
            return round((t - host0) * 1e3, 2)

        with open(path, "w") as f:
            for kind, rows, start, end, host, t0, new, prefix in marks:
                f.write(json.dumps({"step": kind, "rows": rows, "new": new, "prefix": prefix,
                                    "host_ms": ms(t0), "call_ms": round(host * 1e3, 2),
                                    "gpu_ms": round(first.elapsed_time(start), 2),
                                    "gpu_span_ms": round(start.elapsed_time(end), 2)}) + "\n")
            for kind, tokens, t0, call_s, start, end, _ in self.moves:
                rec = {"move": kind, "n": tokens, "host_ms": ms(t0),
                       "call_ms": round(call_s * 1e3, 2)}
                if start is not None:
                    rec["gpu_ms"] = round(first.elapsed_time(start), 2)
                    rec["gpu_span_ms"] = round(start.elapsed_time(end), 2)
                f.write(json.dumps(rec) + "\n")
            for created, admitted, token in seen.values():
                f.write(json.dumps({"req": ms(created), "admitted": ms(admitted),
                                    "token": None if token is None else ms(token)}) + "\n")
