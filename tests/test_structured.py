"""course.structured (lab 13's released engine core): regex -> DFA, token masks, JSON Schema, decoding.

Each part is checked against an independent reference: Python's `re` for the automaton, a brute
force (decode every token, walk it) for the trie's masks, `json.loads` + `jsonschema` for what the
grammar lets through, xgrammar (the library vLLM and SGLang use) for the masks themselves, step by
step, where our language and xgrammar's are the same. The real model runs only in the `slow` tests.
"""
from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch

import course
from course.engine.sampler import SamplingParams
from course.structured import (
    FINISHED, Grammar, GrammarState, TokenMask, UnsupportedSchemaError, Vocabulary, apply_token_mask_,
    compile_grammar, compile_regex, generate, json_object_regex, pack, schema_to_regex, unpack,
)
from course.structured.regex import utf8_sequences

import xgrammar as xgr      # the reference masks (pinned in the dev extras: missing is a failure, never a skip)

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "city": {"type": "string"}, "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "hobbies"]}
SHORT = {"type": "object", "properties": {           # the real model's: a short answer keeps the slow tests short
    "name": {"type": "string"}, "age": {"type": "integer"},
    "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
    "required": ["name", "age", "hobbies"]}
MIXED = {"type": "object", "properties": {            # every property optional: the first has no comma
    "a": {"type": "number"}, "b": {"enum": ["x", "y", 3, None]}, "c": {"type": "boolean"},
    "d": {"type": "null"}, "e": {"type": "array", "items": {"type": "integer"}, "minItems": 2}}}
NESTED = {"type": "object", "properties": {
    "p": {"type": "object", "properties": {"q": {"type": "string"}, "r": {"const": "fixed"}}, "required": ["q", "r"]},
    "s": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    "t": {"type": ["string", "boolean"]}},
    "required": ["p", "s"]}
BOUNDED = {"type": "object", "properties": {
    "code": {"type": "string", "minLength": 2, "maxLength": 4},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2}},
    "required": ["code", "tags"]}


@pytest.fixture(scope="module")
def tok():
    return course.load_tokenizer()


@pytest.fixture(scope="module")
def vocab(tok):
    return Vocabulary.from_tokenizer(tok)


# --- regex -> DFA ------------------------------------------------------------------------------------

PATTERNS = [r"[a-z]+@(ex|ample)\.com", r"a|b*", r"(ab|a)*c?", r".{2,3}", r"[^a-c]x", r"\d{3}-\d{4}", r"é+|中",
            r"(a|b)*abb", r"x{,2}y{2,}", r"[\w.-]+", r"\s*\S\W?", r"(?:ab)+?|[^\x00-\x7f]", r"[]a-]{1,3}", r"\{\}",
            r"a{", r"(|a)b+?", r"[^\n]*\n", r"\u00e9?\U0001F600{1,2}"]
ALPHABET = "abcxy-.@é中😀\n 0129_{}]\u00ff\u0800\uffff\U00010000\U0010ffff"


def _sample(dfa, rng: random.Random, max_len: int = 12) -> bytes | None:
    """A random string the DFA accepts (a walk to an accepting state), or None."""
    s, out = dfa.start, bytearray()
    for _ in range(max_len):
        if dfa.accept[s] and rng.random() < 0.3:
            return bytes(out)
        nxt = np.flatnonzero(dfa.trans[s] >= 0)
        if not len(nxt):
            break
        out.append(int(rng.choice(nxt.tolist())))
        s = int(dfa.trans[s, out[-1]])
    return bytes(out) if dfa.accept[s] else None


def test_regex_dfa_agrees_with_python_re():
    rng = random.Random(0)
    for p in PATTERNS:
        dfa = compile_regex(p)
        seen = {True: 0, False: 0}
        for _ in range(600):                          # random strings: both ways
            s = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6)))
            want = re.fullmatch(p, s, re.ASCII) is not None
            assert dfa.fullmatch(s) == want, f"{p!r} on {s!r}: re says {want}"
            seen[want] += 1
        for _ in range(200):                          # strings the DFA accepts: re must accept them too
            data = _sample(dfa, rng)
            if data is not None:
                s = data.decode()                     # accepted bytes are always valid UTF-8
                assert re.fullmatch(p, s, re.ASCII), f"{p!r}: the DFA accepts {s!r}, re does not"
                seen[True] += 1
        assert seen[True] and seen[False], f"{p!r}: the test saw only one outcome {seen}"


