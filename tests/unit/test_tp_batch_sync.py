"""batch_sync between two gloo ranks, without a model: every field of an EXTEND and a DECODE
batch arrives as sent (and of an EXTEND whose lens do not fit the header's message), the rows land in the worker's req_to_token, and a worker that waits for
its next batch longer than the TP group's timeout still gets it (an idle server: the wait is on
the host group, whose timeout is parallel_state.HOST_WAIT_TIMEOUT)."""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode

GROUP_TIMEOUT_S = 2.0  # the TP group's; rank 0 idles longer than this before its first batch
IDLE_S = 3.5


def _batches() -> list[ForwardBatch]:
    i64 = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    ext = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=i64([5, 6, 7, 8, 9]),
                       positions=i64([3, 4, 5, 0, 1]), out_cache_loc=i64([11, 12, 13, 21, 22]),
                       req_pool_indices=i64([2, 0]), seq_lens=i64([6, 2]),
                       logits_indices=i64([2, 4]), seq_lens_cpu=[6, 2],
                       extend_prefix_lens_cpu=[3, 0], extend_lens_cpu=[3, 2])
    dec = ForwardBatch(mode=ForwardMode.DECODE, input_ids=i64([1, 2]), positions=i64([6, 2]),
                       out_cache_loc=i64([14, 23]), req_pool_indices=i64([2, 0]),
                       seq_lens=i64([7, 3]), logits_indices=i64([0, 1]), seq_lens_cpu=[7, 3])
    # more rows than the header's message carries lens for (3 x 70 > INLINE_LENS): a second one
    rows = 70
    big = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=torch.arange(rows),
                       positions=i64([5, 1] * (rows // 2)), out_cache_loc=torch.arange(100, 170),
                       req_pool_indices=i64([2, 0] * (rows // 2)),
                       seq_lens=i64([6, 2] * (rows // 2)), logits_indices=torch.arange(rows),
                       seq_lens_cpu=[6, 2] * (rows // 2),
                       extend_prefix_lens_cpu=[5, 1] * (rows // 2), extend_lens_cpu=[1] * rows)
    return [ext, dec, big]


def _table(step: int) -> torch.Tensor:
    """Rank 0's req_to_token before step `step` (rows 0 and 2 in use, row 1 stale)."""
    t = torch.zeros(4, 16, dtype=torch.int64)
    t[2, :6] = torch.tensor([31, 32, 33, 11, 12, 13])
    t[0, :2] = torch.tensor([21, 22])
    t[1, :5] = 99
    if step == 1:
        t[2, 6], t[0, 2] = 14, 23
    return t


def _rank_main(rank: int, init_file: str, out: str) -> None:
    try:
        from radixlm.runtime.distributed import batch_sync, parallel_state

        tp = parallel_state.init_distributed(2, rank, f"file://{init_file}", "cpu",
                                              timeout_s=GROUP_TIMEOUT_S)
        if rank == 0:
            time.sleep(IDLE_S)
            for step, fb in enumerate(_batches()):
                batch_sync.send_batch(tp, fb, _table(step))
            batch_sync.send_stop(tp)
            got = None
        else:
            got, r2t = [], torch.zeros(4, 16, dtype=torch.int64)
            while (fb := batch_sync.recv_batch(tp, r2t, "cpu")) is not None:
                got.append({"mode": fb.mode.value} | {k: getattr(fb, k) for k in (
                    "input_ids", "positions", "out_cache_loc", "req_pool_indices",
                    "seq_lens", "logits_indices", "seq_lens_cpu", "extend_prefix_lens_cpu",
                    "extend_lens_cpu", "num_decode_tail")} | {"r2t": r2t.clone()})
        torch.save(got, f"{out}.{rank}")
        torch.distributed.barrier(group=tp.host_group)
        parallel_state.destroy_distributed(timeout_s=30.0)
    except BaseException:
        with open(f"{out}.{rank}.err", "w") as f:
            f.write(traceback.format_exc())
    sys.stdout.flush()
    os._exit(0)  # as tp_harness's ranks: skip the interpreter's teardown of torch's state


def test_batches_arrive_after_an_idle_longer_than_the_group_timeout(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    init_file, out = str(tmp_path / "init"), str(tmp_path / "out")
    procs = [ctx.Process(target=_rank_main, args=(r, init_file, out), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
    errs = [open(f"{out}.{r}.err").read() for r in range(2) if os.path.exists(f"{out}.{r}.err")]
    assert not errs, "\n".join(errs)
    got = torch.load(f"{out}.1")
    sent = _batches()
    assert len(got) == len(sent)
    for step, (want, have) in enumerate(zip(sent, got)):
        for key, value in have.items():
            if key == "r2t":
                rows = want.req_pool_indices.tolist()
                expect = _table(step)
                assert torch.equal(value[rows, :max(want.seq_lens_cpu)],
                                   expect[rows, :max(want.seq_lens_cpu)]), step
                assert value[1].eq(0).all(), "a row the batch does not read is not sent"
            elif key == "mode":
                assert value == want.mode.value, step
            elif isinstance(value, torch.Tensor):
                assert torch.equal(value, getattr(want, key)), (step, key)
            else:
                assert value == getattr(want, key), (step, key)
