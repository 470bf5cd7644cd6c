"""Constrained decoding: a grammar's masks at every step, and jump-forward where the grammar decides.

    vocab = Vocabulary.from_tokenizer(tokenizer, model.cfg.vocab_size)
    grammar = compile_grammar("json_schema", schema, vocab)    # cached: the next request reuses it
    out = generate(model, tokenizer, prompt_ids, grammar, 64, jump_forward="text")
    json.loads(out.text)                                       # always parses; out.model_steps <= tokens

A `Grammar` (DFA + vocabulary) is shared by every request with the same spec; it caches one packed
mask per DFA state, so a state costs one trie walk the first time and a lookup after. A
`GrammarState` is one request's position: advance by token id, the mask for the next token,
rollback by n tokens (lab 08's speculative tokens come back when rejected).

Jump-forward (SGLang's compressed FSM, llguidance's fast-forward tokens): where the DFA leaves one
way on, those bytes need no model choice. `{"name": "` is forced before the name; `, "age": `
after it. Appending their tokens without a sampling step saves model steps: they go to the model
with the next step's input, like a short prefill (one forward pass over several tokens).

Three modes, and the subtlety of token boundaries:
- "off": one model step per token, EOS included.
- "exact": skip the step only where the mask allows exactly one token (often EOS at the end). The
  model would have had to pick it: greedy, the output is "off"'s token for token (sampled, the same
  distribution, though a seeded stream shifts by the draws skipped).
- "text": force the grammar's forced bytes. They must become tokens, and the tokenizer's encoding
  of the forced text alone (what we use) need not be what the model would have written: step by step
  SmolLM2 writes `{` then `"` where the tokenizer writes `{"`, and the rest of its answer changes.
  At the end of the forced text a longer token could run into the free part (` ` then `true`, or
  ` true`?): forcing a token the model would never write shifts what it writes next. So we hold
  back the last forced tokens whenever a longer allowed token starts with them (the model then
  chooses, under the mask), as llguidance does. SGLang instead re-tokenizes the whole output after
  a jump and recomputes the cache from the first token that changed. Either way the output stays
  valid; it may differ from "off" after the first jump.
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from course.engine.runner import forward_cached_eager
from course.engine.sampler import SamplingParams, sample
from course.engine.slot_cache import SlotKVCache
from course.structured.json_schema import json_object_regex, schema_to_regex
from course.structured.regex import DFA, compile_regex
from course.structured.tokens import TokenMask, Vocabulary, pack

FINISHED = -2                       # the state after EOS


class Grammar:
    """A DFA lifted to one vocabulary; masks cached per state. Shared by requests (no request state)."""

    def __init__(self, dfa: DFA, vocab: Vocabulary):
        self.dfa, self.vocab = dfa, vocab
        self._masks: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # state -> (packed words, allowed ids)
        self.mask_seconds = 0.0     # time spent walking the trie (cache misses)
        eos_only = np.zeros(vocab.size, dtype=bool)
        eos_only[vocab.eos] = True
        self._masks[FINISHED] = (pack(eos_only), np.flatnonzero(eos_only))

    @classmethod
    def from_regex(cls, pattern: str, vocab: Vocabulary) -> Grammar:
        return cls(compile_regex(pattern), vocab)

    @classmethod
    def from_json_schema(cls, schema: dict, vocab: Vocabulary, **kw) -> Grammar:
        return cls(compile_regex(schema_to_regex(schema, **kw)), vocab)

    def _entry(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        if state not in self._masks:
            t = time.perf_counter()
            allowed = self.vocab.allowed(self.dfa, state)             # (V,) bool
            self._masks[state] = (pack(allowed), np.flatnonzero(allowed))
            self.mask_seconds += time.perf_counter() - t
        return self._masks[state]

    def mask(self, state: int) -> np.ndarray:
        """(ceil(V/32),) int32: the packed mask of the next token from `state`."""
        return self._entry(state)[0]

    def allowed_ids(self, state: int) -> np.ndarray:
        """The token ids allowed from `state`, ascending."""
        return self._entry(state)[1]

    @property
    def n_cached(self) -> int:
        return len(self._masks) - 1

    def __repr__(self) -> str:
        return f"Grammar({self.dfa!r}, {self.n_cached} masks cached)"


_CACHE: OrderedDict = OrderedDict()
CACHE_SIZE = 64


def compile_grammar(kind: str, spec, vocab: Vocabulary) -> Grammar:
    """The Grammar of a spec, compiled once and reused (least recently used out after CACHE_SIZE).
    kind: "regex" (spec: a pattern), "json_schema" (spec: a schema dict), "json_object" (spec: None
    or {"max_depth": n}). Errors: ValueError (json_schema.UnsupportedSchemaError names the keyword)."""
    if kind not in ("regex", "json_schema", "json_object"):
        raise ValueError(f"kind must be 'regex', 'json_schema' or 'json_object', got {kind!r}")
    key = (kind, json.dumps(spec), vocab)                             # property order matters: not sorted
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    if kind == "regex":
        pattern = spec
    elif kind == "json_schema":
        pattern = schema_to_regex(spec)
    else:
        pattern = json_object_regex(**(spec or {}))
    grammar = Grammar(compile_regex(pattern), vocab)
    _CACHE[key] = grammar
    if len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    return grammar


class GrammarState:
    """One request's place in a grammar: one DFA state per token so far (rollback pops them)."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.states = [grammar.dfa.start]

    @property
    def state(self) -> int:
        return self.states[-1]

    @property
    def finished(self) -> bool:
        """EOS was accepted: nothing may follow."""
        return self.state == FINISHED

    @property
    def is_accepting(self) -> bool:
        """The output so far is a whole match: EOS is allowed now."""
        return self.finished or self.grammar.dfa.accepts(self.state)

    def mask(self) -> np.ndarray:
        return self.grammar.mask(self.state)

    def allowed_ids(self) -> np.ndarray:
        return self.grammar.allowed_ids(self.state)

    def fill(self, mask: TokenMask, row: int) -> None:
        mask.fill(row, self.mask())

    def next_state(self, token_id: int) -> int:
        """The state after `token_id` (FINISHED for an accepted EOS), or -1 if the grammar forbids it."""
        vocab, s = self.grammar.vocab, self.state
        if s == FINISHED:
            return -1
        if token_id in vocab.eos:
            return FINISHED if self.grammar.dfa.accepts(s) else -1
        data = vocab.tokens[token_id] if 0 <= token_id < len(vocab.tokens) else None
        return -1 if not data else self.grammar.dfa.walk(s, data)

    def advance(self, token_id: int) -> None:
        nxt = self.next_state(int(token_id))
        if nxt == -1:
            data = self.grammar.vocab.tokens[token_id] if 0 <= token_id < len(self.grammar.vocab.tokens) else None
            why = "the output already ended (EOS)" if self.finished else \
                "EOS before the output is complete" if token_id in self.grammar.vocab.eos else \
                "a special token" if data is None else f"its bytes {data!r} leave the grammar"
            raise ValueError(f"token {token_id} is not allowed in state {self.state}: {why}")
        self.states.append(nxt)

    def rollback(self, n: int) -> None:
        """Forget the last n tokens."""
        if type(n) is not int or not 0 <= n < len(self.states):
            raise ValueError(f"can roll back 0..{len(self.states) - 1} tokens, got {n!r}")
        del self.states[len(self.states) - n:]

    def forced_bytes(self) -> bytes:
        return b"" if self.finished else self.grammar.dfa.forced(self.state)

    def forced_tokens(self, tokenizer=None) -> list[int]:
        """Tokens to append without a model step. The one allowed token if there is exactly one
        (exact); else, given a tokenizer, the encoding of the forced bytes, less its held-back tail."""
        ids = self.allowed_ids()
        if len(ids) == 1:
            return [int(ids[0])]
        if tokenizer is None:
            return []
        data = self.forced_bytes()
        text = _whole_chars(data)
        if not text:
            return []
        vocab = self.grammar.vocab
        tokens = tokenizer.encode(text, add_special_tokens=False)
        if b"".join(vocab.tokens[t] or b"\0" for t in tokens) != text.encode():
            return []                                                 # a tokenizer that normalizes text: no jump
        states = [self.state]
        for t in tokens:
            states.append(self.grammar.dfa.walk(states[-1], vocab.tokens[t]))
        k = len(tokens)                                               # hold back what a longer token could cover
        while k > 0:
            tail = b"".join(vocab.tokens[t] for t in tokens[k - 1:])
            allowed = self.grammar.allowed_ids(states[k - 1])
            if not any(len(vocab.tokens[a] or b"") > len(tail) and vocab.tokens[a].startswith(tail) for a in allowed):
                break
            k -= 1
        return tokens[:k]


