"""Speculative decoding trace (lab 08): what the draft proposed at every step, and what the target kept.

One step = one forward pass of the target. The trace format, written by lab 08's loop:

    steps = [                      # one tuple per step, in order
        ([464, 2068, 318], 2, 257),    # (drafted tokens, how many were accepted, the target's token)
        ([11, 290], 0, 13),            # rejected at once: the target's own token replaces the first draft
        ...
    ]

A step with n accepted keeps drafted[:n] and appends the target's token: a *bonus* token when
n == len(drafted) (every draft passed, so the target's extra row is free), otherwise a
*correction* (greedy) or *resample* drawn from max(0, p - q) (sampling). Drafts after the first
rejected one are *discarded* without being checked. A step with no draft at all (prompt lookup
found no match) is a *plain* decoding step: its token is neither a bonus nor a correction. A step slider replays the run: the text so far
and the latest steps, each draft coloured by its fate.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from html import escape

from .explorer import Explorer, explorer
from .html import FONT, MONO, legend, show_token

COLORS = {
    "accepted": "#009E73",
    "rejected": "#D55E00",
    "discarded": "#BBBBBB",
    "bonus": "#0072B2",
    "correction": "#E69F00",
    "plain step": "#DDDDDD",     # no draft: an ordinary decoding step
}
MAX_SLIDER_STEPS = 60   # more steps than this: the slider moves several steps at a time
RECENT = 8              # steps listed in the table under the text


@dataclass(frozen=True)
class TraceStats:
    """Counts over the first `steps` steps of a trace."""

    steps: int            # target forward passes
    tokens: int           # tokens produced (accepted drafts + one target token per step)
    drafted: int          # tokens the draft proposed
    accepted: int         # drafts the target accepted
    rejections: int       # steps that ended on a rejected draft

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over checked drafts (accepted + the first rejected of each step); drafts
        discarded after a rejection were never checked, so they do not count."""
        checked = self.accepted + self.rejections
        return self.accepted / checked if checked else math.nan


def trace_stats(steps: Sequence, upto: int | None = None) -> TraceStats:
    """Statistics of steps[:upto] (all steps when upto is None)."""
    _check_steps(steps, "steps")
    part = list(steps)[: len(steps) if upto is None else upto]
    return TraceStats(
        steps=len(part), tokens=sum(n + 1 for _, n, _ in part), drafted=sum(len(d) for d, _, _ in part),
        accepted=sum(n for _, n, _ in part), rejections=sum(n < len(d) for d, n, _ in part))


def target_kind(drafted: Sequence[int], n_accepted: int) -> str:
    """What the target's token of a step is: a bonus (every draft passed), a correction, or a plain step (no draft)."""
    return "plain step" if not drafted else "bonus" if n_accepted == len(drafted) else "correction"


def step_fates(drafted: Sequence[int], n_accepted: int) -> list[str]:
    """The fate of each drafted token of one step: accepted, then one rejected, then discarded."""
    return ["accepted" if i < n_accepted else "rejected" if i == n_accepted else "discarded"
            for i in range(len(drafted))]


def spec_trace(runs: Mapping[str, Sequence] | Sequence, decode: Callable[[int], str], prompt: str = "",
               title: str = "Speculative decoding, step by step") -> Explorer:
    """Draw one or several traces (a dict name -> steps, or one list of steps) with a run picker and a
    step slider. `decode(token_id)` gives a token's text. Precomputed, so it works in static HTML."""
    if not isinstance(runs, Mapping):
        runs = {"run": runs}
    if not runs:
        raise ValueError("runs must be a non-empty dict of run name -> steps (a list of (drafted, n, token))")
    for name, steps in runs.items():
        _check_steps(steps, f"runs[{name!r}]")
    if not callable(decode):
        raise TypeError(f"decode must map a token id to its text, got {type(decode).__name__}")
    names = list(runs)
    n_max = max(len(s) for s in runs.values())
    every = math.ceil(n_max / MAX_SLIDER_STEPS)
    positions = sorted(set(range(1, n_max + 1, every)) | {n_max})   # steps shown: 1 .. n_max
    text_of = {}

    def tok(t: int) -> str:
        if t not in text_of:
            text_of[t] = show_token(decode(int(t)))
        return text_of[t]

    def render(run: str, step: int) -> str:
        return _draw(runs[run], min(step, len(runs[run])), prompt, tok, ended=step > len(runs[run]))

    controls = {"run": names, "step": positions} if len(names) > 1 else {"step": positions}
    if len(names) == 1:
        only = names[0]
        return explorer(lambda step: render(only, step), controls, title=title,
                        labels={"step": "target pass"}, initial={"step": n_max})
    return explorer(render, controls, title=title, labels={"run": "drafter", "step": "target pass"},
                    initial={"step": n_max})


