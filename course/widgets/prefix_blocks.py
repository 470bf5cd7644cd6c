"""Prefix blocks (lab 09): which physical blocks each request uses, and which of them came from
the prefix cache instead of being computed.

Left, one row per request: its logical blocks in order, each labelled with its physical block
(`L1 -> P7`). Green blocks were found in the cache (no prefill for their tokens); blue ones were
computed by this request. A dashed border marks a partly filled last block, which is never shared.
Right, the pool: blocks in use (thick border and `ref n` when shared), blocks that hold cached
tokens but have no user (evictable, numbered in LRU order: 1 goes first), and empty free blocks.
A step slider replays the run; every step is drawn ahead of time (see explorer.py), so it replays
in static HTML too.

The step format:

    steps = [
        {"requests": {"req 0": ([3, 1, 4], token_texts, 0)},       # name -> (block table, tokens, cached blocks)
         "cached": []},                                            # evictable cached blocks, LRU first
        {"requests": {"req 1": ([3, 1, 6], token_texts, 2)},       # req 1 reused blocks 3 and 1
         "cached": [4]},                                           # req 0 left; its last block is evictable
    ]

The first `cached blocks` entries of a table are the cache hits; they must be full blocks.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

from .cache_blocks import FREE, PER_ROW, _tokens_html, check_snapshot, owners
from .explorer import Explorer, explorer
from .html import FONT, MONO

HIT = "#009E73"        # found in the cache: no prefill
COMPUTED = "#0072B2"   # computed by this request
EVICTABLE = "#B8E0D2"  # cached content, no user: the LRU queue


def check_step(step: Mapping, block_size: int, n_blocks: int, name: str = "step") -> None:
    """Raise ValueError naming what is wrong with one step (see the module doc for the format)."""
    if not isinstance(step, Mapping) or set(step) != {"requests", "cached"}:
        raise ValueError(f"{name} must be a dict with keys 'requests' and 'cached'")
    requests, cached = step["requests"], step["cached"]
    if not isinstance(requests, Mapping):
        raise ValueError(f"{name}['requests'] must be a dict of name -> (block table, tokens, cached blocks)")
    plain = {}
    for seq, entry in requests.items():
        if not (isinstance(entry, Sequence) and len(entry) == 3):
            raise ValueError(f"{name}['requests'][{seq!r}] must be a triple (block table, tokens, cached blocks)")
        table, tokens, hits = entry
        if not isinstance(hits, int) or not 0 <= hits <= len(table) or hits * block_size > len(tokens):
            raise ValueError(f"{name}['requests'][{seq!r}]: cached blocks must be an int from 0 to the number of "
                             f"full blocks ({len(tokens) // block_size}), got {hits!r}")
        plain[seq] = (table, tokens)
    check_snapshot(plain, block_size, n_blocks, f"{name}['requests']")
    if isinstance(cached, (str, bytes)) or not isinstance(cached, Sequence):
        raise ValueError(f"{name}['cached'] must be a list of block ids, least recently used first")
    used = owners(plain)
    for b in cached:
        if not isinstance(b, int) or not 0 <= b < n_blocks:
            raise ValueError(f"{name}['cached']: block ids must be ints in 0..{n_blocks - 1}, got {b!r}")
        if b in used:
            raise ValueError(f"{name}['cached']: block {b} is used by {used[b]}; an evictable block has no user")
    if len(set(cached)) != len(cached):
        raise ValueError(f"{name}['cached'] lists a block twice: {list(cached)}")


def reuse(step: Mapping, block_size: int) -> tuple[int, int]:
    """(tokens taken from the cache, tokens held) over the step's requests."""
    hit = sum(h * block_size for _, _, h in step["requests"].values())
    return hit, sum(len(t) for _, t, _ in step["requests"].values())


def prefix_blocks(steps: Sequence[Mapping], block_size: int, n_blocks: int,
                  labels: Sequence[str] | None = None, title: str = "Prefix-cached blocks") -> Explorer:
    """The widget: a step slider over `steps` (see the module doc). `labels[t]` says what step t did."""
    if not isinstance(block_size, int) or block_size < 1 or not isinstance(n_blocks, int) or n_blocks < 1:
        raise ValueError(f"block_size and n_blocks must be positive ints, got {block_size!r}, {n_blocks!r}")
    if isinstance(steps, Mapping) or not isinstance(steps, Sequence) or not steps:
        raise ValueError("steps must be a non-empty list with one dict per step")
    for t, step in enumerate(steps):
        check_step(step, block_size, n_blocks, f"steps[{t}]")
    if labels is not None and len(labels) != len(steps):
        raise ValueError(f"labels must have one entry per step ({len(steps)}), got {len(labels)}")

    def render(step: int) -> str:
        return _draw(steps[step], block_size, n_blocks, step, labels[step] if labels is not None else "")

    order = list(range(len(steps)))
    return explorer(render, {"step": order}, title=title, labels={"step": "engine step"}, initial={"step": order[0]})


