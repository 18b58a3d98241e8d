"""Jump-forward inside a UTF-8 character. Found by fuzzing the server: a grammar that forces a
non-ASCII character, after a byte-level token that ended in the middle of that character, made
xgrammar's forced string start with UTF-8 continuation bytes; its binding raised
UnicodeDecodeError, which crashed the scheduler (every request in flight lost). No jump happens
there now; the grammar mask still forces the bytes token by token."""

from __future__ import annotations

from types import SimpleNamespace

from radixlm.runtime.constrained import grammar as grammar_mod
from radixlm.runtime.constrained.jump_forward import try_jump_forward


def test_no_jump_from_inside_a_character():
    xgr = grammar_mod._xgr()
    # one token per byte value, as raw bytes (a byte-level BPE vocabulary's single-byte tokens)
    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)], vocab_type=xgr.VocabType.RAW)
    compiled = xgr.GrammarCompiler(info).compile_regex("éé")  # é = C3 A9
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_token(0xC3)  # the first byte of é: the matcher is mid-character
    req = SimpleNamespace(grammar=matcher, output_ids=[0xC3], return_logprob=False)
    assert try_jump_forward(req, tokenizer=None) is None
    assert req.output_ids == [0xC3]
    assert matcher.accept_token(0xA9) and matcher.accept_token(0xC3)  # the mask still leads on
