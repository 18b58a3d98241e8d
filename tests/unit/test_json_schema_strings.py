"""constrained/json_schema_strings: length-bounded strings admit no raw control characters (valid
JSON for a strict parser), and keep their bounds; the check fails if an xgrammar upgrade changes
the printed rule the fix rewrites while the hole is still there."""

from __future__ import annotations

import json

import pytest

from radixlm.runtime.constrained.json_schema_strings import json_schema_grammar

xgr = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "required": ["a", "b"], "properties": {
    "a": {"type": "string", "minLength": 1, "maxLength": 5},
    "b": {"type": "array", "items": {"type": "string", "maxLength": 3}},
    "c": {"type": "string"}}}


@pytest.fixture(scope="module")
def compiler():
    # a byte-level vocabulary is enough to walk any string through the matcher
    return xgr.GrammarCompiler(xgr.TokenizerInfo([chr(i) for i in range(128)]))


def accepts(compiler, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(json_schema_grammar(SCHEMA)),
                                 terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


@pytest.mark.parametrize("text,ok", [
    ('{"a": "abcde", "b": ["xyz"]}', True),
    ('{"a": "ab", "b": [], "c": "free\\ttext"}', True),   # unbounded string: escapes as before
    ('{"a": "ab\tc", "b": []}', False),                   # raw tab in a bounded string
    ('{"a": "abc", "b": ["x\x01"]}', False),              # raw U+0001 in a bounded array item
    ('{"a": "abcdef", "b": []}', False),                  # the bound still holds
    ('{"a": "", "b": []}', False),                        # minLength too
])
def test_bounded_strings_are_strict_json(compiler, text, ok):
    assert accepts(compiler, text) is ok
    if ok:
        json.loads(text)  # strict: what clients parse with


def test_unchanged_without_bounded_strings():
    plain = {"type": "object", "properties": {"c": {"type": "string"}}}
    assert str(json_schema_grammar(plain)) == str(
        xgr.Grammar.from_json_schema(json.dumps(plain), any_whitespace=False))


def test_no_surrogates_in_bounded_strings():
    """xgrammar takes the UTF-8 bytes of a surrogate (ED A0 80) for one character; Python decodes
    them to three U+FFFD, over the length bound. Byte-level tokens, as a BPE vocabulary has."""
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([bytes([i]) for i in range(256)]))
    compiled = compiler.compile_grammar(json_schema_grammar(SCHEMA))

    def accepts(text: bytes) -> bool:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return all(matcher.accept_token(b) for b in text) and matcher.is_terminated()

    assert accepts('{"a": "\u00e9\u6f22\U0001f999", "b": []}'.encode())  # 2, 3, 4 bytes
    assert not accepts(b'{"a": "x\xed\xa0\x80", "b": []}')  # U+D800 as UTF-8
