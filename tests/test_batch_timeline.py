"""The batch timeline widget (lab 04) without a browser: states, statistics, drawing, bad traces."""
import re

import ipywidgets as widgets
import pytest

from course.widgets.batch_timeline import COLORS, batch_timeline, cell_states, timeline_stats

# Two requests in a static batch of 2, then request 2, which arrived at step 1 and waited.
STATIC = [
    {0: "prefill", 1: "prefill"},
    {0: "decode", 1: "decode", 2: "waiting"},
    {0: "padding", 1: "decode", 2: "waiting"},
    {2: "prefill"},
    {2: "decode"},
]
# The same requests, continuously batched: 2 takes 0's slot as soon as 0 leaves.
CONTINUOUS = [
    {0: "prefill", 1: "prefill"},
    {0: "decode", 1: "decode", 2: "waiting"},
    {1: "decode", 2: "prefill"},
    {2: "decode"},
]
TIMES = [0.5, 0.7, 0.9, 1.4, 1.6]


def test_cell_states_fill_not_arrived_and_done():
    grid = cell_states(CONTINUOUS, [0, 1, 2], n_steps=6)
    assert grid == [
        ["prefill", "decode", "done", "done", "done", "done"],
        ["prefill", "decode", "decode", "done", "done", "done"],
        ["not arrived", "waiting", "prefill", "decode", "done", "done"],
    ]
    assert cell_states(STATIC, [0, 9], n_steps=2) == [["prefill", "decode"], ["not arrived", "not arrived"]]


def test_stats_in_steps_and_seconds():
    st = timeline_stats(STATIC, TIMES)
    assert (st[0].arrival, st[0].first_token, st[0].last_token, st[0].finish, st[0].tokens) == (0, 0, 1, 2, 2)
    assert st[0].latency_steps == 3, "a static request leaves with its batch: padding counts"
    assert st[0].latency_s == pytest.approx(0.9) and st[0].ttft_s == pytest.approx(0.5)
    assert st[0].tpot_s == pytest.approx(0.2)
    assert (st[2].arrival, st[2].first_token, st[2].finish, st[2].latency_steps, st[2].ttft_steps) == (1, 3, 4, 4, 3)
    assert st[2].latency_s == pytest.approx(1.6 - 0.5), "latency starts at the start of the arrival step"
    assert st[2].ttft_s == pytest.approx(1.4 - 0.5) and st[2].tpot_s == pytest.approx(0.2)
    cont = timeline_stats(CONTINUOUS)
    assert cont[2].latency_steps == 3 and cont[2].latency_s is None and cont[2].tpot_s is None
    one = timeline_stats([{0: "prefill"}], [0.1])[0]
    assert one.tokens == 1 and one.tpot_s is None, "one token: no gap between tokens to time"


def test_widget_draws_both_schedules_with_a_step_slider():
    w = batch_timeline({"static": STATIC, "continuous": CONTINUOUS}, times={"static": TIMES}, title="tiny")
    slider = w.controls["step"]
    assert isinstance(slider, widgets.SelectionSlider)
    assert w.options[0] == [0, 1, 2, 3, 4], "one slider position per step of the longer schedule"
    assert slider.index == 4 and w.stack.selected_index == 4, "opens on the whole schedule"
    full, first = w.html_at(step=4), w.html_at(step=0)
    assert full.count("<svg") == 2 and "static" in full and "continuous" in full
    for state, color in COLORS.items():
        if state != "not arrived":
            assert color in full, f"{state} is drawn in the full schedule"
    assert COLORS["padding"] in full and "step 4: batch = [2], tokens this step = 1" in full
    assert "step 4: finished (this schedule took 4 steps)" in full
    assert "step 1: batch = [0, 1], tokens this step = 2, waiting = [2]" in w.html_at(step=1)
    assert "step 2: batch = [1] + padding [0], tokens this step = 1, waiting = [2]" in w.html_at(step=2)
    # revealing: step 0 shows no decode yet, and no latency for unfinished requests
    assert COLORS["decode"] not in first.split("<svg")[1] and COLORS["decode"] in full.split("<svg")[1]
    assert "3 steps · 0.90 s" in full and "3 steps · 0.90 s" not in first
    assert "mean latency" in full and "88% of busy slots made a token" in full  # static: 7 tokens in 8 busy slot-steps
    assert len(re.findall(r"<title>request 0: steps 0-0: prefill</title>", full)) == 2


def test_long_traces_thin_the_slider():
    trace = [{0: "prefill"}] + [{0: "decode"}] * 299
    w = batch_timeline({"one": trace})
    steps = w.options[0]
    assert len(steps) <= 121 and steps[0] == 0 and steps[-1] == 299
    assert len(w.html_at(step=299)) < 30_000, "one rect per run of equal states keeps a drawing small"


@pytest.mark.parametrize("traces, message", [
    ({}, "non-empty dict"),
    ({"s": []}, r"traces\['s'\] must be a non-empty list"),
    ({"s": [{0: "prefill"}, [0]]}, r"traces\['s'\]\[1\] must be a dict"),
    ({"s": [{0: "prefill"}, {0: "running"}]}, r"traces\['s'\]\[1\]\[0\] is 'running'"),
    ({"s": [{0: "prefill"}, {}, {0: "decode"}]}, r"request 0 is missing from steps 1..1"),
    ({"s": [{0: "decode"}]}, r"'decode' before any 'prefill'"),
    ({"s": [{0: "waiting"}]}, r"never get a 'prefill'"),
])
def test_bad_traces_say_what_is_wrong(traces, message):
    with pytest.raises(ValueError, match=message):
        batch_timeline(traces)


def test_bad_times_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"times\['static'\] must hold one end time per step \(5\), got 2"):
        batch_timeline({"static": STATIC}, times={"static": [0.1, 0.2]})
    with pytest.raises(ValueError, match="non-decreasing"):
        timeline_stats(STATIC, [0.5, 0.4, 0.9, 1.4, 1.6])
    with pytest.raises(ValueError, match="times has schedules that traces lacks"):
        batch_timeline({"static": STATIC}, times={"other": TIMES})
