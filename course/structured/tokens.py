"""From bytes to tokens: which vocabulary tokens keep the automaton alive, as a packed bitmask.

    vocab = Vocabulary.from_tokenizer(tokenizer)       # once per tokenizer: bytes of every token, a trie
    allowed = vocab.allowed(dfa, state)               # (V,) bool: tokens whose bytes the DFA can walk
    mask = TokenMask(batch=2, vocab_size=vocab.size)  # (2, ceil(V/32)) int32 words
    mask.fill(0, pack(allowed)); mask.apply_(logits)  # logits (2, V): -inf where a bit is 0

The bytes of a token. A byte-level BPE tokenizer (GPT-2, Llama 3, SmolLM2) writes each byte as one
printable character (GPT-2's table: "Ġ" is the space byte 0x20, "Ċ" the newline), so a token's
string maps back to its exact bytes, which may end inside a UTF-8 character. Special tokens
(<|im_start|>, ...) are control, not text: never allowed, except end-of-sequence (EOS) where the
automaton accepts: the output may stop there.

The trie. Tokens share prefixes ("{", "{\"", "{\"name"), so we walk them as a trie: step the DFA by
a node's byte; where it dies, the whole subtree dies with it (every token below starts with those
bytes). The walk goes one depth at a time, all live (node, state) pairs at once in numpy. A token
is allowed when the walk reaches its node alive. The result depends only on the state, so a grammar
caches it per state (decode.py): a generation pays the walk once per new state, then a lookup.

The bitmask: (B, W) int32 with W = ceil(V / 32); bit j of word i allows token 32 i + j. It is
xgrammar's layout (`allocate_token_bitmask`), 32x smaller than a bool mask: what crosses from the
CPU, where masks are computed, to the GPU, where the logits are.
"""
from __future__ import annotations

import numpy as np
import torch

from course.structured.regex import DFA


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for themselves, the
    other 68 (controls, space, ...) take the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def token_bytes(tokenizer) -> list[bytes | None]:
    """The bytes of every token id of `tokenizer`, None for special and added tokens."""
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    n = len(tokenizer)
    special = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})} | set(tokenizer.all_special_ids)
    out: list[bytes | None] = []
    for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(n)))):
        if i in special or piece is None:
            out.append(None)
            continue
        try:
            out.append(bytes(to_byte[c] for c in piece))
        except KeyError:
            raise ValueError(f"token {i} ({piece!r}) is not made of GPT-2 byte characters: structured outputs "
                             "here need a byte-level BPE tokenizer (GPT-2, Llama 3, SmolLM2)") from None
    return out


