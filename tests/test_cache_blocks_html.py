"""The cache-blocks widget replays in static HTML: execute, export, open offline, move the step slider.

A notebook draws two hand-made snapshots (a prompt, then a fork with copy-on-write) with
`cache_blocks`; exported with `course.static_html.export_html` and opened from file:// in headless
chromium (network aborted), the slider must change the drawing with no kernel behind it.
"""
from __future__ import annotations

import textwrap

import pytest

from browser import is_blank, open_page, widget_page

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CELL = textwrap.dedent("""\
    from course.widgets.cache_blocks import cache_blocks
    steps = [{"req 0": ([4, 1], ["Four", " score", " and"])},
             {"req 0": ([4, 1], ["Four", " score", " and", " seven"]),
              "req 1": ([4, 0], ["Four", " score", " and", " eight"])}]
    cache_blocks(steps, block_size=2, n_blocks=6, labels=["prefill", "fork and copy-on-write"], title="two steps")
""")


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    return widget_page(tmp_path_factory.mktemp("cache_blocks_html"), CELL)


def test_step_slider_replays_the_blocks_offline(page_file, tmp_path):
    with open_page(page_file) as view:
        out = view.page.locator(".jp-OutputArea-output").first
        out.locator("text=fork and copy-on-write").first.wait_for(timeout=30_000)
        text = out.inner_text()
        assert "3 of 6 blocks in use" in text and "1 shared" in text, "opens on the busiest step: the fork"
        assert "P4 req 0, req 1 · ref 2" in text, "the shared block names both users"

        handle = out.locator(".noUi-handle").first
        handle.press("Home")                                   # back to step 0: the prompt alone
        out.locator("text=2 of 6 blocks in use").first.wait_for(timeout=5_000)
        assert "req 1" not in out.inner_text(), "request 1 does not exist yet at step 0"
        handle.press("ArrowRight")
        out.locator("text=P4 req 0, req 1 · ref 2").first.wait_for(timeout=5_000)

        shot = tmp_path / "blocks.png"
        out.screenshot(path=str(shot))
    assert not is_blank(shot), "the screenshot is blank"
    view.assert_offline()
    view.assert_no_errors()
