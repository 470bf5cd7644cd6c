"""Fast checks of the widget pattern: states, front-end links, drawings, input errors."""
from __future__ import annotations

import math

import ipywidgets as widgets
import pytest
from ipywidgets.widgets.widget_link import Link

from course.widgets import MAX_STATES, bar_table, cell_grid, explorer, next_token_explorer, show_token

LOGITS = [4.0, 3.2, 2.5, 1.0, 0.3]
WORDS = [" the", " a", "\n", "cat", "<b>"]


def table(t: float) -> list[tuple[str, float]]:
    """softmax(LOGITS / t) as (word, probability) rows, like a student's top_k_table."""
    z = sum(math.exp(x / t) for x in LOGITS)
    return [(w, math.exp(x / t) / z) for w, x in zip(WORDS, LOGITS)]


def linked(link: Link) -> tuple[object, str, object, str]:
    (src, src_attr), (dst, dst_attr) = link.source, link.target
    return src, src_attr, dst, dst_attr


# --- explorer -----------------------------------------------------------------------------------

def test_explorer_draws_every_combination_once():
    calls = []

    def render(step: int, mode: str) -> str:
        calls.append((step, mode))
        return f"<p>{step}:{mode}</p>"

    w = explorer(render, {"step": [0, 1, 2, 3], "mode": ["fcfs", "sjf"]}, title="t")
    assert len(w.states) == 8 and len(calls) == 8 and len(set(calls)) == 8
    assert w.html_at(step=2, mode="sjf") == "<p>2:sjf</p>"
    assert w.shown_html() == "<p>0:fcfs</p>"  # the first combination is shown initially
    assert isinstance(w.controls["step"], widgets.SelectionSlider)
    assert isinstance(w.controls["mode"], widgets.ToggleButtons)


def test_explorer_links_each_control_to_every_stack_at_its_level():
    w = explorer(lambda a, b, c: f"{a}{b}{c}", {"a": [1, 2], "b": ["x", "y", "z"], "c": [0.5, 1.5]})
    assert len(w.states) == 12
    # stacks: 1 over a, 2 over b, 2*3 over c -> one jslink each, all on `index` -> `selected_index`
    assert len(w.links) == 1 + 2 + 6
    per_control = {name: 0 for name in w.names}
    for link in w.links:
        src, src_attr, dst, dst_attr = linked(link)
        assert isinstance(link, Link)  # jslink: runs in the front end, no kernel needed
        assert (src_attr, dst_attr) == ("index", "selected_index")
        assert isinstance(dst, widgets.Stack) and dst.selected_index == 0
        name = next(n for n, c in w.controls.items() if c is src)
        per_control[name] += 1
        assert len(dst.children) == len(w.options[w.names.index(name)])
    assert per_control == {"a": 1, "b": 2, "c": 6}
    assert any(linked(k)[0] is w.controls["a"] and linked(k)[2] is w.stack for k in w.links)


def test_explorer_picks_controls_by_value_type():
    long = [f"option number {i}" for i in range(8)]
    w = explorer(lambda n, s, l: "", {"n": [1, 2, 3], "s": ["a", "b"], "l": long}, labels={"n": "steps"})
    assert isinstance(w.controls["n"], widgets.SelectionSlider)
    assert w.controls["n"].description == "steps"
    assert isinstance(w.controls["s"], widgets.ToggleButtons)
    assert isinstance(w.controls["l"], widgets.Dropdown)


def test_explorer_rejects_bad_controls():
    with pytest.raises(ValueError, match="controls"):
        explorer(lambda: "", {})
    with pytest.raises(ValueError, match=r"controls\['a'\] is empty"):
        explorer(lambda a: "", {"a": []})
    with pytest.raises(ValueError, match="max_states"):
        explorer(lambda a, b: "", {"a": range(50), "b": range(41)})  # 2050 > 2000
    assert MAX_STATES == 2000
    with pytest.raises(ValueError, match="max_chars=100"):
        explorer(lambda a: "x" * 60, {"a": [1, 2]}, max_chars=100)
    with pytest.raises(TypeError, match="render"):
        explorer(lambda a: 3, {"a": [1]})


# --- drawing helpers ----------------------------------------------------------------------------

