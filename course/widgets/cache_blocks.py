"""Cache blocks (lab 05): each sequence's logical KV blocks, the physical blocks they map to, and
the tokens those blocks hold, at every step of an engine's run.

Left, one row per sequence: its logical blocks in order, each labelled with the physical block it
sits in (`L1 -> P7`) and the tokens it holds. Right, the pool: every physical block, coloured by
its owner, free ones grey, shared ones (reference count > 1, e.g. a prompt shared by parallel
samples) with a thick border and `x2`. A step slider replays the run; the drawing of every step is
made ahead of time (see explorer.py), so it replays in static HTML too.

The snapshot format, one per step:

    snapshots = [
        {"req 0": ([7, 1], ["Four", " score", " and", " seven", " years"])},   # step 0: name -> (block table, tokens)
        {"req 0": ([7, 1], [...]), "req 1": ([7, 4], [...])},                  # step 1: req 1 shares block 7
    ]

A table must hold exactly ceil(len(tokens) / block_size) blocks, each in range(n_blocks).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape

from .explorer import Explorer, explorer
from .html import FONT, MONO, PALETTE, show_token

FREE = "#EEEEEE"
PER_ROW = 8            # physical blocks per row of the pool


@dataclass(frozen=True)
class BlockStats:
    """What one snapshot holds: blocks in use, shared blocks, tokens, and the slots they occupy."""

    used_blocks: int      # physical blocks mapped by at least one sequence
    shared_blocks: int    # physical blocks mapped by two sequences or more
    tokens: int           # tokens over all sequences (a shared block's tokens count once per sequence)
    stored_tokens: int    # token slots actually filled in the pool (shared blocks count once)
    slots: int            # token slots of the used blocks

    @property
    def waste(self) -> float:
        """Fraction of the used blocks' slots that hold no token (the partly filled last blocks)."""
        return 1 - self.stored_tokens / self.slots if self.slots else 0.0


def check_snapshot(snapshot: Mapping, block_size: int, n_blocks: int, name: str = "snapshot") -> None:
    if not isinstance(snapshot, Mapping):
        raise ValueError(f"{name} must be a dict of sequence name -> (block table, tokens), got {type(snapshot).__name__}")
    for seq, entry in snapshot.items():
        if not (isinstance(entry, Sequence) and len(entry) == 2):
            raise ValueError(f"{name}[{seq!r}] must be a pair (block table, tokens)")
        table, tokens = entry
        if any(not isinstance(b, int) or not 0 <= b < n_blocks for b in table):
            raise ValueError(f"{name}[{seq!r}]: block ids must be ints in 0..{n_blocks - 1}, got {list(table)}")
        if len(set(table)) != len(table):
            raise ValueError(f"{name}[{seq!r}]: a block appears twice in one table: {list(table)}")
        need = math.ceil(len(tokens) / block_size)
        if len(table) != need:
            raise ValueError(f"{name}[{seq!r}]: {len(tokens)} tokens in blocks of {block_size} need {need} blocks, "
                             f"the table has {len(table)}")


def owners(snapshot: Mapping) -> dict[int, list]:
    """Physical block -> the sequences that map it, in snapshot order (its reference count is the length)."""
    out: dict[int, list] = {}
    for seq, (table, _) in snapshot.items():
        for b in table:
            out.setdefault(b, []).append(seq)
    return out


def block_stats(snapshot: Mapping, block_size: int) -> BlockStats:
    own = owners(snapshot)
    filled: dict[int, int] = {}
    for table, tokens in snapshot.values():
        for i, b in enumerate(table):
            filled[b] = max(filled.get(b, 0), min(block_size, len(tokens) - i * block_size))
    return BlockStats(used_blocks=len(own), shared_blocks=sum(len(o) > 1 for o in own.values()),
                      tokens=sum(len(t) for _, t in snapshot.values()), stored_tokens=sum(filled.values()),
                      slots=len(own) * block_size)


def cache_blocks(snapshots: Sequence[Mapping], block_size: int, n_blocks: int,
                 labels: Sequence[str] | None = None, title: str = "KV cache blocks") -> Explorer:
    """The widget: a step slider over `snapshots` (see the module doc), each drawn as logical
    blocks per sequence and the physical pool. `labels[t]` optionally says what step t did."""
    if not isinstance(block_size, int) or block_size < 1 or not isinstance(n_blocks, int) or n_blocks < 1:
        raise ValueError(f"block_size and n_blocks must be positive ints, got {block_size!r}, {n_blocks!r}")
    if isinstance(snapshots, Mapping) or not isinstance(snapshots, Sequence) or not snapshots:
        raise ValueError("snapshots must be a non-empty list with one dict per step")
    for t, snap in enumerate(snapshots):
        check_snapshot(snap, block_size, n_blocks, f"snapshots[{t}]")
    if labels is not None and len(labels) != len(snapshots):
        raise ValueError(f"labels must have one entry per snapshot ({len(snapshots)}), got {len(labels)}")
    names = []
    for snap in snapshots:
        names += [s for s in snap if s not in names]
    colors = {s: PALETTE[i % len(PALETTE)] for i, s in enumerate(names)}

    def render(step: int) -> str:
        snap = snapshots[step]
        label = labels[step] if labels is not None else ""
        return _draw(snap, block_size, n_blocks, colors, step, label)

    steps = list(range(len(snapshots)))
    # Open on the first step with the most blocks in use: the last step of a run is often an empty pool.
    busiest = max(steps, key=lambda t: (block_stats(snapshots[t], block_size).used_blocks, -t))
    return explorer(render, {"step": steps}, title=title, labels={"step": "engine step"}, initial={"step": busiest})


