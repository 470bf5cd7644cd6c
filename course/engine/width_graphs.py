"""Decode graphs for calls of several widths, and one-slot caches that keep their graphs (lab 08).

Speculative decoding calls the target with T = gamma + 1 new tokens (the last accepted token and the
drafts) and, when the drafter had nothing to offer, with T = 1; the draft model is called with
T = 1, or T = 2 after a step that accepted every draft. A graph holds one shape, so
`WidthGraphs` keeps one `SlotDecodeGraphs` per width over the same cache and routes each call by
its width; any other width (a prefill) runs eagerly.

Capturing costs a few eager passes, more than a short generation saves, so `SlotCachePool` makes
each one-slot cache (and captures its graphs) once per (model, max_len rounded up, widths) and
hands the same cache out again, emptied, on every later request:

    caches = SlotCachePool(graphs=True)                 # False: a fresh plain cache per request
    cache = caches.get(model, max_len=90, widths=(1, 5))  # forward_cached on it replays T = 1 or 5
"""
from __future__ import annotations

import torch

from course.engine.graphs import SlotDecodeGraphs
from course.engine.runner import forward_cached_eager
from course.engine.slot_cache import SlotKVCache
from course.models.decoder import Decoder

__all__ = ["WidthGraphs", "SlotCachePool"]


def _widths(widths) -> tuple[int, ...]:
    try:
        out = tuple(sorted(set(widths)))
    except TypeError:
        out = ()
    if not out or any(type(t) is not int or t < 1 for t in out):
        raise ValueError(f"widths must be positive ints (new tokens per call), got {widths!r}")
    return out


class WidthGraphs:
    """forward_cached on one SlotKVCache for calls of the given widths, each replayed from its own
    graphs; a drop-in for `cache.graphs`. Logits of a replay are a static buffer: read them before
    the next call."""

    def __init__(self, model: Decoder, cache: SlotKVCache, widths, max_batch: int | None = None):
        self.model, self.cache = model, cache
        self.by_width = {T: SlotDecodeGraphs(model, cache, max_batch, n_tokens=T) for T in _widths(widths)}
        self.eager_calls = 0

    @property
    def off(self) -> str | None:
        """Why some width runs eagerly (its step could not be captured), or None."""
        return next((g.off for g in self.by_width.values() if g.off is not None), None)

    @property
    def replays(self) -> int:
        return sum(g.replays for g in self.by_width.values())

    def __call__(self, model: Decoder, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: SlotKVCache,
                 slots: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        width = input_ids.shape[1] if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else None
        graphs = self.by_width.get(width)
        if graphs is None:
            self.eager_calls += 1
            return forward_cached_eager(model, input_ids, position_ids, cache, slots, attention_mask)
        return graphs(model, input_ids, position_ids, cache, slots, attention_mask)

    def describe(self) -> str:
        return "; ".join(f"width {T}: {g.describe()}" for T, g in self.by_width.items()) + \
            f"; {self.eager_calls} calls of other widths (eager)"


class SlotCachePool:
    """One-slot caches, handed out empty. With `graphs`, each (model, max_len rounded up to
    `round_to`, widths) gets one cache whose decode graphs are captured when it is first asked for,
    and the same cache every later time: use one at a time per key. Without, a fresh plain cache of
    exactly max_len per request, as `SlotKVCache(model.cfg, 1, max_len, ...)` would give."""

    def __init__(self, graphs: bool = False, round_to: int = 64):
        if not isinstance(graphs, bool):
            raise TypeError(f"graphs must be True or False, got {graphs!r}")
        if type(round_to) is not int or round_to < 1:
            raise ValueError(f"round_to must be a positive int, got {round_to!r}")
        self.graphs, self.round_to = graphs, round_to
        self._kept: dict[tuple, SlotKVCache] = {}

    def get(self, model: Decoder, max_len: int, widths=(1,)) -> SlotKVCache:
        """An empty one-slot cache for `model` with room for `max_len` tokens."""
        if not isinstance(model, Decoder):
            raise TypeError(f"model must be a course Decoder, got {type(model).__name__}")
        if type(max_len) is not int or max_len < 1:
            raise ValueError(f"max_len must be a positive int, got {max_len!r}")
        widths = _widths(widths)
        if not self.graphs:
            return SlotKVCache(model.cfg, n_slots=1, max_len=max_len, dtype=model.dtype, device=model.device)
        size = -(-max_len // self.round_to) * self.round_to
        key = (id(model), size, widths)
        cache = self._kept.get(key)
        if cache is None:                     # (the kept cache holds the model: its id cannot be reused)
            with torch.inference_mode(False):     # asked inside a timing loop's inference mode, the cache must
                cache = SlotKVCache(model.cfg, n_slots=1, max_len=size, dtype=model.dtype, device=model.device)
                cache.graphs = WidthGraphs(model, cache, widths)    # still be a normal tensor a graph may write
            self._kept[key] = cache
        cache.reset(0)
        return cache
