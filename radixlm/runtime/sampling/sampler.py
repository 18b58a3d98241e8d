"""Sampler: logits (B, V) -> next token ids (B,) plus the requested logprobs.

One step, every row at once:
  1. penalties and hard masks (SamplingBatchInfo.apply_penalties_and_masks, in place);
  2. all rows greedy -> argmax and done;
  3. otherwise logits / temperature -> softmax -> drop tokens below a per-row threshold that
     top-k, top-p and min-p define -> one categorical draw per row with the exponential race:
     argmax_v(p_v / E_v), E_v ~ Exp(1) i.i.d., picks v with probability p_v / sum(p). It needs
     no normalization, no cumulative sum and no multinomial call, and a row's draw depends only
     on its own probabilities and its own noise row;
  4. greedy rows of a mixed batch take the argmax of their (penalized) logits.

Seeded requests draw their noise row from their own torch.Generator (`Req.generator`, created on
first use and kept on the request), so their tokens do not depend on what else shares the batch.
The only per-request loop is over those seeded rows.

Logprobs describe the model's own distribution: log_softmax of the raw logits, before penalties,
masks and temperature (SGLang's default).

Device -> host syncs: none. The caller reads next_token_ids when it needs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from radixlm.runtime.layers import cpu_fused
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.logprobs import token_logprobs
from radixlm.runtime.sampling.sampling_batch_info import SamplingBatchInfo

# Exp(1) noise is clamped away from 0: p / 0 would be inf (or nan for p == 0), and argmax treats
# nan as the maximum. The clamp changes a draw with probability ~1e-20 per element.
_MIN_NOISE = 1e-20


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # (B,) int64
    logprobs: Optional[torch.Tensor] = None  # (B,) float32, logprob of the chosen token
    top_logprobs_vals: Optional[torch.Tensor] = None  # (B, top_logprobs_num) float32, descending
    top_logprobs_ids: Optional[torch.Tensor] = None  # (B, top_logprobs_num) int64
    # (B, V) the unpenalized logits, kept when logprobs are asked for: token_ids_logprob reads them
    raw_logits: Optional[torch.Tensor] = None

    def take_rows(self, rows: list[int]) -> "SampleOutput":
        """The output of the given rows only (host tensors; raw_logits is not carried: a batch
        that needs it never loses rows this way, see scheduler._complete_decode)."""
        index = torch.tensor(rows, dtype=torch.int64)
        pick = (lambda t: None if t is None else t.index_select(0, index))
        return SampleOutput(next_token_ids=pick(self.next_token_ids),
                            logprobs=pick(self.logprobs),
                            top_logprobs_vals=pick(self.top_logprobs_vals),
                            top_logprobs_ids=pick(self.top_logprobs_ids))


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        reqs: list[Req],
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> SampleOutput:
        """logits: (B, V) float32, row i for reqs[i]; overwritten (penalties, temperature).

        Calls info.update(next_token_ids) before returning, so the penalty counts and min-token
        counters already include this step's tokens.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(info) == len(reqs), (
            logits.shape, len(info), len(reqs))
        logits = logits.float()  # no copy when already float32
        # Raw logits are kept only when logprobs are asked for; everything below edits in place.
        raw = logits.clone() if return_logprob else None

        info.apply_penalties_and_masks(logits)
        if info.is_all_greedy:
            next_ids = cpu_fused.argmax_rows(logits)  # torch's argmax off the CPU
        else:
            next_ids = self._sample(logits, info, reqs)

        out = SampleOutput(next_token_ids=next_ids, raw_logits=raw)
        if return_logprob:
            out.logprobs, out.top_logprobs_vals, out.top_logprobs_ids = token_logprobs(
                raw, next_ids, top_logprobs_num)
        info.update(next_ids)
        return out

    # --- stochastic path ----------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, info: SamplingBatchInfo, reqs: list[Req]) -> torch.Tensor:
        # Greedy rows of a mixed batch: argmax before temperature touches the logits. Their
        # temperature entry is 1.0, so the division below leaves them finite.
        greedy_ids = logits.argmax(dim=-1) if info.any_greedy else None  # (B,)
        probs = self.filtered_probs(logits, info)
        next_ids = probs.div_(row_noise(probs, info, reqs, "exponential")).argmax(dim=-1)  # (B,)
        if greedy_ids is not None:
            next_ids = torch.where(info.greedy_rows, greedy_ids, next_ids)
        return next_ids

    def filtered_probs(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """The distribution a row samples from, (B, V): logits (penalized, in place) / temperature
        -> softmax -> tokens below the top-k / top-p / min-p cut set to 0. Not renormalized (the
        exponential race does not need it; divide by the row sum for probabilities)."""
        logits.div_(info.temperatures)  # (B, V) / (B, 1)
        probs = torch.softmax(logits, dim=-1)  # (B, V)
        if info.need_top_k or info.need_top_p or info.need_min_p:
            threshold = self._keep_threshold(probs, info)  # (B, 1)
            # Ties at the threshold are all kept: the kept set depends only on the row's values.
            probs.masked_fill_(probs < threshold, 0.0)
        return probs

    @staticmethod
    def _keep_threshold(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Per-row probability below which tokens are dropped, (B, 1).

        All three filters keep a prefix of the tokens sorted by probability, so each is one cut
        value: top-k keeps the k most likely; top-p (applied after top-k and relative to the
        top-k mass, as HF and vLLM do) keeps the fewest most-likely tokens whose mass reaches
        top_p, at least one; min-p keeps tokens with p >= min_p * max(p). The result is the
        largest of the three cuts. Rows where a filter is off get a cut of 0 for it.
        """
        B, V = probs.shape
        top_ks = info.top_ks.view(-1, 1)  # (B, 1), V where disabled
        threshold = probs.new_zeros(B, 1)
        if info.need_top_p:
            # Top-p needs the whole sorted row; top-k reads its cut from the same sort.
            sorted_p = probs.sort(dim=-1, descending=True).values  # (B, V)
            cum = sorted_p.cumsum(dim=-1)  # (B, V), non-decreasing
            topk_mass = cum.gather(1, top_ks - 1)  # (B, 1): mass of the top-k set
            # Token j (0-based, sorted) is kept iff the mass before it is < top_p * topk_mass;
            # token 0 always is. Positions past top-k never count: their cum >= topk_mass.
            top_ps = info.top_ps.view(-1, 1)  # (B, 1)
            before = cum[:, :-1] < top_ps * topk_mass  # (B, V-1)
            n_keep = (1 + before.sum(dim=-1, keepdim=True)).clamp_(max=top_ks)  # (B, 1)
            # Rows with top_p == 1 take the plain top-k cut: rounding can make cum reach the
            # total early, which would otherwise drop a tail of tiny but non-zero tokens.
            n_keep = torch.where(top_ps < 1.0, n_keep, top_ks)
            threshold = sorted_p.gather(1, n_keep - 1)
            row_max = sorted_p[:, :1]
        elif info.need_top_k:
            # Only the k_max largest per row are needed: topk is much cheaper than a full sort.
            k_max = info.max_top_k
            top_vals = probs.topk(k_max, dim=-1).values  # (B, k_max), descending
            kth = top_vals.gather(1, top_ks.clamp(max=k_max) - 1)  # (B, 1)
            threshold = torch.where(top_ks < V, kth, threshold)
            row_max = top_vals[:, :1]
        else:
            row_max = probs.amax(dim=-1, keepdim=True)  # (B, 1)
        if info.need_min_p:
            threshold = torch.maximum(threshold, info.min_ps.view(-1, 1) * row_max)
        return threshold


def row_noise(like: torch.Tensor, info: SamplingBatchInfo, reqs: list[Req],
              kind: str) -> torch.Tensor:
    """Noise shaped like `like` ((B, V) or (B,)): i.i.d. Exp(1) (clamped away from 0) or U[0, 1).
    Seeded rows draw from their request's own generator, so their draws do not depend on what
    else shares the batch."""
    noise = torch.empty_like(like)
    draw = noise.exponential_ if kind == "exponential" else noise.uniform_
    draw()
    for i in info.seeded_rows:  # the only per-request loop: each seeded row has its own RNG
        row = noise[i]
        (row.exponential_ if kind == "exponential" else row.uniform_)(
            generator=_generator_for(reqs[i], like.device))
    return noise.clamp_(min=_MIN_NOISE) if kind == "exponential" else noise


def _generator_for(req: Req, device: torch.device) -> torch.Generator:
    """The request's own RNG, seeded from sampling_params.seed on first use. It lives on the
    request, so it keeps its position in the stream across batch changes and retractions."""
    if req.generator is None:
        req.generator = torch.Generator(device=device)
        req.generator.manual_seed(req.sampling_params.seed)
    return req.generator
