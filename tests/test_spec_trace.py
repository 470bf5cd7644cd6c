"""The speculative decoding trace widget (lab 08) without a browser: statistics, fates, drawing, bad traces."""
import math

import ipywidgets as widgets
import pytest

from course.widgets.spec_trace import COLORS, spec_trace, step_fates, trace_stats

WORDS = {1: "The", 2: " cat", 3: " sat", 4: " on", 5: " the", 6: " mat", 7: " dog", 8: ".", 9: " ran"}
decode = WORDS.__getitem__
# pass 1: 3 drafts, all accepted, bonus " the"; pass 2: " dog" rejected for " mat", " ran" discarded;
# pass 3: no drafts (prompt lookup found nothing), the target's "."
STEPS = [([2, 3, 4], 3, 5), ([7, 9], 0, 6), ([], 0, 8)]


def test_fates_of_one_step():
    assert step_fates([7, 9, 9], 0) == ["rejected", "discarded", "discarded"]
    assert step_fates([2, 3, 4], 3) == ["accepted"] * 3
    assert step_fates([2, 3, 4], 1) == ["accepted", "rejected", "discarded"]
    assert step_fates([], 0) == []


def test_stats_count_checked_drafts_only():
    st = trace_stats(STEPS)
    assert (st.steps, st.tokens, st.drafted, st.accepted, st.rejections) == (3, 6, 5, 3, 1)
    assert st.tokens_per_pass == pytest.approx(2.0)
    assert st.acceptance_rate == pytest.approx(3 / 4), "the discarded ' ran' was never checked: 3 of 4"
    first = trace_stats(STEPS, upto=1)
    assert first.tokens == 4 and first.acceptance_rate == 1.0
    assert math.isnan(trace_stats([([], 0, 8)]).acceptance_rate), "no draft checked: no rate"


def test_widget_replays_one_run_with_a_slider():
    w = spec_trace(STEPS, decode, prompt="Once:")
    assert list(w.controls) == ["step"] and isinstance(w.controls["step"], widgets.SelectionSlider)
    assert w.options[0] == [1, 2, 3] and w.controls["step"].index == 2, "opens on the whole run"
    last, first = w.html_at(step=3), w.html_at(step=1)
    assert "after 3 of 3 target passes" in last and "6 tokens, 2.00 tokens per pass" in last
    assert "3 of 5 drafts accepted, acceptance rate 75%" in last
    assert "after 1 of 3 target passes" in first and "acceptance rate 100%" in first
    assert "Once:" in first and "␣cat" in first, "the prompt and the tokens, whitespace made visible"
    assert "␣dog" not in first and "␣dog" in w.html_at(step=2), "a rejected draft shows at its own step"
    for fate in ("accepted", "rejected", "discarded", "correction"):
        assert COLORS[fate] in w.html_at(step=2), f"{fate} is drawn at pass 2"
    assert "background: " + COLORS["bonus"] in first, "pass 1 ends with a bonus token"
    assert "no draft" in last and "0/0 accepted" in last
    assert "(plain step)" in last and "(plain step)" not in first, \
        "a step with no draft is a plain decoding step: its token is neither a bonus nor a correction"


def test_several_runs_get_a_picker_and_shorter_runs_stop():
    short = [([2], 1, 3)]
    w = spec_trace({"draft": STEPS, "lookup": short}, decode)
    assert list(w.controls) == ["run", "step"] and isinstance(w.controls["run"], widgets.ToggleButtons)
    assert "after 1 of 1 target passes" in w.html_at(run="lookup", step=3), "past its end a run shows its last pass"
    assert "this run was done after 1 pass)" in w.html_at(run="lookup", step=3), "and says that it ended"
    assert "was done" not in w.html_at(run="draft", step=3), "a run at its own last pass has not ended early"
    assert "after 2 of 3 target passes" in w.html_at(run="draft", step=2)


def test_long_runs_thin_the_slider():
    steps = [([1, 2], 1, 3)] * 200
    w = spec_trace(steps, lambda t: "x")
    pos = w.options[0]
    assert len(pos) <= 61 and pos[0] == 1 and pos[-1] == 200


@pytest.mark.parametrize("steps, message", [
    ([], "non-empty list"),
    ({"a": []}, r"runs\['a'\] must be a non-empty list"),
    ([([1], 0)], r"must be a \(drafted, n_accepted, token\) tuple"),
    ([([1], 2, 3)], r"n_accepted must be an int in 0..1"),
    ([("ab", 0, 3)], "drafted must be a list of token ids"),
    ([([1], 0, "x")], "token must be an int token id"),
])
def test_bad_traces_say_what_is_wrong(steps, message):
    with pytest.raises(ValueError, match=message):
        spec_trace(steps, decode)


def test_decode_must_be_callable():
    with pytest.raises(TypeError, match="decode must map a token id"):
        spec_trace(STEPS, WORDS)