class Vocabulary:
    """Every token's bytes and a trie over them, for one tokenizer and a model's vocabulary size V.

    Trie nodes are numbered depth by depth, in byte order: the children of a node are consecutive
    (first_child[n], n_children[n]). node_byte[n] is the byte into node n; token_at[n] the token
    whose bytes end there (-1 if none). Node 0 is the root (no bytes)."""

    def __init__(self, tokens: list[bytes | None], vocab_size: int | None = None,
                 eos_token_ids: list[int] | tuple[int, ...] = ()):
        self.tokens = list(tokens)
        self.size = len(tokens) if vocab_size is None else int(vocab_size)
        if self.size < len(tokens):
            raise ValueError(f"vocab_size {self.size} is smaller than the tokenizer's {len(tokens)} tokens")
        self.eos = [int(e) for e in eos_token_ids]
        if any(not 0 <= e < self.size for e in self.eos):
            raise ValueError(f"eos_token_ids {self.eos} must be token ids below {self.size}")
        self._build_trie()

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None, eos_token_ids=None) -> Vocabulary:
        """vocab_size: the model's logits width (it may pad the tokenizer's vocabulary); EOS: the
        tokenizer's end-of-sequence token unless given."""
        eos = [tokenizer.eos_token_id] if eos_token_ids is None else list(eos_token_ids)
        return cls(token_bytes(tokenizer), vocab_size or len(tokenizer), [e for e in eos if e is not None])

    def _build_trie(self):
        words = {t: i for i, t in enumerate(self.tokens) if t}       # bytes -> token id (empty: never allowed)
        if len(words) != sum(1 for t in self.tokens if t):
            raise ValueError("two tokens have the same bytes: a trie node holds one token id")
        levels = [[b""]]                                             # level d: the sorted prefixes of length d
        longest = max(map(len, words), default=0)
        for d in range(1, longest + 1):
            levels.append(sorted({w[:d] for w in words if len(w) >= d}))
        offset = np.cumsum([0] + [len(level) for level in levels])
        n = int(offset[-1])
        self.node_byte = np.zeros(n, dtype=np.int64)
        self.token_at = np.full(n, -1, dtype=np.int64)
        self.first_child = np.zeros(n, dtype=np.int64)
        self.n_children = np.zeros(n, dtype=np.int64)
        index = {b"": 0}
        for d in range(1, len(levels)):
            for k, p in enumerate(levels[d]):
                node, parent = int(offset[d]) + k, index[p[:-1]]
                index[p] = node
                if self.n_children[parent] == 0:
                    self.first_child[parent] = node               # sorted: siblings are consecutive
                self.n_children[parent] += 1
                self.node_byte[node] = p[-1]
                self.token_at[node] = words.get(p, -1)
        self.n_nodes = n

    def allowed(self, dfa: DFA, state: int) -> np.ndarray:
        """(V,) bool: the tokens that `dfa` can read whole from `state` and stay alive, plus EOS when
        `state` accepts. A walk of the trie, pruned where the DFA dies."""
        out = np.zeros(self.size, dtype=bool)
        if state < 0:
            return out
        nodes = self.first_child[0] + np.arange(self.n_children[0])   # depth 1
        states = np.full(len(nodes), state, dtype=np.int64)           # the parent's state, per node
        while len(nodes):
            states = dfa.trans[states, self.node_byte[nodes]]         # step every pair by its byte
            alive = states >= 0
            nodes, states = nodes[alive], states[alive]               # dead: the subtree is never visited
            tok = self.token_at[nodes]
            out[tok[tok >= 0]] = True
            counts = self.n_children[nodes]                           # go one level down
            starts = np.repeat(self.first_child[nodes] - np.cumsum(counts) + counts, counts)
            nodes = starts + np.arange(int(counts.sum()))
            states = np.repeat(states, counts)
        if dfa.accepts(state):
            out[self.eos] = True
        return out

    def __repr__(self) -> str:
        return f"Vocabulary({sum(t is not None for t in self.tokens)} text tokens of {self.size}, " \
               f"{self.n_nodes} trie nodes, eos={self.eos})"


# --- the packed bitmask ----------------------------------------------------------------------------

def n_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def pack(allowed: np.ndarray) -> np.ndarray:
    """(V,) bool -> (ceil(V/32),) int32: bit j of word i is allowed[32 i + j]."""
    V = len(allowed)
    bits = np.zeros(n_words(V) * 32, dtype=bool)
    bits[:V] = allowed
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)


def unpack(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(..., W) int32 -> (..., V) bool, on the words' device."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> shifts) & 1                        # (..., W, 32)
    return bits.flatten(-2)[..., :vocab_size].bool()


class TokenMask:
    """One row of packed bits per request of a batch: (B, W) int32, all allowed to begin with."""

    def __init__(self, batch: int, vocab_size: int, device: str | torch.device = "cpu"):
        if type(batch) is not int or batch < 1 or type(vocab_size) is not int or vocab_size < 1:
            raise ValueError(f"batch and vocab_size must be positive ints, got {batch!r} and {vocab_size!r}")
        self.vocab_size = vocab_size
        self.words = torch.full((batch, n_words(vocab_size)), -1, dtype=torch.int32, device=device)

    def fill(self, row: int, words: np.ndarray | torch.Tensor) -> None:
        """Row `row` gets these packed words (from `pack` or a grammar's cache)."""
        self.words[row] = torch.as_tensor(words, dtype=torch.int32)

    def allow_all(self, row: int) -> None:
        """An unconstrained request: every bit set."""
        self.words[row] = -1

    def to_bool(self) -> torch.Tensor:
        return unpack(self.words, self.vocab_size)                    # (B, V)

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_token_mask_(logits, self.words)


def apply_token_mask_(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Set logits (B, V) to -inf where the packed mask (B, ceil(V/32)) int32 has a 0 bit; in place, on
    the logits' device (the words are copied there). Returns `logits`."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a floating (B, V) tensor, got {got}")
    B, V = logits.shape
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int32 or tuple(words.shape) != (B, n_words(V)):
        got = (tuple(words.shape), words.dtype) if isinstance(words, torch.Tensor) else type(words).__name__
        raise ValueError(f"the mask must be an int32 tensor of shape (B, ceil(V/32)) = {(B, n_words(V))}, got {got}")
    allowed = unpack(words.to(logits.device, non_blocking=True), V)    # (B, V)
    return logits.masked_fill_(~allowed, float("-inf"))