def test_utf8_sequences_are_exactly_the_encodings():
    rng = random.Random(1)
    for _ in range(100):
        lo = rng.randint(0, 0x10FFFF)
        hi = min(0x10FFFF, lo + rng.choice([0, 1, 70, 3000, 70000]))
        seqs = utf8_sequences([(lo, hi)])
        want = {chr(c).encode() for c in range(lo, hi + 1) if not 0xD800 <= c <= 0xDFFF}
        assert sum(int(np.prod([b - a + 1 for a, b in s])) for s in seqs) == len(want), (hex(lo), hex(hi))
        for w in rng.sample(sorted(want), min(50, len(want))):
            hits = [s for s in seqs if len(s) == len(w) and all(a <= x <= b for x, (a, b) in zip(w, s))]
            assert len(hits) == 1, (w, hits)


def test_only_valid_utf8_is_accepted():
    dfa = compile_regex(".")
    # overlong forms, a surrogate, beyond U+10FFFF, stray bytes, and the newline that '.' leaves out
    for bad in (b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xff", b"\x80", b"\n"):
        assert not dfa.fullmatch(bad), f"'.' must not accept {bad!r}"
    for good in ("a", "é", "中", "😀", "\U0010ffff", "\ud7ff", "\ue000"):
        assert dfa.fullmatch(good), good


def test_dfa_is_minimal_live_and_forces_literals():
    assert compile_regex("(a|b)*abb").n_states == 4, "the textbook DFA of (a|b)*abb has 4 states"
    assert compile_regex("a(b|c)d|a(b|c)e").n_states == compile_regex("a[bc][de]").n_states == 4
    dfa = compile_regex(r"[a-z]+@(ex|ample)\.com")
    reach = dfa.accept.copy()                         # every state can still reach an accepting one
    for _ in range(dfa.n_states):
        reach |= ((dfa.trans >= 0) & reach[dfa.trans]).any(axis=1)
    assert reach.all()
    assert dfa.walk(dfa.start, b"me@x") == -1
    s = dfa.walk(dfa.start, b"me@")
    assert dfa.forced(s) == b"" and dfa.forced(dfa.walk(s, b"a")) == b"mple.com"
    assert compile_regex(r'\{"name": "[a-z]+"\}').forced(0) == b'{"name": "'
    assert compile_regex("ab|abc").forced(0) == b"ab", "accepting is a choice: the forced run stops there"


@pytest.mark.parametrize("pattern, at, says", [
    ("a**", 2, "multiple repeat"), ("(ab", 0, "missing ')'"), ("ab)", 2, "unbalanced ')'"),
    ("[a-", 0, "unterminated character class"), ("*a", 0, "nothing to repeat"), ("a{3,1}", 1, "max 1 < min 3"),
    (r"a\b", 1, r"unsupported escape \b"), ("^a", 0, "anchors"), ("[z-a]", 2, "bad character range z-a"),
    ("(?=a)", 1, "only (...) and (?:...)"), (r"\x4", 0, "2 hex digits"), ("a{2000}", 1, "above 1000"),
    ("[^\\x00-\\U0010ffff]", None, "matches no string"), ("a\\", 1, "lone backslash"),
])
def test_bad_patterns_name_their_position(pattern, at, says):
    with pytest.raises(ValueError) as e:
        compile_regex(pattern)
    assert says in str(e.value)
    if at is not None:
        assert f"position {at}:" in str(e.value)
        assert str(e.value).splitlines()[-1] == "    " + " " * at + "^", "the caret points at the position"


# --- tokens: bytes, trie walk, bitmask -------------------------------------------------------------

def test_token_bytes_match_the_tokenizer(tok, vocab):
    assert vocab.size == len(tok) == 49152 and vocab.eos == [tok.eos_token_id]
    special = set(tok.all_special_ids) | {int(i) for i in tok.added_tokens_decoder}
    assert all(vocab.tokens[i] is None for i in special) and sum(t is None for t in vocab.tokens) == len(special)
    checked = 0
    for i in range(0, len(tok), 7):
        data = vocab.tokens[i]
        if data is not None and _is_utf8(data):
            assert tok.decode([i]) == data.decode(), i
            checked += 1
    assert checked > 6000
    for text in ['{"name": "Zoë", "n": 42}', "  tabs\tand\nnewlines 中文 😀", "ünïcödé"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(vocab.tokens[i] for i in ids) == text.encode(), text


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False


def _brute_force(vocab: Vocabulary, dfa, state: int) -> np.ndarray:
    out = np.zeros(vocab.size, dtype=bool)
    for i, data in enumerate(vocab.tokens):
        out[i] = data is not None and dfa.walk(state, data) >= 0
    if dfa.accepts(state):
        out[vocab.eos] = True
    return out


def test_trie_masks_equal_brute_force(vocab):
    dfa = compile_regex(schema_to_regex(PERSON))
    prefixes = [b"", b'{"name": "', b'{"name": "Jo\xc3', b'{"name": "a\\', b'{"name": "a", "age": 1',
                b'{"name": "a", "age": 12, "hobbies": []', b'{"name": "a", "age": 12, "hobbies": []}']
    counts = []
    for prefix in prefixes:
        s = dfa.walk(dfa.start, prefix)
        assert s >= 0, prefix
        allowed = vocab.allowed(dfa, s)
        np.testing.assert_array_equal(allowed, _brute_force(vocab, dfa, s), err_msg=f"after {prefix!r}")
        counts.append(int(allowed.sum()))
    assert counts[0] == 2, "a person starts with '{' or '{\"': two tokens"
    assert counts[1] > 40000 and counts[2] == 64 and counts[-1] == 1, counts
    dot = compile_regex(".{1,3}")
    for s in range(dot.n_states):
        np.testing.assert_array_equal(vocab.allowed(dot, s), _brute_force(vocab, dot, s))


def test_eos_is_allowed_exactly_where_the_dfa_accepts(vocab):
    dfa = compile_regex("ab|abc")
    for prefix, eos in ((b"", False), (b"a", False), (b"ab", True), (b"abc", True)):
        allowed = vocab.allowed(dfa, dfa.walk(dfa.start, prefix))
        assert allowed[vocab.eos[0]] == eos, prefix
        assert not allowed[[0, 1, 3, 16]].any(), "special tokens are never allowed"


def test_pack_layout_and_apply():
    rng = np.random.default_rng(0)
    V = 100                                          # not a multiple of 32: the last word is partial
    allowed = rng.random((3, V)) < 0.3
    words = np.stack([pack(a) for a in allowed])
    assert words.shape == (3, 4) and words.dtype == np.int32
    one = np.zeros(V, dtype=bool)
    one[33] = True
    assert pack(one).tolist() == [0, 2, 0, 0], "token 33 is bit 1 of word 1"
    one[:] = False
    one[31] = True
    assert pack(one)[0] == -2**31, "bit 31 is the sign bit of an int32"
    t = torch.from_numpy(words)
    assert torch.equal(unpack(t, V), torch.from_numpy(allowed))
    logits = torch.randn(3, V)
    before = logits.clone()
    mask = TokenMask(3, V)
    for b in range(3):
        mask.fill(b, words[b])
    assert mask.apply_(logits) is logits
    want = torch.where(torch.from_numpy(allowed), before, torch.tensor(float("-inf")))
    assert torch.equal(logits, want)
    mask.allow_all(1)
    assert mask.to_bool()[1].all() and torch.equal(mask.to_bool()[0], torch.from_numpy(allowed[0]))
    with pytest.raises(ValueError, match="int32 tensor of shape"):
        apply_token_mask_(torch.randn(3, V), torch.from_numpy(words).long())
    with pytest.raises(ValueError, match=r"\(B, ceil\(V/32\)\) = \(3, 4\)"):
        apply_token_mask_(torch.randn(3, V), torch.from_numpy(words)[:, :3])
    with pytest.raises(ValueError, match="floating"):
        apply_token_mask_(torch.zeros(3, V, dtype=torch.long), torch.from_numpy(words))


# --- JSON Schema -> regex ----------------------------------------------------------------------------

def test_schema_regex_accepts_json_dumps_and_rejects_the_rest():
    dfa = compile_regex(schema_to_regex(PERSON))
    good = [{"name": "Zoë \"Z\" \\ \n", "age": -3, "hobbies": []},
            {"name": "", "age": 0, "city": "Paris", "hobbies": ["a", "b\u0001", "c"]}]
    for v in good:
        assert dfa.fullmatch(json.dumps(v)) and dfa.fullmatch(json.dumps(v, ensure_ascii=False)), v
    bad = [json.dumps({"name": "x", "hobbies": []}),                                     # required age missing
           json.dumps({"age": 1, "name": "x", "hobbies": []}),                           # declared order
           json.dumps({"name": "x", "age": 1.5, "hobbies": []}),                         # not an integer
           json.dumps({"name": "x", "age": 1, "hobbies": [], "extra": 1}),               # undeclared property
           json.dumps({"name": "x", "age": 1, "hobbies": ["a", "b", "c", "d"]}),         # maxItems
           json.dumps({"name": "x", "age": 1, "hobbies": []}, separators=(",", ":")),    # whitespace policy
           '{"name": "x", "age": 01, "hobbies": []}', '{"name": "x", "age": -0, "hobbies": []}',
           '{"name": "a\tb", "age": 1, "hobbies": []}', '{"name": "\\x", "age": 1, "hobbies": []}']
    for text in bad:
        assert not dfa.fullmatch(text), text
    compact = compile_regex(schema_to_regex(MIXED, separators=(",", ":")))
    assert compact.fullmatch(json.dumps({"c": True, "e": [1, 2]}, separators=(",", ":")))
    assert compact.fullmatch("{}") and not compact.fullmatch('{"e": [1]}')


def test_json_object_is_any_object_to_a_bounded_depth():
    dfa = compile_regex(json_object_regex(2))
    assert dfa.fullmatch(json.dumps({"a": [1, "x", None, True], "b": {"c": 2.5e3}, "": {}}))
    assert dfa.fullmatch("{}")
    assert not dfa.fullmatch(json.dumps({"a": {"b": {"c": 1}}})), "depth 3 is beyond max_depth=2"
    assert not dfa.fullmatch("[1]") and not dfa.fullmatch('"x"'), "json_object: the top level is an object"
    with pytest.raises(ValueError, match="max_depth"):
        json_object_regex(0)


@pytest.mark.parametrize("schema, keyword, path", [
    ({"type": "string", "pattern": "a+"}, "pattern", "#"),
    ({"type": "object", "properties": {"x": {"type": "integer", "minimum": 0}}}, "minimum", "#/properties/x"),
    ({"$ref": "#/$defs/a"}, "$ref", "#"),
    ({"oneOf": [{"type": "integer"}]}, "oneOf", "#"),
    ({"type": "strnig"}, "type", "#"),
    ({"type": "object", "properties": {}, "additionalProperties": True}, "additionalProperties", "#"),
    ({"type": "array", "items": [{"type": "integer"}]}, "items", "#"),
    ({"type": "array", "items": {"type": "string", "format": "date"}}, "format", "#/items"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}, "required", "#"),
    ({"type": "string", "maxLength": 1, "minLength": 2}, "maxLength", "#"),
    ({"enum": []}, "enum", "#"),
])
def test_unsupported_keywords_are_named(schema, keyword, path):
    with pytest.raises(UnsupportedSchemaError) as e:
        schema_to_regex(schema)
    assert isinstance(e.value, ValueError)
    assert (e.value.keyword, e.value.path) == (keyword, path)
    assert repr(keyword) in str(e.value) and path in str(e.value)


def test_annotations_are_ignored():
    plain = schema_to_regex({"type": "object", "properties": {"a": {"type": "integer"}}})
    noted = schema_to_regex({"title": "T", "description": "d", "$schema": "x", "type": "object",
                             "properties": {"a": {"type": "integer", "title": "A", "default": 1}}})
    assert plain == noted


def _distances(dfa) -> np.ndarray:
    """Fewest bytes from each state to an accepting one."""
    dist = np.where(dfa.accept, 0, 10**6)
    for _ in range(dfa.n_states):
        nxt = np.where(dfa.trans >= 0, dist[dfa.trans] + 1, 10**6).min(axis=1)
        dist = np.minimum(dist, nxt)
    return dist


def _random_walk(grammar: Grammar, rng: random.Random, budget: int = 40) -> list[int]:
    """Random allowed tokens (nudged toward an end after `budget`) until EOS: every path the masks allow."""
    dist, vocab = _distances(grammar.dfa), grammar.vocab
    st, out = GrammarState(grammar), []
    while not st.finished:
        ids = st.allowed_ids().tolist()
        going = [t for t in ids if t not in vocab.eos]
        if len(out) < budget and going and rng.random() < 0.7:
            t = rng.choice(going)                     # (not EOS yet: walks long enough to see the grammar)
        else:                                     # toward the end: a short token that gets closer
            cands = [t for t in rng.sample(ids, min(64, len(ids))) + ids[:300] if t not in vocab.eos]
            if st.is_accepting and (len(out) >= budget or not cands):
                t = vocab.eos[0]
            else:
                t = min(cands, key=lambda t: (dist[st.next_state(t)], rng.random()))
        st.advance(t)
        out.append(t)
        assert len(out) < 10 * budget, "the walk did not end"
    return out


@pytest.mark.parametrize("schema", [PERSON, MIXED, NESTED, BOUNDED], ids=["person", "mixed", "nested", "bounded"])
def test_every_token_path_the_masks_allow_parses_and_validates(vocab, schema):
    grammar = Grammar.from_json_schema(schema, vocab)
    rng = random.Random(2)
    for _ in range(6):
        ids = _random_walk(grammar, rng)
        assert ids[-1] in vocab.eos
        text = b"".join(vocab.tokens[t] for t in ids[:-1]).decode()       # strict: valid UTF-8
        jsonschema.validate(json.loads(text), schema)


# --- decoding state, jump-forward ------------------------------------------------------------------

def test_grammar_state_advance_eos_rollback(tok, vocab):
    grammar = Grammar.from_regex(r'\{"a": [0-9]+\}', vocab)
    st = GrammarState(grammar)
    ids = tok.encode('{"a": 12}', add_special_tokens=False)
    for t in ids[:-1]:
        st.advance(t)
    assert not st.is_accepting
    with pytest.raises(ValueError, match="EOS before the output is complete"):
        st.advance(tok.eos_token_id)
    with pytest.raises(ValueError, match="leave the grammar"):
        st.advance(tok.encode("x", add_special_tokens=False)[0])
    with pytest.raises(ValueError, match="a special token"):
        st.advance(1)
    before = st.state
    st.advance(ids[-1])
    assert st.is_accepting and st.allowed_ids().tolist() == [tok.eos_token_id], "after '}' only EOS"
    st.advance(tok.eos_token_id)
    assert st.finished and st.state == FINISHED
    with pytest.raises(ValueError, match="already ended"):
        st.advance(ids[0])
    st.rollback(2)
    assert st.state == before and len(st.states) == len(ids)
    with pytest.raises(ValueError, match="roll back"):
        st.rollback(len(ids) + 1)
    mask = TokenMask(2, vocab.size)
    st.fill(mask, 1)
    assert mask.to_bool()[1].sum() == len(st.allowed_ids()) and mask.to_bool()[0].all()


def test_forced_tokens_jump_over_literals(tok, vocab):
    literal = '{"name": "Bob", "ok": true}'
    st = GrammarState(Grammar.from_regex(re.escape(literal), vocab))
    assert st.forced_bytes() == literal.encode()
    assert st.forced_tokens() == [] and len(st.allowed_ids()) > 1, "exact mode: several tokens start it"
    jump = st.forced_tokens(tok)
    assert jump == tok.encode(literal, add_special_tokens=False), \
        "nothing follows: all of it, as the tokenizer writes it"
    for t in jump:
        st.advance(t)
    assert st.forced_tokens() == [tok.eos_token_id], "then EOS is the only token: forced exactly"
    # a free part follows: the tail that a longer allowed token could cover is left to the model
    st = GrammarState(Grammar.from_regex(r'\{"n": (true|false)\}', vocab))
    assert st.forced_bytes() == b'{"n": '
    assert [vocab.tokens[t] for t in st.forced_tokens(tok)] == [b'{"', b"n", b'":'], \
        "' true' is one token: the ' ' is held back"
    st = GrammarState(Grammar.from_regex(r'\{"n": [0-9]+\}', vocab))
    assert [vocab.tokens[t] for t in st.forced_tokens(tok)] == [b'{"', b"n", b'":', b" "], "no token is ' ' + a digit"


def test_compile_grammar_caches_by_spec(vocab):
    a = compile_grammar("json_schema", MIXED, vocab)
    assert compile_grammar("json_schema", json.loads(json.dumps(MIXED)), vocab) is a
    assert compile_grammar("regex", "[ab]+", vocab) is not a
    assert compile_grammar("json_object", {"max_depth": 1}, vocab).dfa.fullmatch('{"a": 1}')
    with pytest.raises(UnsupportedSchemaError):
        compile_grammar("json_schema", {"type": "string", "format": "email"}, vocab)
    with pytest.raises(ValueError, match="kind must be"):
        compile_grammar("grammar", "x", vocab)


# --- xgrammar as the reference ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def xgr_compiler(tok, vocab):
    """xgrammar over the same vocabulary: special tokens as empty strings (xgrammar never allows
    those), EOS as the stop token. Its own reading of the tokenizer must give the same bytes."""
    theirs = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab.size).decoded_vocab
    assert all(t is None or t == theirs[i] for i, t in enumerate(vocab.tokens)), "token bytes differ from xgrammar's"
    info = xgr.TokenizerInfo([t or b"" for t in vocab.tokens], xgr.VocabType.RAW, vocab_size=vocab.size,
                             stop_token_ids=vocab.eos)
    return xgr.GrammarCompiler(info)


