"""Speculative decoding (NGRAM) through the Engine, fp32 on the CPU: the same greedy tokens,
logprobs, finishes and grammar output as without it, on prompts whose answers copy their input
(so drafts are accepted: every test asserts some were), and the KV accounting after each test.

A dropped bonus token, a wrong accepted prefix or a penalty that missed the drafts changes the
tokens; a rejected slot not freed (or an accepted one freed) fails the integrity check."""

from __future__ import annotations

import pytest
import torch

LIST = ("Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, "
        "honeydew, kiwi, lemon, mango. Repeat:")
CODE = ("Copy the following code:\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n"
        "    return a - b\nCopy:\n")
DOC = ('Return this JSON exactly: {"name": "Ada Lovelace", "born": 1815, "field": "mathematics", '
       '"known_for": "the first program"}\nJSON: ')
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                                           "field": {"type": "string"}},
          "required": ["name", "born", "field"]}


@pytest.fixture(scope="module")
def spec_engine(make_engine):
    # adaptive off: every draft found is verified, the most acceptance and rejection paths;
    # 3 drafts: a verify of <= 4 requests stays within the GGUF kernel's direct (<= 16 rows) path
    return make_engine(speculative_algorithm="NGRAM", speculative_adaptive=False,
                       speculative_num_draft_tokens=4)


def _params(**kw):
    return {"temperature": 0, "max_new_tokens": 32, **kw}


def _same(a: dict, b: dict, lp_tol: float = 2e-4) -> None:
    assert a["output_ids"] == b["output_ids"]
    assert a["text"] == b["text"]
    assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if key not in a["meta_info"]:
            continue
        for x, y in zip(a["meta_info"][key], b["meta_info"][key]):
            if key == "output_token_logprobs":
                assert x[1] == y[1] and abs(x[0] - y[0]) < lp_tol, (x, y)
            else:
                assert [t for _, t, _ in x] == [t for _, t, _ in y]
                assert max(abs(u[0] - v[0]) for u, v in zip(x, y)) < lp_tol


def test_greedy_logprobs_penalties_and_stops_match_plain_decoding(engine, spec_engine, integrity):
    prompts = [LIST, CODE, LIST, LIST]
    params = [_params(),
              _params(frequency_penalty=0.4, presence_penalty=0.2, logit_bias={"28": -2.0}),
              _params(stop=["grape"]),  # the stop string ends inside an accepted draft
              _params(stop_regex=[r"kiwi,?"], min_new_tokens=4, repetition_penalty=1.1)]
    kw = dict(return_logprob=[True, True, True, False], top_logprobs_num=3)
    off = engine.generate(prompts, params, **kw)
    on = spec_engine.generate(prompts, params, **kw)
    for a, b in zip(off, on):
        _same(a, b)
    metas = [o["meta_info"] for o in on]
    assert all(m["spec_verify_steps"] > 0 for m in metas)
    assert metas[0]["spec_accept_length"] > 2 and metas[1]["spec_accept_length"] > 1.5
    assert metas[2]["finish_reason"] == {"type": "stop", "matched": "grape"}
    assert metas[2]["spec_accept_length"] > 1.5
    assert "spec_verify_steps" not in off[0]["meta_info"]
    integrity(engine)
    integrity(spec_engine)


def test_grammar_constrained_drafts_match_plain_decoding(engine, spec_engine, integrity):
    params = [_params(json_schema=SCHEMA, max_new_tokens=40), _params(regex=r"[a-z, ]{20,60}\.")]
    prompts = [DOC, LIST]
    off = engine.generate(prompts, params)
    on = spec_engine.generate(prompts, params)
    for a, b in zip(off, on):
        _same(a, b)
    assert on[1]["meta_info"]["spec_accept_length"] > 1.5  # drafts passed the grammar check
    integrity(spec_engine)


def test_streaming_n_sampling_and_abort(spec_engine, integrity):
    before = spec_engine.get_stats()
    chunks = list(spec_engine.generate(LIST, _params(ignore_eos=True), stream=True))
    after = spec_engine.get_stats()
    final = spec_engine.generate(LIST, _params(ignore_eos=True))
    assert chunks[-1]["output_ids"] == final["output_ids"]
    assert len(chunks) < len(final["output_ids"])  # several tokens per verify step
    # every verify appends its accepted drafts + exactly one more token (none cut by a finish)
    delta = {k: after[k] - before[k] for k in ("spec_verify_tokens", "spec_accepted_tokens",
                                               "spec_verify_reqs")}
    assert delta["spec_accepted_tokens"] > 0
    assert delta["spec_verify_tokens"] == delta["spec_accepted_tokens"] + delta["spec_verify_reqs"]
    outs = spec_engine.generate([CODE], {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 24,
                                         "n": 3, "seed": 3})
    assert len(outs) == 3 and all(len(o["output_ids"]) > 0 for o in outs)
    stream = spec_engine.generate(CODE, _params(max_new_tokens=200), stream=True, rid="to-abort")
    next(stream)
    spec_engine.abort_request("to-abort")
    last = list(stream)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    integrity(spec_engine)