def test_show_token_escapes_and_shows_whitespace():
    assert show_token(" the") == "␣the"
    assert show_token("\n") == "↵"
    assert show_token("<b>&") == "&lt;b&gt;&amp;"


def test_cell_grid_is_self_contained_svg():
    html = cell_grid(["r0", "r1"], [0, 1, 2], [["wait", "run", None], ["run", "run", "done"]],
                     {"wait": "#999", "run": "#0072B2", "done": "#009E73"})
    assert html.count("<rect") == 6 and "<script" not in html and "http" not in html.replace("http://www.w3.org/2000/svg", "")
    with pytest.raises(ValueError, match="missing from colors"):
        cell_grid(["r0"], [0], [["oops"]], {"run": "#000"})


def test_bar_table_scales_to_max_value():
    html = bar_table([("a", 0.5)], max_value=1.0, bar_px=200)
    assert "width: 100.0px" in html and "0.500" in html


# --- next-token explorer ------------------------------------------------------------------------

def test_token_widget_draws_the_right_probabilities():
    w = next_token_explorer(table, prompt="Once upon a")
    assert len(w.states) == 8
    cold, hot = w.html_at(temperature=0.1), w.html_at(temperature=2.0)
    assert cold != hot
    for t, html in ((0.1, cold), (2.0, hot)):
        for word, p in table(t):
            assert f"{p:.3f}" in html
        assert f"top-5 hold {100 * sum(p for _, p in table(t)):.1f}% of the probability" in html
    assert "1.000" in cold and "0.396" in hot  # softmax(LOGITS / 2)[0]
    assert "␣the" in cold and "&lt;b&gt;" in cold and "<b>" not in cold.split("</table>")[0]
    assert "Once upon a" in cold


def test_token_widget_accepts_numpy_like_numbers():
    class Num:  # what float() accepts: NumPy scalars, 0-d tensors
        def __init__(self, x): self.x = x
        def __float__(self): return self.x

    w = next_token_explorer(lambda t: [("a", Num(0.75)), ("b", Num(0.25))], temperatures=[1.0])
    assert "0.750" in w.shown_html()


@pytest.mark.parametrize("temps, match", [
    ([], "temperatures is empty"),
    ([0.5, 0.0], "temperatures must be positive"),
    ([-1.0], "temperatures must be positive"),
    ([float("nan")], "temperatures must be positive"),
    (["hot"], "temperatures must hold numbers"),
    (0.5, "temperatures must be a sequence"),
    ([1.0, 1.0], "temperatures has duplicates"),
])
def test_token_widget_rejects_bad_temperatures(temps, match):
    with pytest.raises(ValueError, match=match):
        next_token_explorer(table, temperatures=temps)


@pytest.mark.parametrize("rows, match", [
    ([], "non-empty list"),
    (None, "non-empty list"),
    ([("a", 0.5, 1)], r"\(word, probability\) pairs"),
    ([(3, 0.5)], "words must be str"),
    ([("a", "high")], "probabilities must be numbers"),
    ([("a", 1.5)], r"outside \[0, 1\]"),
    ([("a", -0.1)], r"outside \[0, 1\]"),
    ([("a", 0.7), ("b", 0.6)], "sum to 1.3000"),
])
def test_token_widget_rejects_bad_tables(rows, match):
    with pytest.raises(ValueError, match=r"table_fn\(1\).*" + match):
        next_token_explorer(lambda t: rows, temperatures=[1.0])


def test_explorer_can_open_on_a_chosen_state():
    w = explorer(lambda step, mode: f"<p>{step}:{mode}</p>", {"step": [0, 1, 2], "mode": ["fcfs", "sjf"]},
                 initial={"mode": "sjf", "step": 2})
    assert w.shown_html() == "<p>2:sjf</p>"
    assert w.stack.selected_index == 2
    with pytest.raises(ValueError, match=r"initial\['mode'\]"):
        explorer(lambda mode: "", {"mode": ["a"]}, initial={"mode": "b"})
    with pytest.raises(ValueError, match="no control of that name"):
        explorer(lambda mode: "", {"mode": ["a"]}, initial={"speed": 1})


def test_token_widget_opens_at_temperature_one():
    w = next_token_explorer(lambda t: [("a", 0.5)], temperatures=[0.5, 1.0, 2.0])
    assert "(temperature 1)" in w.shown_html()
