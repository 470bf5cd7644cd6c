"""Grammars for `response_format`: compiled once per schema, off the event loop, shared by requests.

    grammars = GrammarCache(tokenizer, model.cfg.vocab_size, eos_token_id=core.eos_token_id)
    grammar = await grammars.get(("json_schema", schema))     # APIError 400 naming an unsupported keyword
    engine.add(prompt_ids, params, max_tokens, grammar=grammar)  # the engine masks this request's logits

Compiling is the costly part of structured outputs, and it is paid once: the vocabulary's bytes and
trie (about a second for 49k tokens, on the first structured request), the schema's regex, its DFA,
and one token mask per DFA state (a trie walk each, done here up front, so the engine's step never
pays a cache miss: a miss there would stall the whole batch). The next request with the same
schema finds the Grammar in the cache (least recently used out after `size`). The work runs in a
worker thread (`asyncio.to_thread`, as the engine's step does), so the event loop keeps streaming
other requests' tokens meanwhile; requests that ask for a schema already being compiled wait for
that one compilation rather than starting their own. `metrics()` reports compilations, cache hits
and the seconds spent, for /metrics.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict

from course.serve.protocol import APIError
from course.structured.decode import Grammar, compile_grammar
from course.structured.json_schema import UnsupportedSchemaError, resolve_refs
from course.structured.tokens import Vocabulary

SCHEMA_PARAM = "response_format.json_schema.schema"
WARM_STATES = 4096                 # masks computed at compile time for DFAs up to this many states


class GrammarCache:
    """Compiled grammars by (kind, spec), over one tokenizer's vocabulary at the model's logits width."""

    def __init__(self, tokenizer, vocab_size: int, size: int = 64, eos_token_id: int | None = None):
        """eos_token_id: the token that ends an output (the engine's), else the tokenizer's EOS."""
        if type(size) is not int or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        self.tokenizer, self.vocab_size, self.size = tokenizer, vocab_size, size
        self.eos = None if eos_token_id is None else [eos_token_id]
        self.vocab: Vocabulary | None = None               # built by the first compilation
        self._vocab_lock = threading.Lock()                # two first compilations in two threads build it once
        self.grammars: OrderedDict[str, Grammar] = OrderedDict()
        self.pending: dict[str, asyncio.Future] = {}       # compilations in flight, by key
        self.compiles, self.hits, self.compile_seconds = 0, 0, 0.0

    async def get(self, fmt: tuple[str, dict | None]) -> Grammar:
        """The Grammar of a parsed response_format (protocol.parse_response_format's (kind, spec)),
        compiled in a worker thread on a miss. APIError 400 when the schema is outside the subset."""
        kind, spec = fmt
        key = json.dumps([kind, spec])                     # property order matters to the grammar: not sorted
        if key in self.grammars:
            self.hits += 1
            self.grammars.move_to_end(key)
            return self.grammars[key]
        task = self.pending.get(key)
        if task is None:
            task = asyncio.ensure_future(asyncio.to_thread(self._compile, kind, spec))
            self.pending[key] = task
            task.add_done_callback(lambda t: self.pending.pop(key, None) and (t.cancelled() or t.exception()))
        else:
            self.hits += 1
        grammar = await asyncio.shield(task)               # a client that leaves does not cancel the others' wait
        if key not in self.grammars:
            self.grammars[key] = grammar
            if len(self.grammars) > self.size:
                self.grammars.popitem(last=False)
        return grammar

    def _compile(self, kind: str, spec: dict | None) -> Grammar:
        """Vocabulary (once), then the grammar and its masks; errors become APIError 400. In a thread."""
        t0 = time.perf_counter()
        try:
            vocab = self.vocabulary()
            if kind == "json_schema":
                spec = resolve_refs(spec)                  # pydantic's $defs (enums, nested models) inlined
            grammar = compile_grammar(kind, spec, vocab)
        except UnsupportedSchemaError as e:
            raise APIError(400, f"'{SCHEMA_PARAM}' is outside the supported JSON Schema subset: {e}",
                           param=SCHEMA_PARAM) from None
        except RecursionError:
            raise APIError(400, f"'{SCHEMA_PARAM}' is nested too deeply.", param=SCHEMA_PARAM) from None
        except ValueError as e:                            # e.g. a repeat count the regex engine refuses
            raise APIError(400, f"'{SCHEMA_PARAM}' cannot be compiled: {e}", param=SCHEMA_PARAM) from None
        if grammar.dfa.n_states <= WARM_STATES:
            for state in range(grammar.dfa.n_states):     # every mask now: the engine's step only looks up
                grammar.mask(state)
        self.compiles += 1
        self.compile_seconds += time.perf_counter() - t0
        return grammar

    def vocabulary(self) -> Vocabulary:
        """The tokenizer's Vocabulary at the model's logits width, built on first use (about a second)."""
        with self._vocab_lock:
            if self.vocab is None:
                self.vocab = Vocabulary.from_tokenizer(self.tokenizer, self.vocab_size, self.eos)
            return self.vocab

    def metrics(self) -> dict[str, float]:
        """Counters for /metrics: compilations, cache hits, seconds compiling, grammars held."""
        return {"grammar_compiles": self.compiles, "grammar_cache_hits": self.hits,
                "grammar_compile_seconds": self.compile_seconds, "grammars_cached": len(self.grammars)}