def test_retraction_and_chunked_prefill(engine, make_engine, integrity):
    # admitted optimistically into a pool too small for all outputs (retraction); the longest
    # prompt is computed in 32-token chunks while the others decode with drafts
    eng = make_engine(speculative_algorithm="NGRAM", max_total_tokens=200,
                      chunked_prefill_size=32, schedule_conservativeness=0.05)
    prompts = [LIST, CODE, "Please. " + LIST, "Now. " + CODE, LIST + " " + LIST]
    params = _params(max_new_tokens=24)
    on = eng.generate(prompts, params)
    off = engine.generate(prompts, params)
    for a, b in zip(off, on):
        assert a["output_ids"] == b["output_ids"]
    stats = eng.get_stats()
    assert stats["retractions"] > 0 and stats["spec_accepted_tokens"] > 0
    integrity(eng)


def test_other_family_gemma2_windows_and_softcaps(tmp_path, integrity):
    """Gemma 2 (its own model file: sliding windows of 8, attention and final soft-caps) on a
    tiny random checkpoint: the verify forward's extend attention with a cached prefix, both
    backends, against plain decoding; and the verify run as a decode batch (verify.py's
    `as_decode`). Random weights fall into repetitions: drafts accepted."""
    import arch_parity as ap
    from test_model_parity_gemma import CASES

    cls, config = CASES["gemma2"]
    ap.save_tiny(cls, config(), tmp_path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() * 4 for n in (6, 9, 13)]
    prompts += ap.prompts(256)[:3]
    spec = dict(speculative_algorithm="NGRAM", speculative_adaptive=False)
    engines = [ap.make_engine(str(tmp_path), **kw) for kw in (
        {}, spec, dict(spec, attention_backend="torch_native"),
        spec, dict(spec, attention_backend="torch_native"))]
    for e in engines[3:]:  # verifies as decode batches of one row per token (GPU: in a graph)
        e.runner.replays_decode_graph = lambda rows: True
    try:
        off, *ons = [ap.generate(e, prompts, max_new=24) for e in engines]
        for on in ons:
            assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
            assert sum(o["meta_info"]["spec_accept_length"] > 1 for o in on) >= 4
        for e in engines:
            integrity(e)
    finally:
        for e in engines:
            e.shutdown()


def test_a_failure_in_one_verified_request_fails_it_alone(spec_engine, monkeypatch):
    """An exception in one request's handling of its verified tokens (injected into its stop
    check) fails that request with a 500 abort; the others keep the tokens of a clean run; the
    step's draft slots go back (integrity) and the engine serves on."""
    from radixlm.runtime.scheduler import token_processing

    eng = spec_engine
    prompts = [LIST, CODE, DOC]
    sp = _params(ignore_eos=True)
    clean = [o["output_ids"] for o in eng.generate(prompts, sp)]
    before = eng.get_stats()
    real = token_processing.check_finish

    def failing(req, *a, **kw):
        if req.rid == "spec-fail-1" and len(req.output_ids) >= 8:
            raise RuntimeError("injected failure")
        return real(req, *a, **kw)

    monkeypatch.setattr(token_processing, "check_finish", failing)
    outs = eng.generate(prompts, sp, rid=[f"spec-fail-{i}" for i in range(3)])
    monkeypatch.undo()
    after = eng.get_stats()
    assert after["spec_verify_steps"] > before["spec_verify_steps"]  # it failed inside verifies
    for i, o in enumerate(outs):
        reason = o["meta_info"]["finish_reason"]
        if i == 1:
            assert reason["type"] == "abort" and reason["status_code"] == 500, reason
            assert "verified tokens" in reason["message"] and "injected" in reason["message"]
        else:
            assert o["output_ids"] == clean[i]
    assert after["request_failures"] == before.get("request_failures", 0) + 1
    eng.wait_idle()
    eng.check_integrity()
    assert eng.generate(CODE, sp)["output_ids"] == clean[1]
    eng.wait_idle()
    eng.check_integrity()


