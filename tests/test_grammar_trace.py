"""The constrained-generation trace widget (lab 13) without a browser: kinds, drawing, bad traces."""
import ipywidgets as widgets
import pytest

from course.widgets import grammar_trace
from course.widgets.grammar_trace import step_kind

WORDS = {1: '{"', 2: "name", 3: '":', 4: ' "', 5: "Ada", 6: '"}', 7: "<end>", 8: " Bob"}
decode = WORDS.__getitem__
STEPS = [
    {"state": 0, "allowed": 2, "token": 1, "wanted": None},                       # jump-forward
    {"state": 2, "allowed": 4, "token": 2, "wanted": None},
    {"state": 6, "allowed": 29, "token": 4, "wanted": 4, "kept": [4, 5]},          # the model's own
    {"state": 10, "allowed": 48000, "token": 5, "wanted": 8, "kept": [5, 8, 6]},   # overruled
]


def test_kinds():
    assert [step_kind(s) for s in STEPS] == ["jump-forward (no model step)"] * 2 + \
        ["model's own choice", "mask overruled the model"]


def test_widget_replays_with_a_slider():
    w = grammar_trace(STEPS, decode, prompt="Describe Ada:")
    assert list(w.controls) == ["step"] and isinstance(w.controls["step"], widgets.SelectionSlider)
    assert w.options[0] == [1, 2, 3, 4] and w.controls["step"].index == 3, "opens on the whole generation"
    last, first = w.html_at(step=4), w.html_at(step=1)
    assert "token 4 of 4" in last and "2 model steps, 2 tokens by jump-forward" in last
    assert "overruled the model 1 time<" in last and "48000" in last and "and 47997 more" in last
    assert "␣Bob" in last, "the model's wish is shown"
    assert "token 1 of 4" in first and "no model step" in first and "Describe Ada:" in first


def test_long_traces_thin_the_slider():
    steps = [{"state": 0, "allowed": 3, "token": 5, "wanted": 5}] * 200
    w = grammar_trace(steps, decode)
    assert len(w.options[0]) <= 81 and w.options[0][-1] == 200


@pytest.mark.parametrize("bad", [[], "abc", [{"state": 0}], [{"state": 0, "allowed": 0, "token": 1, "wanted": None}],
                                 [{"state": 0, "allowed": 2, "token": "x", "wanted": None}],
                                 [{"state": 0, "allowed": 2, "token": 1, "wanted": 1.5}]])
def test_bad_traces_are_refused(bad):
    with pytest.raises(ValueError):
        grammar_trace(bad, decode)
    with pytest.raises(TypeError):
        grammar_trace(STEPS, "not callable")
