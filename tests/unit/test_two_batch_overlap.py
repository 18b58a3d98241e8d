"""--enable-two-batch-overlap (models/two_batch_overlap.py) on the CPU over gloo: TP=2 extends of
at least MIN_TOKENS run each layer's all-reduces beside the other half of the tokens' compute;
greedy tokens equal plain TP=2's in fp32 (rank 1 runs the same path in its own process), the
overlapped loop really ran (rank 0 is this process), the KV integrity check holds, and the
flag is refused where it cannot run."""

from __future__ import annotations

import random

import pytest

from radixlm.runtime.engine import Engine
from radixlm.runtime.models import two_batch_overlap

# three prompts of 700-800 tokens admitted in one extend (chunks of up to 4096 tokens): one
# batch of >= MIN_TOKENS rows, then decode steps and a second, shorter round (cache hits)
ARGS = dict(dtype="float32", device="cpu", max_total_tokens=8192, context_length=2048,
            chunked_prefill_size=4096, tp_size=2)
SP = {"max_new_tokens": 8, "temperature": 0}


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in (700, 750, 800)]


def _run(engine: Engine, prompts) -> list[list[int]]:
    try:
        first = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=SP)]
        again = [r["output_ids"] for r in engine.generate(
            input_ids=[p[:600] + p[:50] for p in prompts[:2]], sampling_params=SP)]
        engine.check_integrity()
        return first + again
    finally:
        engine.shutdown()


def test_two_batch_overlap_matches_plain_tp2(tiny_chat_path, monkeypatch):
    prompts = _prompts()
    assert sum(map(len, prompts)) >= two_batch_overlap.MIN_TOKENS
    plain = _run(Engine(model_path=tiny_chat_path, **ARGS), prompts)
    rows = []
    real = two_batch_overlap.run_layers

    def counted(layers, x, *rest):
        rows.append(x.shape[0])
        return real(layers, x, *rest)

    monkeypatch.setattr(two_batch_overlap, "run_layers", counted)
    engine = Engine(model_path=tiny_chat_path, enable_two_batch_overlap=True, **ARGS)
    assert engine.runner.model.two_batch_overlap is not None
    assert _run(engine, prompts) == plain
    assert rows and min(rows) >= two_batch_overlap.MIN_TOKENS  # the first round's extend


def test_two_batch_overlap_refused_without_tp(tiny_chat_path):
    # an engine of the same model first: the refusal must hold for a model the loader's cache
    # serves too (it was checked only on a fresh load, so it depended on the tests' order)
    Engine(model_path=tiny_chat_path, **dict(ARGS, tp_size=1)).shutdown()
    with pytest.raises(ValueError, match="enable-two-batch-overlap.*tp-size"):
        Engine(model_path=tiny_chat_path, enable_two_batch_overlap=True,
               **dict(ARGS, tp_size=1))


def test_two_batch_overlap_refused_for_other_layers(tmp_path):
    """Qwen3's layers (per-head q / k norms: their own attention class) are not llama.py's."""
    import tp_harness as th

    path = th.write_tiny_llama(str(tmp_path / "q3"), vocab=64, heads=4, kv_heads=2, tied=True,
                               arch="qwen3")
    with pytest.raises(ValueError, match="enable-two-batch-overlap.*not supported"):
        Engine(model_path=path, enable_two_batch_overlap=True, skip_tokenizer_init=True,
               **dict(ARGS, context_length=512))