def test_bf16_drafts_give_plain_tokens_bit_for_bit(make_engine, integrity):
    """bf16 activations (the bundled GGUF's default dtype), where any other summation order
    shows in the logprobs: on the CPU a verify runs as decode rows (speculative/verify.py's as_decode), over
    GEMMs whose rows do not depend on the row count and attention whose key splits each row plans
    as it would alone, so the tokens equal plain decoding's bit for bit, also past a lone row's
    split threshold (~3.6k keys at SmolLM2's 9 query heads: the long prompt)."""
    long_prompt = CODE * 105  # ~3.8k tokens of code to copy
    prompts = [LIST, CODE, DOC, long_prompt]
    kw = dict(dtype="bfloat16", context_length=4096)
    plain = make_engine(**kw)
    if not plain.runner.keep_quantized:  # (a CPU whose kernel build has no fast GGUF path)
        pytest.skip("bit-exact bf16 rows are the GGUF kernels' direct path's property; this "
                    "CPU dequantizes the GGUF instead")
    spec = make_engine(speculative_algorithm="NGRAM", speculative_adaptive=False,
                       speculative_num_draft_tokens=6, **kw)
    a = plain.generate(prompts, _params(max_new_tokens=40), return_logprob=True)
    b = spec.generate(prompts, _params(max_new_tokens=40), return_logprob=True)
    assert [r["output_ids"] for r in a] == [r["output_ids"] for r in b]
    # the logits themselves, not only their argmax: every token's logprob to the last bit
    assert ([r["meta_info"]["output_token_logprobs"] for r in a]
            == [r["meta_info"]["output_token_logprobs"] for r in b])
    assert spec.get_stats()["spec_draft_tokens"] > 0
    assert len(plain.tokenizer.encode(long_prompt)) > 3641
    integrity(plain)
    integrity(spec)


@pytest.mark.parametrize("algo", ["NGRAM", "EAGLE3", "EAGLE3-tree"])
def test_bf16_batches_past_the_gguf_kernels_row_limit_stay_exact(algo, make_engine, integrity,
                                                                  tmp_path):
    """Past DIRECT_MAX_M running requests a GGUF model's plain step already multiplies by
    another kernel (the dense rows' GEMM, whose sums depend on the row count): a verify's extra
    rows there changed 4 of 32 batch-32 outputs. Such steps draft nothing (NGRAM: no lookups;
    EAGLE3, which verifies every step, verifies the last tokens alone); drafting resumes as the
    batch drains below the limit. Every logprob equals plain decoding's."""
    from radixlm.runtime.layers import quantized_linear

    n = quantized_linear.DIRECT_MAX_M + 4
    prompts = [f"{i}. " + [LIST, CODE, DOC][i % 3] for i in range(n)]
    kw = dict(dtype="bfloat16", max_running_requests=n)
    plain = make_engine(**kw)
    if not plain.runner.keep_quantized:
        pytest.skip("the row limit is the GGUF kernels' direct path's; this CPU dequantizes")
    if algo.startswith("EAGLE3"):  # a random head for the bundled SmolLM2 (576 wide, 30 layers)
        from tiny_models import write_tiny_eagle3

        head = write_tiny_eagle3(str(tmp_path / "head"), vocab=49152, hidden=576, heads=9,
                                 kv_heads=3, inter=256, draft_vocab=4096, aux_layers=(1, 14, 26))
        kw["speculative_draft_model_path"] = head
    if algo == "EAGLE3-tree":  # (trees of 5 nodes: each a decode row on a scratch row)
        kw.update(speculative_eagle_topk=3, speculative_num_steps=2)
    spec = make_engine(speculative_algorithm=algo.removesuffix("-tree"),
                       speculative_adaptive=False, speculative_num_draft_tokens=6, **kw)
    params = [_params(max_new_tokens=12 + 3 * (i % 8)) for i in range(n)]  # the batch drains
    a = plain.generate(prompts, params, return_logprob=True)
    b = spec.generate(prompts, params, return_logprob=True)
    assert [r["output_ids"] for r in a] == [r["output_ids"] for r in b]
    assert ([r["meta_info"]["output_token_logprobs"] for r in a]
            == [r["meta_info"]["output_token_logprobs"] for r in b])
    assert spec.get_stats()["spec_draft_tokens"] > 0  # (below the limit)
    integrity(plain)
    integrity(spec)
