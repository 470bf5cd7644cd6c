"""The speculative decoding trace replays in static HTML: execute, export, open offline, move the controls.

A notebook draws two hand-made traces with `spec_trace`; exported with `course.static_html.export_html`
and opened from file:// in headless chromium (network aborted), the step slider and the run picker
must change the drawing with no kernel behind it.
"""
from __future__ import annotations

import textwrap

import pytest

from browser import is_blank, open_page, widget_page

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CELL = textwrap.dedent("""\
    from course.widgets import spec_trace
    words = {1: "The", 2: " cat", 3: " sat", 4: " on", 5: " the", 6: " mat", 7: " dog", 8: ".", 9: " ran"}
    spec_trace({"draft model": [([2, 3, 4], 3, 5), ([7, 9], 0, 6), ([], 0, 8)],
                "prompt lookup": [([], 0, 2), ([3], 1, 4)]},
               words.__getitem__, prompt="Once:")
""")


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    return widget_page(tmp_path_factory.mktemp("spec_trace_html"), CELL)


def test_slider_and_run_picker_replay_offline(page_file, tmp_path):
    with open_page(page_file) as view:
        out = view.page.locator(".jp-OutputArea-output").first
        out.locator("text=after 3 of 3 target passes").wait_for(timeout=30_000)
        assert "acceptance rate 75%" in out.inner_text()

        handle = out.locator(".noUi-handle").first
        handle.press("Home")                                   # back to pass 1: all drafts accepted, a bonus
        out.locator("text=after 1 of 3 target passes").first.wait_for(timeout=5_000)
        assert "acceptance rate 100%" in out.inner_text()
        handle.press("ArrowRight")                             # pass 2: ' dog' rejected
        out.locator("text=after 2 of 3 target passes").first.wait_for(timeout=5_000)
        assert "␣dog" in out.inner_text()

        out.locator("button", has_text="prompt lookup").click()
        out.locator("text=after 2 of 2 target passes").first.wait_for(timeout=5_000)
        assert "1 of 1 drafts accepted" in out.inner_text()

        shot = tmp_path / "trace.png"
        out.screenshot(path=str(shot))
    assert not is_blank(shot), "the screenshot is blank"
    view.assert_offline()
    view.assert_no_errors()
