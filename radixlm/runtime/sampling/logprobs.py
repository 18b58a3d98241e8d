"""Logprobs of given tokens under given logits, plus the top-k alternatives.

Used for prompt (input) logprobs, where the logits at position i score token i+1, so the caller
passes `token_ids[i] = input_ids[i + 1]`, and by the Sampler for the chosen output tokens.

log_softmax(x)[t] = x[t] - logsumexp(x), so instead of materializing a (N, V) log_softmax we take
logsumexp per row (N,) and subtract it from the gathered and the top-k raw logits. Rows are
processed in chunks so a long prompt (N in the thousands, V ~ 1e5) never needs a second full-size
(N, V) float32 temporary: logsumexp's internal exp() is at most (_CHUNK_ROWS, V).
"""

from __future__ import annotations

import torch

_CHUNK_ROWS = 1024


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (N, V) any float dtype, token_ids (N,) int64 -> (chosen (N,), top_vals (N, k),
    top_ids (N, k)), all logprobs in float32, top_vals descending. top_k == 0 gives (N, 0)."""
    N, V = logits.shape
    k = min(top_k, V)
    chosen = torch.empty(N, dtype=torch.float32, device=logits.device)
    top_vals = torch.empty(N, k, dtype=torch.float32, device=logits.device)
    top_ids = torch.empty(N, k, dtype=torch.int64, device=logits.device)
    token_ids = token_ids.view(-1, 1).to(torch.int64)
    for start in range(0, N, _CHUNK_ROWS):  # chunks of rows, not requests or tokens
        end = min(start + _CHUNK_ROWS, N)
        x = logits[start:end].float()  # (n, V); no copy when already float32
        lse = torch.logsumexp(x, dim=-1, keepdim=True)  # (n, 1)
        chosen[start:end] = (x.gather(1, token_ids[start:end]) - lse).view(-1)
        if k > 0:
            vals, ids = x.topk(k, dim=-1)  # (n, k), sorted descending
            top_vals[start:end] = vals - lse
            top_ids[start:end] = ids
    return chosen, top_vals, top_ids
