"""Grammar-constrained generation, step by step (lab 13): the automaton's state, the tokens the mask
kept, and the token the model wanted, at every new token.

The trace format is what `course.structured.generate(..., trace=[])` records, one dict per new token:

    steps = [
        {"state": 0, "allowed": 2, "token": 5018, "wanted": None},      # written by jump-forward
        {"state": 8, "allowed": 29, "token": 392, "wanted": 392},       # the model's own top token
        {"state": 31, "allowed": 2, "token": 216, "wanted": 392},       # the mask overruled the model
        ...
    ]

and optionally "kept": a few of the allowed token ids (the widget lists them). A step slider replays
the generation: the text so far, each token coloured by how it was chosen, and the latest step's
state, mask size, kept tokens and the model's own wish.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from html import escape

from .explorer import Explorer, explorer
from .html import FONT, MONO, legend, show_token

COLORS = {
    "model's own choice": "#009E73",
    "mask overruled the model": "#D55E00",
    "jump-forward (no model step)": "#BBBBBB",
}
MAX_SLIDER_STEPS = 80   # more steps than this: the slider moves several steps at a time
KEPT_SHOWN = 12         # allowed tokens listed for the latest step
RECENT = 6              # steps listed in the table under the text


def step_kind(step: Mapping) -> str:
    """How a step's token was chosen: jump-forward, the model's own top token, or the mask's correction."""
    if step["wanted"] is None:
        return "jump-forward (no model step)"
    return "model's own choice" if step["wanted"] == step["token"] else "mask overruled the model"


def grammar_trace(steps: Sequence[Mapping], decode: Callable[[int], str], prompt: str = "",
                  title: str = "Constrained generation, step by step") -> Explorer:
    """A step slider over one constrained generation's trace. `decode(token_id)` gives a token's
    text. Precomputed, so it works in static HTML."""
    _check_steps(steps)
    if not callable(decode):
        raise TypeError(f"decode must map a token id to its text, got {type(decode).__name__}")
    every = math.ceil(len(steps) / MAX_SLIDER_STEPS)
    positions = sorted(set(range(1, len(steps) + 1, every)) | {len(steps)})
    text_of: dict[int, str] = {}

    def tok(t: int) -> str:
        if t not in text_of:
            text_of[t] = show_token(decode(int(t)))
        return text_of[t]

    return explorer(lambda step: _draw(steps, step, prompt, tok), {"step": positions}, title=title,
                    labels={"step": "token"}, initial={"step": len(steps)})


def _chip(text: str, kind: str, title: str) -> str:
    color = COLORS[kind]
    style = f"background: {color}33; border-bottom: 3px solid {color};"
    return f'<span title="{escape(title)}" style="{style} white-space: pre; padding: 0 1px; margin-right: 1px;">{text}</span>'


def _draw(steps: Sequence[Mapping], shown: int, prompt: str, tok) -> str:
    part = steps[:shown]
    kinds = [step_kind(s) for s in part]
    model_steps = sum(k != "jump-forward (no model step)" for k in kinds)
    overruled = sum(k == "mask overruled the model" for k in kinds)
    head = (f'<div style="{FONT} margin: 4px 0;"><b>token {shown} of {len(steps)}</b>: {model_steps} model steps, '
            f"{shown - model_steps} tokens by jump-forward, the mask overruled the model {overruled} time"
            f'{"s" * (overruled != 1)}</div>')
    text = [f'<span style="color: #888; white-space: pre-wrap;">{escape(prompt)}</span>'] if prompt else []
    text += [_chip(tok(s["token"]), k, f"token {i + 1}: state {s['state']}, {s['allowed']} allowed")
             for i, (s, k) in enumerate(zip(part, kinds))]
    body = f'<div style="{MONO} font-size: 13px; line-height: 1.9; max-width: 860px;">{"".join(text)}</div>'
    last = part[-1]
    kept = list(last.get("kept", []))[:KEPT_SHOWN]
    kept_html = " ".join(_chip(tok(t), "model's own choice" if t == last["token"] else "jump-forward (no model step)",
                               "allowed") for t in kept)
    more = last["allowed"] - len(kept)
    wanted = "<i>no model step</i>" if last["wanted"] is None else tok(last["wanted"])
    latest = (f'<div style="{FONT} margin-top: 6px;">state <b>{last["state"]}</b>: the mask keeps <b>{last["allowed"]}</b> '
              f'token{"s" * (last["allowed"] != 1)}{": " + kept_html if kept else ""}'
              f'{f" and {more} more" if kept and more > 0 else ""}<br>written: {tok(last["token"])} &nbsp; '
              f"the model wanted: {wanted}</div>")
    rows = []
    for i in range(max(0, shown - RECENT), shown):
        s, k = steps[i], step_kind(steps[i])
        w = "&mdash;" if s["wanted"] is None else tok(s["wanted"])
        rows.append(f'<tr><td style="padding-right: 10px; color: #666;">token {i + 1}</td>'
                    f'<td style="padding-right: 10px;">state {s["state"]}</td>'
                    f'<td style="padding-right: 10px; text-align: right;">{s["allowed"]} allowed</td>'
                    f'<td style="padding-right: 10px;">{_chip(tok(s["token"]), k, k)}</td>'
                    f'<td style="color: #666;">wanted {w}</td></tr>')
    table = f'<table style="{MONO} font-size: 12px; margin-top: 6px; border-collapse: collapse;">{"".join(rows)}</table>'
    return legend(COLORS) + head + body + latest + table


def _check_steps(steps) -> None:
    if isinstance(steps, (str, bytes, Mapping)) or not isinstance(steps, Sequence) or len(steps) == 0:
        raise ValueError("steps must be a non-empty list of dicts with state, allowed, token, wanted "
                         "(what course.structured.generate(..., trace=[]) records)")
    for i, s in enumerate(steps):
        if not isinstance(s, Mapping) or not {"state", "allowed", "token", "wanted"} <= set(s):
            raise ValueError(f"steps[{i}] must be a dict with keys state, allowed, token, wanted; got {s!r}")
        for key in ("state", "allowed", "token"):
            if not isinstance(s[key], int) or isinstance(s[key], bool):
                raise ValueError(f"steps[{i}][{key!r}] must be an int, got {s[key]!r}")
        if s["allowed"] < 1:
            raise ValueError(f"steps[{i}]['allowed'] must be >= 1 (the written token was allowed), got {s['allowed']}")
        if s["wanted"] is not None and (not isinstance(s["wanted"], int) or isinstance(s["wanted"], bool)):
            raise ValueError(f"steps[{i}]['wanted'] must be a token id or None, got {s['wanted']!r}")
