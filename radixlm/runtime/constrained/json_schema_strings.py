"""JSON Schema grammars whose length-bounded strings admit only valid JSON.

xgrammar (0.2.8; upstream issue mlc-ai/xgrammar#800, open) lowers a string with `minLength` /
`maxLength` to a bounded repetition of the class `[^"\\\r\n]`: raw control characters other than
CR/LF (a tab, U+0001, ...) pass there, although JSON forbids them inside strings, so a model may
emit text that `json.loads` (strict, the default) rejects. Seen here with a random tiny model on
forced tool calls ("Invalid control character"), and reported upstream on real models at ~1% of
calls. `json_schema_grammar` builds xgrammar's grammar, and where that class appears rewrites it
in the grammar's EBNF text to `[^\0-\x1f"\\\ud800-\udfff]` and parses it back: no control
character (as xgrammar's unbounded strings), and no UTF-16 surrogate either. xgrammar accepts the
3-byte UTF-8 form of a surrogate (ED A0 80) as one character, which Python decodes to three
U+FFFD: seen when a random model filled a maxLength-20 string to 22 characters. (Escape sequences stay unemittable inside bounded strings: xgrammar's other half of the
issue, unchanged. Schemas inside structural tags reach xgrammar as text and keep the hole.) Rewriting the schema to a `pattern` instead was tried: xgrammar compiles
`{0,200}` that way with an internal check failure.
"""

from __future__ import annotations

import json
from typing import Any

_BOUNDED_CHAR = '[^\\"\\\\\\r\\n]'  # as xgrammar prints it
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\ud800-\\udfff]'


def json_schema_grammar(schema: Any, any_whitespace: bool = False):
    """xgrammar Grammar for `schema` (a JSON string or parsed JSON), with the fix above."""
    import xgrammar as xgr

    text = schema if isinstance(schema, str) else json.dumps(schema)
    grammar = xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
    ebnf = str(grammar)
    if _BOUNDED_CHAR not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_BOUNDED_CHAR, _JSON_STRING_CHAR))
