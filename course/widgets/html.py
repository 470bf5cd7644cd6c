"""Small drawing helpers: each returns a self-contained HTML/SVG string.

Why strings: a widget state is drawn once, in Python, ahead of time, and shipped inside an
`ipywidgets.HTML`. The same string must look right in JupyterLab and in a static HTML page
with no kernel and no network, so everything here uses inline styles only: no external CSS,
no fonts to download, no <script>.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

FONT = "font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; font-size: 13px;"
MONO = "font-family: ui-monospace, 'DejaVu Sans Mono', Menlo, monospace;"

# Colour-blind friendly (Okabe-Ito), for states like waiting / prefill / decode / done.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#999999")

_VISIBLE_WHITESPACE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}


def show_token(text: str) -> str:
    """HTML-escaped token text with whitespace made visible (' the' -> '␣the').

    Tokens often start with a space or are a bare newline; drawn as-is they look identical to
    their neighbours or vanish entirely.
    """
    if text == "":
        return "<i>(empty)</i>"
    return escape("".join(_VISIBLE_WHITESPACE.get(ch, ch) for ch in text))


def bar_table(
    rows: Sequence[tuple[str, float]],
    *,
    max_value: float | None = None,
    value_format: str = "{:.3f}",
    color: str = PALETTE[0],
    bar_px: int = 260,
    label_html: bool = False,
) -> str:
    """A table of horizontal bars: label | bar | value, one row per (label, value).

    Bars are scaled to `max_value` (default: the largest value), so pass a fixed `max_value`
    (e.g. 1.0 for probabilities) when states must be comparable with each other.
    Labels are HTML-escaped with visible whitespace unless `label_html` says they already are HTML.
    """
    top = max_value if max_value is not None else max((v for _, v in rows), default=0.0)
    lines = []
    for label, value in rows:
        frac = 0.0 if top <= 0 else min(max(value / top, 0.0), 1.0)
        shown = label if label_html else show_token(label)
        lines.append(
            f'<tr><td style="text-align: right; white-space: pre; padding-right: 8px;">{shown}</td>'
            f'<td><div style="background: #eee; width: {bar_px}px; height: 14px;">'
            f'<div style="background: {color}; width: {frac * bar_px:.1f}px; height: 14px;"></div></div></td>'
            f'<td style="text-align: right; padding-left: 8px;">{escape(value_format.format(value))}</td></tr>'
        )
    return f'<table style="{MONO} font-size: 13px; border-collapse: collapse;">{"".join(lines)}</table>'


def legend(colors: Mapping[str, str]) -> str:
    """A one-line legend: a coloured square and the name of each state."""
    items = "".join(
        f'<span style="margin-right: 14px; white-space: nowrap;">'
        f'<span style="display: inline-block; width: 12px; height: 12px; background: {c}; '
        f'vertical-align: middle; margin-right: 4px;"></span>{escape(name)}</span>'
        for name, c in colors.items()
    )
    return f'<div style="{FONT} margin: 4px 0;">{items}</div>'


def cell_grid(
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    states: Sequence[Sequence[str | None]],
    colors: Mapping[str, str],
    *,
    text: Sequence[Sequence[str]] | None = None,
    cell_px: int = 18,
    label_px: int = 70,
    show_legend: bool = True,
) -> str:
    """An SVG grid of coloured cells, e.g. requests x engine steps coloured by request state.

    `states[r][c]` names the state of cell (r, c) (a key of `colors`) or is None for an empty
    cell. Optional `text[r][c]` is written inside the cell (e.g. a request id in a cache block).
    Every cell carries a <title>, so hovering shows row, column and state.
    """
    if len(states) != len(row_labels) or any(len(r) != len(col_labels) for r in states):
        raise ValueError("states must have one row per row label and one entry per column label")
    unknown = {s for r in states for s in r if s is not None} - set(colors)
    if unknown:
        raise ValueError(f"states use names missing from colors: {sorted(unknown)}")
    head_px = 16
    width = label_px + cell_px * len(col_labels) + 2
    height = head_px + cell_px * len(row_labels) + 2
    step = max(1, len(col_labels) // 20)  # label at most ~20 columns so labels never overlap
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'style="{FONT}" font-size="11">'
    ]
    for c, name in enumerate(col_labels):
        if c % step == 0:
            x = label_px + c * cell_px + cell_px / 2
            parts.append(f'<text x="{x:.1f}" y="12" text-anchor="middle" fill="#555">{escape(str(name))}</text>')
    for r, name in enumerate(row_labels):
        y = head_px + r * cell_px
        parts.append(
            f'<text x="{label_px - 6}" y="{y + cell_px * 0.7:.1f}" text-anchor="end">{escape(str(name))}</text>'
        )
        for c, state in enumerate(states[r]):
            x = label_px + c * cell_px
            fill = colors[state] if state is not None else "#f4f4f4"
            tip = f"{name} · {col_labels[c]} · {state or 'empty'}"
            parts.append(
                f'<rect x="{x}" y="{y}" width="{cell_px - 1}" height="{cell_px - 1}" fill="{fill}">'
                f"<title>{escape(tip)}</title></rect>"
            )
            if text is not None and text[r][c]:
                parts.append(
                    f'<text x="{x + (cell_px - 1) / 2:.1f}" y="{y + cell_px * 0.68:.1f}" '
                    f'text-anchor="middle" font-size="9" fill="#fff">{escape(text[r][c])}</text>'
                )
    parts.append("</svg>")
    svg = "".join(parts)
    return f"<div>{legend(colors) if show_legend else ''}{svg}</div>"


def note(text: str) -> str:
    """A line of plain explanatory text under a drawing (escaped)."""
    return f'<div style="{FONT} margin: 6px 0; color: #333;">{escape(text)}</div>'