def _xgr_json(compiler, schema):
    return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))


def _check_against_xgrammar(grammar: Grammar, compiled, ids: list[int]) -> int:
    """Walk `ids` in both; at every step our packed mask must equal xgrammar's bitmask, and the
    forced bytes its jump-forward string. Returns the steps compared."""
    matcher = xgr.GrammarMatcher(compiled)
    theirs = xgr.allocate_token_bitmask(1, grammar.vocab.size)
    st = GrammarState(grammar)
    for k, t in enumerate(ids):
        matcher.fill_next_token_bitmask(theirs)
        ours = torch.from_numpy(st.mask())
        if not torch.equal(ours, theirs[0]):
            a, b = unpack(ours, grammar.vocab.size), unpack(theirs[0], grammar.vocab.size)
            raise AssertionError(f"step {k}: masks differ, ours only {torch.nonzero(a & ~b)[:5].flatten().tolist()}, "
                                 f"xgrammar only {torch.nonzero(b & ~a)[:5].flatten().tolist()}")
        if _is_utf8(st.forced_bytes()):
            assert st.forced_bytes() == matcher.find_jump_forward_string().encode(), f"step {k}"
        st.advance(t)
        assert matcher.accept_token(t), f"step {k}: xgrammar refuses token {t}"
    assert st.finished and matcher.is_terminated()
    return len(ids)


