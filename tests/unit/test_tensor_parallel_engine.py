"""Engine(tp_size=2) on the CPU (gloo): rank 0 schedules in this process, rank 1 runs in a spawned
worker that receives every batch; greedy output must equal tp_size=1 in fp32. On a tiny random
Llama with SmolLM2's tokenizer and, like SmolLM2, 3 KV heads (split 2 + 1): what is checked here
is the engine's TP plumbing (batches broadcast, chunked prefill, radix-cache hits); SmolLM2's own
numerics under TP are test_tensor_parallel.py's. Also: the multi-node flags (a second "node" on
this machine), the KV integrity check, refusals, and that no worker process outlives the
engine."""

from __future__ import annotations

import json
import multiprocessing as mp

import psutil
import pytest

import tp_harness as th
from radixlm.net import free_port
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.distributed import tp_worker
from radixlm.runtime.engine import Engine

ARGS = dict(dtype="float32", device="cpu", max_total_tokens=4096, context_length=1024,
            chunked_prefill_size=64)  # chunks: extends over a cached prefix
SP = {"max_new_tokens": 20, "temperature": 0}
SHARED = "You are a helpful assistant. Answer briefly and precisely. Question: "
PROMPTS = ["The capital of France is", "def fib(n):", SHARED + "What is 2 + 2?",
           SHARED + "Name a primary color.", "List three animals: " * 12]


@pytest.fixture
def before():
    """Child processes alive before the test (in a full run, other modules' servers): the TP
    checks below look only at children started since."""
    return {p.pid for p in _live_children()} | {p.pid for p in mp.active_children()}


def _tp_children(before: set) -> list[psutil.Process]:
    return [p for p in _live_children() if p.pid not in before]


def _live_children() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            # multiprocessing's resource tracker (started by the first spawn) lives on
            if (p.status() != psutil.STATUS_ZOMBIE
                    and "resource_tracker" not in " ".join(p.cmdline())):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _run(engine: Engine) -> list[list[int]]:
    try:
        first = [r["output_ids"] for r in engine.generate(PROMPTS, SP)]
        again = [r["output_ids"] for r in engine.generate(PROMPTS[2:4], SP)]  # radix cache hits
        engine.check_integrity()
        return first + again
    finally:
        engine.shutdown()


def _run_with_stats(engine: Engine) -> tuple[list[list[int]], dict]:
    """_run's outputs and the engine's counters, read before _run shuts it down."""
    stats = {}
    real_shutdown = engine.shutdown

    def shutdown():
        stats.update(engine.get_stats())
        real_shutdown()

    engine.shutdown = shutdown
    return _run(engine), stats


@pytest.fixture(scope="module")
def tp1_outputs(tiny_chat_path):
    return _run(Engine(model_path=tiny_chat_path, **ARGS))


