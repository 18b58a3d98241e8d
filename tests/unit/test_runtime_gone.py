"""When the runtime is gone (a child process died, the server stops), TokenizerManager.fail_all
ends what waits and refuses what comes later: nothing waits for an answer that cannot come.
The end-to-end checks (SIGKILL of each child) are tests/e2e/test_faults.py."""

from __future__ import annotations

import asyncio

import pytest

from radixlm.server.errors import RuntimeGoneError, server_abort, server_fault, to_api_error
from radixlm.server.io_struct import GenerateReqInput
from radixlm.server.tokenizer_manager import ReqState, TokenizerManager

DEAD = "the scheduler process died (exit code -9)"


def _bare_manager() -> TokenizerManager:
    """The state fail_all, generate's first steps and control touch; no sockets."""
    tm = TokenizerManager.__new__(TokenizerManager)
    tm.states, tm.control_waiters, tm.gone, tm._resumed = {}, {}, None, None
    return tm


def test_fail_all_ends_requests_and_control_calls_and_refuses_later_ones():
    async def scenario():
        tm = _bare_manager()
        running = ReqState(GenerateReqInput(text="x"), 1)
        tm.states["r1"] = running
        reply = asyncio.get_running_loop().create_future()
        tm.control_waiters[0] = reply
        tm.fail_all(DEAD)
        assert running.event.is_set() and running.finish == server_abort(DEAD)
        with pytest.raises(RuntimeGoneError, match="scheduler process died"):
            await reply
        with pytest.raises(RuntimeGoneError, match="scheduler process died"):
            await tm.generate(GenerateReqInput(text="y")).__anext__()
        with pytest.raises(RuntimeGoneError, match="scheduler process died"):
            await tm.control("get_stats")
        assert list(tm.states) == ["r1"]  # the refused one was never registered

    asyncio.run(scenario())


def test_server_aborts_are_errors_and_plain_aborts_reasons():
    assert server_fault(server_abort(DEAD)) == (503, DEAD)
    assert server_fault({"type": "abort", "message": "aborted by request"}) is None
    assert server_fault({"type": "length", "length": 5}) is None and server_fault(None) is None
    err = to_api_error(RuntimeGoneError(DEAD))
    assert (err.status, err.message) == (503, DEAD)