@pytest.mark.parametrize("schema", [PERSON, MIXED, NESTED], ids=["person", "mixed", "nested"])
def test_masks_equal_xgrammar_on_every_step(vocab, xgr_compiler, schema):
    grammar, compiled = Grammar.from_json_schema(schema, vocab), _xgr_json(xgr_compiler, schema)
    rng = random.Random(3)
    steps = sum(_check_against_xgrammar(grammar, compiled, _random_walk(grammar, rng)) for _ in range(8))
    assert steps >= 40, "compare on enough steps"


def test_regex_masks_equal_xgrammar(vocab, xgr_compiler):
    rng = random.Random(4)
    for p in [r"[a-z]+@(ex|ample)\.com", r"\d{3}-\d{4}", r"(ab|a)*c?", r"[^a-c]{1,4}x", r"é+|中", r"\w+( \w+)*\."]:
        grammar = Grammar.from_regex(p, vocab)
        for _ in range(3):
            _check_against_xgrammar(grammar, xgr_compiler.compile_regex(p), _random_walk(grammar, rng, budget=12))


def test_where_xgrammar_differs_and_why(vocab, xgr_compiler):
    """The documented differences, pinned (xgrammar 0.2.8): each is a place where our language is
    the stricter one on purpose, and the tests above keep away from them."""
    def both(grammar, compiled, prefix: bytes):
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string(prefix)
        theirs = xgr.allocate_token_bitmask(1, vocab.size)
        m.fill_next_token_bitmask(theirs)
        ours = unpack(torch.from_numpy(grammar.mask(grammar.dfa.walk(0, prefix))), vocab.size)
        return ours, unpack(theirs[0], vocab.size)

    # 1. after the lead byte ED, xgrammar also takes A0..BF: an encoded surrogate, which no UTF-8 decoder accepts
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    ours, theirs = both(Grammar.from_json_schema(schema, vocab), _xgr_json(xgr_compiler, schema), b'{"s": "\xed')
    extra = torch.nonzero(theirs & ~ours).flatten().tolist()
    assert not (ours & ~theirs).any() and extra
    assert all(0xA0 <= vocab.tokens[t][0] <= 0xBF for t in extra)
    # 2. xgrammar's '.' is any character, newline included; Python's (and ours) is not
    p = r"x.y"
    ours, theirs = both(Grammar.from_regex(p, vocab), xgr_compiler.compile_regex(p), b"x")
    extra = torch.nonzero(theirs & ~ours).flatten().tolist()
    assert extra and all(vocab.tokens[t].startswith(b"\n") for t in extra)
    # 3. a string with minLength/maxLength: xgrammar allows raw control characters (not JSON) and no escapes
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}, "required": ["s"]}
    ours, theirs = both(Grammar.from_json_schema(schema, vocab), _xgr_json(xgr_compiler, schema), b'{"s": "')
    tab = vocab.tokens.index(b"\t")
    assert theirs[tab] and not ours[tab]
    with pytest.raises(json.JSONDecodeError):
        json.loads('{"s": "\t"}')


