"""Lab 07's batched sampler, released for the labs after it: one call samples a whole batch, each
row with its own settings and, for a seeded request, its own random generator.

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=1)]
    generators = [None, torch.Generator(device).manual_seed(1)]     # made once per request
    tokens = sample(logits, params, generators)                     # (B,) torch.long

The order is vLLM's: greedy rows take the argmax of the raw logits; the other rows go through
temperature -> min-p -> top-k -> top-p -> softmax -> one draw (the processors are lab 07's, released
in course.engine.logits). A row with a generator draws with it alone, so a seeded request gets the
same tokens whoever shares its batch.

What a server adds (optional fields whose defaults change nothing): `logit_bias`, then
`repetition_penalty`, `frequency_penalty` and `presence_penalty` (course.engine.penalties), applied
before everything above, greedy rows included, as vLLM does. The penalties read each row's prompt
and output token ids: `sample(logits, params, generators, history=[(prompt_ids, output_ids), ...])`.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

import torch

from course.engine.logits import apply_min_p, apply_temperature, apply_top_k, apply_top_p
from course.engine.penalties import apply_logit_bias, apply_penalties

# the server's fields and their "off" values; repr shows them only when they are on
_EXTRA = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": None}
_PENALTIES = (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0))


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (a small version of vLLM's SamplingParams)."""

    temperature: float = 1.0     # 0: greedy
    top_k: int = 0               # 0: off
    top_p: float = 1.0           # 1: off
    min_p: float = 0.0           # 0: off
    seed: int | None = None      # None: draw from torch's global generator
    repetition_penalty: float = 1.0                 # > 0; 1: off (vLLM's extension)
    frequency_penalty: float = 0.0                  # 0: off
    presence_penalty: float = 0.0                   # 0: off
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)   # token id -> added to its logit

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
        if not (isinstance(self.repetition_penalty, (int, float)) and 0 < self.repetition_penalty < math.inf):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number (0 = off), got {value!r}")
        if self.logit_bias is not None and not (isinstance(self.logit_bias, Mapping) and all(
                type(k) is int and k >= 0 and isinstance(v, (int, float)) and math.isfinite(v)
                for k, v in self.logit_bias.items())):
            raise ValueError("logit_bias must map token ids (ints >= 0) to finite numbers")

    def __repr__(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if f.name not in _EXTRA or getattr(self, f.name) != _EXTRA[f.name]]
        return f"SamplingParams({', '.join(shown)})"

    @property
    def penalized(self) -> bool:
        """True when a penalty is on (sample needs the row's token ids)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def generator(self, device: str | torch.device = "cpu") -> torch.Generator | None:
        """The request's own generator (seeded once, when the request starts), or None without a seed."""
        return None if self.seed is None else torch.Generator(device=device).manual_seed(self.seed)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None] | None = None, *,
           history: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None) -> torch.Tensor:
    """One token per row of logits (B, V): (B,) torch.long. Does not modify `logits`.
    history: (prompt ids, output ids) per row, needed only when a row has a penalty on."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a (B, V) tensor, got {getattr(logits, 'shape', type(logits).__name__)}")
    B = logits.shape[0]
    generators = [None] * B if generators is None else list(generators)
    if len(params) != B or len(generators) != B:
        raise ValueError(f"need one SamplingParams and one generator (or None) per row: B={B}, "
                         f"got {len(params)} params and {len(generators)} generators")
    z = logits.float()
    # read with getattr: lab 07 passes its own SamplingParams, which has none of the server's fields
    bias = [getattr(p, "logit_bias", None) for p in params]
    pens = [tuple(getattr(p, name, off) for name, off in _PENALTIES) for p in params]   # (repetition, frequency, presence)
    if any(bias):                                                                  # vLLM: bias, then penalties
        z = apply_logit_bias(z, bias)
    if any(pen != (1.0, 0.0, 0.0) for pen in pens):
        if history is None or len(history) != B:
            raise ValueError("a row has a penalty on: pass history=[(prompt_ids, output_ids)] with one pair per row")
        rep, freq, pres = zip(*pens)
        z = apply_penalties(z, [h[0] for h in history], [h[1] for h in history], rep, freq, pres)
    out = z.argmax(dim=-1)                                 # greedy rows: the argmax (bias and penalties included)
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
