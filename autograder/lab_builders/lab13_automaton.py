"""Lab 13, sections 2-3: a regular expression as an automaton over bytes (Problem 1), token bytes, the
vocabulary trie and the allowed tokens of a state (Problem 2), the packed bitmask (Problem 3)."""
from autograder.authoring import code, locked, md, solution, tests

# Hidden-test reference for Problem 1: Python's `re` on random strings over each pattern's alphabet.
HIDDEN_RE = r'''
import random as _random
def _strings(alphabet, n, seed, longest=7):
    rng = _random.Random(seed)
    out = {""} | set(alphabet)
    while len(out) < n:
        out.add("".join(rng.choice(alphabet) for _ in range(rng.randint(1, longest))))
    return sorted(out)
def _live_prefix(pattern, text):
    # can `text` be continued into a full match? (the course's minimal DFA, independent of your code)
    from course.structured.regex import compile_regex as _cr
    return _cr(pattern).walk(0, text.encode()) >= 0
'''.strip("\n")

# Hidden-test reference for Problem 2: brute force over the vocabulary, the course's DFA walking each
# token's bytes (no trie), and the bytes xgrammar reads from the tokenizer.
HIDDEN_BRUTE = r'''
from course.structured.regex import compile_regex as _cr
def _brute_allowed(pattern, prefix, tokens, eos_ids, size):
    dfa = _cr(pattern)
    s = dfa.walk(0, prefix)
    out = np.zeros(size, dtype=bool)
    for i, t in enumerate(tokens):
        if t and dfa.walk(s, t) >= 0:
            out[i] = True
    if dfa.accepts(s):
        out[list(eos_ids)] = True
    return out
'''.strip("\n")

