"""Batch timeline (lab 04): which request does what at every engine step, for several schedules.

Rows are requests, columns are engine steps (one forward pass of the batch each). Schedules (e.g.
static and continuous batching) are drawn one above the other on the same step axis, so the
padding of a static batch and the refilled slots of a continuous one line up for comparison.
A step slider replays the schedules: cells after the chosen step are blank, and a line under each
grid says who is in the batch at that step and how many tokens it produced.

The trace format, written by the engines of lab 04:

    trace = [                           # one dict per engine step, in order
        {0: "prefill", 1: "prefill", 2: "waiting"},  # step 0: request id -> state
        {0: "decode", 1: "decode", 2: "waiting"},    # step 1
        {0: "padding", 1: "decode", 2: "waiting"},   # step 2: 0 is done but still holds its slot
        {2: "prefill"},                              # step 3: 0 and 1 have left the batch
        ...
    ]

Recorded states: "waiting" (arrived, not admitted; or admitted but left out of this step),
"chunk" (a piece of its prompt goes through the model, no token yet: chunked prefill, lab 11),
"prefill" (its prompt, or the prompt's last chunk, goes through the model and its first token comes
out), "decode" (one more token), "padding" (holds a slot and is computed, but is finished or a pad
row: wasted work). A request is absent before it arrives ("not arrived")
and after it leaves the batch ("done"); a gap in between is an error. Optional `times[t]`: seconds
from the start of the run to the end of step t, for latencies in seconds.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from html import escape

from .explorer import Explorer, explorer
from .html import FONT, MONO, legend

RECORDED = ("waiting", "chunk", "prefill", "decode", "padding")
COLORS = {
    "not arrived": "#EEEEEE",
    "waiting": "#E69F00",
    "chunk": "#56B4E9",
    "prefill": "#0072B2",
    "decode": "#009E73",
    "padding": "#D55E00",
    "done": "#C8C8C8",
}
WORKING = ("prefill", "decode")   # states that produce a new token
SLOTTED = ("prefill", "decode", "padding")   # states of a slot that computes one position (the bar under a grid)
MAX_SLIDER_STEPS = 120            # more steps than this: the slider moves several steps at a time


@dataclass(frozen=True)
class RequestStats:
    """When one request arrived, got its first token and left the batch (engine steps, inclusive)."""

    arrival: int              # first step it appears in (waiting or prefill)
    first_token: int          # its first prefill step
    last_token: int           # its last prefill or decode step
    finish: int               # last step it holds a slot: its response is complete after this step
    tokens: int               # new tokens it got (prefill and decode steps)
    latency_s: float | None   # end of step `finish` minus start of step `arrival`, if times were given
    ttft_s: float | None      # end of step `first_token` minus start of step `arrival`
    tpot_s: float | None      # mean time between its tokens: first to last token over (tokens - 1)

    @property
    def latency_steps(self) -> int:
        return self.finish - self.arrival + 1

    @property
    def ttft_steps(self) -> int:
        return self.first_token - self.arrival + 1


def timeline_stats(trace: Sequence[Mapping[Hashable, str]],
                   times: Sequence[float] | None = None) -> dict[Hashable, RequestStats]:
    """Per-request arrival, first token, finish and latency, read off a trace (see module doc)."""
    _check_trace(trace, "trace")
    if times is not None:
        _check_times(times, len(trace), "times")
    seen: dict[Hashable, list[int]] = {}
    for t, step in enumerate(trace):
        for rid in step:
            seen.setdefault(rid, []).append(t)
    stats = {}
    for rid, steps in seen.items():
        states = [trace[t][rid] for t in steps]
        first_token = steps[states.index("prefill")]
        last_token = max(t for t, s in zip(steps, states) if s in WORKING)
        arrival, finish, tokens = steps[0], steps[-1], sum(s in WORKING for s in states)
        start = (lambda t: 0.0 if t == 0 else float(times[t - 1])) if times is not None else None
        stats[rid] = RequestStats(
            arrival=arrival, first_token=first_token, last_token=last_token, finish=finish, tokens=tokens,
            latency_s=None if times is None else float(times[finish]) - start(arrival),
            ttft_s=None if times is None else float(times[first_token]) - start(arrival),
            tpot_s=None if times is None or tokens < 2 else
            (float(times[last_token]) - float(times[first_token])) / (tokens - 1),
        )
    return stats


def cell_states(trace: Sequence[Mapping[Hashable, str]], rids: Sequence[Hashable], n_steps: int) -> list[list[str]]:
    """The drawn state of every (request, step) cell: recorded ones, then 'not arrived' before a
    request's first step and 'done' after its last (also past the end of a shorter trace)."""
    stats = timeline_stats(trace)
    grid = []
    for rid in rids:
        row = []
        for t in range(n_steps):
            if rid not in stats or t < stats[rid].arrival:
                row.append("not arrived")
            elif t > stats[rid].finish:
                row.append("done")
            else:
                row.append(trace[t][rid])
        grid.append(row)
    return grid


