"""The detokenizer process fails one request, not itself (server/detokenizer_process.py): the
failed request's update carries an error finish and `failed` (the TokenizerManager then aborts it
in the scheduler), its later updates are dropped, the other requests' text goes on."""

from __future__ import annotations

import logging

import pytest

from radixlm.server import detokenizer_process
from radixlm.server.detokenizer_process import Detokenizer
from radixlm.server.io_struct import BatchTokenOut, ReqUpdate


@pytest.fixture(scope="module")
def tokenizer():
    from radixlm.runtime.models import loader

    return loader.load_tokenizer(loader.default_model_path(), "gguf")


def _up(rid: str, ids: list[int], n: int, finish=None) -> ReqUpdate:
    return ReqUpdate(rid, ids, n, finish, prompt_tokens=3, cached_tokens=0)


def test_one_failing_request_leaves_the_others(tokenizer, monkeypatch, caplog):
    caplog.set_level(logging.ERROR)
    real = detokenizer_process._DecodeState.feed

    def feed(self, tok, up):
        if up.rid == "bad":
            raise UnicodeDecodeError("utf-8", b"\x80", 0, 1, "injected failure")
        return real(self, tok, up)

    monkeypatch.setattr(detokenizer_process._DecodeState, "feed", feed)
    det = Detokenizer(tokenizer)
    hello = tokenizer.encode("Hello world")
    out = det.process(BatchTokenOut([_up("good", hello[:1], 1), _up("bad", hello, 2)]))
    good, bad = out.updates
    assert not good.failed and good.text_delta
    assert bad.failed and bad.update.finish["status_code"] == 500
    assert "detokenization" in bad.update.finish["message"] and bad.update.new_ids == []
    assert any("bad" in r.getMessage() and r.exc_info for r in caplog.records)
    # the failed request's later updates (until the scheduler's finish) are dropped
    out = det.process(BatchTokenOut([_up("bad", hello[:1], 3), _up("good", hello[1:], 2)]))
    assert [u.rid for u in out.updates] == ["good"]
    out = det.process(BatchTokenOut([_up("bad", [], 3, {"type": "abort"}),
                                     _up("good", [], 2, {"type": "length", "length": 2})]))
    assert [u.rid for u in out.updates] == ["good"]
    assert not det.failed and not det.states
