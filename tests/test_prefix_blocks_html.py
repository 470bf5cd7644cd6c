"""The prefix-blocks widget replays in static HTML: execute, export, open offline, move the step slider.

A notebook draws three hand-made steps (a request computes its blocks, a second one reuses two of
them, then only cached blocks remain) with `prefix_blocks`; exported with
`course.static_html.export_html` and opened from file:// in headless chromium (network aborted), the
slider must change the drawing with no kernel behind it.
"""
from __future__ import annotations

import textwrap

import pytest

from browser import is_blank, open_page, widget_page

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CELL = textwrap.dedent("""\
    from course.widgets import prefix_blocks
    steps = [{"requests": {"req 0": ([3, 1, 4], ["You", " are", " kind", " .", "!"], 0)}, "cached": []},
             {"requests": {"req 1": ([3, 1, 0], ["You", " are", " kind", " .", "?"], 2)}, "cached": [4]},
             {"requests": {}, "cached": [4, 0, 1, 3]}]
    prefix_blocks(steps, block_size=2, n_blocks=6, labels=["req 0 computes", "req 1 reuses", "all done"], title="three steps")
""")


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    return widget_page(tmp_path_factory.mktemp("prefix_blocks_html"), CELL)


def test_step_slider_replays_the_cache_offline(page_file, tmp_path):
    with open_page(page_file) as view:
        out = view.page.locator(".jp-OutputArea-output").first
        out.locator("text=req 0 computes").first.wait_for(timeout=30_000)
        text = out.inner_text()
        assert "0 of 5 tokens came from the cache" in text, "opens on the first step"
        assert "P2 empty" in text

        handle = out.locator(".noUi-handle").first
        handle.press("ArrowRight")                              # step 1: req 1 reuses blocks 3 and 1
        out.locator("text=4 of 5 tokens came from the cache").first.wait_for(timeout=5_000)
        assert "P4 · LRU 1" in out.inner_text(), "req 0's partial block waits in the LRU queue"
        shot = tmp_path / "prefix.png"
        out.screenshot(path=str(shot))
        handle.press("End")                                     # step 2: nothing running, all cached
        out.locator("text=no running requests").first.wait_for(timeout=5_000)
        assert "P3 · LRU 4" in out.inner_text()
    assert not is_blank(shot), "the screenshot is blank"
    view.assert_offline()
    view.assert_no_errors()