def batch_timeline(traces: Mapping[str, Sequence[Mapping[Hashable, str]]],
                   times: Mapping[str, Sequence[float]] | None = None,
                   title: str = "Batch timeline") -> Explorer:
    """Draw each schedule's trace as a requests x steps grid, stacked on one step axis, with a
    step slider (the drawing is precomputed per step, so it replays in static HTML too).

    `traces` maps a schedule name ("static", "continuous") to its trace; `times` optionally maps
    the same names to per-step end times in seconds. Raises ValueError naming what is malformed.
    """
    if not isinstance(traces, Mapping) or not traces:
        raise ValueError("traces must be a non-empty dict of schedule name -> trace (a list of step dicts)")
    times = dict(times or {})
    for name, trace in traces.items():
        _check_trace(trace, f"traces[{name!r}]")
        if name in times:
            _check_times(times[name], len(trace), f"times[{name!r}]")
    unknown = set(times) - set(traces)
    if unknown:
        raise ValueError(f"times has schedules that traces lacks: {sorted(map(str, unknown))}")
    rids = sorted({rid for trace in traces.values() for step in trace for rid in step}, key=_sort_key)
    n_steps = max(len(trace) for trace in traces.values())
    grids = {name: cell_states(trace, rids, n_steps) for name, trace in traces.items()}
    stats = {name: timeline_stats(trace, times.get(name)) for name, trace in traces.items()}
    every = math.ceil(n_steps / MAX_SLIDER_STEPS)
    steps = sorted(set(range(0, n_steps, every)) | {n_steps - 1})

    def render(step: int) -> str:
        parts = [legend(COLORS)]
        for name, trace in traces.items():
            parts.append(_schedule_html(name, trace, grids[name], stats[name], rids, n_steps, step))
        return "".join(parts)

    # open on the whole schedule; the slider replays it from step 0
    return explorer(render, {"step": steps}, title=title, labels={"step": "engine step"}, initial={"step": steps[-1]})


# --- drawing ---------------------------------------------------------------------------------------

