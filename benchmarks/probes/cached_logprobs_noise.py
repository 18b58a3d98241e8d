"""How far served prompt logprobs (scheduler/cached_logprobs.py) sit from a recompute, next to
the batch-composition noise a recompute alone already has, per dtype.

    python benchmarks/probes/cached_logprobs_noise.py --dtype bfloat16

On one engine per setting, a context is scored (logprob_start_len=0), then prompts
context + continuation are scored again. Printed (max |difference| over all scored positions):
  served_vs_recompute   cache on (context served from the tree) vs cache off
  served_vs_recompute_chunked  the same, both engines with chunked_prefill_size=16
  decode_served_vs_recompute   output tokens' logprobs stored by decode steps (a greedy
                        generation with return_logprob), served to prompt + output, vs cache off
  noise_batch           cache off: each prompt alone vs all prompts in one batch
  noise_chunked         cache off: unchunked vs chunked_prefill_size=16
  noise_prefix_reuse    cache on, serving off (the old path: the context's KV from the tree,
                        its logprobs recomputed on top) vs cache off
One JSON line; nothing is saved.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.offline_throughput import default_model_path  # noqa: E402


def _lps(outs) -> list[list[float]]:
    return [[v for v, _, _ in o["meta_info"]["input_token_logprobs"] if v is not None]
            for o in outs]


def _diff(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model-path", default=None)
    p.add_argument("--context-len", type=int, default=200)
    args = p.parse_args()
    import radixlm
    from radixlm.runtime.scheduler import cached_logprobs

    rng = random.Random(0)
    ctx = [rng.randrange(100, 40000) for _ in range(args.context_len)]
    prompts = [ctx + [rng.randrange(100, 40000) for _ in range(12)] for _ in range(4)]
    kw = dict(sampling_params=[{"max_new_tokens": 0}] * 4, return_logprob=[True] * 4,
              logprob_start_len=[0] * 4)

    def engine(**extra):
        return radixlm.Engine(model_path=args.model_path or default_model_path(), dtype=args.dtype,
                              context_length=1024, max_total_tokens=4000, **extra)

    def scored(eng, warm: bool, one_by_one: bool = False):
        if warm:
            eng.generate(input_ids=ctx, sampling_params={"max_new_tokens": 0},
                         return_logprob=True, logprob_start_len=0)
        if one_by_one:
            return _lps([eng.generate(input_ids=[q], **{k: v[:1] for k, v in kw.items()})[0]
                         for q in prompts])
        return _lps(eng.generate(input_ids=prompts, **kw))

    res = {"dtype": args.dtype, "context_len": args.context_len}
    off = engine(disable_radix_cache=True)
    ref_batch, ref_alone = scored(off, False), scored(off, False, one_by_one=True)
    off.shutdown()
    chunked = engine(disable_radix_cache=True, chunked_prefill_size=16)
    ref_chunked = scored(chunked, False)
    chunked.shutdown()
    chunked_on = engine(chunked_prefill_size=16)
    served_chunked = scored(chunked_on, True)
    chunked_on.shutdown()
    on = engine()
    served = scored(on, True)
    on.flush_cache()
    gen = on.generate(input_ids=ctx, return_logprob=True,
                      sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    full = ctx + gen["output_ids"]
    one = dict(sampling_params={"max_new_tokens": 0}, return_logprob=True,
               logprob_start_len=len(ctx))
    from_decode = _lps([on.generate(input_ids=full, **one)])
    assert on.get_stats()["cached_tokens"] >= len(full) - 2  # really served
    on.flush_cache()
    cached_logprobs.serves_cached_logprobs = lambda req, tree: False
    old_path = scored(on, True)
    on.shutdown()
    off = engine(disable_radix_cache=True)
    decode_ref = _lps([off.generate(input_ids=full, **one)])
    off.shutdown()
    res.update(served_vs_recompute=_diff(served, ref_batch),
               served_vs_recompute_chunked=_diff(served_chunked, ref_chunked),
               decode_served_vs_recompute=_diff(from_decode, decode_ref),
               noise_batch=_diff(ref_alone, ref_batch),
               noise_chunked=_diff(ref_chunked, ref_batch),
               noise_prefix_reuse=_diff(old_path, ref_batch))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