def test_engine_tp2_matches_tp1(tiny_chat_path, tp1_outputs, before, tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_TP_WORKER_TIMING", str(tmp_path / "timing"))
    engine = Engine(tp_size=2, model_path=tiny_chat_path, **ARGS)
    assert engine.runner.num_kv_heads == 2  # rank 0 holds 2 of the 3 KV heads
    assert _run(engine) == tp1_outputs
    assert _tp_children(before) == []
    assert [c for c in mp.active_children() if c.pid not in before] == []
    kinds = json.loads((tmp_path / "timing.rank1.json").read_text())["kinds"]  # the worker's
    assert kinds["extend"]["steps"] > 0 and kinds["decode"]["forward_call_s"] > 0
    assert sum(k["steps"] for k in kinds.values()) >= len(tp1_outputs[0])


def test_engine_tp2_ngram_matches_tp1(tiny_chat_path, tp1_outputs, before):
    """NGRAM speculative decoding under TP=2: the verify batches (several rows a request, the
    rows of one request sharing its req_to_token row) reach the worker as any batch does."""
    engine = Engine(tp_size=2, model_path=tiny_chat_path, speculative_algorithm="NGRAM",
                    speculative_adaptive=False, **ARGS)
    outputs, stats = _run_with_stats(engine)
    assert outputs == tp1_outputs
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0
    assert _tp_children(before) == []


def test_engine_tp2_standalone_matches_tp1(tiny_chat_path, tp1_outputs, before):
    """A draft model under TP=2 (the model as its own draft: every draft accepted): the draft
    runs whole on rank 0, the verifies reach the worker as any batch does."""
    engine = Engine(tp_size=2, model_path=tiny_chat_path, speculative_algorithm="STANDALONE",
                    speculative_draft_model_path=tiny_chat_path, speculative_adaptive=False,
                    speculative_num_draft_tokens=4, **ARGS)
    assert engine.scheduler.spec.runner.tp.size == 1  # the draft: unsharded, on this rank
    assert engine.runner.tp.size == 2
    outputs, stats = _run_with_stats(engine)
    assert outputs == tp1_outputs
    assert stats["spec_verify_steps"] > 0
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0
    assert _tp_children(before) == []


@pytest.mark.parametrize("topk", [1, 2])
def test_engine_tp2_eagle3_matches_tp1(tiny_chat_path, tp1_outputs, before, tmp_path, topk):
    """An EAGLE-3 head (random) under TP=2: it runs on rank 0 with the target's whole embedding
    (the target's own is split by vocabulary there) and the layers' hidden states. Top-k 2:
    draft trees, whose verify rows read scratch rows of req_to_token (sent with the batch)."""
    from tiny_models import write_tiny_eagle3

    head = write_tiny_eagle3(str(tmp_path / "head"), vocab=49152, hidden=96,
                             aux_layers=(0, 1, 1))
    engine = Engine(tp_size=2, model_path=tiny_chat_path, speculative_algorithm="EAGLE3",
                    speculative_draft_model_path=head, speculative_adaptive=False,
                    speculative_eagle_topk=topk, **ARGS)
    assert engine.runner.whole_embedding.shape == (49152, 96)
    assert engine.runner.model.embed_tokens.weight.shape[0] < 49152  # the rank's shard
    outputs, stats = _run_with_stats(engine)
    assert outputs == tp1_outputs
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0
    assert _tp_children(before) == []


def test_engine_tp2_two_nodes(tiny_chat_path, tp1_outputs, before):
    """--nnodes 2: node 1's rank started by run_node (as launch_server --node-rank 1 does)."""
    addr = f"127.0.0.1:{free_port()}"
    node = dict(tp_size=2, nnodes=2, dist_init_addr=addr, model_path=tiny_chat_path, **ARGS)
    ctx = mp.get_context("spawn")
    other = ctx.Process(target=tp_worker.run_node, args=(ServerArgs(node_rank=1, **node),))
    other.start()
    try:
        engine = Engine(node_rank=0, **node)
        assert _run(engine) == tp1_outputs
        other.join(30)
        assert other.exitcode == 0
    finally:
        if other.is_alive():
            other.kill()
            other.join(5)
    assert _tp_children(before) == []


def test_tp_flags_refused(tmp_path, before):
    for kw, msg in [(dict(tp_size=3, nnodes=2), "multiple of nnodes"),
                    (dict(tp_size=2, nnodes=2, node_rank=2), "node_rank"),
                    (dict(tp_size=2, nnodes=2), "dist_init_addr")]:
        with pytest.raises(ValueError, match=msg):
            tp_worker.check_args(ServerArgs(**kw))
    # a model the group cannot split: refused after the workers started, and they are gone
    path = th.write_tiny_llama(str(tmp_path / "m"), vocab=64, heads=4, kv_heads=2, tied=True)
    with pytest.raises(ValueError, match="replicated"):
        Engine(model_path=path, tp_size=3, skip_tokenizer_init=True,
               **dict(ARGS, context_length=512))  # (the model's positions)
    assert _tp_children(before) == []
