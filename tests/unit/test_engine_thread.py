"""The in-process engine's scheduler thread: it reports a step's progress to asyncio consumers in
one callback per event loop (engine._notify_all), in order, and to the synchronous ones
directly; `enable_gc_freeze` freezes the start-up objects as the server's scheduler does."""

from __future__ import annotations

import asyncio
import gc
import threading

from radixlm.runtime.engine import _notify_all, _Sink


def test_a_steps_updates_take_one_callback_per_loop():
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    thread = threading.Thread(target=lambda: (asyncio.set_event_loop(loop), ready.set(),
                                              loop.run_forever()), daemon=True)
    thread.start()
    ready.wait()
    try:
        async def make():
            return [_Sink(object(), loop) for _ in range(3)]

        streams = asyncio.run_coroutine_threadsafe(make(), loop).result()
        plain = _Sink(object())  # a synchronous consumer: its thread queue
        calls = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(a), real(*a))[1]
        _notify_all([(streams[0], 1, False), (plain, 4, True), (streams[1], 2, False),
                     (streams[2], 3, True)])
        _notify_all([(streams[0], 2, True)])
        assert len(calls) == 2  # one a step, not one a request

        async def drain():
            return [[s.queue.get_nowait() for _ in range(s.queue.qsize())] for s in streams]

        got = asyncio.run_coroutine_threadsafe(drain(), loop).result()
        assert got == [[(1, False), (2, True)], [(2, False)], [(3, True)]]
        assert plain.queue.get_nowait() == (4, True) and plain.done.is_set()
        assert streams[2].done.is_set() and not streams[1].done.is_set()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()


def test_gc_freeze_applies_to_an_engine(make_engine, integrity):
    gc.unfreeze()
    try:
        eng = make_engine(enable_gc_freeze=True)
        assert gc.get_freeze_count() > 0  # (was ignored by the Engine: a flag doing nothing)
        assert eng.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
        integrity(eng)
    finally:
        gc.unfreeze()  # the test process goes on collecting


def test_streams_honour_stream_interval(make_engine, integrity):
    """A stream sends the first token at once, then an update every stream_interval tokens (the
    request's, else the engine's), and the end: as the server's streams (the Engine sent
    every token whatever the field said)."""
    import asyncio

    eng = make_engine(stream_interval=3)
    sp = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0}
    counts = [len(c["output_ids"]) for c in eng.generate("Hello", sp, stream=True)]
    assert counts == [1, 4, 7, 8], counts
    sp_own = dict(sp, stream_interval=5)

    async def collect():
        return [len(c["output_ids"]) async for c in
                await eng.async_generate("Hello", sp_own, stream=True)]

    assert asyncio.run(collect()) == [1, 6, 8]
    integrity(eng)


def test_stream_text_is_incremental_and_agrees_with_the_final(make_engine, integrity,
                                                              monkeypatch):
    """A stream's chunks carry cumulative text decoded incrementally (each chunk decodes only
    its new ids and a short window, not the whole output again), each a prefix of the final
    text, which is the plain decode's."""
    eng = make_engine()
    calls = []
    real = eng.tokenizer.decode

    def decode(ids, *a, **k):
        calls.append(len(ids))
        return real(ids, *a, **k)

    monkeypatch.setattr(eng.tokenizer, "decode", decode)
    sp = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0}
    chunks = list(eng.generate("Write a story about a cat:", sp, stream=True))
    final = chunks[-1]
    assert final["text"] == real(final["output_ids"], skip_special_tokens=True)
    for c in chunks[:-1]:
        assert final["text"].startswith(c["text"])
    assert len(chunks) == 40 and chunks[-2]["text"]
    # the partial chunks' decodes: a window each (<= a few ids), not all ids so far
    assert max(calls[:-1]) <= 8, calls  # (the last call: the final text's full decode)
    integrity(eng)
