"""A regular expression becomes a DFA over bytes: parse by hand -> Thompson NFA -> subset construction.

    dfa = compile_regex(r"[a-z]+@(ex|ample)\\.com")
    dfa.fullmatch("me@ex.com")           # True: the whole text must match, like re.fullmatch
    s = dfa.walk(dfa.start, b"me@")     # a state, or -1 once no continuation can match
    dfa.forced(s)                       # b"": the next byte is not forced here (e or a)

Why bytes, not characters: a byte-level BPE token is a string of bytes, and one token may end in the
middle of a character ("é" is 2 bytes, an emoji 4, and the vocabulary holds tokens with half of
one). An automaton over bytes walks any token, whole characters or not; xgrammar and vLLM work the
same way. A character class becomes byte sequences through UTF-8: [à-ÿ] is C3 then A0..BF. Only valid
UTF-8 is accepted (no overlong forms, no surrogates D800-DFFF), so every accepted output decodes.

The subset: literals (\\-escapes of punctuation, \\n \\t \\r \\f \\v, \\xHH, \\uHHHH, \\UHHHHHHHH),
classes [a-z0-9_] and [^...], \\d \\w \\s and their negations (ASCII meanings, as re.ASCII), `.` (any
character but a newline), `*` `+` `?` `{m}` `{m,}` `{m,n}` `{,n}` (a lazy `?` after one is accepted:
it matches the same strings), `|`, groups (...) and (?:...). Not regular, or not needed: anchors
(the whole output always matches the whole pattern), backreferences, lookaround, \\b. A pattern
outside the subset raises ValueError naming the position.

The DFA is minimal (Moore's partition refinement) and holds only live states: from every state some
continuation reaches an accepting state, so a generation can always finish. Dead is -1.
"""
from __future__ import annotations

from collections import deque

import numpy as np

MAX_CODE = 0x10FFFF
MAX_REPEAT = 1000                     # {m,n} copies its operand n times: keep the automaton bounded
_META = set(".[]()*+?{}|\\^$")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
_DIGIT = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE = [(0x09, 0x0D), (0x20, 0x20)]


# --- sets of characters: sorted, disjoint (lo, hi) code-point ranges ----------------------------------