def _schedule_html(name, trace, grid, stats, rids, n_steps, step) -> str:
    cell = max(4, min(16, 900 // max(n_steps, 1)))
    row_h, label_w, right_w, bar_h, head = 15, 56, 120, 22, 14
    width = label_w + cell * n_steps + right_w
    height = head + row_h * len(rids) + bar_h + 4
    top_busy = max(1, max((sum(s in SLOTTED for s in st.values()) for st in trace), default=1))
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="10" style="{FONT}">']
    tick = max(1, math.ceil(n_steps / 25 / 5) * 5) if n_steps > 25 else 1
    for t in range(0, n_steps, tick):
        svg.append(f'<text x="{label_w + t * cell + cell / 2:.1f}" y="10" text-anchor="middle" fill="#666">{t}</text>')
    for r, rid in enumerate(rids):
        y = head + r * row_h
        svg.append(f'<text x="{label_w - 5}" y="{y + row_h - 4}" text-anchor="end">req {escape(str(rid))}</text>')
        for state, t0, t1 in _runs(grid[r][: step + 1]):
            tip = f"request {rid}: steps {t0}-{t1 - 1}: {state}"
            svg.append(f'<rect x="{label_w + t0 * cell}" y="{y}" width="{(t1 - t0) * cell}" height="{row_h - 2}" '
                       f'fill="{COLORS[state]}"><title>{escape(tip)}</title></rect>')
        s = stats.get(rid)
        if s is not None and s.finish <= step:
            secs = f" · {s.latency_s:.2f} s" if s.latency_s is not None else ""
            svg.append(f'<text x="{label_w + n_steps * cell + 6}" y="{y + row_h - 4}" fill="#333">'
                       f'{s.latency_steps} steps{secs}</text>')
    # cell borders as one path, then a bar per step: how many slots were busy and how many of them produced a token
    grid_y, grid_h = head, row_h * len(rids)
    lines = "".join(f"M{label_w + t * cell} {grid_y}v{grid_h}" for t in range(1, step + 1) if cell >= 6)
    if lines:
        svg.append(f'<path d="{lines}" stroke="#fff" stroke-width="1"/>')
    base = grid_y + grid_h + bar_h
    busy = "".join(_bar(label_w + t * cell, base, cell, bar_h * sum(s in SLOTTED for s in trace[t].values()) / top_busy)
                   for t in range(min(step + 1, len(trace))))
    useful = "".join(_bar(label_w + t * cell, base, cell, bar_h * sum(s in WORKING for s in trace[t].values()) / top_busy)
                     for t in range(min(step + 1, len(trace))))
    svg.append(f'<path d="{busy}" fill="{COLORS["padding"]}"/><path d="{useful}" fill="#555"/>')
    svg.append(f'<text x="{label_w - 5}" y="{base - 4}" text-anchor="end" fill="#555">tokens</text>')
    x = label_w + (step + 1) * cell
    svg.append(f'<line x1="{x}" x2="{x}" y1="{head - 2}" y2="{base}" stroke="#000" stroke-width="1.5"/>')
    svg.append("</svg>")
    return (f'<div style="{FONT} margin-top: 10px;"><b>{escape(str(name))}</b> {escape(_summary(trace, stats))}</div>'
            + "".join(svg) + f'<div style="{MONO} font-size: 12px; color: #333;">{escape(_step_line(trace, step))}</div>')


def _runs(row: Sequence[str]) -> list[tuple[str, int, int]]:
    """[(state, first step, end step)] for each stretch of equal states, to draw one rect per stretch."""
    runs: list[tuple[str, int, int]] = []
    for t, state in enumerate(row):
        if runs and runs[-1][0] == state:
            runs[-1] = (state, runs[-1][1], t + 1)
        else:
            runs.append((state, t, t + 1))
    return runs


def _bar(x: float, base: float, w: float, h: float) -> str:
    return f"M{x} {base}h{w - 1}v{-h:.1f}h{1 - w}z" if h > 0 else ""


def _summary(trace, stats) -> str:
    tokens = sum(s.tokens for s in stats.values())
    slot_steps = sum(sum(s in SLOTTED for s in step.values()) for step in trace)
    lat = [s.latency_steps for s in stats.values()]
    text = f"· {len(trace)} steps · {tokens} tokens · mean latency {sum(lat) / len(lat):.1f} steps"
    secs = [s.latency_s for s in stats.values() if s.latency_s is not None]
    if secs:
        text += f" ({sum(secs) / len(secs):.2f} s)"
    if slot_steps:
        text += f" · {100 * tokens / slot_steps:.0f}% of busy slots made a token"
    return text


def _step_line(trace, step) -> str:
    if step >= len(trace):
        return f"step {step}: finished (this schedule took {len(trace)} steps)"
    now = trace[step]
    pick = lambda *states: [rid for rid in sorted(now, key=_sort_key) if now[rid] in states]  # noqa: E731
    line = f"step {step}: batch = {pick(*WORKING)}"
    if pick("padding"):
        line += f" + padding {pick('padding')}"
    if pick("chunk"):
        line += f" + prompt chunks {pick('chunk')}"
    line += f", tokens this step = {len(pick(*WORKING))}"
    if pick("waiting"):
        line += f", waiting = {pick('waiting')}"
    return line


def _sort_key(rid):
    return (0, rid, "") if isinstance(rid, (int, float)) else (1, 0, str(rid))


# --- checks ----------------------------------------------------------------------------------------

def _check_trace(trace, name: str) -> None:
    if isinstance(trace, (str, bytes, Mapping)) or not isinstance(trace, Sequence) or len(trace) == 0:
        raise ValueError(f"{name} must be a non-empty list with one dict per engine step, got {type(trace).__name__}")
    last_seen: dict[Hashable, int] = {}
    prefilled: set[Hashable] = set()
    for t, step in enumerate(trace):
        if not isinstance(step, Mapping):
            raise ValueError(f"{name}[{t}] must be a dict of request id -> state, got {type(step).__name__}")
        for rid, state in step.items():
            if state not in RECORDED:
                raise ValueError(f"{name}[{t}][{rid!r}] is {state!r}; a recorded state is one of {RECORDED} "
                                 "(leave a request out before it arrives and after it leaves)")
            if rid in last_seen and last_seen[rid] != t - 1:
                raise ValueError(f"{name}: request {rid!r} is missing from steps {last_seen[rid] + 1}..{t - 1} "
                                 "between its appearances: record it as 'waiting' while it waits")
            if state == "prefill":
                prefilled.add(rid)
            elif state in ("decode", "padding") and rid not in prefilled:
                raise ValueError(f"{name}[{t}][{rid!r}] is {state!r} before any 'prefill' step of that request")
            last_seen[rid] = t
    never = [rid for rid in last_seen if rid not in prefilled]
    if never:
        raise ValueError(f"{name}: requests {never} never get a 'prefill' step (every request needs one)")


def _check_times(times, n_steps: int, name: str) -> None:
    if isinstance(times, (str, bytes)) or not isinstance(times, Sequence) or len(times) != n_steps:
        got = len(times) if isinstance(times, Sequence) else type(times).__name__
        raise ValueError(f"{name} must hold one end time per step ({n_steps}), got {got}")
    if any(b < a for a, b in zip(times, times[1:])) or (n_steps and times[0] < 0):
        raise ValueError(f"{name} must be seconds since the start, non-decreasing")
