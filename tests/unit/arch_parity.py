"""Helpers for the per-architecture parity tests (test_model_parity_*.py): a tiny random-weight HF
checkpoint written with `save_pretrained`, HF's own greedy tokens and prompt logprobs on it (fp32),
and the checks an fp32 radixlm Engine on the same folder must pass against them."""

from __future__ import annotations

import torch

MAX_NEW = 12
CONTEXT = 256


def save_tiny(model_cls, config, path, seed: int = 0):
    """The HF model with random weights (a wider init than the default 0.02, so the tiny model's
    logits are not flat and greedy choices are far from ties), saved to `path`, in eval mode."""
    torch.manual_seed(seed)
    # eager attention: the reference is the plain math (an SDPA or flash path may drop a feature:
    # transformers 5.17's Gemma 2 under SDPA lost the attention soft-cap, 5.23's did not)
    config._attn_implementation = "eager"
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.08)
            else:  # norms near 1 but not 1: a norm weight loaded into the wrong place shows
                p.uniform_(0.8, 1.2)
    model.save_pretrained(path)
    return model


def prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    """Random ids: short and long (> 64 tokens) prompts, and pairs sharing a 40-token prefix (radix
    cache hits on the second round)."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    shared = ids(40)
    out = [ids(n) for n in (1, 7, 23, 66, 97, 150)]
    out += [shared + ids(n) for n in (3, 30, 81)]
    return out


def hf_greedy(model, prompt_ids: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    outs = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                               min_new_tokens=0, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        outs.append(y[0, len(ids):].tolist())
    return outs


def make_engine(path: str, **kw):
    import radixlm

    kw.setdefault("context_length", CONTEXT)
    kw.setdefault("dtype", "float32")
    return radixlm.Engine(model_path=path, skip_tokenizer_init=True, max_total_tokens=4096, **kw)


def generate(eng, prompt_ids, max_new: int = MAX_NEW) -> list[dict]:
    return eng.generate(input_ids=prompt_ids, sampling_params={
        "temperature": 0, "max_new_tokens": max_new, "ignore_eos": True})


def check_greedy(eng, prompt_ids, ref) -> None:
    """Batch greedy equals HF twice: cold, then with the shared prefixes in the radix cache."""
    for round_ in range(2):
        outs = generate(eng, prompt_ids)
        for i, (o, r) in enumerate(zip(outs, ref)):
            assert o["output_ids"] == r, f"round {round_}, prompt {i} (len {len(prompt_ids[i])})"
        if round_ == 1 and not eng.server_args.disable_radix_cache:
            assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs if
                       len(o["output_ids"]) and o["meta_info"]["prompt_tokens"] > 1)
    eng.wait_idle()
    eng.check_integrity()


def check_prompt_logprobs(eng, model, prompt_ids, atol: float = 1e-3) -> None:
    for ids in prompt_ids:
        if len(ids) < 2:
            continue
        o = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                         return_logprob=True, logprob_start_len=0)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        got = o["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in got] == ids and got[0][0] is None
        torch.testing.assert_close(torch.tensor([lp for lp, _, _ in got[1:]]), ref,
                                   atol=atol, rtol=0)
    eng.wait_idle()
    eng.check_integrity()


def make_case(name: str, model_cls, config, tmp_path_factory, vocab: int):
    """What a module-scoped `case` fixture yields: (name, checkpoint folder, HF model, prompts,
    HF greedy outputs) for a tiny checkpoint of `model_cls(config)`."""
    path = tmp_path_factory.mktemp(name)
    model = save_tiny(model_cls, config, path)
    ids = prompts(vocab)
    return name, str(path), model, ids, hf_greedy(model, ids)


def check_engine_matches_hf(case, backend: str, checks=None) -> None:
    """An fp32 Engine on `backend` gives HF's greedy tokens (cold and from the radix cache) and
    prompt logprobs; `checks(eng)` asserts what the architecture needs first."""
    _, path, model, ids, ref = case
    eng = make_engine(path, attention_backend=backend)
    try:
        assert eng.runner.attention_backend_name == ("cpu" if backend == "auto" else backend)
        if checks is not None:
            checks(eng)
        check_greedy(eng, ids, ref)
        check_prompt_logprobs(eng, model, ids)
    finally:
        eng.shutdown()


# server-argument variants that must not change a token: radix cache off, prefill in chunks of 16
VARIANTS = [dict(disable_radix_cache=True), dict(chunked_prefill_size=16)]
VARIANT_IDS = ["radix-off", "chunked-16"]


def check_variant_matches_hf(case, **variant) -> None:
    _, path, _, ids, ref = case
    eng = make_engine(path, **variant)
    try:
        check_greedy(eng, ids, ref)
    finally:
        eng.shutdown()