def _norm(ranges) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _negate(ranges) -> list[tuple[int, int]]:
    out, nxt = [], 0
    for lo, hi in _norm(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    return out + ([(nxt, MAX_CODE)] if nxt <= MAX_CODE else [])


_CLASS_ESCAPES = {"d": _DIGIT, "w": _WORD, "s": _SPACE,
                  "D": _negate(_DIGIT), "W": _negate(_WORD), "S": _negate(_SPACE)}
ANY_BUT_NEWLINE = _negate([(0x0A, 0x0A)])


# --- the parser: pattern -> syntax tree ------------------------------------------------------------
# nodes: ("set", ranges) one character of the set | ("cat", [nodes]) | ("alt", [nodes])
#        ("repeat", node, min, max or None)

class _Parser:
    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0

    def fail(self, why: str, at: int | None = None):
        at = self.i if at is None else at
        raise ValueError(f"bad regular expression at position {at}: {why}\n    {self.p}\n    {' ' * at}^")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def parse(self):
        node = self.alt()
        if self.i < len(self.p):                    # alt() stops only at ')' here
            self.fail("unbalanced ')': no group to close")
        return node

    def alt(self):
        branches = [self.concat()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.concat())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def concat(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.repeat())
        return items[0] if len(items) == 1 else ("cat", items)

    def repeat(self):
        node = self.atom()
        quantified = False
        while (q := self.quantifier()) is not None:
            if quantified:
                self.fail("multiple repeat: a quantifier cannot follow a quantifier", q[2])
            node, quantified = ("repeat", node, q[0], q[1]), True
            if self.peek() == "?":                  # lazy: same strings under a full match
                self.i += 1
            elif self.peek() == "+":
                self.fail("possessive quantifiers (a*+) are not supported")
        return node

    def quantifier(self) -> tuple[int, int | None, int] | None:
        """(min, max or None, position) of the quantifier at the cursor, consumed; None if none."""
        at, c = self.i, self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c] + (at,)
        if c != "{":
            return None
        end = self.p.find("}", at)
        body = self.p[at + 1:end] if end > 0 else ""
        lo, comma, hi = body.partition(",")
        if end < 0 or not (lo.isdigit() or (comma and hi.isdigit())) or not (hi.isdigit() or hi == ""):
            return None                             # not a quantifier: '{' is a literal, as in Python
        m, n = int(lo or 0), (int(hi) if hi else None) if comma else int(lo)
        if n is not None and n < m:
            self.fail(f"bad repeat {{{body}}}: max {n} < min {m}", at)
        if max(m, n or 0) > MAX_REPEAT:
            self.fail(f"repeat counts above {MAX_REPEAT} are not supported", at)
        self.i = end + 1
        return m, n, at

    def atom(self):
        at, c = self.i, self.peek()
        if c == "(":
            self.i += 1
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                self.fail("only (...) and (?:...) groups are supported (no lookaround, flags or names)")
            node = self.alt()
            if self.peek() != ")":
                self.fail("missing ')': unterminated group", at)
            self.i += 1
            return node
        if c == "[":
            return ("set", self.char_class())
        if c in ("*", "+", "?") or (c == "{" and self.quantifier() is not None):
            self.fail("nothing to repeat", at)
        if c in ("^", "$"):
            self.fail("anchors are not supported: the output always matches the whole pattern")
        self.i += 1
        if c == ".":
            return ("set", ANY_BUT_NEWLINE)
        if c == "\\":
            return ("set", self.escape(at))
        return ("set", [(ord(c), ord(c))])

    def escape(self, at: int) -> list[tuple[int, int]]:
        """The set an escape names; the cursor is just after the backslash."""
        c = self.peek()
        if c is None:
            self.fail("the pattern ends with a lone backslash", at)
        self.i += 1
        if c in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c]
        if c in _ESCAPES:
            return [(ord(_ESCAPES[c]),) * 2]
        if c in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.p[self.i:self.i + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                self.fail(f"\\{c} needs {width} hex digits", at)
            self.i += width
            code = int(digits, 16)
            if code > MAX_CODE or 0xD800 <= code <= 0xDFFF:
                self.fail(f"\\{c}{digits} is not a Unicode character that UTF-8 can encode", at)
            return [(code, code)]
        if c.isascii() and not c.isalnum():        # \. \* \\ \{ \- \/ ...: the character itself
            return [(ord(c), ord(c))]
        self.fail(f"unsupported escape \\{c} (no backreferences, \\b, \\A, \\Z, \\p)", at)

    def char_class(self) -> list[tuple[int, int]]:
        at = self.i
        self.i += 1                                 # '['
        negate = self.peek() == "^"
        self.i += negate
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                self.fail("unterminated character class: missing ']'", at)
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_item()
            if self.peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                dash = self.i
                self.i += 1
                hi = self.class_item()
                if len(lo) != 1 or len(hi) != 1 or lo[0][0] != lo[0][1] or hi[0][0] != hi[0][1]:
                    self.fail("a range needs single characters at both ends (not \\d, \\w, ...)", dash)
                if hi[0][0] < lo[0][0]:
                    self.fail(f"bad character range {chr(lo[0][0])}-{chr(hi[0][0])}", dash)
                ranges.append((lo[0][0], hi[0][0]))
            else:
                ranges.extend(lo)
        return _negate(ranges) if negate else _norm(ranges)

    def class_item(self) -> list[tuple[int, int]]:
        at, c = self.i, self.peek()
        if c is None:
            self.fail("unterminated character class: missing ']'")
        self.i += 1
        return self.escape(at) if c == "\\" else [(ord(c), ord(c))]


def parse(pattern: str):
    """The syntax tree of `pattern` (ValueError naming the position if it is outside the subset)."""
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str, got {type(pattern).__name__}")
    return _Parser(pattern).parse()


# --- characters -> UTF-8 byte sequences --------------------------------------------------------------

_LENGTHS = ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, MAX_CODE))  # no surrogates


def utf8_sequences(ranges) -> list[list[tuple[int, int]]]:
    """The UTF-8 encodings of a set of characters as byte-range sequences: [(0xC3, 0xC3), (0xA0, 0xBF)]
    is every 2-byte string C3 xx with xx in A0..BF (à..ÿ). Each sequence has one length."""
    out = []
    for lo, hi in ranges:
        for a, b in _LENGTHS:                        # split so both ends have the same length
            if max(lo, a) <= min(hi, b):
                out += _byte_ranges(list(chr(max(lo, a)).encode()), list(chr(min(hi, b)).encode()))
    return out