CELLS = [
md(r"""
## 2. A regular expression as an automaton

A regular expression describes a set of strings: `[a-z]+@(ex|ample)\.com` is every address of that
shape. Python's `re.fullmatch` answers one question: is this whole string in the set? Constrained
decoding asks a harder one, after every token: **can this beginning still become a match?** `me@e`
can (`me@ex.com`); `me@@` cannot, whatever follows. An **automaton** answers it cheaply. It reads the
output one byte at a time and keeps a **state**: a summary of the prefix that holds everything that
matters for the future. After each byte there is a new state. A **dead** state means that no
continuation can match.

**Why bytes, not characters.** A token of a byte-level BPE vocabulary is a string of bytes, and it
may end in the middle of a character: `é` is two bytes in UTF-8, and the vocabulary has tokens that
hold only the first one. An automaton over bytes can walk any token; one over characters could not.
For ASCII text the two are the same.

**Thompson's construction** turns the expression into an NFA (a *nondeterministic* finite automaton)
piece by piece. Every piece is a fragment with one entry state `s` and one exit state `e`, and they
are glued with free moves (**epsilon moves**, taken without reading a byte):

| piece | fragment |
|---|---|
| a byte from a set (`a`, `[a-z]`, `\d`) | `s` to `e` on any byte of the set |
| `AB` | `s` to A's entry; A's exit to B's entry; B's exit to `e` (all free) |
| `A\|B` | `s` to both entries; both exits to `e` |
| `A*` | `s` to A's entry and to `e`; A's exit back to A's entry and on to `e` |
| `A+` | like `A*` without the move from `s` to `e`: at least once |
| `A?` | like `A*` without the move back: at most once |

The machine is nondeterministic because after a prefix it may be in several states at once. So we
track **the set of NFA states** the prefix may have reached: that set is the automaton's state (this is
the subset construction, done lazily, one set at a time). The **epsilon closure** of a set adds every
state reachable from it by free moves, however many. One step on a byte: the states that the set's
edges reach on that byte, then their closure. The empty set is the dead state. The output matches when
the set holds the final exit state.

A parser is given: it turns a pattern into a tree of the node kinds in the table. Characters outside
ASCII and classes such as `[^"]` become alternatives of UTF-8 byte sequences, so `[^"]` never lets a
half character through. It is the course's parser (`course/structured/regex.py`, which supports more
syntax, such as `{m,n}`), with each repeat rewritten into these six kinds:
"""),
locked("regex_parser", r'''
from course.structured.regex import parse as _parse_chars, utf8_sequences


def parse_bytes(pattern: str):
    """A pattern -> a tree of ("bytes", frozenset of byte values), ("cat", [nodes]), ("alt", [nodes]),
    ("star", node), ("plus", node), ("opt", node). ValueError (with the position) outside the subset."""
    def convert(node):
        kind = node[0]
        if kind == "set":                                      # characters -> alternatives of UTF-8 byte runs
            seqs = [("cat", [("bytes", frozenset(range(lo, hi + 1))) for lo, hi in seq]) for seq in utf8_sequences(node[1])]
            seqs = [s[1][0] if len(s[1]) == 1 else s for s in seqs]
            return seqs[0] if len(seqs) == 1 else ("alt", seqs)
        if kind in ("cat", "alt"):
            return (kind, [convert(c) for c in node[1]])
        _, child, lo, hi = node                                # ("repeat", child, min, max or None)
        c = convert(child)
        if hi is None:
            return ("star", c) if lo == 0 else ("cat", [c] * (lo - 1) + [("plus", c)])
        return ("cat", [c] * lo + [("opt", c)] * (hi - lo))
    return convert(_parse_chars(pattern))

print(parse_bytes(r"(ab|c)*d?"))
print(parse_bytes("é"))
'''),
md(r"""
## Problem 1: The automaton (4 points)

**Deliverable:** complete `Automaton`: `_build` (Thompson's construction of one node, recursively),
`closure` (the epsilon closure of a set of NFA states) and `step` (the state after one byte), so that
`fullmatch` agrees with Python's `re.fullmatch` and a prefix's state is dead exactly when no
continuation can match.

The rest is given: `__init__` builds the NFA from the tree, `_new` adds an NFA state, and `walk`,
`accepts`, `alive` and `fullmatch` are one-liners on top of your three methods. States are
`frozenset`s of NFA state numbers: hashable, so a state can be a dictionary key. That matters soon:
section 3 computes one mask per state and caches it. **Cache `step`** in `self._next`, keyed by
`(state, byte)`: the trie walk of section 3 calls it hundreds of thousands of times, with few
distinct keys.
"""),
solution("automaton", r'''
class Automaton:
    """A regular expression as an automaton over UTF-8 bytes. A state is a frozenset of NFA states;
    frozenset() is dead. The NFA: eps[s] (states reached by free moves), edges[s] ((byte set, t) pairs)."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[frozenset, int]]] = []
        self._next: dict = {}                                  # (state, byte) -> state: the step cache
        entry, self.final = self._build(parse_bytes(pattern))
        self.start = self.closure({entry})

    def _new(self) -> int:
        """A new NFA state with no moves yet; its number."""
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def _build(self, node) -> tuple[int, int]:
        """Thompson's construction: a fragment for `node`, as (entry state, exit state)."""
        s, e = self._new(), self._new()
        kind = node[0]
        ### BEGIN SOLUTION
        if kind == "bytes":
            self.edges[s].append((node[1], e))
        elif kind == "cat":
            cur = s
            for child in node[1]:
                a, b = self._build(child)
                self.eps[cur].append(a)
                cur = b
            self.eps[cur].append(e)
        elif kind == "alt":
            for child in node[1]:
                a, b = self._build(child)
                self.eps[s].append(a)
                self.eps[b].append(e)
        elif kind in ("star", "plus", "opt"):
            a, b = self._build(node[1])
            self.eps[s].append(a)
            self.eps[b].append(e)
            if kind in ("star", "opt"):                        # zero times
                self.eps[s].append(e)
            if kind in ("star", "plus"):                       # once more
                self.eps[b].append(a)
        else:
            raise ValueError(f"unknown node {kind!r}")
        ### END SOLUTION
        return s, e

    def closure(self, states) -> frozenset:
        """Every NFA state reachable from `states` by epsilon moves (any number of them), `states` included."""
        ### BEGIN SOLUTION
        seen, todo = set(states), list(states)
        while todo:
            for t in self.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)
        ### END SOLUTION

    def step(self, state: frozenset, byte: int) -> frozenset:
        """The state after reading one byte (0..255) in `state`; frozenset() once no match is possible."""
        ### BEGIN SOLUTION
        key = (state, byte)
        if key not in self._next:
            moved = {t for s in state for allowed, t in self.edges[s] if byte in allowed}
            self._next[key] = self.closure(moved)
        return self._next[key]
        ### END SOLUTION

    def walk(self, state: frozenset, data: bytes) -> frozenset:
        for b in data:
            state = self.step(state, b)
        return state

    def alive(self, state: frozenset) -> bool:
        return len(state) > 0

    def accepts(self, state: frozenset) -> bool:
        return self.final in state

    def fullmatch(self, text: str) -> bool:
        return self.accepts(self.walk(self.start, text.encode()))
'''),
tests("automaton_tests", 4, r"""
cases = Cases(points=4)
def auto(p):
    return expect_type(Automaton(p), f"Automaton({p!r})", Automaton)
def full(a, text):
    return expect_bool(a.fullmatch(text), f"Automaton({a.pattern!r}).fullmatch({text!r})")
with cases("literals and concatenation"):
    a = auto("abc")
    assert full(a, "abc") and not full(a, "ab") and not full(a, "abcd"), "'abc' matches exactly abc: not ab, not abcd"
with cases("a+ means one or more"):
    a = auto("a+")
    assert full(a, "a") and full(a, "aaa"), "a+ matches a and aaa"
    assert not full(a, ""), "a+ means one or more: the empty string does not match (no free move from entry to exit)"
with cases("star, optional, alternation"):
    assert full(auto("a*"), "") and full(auto("a*"), "aaaa"), "a* matches zero or more a"
    assert full(auto("ab?c"), "ac") and not full(auto("ab?c"), "abbc"), "b? is zero or one b"
    assert full(auto("cat|dog"), "dog") and not full(auto("cat|dog"), "catdog"), "cat|dog is one of the two"
with cases("free moves chain: the closure follows them all"):
    a = auto("(a|b)*c")
    assert full(a, "c") and full(a, "abbac"), ("(a|b)*c matches c and abbac: the start state's closure must follow free "
                                              "moves through the group and the star to c (several free moves in a row)")
with cases("states are frozensets, dead is empty"):
    a = auto("[0-9]+")
    s = expect_type(a.step(a.start, ord("7")), "step(start, ord('7'))", frozenset)
    assert a.alive(s) and a.accepts(s), "after '7', [0-9]+ is alive and accepts"
    assert expect_type(a.step(s, ord("x")), "step(state, ord('x'))", frozenset) == frozenset(), \
        "after '7x' no continuation can match: step must return the dead state, frozenset()"
### BEGIN HIDDEN TESTS
""" + HIDDEN_RE + r"""
PATTERNS = [("ab|a", "ab"), ("(ab|a)*c?", "abc"), ("a(b|c)*d", "abcd"), ("(a*b*)*", "ab"), ("(a?)+b", "ab"),
            ("(a|b)+(c|d)?", "abcd"), ("x(yz)?x", "xyz"), ("[a-c]+[0-9]?", "ab3z"), ("(ab)+|(ba)+", "ab"),
            ("a?b?c?", "abc"), ("((a|b)c)*", "abc"), ("[^ab]c*", "abcx"), (r"\d+(\.\d+)?", "12.a"), ("a{2,3}b", "ab")]
for i, (p, alphabet) in enumerate(PATTERNS):
    with cases(f"{p!r} agrees with re.fullmatch"):
        a = auto(p)
        for text in _strings(alphabet, 60, i):
            exp = re.fullmatch(p, text) is not None
            got = full(a, text)
            assert got == exp, f"Automaton({p!r}).fullmatch({text!r}) is {got}; re.fullmatch says {exp}"
for i, (p, alphabet) in enumerate(PATTERNS[:8]):
    with cases(f"{p!r}: a prefix is alive exactly when it can still match"):
        a = auto(p)
        for text in _strings(alphabet, 40, 100 + i, longest=5):
            exp = _live_prefix(p, text)
            got = expect_bool(a.alive(a.walk(a.start, text.encode())), f"alive after {text!r}")
            assert got == exp, (f"{p!r} after {text!r}: your state is {'alive' if got else 'dead'}, but it "
                                f"{'can' if exp else 'cannot'} still be completed into a match")
with cases("UTF-8: a character is several bytes"):
    a = auto("é+|中")
    assert full(a, "éé") and full(a, "中") and not full(a, "e"), "'é+|中' matches éé and 中"
    half = a.step(a.start, "é".encode()[0])
    assert a.alive(half) and not a.accepts(half), "after é's first byte (0xC3) the state is alive, not accepting"
with cases("the same prefix gives the same (hashable) state"):
    a = auto("[a-z]+@(ex|ample)\\.com")
    s1, s2 = a.walk(a.start, b"me@"), a.walk(a.start, b"you@")
    assert s1 == s2 and hash(s1) == hash(s2), "me@ and you@ leave the automaton in the same state: equal frozensets"
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
Try your automaton on a prefix, byte by byte, and watch the set of NFA states: it grows where several
paths are open and shrinks where the text decides between them.
"""),
code(r'''
email = Automaton(r"[a-z]+@(ex|ample)\.com")
state = email.start
for ch in "me@ex.c":
    state = email.step(state, ord(ch))
    print(f"after {ch!r}: {len(state):2} NFA states, alive {email.alive(state)}, accepts {email.accepts(state)}")
print("'me@ex.com' matches:", email.fullmatch("me@ex.com"), "| 'me@@' alive:", email.alive(email.walk(email.start, b"me@@")))
print(f"{len(email.eps)} NFA states; {len(set(email._next.values()))} distinct automaton states seen so far")
'''),
md(r"""
## 3. From bytes to tokens

The model does not write bytes; it writes tokens. At each step the engine needs **the set of tokens
that keep the automaton alive**: token `t` is allowed in state `s` if walking all of `t`'s bytes from
`s` never reaches the dead state. (A token may end in the middle of the match: `{"na` is fine if
`{"name"` is where the grammar goes.) And one special token: **end of text** (EOS) is allowed exactly
when the state accepts, because stopping there leaves a complete match.

**A token's bytes.** SmolLM2's tokenizer, like GPT-2's and Llama 3's, is a *byte-level* BPE: it
spells every byte with one printable character, so that its vocabulary file holds only text. Printable
ASCII and most of Latin-1 stand for themselves; the 68 other bytes (controls, the space, ...) are
moved to characters from U+0100 on: the space byte is `Ġ`, the newline `Ċ`. A token piece such as
`Ġthe` is the bytes `b" the"`, and `Ã©` is the two bytes of `é`. `BYTE_CHARS` (given) is that table,
byte to character.

**The trie.** Checking 49,152 tokens one by one from every state repeats work: `{"`, `{"n` and
`{"name` share their first bytes. A **trie** stores the token bytes as a tree: one node per distinct
prefix, one edge per byte, and a node marks the token that ends there. Walk it from the root with the
automaton: step the state by each edge's byte, and **where the state dies, skip the whole subtree**
(every token below starts with the bytes that killed it). In a state that expects a digit, the walk
enters ten subtrees of the root's thousands and stops.

## Problem 2: Token bytes and the trie walk (4 points)

**Deliverable:** `piece_bytes(piece)` (a token piece to its bytes), `build_trie(tokens)` (a trie of
`TrieNode`s over the token bytes) and `allowed_tokens(automaton, state, trie, vocab_size, eos_ids)`, a
`(vocab_size,)` bool numpy array: the tokens whose bytes keep the automaton alive from `state`, plus
the EOS ids when `state` accepts.

`tokens[i]` is `None` for special tokens (`<|im_start|>`, ...): they are control, never text, so they
never go into the trie. `allowed_tokens` may use only the automaton's `start`, `step`, `alive` and
`accepts`: the tests run it on the course's automaton (a minimal DFA with integer states, dead = -1)
too, so that a mistake in Problem 1 does not cost you here.
"""),
locked("byte_chars", r'''
from course.structured.tokens import bytes_to_unicode

BYTE_CHARS = bytes_to_unicode()          # {byte: the character that spells it in the vocabulary}
SPECIAL = set(tokenizer.all_special_ids) | {int(i) for i in tokenizer.added_tokens_decoder}   # control tokens: no bytes
print("space ->", BYTE_CHARS[32], "| newline ->", BYTE_CHARS[10], "| 'a' ->", BYTE_CHARS[97])
pieces = tokenizer.convert_ids_to_tokens([tokenizer.encode(" the")[0], tokenizer.encode("é")[0]])
print("pieces:", pieces)


class TrieNode:
    """One prefix of some tokens: children by next byte, and the token id that ends here (-1: none)."""
    __slots__ = ("children", "token")

    def __init__(self):
        self.children: dict[int, "TrieNode"] = {}
        self.token = -1


class CourseAutomaton:
    """The course's minimal DFA (course/structured/regex.py) behind Problem 1's interface: integer
    states, dead = -1. The tests run your trie walk on it, independent of your Problem 1."""

    def __init__(self, pattern: str):
        from course.structured import compile_regex
        self.pattern, self.dfa = pattern, compile_regex(pattern)
        self.start = self.dfa.start

    def step(self, state: int, byte: int) -> int:
        return self.dfa.step(state, byte)

    def walk(self, state: int, data: bytes) -> int:
        return self.dfa.walk(state, data)

    def alive(self, state: int) -> bool:
        return state >= 0

    def accepts(self, state: int) -> bool:
        return self.dfa.accepts(state)
'''),
solution("token_trie", r'''
def piece_bytes(piece: str) -> bytes:
    """A byte-level BPE piece ('Ġthe') -> the bytes it spells (b' the')."""
    ### BEGIN SOLUTION
    to_byte = {c: b for b, c in BYTE_CHARS.items()}
    return bytes(to_byte[c] for c in piece)
    ### END SOLUTION


def build_trie(tokens: list[bytes | None]) -> TrieNode:
    """A trie of every token's bytes: node.token = i where tokens[i] ends. None (special) tokens are left out."""
    ### BEGIN SOLUTION
    root = TrieNode()
    for i, data in enumerate(tokens):
        if not data:
            continue
        node = root
        for b in data:
            child = node.children.get(b)
            if child is None:
                child = node.children[b] = TrieNode()
            node = child
        node.token = i
    return root
    ### END SOLUTION


def allowed_tokens(automaton, state, trie: TrieNode, vocab_size: int, eos_ids: list[int]) -> np.ndarray:
    """(vocab_size,) bool: tokens whose bytes keep `automaton` alive from `state`; EOS where `state` accepts."""
    ### BEGIN SOLUTION
    out = np.zeros(vocab_size, dtype=bool)
    if not automaton.alive(state):
        return out
    todo = [(trie, state)]
    while todo:
        node, s = todo.pop()
        for b, child in node.children.items():
            nxt = automaton.step(s, b)
            if not automaton.alive(nxt):
                continue                                       # the whole subtree dies here
            if child.token >= 0:
                out[child.token] = True
            todo.append((child, nxt))
    if automaton.accepts(state):
        out[list(eos_ids)] = True
    return out
    ### END SOLUTION
'''),
tests("token_trie_tests", 4, r"""
cases = Cases(points=4)
with cases("byte-level pieces"):
    assert expect_type(piece_bytes("Ġthe"), "piece_bytes('Ġthe')", bytes) == b" the", \
        "'Ġ' spells the space byte: piece_bytes('Ġthe') is b' the' (invert BYTE_CHARS; do not .encode() the piece)"
    assert piece_bytes("Ã©") == "é".encode() and piece_bytes("Ċ") == b"\n", "'Ã©' is the two bytes of é; 'Ċ' is a newline"
from course.structured import token_bytes as _course_token_bytes
vocab_bytes = _course_token_bytes(tokenizer)       # the course's bytes: a piece_bytes mistake costs only its cases
trie = expect_type(build_trie(vocab_bytes), "build_trie(vocab_bytes)", TrieNode)
digit = tokenizer.convert_tokens_to_ids("7")
with cases("a small trie"):
    t = expect_type(build_trie([b"ab", None, b"a", b"b"]), "build_trie([b'ab', None, b'a', b'b'])", TrieNode)
    assert sorted(t.children) == [ord("a"), ord("b")] and t.children[ord("a")].token == 2, \
        "the root has children for bytes a and b; the node of b'a' holds token 2"
    assert t.children[ord("a")].children[ord("b")].token == 0, "the node under a, b holds token 0 (b'ab'); None is left out"
with cases("digits only"):
    a = CourseAutomaton("[0-9]+")
    got = expect_type(allowed_tokens(a, a.start, trie, V, [EOS]), "allowed_tokens(...)", np.ndarray)
    assert got.dtype == np.bool_ and got.shape == (V,), f"a ({V},) bool array, got {got.dtype} {got.shape}"
    assert got[digit] and not got[tokenizer.convert_tokens_to_ids("a")], "in [0-9]+ a digit token is allowed, 'a' is not"
    assert not got[EOS], "EOS is allowed only where the state accepts: an empty number is not a match yet"
with cases("EOS where the state accepts"):
    s = a.step(a.start, ord("4"))
    assert allowed_tokens(a, s, trie, V, [EOS])[EOS], "after '4', [0-9]+ accepts: EOS must be allowed (the output may stop)"
### BEGIN HIDDEN TESTS
""" + HIDDEN_BRUTE + r"""
with cases("token bytes equal xgrammar's reading of the tokenizer"):
    _xgr = xgr
    theirs = _xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=V).decoded_vocab
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    bad = [i for i, t in enumerate(vocab_bytes) if t is not None and piece_bytes(pieces[i]) != theirs[i]]
    assert not bad, f"piece_bytes differs from xgrammar's bytes for tokens {bad[:5]} (e.g. {tokenizer.convert_ids_to_tokens(bad[:1])})"
for pattern, prefix in [("[0-9]+", b""), ('\\{"name": "[a-z ]*"\\}', b'{"na'), ('\\{"name": "[a-z ]*"\\}', b'{"name": "bo'),
                        ("(yes|no)", b""), ("é+|中", b"\xc3"), ("[a-z]+@(ex|ample)\\.com", b"me@ex.com")]:
    with cases(f"{pattern!r} after {prefix!r}: the tokens brute force finds"):
        a = CourseAutomaton(pattern)
        s = a.walk(a.start, prefix)
        got = allowed_tokens(a, s, trie, V, [EOS])
        exp = _brute_allowed(pattern, prefix, vocab_bytes, [EOS], V)
        extra, missing = np.flatnonzero(got & ~exp), np.flatnonzero(exp & ~got)
        assert not len(extra) and not len(missing), \
            (f"{pattern!r} after {prefix!r}: you allow {len(extra)} tokens too many (e.g. {tokenizer.convert_ids_to_tokens(extra[:3].tolist())}) "
             f"and miss {len(missing)} (e.g. {tokenizer.convert_ids_to_tokens(missing[:3].tolist())}); EOS {'expected' if exp[EOS] else 'not expected'}")
with cases("a dead state allows nothing"):
    a = CourseAutomaton("[0-9]+")
    assert not allowed_tokens(a, -1, trie, V, [EOS]).any(), "no token, not even EOS, from the dead state"
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
How much work does the trie save? Count the tokens a state allows, the trie nodes the walk visits,
and the time, for a few states of a JSON-like pattern (your automaton, the CPU):
"""),
code(r'''
vocab_bytes = [None if i in SPECIAL else piece_bytes(p) for i, p in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))]
trie = build_trie(vocab_bytes)

def count_nodes(node):
    return 1 + sum(count_nodes(c) for c in node.children.values())

print(f"{sum(t is not None for t in vocab_bytes)} text tokens, {count_nodes(trie)} trie nodes")
name_pattern = r'\{"name": "[a-zA-Z ]*", "age": (0|[1-9][0-9]*)\}'
auto_name = Automaton(name_pattern)
for prefix in [b"", b'{"name": "', b'{"name": "Ada", "age": ', b'{"name": "Ada", "age": 36']:
    s = auto_name.walk(auto_name.start, prefix)
    t0 = time.perf_counter()
    ok = allowed_tokens(auto_name, s, trie, V, [EOS])
    ms = 1e3 * (time.perf_counter() - t0)
    shown = tokenizer.convert_ids_to_tokens(np.flatnonzero(ok)[:6].tolist())
    print(f"after {prefix.decode()!r:28}: {int(ok.sum()):6} allowed ({ms:6.1f} ms, your Python walk, CPU), e.g. {shown}")
'''),
md(r"""
Inside a string almost every token is allowed, and the walk visits most of the trie; after `"age": `
only digit tokens survive and the walk is short. The result depends on the state only, never on the
request or the model, so an engine computes it **once per state** and caches it: the second request
that reaches a state pays a dictionary lookup. The course's version (`course.structured.tokens`) does
the same walk with NumPy, one trie level at a time for all live nodes at once.

## Problem 3: The packed bitmask (3 points)

The mask goes where the logits are, onto the GPU, once per step for every request in the batch. A
bool per token is 49 KB per request; one **bit** per token is 6 KB. xgrammar, vLLM and SGLang pack it
as `int32` words: **bit `j` of word `i` is token `32 i + j`** (bit 0 is the least significant), so a
`(B, V)` mask becomes `(B, ceil(V / 32))` int32. A word with all 32 bits set is `-1` in two's
complement, and bit 31 makes a word negative: that is fine, only the bits matter. Applying the mask
unpacks the bits on the logits' device and sets the logits of 0 bits to minus infinity, in place.

**Deliverable:** `pack_bitmask(allowed)` (a `(B, V)` bool tensor to `(B, ceil(V/32))` int32 on the same
device) and `apply_bitmask_(logits, words)` (in place: `-inf` where the bit is 0; returns `logits`).
Both work on whole tensors, no Python loop over tokens: shift with `torch.arange(32)` and sum or
`&` with 1.
"""),
solution("bitmask", r'''
def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """(B, V) bool -> (B, ceil(V/32)) int32: bit j of word i is allowed[:, 32 i + j]."""
    ### BEGIN SOLUTION
    B, V = allowed.shape
    W = (V + 31) // 32
    bits = torch.zeros(B, W * 32, dtype=torch.int64, device=allowed.device)
    bits[:, :V] = allowed.long()
    weights = torch.ones(32, dtype=torch.int64, device=allowed.device) << torch.arange(32, device=allowed.device)
    words = (bits.view(B, W, 32) * weights).sum(-1)                 # (B, W) in 0 .. 2**32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    ### END SOLUTION


def apply_bitmask_(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """logits (B, V) float, words (B, ceil(V/32)) int32: -inf where a bit is 0, in place; returns logits."""
    ### BEGIN SOLUTION
    B, V = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (words.to(logits.device).unsqueeze(-1) >> shifts) & 1     # (B, W, 32)
    allowed = bits.flatten(1)[:, :V].bool()                          # (B, V)
    return logits.masked_fill_(~allowed, float("-inf"))
    ### END SOLUTION
'''),
tests("bitmask_tests", 3, r"""
cases = Cases(points=3)
with cases("token 0 is bit 0 of word 0"):
    allowed = torch.zeros(1, 40, dtype=torch.bool, device=dev)
    allowed[0, [0, 33]] = True
    w = expect_tensor(pack_bitmask(allowed), "pack_bitmask((1, 40) bools)", dtype=torch.int32, shape=(1, 2), device=dev)
    assert w.tolist() == [[1, 2]], ("tokens 0 and 33 allowed: bit j of word i is token 32 i + j, so word 0 is 1 (bit 0) "
                                    f"and word 1 is 2 (bit 1); got {w.tolist()}")
with cases("all allowed is -1 (bit 31 makes a word negative)"):
    w = expect_tensor(pack_bitmask(torch.ones(2, 64, dtype=torch.bool, device=dev)), "pack_bitmask((2, 64) bools)",
                      dtype=torch.int32, shape=(2, 2), device=dev)
    assert w.tolist() == [[-1, -1], [-1, -1]], "32 bits set is -1 as int32 (two's complement)"
with cases("apply: -inf where the bit is 0, in place"):
    logits = torch.arange(40, dtype=torch.float32, device=dev)[None].clone()
    words = torch.tensor([[5, 0]], dtype=torch.int32, device=dev)                   # tokens 0 and 2
    out = apply_bitmask_(logits, words)
    assert out is logits, "apply_bitmask_ works in place and returns the logits"
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2], "word 0 = 5 = bits 0 and 2: tokens 0 and 2 stay"
### BEGIN HIDDEN TESTS
_xgr = xgr
g = torch.Generator().manual_seed(13)                        # test data drawn on the CPU, then moved to the device
for B, n in [(1, 32), (3, 49152), (2, 70), (4, 1)]:
    with cases(f"pack ({B}, {n}) equals the bits, bit j of word i"):
        allowed = (torch.rand(B, n, generator=g) < 0.4).to(dev)  # cpu: drawn there, then moved
        w = expect_tensor(pack_bitmask(allowed), f"pack_bitmask(({B}, {n}))", dtype=torch.int32, shape=(B, (n + 31) // 32), device=dev)
        flat = w.cpu().tolist()
        ref = [[sum(1 << j for j in range(32) if 32 * i + j < n and bool(allowed[b, 32 * i + j])) for i in range((n + 31) // 32)]
               for b in range(B)]
        ref = [[x - 2**32 if x >= 2**31 else x for x in row] for row in ref]
        assert flat == ref, "a word differs from the bits it should hold: bit j of word i is token 32 i + j"
for B, n in [(2, 49152), (1, 100)]:
    with cases(f"apply ({B}, {n}) as xgrammar's apply_token_bitmask_inplace"):
        words = torch.randint(-2**31, 2**31 - 1, (B, (n + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)  # cpu: xgrammar's reference
        logits = torch.randn(B, n, generator=g)  # cpu: xgrammar's reference applies on the CPU
        theirs = logits.clone()
        _xgr.apply_token_bitmask_inplace(theirs, words)
        ours = logits.clone().to(dev)
        apply_bitmask_(ours, words.to(dev))
        assert torch.equal(ours.cpu(), theirs), "your masked logits differ from xgrammar's with the same words (bit j of word i is token 32 i + j)"
with cases("pack then apply round trip, on the device"):
    allowed = (torch.rand(3, 1000, generator=g) < 0.1).to(dev)  # cpu: drawn there, then moved
    logits = torch.zeros(3, 1000, device=dev)
    apply_bitmask_(logits, pack_bitmask(allowed))
    assert torch.equal(torch.isfinite(logits), allowed), "apply_bitmask_(pack_bitmask(allowed)) keeps exactly the allowed tokens"
### END HIDDEN TESTS
cases.score()
"""),
]
