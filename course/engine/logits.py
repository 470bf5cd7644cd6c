"""Lab 07's logits processors, released: temperature, top-k, top-p and min-p over a batch of logits,
one setting per row. Lab 07's tests of its later problems (the sampler) run on these, so a mistake
in one processor costs only that processor's points; later labs may use them as they are.

    z = apply_temperature(logits, temperature)    # logits (B, V), temperature (B,) -> (B, V)
    z = apply_min_p(z, min_p)                     # vLLM's order: temperature, min-p, top-k, top-p
    z = apply_top_k(z, top_k)
    z = apply_top_p(z, top_p)
    probs = z.softmax(dim=-1)

Each is a logits processor: logits in, new logits out. A removed token gets -inf (probability 0
after the softmax; the survivors are renormalized), kept logits are unchanged, and the input is
never modified. Settings may be tensors or lists, one value per row.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["apply_temperature", "apply_top_k", "apply_top_p", "apply_min_p"]


def _per_row(logits: torch.Tensor, setting, name: str, dtype: torch.dtype) -> torch.Tensor:
    """`setting` as a (B,) tensor on the logits' device, after checking both shapes."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a (B, V) tensor, got {got}")
    s = torch.as_tensor(setting, dtype=dtype, device=logits.device)
    if s.shape != (logits.shape[0],):
        raise ValueError(f"{name} must hold one value per row: shape ({logits.shape[0]},), got {tuple(s.shape)}")
    return s


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Row b divided by temperature[b]; rows at temperature 0 (greedy: the sampler takes their argmax)
    are returned unchanged. A negative temperature raises ValueError."""
    t = _per_row(logits, temperature, "temperature", logits.dtype)
    if (t < 0).any():
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {t.tolist()}")
    return logits / torch.where(t == 0, torch.ones_like(t), t)[:, None]          # (B, V) / (B, 1)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Per row, -inf over every token below the top_k[b]-th largest logit: ties with it survive (so
    more than k tokens may). top_k[b] = 0 or >= V: the row is unchanged."""
    k = _per_row(logits, top_k, "top_k", torch.long)
    V = logits.shape[-1]
    k = torch.where((k <= 0) | (k > V), torch.full_like(k, V), k)               # off: keep all V
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])   # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Per row, keep the most probable tokens until their mass reaches top_p[b]: a token survives if
    the tokens ranked above it hold less than top_p[b] (so the token that crosses p is kept, and the
    top token always is). top_p[b] = 1: unchanged. top_p outside (0, 1] raises ValueError."""
    p = _per_row(logits, top_p, "top_p", torch.float32)
    if ((p <= 0) | (p > 1)).any():
        raise ValueError(f"top_p must be in (0, 1], got {p.tolist()}")
    sorted_probs, order = logits.float().softmax(dim=-1).sort(dim=-1, descending=True)   # (B, V)
    above = sorted_probs.cumsum(dim=-1) - sorted_probs                          # mass ranked above each token
    drop = (above >= p[:, None]) & (p[:, None] < 1)                             # top_p = 1 drops nothing
    drop[:, 0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Per row, -inf over every token less than min_p[b] times as probable as the row's top token.
    min_p[b] = 0: unchanged. min_p outside [0, 1] raises ValueError."""
    m = _per_row(logits, min_p, "min_p", torch.float32)
    if ((m < 0) | (m > 1)).any():
        raise ValueError(f"min_p must be in [0, 1], got {m.tolist()}")
    probs = logits.float().softmax(dim=-1)                                      # (B, V)
    return logits.masked_fill(probs < m[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
