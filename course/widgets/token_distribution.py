"""Next-token distribution explorer (lab 01): how temperature reshapes the top-k.

The student's own `top_k_table` drives it: for each temperature on the slider we call
`table_fn(temperature)` once, ahead of time, and draw its rows as bars on a fixed 0..1 scale,
so a low temperature shows one bar near full and a high one shows many short bars.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from html import escape

from .explorer import Explorer, explorer
from .html import FONT, MONO, bar_table, note

Row = tuple[str, float]
TEMPERATURES = (0.1, 0.3, 0.5, 0.7, 1.0, 1.3, 1.6, 2.0)
_SLACK = 1e-4  # float32 softmax rounding: probabilities may overshoot 1 by a hair


def next_token_explorer(
    table_fn: Callable[[float], list[Row]],
    temperatures: Sequence[float] = TEMPERATURES,
    prompt: str = "",
) -> Explorer:
    """A temperature slider over the top-k next tokens, drawn as probability bars.

    `table_fn(t)` returns the top-k rows `[(word, probability), ...]` at temperature `t`,
    e.g. `lambda t: top_k_table(logits, tokenizer, k=10, temperature=t)`.
    Raises ValueError naming `temperatures` or `table_fn` when an input is unusable.
    """
    temps = _check_temperatures(temperatures)
    tables = {t: _check_table(table_fn(t), t) for t in temps}

    def render(temperature: float) -> str:
        rows = tables[temperature]
        mass = sum(p for _, p in rows)
        head = (
            f'<div style="{FONT} margin: 4px 0;">prompt: <span style="{MONO}">{escape(prompt)}</span></div>'
            if prompt else ""
        )
        summary = f"top-{len(rows)} hold {100 * mass:.1f}% of the probability (temperature {temperature:g})"
        return head + bar_table(rows, max_value=1.0) + note(summary)

    start = {"temperature": 1.0} if 1.0 in temps else None  # open on the model's own distribution
    return explorer(render, {"temperature": temps}, title="Next-token distribution", initial=start)


def _check_temperatures(temperatures: Sequence[float]) -> list[float]:
    if isinstance(temperatures, (str, bytes)) or not isinstance(temperatures, Sequence):
        raise ValueError(f"temperatures must be a sequence of numbers, got {type(temperatures).__name__}")
    if len(temperatures) == 0:
        raise ValueError("temperatures is empty: give at least one temperature, e.g. (0.5, 1.0, 2.0)")
    temps = []
    for t in temperatures:
        if not isinstance(t, numbers.Real) or isinstance(t, bool):
            raise ValueError(f"temperatures must hold numbers, got {t!r}")
        if not (math.isfinite(t) and t > 0):
            raise ValueError(f"temperatures must be positive and finite, got {t!r} (divide by 0 otherwise)")
        temps.append(float(t))
    if len(set(temps)) != len(temps):
        raise ValueError(f"temperatures has duplicates: {list(temperatures)}")
    return temps


def _check_table(rows: object, temperature: float) -> list[Row]:
    """The rows as (str, float) pairs, or a ValueError that says what table_fn got wrong."""
    where = f"table_fn({temperature:g})"
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence) or len(rows) == 0:
        raise ValueError(f"{where} must return a non-empty list of (word, probability) pairs, got {rows!r:.80}")
    out = []
    for row in rows:
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) != 2:
            raise ValueError(f"{where} rows must be (word, probability) pairs, got {row!r:.80}")
        word, p = row
        if not isinstance(word, str):
            raise ValueError(f"{where} words must be str (decode the token id), got {word!r:.80}")
        try:
            p = float(p)  # accepts Python, NumPy and 0-d torch numbers
        except (TypeError, ValueError):
            raise ValueError(f"{where} probabilities must be numbers, got {p!r:.80}") from None
        if not (0.0 <= p <= 1.0 + _SLACK):
            raise ValueError(f"{where} gave probability {p} for {word!r}: outside [0, 1]")
        out.append((word, min(p, 1.0)))
    if sum(p for _, p in out) > 1.0 + _SLACK:
        raise ValueError(f"{where} probabilities sum to {sum(p for _, p in out):.4f} > 1: softmax over all tokens first")
    return out