# --- drawing ---------------------------------------------------------------------------------------

def _tokens_html(tokens: Sequence[str], block_size: int) -> str:
    cells = [f'<span style="display:inline-block;min-width:10px;max-width:70px;overflow:hidden;'
             f'white-space:pre;margin:1px;padding:0 2px;background:#fff;border-radius:2px;">{show_token(str(t))}</span>'
             for t in tokens]
    cells += ['<span style="display:inline-block;width:10px;margin:1px;padding:0 2px;color:#bbb;">·</span>'] \
        * (block_size - len(tokens))
    return "".join(cells)


def _draw(snap: Mapping, block_size: int, n_blocks: int, colors: Mapping, step: int, label: str) -> str:
    own = owners(snap)
    stats = block_stats(snap, block_size)
    head = (f'<div style="{FONT} margin:4px 0;"><b>step {step}</b>{escape(" · " + label) if label else ""} · '
            f'{stats.used_blocks} of {n_blocks} blocks in use · {stats.shared_blocks} shared · '
            f'{stats.stored_tokens} tokens stored in {stats.slots} slots '
            f'({100 * stats.waste:.0f}% of reserved slots empty)</div>')
    # logical view: one row per sequence
    rows = []
    for seq, (table, tokens) in snap.items():
        cells = []
        for i, b in enumerate(table):
            held = list(tokens[i * block_size:(i + 1) * block_size])
            shared = len(own[b]) > 1
            border = "3px solid #000" if shared else f"1px solid {colors[seq]}"
            tip = f"{seq}: logical block {i} -> physical block {b}, {len(held)} of {block_size} slots" + \
                (f", shared by {len(own[b])} sequences" if shared else "")
            cells.append(f'<td title="{escape(tip)}" style="border:{border};background:{colors[seq]}22;padding:2px;'
                         f'vertical-align:top;"><div style="font-size:11px;color:#333;">L{i} &rarr; P{b}'
                         f'{" ×" + str(len(own[b])) if shared else ""}</div>'
                         f'<div style="{MONO} font-size:11px;">{_tokens_html(held, block_size)}</div></td>')
        name = (f'<td style="padding-right:6px;white-space:nowrap;"><span style="display:inline-block;width:10px;'
                f'height:10px;background:{colors[seq]};margin-right:4px;"></span>{escape(str(seq))}</td>')
        rows.append(f"<tr>{name}{''.join(cells) or '<td><i>no blocks</i></td>'}</tr>")
    logical = (f'<div style="{FONT}"><div style="color:#555;margin:4px 0;">Logical blocks (each sequence\'s view)</div>'
               f'<table style="border-collapse:separate;border-spacing:3px;">{"".join(rows)}</table></div>')
    # physical view: the pool
    first_tokens: dict[int, list] = {}
    for table, tokens in snap.values():
        for i, b in enumerate(table):
            first_tokens.setdefault(b, list(tokens[i * block_size:(i + 1) * block_size]))
    pool_rows = []
    for r in range(0, n_blocks, PER_ROW):
        cells = []
        for b in range(r, min(r + PER_ROW, n_blocks)):
            who = own.get(b, [])
            if not who:
                cells.append(f'<td title="physical block {b}: free" style="background:{FREE};padding:2px;'
                             f'min-width:40px;vertical-align:top;"><div style="font-size:11px;color:#999;">P{b} free</div></td>')
                continue
            shared = len(who) > 1
            tip = f"physical block {b}: ref count {len(who)}, used by {', '.join(map(str, who))}"
            border = "3px solid #000" if shared else "1px solid #999"
            cells.append(f'<td title="{escape(tip)}" style="background:{colors[who[0]]}33;border:{border};padding:2px;'
                         f'vertical-align:top;"><div style="font-size:11px;color:#333;">P{b} '
                         f'{escape(", ".join(map(str, who)))}{" · ref " + str(len(who)) if shared else ""}</div>'
                         f'<div style="{MONO} font-size:11px;">{_tokens_html(first_tokens[b], block_size)}</div></td>')
        pool_rows.append(f"<tr>{''.join(cells)}</tr>")
    physical = (f'<div style="{FONT}"><div style="color:#555;margin:8px 0 4px;">Physical blocks (the pool; '
                f'thick border: shared)</div><table style="border-collapse:separate;border-spacing:3px;">'
                f'{"".join(pool_rows)}</table></div>')
    return f'<div>{head}{logical}{physical}</div>'
