"""Logit bias and repetition, frequency and presence penalties over a batch of logits, in vLLM's order.

    z = apply_logit_bias(logits, [{50256: -100.0}, None])            # token id -> a number added to its logit
    z = apply_penalties(z, prompts, outputs, repetition=[1.2, 1.0], frequency=[0.5, 0.0], presence=[0.0, 0.3])

They run before temperature, and before the greedy argmax too, so they change greedy text:

    repetition (vLLM's extension, > 0, 1 = off): every token seen in the prompt or the output so far
               has its logit divided by r when positive, multiplied by r when negative (CTRL's penalty);
    frequency  (OpenAI, [-2, 2], 0 = off): minus f times how often the token occurs in the output;
    presence   (OpenAI, [-2, 2], 0 = off): minus p once if the token occurs in the output at all.

Like lab 07's processors: logits in, new logits out (float32), the input never modified; settings
are one per row. `prompts[b]` and `outputs[b]` are row b's token ids.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["apply_logit_bias", "apply_penalties"]


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[Mapping[int, float] | None]) -> torch.Tensor:
    """Row b plus biases[b][token] at each token it names (None or {}: the row is unchanged)."""
    _check(logits, biases, "biases")
    z = logits.float().clone()
    for b, bias in enumerate(biases):
        if bias:
            if max(bias) >= z.shape[1] or min(bias) < 0:
                raise ValueError(f"row {b}: logit_bias names a token outside the vocabulary (0..{z.shape[1] - 1})")
            ids = torch.tensor(list(bias.keys()), dtype=torch.long, device=z.device)
            z[b, ids] += torch.tensor(list(bias.values()), dtype=z.dtype, device=z.device)
    return z


def apply_penalties(logits: torch.Tensor, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                    repetition: Sequence[float], frequency: Sequence[float], presence: Sequence[float]) -> torch.Tensor:
    """Repetition (prompt and output tokens), then frequency and presence (output tokens), per row."""
    for name, value in (("prompts", prompts), ("outputs", outputs), ("repetition", repetition),
                        ("frequency", frequency), ("presence", presence)):
        _check(logits, value, name)
    B, V = logits.shape
    dev = logits.device
    counts = torch.zeros(B, V, dtype=torch.float32, device=dev)            # output token counts, (B, V)
    seen = torch.zeros(B, V, dtype=torch.bool, device=dev)                 # in the prompt or the output
    for b in range(B):
        if outputs[b]:
            out = torch.as_tensor(list(outputs[b]), dtype=torch.long, device=dev)
            counts[b].index_add_(0, out, torch.ones(len(out), device=dev))
        if prompts[b] and repetition[b] != 1.0:
            seen[b, torch.as_tensor(list(prompts[b]), dtype=torch.long, device=dev)] = True
    seen |= counts > 0
    r = torch.as_tensor(repetition, dtype=torch.float32, device=dev)[:, None]       # (B, 1)
    z = logits.float()
    z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
    z = z - torch.as_tensor(frequency, dtype=torch.float32, device=dev)[:, None] * counts
    return z - torch.as_tensor(presence, dtype=torch.float32, device=dev)[:, None] * (counts > 0)


def _check(logits, values, name: str) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a (B, V) tensor, got {getattr(logits, 'shape', type(logits).__name__)}")
    if len(values) != logits.shape[0]:
        raise ValueError(f"{name} must hold one entry per row: {logits.shape[0]}, got {len(values)}")
