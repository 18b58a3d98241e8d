"""Tensor-parallel test harness: random Llama checkpoints, a fixed sequence of forward batches
run through a ModelRunner, and N gloo ranks in spawned processes running the same sequence
(rank 0 builds the batches, its runner broadcasts each; the others receive and run them, as
distributed/tp_worker's workers do).

The batches (all requests' K/V in one pool, slots handed out here):
  1. EXTEND: A (12 tokens) and B (7 tokens), no prefix
  2. EXTEND mixed: C (8 tokens of A's prefix cached, 5 new) + A decoding (num_decode_tail=1)
  3. DECODE: A, B, C      4. DECODE: A, B, C
Each step's next tokens are the argmax of its logits, so tokens that differ between TP=1 and
TP=N change every later step's inputs (the greedy-token comparison is end to end).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch
import torch.distributed

from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from tiny_models import write_tiny_llama  # noqa: F401  (th.write_tiny_llama)

TIMEOUT_S = 240.0  # one rank's whole run; a hung collective never blocks the test run longer




def _batch(runner, mode, reqs, num_decode_tail=0) -> ForwardBatch:
    """reqs: (row, kv_len, new token ids) each; writes the new tokens' slots into req_to_token."""
    r2t = runner.req_to_token_pool.req_to_token
    ids, pos, locs, logit_rows = [], [], [], []
    for row, kv_len, new in reqs:
        n = len(new)
        slots = torch.arange(runner._next_slot, runner._next_slot + n, device=runner.device)
        runner._next_slot += n
        r2t[row, kv_len : kv_len + n] = slots
        ids += new
        pos += list(range(kv_len, kv_len + n))
        locs.append(slots)
        logit_rows.append(len(ids) - 1)
    i64 = lambda x: torch.tensor(x, dtype=torch.int64, device=runner.device)  # noqa: E731
    return ForwardBatch(
        mode=mode, input_ids=i64(ids), positions=i64(pos), out_cache_loc=torch.cat(locs),
        req_pool_indices=i64([r[0] for r in reqs]),
        seq_lens=i64([r[1] + len(r[2]) for r in reqs]), logits_indices=i64(logit_rows),
        seq_lens_cpu=[r[1] + len(r[2]) for r in reqs],
        extend_prefix_lens_cpu=[r[1] for r in reqs], extend_lens_cpu=[len(r[2]) for r in reqs],
        num_decode_tail=num_decode_tail)


def run_fixed_batches(runner, vocab: int) -> list[torch.Tensor]:
    """The four steps of the module docstring; returns each step's (N, vocab) fp32 logits."""
    g = torch.Generator().manual_seed(7)
    toks = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    runner._next_slot = 1  # slot 0 is the pool's scratch slot
    a, b = toks(12), toks(7)
    r2t = runner.req_to_token_pool.req_to_token
    out = []

    def step(mode, reqs, tail=0):
        logits = runner.forward(_batch(runner, mode, reqs, tail))
        out.append(logits.float().cpu())
        return logits.argmax(-1).tolist()

    ta, tb = step(ForwardMode.EXTEND, [(0, 0, a), (1, 0, b)])
    r2t[2, :8] = r2t[0, :8]  # C's cached prefix: A's first 8 tokens' slots
    tc, ta = step(ForwardMode.EXTEND, [(2, 8, a[:8] + toks(5)), (0, 12, [ta])], tail=1)
    lens = [13, 7, 13]  # KV tokens of A, B, C before the first decode
    for _ in range(2):
        ta, tb, tc = step(ForwardMode.DECODE, [(0, lens[0], [ta]), (1, lens[1], [tb]),
                                               (2, lens[2], [tc])])
        lens = [n + 1 for n in lens]
    return out


def make_runner(args_kw: dict):
    from radixlm.runtime.config import ServerArgs
    from radixlm.runtime.executor.model_runner import ModelRunner

    kw = dict(dtype="float32", device="cpu", attention_backend="torch_native",
              max_total_tokens=256, max_running_requests=4, context_length=256)
    return ModelRunner(ServerArgs(**{**kw, **args_kw}))


