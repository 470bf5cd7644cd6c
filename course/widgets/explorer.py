"""`explorer()`: the one pattern every course widget follows.

A course widget must work twice: live in JupyterLab, and in the static HTML of an executed
notebook, where there is no kernel. In static HTML Python callbacks are frozen; only links made
in the front end (`widgets.jslink`) still run. So nothing is computed when a control moves:

1. `render(**values)` draws every combination of control values ahead of time, as an HTML string;
2. the drawings sit in nested `ipywidgets.Stack`s: the outer stack has one child per value of the
   first control, each child is a stack over the second control, and so on down to the drawings;
3. each control's `index` is jslinked to the `selected_index` of every stack at its level.

Moving a control then only changes which child a stack shows, and the browser does that alone.
The cost is one drawing per combination, hence the `max_states` limit.
"""
from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from html import escape
from typing import Any

import ipywidgets as widgets
from ipywidgets.widgets.widget_link import Link  # what jslink returns

MAX_STATES = 2000  # each state is an HTML string saved in the notebook; keep pages light
MAX_CHARS = 20_000_000  # all states together; a notebook much bigger than this is slow to open


class Explorer(widgets.VBox):
    """What `explorer()` returns: a VBox (title, controls, stacks) that also keeps its parts.

    The extra attributes are Python-only (the front end sees a plain VBox); tests and lab code
    use them to look at a state without a browser.
    """

    def __init__(self, children, *, names, options, controls, states, links, stack):
        super().__init__(children)
        self.names: list[str] = names
        self.options: list[list[Any]] = options
        self.controls: dict[str, widgets.ValueWidget] = controls
        self.states: dict[tuple[int, ...], widgets.HTML] = states
        self.links: list[Link] = links
        self.stack: widgets.Stack = stack

    def html_at(self, **values: Any) -> str:
        """The drawing shown when each control is set to the given value."""
        key = tuple(self.options[i].index(values[name]) for i, name in enumerate(self.names))
        return self.states[key].value

    def shown_html(self) -> str:
        """The drawing shown for the controls' current positions (as the kernel knows them)."""
        return self.states[tuple(self.controls[n].index for n in self.names)].value


def explorer(
    render: Callable[..., str],
    controls: Mapping[str, Sequence[Any]],
    title: str = "",
    labels: Mapping[str, str] | None = None,
    *,
    initial: Mapping[str, Any] | None = None,
    max_states: int = MAX_STATES,
    max_chars: int = MAX_CHARS,
) -> Explorer:
    """A widget that shows `render(**values)` for the values picked on one control per key.

    `controls` maps each keyword of `render` to the values it can take, in order; the first
    combination is shown initially unless `initial` maps some keywords to the values to start
    at. `labels` optionally maps a keyword to the control's caption.
    Numbers get a slider, a few short choices get toggle buttons, anything else a dropdown.
    `render` is called once per combination (at most `max_states`) and must return HTML;
    all drawings together may hold at most `max_chars` characters (they are saved in the notebook).
    """
    if not isinstance(controls, Mapping) or not controls:
        raise ValueError("controls must be a non-empty dict of name -> sequence of values")
    names = list(controls)
    options = [list(controls[n]) for n in names]
    for name, opts in zip(names, options):
        if not opts:
            raise ValueError(f"controls[{name!r}] is empty: give it at least one value")
        if len({_label(v) for v in opts}) != len(opts):
            raise ValueError(f"controls[{name!r}] has duplicate values: {opts}")
    n_states = math.prod(len(o) for o in options)
    if n_states > max_states:
        sizes = " x ".join(str(len(o)) for o in options)
        raise ValueError(
            f"controls give {sizes} = {n_states} states, more than max_states={max_states}: "
            "use fewer values per control (every state is drawn ahead of time and saved)"
        )
    labels = dict(labels or {})
    start = [0] * len(names)
    for name, value in dict(initial or {}).items():
        if name not in names:
            raise ValueError(f"initial[{name!r}]: no control of that name; controls are {names}")
        if value not in options[names.index(name)]:
            raise ValueError(f"initial[{name!r}] = {value!r} is not one of controls[{name!r}]")
        start[names.index(name)] = options[names.index(name)].index(value)
    # Draw everything first, so a failing render leaves no half-built widgets in the kernel.
    drawings: dict[tuple[int, ...], str] = {}
    total_chars = 0
    for key in itertools.product(*(range(len(o)) for o in options)):
        html = render(**{n: options[i][j] for i, (n, j) in enumerate(zip(names, key))})
        if not isinstance(html, str):
            raise TypeError(f"render must return an HTML str, got {type(html).__name__}")
        total_chars += len(html)
        if total_chars > max_chars:
            raise ValueError(
                f"render drew more than max_chars={max_chars} characters over {len(drawings) + 1} of "
                f"{n_states} states: draw less per state (e.g. fewer SVG elements) or use fewer states"
            )
        drawings[key] = html

    control_widgets = {n: _control(labels.get(n, n), o, i0) for n, o, i0 in zip(names, options, start)}
    states = {key: widgets.HTML(html) for key, html in drawings.items()}
    links: list[Link] = []

    def build(level: int, chosen: tuple[int, ...]) -> widgets.Widget:
        """The stack over control `level` given the earlier choices, or the drawing at the bottom."""
        if level == len(names):
            return states[chosen]
        children = [build(level + 1, chosen + (j,)) for j in range(len(options[level]))]
        stack = widgets.Stack(children=children, selected_index=start[level])
        links.append(widgets.jslink((control_widgets[names[level]], "index"), (stack, "selected_index")))
        return stack

    stack = build(0, ())
    head = [widgets.HTML(f"<b>{escape(title)}</b>")] if title else []
    return Explorer(
        [*head, *control_widgets.values(), stack],
        names=names, options=options, controls=control_widgets,
        states=states, links=links, stack=stack,
    )


def _label(value: Any) -> str:
    """How a value is written on its control: floats compactly (0.7, not 0.7000000001)."""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _control(description: str, values: list[Any], index: int = 0) -> widgets.ValueWidget:
    """The control for one keyword; its `index` (an int) is what gets jslinked."""
    opts = [(_label(v), v) for v in values]
    common = dict(options=opts, index=index, description=description, style={"description_width": "initial"})
    numeric = all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values)
    if numeric and len(values) > 1:
        return widgets.SelectionSlider(**common, continuous_update=True, layout=widgets.Layout(width="440px"))
    if len(values) <= 6 and sum(len(label) for label, _ in opts) <= 60:
        return widgets.ToggleButtons(**common)
    return widgets.Dropdown(**common)
