"""The constrained-generation trace replays in static HTML: execute, export, open offline, move the slider.

A notebook draws a hand-made trace with `grammar_trace`; exported with `course.static_html.export_html`
and opened from file:// in headless chromium (network aborted), the step slider must change the
drawing with no kernel behind it.
"""
from __future__ import annotations

import textwrap

import pytest

from browser import is_blank, open_page, widget_page

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CELL = textwrap.dedent("""\
    from course.widgets import grammar_trace
    words = {1: '{"', 2: "name", 3: '":', 4: ' "', 5: "Ada", 6: '"}', 8: " Bob"}
    grammar_trace([{"state": 0, "allowed": 2, "token": 1, "wanted": None},
                   {"state": 2, "allowed": 4, "token": 2, "wanted": None},
                   {"state": 6, "allowed": 29, "token": 4, "wanted": 4, "kept": [4, 5]},
                   {"state": 10, "allowed": 48000, "token": 5, "wanted": 8, "kept": [5, 8, 6]}],
                  words.__getitem__, prompt="Ada:")
""")


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    return widget_page(tmp_path_factory.mktemp("grammar_trace_html"), CELL)


def test_slider_replays_offline(page_file, tmp_path):
    with open_page(page_file) as view:
        out = view.page.locator(".jp-OutputArea-output").first
        out.locator("text=token 4 of 4").first.wait_for(timeout=30_000)
        assert "overruled the model 1 time" in out.inner_text()

        handle = out.locator(".noUi-handle").first
        handle.press("Home")                                   # back to token 1: written by jump-forward
        out.locator("text=token 1 of 4").first.wait_for(timeout=5_000)
        assert "no model step" in out.inner_text()
        handle.press("ArrowRight")
        handle.press("ArrowRight")                             # token 3: the model's own choice
        out.locator("text=token 3 of 4").first.wait_for(timeout=5_000)
        assert "1 model steps" in out.inner_text()

        shot = tmp_path / "trace.png"
        out.screenshot(path=str(shot))
    assert not is_blank(shot), "the screenshot is blank"
    view.assert_offline()
    view.assert_no_errors()