# --- drawing ---------------------------------------------------------------------------------------

def _swatch(color: str, text: str, dashed: bool = False) -> str:
    border = "1px dashed #333" if dashed else "1px solid #999"
    return (f'<span style="margin-right:12px;white-space:nowrap;"><span style="display:inline-block;width:12px;'
            f'height:12px;background:{color};border:{border};vertical-align:middle;margin-right:4px;"></span>'
            f'{escape(text)}</span>')


def _draw(step: Mapping, block_size: int, n_blocks: int, t: int, label: str) -> str:
    requests, cached = step["requests"], list(step["cached"])
    own = owners({s: (tab, toks) for s, (tab, toks, _) in requests.items()})
    hit, held = reuse(step, block_size)
    head = (f'<div style="{FONT} margin:4px 0;"><b>step {t}</b>{escape(" · " + label) if label else ""} · '
            f'{len(own)} of {n_blocks} blocks in use · {sum(len(o) > 1 for o in own.values())} shared · '
            f'{len(cached)} cached and evictable · {hit} of {held} tokens came from the cache</div>')
    legend = (f'<div style="{FONT} margin:2px 0 6px;">{_swatch(HIT + "55", "from the cache (no prefill)")}'
              f'{_swatch(COMPUTED + "33", "computed by this request")}{_swatch("#fff", "partial block: never shared", True)}'
              f'{_swatch(EVICTABLE, "cached, no user (LRU order)")}{_swatch(FREE, "empty")}</div>')
    rows = []
    for seq, (table, tokens, hits) in requests.items():
        cells = []
        for i, b in enumerate(table):
            held_tokens = list(tokens[i * block_size:(i + 1) * block_size])
            from_cache, shared, partial = i < hits, len(own[b]) > 1, len(held_tokens) < block_size
            color = HIT + "55" if from_cache else COMPUTED + "33"
            border = "3px solid #000" if shared else ("1px dashed #333" if partial else "1px solid #999")
            tip = (f"{seq}: logical block {i} -> physical block {b}, "
                   f"{'from the cache' if from_cache else 'computed'}, {len(held_tokens)} of {block_size} slots"
                   + (f", shared by {len(own[b])} requests" if shared else ""))
            cells.append(f'<td title="{escape(tip)}" style="border:{border};background:{color};padding:2px;'
                         f'vertical-align:top;"><div style="font-size:11px;color:#333;">L{i} &rarr; P{b}'
                         f'{" · hit" if from_cache else ""}</div>'
                         f'<div style="{MONO} font-size:11px;">{_tokens_html(held_tokens, block_size)}</div></td>')
        name = f'<td style="padding-right:6px;white-space:nowrap;">{escape(str(seq))}<br>' \
               f'<span style="font-size:11px;color:#555;">{hits * block_size} of {len(tokens)} cached</span></td>'
        rows.append(f"<tr>{name}{''.join(cells) or '<td><i>no blocks</i></td>'}</tr>")
    logical = (f'<div style="{FONT}"><div style="color:#555;margin:4px 0;">Each request\'s blocks</div>'
               f'<table style="border-collapse:separate;border-spacing:3px;">'
               f'{"".join(rows) or "<tr><td><i>no running requests</i></td></tr>"}</table></div>')
    lru = {b: i + 1 for i, b in enumerate(cached)}
    pool_rows = []
    for r in range(0, n_blocks, PER_ROW):
        cells = []
        for b in range(r, min(r + PER_ROW, n_blocks)):
            who = own.get(b, [])
            if who:
                shared = len(who) > 1
                tip = f"physical block {b}: ref count {len(who)}, used by {', '.join(map(str, who))}"
                cells.append(f'<td title="{escape(tip)}" style="background:#fff;border:{"3px solid #000" if shared else "1px solid #999"};'
                             f'padding:2px 4px;font-size:11px;">P{b} · ref {len(who)}</td>')
            elif b in lru:
                cells.append(f'<td title="physical block {b}: cached tokens, no user; evicted {lru[b]}. when a block is needed" '
                             f'style="background:{EVICTABLE};border:1px solid #999;padding:2px 4px;font-size:11px;">'
                             f'P{b} · LRU {lru[b]}</td>')
            else:
                cells.append(f'<td title="physical block {b}: empty" style="background:{FREE};padding:2px 4px;'
                             f'font-size:11px;color:#999;">P{b} empty</td>')
        pool_rows.append(f"<tr>{''.join(cells)}</tr>")
    physical = (f'<div style="{FONT}"><div style="color:#555;margin:8px 0 4px;">The pool (thick border: shared; '
                f'LRU n: cached with no user, evicted n-th)</div><table style="border-collapse:separate;'
                f'border-spacing:3px;">{"".join(pool_rows)}</table></div>')
    return f"<div>{head}{legend}{logical}{physical}</div>"