def test_our_bitmask_applies_like_xgrammars(vocab):
    rng = np.random.default_rng(5)
    allowed = rng.random((2, vocab.size)) < 0.5
    words = torch.from_numpy(np.stack([pack(a) for a in allowed]))
    logits = torch.randn(2, vocab.size)
    ours, theirs = logits.clone(), logits.clone()
    apply_token_mask_(ours, words)
    xgr.apply_token_bitmask_inplace(theirs, words)
    assert torch.equal(ours, theirs)


# --- the real model (slow) -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def person_runs(tok):
    """Greedy generations of one schema in the three jump-forward modes."""
    model = course.load_model()
    vocab = Vocabulary.from_tokenizer(tok, model.cfg.vocab_size)
    msgs = [{"role": "user", "content": "Describe a person as JSON: name, age, hobbies."}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    grammar = compile_grammar("json_schema", SHORT, vocab)
    trace: list[dict] = []
    runs = {mode: generate(model, tok, prompt_ids, grammar, 60, jump_forward=mode,
                           trace=trace if mode == "off" else None) for mode in ("off", "exact", "text")}
    return model, prompt_ids, grammar, runs, trace


@pytest.mark.slow
def test_constrained_generation_is_valid_and_jump_forward_saves_steps(tok, person_runs):
    model, prompt_ids, grammar, runs, trace = person_runs
    for mode, r in runs.items():
        assert r.finish_reason == "stop" and r.token_ids[-1] == tok.eos_token_id, (mode, r)
        jsonschema.validate(json.loads(r.text), SHORT)
        assert r.model_steps + r.forced_tokens == len(r.token_ids)
    off, exact, text = runs["off"], runs["exact"], runs["text"]
    assert off.forced_tokens == 0
    assert [step["token"] for step in trace] == off.token_ids and all(step["allowed"] >= 1 for step in trace)
    assert trace[0]["allowed"] == 2 and trace[-1]["allowed"] == 1, "'{' or '{\"' first; EOS alone last"
    assert any(step["wanted"] != step["token"] for step in trace), "the mask changed some of the model's choices"
    assert exact.token_ids == off.token_ids, "exact jump-forward skips only steps whose token was the only choice"
    assert exact.forced_tokens >= 1 and exact.model_steps < off.model_steps
    assert text.model_steps < exact.model_steps, "forcing the grammar's literal text saves more steps"
    # what the text mode keeps: every forced byte run of stepwise decoding is in its output too
    st = GrammarState(grammar)
    for t in off.token_ids[:-1]:
        if st.forced_bytes():
            assert st.forced_bytes().decode() in text.text
        st.advance(t)
    # sampling, seeded: valid too, and the same seed gives the same output
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    a = generate(model, tok, prompt_ids, grammar, 12, params=params, jump_forward="text")
    b = generate(model, tok, prompt_ids, grammar, 12, params=params, jump_forward="text")
    assert a.token_ids == b.token_ids
    if a.finish_reason == "stop":
        jsonschema.validate(json.loads(a.text), SHORT)
    else:                                             # cut by max_new_tokens: still a prefix of a valid output
        assert grammar.dfa.walk(0, a.text.encode()) >= 0


@pytest.mark.slow
def test_masks_equal_xgrammar_along_the_models_generation(person_runs, xgr_compiler):
    _, _, grammar, runs, _ = person_runs
    compiled = _xgr_json(xgr_compiler, SHORT)
    for mode in ("off", "text"):
        assert _check_against_xgrammar(grammar, compiled, runs[mode].token_ids) == len(runs[mode].token_ids)