def _byte_ranges(lo: list[int], hi: list[int]) -> list[list[tuple[int, int]]]:
    """Every byte string between two encodings of one length, as range sequences (continuation
    bytes run 80..BF: a lead byte's block is full when its tail runs 80..80 to BF..BF)."""
    if len(lo) == 1:
        return [[(lo[0], hi[0])]]
    if lo[0] == hi[0]:
        return [[(lo[0], lo[0])] + s for s in _byte_ranges(lo[1:], hi[1:])]
    n, out = len(lo) - 1, []
    first, last = lo[0], hi[0]
    if any(b != 0x80 for b in lo[1:]):               # lo's block is partial: its own sequences
        out += [[(lo[0], lo[0])] + s for s in _byte_ranges(lo[1:], [0xBF] * n)]
        first += 1
    tail = []
    if any(b != 0xBF for b in hi[1:]):               # so is hi's
        tail = [[(hi[0], hi[0])] + s for s in _byte_ranges([0x80] * n, hi[1:])]
        last -= 1
    if first <= last:                                # the full blocks between them
        out.append([(first, last)] + [(0x80, 0xBF)] * n)
    return out + tail


# --- Thompson's construction: tree -> NFA with epsilon moves ------------------------------------------

class NFA:
    """States 0..n-1; eps[s]: states reachable for free; edges[s]: (lo, hi, t) on a byte in lo..hi."""

    def __init__(self):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []

    def state(self) -> int:
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node) -> tuple[int, int]:
        """A fragment for `node`: (start, end), end with no moves of its own yet."""
        kind = node[0]
        s, e = self.state(), self.state()
        if kind == "set":
            for seq in utf8_sequences(node[1]):      # one chain of byte ranges per sequence
                cur = s
                for k, (lo, hi) in enumerate(seq):
                    nxt = e if k == len(seq) - 1 else self.state()
                    self.edges[cur].append((lo, hi, nxt))
                    cur = nxt
        elif kind == "cat":
            cur = s
            for child in node[1]:
                a, b = self.build(child)
                self.eps[cur].append(a)
                cur = b
            self.eps[cur].append(e)
        elif kind == "alt":
            for child in node[1]:
                a, b = self.build(child)
                self.eps[s].append(a)
                self.eps[b].append(e)
        elif kind == "repeat":
            _, child, m, n = node
            cur = s
            for _ in range(m):                       # m required copies
                a, b = self.build(child)
                self.eps[cur].append(a)
                cur = b
            if n is None:                            # then a loop: zero or more
                a, b = self.build(child)
                self.eps[cur] += [a, e]
                self.eps[b] += [a, e]
            else:                                    # then n - m optional copies
                for _ in range(n - m):
                    a, b = self.build(child)
                    self.eps[cur] += [a, e]
                    cur = b
                self.eps[cur].append(e)
        else:
            raise ValueError(f"unknown node {kind!r}")
        return s, e


# --- subset construction, pruning, minimization --------------------------------------------------------

class DFA:
    """trans (n_states, 256) int32: the next state on each byte, -1 = dead. accept (n_states,) bool.
    Start is state 0; states are numbered breadth-first from it."""

    def __init__(self, trans: np.ndarray, accept: np.ndarray, pattern: str = ""):
        self.trans, self.accept, self.pattern = trans, accept, pattern
        self.start = 0
        live = trans >= 0
        self._n_out = live.sum(axis=1)               # how many bytes continue from each state
        self._only = live.argmax(axis=1)             # the byte, where there is one

    @property
    def n_states(self) -> int:
        return len(self.accept)

    def step(self, state: int, byte: int) -> int:
        return int(self.trans[state, byte]) if state >= 0 else -1

    def walk(self, state: int, data: bytes) -> int:
        """The state after `data`, or -1 if it leaves the language."""
        for b in data:
            if state < 0:
                return -1
            state = self.trans[state, b]
        return int(state)

    def accepts(self, state: int) -> bool:
        return state >= 0 and bool(self.accept[state])

    def fullmatch(self, text: str | bytes) -> bool:
        data = text.encode() if isinstance(text, str) else bytes(text)
        return self.accepts(self.walk(self.start, data))

    def forced(self, state: int, limit: int = 4096) -> bytes:
        """The bytes every continuation from `state` starts with: follow the only byte out while
        there is exactly one and the state does not accept (accepting is a choice: stop or go on)."""
        out = bytearray()
        while state >= 0 and not self.accept[state] and self._n_out[state] == 1 and len(out) < limit:
            out.append(int(self._only[state]))
            state = int(self.trans[state, out[-1]])
        return bytes(out)

    def __repr__(self) -> str:
        shown = self.pattern if len(self.pattern) <= 60 else self.pattern[:57] + "..."
        return f"DFA({shown!r}, {self.n_states} states)"


