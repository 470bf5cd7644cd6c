"""The window-blocks widget replays in static HTML: execute, export, open offline, move the step slider.

A notebook draws two snapshots of a window and a window with a sink block (before and after the
first eviction) with `window_blocks`; exported with `course.static_html.export_html` and opened from
file:// in headless chromium (network aborted), the slider must change the drawing with no kernel.
"""
from __future__ import annotations

import textwrap

import pytest

from browser import is_blank, open_page, widget_page

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CELL = textwrap.dedent("""\
    from course.widgets.window_blocks import window_blocks
    toks = ["The", " keeper", " lit", " the", " lamp", " again"]
    steps = [{"window": ([3, 1, 4], toks[:5], 0), "window + sinks": ([2, 0, 5], toks[:5], 1)},
             {"window": ([None, 1, 4], toks, 0), "window + sinks": ([2, None, 5], toks, 1)}]
    window_blocks(steps, block_size=2, labels=["before eviction", "after the first eviction"], title="two steps")
""")


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    return widget_page(tmp_path_factory.mktemp("window_blocks_html"), CELL)


def test_step_slider_replays_the_evictions_offline(page_file, tmp_path):
    with open_page(page_file) as view:
        out = view.page.locator(".jp-OutputArea-output").first
        out.locator("text=after the first eviction").first.wait_for(timeout=30_000)
        text = out.inner_text()
        assert "L0 evicted" in text and "L1 evicted" in text, "opens on the last step: both rows have evicted a block"
        assert "evicted: 1 block" in text

        handle = out.locator(".noUi-handle").first
        handle.press("Home")                                   # back to step 0: nothing evicted yet
        out.locator("text=before eviction").first.wait_for(timeout=5_000)
        text = out.inner_text()
        assert "L0 evicted" not in text and "L1 evicted" not in text, "nothing is evicted at step 0"
        handle.press("ArrowRight")
        out.locator("text=L0 evicted").first.wait_for(timeout=5_000)

        shot = tmp_path / "window.png"
        out.screenshot(path=str(shot))
    assert not is_blank(shot), "the screenshot is blank"
    view.assert_offline()
    view.assert_no_errors()
