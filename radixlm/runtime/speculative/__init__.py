"""Speculative decoding: drafts, one verify forward, exact acceptance (see worker.py).

`create(args, sched)` returns the scheduler's speculator, or None when
`--speculative-algorithm` is not set; the flags are checked in spec_config.py.
"""

from __future__ import annotations

from radixlm.runtime.speculative.spec_config import SpecConfig, resolve


def create(args, sched):
    cfg: SpecConfig = resolve(args)
    if cfg is None:
        return None
    from radixlm.runtime.speculative.worker import NgramSpeculator

    return NgramSpeculator(cfg, sched)
