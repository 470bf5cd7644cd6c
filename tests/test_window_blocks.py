"""The window-blocks widget (lab 10) without a browser: what each row keeps, drawing per step, bad input."""
import ipywidgets as widgets
import pytest

from course.widgets.window_blocks import EVICTED, SINK, WINDOW, check_entry, window_blocks, window_stats

# block_size 2. Step 0: 5 tokens, nothing evicted yet. Step 1: 6 tokens; "window" has evicted L0.
# "window + sinks" keeps L0 (a sink) and has evicted L1.
TOKENS = ["The", " keeper", " lit", " the", " lamp"]
STEPS = [
    {"window": ([3, 1, 4], TOKENS, 0), "window + sinks": ([2, 0, 5], TOKENS, 1)},
    {"window": ([None, 1, 4], TOKENS + [" again"], 0), "window + sinks": ([2, None, 5], TOKENS + [" again"], 1)},
]


def test_window_stats_count_what_is_kept():
    s = window_stats(STEPS[1]["window"], 2)
    assert (s.kept_blocks, s.evicted_blocks, s.kept_tokens, s.tokens) == (2, 1, 4, 6)
    s = window_stats(STEPS[0]["window + sinks"], 2)
    assert (s.kept_blocks, s.evicted_blocks, s.kept_tokens, s.tokens) == (3, 0, 5, 5)


def test_widget_draws_kept_sink_and_evicted_blocks():
    w = window_blocks(STEPS, block_size=2, labels=["5 tokens", "6 tokens"], title="t")
    assert isinstance(w.controls["step"], widgets.SelectionSlider) and w.options[0] == [0, 1]
    assert w.controls["step"].index == 1, "opens on the last step"
    first, last = w.html_at(step=0), w.html_at(step=1)
    assert "step 1</b> · 6 tokens" in last
    assert "L0 evicted" in last and "L0 evicted" not in first
    assert "L0 &rarr; P2 · sink" in last and f"border:2px solid {SINK}" in last, "the sink block is marked"
    assert "L1 evicted" in last and f"1px dashed {EVICTED}" in last
    assert f"border:2px solid {WINDOW}" in last and "L2 &rarr; P4" in last
    assert "2 blocks in memory (4 slots) hold 4 of 6 tokens · evicted: 1 block" in last
    assert "␣keeper" in first, "token text shows its leading space"
    assert "sink (kept for good)" in first, "a legend names the colours"


def test_html_is_escaped():
    html = window_blocks([{"<w>": ([0], ["<b>", "&"], 0)}], 2).html_at(step=0)
    assert "&lt;w&gt;" in html and "&lt;b&gt;" in html and "<w>" not in html


@pytest.mark.parametrize("entry, message", [
    (([0], ["a"]), "triple"),
    ("abc", "triple"),
    (([0], "ab", 0), "must be lists"),
    (([0, 1], ["a"], 0), "need 1 table entries, got 2"),
    (([-1], ["a"], 0), "block ids"),
    ((["0"], ["a"], 0), "block ids"),
    (([1, 1], ["a", "b", "c"], 0), "appears twice"),
    (([0, 1], ["a", "b", "c"], 3), "sink blocks must be an int from 0 to 2"),
    (([None, 1], ["a", "b", "c"], 1), "cannot be evicted"),
    (([0, None], ["a", "b", "c"], 0), "cannot be evicted"),
])
def test_bad_entries_are_named(entry, message):
    with pytest.raises(ValueError, match=message):
        check_entry(entry, 2)


@pytest.mark.parametrize("steps, block_size, labels, message", [
    ([], 2, None, "non-empty list"),
    ({"a": ([0], ["x"], 0)}, 2, None, "non-empty list"),
    ([["x"]], 2, None, r"steps\[0\] must be a dict"),
    ([{"a": ([0], ["x"], 0)}], 0, None, "positive int"),
    ([{"a": ([0], ["x"], 0)}], 2, ["one", "two"], "one entry per step"),
    ([{"a": ([0, 1], ["x"], 0)}], 2, None, r"steps\[0\]\['a'\]"),
])
def test_bad_steps_are_named(steps, block_size, labels, message):
    with pytest.raises(ValueError, match=message):
        window_blocks(steps, block_size, labels=labels)
