"""Window blocks (lab 10): which KV blocks a sliding window keeps, and which it has evicted, at
every step of a run.

One row per sequence (e.g. one per policy: "window" and "window + sinks"): its logical blocks in
order. A kept block is labelled with the physical block it sits in (`L5 -> P2`) and coloured as a
sink (kept for good) or as part of the window; an evicted block is grey and dashed, its tokens
faded: its physical block went back to the pool and may already hold newer tokens (watch the
physical ids come back). Each row says how many blocks and tokens are still in memory. A step
slider replays the run; every step is drawn ahead of time (see explorer.py), so it replays in
static HTML too.

The step format:

    steps = [
        {"window": ([None, 3, 0], token_texts, 0),          # name -> (table, tokens, sink blocks)
         "window + sinks": ([1, None, 2], token_texts, 1)},  # None marks an evicted block
        ...
    ]

A table holds exactly ceil(len(tokens) / block_size) entries, each a block id >= 0 or None; its
first `sink blocks` entries and its last entry are never None.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape

from .cache_blocks import _tokens_html
from .explorer import Explorer, explorer
from .html import FONT, MONO, legend

SINK = "#CC79A7"       # kept for good: the first blocks
WINDOW = "#0072B2"     # kept while inside the window
EVICTED = "#BBBBBB"    # freed: its physical block went back to the pool


@dataclass(frozen=True)
class WindowStats:
    """What one row keeps: blocks and tokens in memory, and blocks evicted so far."""

    kept_blocks: int
    evicted_blocks: int
    kept_tokens: int
    tokens: int


def check_entry(entry, block_size: int, name: str = "entry") -> None:
    """Raise ValueError naming what is wrong with one (table, tokens, sink blocks) entry."""
    if not (isinstance(entry, Sequence) and not isinstance(entry, str) and len(entry) == 3):
        raise ValueError(f"{name} must be a triple (block table, tokens, sink blocks)")
    table, tokens, sinks = entry
    if isinstance(table, str) or not isinstance(table, Sequence) or isinstance(tokens, str) \
            or not isinstance(tokens, Sequence):
        raise ValueError(f"{name}: the block table and the tokens must be lists")
    need = math.ceil(len(tokens) / block_size)
    if len(table) != need:
        raise ValueError(f"{name}: {len(tokens)} tokens in blocks of {block_size} need {need} table entries, "
                         f"got {len(table)}")
    kept = [b for b in table if b is not None]
    if any(type(b) is not int or b < 0 for b in kept):
        raise ValueError(f"{name}: table entries must be block ids (ints >= 0) or None (evicted), got {list(table)}")
    if len(set(kept)) != len(kept):
        raise ValueError(f"{name}: a physical block appears twice in one table: {list(table)}")
    if type(sinks) is not int or not 0 <= sinks <= len(table):
        raise ValueError(f"{name}: sink blocks must be an int from 0 to {len(table)}, got {sinks!r}")
    if any(b is None for b in table[:sinks]) or (table and table[-1] is None):
        raise ValueError(f"{name}: sink blocks and the last block (it holds the newest token) cannot be evicted: "
                         f"{list(table)}")


def window_stats(entry, block_size: int) -> WindowStats:
    """Blocks and tokens a row keeps in memory (evicted blocks are always full)."""
    table, tokens, _ = entry
    evicted = sum(b is None for b in table)
    return WindowStats(kept_blocks=len(table) - evicted, evicted_blocks=evicted,
                       kept_tokens=len(tokens) - evicted * block_size, tokens=len(tokens))


def window_blocks(steps: Sequence[Mapping], block_size: int, labels: Sequence[str] | None = None,
                  title: str = "Sliding-window KV blocks") -> Explorer:
    """The widget: a step slider over `steps` (see the module doc); `labels[t]` optionally says
    what step t is (e.g. "after 96 tokens"). Opens on the last step."""
    if type(block_size) is not int or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if isinstance(steps, Mapping) or not isinstance(steps, Sequence) or not steps:
        raise ValueError("steps must be a non-empty list with one dict (name -> entry) per step")
    for t, step in enumerate(steps):
        if not isinstance(step, Mapping):
            raise ValueError(f"steps[{t}] must be a dict of sequence name -> (block table, tokens, sink blocks)")
        for seq, entry in step.items():
            check_entry(entry, block_size, f"steps[{t}][{seq!r}]")
    if labels is not None and len(labels) != len(steps):
        raise ValueError(f"labels must have one entry per step ({len(steps)}), got {len(labels)}")

    def render(step: int) -> str:
        return _draw(steps[step], block_size, step, labels[step] if labels is not None else "")

    order = list(range(len(steps)))
    return explorer(render, {"step": order}, title=title, labels={"step": "step"}, initial={"step": order[-1]})


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


def _draw(step: Mapping, block_size: int, index: int, label: str) -> str:
    head = f'<div style="{FONT} margin:4px 0;"><b>step {index}</b>{escape(" · " + label) if label else ""}</div>'
    rows = []
    for seq, entry in step.items():
        table, tokens, sinks = entry
        stats = window_stats(entry, block_size)
        cells = []
        for i, b in enumerate(table):
            held = [str(t) for t in tokens[i * block_size:(i + 1) * block_size]]
            if b is None:
                tip = f"{seq}: logical block {i} evicted; its physical block went back to the pool"
                cells.append(f'<div title="{escape(tip)}" style="display:inline-block;vertical-align:top;margin:2px;'
                             f'padding:2px;border:1px dashed {EVICTED};background:#f6f6f6;opacity:0.55;">'
                             f'<div style="font-size:11px;color:#777;">L{i} evicted</div>'
                             f'<div style="{MONO} font-size:11px;color:#999;">{_tokens_html(held, block_size)}</div></div>')
                continue
            color, role = (SINK, "sink") if i < sinks else (WINDOW, "window")
            tip = f"{seq}: logical block {i} -> physical block {b} ({role}), {len(held)} of {block_size} slots"
            cells.append(f'<div title="{escape(tip)}" style="display:inline-block;vertical-align:top;margin:2px;'
                         f'padding:2px;border:2px solid {color};background:{color}22;">'
                         f'<div style="font-size:11px;color:#333;">L{i} &rarr; P{b}{" · sink" if i < sinks else ""}</div>'
                         f'<div style="{MONO} font-size:11px;">{_tokens_html(held, block_size)}</div></div>')
        summary = (f"{_blocks(stats.kept_blocks)} in memory ({stats.kept_blocks * block_size} slots) hold "
                   f"{stats.kept_tokens} of {stats.tokens} tokens · evicted: {_blocks(stats.evicted_blocks)}")
        rows.append(f'<div style="{FONT} margin:8px 0 2px;"><b>{escape(str(seq))}</b> · {escape(summary)}</div>'
                    f'<div style="{FONT}">{"".join(cells) or "<i>no blocks</i>"}</div>')
    return f'<div>{head}{legend({"sink (kept for good)": SINK, "window": WINDOW, "evicted": EVICTED})}{"".join(rows)}</div>'