def compile_regex(pattern: str) -> DFA:
    """The minimal DFA over UTF-8 bytes of the strings that fully match `pattern`."""
    nfa = NFA()
    start, end = nfa.build(parse(pattern))
    trans, accept = _determinize(nfa, start, end)
    trans, accept = _prune(trans, accept)
    if trans is None:
        raise ValueError(f"the pattern {pattern!r} matches no string of valid UTF-8")
    trans, accept = _minimize(trans, accept)
    return DFA(trans, accept, pattern)


def _determinize(nfa: NFA, start: int, end: int):
    """Subset construction: a DFA state is the set of NFA states the input so far may have reached.
    Bytes are grouped into classes that no edge tells apart (cut at every range end): fewer columns."""
    cuts = sorted({0, 256} | {x for es in nfa.edges for lo, hi, _ in es for x in (lo, hi + 1)})
    byte_class = np.searchsorted(cuts, np.arange(256), side="right") - 1      # (256,) byte -> class
    n_cls = len(cuts) - 1

    def closure(states) -> frozenset:
        seen, todo = set(states), list(states)
        while todo:
            for t in nfa.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)

    first = closure([start])
    ids, order, rows = {first: 0}, [first], []
    for S in order:                                  # order grows while we walk it: breadth first
        moves: dict[int, set[int]] = {}
        for s in S:
            for lo, hi, t in nfa.edges[s]:
                for c in range(byte_class[lo], byte_class[hi] + 1):
                    moves.setdefault(c, set()).add(t)
        row = [-1] * n_cls
        for c, targets in moves.items():
            T = closure(targets)
            if T not in ids:
                ids[T] = len(order)
                order.append(T)
            row[c] = ids[T]
        rows.append(row)
    trans = np.array(rows, dtype=np.int32)[:, byte_class]                    # (n, 256)
    accept = np.array([end in S for S in order], dtype=bool)
    return trans, accept


def _prune(trans: np.ndarray, accept: np.ndarray):
    """Drop the states from which no accepting state can be reached (they become -1)."""
    live = accept.copy()
    while True:
        grown = live | ((trans >= 0) & live[trans]).any(axis=1)
        if (grown == live).all():
            break
        live = grown
    if not live[0]:
        return None, None
    trans = np.where((trans >= 0) & live[trans], trans, -1)
    return _renumber(trans, accept, np.arange(len(accept)))


def _minimize(trans: np.ndarray, accept: np.ndarray):
    """Moore's refinement: start from {accepting, not}; split blocks whose states go to different
    blocks on some byte; stop when nothing splits. Each block becomes one state."""
    block = accept.astype(np.int64)
    n_blocks = len(np.unique(block))
    while True:
        nxt = np.where(trans >= 0, block[trans], -1)                          # (n, 256) block after each byte
        _, block = np.unique(np.column_stack([block, nxt]), axis=0, return_inverse=True)
        block = block.reshape(-1)
        if len(np.unique(block)) == n_blocks:
            break
        n_blocks = len(np.unique(block))
    return _renumber(trans, accept, block)


def _renumber(trans: np.ndarray, accept: np.ndarray, block: np.ndarray):
    """Merge states of one block and number the reachable ones breadth-first from state 0's block."""
    rep: dict[int, int] = {}
    for s, b in enumerate(block.tolist()):
        rep.setdefault(b, s)
    new = {block[0].item(): 0}
    queue, order = deque([block[0].item()]), []
    while queue:
        b = queue.popleft()
        order.append(b)
        for t in trans[rep[b]].tolist():
            if t >= 0 and (tb := block[t].item()) not in new:
                new[tb] = len(new)
                queue.append(tb)
    lut = np.full(int(block.max()) + 2, -1, dtype=np.int32)                   # block -> new id; index -1 -> -1
    for b, i in new.items():
        lut[b] = i
    reps = [rep[b] for b in order]
    t = trans[reps]
    out = np.where(t >= 0, lut[block[np.maximum(t, 0)]], -1).astype(np.int32)
    return out, accept[reps].copy()
