"""The prefix-blocks widget (lab 09) without a browser: reuse counts, drawing per step, bad input."""
import ipywidgets as widgets
import pytest

from course.widgets.prefix_blocks import COMPUTED, EVICTABLE, HIT, check_step, prefix_blocks, reuse

# block_size 2. Step 0: req 0 computed "You are kind ." in blocks 3, 1, 4 (the last one partial).
# Step 1: req 0 left (blocks 3 and 1 stay cached, LRU order 4, 1, 3); req 1 reuses blocks 3 and 1.
STEPS = [
    {"requests": {"req 0": ([3, 1, 4], ["You", " are", " kind", " .", "!"], 0)}, "cached": []},
    {"requests": {"req 1": ([3, 1, 0], ["You", " are", " kind", " .", "?"], 2)}, "cached": [4]},
    {"requests": {}, "cached": [4, 0, 1, 3]},
]


def test_reuse_counts_cached_tokens():
    assert reuse(STEPS[0], 2) == (0, 5)
    assert reuse(STEPS[1], 2) == (4, 5), "two blocks of 2 came from the cache"
    assert reuse(STEPS[2], 2) == (0, 0)


def test_widget_draws_hits_and_the_lru_queue():
    w = prefix_blocks(STEPS, block_size=2, n_blocks=6, labels=["req 0 computed", "req 1 reused", "all done"], title="t")
    assert isinstance(w.controls["step"], widgets.SelectionSlider) and w.options[0] == [0, 1, 2]
    first, second, last = (w.html_at(step=s) for s in range(3))
    assert "step 0</b> · req 0 computed · 3 of 6 blocks in use · 0 shared · 0 cached and evictable · " \
           "0 of 5 tokens came from the cache" in first
    assert "step 1</b> · req 1 reused · 3 of 6 blocks in use · 0 shared · 1 cached and evictable · " \
           "4 of 5 tokens came from the cache" in second
    assert "L0 &rarr; P3 · hit" in second and "L2 &rarr; P0 · hit" not in second, "only the first 2 blocks are hits"
    assert "L0 &rarr; P3 · hit" not in first and f"background:{HIT}55" not in first.split("Each request")[1]
    assert f"background:{COMPUTED}33" in first, "computed blocks are blue"
    assert "1px dashed #333" in first, "the partial last block has a dashed border"
    assert "P4 · LRU 1" in second and f"background:{EVICTABLE}" in second, "evictable blocks show their LRU rank"
    assert "P4 · LRU 1" in last and "P3 · LRU 4" in last and "no running requests" in last
    assert "P2 empty" in first and "P3 · ref 1" in first
    assert "␣are" in first, "token text shows its leading space"
    assert "4 of 5 cached" in second


def test_shared_blocks_show_their_reference_count():
    step = {"requests": {"a": ([0, 1], ["x", "y", "z"], 1), "b": ([0, 2], ["x", "y", "w"], 1)}, "cached": []}
    html = prefix_blocks([step], block_size=2, n_blocks=3).html_at(step=0)
    assert "P0 · ref 2" in html and "3px solid #000" in html and "1 shared" in html
    assert "shared by 2 requests" in html


def test_html_is_escaped():
    html = prefix_blocks([{"requests": {"<r>": ([0], ["<b>", "&"], 1)}, "cached": []}], 2, 2).html_at(step=0)
    assert "&lt;r&gt;" in html and "&lt;b&gt;" in html and "<r>" not in html


@pytest.mark.parametrize("step, message", [
    ({"requests": {}}, "keys 'requests' and 'cached'"),
    ({"requests": [], "cached": []}, "must be a dict of name"),
    ({"requests": {"a": ([0], ["x"])}, "cached": []}, "must be a triple"),
    ({"requests": {"a": ([0], ["x"], 1)}, "cached": []}, r"cached blocks must be an int from 0 to the number of full blocks \(0\)"),
    ({"requests": {"a": ([0, 1], ["x", "y", "z"], -1)}, "cached": []}, "got -1"),
    ({"requests": {"a": ([9], ["x"], 0)}, "cached": []}, r"block ids must be ints in 0..5"),
    ({"requests": {"a": ([0, 1], ["x"], 0)}, "cached": []}, "need 1 blocks, the table has 2"),
    ({"requests": {"a": ([0], ["x"], 0)}, "cached": [0]}, "an evictable block has no user"),
    ({"requests": {}, "cached": [1, 1]}, "lists a block twice"),
    ({"requests": {}, "cached": [7]}, r"ints in 0..5"),
    ({"requests": {}, "cached": "12"}, "must be a list of block ids"),
])
def test_bad_steps_say_what_is_wrong(step, message):
    with pytest.raises(ValueError, match=message):
        check_step(step, block_size=2, n_blocks=6)
    with pytest.raises(ValueError, match=message):
        prefix_blocks([step], block_size=2, n_blocks=6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="non-empty list"):
        prefix_blocks([], block_size=2, n_blocks=6)
    with pytest.raises(ValueError, match="non-empty list"):
        prefix_blocks(STEPS[0], block_size=2, n_blocks=6)
    with pytest.raises(ValueError, match="positive ints"):
        prefix_blocks(STEPS, block_size=0, n_blocks=6)
    with pytest.raises(ValueError, match=r"one entry per step \(3\), got 1"):
        prefix_blocks(STEPS, block_size=2, n_blocks=6, labels=["x"])
