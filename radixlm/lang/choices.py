"""How `select` decides among choices from per-token logprobs of `prefix + choice`.

The calling convention is SGLang's, so a choice method written for SGLang runs unchanged: keyword
arguments `choices`, `normalized_prompt_logprobs` (one float per choice), `input_token_logprobs`
(per choice, the choice's tokens as `(logprob, token_id, token_text)` triples, conditional on the
prefix), `output_token_logprobs` (per choice; empty: select generates nothing) and, for a method
whose `requires_unconditional_logprobs` is true, `unconditional_token_logprobs` (the same tokens
scored without the prefix). Token ids or texts a backend does not have are None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: Optional[dict] = None


class ChoicesSamplingMethod:
    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: list[list], output_token_logprobs: list[list],
                 unconditional_token_logprobs: Optional[list[list]] = None) -> ChoicesDecision:
        raise NotImplementedError


def _argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=lambda i: xs[i])


def _lps(triples: list) -> list[float]:
    return [t[0] for t in triples]


def _meta(normalized, inputs, outputs, **extra) -> dict:
    return {"normalized_prompt_logprobs": normalized, "input_token_logprobs": inputs,
            "output_token_logprobs": outputs, **extra}


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean logprob per token (SGLang's default)."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None):
        best = _argmax(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], _meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs))


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare token by token: keep the choices whose token at position j is most likely, move on
    to j + 1 among those, until one remains. A choice that has run out of tokens continues with
    its own mean logprob (so a choice that is a prefix of another competes fairly)."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None):
        rows = [_lps(t) for t in input_token_logprobs]
        width = max((len(r) for r in rows), default=0)
        matrix = [r + [sum(r) / len(r) if r else 0.0] * (width - len(r)) for r in rows]
        alive = list(range(len(choices)))
        for j in range(width):
            top = max(matrix[i][j] for i in alive)
            alive = [i for i in alive if matrix[i][j] == top]
            if len(alive) == 1:
                break
        return ChoicesDecision(choices[alive[0]], _meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
            greedy_logprob_matrix=matrix))


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """Mean over the choice's tokens of (logprob given the prefix - logprob without it): prefers
    choices the context makes likelier, not choices that are likely anyway. An unscored first
    unconditional token (logprob None) counts as 0, as in SGLang."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None):
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            c, u = _lps(cond), [lp or 0.0 for lp in _lps(uncond)]
            n = min(len(c), len(u))
            # align on the last n tokens: the choice's own tokens end both sequences
            diff = [a - b for a, b in zip(c[len(c) - n:], u[len(u) - n:])]
            scores.append(sum(diff) / max(n, 1))
        best = _argmax(scores)
        return ChoicesDecision(choices[best], _meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
            unconditional_token_logprobs=unconditional_token_logprobs,
            normalized_unconditional_prompt_logprobs=scores,  # SGLang's key
            unconditional_normalized_scores=scores))  # radixlm's earlier key, kept for its users


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()


def decide(method: Any, choices: list[str], token_logprobs: list[list],
           unconditional: Optional[list[list]] = None) -> ChoicesDecision:
    """Run `method` (default: token_length_normalized) on per-choice `(logprob, id, text)` triples
    of the choices' tokens (a bare float is taken as a logprob with no id or text)."""
    method = method or token_length_normalized
    token_logprobs = [[_triple(t) for t in row] for row in token_logprobs]
    if unconditional is not None:
        unconditional = [[_triple(t) for t in row] for row in unconditional]
    normalized = []
    for row in token_logprobs:
        vals = [t[0] for t in row if t[0] is not None]
        normalized.append(sum(vals) / len(vals) if vals else 0.0)
    return method(choices=choices, normalized_prompt_logprobs=normalized,
                  input_token_logprobs=token_logprobs,
                  output_token_logprobs=[[] for _ in choices],
                  unconditional_token_logprobs=unconditional)


def _triple(t) -> tuple:
    if isinstance(t, (list, tuple)):
        return tuple(t) + (None,) * (3 - len(t))
    return (t, None, None)
