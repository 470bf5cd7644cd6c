"""What routing costs in quality: perplexity of the MoE model on the held-out text.

    nll = windowed_nll(model, ids)                       # (n - 1 - n_windows,) losses, float32
    table = perplexity_vs_k(model, ids, ks=(1, 2, 4, 8)) # {k: perplexity}; k = E is the dense model
    table = perplexity_vs_capacity(model, ids, k=2, factors=(1.0, 1.25, 2.0))

The text is scored in windows of `window` tokens, each its own sequence (positions from 0): the cost
of attention grows with the square of the length, and a 5,000-token pass of the course model takes
half a minute on two CPU cores where five 1,024-token windows take ten seconds. Every setting is
scored on the same windows, so the numbers compare. Capacity counts over the rows of one forward
(one window here), as an engine counts over the tokens of one batch.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from course.moe.moefy import moe_layers, set_top_k
from course.quant.perplexity import token_nll


def windowed_nll(model: nn.Module, ids: list[int], window: int = 1024) -> torch.Tensor:
    """Next-token losses of the text scored window by window, concatenated (float32, CPU)."""
    if type(window) is not int or window < 2:
        raise ValueError(f"window must be an int >= 2, got {window!r}")
    parts = [token_nll(model, ids[s:s + window]) for s in range(0, len(ids), window) if len(ids[s:s + window]) >= 2]
    if not parts:
        raise ValueError("ids must hold at least 2 tokens")
    return torch.cat(parts)


def _ppl(nll: torch.Tensor) -> float:
    return math.exp(float(nll.double().mean()))


def perplexity_vs_k(model: nn.Module, ids: list[int], ks=(1, 2, 4, 8), weighting: str = "ones",
                    window: int = 1024, dense_layers: tuple[int, ...] = ()) -> dict[int, float]:
    """{k: perplexity} with k experts per token in every layer but `dense_layers` (see set_top_k);
    the layers' knobs are restored after."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError("the model has no MoE layers: moefy(model) or load_moe(model) first")
    saved = [(m.top_k, m.weighting, m.capacity_factor) for m in layers]
    try:
        out = {}
        for k in ks:
            set_top_k(model, k, weighting=weighting, dense_layers=dense_layers)
            out[k] = _ppl(windowed_nll(model, ids, window))
        return out
    finally:
        for m, (k, w, cf) in zip(layers, saved):
            m.top_k, m.weighting, m.capacity_factor = k, w, cf


def perplexity_vs_capacity(model: nn.Module, ids: list[int], k: int = 2, factors=(1.0, 1.25, 2.0),
                           window: int = 1024, dense_layers: tuple[int, ...] = ()) -> dict[float, tuple[float, float]]:
    """{factor: (perplexity, share of pairs dropped)} at k experts per token (None: no capacity limit).
    Only the sparse layers count in the share dropped."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError("the model has no MoE layers: moefy(model) or load_moe(model) first")
    saved = [(m.top_k, m.capacity_factor, m.record) for m in layers]
    dropped = []
    hooks = [m.register_forward_hook(lambda mod, a, o: dropped.append(
        (int((~mod.last_keep).sum()), mod.last_keep.numel()) if mod.record and mod.last_keep is not None else (0, 0)))
        for m in layers]
    try:
        out = {}
        for f in factors:
            set_top_k(model, k, capacity_factor=f, dense_layers=dense_layers)
            for i, m in enumerate(layers):
                m.record = i not in dense_layers
            dropped.clear()
            ppl = _ppl(windowed_nll(model, ids, window))
            lost, total = map(sum, zip(*dropped))
            out[f] = (ppl, lost / max(total, 1))
        return out
    finally:
        for h in hooks:
            h.remove()
        for m, (k, cf, rec) in zip(layers, saved):
            m.top_k, m.capacity_factor, m.record = k, cf, rec
