"""Jump-forward decoding: append the text a grammar forces, instead of decoding it token by token.

The compressed FSM. A grammar compiles to an automaton over characters; at any point of a
generation the matcher sits in a set of states. Follow the edges the matcher could take next: when
every live state allows exactly one next character, that character is forced; appending it moves
to the next state, and the walk repeats until two or more characters are possible (or the grammar
may end). Collapsing each such chain of single-successor states into one edge labelled with the
whole string gives the compressed FSM: from the current state, the compressed edge is the forced
string. xgrammar's `GrammarMatcher.find_jump_forward_string()` performs this walk on its pushdown
automaton (which also covers JSON schemas' nesting), so we ask it at each step, not precompute it.

Re-tokenization. The forced string is text, and its tokens must be the ones the model would have
produced: token boundaries can cross from the already generated text into the forced text (e.g.
`"` then `name` vs `"name`). So the last few generated tokens are decoded, the forced string is
appended, the whole tail is re-tokenized with the real tokenizer, and generated tokens that differ
are rolled back (grammar rollback included) before the new ones are accepted. The caller then
recomputes KV from the first changed position in one extend step, mostly a radix-cache hit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

RETOKENIZE_TAIL = 2  # generated tokens re-tokenized together with the forced string
FORCED_TOKEN_LOGPROB = 0.0  # a forced token has probability 1 under the constraint


@dataclass
class JumpResult:
    first_changed: int  # index into output_ids of the first token that is new or replaced
    old_tail: list  # output_ids[first_changed:] before the splice (their KV may exist)
    forced_text: str
    num_new_tokens: int


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def try_jump_forward(req, tokenizer) -> Optional[JumpResult]:
    """If the request's grammar forces a string now, splice it into `req.output_ids` (updating the
    grammar matcher and logprob lists) and return what changed; otherwise return None."""
    matcher = req.grammar
    if matcher is None or matcher.is_terminated():
        return None
    try:
        forced = matcher.find_jump_forward_string()
    except UnicodeDecodeError:
        # The matcher stands inside a UTF-8 character (a byte-level token ended mid-character):
        # the forced bytes start with continuation bytes, which xgrammar's binding cannot decode
        # to str. Found by fuzzing (regex "éé" after the token for byte C3): it crashed the
        # scheduler. No jump now; the grammar mask still forces those bytes token by token.
        return None
    if not forced:
        return None
    out = req.output_ids
    k = min(RETOKENIZE_TAIL, len(out))
    tail = out[len(out) - k:]
    tail_text = tokenizer.decode(tail) if tail else ""
    if "\ufffd" in tail_text:
        return None  # the tail ends inside a multi-byte character: splice later
    new_tail = tokenizer.encode(tail_text + forced, add_special_tokens=False)
    if tokenizer.decode(new_tail) != tail_text + forced:
        return None  # this tokenizer does not round-trip the text: never guess
    common = _common_prefix(tail, new_tail)
    if common == len(new_tail):
        return None
    rollback = k - common
    if rollback:
        matcher.rollback(rollback)
    accepted = 0
    for t in new_tail[common:]:
        if not matcher.accept_token(t):
            matcher.rollback(accepted)  # restore the matcher exactly as it was
            for t_old in tail[common:]:
                matcher.accept_token(t_old)
            return None
        accepted += 1
    first_changed = len(out) - k + common
    del out[first_changed:]  # == tail[common:]
    out.extend(new_tail[common:])
    if req.return_logprob:
        n_new = len(new_tail) - common
        del req.output_token_logprobs[first_changed:]
        req.output_token_logprobs.extend([FORCED_TOKEN_LOGPROB] * n_new)
        if req.top_logprobs_num:
            del req.output_top_logprobs[first_changed:]
            req.output_top_logprobs.extend([[]] * n_new)
        if req.token_ids_logprob:  # forced tokens were not sampled: no distribution to report
            del req.output_token_ids_logprobs[first_changed:]
            req.output_token_ids_logprobs.extend([None] * n_new)
    return JumpResult(first_changed, tail[common:], forced, len(new_tail) - common)
