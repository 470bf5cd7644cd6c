"""The cache-blocks widget (lab 05) without a browser: statistics, drawing per step, shared blocks, bad input."""
import ipywidgets as widgets
import pytest

from course.widgets.cache_blocks import FREE, block_stats, cache_blocks, owners

# block_size 2. Step 0: "A" holds 3 tokens in blocks 4, 1. Step 1: "B" is a fork of "A" that has
# written its own 4th token: it shares block 4 (full) and copied block 1 into block 0.
STEPS = [
    {"A": ([4, 1], ["Four", " score", " and"])},
    {"A": ([4, 1], ["Four", " score", " and", " seven"]), "B": ([4, 0], ["Four", " score", " and", " eight"])},
]


def test_owners_and_stats():
    assert owners(STEPS[1]) == {4: ["A", "B"], 1: ["A"], 0: ["B"]}
    s0 = block_stats(STEPS[0], block_size=2)
    assert (s0.used_blocks, s0.shared_blocks, s0.tokens, s0.stored_tokens, s0.slots) == (2, 0, 3, 3, 4)
    assert s0.waste == pytest.approx(0.25), "one of 4 reserved slots is empty"
    s1 = block_stats(STEPS[1], block_size=2)
    assert (s1.used_blocks, s1.shared_blocks, s1.tokens, s1.stored_tokens, s1.slots) == (3, 1, 8, 6, 6)
    assert s1.waste == 0, "a shared block's tokens are stored once"
    assert block_stats({}, 4).waste == 0


def test_widget_steps_through_the_snapshots():
    w = cache_blocks(STEPS, block_size=2, n_blocks=6, labels=["prefill", "fork, copy-on-write"], title="tiny")
    assert isinstance(w.controls["step"], widgets.SelectionSlider) and w.options[0] == [0, 1]
    assert w.controls["step"].index == 1 and w.stack.selected_index == 1, "opens on the busiest step"
    first, last = w.html_at(step=0), w.html_at(step=1)
    assert "step 0</b> · prefill · 2 of 6 blocks in use · 0 shared" in first
    assert "step 1</b> · fork, copy-on-write · 3 of 6 blocks in use · 1 shared" in last
    assert "L1 &rarr; P1" in first and "L1 &rarr; P0" in last, "each logical block names its physical block"
    assert "P4 A, B · ref 2" in last and "shared by 2 sequences" in last, "a shared block shows its users and ref count"
    assert "3px solid #000" in last and "3px solid #000" not in first, "shared blocks get a thick border"
    assert "P2 free" in first and FREE in first
    assert "␣score" in first, "token text shows its leading space"
    assert "</span>B</td>" not in first and "</span>B</td>" in last, "B has a row only once it exists"
    assert len(last) < 30_000


def test_html_is_escaped():
    w = cache_blocks([{"<seq>": ([0], ["<b>", "&"])}], block_size=2, n_blocks=2)
    html = w.html_at(step=0)
    assert "&lt;seq&gt;" in html and "&lt;b&gt;" in html and "<seq>" not in html


@pytest.mark.parametrize("snapshots, message", [
    ([], "non-empty list"),
    ({"A": ([0], ["x"])}, "non-empty list"),
    ([{"A": [0]}], r"must be a pair"),
    ([{"A": ([9], ["x"])}], r"block ids must be ints in 0..5"),
    ([{"A": ([0, 0], ["x", "y", "z"])}], "a block appears twice"),
    ([{"A": ([0, 1], ["x"])}], r"1 tokens in blocks of 2 need 1 blocks, the table has 2"),
    ([{"A": ([], ["x"])}], r"need 1 blocks, the table has 0"),
])
def test_bad_snapshots_say_what_is_wrong(snapshots, message):
    with pytest.raises(ValueError, match=message):
        cache_blocks(snapshots, block_size=2, n_blocks=6)


def test_bad_sizes_and_labels():
    with pytest.raises(ValueError, match="positive ints"):
        cache_blocks(STEPS, block_size=0, n_blocks=6)
    with pytest.raises(ValueError, match=r"one entry per snapshot \(2\), got 1"):
        cache_blocks(STEPS, block_size=2, n_blocks=6, labels=["only one"])
