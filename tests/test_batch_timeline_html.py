"""The batch timeline replays in static HTML: execute, export, open offline, move the step slider.

A notebook draws a hand-made static and continuous trace with `batch_timeline`; exported with
`course.static_html.export_html` and opened from file:// in headless chromium (network aborted),
the slider must change the drawing with no kernel behind it.
"""
from __future__ import annotations

import textwrap

import pytest

from browser import is_blank, open_page, widget_page

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CELL = textwrap.dedent("""\
    from course.widgets.batch_timeline import batch_timeline
    static = [{0: "prefill", 1: "prefill"}, {0: "decode", 1: "decode", 2: "waiting"},
              {0: "padding", 1: "decode", 2: "waiting"}, {2: "prefill"}, {2: "decode"}]
    continuous = [{0: "prefill", 1: "prefill"}, {0: "decode", 1: "decode", 2: "waiting"},
                  {1: "decode", 2: "prefill"}, {2: "decode"}]
    batch_timeline({"static": static, "continuous": continuous},
                   times={"static": [0.5, 0.7, 0.9, 1.4, 1.6]}, title="three requests")
""")


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    return widget_page(tmp_path_factory.mktemp("batch_timeline_html"), CELL)


def test_step_slider_replays_the_schedules_offline(page_file, tmp_path):
    with open_page(page_file) as view:
        out = view.page.locator(".jp-OutputArea-output").first
        out.locator("text=step 4: batch = [2], tokens this step = 1").wait_for(timeout=30_000)
        full_svg = out.locator("svg").first.inner_html()
        assert "3 steps · 0.90 s" in out.inner_text(), "latencies are shown once requests finish"

        handle = out.locator(".noUi-handle").first
        handle.press("Home")                                   # back to step 0: only the prefills
        out.locator("text=step 0: batch = [0, 1], tokens this step = 2").first.wait_for(timeout=5_000)
        assert out.locator("svg").first.inner_html() != full_svg, "the drawing must change with the slider"
        assert "3 steps · 0.90 s" not in out.inner_text(), "no latency before a request finishes"
        handle.press("ArrowRight")
        handle.press("ArrowRight")                             # step 2: request 0 pads in static, has left in continuous
        out.locator("text=step 2: batch = [1] + padding [0], tokens this step = 1, waiting = [2]").wait_for(timeout=5_000)
        out.locator("text=step 2: batch = [1, 2], tokens this step = 2").wait_for(timeout=5_000)

        shot = tmp_path / "timeline.png"
        out.screenshot(path=str(shot))
    assert not is_blank(shot), "the screenshot is blank"
    view.assert_offline()
    view.assert_no_errors()
