"""Structured outputs: grammar-constrained decoding (the engine core behind lab 13 and
`course.serve`'s `response_format`).

    regex.py        a regular expression -> a minimal DFA over UTF-8 bytes
    tokens.py       the vocabulary's bytes and trie; allowed tokens per state; the packed bitmask
    json_schema.py  a JSON Schema subset (and bounded-depth json_object) -> a regular expression
    decode.py       Grammar (cached masks), GrammarState per request, generate with jump-forward
"""
from course.structured.decode import (
    FINISHED, Generation, Grammar, GrammarState, compile_grammar, fill_masks, generate,
)
from course.structured.json_schema import UnsupportedSchemaError, json_object_regex, resolve_refs, schema_to_regex
from course.structured.regex import DFA, compile_regex
from course.structured.tokens import TokenMask, Vocabulary, apply_token_mask_, pack, token_bytes, unpack

__all__ = [
    "DFA", "compile_regex", "schema_to_regex", "resolve_refs", "json_object_regex", "UnsupportedSchemaError",
    "Vocabulary", "token_bytes", "TokenMask", "pack", "unpack", "apply_token_mask_",
    "Grammar", "GrammarState", "compile_grammar", "fill_masks", "generate", "Generation", "FINISHED",
]
