"""Incremental detokenization and stop-string matching for streamed output.

IncrementalDetokenizer: ids arrive a few at a time; text must leave as soon as it is final.
Decoding each new token alone is wrong twice over: a byte-level BPE token can hold part of a
UTF-8 character (an emoji is often 2-4 tokens), and some decoders (SentencePiece's "▁" / HF
Metaspace) drop a token's leading space when it starts the decoded sequence. So we decode a
short window that starts one already-emitted chunk back (`prefix_offset`) and emit only what
goes past the text already emitted (`read_offset`), and nothing while the window's text ends in
U+FFFD (an incomplete character):

    ids:   ... | emitted earlier | last emitted chunk | not yet emitted |
                                 ^prefix_offset       ^read_offset      ^len(ids)
    delta = decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])

Each push decodes O(window) tokens, never the whole sequence.

StopStringChecker: stop strings may straddle deltas, so text that could still become the start
of a stop string is held back until it is ruled out or completes; a stop string never leaks.
"""

from __future__ import annotations

from typing import Optional

REPLACEMENT_CHAR = "\ufffd"  # what decode() yields for bytes that are not (yet) a full character


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.decode_kwargs = dict(skip_special_tokens=skip_special_tokens,
                                  # honoured by slow (Python) tokenizers; fast ones ignore it
                                  spaces_between_special_tokens=spaces_between_special_tokens)
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window (see module docstring)
        self.read_offset = 0  # ids before this index have had their text emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.decode_kwargs) if ids else ""

    def push(self, new_ids: list[int]) -> str:
        """Append ids; return the text they finalize ("" while a character is incomplete)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window_text = self._decode(self.ids[self.prefix_offset:])
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            # Nothing new (e.g. a skipped special token) or a character still missing bytes.
            # Offsets stay put, so the next push decodes these ids again with their successors.
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return window_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end of the stream: emit held text; incomplete bytes decode to U+FFFD."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return window_text[len(prefix_text):]


class StopStringChecker:
    """Feed text deltas; get back the text that is safe to emit and, once, the matched stop.

    A stop string matches at the first position where any stop string ends (so the outcome does
    not depend on how the text was split into deltas); among stops ending at the same position
    the longest wins. The emitted text stops right before the match (or right after it with
    no_stop_trim). After a match, further feeds return ("", None).
    """

    def __init__(self, stops: list[str], no_stop_trim: bool = False):
        self.stops = [s for s in dict.fromkeys(stops) if s]  # dedupe, keep order, drop ""
        self.no_stop_trim = no_stop_trim
        self.max_len = max((len(s) for s in self.stops), default=0)
        # Every proper prefix of every stop: a held-back suffix must be one of these.
        self._prefixes = {s[:i] for s in self.stops for i in range(1, len(s))}
        self.held = ""  # text not yet emitted: always a proper prefix of some stop string
        self.matched: Optional[str] = None

    def feed(self, text_delta: str) -> tuple[str, Optional[str]]:
        if self.matched is not None:
            return "", None
        if not self.stops:
            return text_delta, None
        buf = self.held + text_delta
        # The held text contains no complete stop (it would have matched earlier), so any match
        # ends inside the delta. Pick the earliest end, then the earliest start.
        best: Optional[tuple[int, int, str]] = None  # (end, start, stop)
        for s in self.stops:
            start = buf.find(s)
            if start >= 0:
                cand = (start + len(s), start, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is not None:
            end, start, s = best
            self.held, self.matched = "", s
            return buf[:end] if self.no_stop_trim else buf[:start], s
        # No match: hold the longest suffix that could still grow into a stop string.
        keep = 0
        for n in range(min(len(buf), self.max_len - 1), 0, -1):
            if buf[-n:] in self._prefixes:
                keep = n
                break
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        """End of stream without a match: the held text was not a stop string after all."""
        out, self.held = self.held, ""
        return out
