"""Distribution explorer (lab 07): which next tokens survive temperature, top-k and top-p.

The student's own processors drive it. `process(logits, temperature, top_k, top_p)` returns the
processed logits `(V,)` (removed tokens at -inf), and the widget calls it once per combination of
control values, ahead of time (see explorer.py). For each state it draws the most likely tokens
of the prompt: a light bar for the probability at that temperature before any truncation
(`process(logits, temperature, 0, 1.0)`), a dark bar for the renormalized probability of the
survivors, and a struck-through row for every token that was cut. A token survives when its
processed logit is finite, as in the lab's tests: at a low temperature a kept token's float32
probability can underflow to 0, and it was still not cut.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from html import escape

import torch

from .explorer import Explorer, explorer
from .html import FONT, MONO, PALETTE, note, show_token

TEMPERATURES = (0.3, 0.7, 1.0, 1.5, 2.0)
TOP_KS = (0, 50, 10, 3)          # 0: no top-k
TOP_PS = (1.0, 0.95, 0.8, 0.5)   # 1.0: no top-p
KEPT, BEFORE, CUT = PALETTE[0], "#c9d9ea", "#bbbbbb"


def survivors(process: Callable, logits: torch.Tensor, temperature: float, top_k: int, top_p: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(before, after, kept): probabilities `(V,)` at this temperature without truncation, and after
    it (renormalized over the tokens `process` keeps; 0 for the cut ones), and the bool mask `(V,)`
    of the kept tokens: those whose processed logit is finite. `kept` is read from the logits, not
    from `after > 0`, because a kept token's probability can underflow to 0 in float32."""
    before, _ = _probs(process(logits.clone(), temperature, 0, 1.0), "process(logits, temperature, 0, 1.0)")
    after, kept = _probs(process(logits.clone(), temperature, top_k, top_p),
                         f"process(logits, {temperature:g}, {top_k}, {top_p:g})")
    return before, after, kept


def sampling_explorer(
    logits: torch.Tensor,
    decode: Callable[[int], str],
    process: Callable,
    temperatures: Sequence[float] = TEMPERATURES,
    top_ks: Sequence[int] = TOP_KS,
    top_ps: Sequence[float] = TOP_PS,
    prompt: str = "",
    rows: int = 12,
) -> Explorer:
    """Sliders for temperature, top-k (0 = off) and top-p (1 = off) over one next-token distribution.

    `logits` (V,) are the model's scores for the token after `prompt`; `decode(token_id)` gives a
    token's text; `process(logits, temperature, top_k, top_p)` returns processed logits (V,).
    The `rows` most likely tokens are drawn (their order does not depend on temperature), plus one
    row for all the others together. `process` gets a fresh copy of the logits at every call.
    """
    logits = _check_logits(logits)
    V = logits.shape[0]
    temps = _check_values(temperatures, "temperatures", lambda t: t > 0, "positive")
    ks = _check_values(top_ks, "top_ks", lambda k: float(k).is_integer() and k >= 0, "integers >= 0 (0 = off)")
    ps = _check_values(top_ps, "top_ps", lambda p: 0 < p <= 1, "in (0, 1]")
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"rows must be an int >= 1, got {rows!r}")
    rows = min(rows, V)
    order = torch.argsort(logits, descending=True)[:rows].tolist()
    words = [decode(i) for i in order]
    shown = torch.zeros(V, dtype=torch.bool)
    shown[order] = True

    def render(temperature: float, top_k: int, top_p: float) -> str:
        before, after, kept = survivors(process, logits, temperature, int(top_k), top_p)
        lines = [_row(show_token(w), before[i].item(), after[i].item(), bool(kept[i])) for w, i in zip(words, order)]
        rest_before, rest_after = before[~shown].sum().item(), after[~shown].sum().item()
        n_rest_kept = int(kept[~shown].sum())
        if V > rows:
            label = f"<i>{V - rows:,} others ({n_rest_kept:,} kept)</i>"
            lines.append(_row(label, rest_before, rest_after, n_rest_kept > 0))
        mass = before[kept].sum().item()
        head = (f'<div style="{FONT} margin: 4px 0;">prompt: <span style="{MONO}">{escape(prompt)}</span></div>'
                if prompt else "")
        table = f'<table style="{MONO} font-size: 13px; border-collapse: collapse;">{"".join(lines)}</table>'
        summary = (f"{int(kept.sum()):,} of {V:,} tokens survive (temperature {temperature:g}, top-k "
                   f"{'off' if int(top_k) == 0 else int(top_k)}, top-p {top_p:g}); before truncation they held "
                   f"{100 * mass:.1f}% of the probability, so renormalizing multiplies each by {1 / mass:.2f}")
        key = (f'<div style="{FONT} margin: 4px 0; color: #333;">light bar: probability at this temperature, '
               f'before truncation · dark bar: after truncation, renormalized · grey, struck: cut</div>')
        return head + key + table + note(summary)

    start = {"temperature": 1.0} if 1.0 in temps else None
    return explorer(render, {"temperature": temps, "top_k": ks, "top_p": ps},
                    title="Which next tokens survive?",
                    labels={"temperature": "temperature", "top_k": "top-k (0 = off)", "top_p": "top-p (1 = off)"},
                    initial=start)


