"""The scheduler's processes shorten the interpreter's switch interval (runtime/gil_switch.py):
the Engine's caller threads otherwise stall its torch ops for up to 5 ms each."""

from __future__ import annotations

import sys

import pytest

from radixlm.runtime.gil_switch import DEFAULT_MS, lower_switch_interval


@pytest.fixture(autouse=True)
def _restore_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # Python's default, whatever an earlier engine set
    yield
    sys.setswitchinterval(before)


def test_lowers_to_the_default(monkeypatch):
    monkeypatch.delenv("RADIXLM_SWITCH_INTERVAL_MS", raising=False)
    assert lower_switch_interval() == pytest.approx(DEFAULT_MS / 1e3)


def test_the_environment_sets_it_or_leaves_pythons(monkeypatch):
    monkeypatch.setenv("RADIXLM_SWITCH_INTERVAL_MS", "0.2")
    assert lower_switch_interval() == pytest.approx(0.0002)
    sys.setswitchinterval(0.005)
    monkeypatch.setenv("RADIXLM_SWITCH_INTERVAL_MS", "0")
    assert lower_switch_interval() == pytest.approx(0.005)
    monkeypatch.setenv("RADIXLM_SWITCH_INTERVAL_MS", "fast")
    with pytest.raises(ValueError, match="RADIXLM_SWITCH_INTERVAL_MS"):
        lower_switch_interval()


def test_a_shorter_interval_is_kept(monkeypatch):
    monkeypatch.delenv("RADIXLM_SWITCH_INTERVAL_MS", raising=False)
    sys.setswitchinterval(0.0001)
    assert lower_switch_interval() == pytest.approx(0.0001)


def test_an_engine_lowers_it(engine, monkeypatch):
    """(The session's engine was made before this test's fixture reset the interval: a new
    Engine's start is what is checked, on the shared model, which loads once.)"""
    import radixlm

    monkeypatch.delenv("RADIXLM_SWITCH_INTERVAL_MS", raising=False)
    eng = radixlm.Engine(model_path=engine.runner.model_path, dtype="float32",
                         max_total_tokens=2048, context_length=512)
    try:
        assert sys.getswitchinterval() == pytest.approx(DEFAULT_MS / 1e3)
    finally:
        eng.shutdown()