def _whole_chars(data: bytes) -> str:
    """The longest prefix of `data` that is whole UTF-8 characters, decoded."""
    for end in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:end].decode()
        except UnicodeDecodeError:
            continue
    return ""


def fill_masks(states: list[GrammarState | None], mask: TokenMask) -> None:
    """A batch's masks: row b from states[b], every token allowed where a request has no grammar."""
    for row, st in enumerate(states):
        if st is None:
            mask.allow_all(row)
        else:
            st.fill(mask, row)


@dataclass
class Generation:
    token_ids: list[int]       # the new tokens, EOS included when it ended the output
    text: str                  # decoded, special tokens left out
    model_steps: int           # forward passes (the prefill is the first)
    forced_tokens: int         # tokens appended without a model step
    finish_reason: str         # "stop" (EOS) or "length" (max_new_tokens)


@torch.no_grad()
def generate(model, tokenizer, prompt_ids, grammar: Grammar, max_new_tokens: int = 64, *,
             params: SamplingParams | None = None, jump_forward: str | bool = "off",
             trace: list | None = None) -> Generation:
    """One request, constrained by `grammar`: a slot KV cache, a prefill, then one forward pass per
    model step over the tokens not yet seen (the last sampled one, and any forced after it).
    params: lab 07's SamplingParams (default greedy); jump_forward: "off", "exact" or "text".
    trace: a list that gets one dict per new token: the DFA state before it, how many tokens the
    mask allowed, the token, the model's own choice without the mask (None for a forced token)."""
    mode = ("text" if jump_forward else "off") if isinstance(jump_forward, bool) else jump_forward
    if mode not in ("off", "exact", "text"):
        raise ValueError(f"jump_forward must be 'off', 'exact' or 'text' (or a bool), got {jump_forward!r}")
    prompt = [int(t) for t in (prompt_ids.flatten().tolist() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)]
    if not prompt:
        raise ValueError("prompt_ids must hold at least one token")
    if type(max_new_tokens) is not int or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if grammar.vocab.size != model.cfg.vocab_size:
        raise ValueError(f"the grammar's vocabulary has {grammar.vocab.size} tokens, the model's logits "
                         f"{model.cfg.vocab_size}: build it with "
                         "Vocabulary.from_tokenizer(tokenizer, model.cfg.vocab_size)")
    params = params or SamplingParams(temperature=0.0)
    dev = model.device
    generator = params.generator(dev)
    cache = SlotKVCache(model.cfg, n_slots=1, max_len=len(prompt) + max_new_tokens, dtype=model.dtype, device=dev)
    slot = torch.zeros(1, dtype=torch.long, device=dev)
    mask = TokenMask(1, model.cfg.vocab_size)
    state = GrammarState(grammar)
    out, feed, steps, forced = [], prompt, 0, 0
    while len(out) < max_new_tokens and not state.finished:
        free = state.forced_tokens(tokenizer if mode == "text" else None) if mode != "off" else []
        if free:                                                      # no model step for these
            free = free[:max_new_tokens - len(out)]
            for t in free:
                if trace is not None:
                    trace.append(dict(state=state.state, allowed=len(state.allowed_ids()), token=t, wanted=None))
                state.advance(t)
            out += free
            feed = feed + [t for t in free if t not in grammar.vocab.eos]
            forced += len(free)
            continue
        start = int(cache.lengths[0])
        ids = torch.tensor([feed], dtype=torch.long, device=dev)                   # (1, T)
        pos = torch.arange(start, start + len(feed), device=dev)[None]             # (1, T)
        logits = forward_cached_eager(model, ids, pos, cache, slot)[:, -1].float()  # (1, V)
        steps += 1
        wanted = int(logits.argmax()) if trace is not None else None
        state.fill(mask, 0)
        mask.apply_(logits)
        t = int(sample(logits, [params], [generator])[0])
        if trace is not None:
            trace.append(dict(state=state.state, allowed=len(state.allowed_ids()), token=t, wanted=wanted))
        state.advance(t)
        out.append(t)
        feed = [t]
    text = tokenizer.decode(out, skip_special_tokens=True)
    return Generation(out, text, steps, forced, "stop" if state.finished else "length")
