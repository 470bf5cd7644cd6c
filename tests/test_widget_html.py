"""The proof that widgets survive static HTML: execute, export, open offline, move a control.

A notebook is executed with a real kernel (nbclient saves the widget state), exported with
`course.static_html.export_html`, and opened from file:// in headless chromium with every
network request aborted. The drawing must change when a control moves, with no kernel behind it.
"""
from __future__ import annotations

import math
import re
import textwrap

import nbformat
import pytest

from browser import is_blank, open_page, widget_page

pytestmark = [pytest.mark.browser, pytest.mark.slow]

LOGITS = [4.0, 3.2, 2.5, 1.0, 0.3]
TOKEN_CELL = textwrap.dedent(f"""\
    import math
    from course.widgets import next_token_explorer
    LOGITS = {LOGITS}
    WORDS = [' the', ' a', '\\n', 'cat', '<b>']
    def table(t):
        z = sum(math.exp(x / t) for x in LOGITS)
        return [(w, math.exp(x / t) / z) for w, x in zip(WORDS, LOGITS)]
    next_token_explorer(table, temperatures=(0.1, 0.3, 1.0, 2.0), prompt='Once upon a')
""")
GRID_CELL = textwrap.dedent("""\
    from course.widgets import explorer
    explorer(lambda step, policy: f'<p class="probe">step {step} / {policy}</p>',
             {"step": [0, 1, 2, 3], "policy": ["fcfs", "sjf"]}, title="two controls")
""")
PROB = re.compile(r"\b[01]\.\d{3}\b")


def probabilities(t: float) -> list[str]:
    z = sum(math.exp(x / t) for x in LOGITS)
    return [f"{math.exp(x / t) / z:.3f}" for x in LOGITS]


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    """An executed notebook with two widgets, exported to static HTML."""
    return widget_page(tmp_path_factory.mktemp("widget_html"),
                       nbformat.v4.new_markdown_cell("# Widgets offline\nSoftmax with temperature: $p_i \\propto e^{z_i/T}$."),
                       TOKEN_CELL, GRID_CELL)


def test_widgets_work_offline_in_static_html(page_file, tmp_path):
    with open_page(page_file) as view:
        page = view.page
        outputs = page.locator(".jp-OutputArea-output")
        token, grid = outputs.nth(0), outputs.nth(1)
        token.locator("text=top-5 hold").wait_for(timeout=30_000)

        # the widget opens at temperature 1.0, drawn exactly as Python computed it
        assert PROB.findall(token.inner_text()) == probabilities(1.0)

        # move the slider one step with the keyboard: the front-end link switches the state
        token.locator(".noUi-handle").first.press("ArrowRight")
        token.locator("text=(temperature 2)").wait_for(timeout=5_000)
        assert PROB.findall(token.inner_text()) == probabilities(2.0)
        assert "2" in token.locator(".widget-readout").first.inner_text()
        token.locator(".noUi-handle").first.press("Home")
        token.locator("text=(temperature 0.1)").wait_for(timeout=5_000)
        assert PROB.findall(token.inner_text()) == probabilities(0.1)

        # two controls, nested stacks: both links must work, in any order
        assert grid.locator(".probe").inner_text() == "step 0 / fcfs"
        grid.locator("button", has_text="sjf").click()
        grid.locator("text=step 0 / sjf").wait_for(timeout=5_000)
        grid.locator(".noUi-handle").first.press("End")
        grid.locator("text=step 3 / sjf").wait_for(timeout=5_000)
        grid.locator("button", has_text="fcfs").click()
        grid.locator("text=step 3 / fcfs").wait_for(timeout=5_000)

        # maths was typeset by the vendored MathJax
        assert page.locator("mjx-container").count() >= 1

        shot = tmp_path / "page.png"
        page.screenshot(path=str(shot), full_page=True)
    assert not is_blank(shot), "the screenshot is blank"
    view.assert_offline()
    view.assert_no_errors()
    assert any(u.endswith("/_vendor/html-manager/embed-amd.js") for u in view.requests)