# --- drawing ---------------------------------------------------------------------------------------

def _chip(text: str, fate: str, title: str) -> str:
    style = {"accepted": f"border-bottom: 3px solid {COLORS['accepted']};",
             "rejected": f"background: {COLORS['rejected']}33; text-decoration: line-through; color: {COLORS['rejected']};",
             "discarded": f"color: {COLORS['discarded']}; text-decoration: line-through;",
             "bonus": f"background: {COLORS['bonus']}; color: #fff;",
             "correction": f"background: {COLORS['correction']}; color: #000;",
             "plain step": f"background: {COLORS['plain step']}; color: #000;"}[fate]
    return f'<span title="{escape(title)}" style="{style} white-space: pre; padding: 0 1px;">{text}</span>'


def _draw(steps, shown: int, prompt: str, tok, ended: bool = False) -> str:
    st = trace_stats(steps, shown)
    # `ended`: the slider is past this run's last pass (it goes as far as the longest run)
    note = f' <span style="color: #666;">(this run was done after {len(steps)} pass{"es" * (len(steps) != 1)})</span>' if ended else ""
    head = (f'<div style="{FONT} margin: 4px 0;"><b>after {st.steps} of {len(steps)} target passes</b>: '
            f"{st.tokens} tokens, {st.tokens_per_pass:.2f} tokens per pass, {st.accepted} of {st.drafted} drafts "
            f"accepted, acceptance rate {_pct(st.acceptance_rate)}{note}</div>")
    text = [f'<span style="color: #888; white-space: pre-wrap;">{escape(prompt)}</span>'] if prompt else []
    for i, (drafted, n, t) in enumerate(steps[:shown]):
        last = i == shown - 1
        for j, d in enumerate(drafted[:n]):
            text.append(_chip(tok(d), "accepted", f"pass {i + 1}: draft {j + 1} accepted"))
        if last:  # the latest step also shows what the target threw away
            for j, (d, fate) in enumerate(zip(drafted, step_fates(drafted, n))):
                if fate != "accepted":
                    text.append(_chip(tok(d), fate, f"pass {i + 1}: draft {j + 1} {fate}"))
        kind = target_kind(drafted, n)
        text.append(_chip(tok(t), kind, f"pass {i + 1}: the target's token ({kind})"))
    body = f'<div style="{MONO} font-size: 13px; line-height: 1.9; max-width: 860px;">{"".join(text)}</div>'
    rows = []
    for i in range(max(0, shown - RECENT), shown):
        drafted, n, t = steps[i]
        chips = " ".join(_chip(tok(d), f, f) for d, f in zip(drafted, step_fates(drafted, n))) or "<i>no draft</i>"
        kind = target_kind(drafted, n)
        rows.append(f'<tr><td style="padding-right: 10px; color: #666;">pass {i + 1}</td><td>{chips}</td>'
                    f'<td style="padding: 0 8px;">{n}/{len(drafted)} accepted &rarr; '
                    f'{_chip(tok(t), kind, kind)} <span style="color:#666">{kind}</span></td></tr>')
    table = f'<table style="{MONO} font-size: 12px; margin-top: 6px; border-collapse: collapse;">{"".join(rows)}</table>'
    return legend(COLORS) + head + body + table


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.0f}%"


# --- checks ----------------------------------------------------------------------------------------

def _check_steps(steps, name: str) -> None:
    if isinstance(steps, (str, bytes, Mapping)) or not isinstance(steps, Sequence) or len(steps) == 0:
        raise ValueError(f"{name} must be a non-empty list of (drafted, n_accepted, token) tuples")
    for i, s in enumerate(steps):
        if not (isinstance(s, Sequence) and len(s) == 3):
            raise ValueError(f"{name}[{i}] must be a (drafted, n_accepted, token) tuple, got {s!r}")
        drafted, n, t = s
        if isinstance(drafted, (str, bytes)) or not isinstance(drafted, Sequence):
            raise ValueError(f"{name}[{i}]: drafted must be a list of token ids, got {type(drafted).__name__}")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(drafted):
            raise ValueError(f"{name}[{i}]: n_accepted must be an int in 0..{len(drafted)} "
                             f"(the number of drafts), got {n!r}")
        if not isinstance(t, int) or isinstance(t, bool):
            raise ValueError(f"{name}[{i}]: token must be an int token id, got {t!r}")
