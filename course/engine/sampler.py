"""Lab 07's batched sampler, released for the labs after it: one call samples a whole batch, each
row with its own settings and, for a seeded request, its own random generator.

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=1)]
    generators = [None, torch.Generator(device).manual_seed(1)]     # made once per request
    tokens = sample(logits, params, generators)                     # (B,) torch.long

The order is vLLM's: greedy rows take the argmax of the raw logits; the other rows go through
temperature -> min-p -> top-k -> top-p -> softmax -> one draw (the processors are lab 07's, released
in course.engine.logits). A row with a generator draws with it alone, so a seeded request gets the
same tokens whoever shares its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from course.engine.logits import apply_min_p, apply_temperature, apply_top_k, apply_top_p


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (a small version of vLLM's SamplingParams)."""

    temperature: float = 1.0     # 0: greedy
    top_k: int = 0               # 0: off
    top_p: float = 1.0           # 1: off
    min_p: float = 0.0           # 0: off
    seed: int | None = None      # None: draw from torch's global generator

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if type(self.top_k) is not int or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and type(self.seed) is not int:
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    def generator(self, device: str | torch.device = "cpu") -> torch.Generator | None:
        """The request's own generator (seeded once, when the request starts), or None without a seed."""
        return None if self.seed is None else torch.Generator(device=device).manual_seed(self.seed)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None] | None = None) -> torch.Tensor:
    """One token per row of logits (B, V): (B,) torch.long. Does not modify `logits`."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a (B, V) tensor, got {getattr(logits, 'shape', type(logits).__name__)}")
    B = logits.shape[0]
    generators = [None] * B if generators is None else list(generators)
    if len(params) != B or len(generators) != B:
        raise ValueError(f"need one SamplingParams and one generator (or None) per row: B={B}, "
                         f"got {len(params)} params and {len(generators)} generators")
    z = logits.float()
    out = z.argmax(dim=-1)                                                         # greedy rows: the raw argmax
    drawn = [b for b in range(B) if params[b].temperature > 0]
    if not drawn:
        return out
    ps = [params[b] for b in drawn]
    z = apply_temperature(z[drawn], [p.temperature for p in ps])                  # vLLM's order
    z = apply_top_p(apply_top_k(apply_min_p(z, [p.min_p for p in ps]), [p.top_k for p in ps]), [p.top_p for p in ps])
    probs = z.softmax(dim=-1)                                                      # (B', V)
    shared = [i for i, b in enumerate(drawn) if generators[b] is None]
    if shared:                                                                     # one draw for all of them
        out[[drawn[i] for i in shared]] = torch.multinomial(probs[shared], 1).squeeze(1)
    for i, b in enumerate(drawn):                                                  # each seeded row on its own
        if generators[b] is not None:
            out[b] = torch.multinomial(probs[i], 1, generator=generators[b])[0]
    return out