def _row(label_html: str, before: float, after: float, kept: bool, bar_px: int = 260) -> str:
    """label | light bar (before) with the dark bar (after) on top | 'before -> after' or 'cut'."""
    light = f'<div style="position: absolute; background: {BEFORE}; width: {min(before, 1) * bar_px:.1f}px; height: 14px;"></div>'
    dark = (f'<div style="position: absolute; background: {KEPT}; width: {min(after, 1) * bar_px:.1f}px; '
            f'height: 6px; top: 4px;"></div>') if kept else ""
    style = "" if kept else f"color: {CUT}; text-decoration: line-through;"
    value = f"{before:.3f} → {after:.3f}" if kept else f"{before:.3f} → cut"
    return (f'<tr style="{style}"><td style="text-align: right; white-space: pre; padding-right: 8px;">{label_html}</td>'
            f'<td><div style="position: relative; background: #f2f2f2; width: {bar_px}px; height: 14px;">{light}{dark}'
            f'</div></td><td style="text-align: right; padding-left: 8px; white-space: nowrap;">{escape(value)}</td></tr>')


def _probs(processed: object, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax, finite mask) of processed logits, checked: a (V,) or (1, V) float tensor with a
    finite maximum."""
    if not isinstance(processed, torch.Tensor) or not processed.is_floating_point():
        raise ValueError(f"{where} must return a float tensor of logits, got {type(processed).__name__}")
    z = processed.detach().float().cpu().reshape(-1)
    if not torch.isfinite(z.max()):
        raise ValueError(f"{where} removed every token (or returned NaN): at least one token must survive")
    if torch.isnan(z).any():
        raise ValueError(f"{where} returned NaN logits")
    return torch.softmax(z, dim=-1), torch.isfinite(z)


def _check_logits(logits: object) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor of shape (V,), got {type(logits).__name__}")
    z = logits.detach().float().cpu()
    if z.dim() == 2 and z.shape[0] == 1:
        z = z[0]
    if z.dim() != 1 or z.shape[0] < 2:
        raise ValueError(f"logits must have shape (V,) with V >= 2, got {tuple(logits.shape)}")
    if not torch.isfinite(z).all():
        raise ValueError("logits must be finite: pass the model's raw scores, before any truncation")
    return z


def _check_values(values: object, name: str, ok: Callable[[float], bool], what: str) -> list:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) == 0:
        raise ValueError(f"{name} must be a non-empty sequence of numbers")
    out = []
    for v in values:
        if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v) or not ok(v):
            raise ValueError(f"{name} must hold numbers {what}, got {v!r}")
        out.append(v)
    if len(set(out)) != len(out):
        raise ValueError(f"{name} has duplicates: {list(values)}")
    return out
