"""Decode-step memory: make room for one new token per running request, retracting if needed.

`new_token_ratio` is the fraction of each running request's remaining `max_new_tokens` that
admission reserves. It starts optimistic, decays a little every decode step (requests often stop
early), and jumps up after a retraction (the optimism was wrong).
"""

from __future__ import annotations

from radixlm.runtime.request import Finish, FinishReason

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
RETRACT_RATIO_BUMP = 0.3


def retract_order_key(req):
    """Least progress first: fewest generated tokens, then the longest prompt (frees the most)."""
    return (len(req.output_ids), -len(req.origin_input_ids))


def ensure_decode_memory(sched) -> list:
    """Evict, then retract running requests until every remaining one can get a slot.

    Retracted requests put their KV into the radix tree (so re-admission is mostly a cache hit),
    return to the front of the waiting queue, and are returned to the caller.
    """
    alloc, tree = sched.allocator, sched.tree_cache
    retracted = []
    while sched.running:
        need = len(sched.running)
        if alloc.available_size() < need:
            tree.evict(need - alloc.available_size())
        if alloc.available_size() >= need:
            break
        if len(sched.running) == 1:
            # a lone request that still does not fit can never fit: the pool is too small for it
            req = sched.running.pop()
            sched.running_info = None
            sched._finish(req, Finish(FinishReason.ABORT,
                                      message="KV cache capacity exceeded by a single request; "
                                              "raise --max-total-tokens"))
            retracted.append(req)
            break
        victim_idx = min(range(len(sched.running)), key=lambda i: retract_order_key(sched.running[i]))
        victim = sched.running.pop(victim_idx)
        sched.running_info.filter([i for i in range(len(sched.running) + 1) if i != victim_idx])
        tree.cache_finished_req(victim, victim.fill_ids[: victim.kv_len])
        if sched.spec is not None:  # a draft model's KV of it goes too
            sched.spec.on_retract(victim)
        victim.reset_for_retract()
        sched.waiting.insert(0, victim)
        retracted.append(victim)
    if retracted:
        sched.new_token_ratio = min(1.0, sched.new_token_ratio + RETRACT_RATIO_BUMP)
        sched.stats["retractions"] += sum(not r.finished for r in retracted)
    return retracted