def _rank_main(rank: int, world: int, init_file: str, cases: list, out: str):
    """One rank: joins the group once, then runs each case's (args_kw, vocab) fixed batches on a
    runner of its own, in order; saves the list of every case's results."""
    torch.set_num_threads(1)  # a shared 2-core box: one thread per rank
    if os.environ.get("RADIXLM_TP_HARNESS_DUMP_S"):  # where a hung rank is (device runs)
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["RADIXLM_TP_HARNESS_DUMP_S"]))
    try:
        from radixlm.runtime.distributed import batch_sync, parallel_state
        device = cases[0][0].get("device", "cpu")  # cuda: NCCL, rank r on cuda:r
        parallel_state.init_distributed(world, rank, f"file://{init_file}", device, timeout_s=120)
        results = []
        for args_kw, vocab in cases:
            runner = make_runner({**args_kw, "tp_size": world})
            if rank == 0:  # schedules: its runner sends each batch to the other ranks
                logits = run_fixed_batches(runner, vocab)
                batch_sync.send_stop(runner.tp)
            else:  # as distributed/tp_worker runs a worker: rank 0's batches, until it stops
                logits = []
                r2t = runner.req_to_token_pool.req_to_token
                while (fb := batch_sync.recv_batch(runner.tp, r2t, runner.device)) is not None:
                    logits.append(runner.forward(fb).clone())
            results.append({"logits": [t.cpu() for t in logits], "kv_heads": runner.num_kv_heads})
            runner.release_cuda_graphs()
            del runner
        torch.save(results, f"{out}.{rank}")
        # tear the group down together: a rank that destroyed its gloo group (and exited) while
        # the other was still finishing its last broadcast aborted at interpreter exit
        # ("terminate called without an active exception", exit -6) in ~1 of 4 runs
        torch.distributed.barrier()
        if not parallel_state.destroy_distributed(timeout_s=60.0):
            raise RuntimeError(f"rank {rank}: leaving the process group hung")
    except BaseException:
        with open(f"{out}.{rank}.err", "w") as f:
            f.write(traceback.format_exc())
        raise
    # Results saved and the group left together: end the process here, as a forked
    # multiprocessing child does, without the interpreter's teardown of torch's native state.
    # That teardown still aborted now and then after the barrier above ("terminate called
    # without an active exception", exit -6: once in this session's five full-suite runs, at
    # c7531cc; 537dc9d's faulthandler saw it after rank_main returned), failing a run whose
    # ranks had all finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_tp(world: int, args_kw: dict, vocab: int, tmp: str) -> list[dict]:
    """Run the fixed batches on `world` gloo ranks; returns every rank's results."""
    return run_tp_cases(world, [(args_kw, vocab)], tmp)[0]


def run_tp_cases(world: int, cases: list[tuple[dict, int]], tmp: str) -> list[list[dict]]:
    """Run each case's (args_kw, vocab) fixed batches on the same `world` gloo ranks, one after
    another (a spawned rank's start, torch and radixlm imported, costs ~2.5 CPU-s); returns, per
    case, every rank's results. Any rank that fails or outlives TIMEOUT_S fails the call, and no
    process is left behind."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    init_file, out = os.path.join(tmp, "tp_init"), os.path.join(tmp, "tp_out")
    procs = [ctx.Process(target=_rank_main, args=(r, world, init_file, cases, out),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S
    try:  # a rank that fails leaves the others waiting in a collective: stop them all at once
        while (any(p.is_alive() for p in procs) and time.monotonic() < deadline
               and not any(p.exitcode for p in procs)):
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    errs = [open(f"{out}.{r}.err").read() for r in range(world) if os.path.exists(f"{out}.{r}.err")]
    codes = [p.exitcode for p in procs]
    if errs or any(c != 0 for c in codes):
        raise AssertionError(f"TP ranks failed (exit codes {codes}):\n" + "\n".join(errs))
    per_rank = [torch.load(f"{out}.{r}") for r in range(world)]
    return [[per_rank[r][i] for r in range(world)] for i in range(len(cases))]
