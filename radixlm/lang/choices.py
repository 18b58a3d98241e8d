"""How `select` decides among choices from per-token logprobs of `prefix + choice`.

Each method receives, per choice, the logprobs of the choice's tokens (conditional on the prefix)
and, when it asks for them, the same tokens' logprobs without the prefix (unconditional).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: Optional[dict] = None


class ChoicesSamplingMethod:
    requires_unconditional_logprobs = False

    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: list[list[float]],
                 unconditional_token_logprobs: Optional[list[list[float]]] = None) -> ChoicesDecision:
        raise NotImplementedError


def _argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=lambda i: xs[i])


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean logprob per token (SGLang's default)."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 unconditional_token_logprobs=None):
        best = _argmax(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs})


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare token by token: keep the choices whose next token is most likely, move on to the
    following token among those, until one remains (a shorter choice that runs out loses ties)."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 unconditional_token_logprobs=None):
        alive = list(range(len(choices)))
        pos = 0
        while len(alive) > 1:
            have = [i for i in alive if pos < len(input_token_logprobs[i])]
            if not have:
                break
            top = max(input_token_logprobs[i][pos] for i in have)
            alive = [i for i in have if input_token_logprobs[i][pos] == top]
            pos += 1
        best = alive[0] if len(alive) == 1 else max(
            alive, key=lambda i: normalized_prompt_logprobs[i])
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs})


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """Mean over the choice's tokens of (logprob given the prefix - logprob with no prefix): prefers
    choices the context makes likelier, not choices that are likely anyway."""

    requires_unconditional_logprobs = True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 unconditional_token_logprobs=None):
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            n = min(len(cond), len(uncond))
            # align on the last n tokens: the choice's own tokens end both sequences
            diff = [c - u for c, u in zip(cond[len(cond) - n:], uncond[len(uncond) - n:])]
            scores.append(sum(diff) / max(n, 1))
        best = _argmax(scores)
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "unconditional_token_logprobs": unconditional_token_logprobs,
            "unconditional_normalized_scores": scores})


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()


def decide(method: Any, choices: list[str], token_logprobs: list[list[float]],
           unconditional: Optional[list[list[float]]] = None) -> ChoicesDecision:
    method = method or token_length_normalized
    normalized = [sum(lp) / max(len(lp), 1) for lp in token_logprobs]
    return method(choices=choices, normalized_prompt_logprobs=normalized,
                  input_token_logprobs=token_logprobs, unconditional_token_logprobs=unconditional)
