"""The detokenizer process: token updates in, text deltas out.

Per request it keeps an IncrementalDetokenizer (never half a UTF-8 character) and a
StopStringChecker (never any part of a stop string); both are created on a request's first update
and dropped when it finishes. The stop token that ended a request is not part of its text.

One request's failure here (its ids, its settings) fails that request, not the process: its
update goes out with an error finish (`status_code` 500, an error in every API) and `failed`
set, so the TokenizerManager aborts it in the scheduler; its later updates are dropped. Logged
with the rid and traceback, and counted (the TokenizerManager adds them to `request_failures`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import traceback

import zmq

from radixlm.runtime.detokenize import IncrementalDetokenizer, StopStringChecker
from radixlm.runtime.models import loader
from radixlm.server.child_process import watch_parent
from radixlm.server.io_struct import BatchTextOut, BatchTokenOut, ReqUpdate, TextUpdate

logger = logging.getLogger(__name__)


class _DecodeState:
    def __init__(self, tokenizer, up: ReqUpdate):
        self.detok = IncrementalDetokenizer(tokenizer, up.skip_special_tokens,
                                            up.spaces_between_special_tokens)
        self.stops = StopStringChecker(list(up.stop_strs), no_stop_trim=up.no_stop_trim)
        self.stopped = False  # a stop string matched: nothing more is emitted
        self.detok_chars = 0  # characters the detokenizer has released so far
        self.settings = (up.skip_special_tokens, up.spaces_between_special_tokens)

    def feed(self, tokenizer, up: ReqUpdate) -> str:
        ids = up.new_ids
        fin = up.finish
        if fin and fin.get("type") == "stop" and isinstance(fin.get("matched"), int) and ids:
            ids = ids[:-1]  # the matched stop token is not text
        if up.rollback_to is not None:
            # jump-forward re-tokenized the tail: same text, other ids. Rebuild from the ids and
            # release only what lies past the text already released.
            all_ids = self.detok.ids[: up.rollback_to] + list(ids)
            self.detok = IncrementalDetokenizer(tokenizer, *self.settings)
            text = self.detok.push(all_ids)[self.detok_chars:]
        else:
            text = self.detok.push(ids) if ids else ""
        if fin is not None:
            text += self.detok.flush()
        self.detok_chars += len(text)
        if self.stopped:
            return ""
        out, matched = self.stops.feed(text)
        if matched is not None:
            self.stopped = True
            return out
        if fin is not None:
            out += self.stops.flush()
        return out


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, _DecodeState] = {}
        self.failed: set[str] = set()  # failed here, not finished in the scheduler yet

    def process(self, batch: BatchTokenOut) -> BatchTextOut:
        out = []
        for up in batch.updates:
            if up.rid in self.failed:  # already answered with an error; the abort is on its way
                if up.finish is not None:
                    self.failed.discard(up.rid)
                continue
            try:
                out.append(self._text_update(up))
            except Exception as e:
                out.append(self._failed_update(up, e))
        return BatchTextOut(out)

    def _text_update(self, up: ReqUpdate) -> TextUpdate:
        if self.tokenizer is None:
            return TextUpdate(up.rid, "", up)
        state = self.states.get(up.rid)
        if state is None:
            state = self.states[up.rid] = _DecodeState(self.tokenizer, up)
        tu = TextUpdate(up.rid, state.feed(self.tokenizer, up), up)
        if up.finish is not None:
            del self.states[up.rid]
        return tu

    def _failed_update(self, up: ReqUpdate, exc: Exception) -> TextUpdate:
        logger.error("request %s failed in detokenization; the other requests go on", up.rid,
                     exc_info=(type(exc), exc, exc.__traceback__))
        self.states.pop(up.rid, None)
        if up.finish is None:
            self.failed.add(up.rid)
        finish = {"type": "abort", "status_code": 500,
                  "message": f"internal error in detokenization: {type(exc).__name__}: {exc}"}
        return TextUpdate(up.rid, "", dataclasses.replace(up, new_ids=[], finish=finish),
                          failed=True)


def run_detokenizer_process(tokenizer_path: str, tokenizer_format: str, skip_tokenizer: bool,
                            ipc: dict[str, str], ready_pipe, log_level: str = "warning",
                            tokenizer=None) -> None:
    """Process entry point. `tokenizer`: the parent's, when this process was forked from it
    (saves loading it again); else it is loaded from `tokenizer_path`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    watch_parent()
    logging.basicConfig(level=log_level.upper(),
                        format="[detokenizer %(asctime)s] %(levelname)s %(message)s")
    try:
        tok = tokenizer
        if tok is None and not skip_tokenizer:
            tok = loader.load_tokenizer(tokenizer_path, tokenizer_format)
        ctx = zmq.Context(1)
        recv = ctx.socket(zmq.PULL)
        recv.bind(ipc["detokenizer_in"])
        send = ctx.socket(zmq.PUSH)
        send.connect(ipc["tokenizer_in"])
        detok = Detokenizer(tok)
        ready_pipe.send(("ready", None))
    except Exception:
        ready_pipe.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            msg = pickle.loads(recv.recv())
            if msg == "shutdown":
                return
            send.send(pickle.dumps(detok.process(msg)))
    except Exception:
        logger.error("detokenizer crashed:\n%s", traceback.format_exc())
        os._exit(1)
